"""The configuration reference lists every setting of every part."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.agent.runtime import AgentSettings
from sluice.client import ClientSettings
from sluice.dispatcher.runtime import DispatcherSettings
from sluice.gateway import ApiKey, GatewaySettings

DOC = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()


@pytest.mark.parametrize(
    "cls", [DispatcherSettings, AgentSettings, ClientSettings, GatewaySettings, ApiKey]
)
def test_every_setting_is_documented(cls: type) -> None:
    missing = [name for name in cls.model_fields if f"`{name}`" not in DOC]
    assert not missing, f"{cls.__name__} settings missing from docs/configuration.md: {missing}"

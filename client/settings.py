"""The client's settings (``SLUICE_CLIENT_…``, ``SLUICE_NATS_URL``): used by ``sluice submit``
and by ``Client.from_settings``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from sluice.common.settings import BrokerSettings

DEFAULT_PUBLISH_TIMEOUT_S = 5.0
"""How long one submit publish waits for the broker's acknowledgement."""
DEFAULT_PUBLISH_RETRY_S = 15.0
"""How long a submit keeps publishing again (same ``Nats-Msg-Id``) after a timeout, a
no-responders answer or a 503 while a stream leader moves: longer than a JetStream leader
election after a node dies (NATS's Raft waits 4 to 9 s before it elects a new leader)."""


class ClientSettings(BrokerSettings):
    """Settings of a producer."""

    model_config = SettingsConfigDict(
        env_prefix="SLUICE_CLIENT_", extra="forbid", populate_by_name=True
    )
    toml_section: ClassVar[str] = "client"

    tenant: str = Field(default="default", min_length=1, description="Tenant of submissions.")
    band: str = Field(default="standard", min_length=1, description="Default priority band.")
    publish_timeout_s: float = Field(
        default=DEFAULT_PUBLISH_TIMEOUT_S,
        gt=0,
        description="How long one submit publish waits for the broker's acknowledgement.",
    )
    publish_retry_s: float = Field(
        default=DEFAULT_PUBLISH_RETRY_S,
        ge=0,
        description="How long a submit publishes again (same message id) after a timeout or "
        "a leader change before it raises ServiceUnavailable (0: no retry).",
    )
    tokenizer: str | None = Field(
        default=None,
        description="A local tokenizer.json: text prompts are sent as the engine's token ids.",
    )
    chat_template: str | None = Field(
        default=None,
        description="The model's chat template, for a batch's chat lines: its "
        "tokenizer_config.json, or a .jinja file (none: Sluice's neutral template).",
    )
    queue_full_retry_after_s: float = Field(
        default=1.0, ge=0, description="Retry-after hint when a queue is full and none is known."
    )

"""Wiring the simulated engine into agents (the face's job: the agent never imports the
simulator)."""

from __future__ import annotations

from sluice.agent.runtime import AgentSettings
from sluice.common.errors import ConfigError
from sluice.schemas.hashing import index_stride
from sluice.sim.engine import SimEngine
from sluice.sim.profiles import get_profile


def simulated_engine(settings: AgentSettings) -> SimEngine:
    """The in-process simulated engine an agent with ``settings`` drives: its profile, and
    digests journalled as the agent reports them. Raises ``ConfigError`` for an unknown
    profile."""
    try:
        profile = get_profile(settings.profile)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    return SimEngine(
        profile,
        digest_min_tokens=settings.digest_min_prefix_tokens,
        digest_stride=index_stride(profile.block_tokens, settings.digest_index_tokens),
    )

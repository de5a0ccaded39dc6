"""Wiring the simulated engine into agents (the face's job: the agent never imports the
simulator)."""

from __future__ import annotations

from sluice.agent.engine import Engine
from sluice.agent.runtime import AgentSettings
from sluice.agent.runtime.httpengine import HttpEngine, HttpEngineConfig
from sluice.common.errors import ConfigError
from sluice.schemas.hashing import DEFAULT_BLOCK_TOKENS, index_stride
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


def build_engine(settings: AgentSettings) -> Engine:
    """The engine an agent with ``settings`` drives: the simulated engine in process, or an
    OpenAI-compatible server (``engine = "openai-http"``)."""
    if settings.engine == "sim":
        return simulated_engine(settings)
    assert settings.engine_url is not None  # the settings validate it
    return HttpEngine(
        HttpEngineConfig(
            url=settings.engine_url,
            model=settings.engine_model or settings.models[0],
            connect_timeout_s=settings.engine_connect_timeout_s,
            first_token_timeout_s=settings.engine_first_token_timeout_s,
            token_timeout_s=settings.engine_token_timeout_s,
            health_every_s=settings.engine_health_every_s,
            metrics_path=settings.engine_metrics_path,
            metrics_url=settings.engine_metrics_url,
            metrics_every_s=settings.engine_metrics_every_s,
            metrics_stale_s=settings.engine_metrics_stale_s,
            kv_events=settings.engine_kv_events,
            kv_replay=settings.engine_kv_replay,
            kv_topic=settings.engine_kv_topic,
            kv_bind=settings.engine_kv_bind,
            digest_min_tokens=settings.digest_min_prefix_tokens,
            block_tokens=DEFAULT_BLOCK_TOKENS,
            stride=index_stride(DEFAULT_BLOCK_TOKENS, settings.digest_index_tokens),
            max_blocks=settings.engine_record_max_blocks,
            kv_max_blocks=settings.engine_kv_max_blocks,
            # Half its coalescing: a later token waits at most 1.5 times that to go out.
            poll_s=max(HttpEngineConfig.poll_s, settings.token_flush_ms / 2000),
        )
    )

"""The agent's settings: ``SLUICE_AGENT_…`` variables or the ``[agent]`` table of the config
file (``SLUICE_NATS_URL`` for the broker). Read once per process."""

from __future__ import annotations

import os
import socket
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from sluice.agent.defaults import KV_MAX_BLOCKS, RECORD_MAX_BLOCKS, TOKEN_FLUSH_MS
from sluice.agent.errors import KVEventError
from sluice.agent.kvevents import replay_endpoint
from sluice.agent.outbox import DEFAULT_MAX_REPORTS
from sluice.agent.reports import (
    DEFAULT_DIGEST_MAX_BLOCKS,
    DEFAULT_DIGEST_MIN_TOKENS,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_SNAPSHOT_EVERY,
)
from sluice.common.settings import BrokerSettings
from sluice.schemas.hashing import DEFAULT_INDEX_TOKENS


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class AgentSettings(BrokerSettings):
    """Settings of one agent (one GPU engine)."""

    model_config = SettingsConfigDict(
        env_prefix="SLUICE_AGENT_", extra="forbid", populate_by_name=True
    )
    toml_section: ClassVar[str] = "agent"

    worker_id: str = Field(
        default_factory=_default_worker_id,
        min_length=1,
        max_length=64,
        description="This worker's name, unique in the fleet (default: host-pid).",
    )
    models: list[str] = Field(default=["sim"], min_length=1, description="Models it serves.")
    capacity: int = Field(default=32, ge=1, description="Requests it takes at once.")
    profile: str = Field(
        default="reference", min_length=1, description="Profile of the simulated engine."
    )
    speed: float = Field(
        default=1.0, gt=0, description="Simulated time runs this many times faster than real."
    )
    engine: Literal["sim", "openai-http"] = Field(
        default="sim",
        description="The engine: sim (in process) or openai-http (an OpenAI-compatible server).",
    )
    engine_url: str | None = Field(
        default=None,
        description="openai-http: http://host:port or unix:///path/to.sock of the engine.",
    )
    engine_model: str | None = Field(
        default=None, description="openai-http: the model name to ask for (default: models[0])."
    )
    engine_connect_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="openai-http: connecting to the engine; a health check or scrape at most.",
    )
    engine_first_token_timeout_s: float = Field(
        default=60.0, gt=0, description="openai-http: from the request to its first token."
    )
    engine_token_timeout_s: float = Field(
        default=30.0, gt=0, description="openai-http: between two tokens of a stream."
    )
    engine_health_every_s: float = Field(
        default=1.0, gt=0, description="openai-http: seconds between health checks."
    )
    engine_metrics_path: str | None = Field(
        default="/metrics",
        description="openai-http: the engine's Prometheus endpoint on its server (null: off).",
    )
    engine_metrics_url: str | None = Field(
        default=None,
        description="openai-http: http://host:port/path of its metrics when not on its server.",
    )
    engine_metrics_every_s: float = Field(
        default=1.0, gt=0, description="openai-http: seconds between scrapes (jittered)."
    )
    engine_kv_events: str | None = Field(
        default=None,
        description="openai-http: tcp://host:port or ipc:///path of its KV events (vLLM).",
    )
    engine_kv_replay: str | None = Field(
        default=None,
        description="openai-http: its replay socket (default: port + 1, or PATH.replay).",
    )
    engine_kv_topic: str = Field(
        default="",
        description=(
            "openai-http: the topic of its KV events to follow (the publisher's `topic` in "
            "vLLM's kv-events-config); empty: every topic on the socket."
        ),
    )
    engine_kv_bind: bool = Field(
        default=False,
        description=(
            "openai-http: bind engine_kv_events and let the engine connect to it (vLLM and "
            "SGLang connect to an endpoint that is neither ipc:// nor a wildcard, such as "
            "tcp://127.0.0.1:5557); false: connect to the engine's socket."
        ),
    )
    engine_metrics_stale_s: float = Field(
        default=5.0, gt=0, description="openai-http: older metrics count as a saturated engine."
    )
    engine_record_max_blocks: int = Field(
        default=RECORD_MAX_BLOCKS,
        ge=1,
        description="openai-http: block hashes its record of served prompts keeps at most.",
    )
    engine_kv_max_blocks: int = Field(
        default=KV_MAX_BLOCKS,
        ge=1,
        description="openai-http: engine KV blocks mirrored from its KV events at most.",
    )
    tokenizer: str | None = Field(
        default=None,
        description="A local tokenizer.json: text prompts are hashed (and sent) as token ids.",
    )
    heartbeat_s: float = Field(
        default=DEFAULT_HEARTBEAT_S, gt=0, description="Seconds between heartbeats."
    )
    token_flush_ms: float = Field(
        default=TOKEN_FLUSH_MS, ge=0, description="Coalesce streamed tokens for up to this long."
    )
    token_flush_tokens: int = Field(
        default=16, ge=1, description="...or until this many tokens are buffered."
    )
    digest_min_prefix_tokens: int = Field(
        default=DEFAULT_DIGEST_MIN_TOKENS,
        ge=1,
        description="Report cached prompts at least this long in digests.",
    )
    digest_snapshot_every: int = Field(
        default=DEFAULT_SNAPSHOT_EVERY,
        ge=1,
        description="Every this many heartbeats, send a full cache snapshot.",
    )
    digest_index_tokens: int = Field(
        default=DEFAULT_INDEX_TOKENS,
        ge=1,
        description="Prompt tokens per reported block (the dispatcher's routing_index_tokens).",
    )
    digest_max_blocks: int = Field(
        default=DEFAULT_DIGEST_MAX_BLOCKS,
        ge=1,
        description="Block hashes per cache digest at most.",
    )
    outbox_max_reports: int = Field(
        default=DEFAULT_MAX_REPORTS,
        ge=1,
        description="Undelivered reports before the agent refuses new work (none is dropped).",
    )
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="On shutdown, wait this long for running requests."
    )
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Serve /metrics, /healthz and /readyz here (0: off)."
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Bind address of the metrics port (0.0.0.0 in a container).",
    )

    @field_validator("worker_id")
    @classmethod
    def _safe_id(cls, v: str) -> str:
        if any(c in v for c in ".*> \t\n"):
            raise ValueError("worker_id may not contain '.', '*', '>' or whitespace")
        return v

    @model_validator(mode="after")
    def _engine_needs_url(self) -> AgentSettings:
        if self.engine == "openai-http":
            url = self.engine_url or ""
            if not url.startswith(("http://", "https://", "unix://")):
                raise ValueError(
                    "engine openai-http needs engine_url: http://host:port or unix:///path"
                )
            if self.engine_kv_events is not None:
                try:
                    replay_endpoint(self.engine_kv_events)
                except KVEventError as exc:
                    raise ValueError(str(exc)) from None
                if self.engine_kv_bind and not _engine_connects(self.engine_kv_events):
                    # (An ipc:// bind even succeeds: it takes the engine's path over, and
                    # neither hears the other.)
                    raise ValueError(
                        f"engine_kv_bind: the engine binds {self.engine_kv_events} itself "
                        "(vLLM and SGLang bind an ipc:// endpoint or one with '*' or '::'); "
                        "connect to it instead (leave engine_kv_bind false)"
                    )
            murl = self.engine_metrics_url
            if murl is not None and not murl.startswith(("http://", "https://")):
                raise ValueError("engine_metrics_url must be http://host:port/path")
            if self.speed != 1.0:
                raise ValueError("speed applies to the simulated engine only (leave it at 1)")
        return self


def _engine_connects(endpoint: str) -> bool:
    """Whether vLLM's and SGLang's KV event publishers connect to ``endpoint`` rather than bind
    it: they bind an ``ipc://`` or ``inproc://`` endpoint and one with ``*`` or ``::``."""
    return endpoint.startswith("tcp://") and "*" not in endpoint and "::" not in endpoint

"""The dispatcher's settings: ``SLUICE_DISPATCHER_…`` variables or the ``[dispatcher]`` table
of the config file (``SLUICE_NATS_URL`` for the broker). Read once per process."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from sluice.common.settings import BrokerSettings
from sluice.dispatcher.admission import DEFAULT_BAND_DELAY_S, AdmissionConfig
from sluice.dispatcher.cacheaware import CacheAwareConfig
from sluice.dispatcher.decisions import DEFAULT_MAX_BYTES
from sluice.dispatcher.defaults import (
    CANCELLED_MAX_IDS,
    FEEDBACK_WINDOW_S,
    KEPT_ADVISORIES_MAX,
    REMOVED_WORKERS_MAX,
    SCALE_DOWN_IDLE_S,
    SCALE_UP_SUSTAIN_S,
    SCALE_UP_WAIT_S,
)
from sluice.dispatcher.enginetime import (
    DEFAULT_DECODE_TOKEN_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    EngineTimeConfig,
)
from sluice.dispatcher.quotas import ModelQuota, Quotas
from sluice.schemas.hashing import DEFAULT_BLOCK_TOKENS
from sluice.schemas.models import AdmissionOverrides, QuotaSpec
from sluice.schemas.names import DEFAULT_BANDS

_A = AdmissionConfig()
_R = CacheAwareConfig()
"""The core's defaults: every setting below that maps onto them takes its default from them."""


def model_quota(spec: QuotaSpec) -> ModelQuota:
    """The pure quota an operator's spec describes."""
    return ModelQuota(
        limit=spec.limit,
        band_limits=dict(spec.band_limits),
        tenant_limits=dict(spec.tenant_limits),
        default_tenant_limit=spec.default_tenant_limit,
        unit=spec.unit,
    )


class DispatcherSettings(BrokerSettings):
    """Settings of one dispatcher."""

    model_config = SettingsConfigDict(
        env_prefix="SLUICE_DISPATCHER_", extra="forbid", populate_by_name=True
    )
    toml_section: ClassVar[str] = "dispatcher"

    dispatcher_id: str = Field(
        default_factory=lambda: f"dispatcher-{socket.gethostname()}-{os.getpid()}",
        min_length=1,
        description="This dispatcher's name (in logs and assignments).",
    )
    bands: list[str] = Field(
        default=list(DEFAULT_BANDS), min_length=1, description="Priority bands, most urgent first."
    )
    global_limit: int = Field(
        default=_A.global_limit, ge=1, description="Requests running at once, fleet-wide."
    )
    band_limits: dict[str, int] = Field(
        default_factory=dict, description="Per-band concurrency caps (default: the global limit)."
    )
    band_shares: dict[str, int] = Field(
        default_factory=dict,
        description="Per band: the share it keeps while a more urgent band waits (borrowing).",
    )
    band_floors: dict[str, float] | None = Field(
        default=None,
        description=(
            "Per offline band: its engine-time share of the fleet, always (a fraction); it "
            "borrows idle capacity only while no more urgent band waits. Unset: batch 0.03."
        ),
    )
    idle_headroom: float = Field(
        default=_A.idle_headroom,
        ge=0,
        lt=1,
        description="Share of the fleet offline bands never borrow (room for online bursts).",
    )
    demand_window_s: float = Field(
        default=_A.demand_window_s,
        gt=0,
        description="Window of the online demand that idle capacity is measured against.",
    )
    burst_s: float = Field(
        default=_A.burst_s,
        gt=0,
        description="Seconds of its rate an offline band's floor or idle budget holds at most.",
    )
    engine_prefill_tokens_per_s: float = Field(
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        gt=0,
        description="Engine time: the engines' prefill speed (uncached tokens per second).",
    )
    engine_decode_token_s: float = Field(
        default=DEFAULT_DECODE_TOKEN_S,
        gt=0,
        description="Engine time: what one more output token costs a well-batched engine.",
    )
    band_delay_s: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_BAND_DELAY_S),
        description="Aging delay per band: a request's virtual deadline is arrival + delay.",
    )
    queue_max_msgs: int = Field(
        default=10_000,
        ge=1,
        description="Queued requests per band before submit fails with QueueFull.",
    )
    band_queue_max_msgs: dict[str, int] = Field(
        default_factory=lambda: {"batch": 100_000},
        description=(
            "Per band: its own queue_max_msgs (the offline backlog: batch keeps 100,000 "
            "durable requests before QueueFull)."
        ),
    )
    queue_max_wait_s: dict[str, float] = Field(
        default_factory=dict,
        description="Per band: size its queue bound as this many seconds of its admission rate.",
    )
    queue_min_msgs: int = Field(
        default=16, ge=1, description="The smallest bound a wait-sized queue gets."
    )
    tenant_queue_max_msgs: int | None = Field(
        default=None,
        ge=1,
        description="Requests per band, model and tenant (queued + running) before QueueFull.",
    )
    max_buffered: int = Field(
        default=2_000, ge=1, description="Requests per band pulled into the dispatcher at most."
    )
    models: list[str] = Field(
        default_factory=list,
        description="Models served; empty: learn them from the workers' heartbeats.",
    )
    model_grace_s: float | None = Field(
        default=None,
        ge=0,
        description="Discovery (models empty): how long an unannounced model waits (one lease).",
    )
    tokenizer: str | None = Field(
        default=None,
        description="A local tokenizer.json for text prompts of every model (off: byte blocks).",
    )
    model_tokenizers: dict[str, str] = Field(
        default_factory=dict, description="Per model: its tokenizer.json (over tokenizer)."
    )
    quotas: dict[str, QuotaSpec] = Field(
        default_factory=dict,
        description="Per model: limit, band_limits, tenant_limits, default_tenant_limit, unit.",
    )
    default_quota: QuotaSpec = Field(
        default_factory=QuotaSpec, description="The quota of models not in quotas."
    )
    max_prompt_tokens: int = Field(
        default=_A.max_prompt_tokens, ge=1, description="Longest prompt accepted."
    )
    max_attempts: int = Field(
        default=_A.max_attempts, ge=1, description="Runs of a request before giving up."
    )
    lease_s: float = Field(
        default=4.0, gt=0, description="A worker silent this long is dead (3-5 heartbeats)."
    )
    reconcile_every_s: float = Field(
        default=60.0, gt=0, description="How often the books are reconciled with the reports."
    )
    reconcile_grace_s: float | None = Field(
        default=None,
        gt=0,
        description="A booking its worker's reports miss this long is orphaned (default 2 leases).",
    )
    reconcile_warn_drift: int = Field(
        default=10, ge=0, description="A reconciliation that corrects more than this warns."
    )
    learn_s: float | None = Field(
        default=None,
        ge=0,
        description="After start, only learn from heartbeats this long (default: one lease).",
    )
    leader_lease_s: float = Field(
        default=3.0,
        gt=0,
        description=(
            "Leadership lease: the leader renews it every third; a standby takes over once it "
            "went unrenewed this long."
        ),
    )
    leader_settle_s: float = Field(
        default=1.0,
        ge=0,
        description=(
            "A new leader listens this long (at most learn_s) before it dispatches: one agent "
            "heartbeat, so it adopts what its predecessor handed off last."
        ),
    )
    handoff_timeout_s: float = Field(
        default=2.0, gt=0, description="How long a worker has to confirm an assignment."
    )
    ack_wait_s: float | None = Field(
        default=None,
        gt=0,
        description=(
            "JetStream ack wait of requests: a dead leader's requests return to the next one "
            "after this (default: leader_lease_s)."
        ),
    )
    max_deliver: int = Field(
        default=10, ge=2, description="Deliveries of a request before it goes to dead letters."
    )
    max_renewals: int = Field(
        default=10,
        ge=0,
        description=(
            "Times the leader may renew a held request's deliveries (every leader change "
            "spends one): a request survives about max_deliver / 2 leader changes more each "
            "time; 0 dead-letters one after max_deliver leader changes."
        ),
    )
    stream_replicas: int = Field(
        default=1, ge=1, le=5, description="JetStream replicas of every stream (3 in a cluster)."
    )
    result_ttl_s: float = Field(
        default=26 * 3600.0,
        gt=0,
        description="How long results are kept (a batch's window must end 1 h before).",
    )
    duplicate_window_s: float = Field(
        default=120.0, gt=0, description="Request-id deduplication window of the streams."
    )
    cancelled_max_ids: int = Field(
        default=CANCELLED_MAX_IDS,
        ge=1,
        description="Cancelled request ids remembered (within the duplicate window) at most.",
    )
    max_kept_advisories: int = Field(
        default=KEPT_ADVISORIES_MAX,
        ge=1,
        description=(
            "Max-deliveries advisories the broker keeps for the leader, at most (oldest "
            "dropped first)."
        ),
    )
    lease_max_removed: int = Field(
        default=REMOVED_WORKERS_MAX,
        ge=1,
        description="Workers whose lease expired remembered at most (their late heartbeats).",
    )
    stream_setup_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "How long the start retries setting up the streams while the broker cannot yet "
            "(a cluster still electing, or not yet knowing every peer), before it fails."
        ),
    )
    fetch_timeout_s: float = Field(default=1.0, gt=0, description="Long-poll of each band task.")
    tick_s: float = Field(default=0.1, gt=0, description="Scheduling loop tick (deadlines).")
    gauges_every_s: float = Field(
        default=0.1,
        ge=0,
        description="Queue and engine gauges refresh at most this often (0: every pass).",
    )
    seed: int = Field(default=0, description="Salt of the least-loaded policy's hash tie-breaks.")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Serve /metrics, /healthz and /readyz here (0: off)."
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Bind address of the metrics port (0.0.0.0 in a container).",
    )

    feedback_window_s: float = Field(
        default=FEEDBACK_WINDOW_S,
        gt=0,
        description="Window of the wait percentiles, rates and expected wait.",
    )
    feedback_every_s: float = Field(
        default=1.0, gt=0, description="How often feedback gauges and scale signals update."
    )
    scale_up_wait_s: float = Field(
        default=SCALE_UP_WAIT_S,
        gt=0,
        description="Expected wait above which a band asks for more workers.",
    )
    scale_up_sustain_s: float = Field(
        default=SCALE_UP_SUSTAIN_S, ge=0, description="...for this long before the scale-up signal."
    )
    scale_down_idle_s: float = Field(
        default=SCALE_DOWN_IDLE_S, gt=0, description="A band idle this long signals scale-down."
    )

    routing_policy: Literal["cache-aware", "least-loaded"] = Field(
        default="cache-aware", description="How workers are chosen (see docs/architecture.md)."
    )
    routing_w_load: float = Field(default=_R.w_load, ge=0, description="Weight of the load term.")
    routing_w_cache: float = Field(
        default=_R.w_cache, ge=0, description="Weight of the cache-miss term."
    )
    routing_w_stable: float = Field(
        default=_R.w_stable, ge=0, description="Weight of moving a prefix off its replicas."
    )
    routing_w_busy: float = Field(
        default=_R.w_busy, ge=0, description="Weight of booked/capacity inside the load term."
    )
    routing_ttft_scale_s: float = Field(
        default=_R.ttft_scale_s, gt=0, description="Predicted TTFT that counts as load 1."
    )
    routing_min_hit_fraction: float = Field(
        default=_R.min_hit_fraction,
        ge=0,
        le=1,
        description="Cache hits below this share of the prefix count 0.",
    )
    routing_key_tokens: int = Field(
        default=_R.key_tokens, ge=1, description="Leading tokens that name a prefix for stickiness."
    )
    routing_sticky_window_s: float = Field(
        default=_R.sticky_window_s,
        gt=0,
        description="A prefix sticks to its replicas this long after use.",
    )
    routing_hard_load_fraction: float = Field(
        default=_R.hard_load_fraction,
        gt=0,
        le=1,
        description="Booked share of capacity that breaks stickiness.",
    )
    routing_hard_ttft_s: float = Field(
        default=_R.hard_ttft_s, gt=0, description="Predicted TTFT that breaks stickiness."
    )
    routing_replica_headroom: float = Field(
        default=_R.replica_headroom,
        gt=0,
        description="Replica budget = ceil(traffic share x workers x this).",
    )
    routing_max_replicas: int = Field(
        default=_R.max_replicas, ge=1, description="Replicas of a prefix at most."
    )
    routing_hot_tau_s: float = Field(
        default=_R.hot_tau_s, gt=0, description="Time constant of a prefix's traffic share."
    )
    routing_explore_share: float = Field(
        default=_R.explore_share,
        ge=0,
        le=1,
        description="Share of requests sent to newly joined workers.",
    )
    routing_explore_window_s: float = Field(
        default=_R.explore_window_s, ge=0, description="How long a joined worker counts as new."
    )
    routing_prefill_tokens_per_s: float = Field(
        default=_R.prefill_tokens_per_s,
        gt=0,
        description="Prior prefill speed until completions teach it.",
    )
    routing_decode_step_s: float = Field(
        default=_R.decode_step_s,
        gt=0,
        description="Prior decode time per token until completions teach it.",
    )
    routing_guess_ttl_s: float = Field(
        default=_R.guess_ttl_s,
        gt=0,
        description="How long a routed prefix counts as cached unreported.",
    )
    routing_index_tokens: int = Field(
        default=_R.index_tokens,
        ge=1,
        description="Prompt tokens per cache-index entry (agents' digest_index_tokens must match).",
    )
    routing_index_max_blocks: int = Field(
        default=_R.index_max_blocks, ge=1, description="Block hashes the cache index keeps at most."
    )
    routing_prefix_max_keys: int = Field(
        default=_R.prefix_max_keys,
        ge=1,
        description="Prefix keys remembered for stickiness and flap counting, at most.",
    )
    routing_shortlist_workers: int = Field(
        default=_R.shortlist_workers,
        ge=0,
        description="Least-loaded workers a decision scores besides the prefix's holders and "
        "replicas (0: every worker).",
    )
    routing_shortlist_per_group: int = Field(
        default=_R.shortlist_per_group,
        ge=1,
        description="Least-loaded holders of each match length (and replicas, when a prefix "
        "has more than routing_shortlist_workers) a decision scores first; the others only "
        "while one could still win.",
    )
    routing_index_memo_min_holders: int = Field(
        default=_R.index_memo_min_holders,
        ge=1,
        description="A chain of prompt blocks (a system prompt) that at least this many "
        "workers cache is kept as one set between its changes, so that a decision does not "
        "list its holders; the same choices for any value.",
    )
    decision_log: Path | None = Field(
        default=None, description="Write one JSON line per routing decision here (off: unset)."
    )
    decision_log_max_bytes: int = Field(
        default=DEFAULT_MAX_BYTES, ge=1024, description="Rotate the decision log at this size."
    )

    @model_validator(mode="after")
    def _consistent(self) -> DispatcherSettings:
        self.admission()  # raises ValueError with the reason
        unknown = set(self.queue_max_wait_s) - set(self.bands)
        if unknown:
            raise ValueError(f"queue_max_wait_s names unknown bands: {sorted(unknown)}")
        if any(w <= 0 for w in self.queue_max_wait_s.values()):
            raise ValueError("queue_max_wait_s values must be > 0")
        if self.queue_max_wait_s and any(
            self.queue_min_msgs > self.queue_max_msgs_of(b) for b in self.queue_max_wait_s
        ):
            raise ValueError("queue_min_msgs must not exceed queue_max_msgs")
        odd = set(self.band_queue_max_msgs) - set(self.bands)
        if odd and self.band_queue_max_msgs != {"batch": 100_000}:
            raise ValueError(f"band_queue_max_msgs names unknown bands: {sorted(odd)}")
        if any(v < 1 for v in self.band_queue_max_msgs.values()):
            raise ValueError("band_queue_max_msgs values must be >= 1")
        self.routing()
        return self

    def admission(self) -> AdmissionConfig:
        """The pure admission configuration these settings describe."""
        delays = {b: d for b, d in self.band_delay_s.items() if b in self.bands}
        unknown = set(self.band_delay_s) - set(self.bands)
        if unknown and self.band_delay_s != DEFAULT_BAND_DELAY_S:
            raise ValueError(f"band_delay_s names unknown bands: {sorted(unknown)}")
        return AdmissionConfig(
            bands=tuple(self.bands),
            global_limit=self.global_limit,
            band_limits=dict(self.band_limits),
            band_delay_s=delays,
            band_shares=dict(self.band_shares),
            band_floors=None if self.band_floors is None else dict(self.band_floors),
            idle_headroom=self.idle_headroom,
            demand_window_s=self.demand_window_s,
            burst_s=self.burst_s,
            max_prompt_tokens=self.max_prompt_tokens,
            max_attempts=self.max_attempts,
            quotas=Quotas(
                models={m: model_quota(q) for m, q in self.quotas.items()},
                default=model_quota(self.default_quota),
            ),
        )

    def routing(self) -> CacheAwareConfig:
        """The pure configuration of the cache-aware policy these settings describe."""
        return CacheAwareConfig(
            block_tokens=DEFAULT_BLOCK_TOKENS,
            w_load=self.routing_w_load,
            w_cache=self.routing_w_cache,
            w_stable=self.routing_w_stable,
            w_busy=self.routing_w_busy,
            ttft_scale_s=self.routing_ttft_scale_s,
            min_hit_fraction=self.routing_min_hit_fraction,
            key_tokens=self.routing_key_tokens,
            sticky_window_s=self.routing_sticky_window_s,
            hard_load_fraction=self.routing_hard_load_fraction,
            hard_ttft_s=self.routing_hard_ttft_s,
            replica_headroom=self.routing_replica_headroom,
            max_replicas=self.routing_max_replicas,
            hot_tau_s=self.routing_hot_tau_s,
            explore_share=self.routing_explore_share,
            explore_window_s=self.routing_explore_window_s,
            prefill_tokens_per_s=self.routing_prefill_tokens_per_s,
            decode_step_s=self.routing_decode_step_s,
            guess_ttl_s=self.routing_guess_ttl_s,
            index_max_blocks=self.routing_index_max_blocks,
            prefix_max_keys=self.routing_prefix_max_keys,
            index_tokens=self.routing_index_tokens,
            shortlist_workers=self.routing_shortlist_workers,
            shortlist_per_group=self.routing_shortlist_per_group,
            index_memo_min_holders=self.routing_index_memo_min_holders,
            explain=self.decision_log is not None,
        )

    def queue_max_msgs_of(self, band: str) -> int:
        """The most requests ``band``'s queue holds before QueueFull."""
        return self.band_queue_max_msgs.get(band, self.queue_max_msgs)

    def engine_time(self) -> EngineTimeConfig:
        """The engine-time priors these settings describe."""
        return EngineTimeConfig(
            prefill_tokens_per_s=self.engine_prefill_tokens_per_s,
            decode_token_s=self.engine_decode_token_s,
        )

    def with_overrides(self, overrides: AdmissionOverrides) -> AdmissionConfig:
        """The admission configuration with an operator's run-time overrides applied; raises
        ValueError (naming the problem) if the result is inconsistent."""
        update: dict[str, object] = {"quotas": {**self.quotas, **overrides.quotas}}
        names = ("global_limit", "band_limits", "band_shares", "band_floors", "default_quota")
        for name in names:
            value = getattr(overrides, name)
            if value is not None:
                update[name] = value
        return self.model_copy(update=update).admission()

    @property
    def effective_learn_s(self) -> float:
        return self.lease_s if self.learn_s is None else self.learn_s

    @property
    def effective_ack_wait_s(self) -> float:
        return self.leader_lease_s if self.ack_wait_s is None else self.ack_wait_s

    @property
    def effective_model_grace_s(self) -> float:
        return self.lease_s if self.model_grace_s is None else self.model_grace_s

"""The dispatcher's Prometheus metrics, declared once."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

QUEUED = Gauge("sluice_dispatcher_queued", "Requests waiting in the dispatcher", ["band"])
RUNNING = Gauge("sluice_dispatcher_running", "Requests booked on workers", ["band"])
ADMITTED = Counter(
    "sluice_dispatcher_admitted_total", "Requests handed to a worker", ["model", "band"]
)
COMPLETED = Counter("sluice_dispatcher_completed_total", "Requests completed", ["band"])
REJECTED = Counter(
    "sluice_dispatcher_rejected_total",
    "Requests answered with a rejection, by reason (model and band empty when unknown)",
    ["model", "band", "reason"],
)
DUPLICATES = Counter("sluice_dispatcher_duplicates_total", "Duplicate submissions dropped")
REQUEUED = Counter("sluice_dispatcher_requeued_total", "Requests re-run after a worker was lost")
RENEWALS = Counter(
    "sluice_dispatcher_renewals_total",
    "Held requests published again with their deliveries renewed (after many leader changes)",
)
RENEWALS_REFUSED = Counter(
    "sluice_dispatcher_renewals_refused_total",
    "Renewals the broker did not take (tried again at the next keepalive tick)",
)
RENEWED_HELD = Gauge(
    "sluice_dispatcher_renewed_held_requests",
    "Held requests whose message is a renewed copy in SLUICE_RENEWED (the older one acked)",
)
LOOKUPS_DEFERRED = Counter(
    "sluice_dispatcher_lookups_deferred_total",
    "Requests sent back because their result could not be looked up (redelivered or requeued)",
)
HANDOFF_REFUSED = Counter(
    "sluice_dispatcher_handoff_refused_total", "Assignments a worker refused or did not confirm"
)
WORKERS = Gauge("sluice_dispatcher_workers", "Workers with a live lease")
LEASES_EXPIRED = Counter("sluice_dispatcher_leases_expired_total", "Workers lost to lease expiry")
REMOVE_NOTICES = Counter(
    "sluice_dispatcher_remove_notices_total",
    "Remove notices sent to workers whose lease was taken away (again for each stale heartbeat)",
)
DRIFT = Gauge(
    "sluice_dispatcher_book_drift", "Booked requests a worker's heartbeat does not list", ["worker"]
)
COPIES_STOPPED = Counter(
    "sluice_dispatcher_copies_stopped_total",
    "Second copies of a request stopped because a stalled worker's first copy finished first",
)
RECONCILE_DRIFT = Counter(
    "sluice_dispatcher_reconcile_drift_total",
    "Requests reconciliation corrected, by kind (orphaned, moved, adopted, unknown)",
    ["kind"],
)
QUEUE_WAIT = Histogram(
    "sluice_dispatcher_queue_wait_seconds",
    "Time from arrival to hand-off",
    ["model", "band"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
INTAKE = Histogram(
    "sluice_dispatcher_intake_seconds",
    "From the broker storing a request to its intake (pull, decode): part of the queue wait",
    ["band"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
HANDOFF = Histogram(
    "sluice_dispatcher_handoff_seconds",
    "Assignment request/reply round trip",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2),
)
BAD_INPUT = Counter(
    "sluice_dispatcher_bad_messages_total",
    "Undecodable or unusable messages "
    "(heartbeat, completion, digest, assignment-reply, wait, cancel)",
    ["kind"],
)
ROUTED = Counter(
    "sluice_dispatcher_routed_total",
    "Routing decisions booked, by the rule that decided",
    ["reason"],
)
FLAPS = Counter(
    "sluice_dispatcher_flaps_total",
    "Booked decisions that flapped: a prefix booked on a worker that has not served it within "
    "the stickiness window (sluice.dispatcher.flaps); the flap rate is its rate() over "
    "sluice_dispatcher_flap_decisions_total's",
)
FLAP_DECISIONS = Counter(
    "sluice_dispatcher_flap_decisions_total",
    "Booked decisions the flap meter counted (the flap rate's denominator)",
)
REPLICA_SETS = Gauge(
    "sluice_dispatcher_prefix_replica_sets",
    "Prefixes with a live replica set, by its size in workers (bounded by the replica cap)",
    ["replicas"],
)
WORKER_PROMPT_TOKENS = Counter(
    "sluice_dispatcher_prompt_tokens_total", "Prompt tokens completed, per worker", ["worker"]
)
WORKER_CACHED_TOKENS = Counter(
    "sluice_dispatcher_cached_tokens_total", "Prompt tokens found cached, per worker", ["worker"]
)
WORKER_HIT_RATE = Gauge(
    "sluice_dispatcher_worker_hit_rate", "Cached share of completed prompt tokens", ["worker"]
)
HIT_ERROR = Histogram(
    "sluice_dispatcher_hit_error_tokens",
    "Cached tokens a completion reported minus the hit expected at routing",
    buckets=(-4096, -1024, -256, -64, -16, 0, 16, 64, 256, 1024, 4096),
)
INDEX_BLOCKS = Gauge("sluice_dispatcher_cache_index_blocks", "Block hashes in the cache index")
INDEX_CAPACITY = Gauge(
    "sluice_dispatcher_cache_index_capacity_blocks",
    "Block hashes the cache index keeps at most (routing_index_max_blocks)",
)
QUEUE_DEPTH = Gauge(
    "sluice_dispatcher_queue_depth", "Requests queued, by model and band", ["model", "band"]
)
EXPECTED_WAIT = Gauge(
    "sluice_dispatcher_expected_wait_seconds",
    "Expected wait of a request arriving now (NaN: queued, nothing admitted lately)",
    ["model", "band"],
)
SCALE_SIGNAL = Gauge(
    "sluice_dispatcher_scale_signal",
    "1: this model and band asks for more workers, -1: it idles, 0: steady",
    ["model", "band"],
)
SCALE_EVENTS = Counter(
    "sluice_dispatcher_scale_events_total", "Scale signals published", ["direction"]
)
CONFIG_UPDATES = Counter(
    "sluice_dispatcher_config_updates_total",
    "Run-time admission configurations seen in the KV bucket, by outcome",
    ["outcome"],
)
STALE_DIGESTS = Counter(
    "sluice_dispatcher_stale_digests_total",
    "Cache digests ignored after a missed delta (until the worker's next snapshot)",
)
ACK_FAILURES = Counter(
    "sluice_dispatcher_ack_failures_total",
    "Request acks the broker did not take (the request is delivered again and recognised)",
)
ANSWER_FAILURES = Counter(
    "sluice_dispatcher_answer_failures_total",
    "Answers or dead letters that could not be stored (their request stays un-acked)",
)
CANCELS = Counter(
    "sluice_dispatcher_cancels_total", "Cancel requests answered, by outcome", ["status"]
)
HELD = Gauge(
    "sluice_dispatcher_held_requests",
    "Queued requests by the layer that holds them (a limit, a quota level, no worker room, "
    "or the queue ahead)",
    ["reason"],
)
QUEUED_NOTICES = Counter(
    "sluice_dispatcher_queued_notices_total",
    "Producers told their request is held in the queue, by what held it",
    ["reason"],
)
QUEUE_BOUND = Gauge(
    "sluice_dispatcher_queue_bound",
    "The bound of a wait-sized band's queue (queue_max_wait_s x its admission rate)",
    ["band"],
)
ENGINE_SECONDS = Counter(
    "sluice_dispatcher_engine_seconds_total",
    "Estimated engine-seconds of the requests handed to workers",
    ["band"],
)
ENGINE_DEMAND = Gauge(
    "sluice_dispatcher_engine_demand_rate",
    "Engine-seconds per second handed to workers lately (decayed over demand_window_s)",
    ["band"],
)
ENGINE_FLOOR = Gauge(
    "sluice_dispatcher_engine_floor_rate",
    "An offline band's engine-time floor, in engine-seconds per second",
    ["band"],
)
ENGINE_IDLE = Gauge(
    "sluice_dispatcher_engine_idle_rate",
    "The idle capacity an offline band may borrow now, in engine-seconds per second",
    ["band"],
)
LEADER = Gauge("sluice_dispatcher_leader", "1 while this dispatcher leads, else 0")
EPOCH = Gauge("sluice_dispatcher_epoch", "The leadership epoch of this dispatcher's last term")
TAKEOVERS = Counter("sluice_dispatcher_takeovers_total", "Times this dispatcher became leader")

WORKER_LEASE_AGE = Gauge(
    "sluice_dispatcher_worker_lease_age_seconds",
    "Seconds since a leased worker's last heartbeat (its lease ends at lease_s)",
    ["worker"],
)
WORKER_IN_FLIGHT = Gauge(
    "sluice_dispatcher_worker_in_flight_requests",
    "Requests a worker's last heartbeat lists as running",
    ["worker"],
)
WORKER_BOOKED = Gauge(
    "sluice_dispatcher_worker_booked_requests", "Requests booked on a worker", ["worker"]
)
WORKER_CAPACITY = Gauge(
    "sluice_dispatcher_worker_capacity_requests",
    "The capacity a worker's last heartbeat announced (0 while it takes no work)",
    ["worker"],
)
WORKER_WAITING = Gauge(
    "sluice_dispatcher_worker_engine_waiting_requests",
    "Requests waiting inside a worker's engine (its queue, from the last heartbeat)",
    ["worker"],
)
WORKER_KV_USED = Gauge(
    "sluice_dispatcher_worker_kv_used_blocks", "KV blocks in use at a worker's engine", ["worker"]
)
WORKER_KV_TOTAL = Gauge(
    "sluice_dispatcher_worker_kv_capacity_blocks", "KV blocks of a worker's engine", ["worker"]
)
QUOTA_USAGE = Gauge(
    "sluice_dispatcher_quota_usage_ratio",
    "Used share of every quota level with a limit: global, band, model, model-band, "
    "model-tenant (tenants not named in the quotas: the fullest of them, name MODEL/*)",
    ["level", "name"],
)

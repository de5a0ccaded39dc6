"""The agent's Prometheus metrics, declared once (labelled by worker)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "sluice_agent_requests_total", "Requests finished by the agent", ["worker", "outcome"]
)
ASSIGNMENTS_REFUSED = Counter(
    "sluice_agent_assignments_refused_total", "Assignments the agent refused", ["worker", "reason"]
)
PROMPT_TOKENS = Counter("sluice_agent_prompt_tokens_total", "Prompt tokens processed", ["worker"])
CACHED_TOKENS = Counter(
    "sluice_agent_cached_tokens_total", "Prompt tokens served from the prefix cache", ["worker"]
)
OUTPUT_TOKENS = Counter("sluice_agent_output_tokens_total", "Tokens generated", ["worker"])
IN_FLIGHT = Gauge("sluice_agent_in_flight", "Requests accepted and not finished", ["worker"])
KV_USAGE = Gauge("sluice_agent_kv_usage_ratio", "Fraction of KV blocks in use", ["worker"])
TTFT = Histogram(
    "sluice_agent_ttft_seconds",
    "Time from submission to first token",
    ["worker"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
TOKEN_CHUNKS_LOST = Counter(
    "sluice_agent_token_chunks_lost_total",
    "Live token chunks that could not be published (the stored result has every token)",
    ["worker"],
)
OUTBOX = Gauge("sluice_agent_outbox_reports", "Finished requests not yet reported", ["worker"])
ENGINE_BUSY = Counter(
    "sluice_agent_engine_busy_seconds_total",
    "Real seconds the engine spent working (its rate is the worker's utilisation)",
    ["worker"],
)
ENGINE_KV_EVENTS = Counter(
    "sluice_agent_engine_kv_events_total",
    "The engine's KV events: batches applied, dropped (malformed), gaps, restarts, missed "
    "batches a replay did not return (unfilled), links to the publisher closed "
    "(publisher_lost: the mirror emptied); events that did not decode, skipped "
    "(malformed_event); blocks orphaned (parent unknown) or stored "
    "again at another depth (conflicting: the publisher's hashes are not chained); events of a "
    "tier below the GPU's, skipped (other_tier)",
    ["worker", "outcome"],
)
ENGINE_WAITING = Gauge(
    "sluice_agent_engine_waiting_requests", "Requests waiting inside the engine", ["worker"]
)

"""The gateway's Prometheus metrics, declared once (served on its own ``GET /metrics``).

``route`` is the route's path (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ...; ``other`` for a path no route serves), so its values are bounded.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "sluice_gateway_requests_total",
    "HTTP requests answered, by route and status code",
    ["route", "status"],
)
TTFT = Histogram(
    "sluice_gateway_first_token_seconds",
    "From a completion request's arrival to its first token reaching the gateway",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
IN_FLIGHT = Gauge(
    "sluice_gateway_in_flight_requests",
    "Completion requests being relayed now (from arrival to the end of the answer)",
    ["route"],
)
CANCELLED = Counter(
    "sluice_gateway_cancelled_total",
    "Requests the gateway cancelled: their client left (disconnect), their time ran out "
    "(timeout), the gateway stopped while it answered them (shutdown), or another choice "
    "of their answer was refused (refused) or failed (failed)",
    ["reason"],
)

"""The benchmarks' default sizes and bounds, named once: the benchmarks take their defaults
from here, and the commands' help shows them (this module imports nothing heavy, so
``sluice --help`` stays quick)."""

from __future__ import annotations

CORE_REQUESTS = 50_000
"""Requests of each pure-core benchmark (``bench_core``)."""
DECISION_REQUESTS = 5_000
"""Requests per worker count of ``decision_costs``."""
MAX_CORE_REQUESTS = 200_000
"""The most of either: the request stream is built in memory first, about 6 KB a request
(50,000 took 300 MB; 10^8 was a ``MemoryError``)."""
LATENCY_REQUESTS = 300
"""Sequential requests of the live dispatch latency."""
THROUGHPUT_REQUESTS = 3000
"""Requests of the live end-to-end throughput."""
SUBMITTERS = 64
"""Concurrent submitters of the throughput, and raw publishers of its baseline."""
AGENTS = 4
"""Agent processes of the live fleet."""
PROMPT_TOKENS = 256
"""Tokens of each live request's prompt."""
MAX_CONCURRENCY = 512
"""``sluice bench-gateway``'s most requests in flight: one HTTP client each, made before the
run (about 0.8 MB apiece; 20,000 took 16.7 GB and held off a SIGTERM for minutes)."""

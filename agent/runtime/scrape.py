"""An engine's load from its Prometheus endpoint: vLLM's and SGLang's metric names, parsed with
``prometheus_client``'s text parser.

- running: ``vllm:num_requests_running`` or ``sglang:num_running_reqs``;
- waiting: ``vllm:num_requests_waiting`` or ``sglang:num_queue_reqs``;
- KV cache use (0-1): ``vllm:kv_cache_usage_perc``, the older ``vllm:gpu_cache_usage_perc``, or
  ``sglang:token_usage``.

Samples of one name are summed over their labels (an engine with several model or rank
labels). Only the lines of these names are parsed: an engine's page is mostly histograms (a
vLLM page runs to hundreds of lines), and the agent scrapes it every second, beside a fleet of
streams on the same cores. A page with none of these names, or one whose lines of them do not
parse, raises
:class:`EngineMetricsError`; the scraper counts it and keeps its last figures, which then grow
stale: figures older than their bound count as a saturated engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from sluice.agent.errors import AgentError

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_NAMES = RUNNING + WAITING + KV_USAGE
MOST_REQUESTS = 1_000_000
"""More running or waiting requests than this is no engine's count."""


class EngineMetricsError(AgentError):
    """An engine's metrics page that gives no load (malformed, or none of the known names)."""


@dataclass(frozen=True)
class ScrapedLoad:
    running: int
    waiting: int
    kv_usage: float
    """0-1."""


def parse_load(text: str) -> ScrapedLoad:
    """The load on one metrics page (see the module docstring)."""
    sums: dict[str, float] = {}
    # A prefix match may keep a longer name's line too: the exact names are checked below.
    ours = "\n".join(line for line in text.splitlines() if line.startswith(_NAMES))
    try:
        for family in text_string_to_metric_families(ours):
            for sample in family.samples:
                if sample.name in _NAMES:
                    sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise EngineMetricsError(f"the metrics page does not parse: {exc}") from exc

    def first(names: tuple[str, ...]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    running, waiting, kv = first(RUNNING), first(WAITING), first(KV_USAGE)
    if running is None and waiting is None and kv is None:
        raise EngineMetricsError("the metrics page has no vLLM or SGLang load metric")
    for name, value, most in (
        ("running", running, MOST_REQUESTS),
        ("waiting", waiting, MOST_REQUESTS),
        ("KV use", kv, 1e9),
    ):
        # NaN, an infinity or an absurd count is no load (it failed the rounding below, or
        # went out in every heartbeat and failed its encoding).
        if value is not None and not (math.isfinite(value) and value <= most):
            raise EngineMetricsError(f"the metrics page gives {name} {value!r}")
    return ScrapedLoad(
        running=max(0, round(running or 0.0)),
        waiting=max(0, round(waiting or 0.0)),
        kv_usage=min(1.0, max(0.0, kv or 0.0)),
    )

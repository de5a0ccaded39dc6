"""What ``sluice loadgen`` sends and what it reports, without the sending (pure, deterministic).

A trace names its prompts by prefix-chained block ids and carries no text. To replay it against
a real endpoint each block id becomes a fixed block of text (seeded words, the same text for
the same id in every request and every run), so that requests sharing blocks share prompt
text and an engine's prefix cache, and any router's prefix tree, sees the sharing the trace
describes. A block is sized in the engine's tokenizer-free counting
(:data:`~sluice.schemas.hashing.TEXT_BYTES_PER_TOKEN` ASCII bytes a token, what ``sluice engine``
counts without a tokenizer), so a 512-token block is 512 tokens at the engine and a prompt is
its trace's ``input_tokens``. A trace without block ids (Azure) gets text of its own per request.

The figures carry the replay's names (:class:`sluice.sim.replay.PolicyResult`): ``ttft_p50_s``,
``ttft_p90_s``, ``ttft_p99_s``, ``throughput_rps``, ``goodput_rps`` (requests whose first token
came within the SLO, over the span from the first arrival to the last finish) and ``hit_rate``
(prompt tokens the engines served from their prefix caches over those they were asked, read
from the engines' own counters).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sluice.dispatcher.stats import percentile
from sluice.schemas.hashing import TEXT_BYTES_PER_TOKEN
from sluice.sim.errors import LoadgenError
from sluice.sim.profiles import EngineProfile
from sluice.sim.replay import scale_to_load
from sluice.sim.traces import MAX_ARRIVAL_S, TraceRequest

_WORDS = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "foot",
    "boy",
    "age",
    "policy",
    "music",
    "market",
    "sense",
    "nation",
    "plan",
    "college",
    "interest",
    "death",
]


def block_text(key: str, tokens: int, seed: int = 0) -> str:
    """The fixed text of block ``key``: ASCII words, exactly ``tokens`` tokens of
    :data:`TEXT_BYTES_PER_TOKEN` bytes each (the same for the same key, seed and size)."""
    if tokens < 1:
        raise LoadgenError("a block has at least one token")
    size = tokens * TEXT_BYTES_PER_TOKEN
    rng = random.Random(f"{seed}:{key}")
    parts: list[str] = []
    length = 0
    while length < size:
        w = rng.choice(_WORDS)
        parts.append(w)
        length += len(w) + 1
    return " ".join(parts)[:size].ljust(size)


class PromptBook:
    """The prompt text of trace requests, built from their blocks (block texts are kept, so a
    block shared by many requests is built once)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._blocks: dict[tuple[str, int], str] = {}

    def _block(self, key: str, tokens: int) -> str:
        text = self._blocks.get((key, tokens))
        if text is None:
            text = self._blocks[(key, tokens)] = block_text(key, tokens, self.seed)
        return text

    def prompt(self, r: TraceRequest, index: int) -> str:
        """Request ``index``'s prompt: its blocks' texts in order, cut to ``input_tokens``; the
        tokens its blocks do not cover (or all of them, without block ids) are its own text."""
        bt = r.block_tokens
        parts = [self._block(f"b{b}", bt) for b in r.block_ids[: math.ceil(r.input_tokens / bt)]]
        covered = len(parts) * bt
        own = 0
        while covered < r.input_tokens:
            parts.append(block_text(f"u{index}.{own}", bt, self.seed))  # never shared: not kept
            covered += bt
            own += 1
        return "".join(parts)[: r.input_tokens * TEXT_BYTES_PER_TOKEN]


def scale_arrivals(
    trace: Sequence[TraceRequest],
    *,
    rate_scale: float | None = None,
    load: float | None = None,
    workers: int = 1,
    profile: EngineProfile | None = None,
    speed: float = 1.0,
) -> list[TraceRequest]:
    """The trace's arrivals from 0: compressed ``rate_scale`` times (2: twice the rate), or
    stretched so that the offered work is ``load`` x the capacity of ``workers`` engines of
    ``profile`` running ``speed`` times faster than real time (as ``sluice replay --load``
    counts work: :func:`sluice.sim.replay.scale_to_load`)."""
    if not trace:
        raise LoadgenError("the trace has no requests")
    if (rate_scale is None) == (load is None):
        raise LoadgenError("give exactly one of rate_scale and load")
    t0 = trace[0].arrival_s
    if rate_scale is not None:
        if not rate_scale > 0:
            raise LoadgenError(f"rate_scale must be > 0, not {rate_scale}")
        out = [replace(r, arrival_s=(r.arrival_s - t0) / rate_scale) for r in trace]
    else:
        assert load is not None
        if not load > 0 or workers < 1 or not speed > 0 or profile is None:
            raise LoadgenError("load needs load > 0, workers >= 1, speed > 0 and a profile")
        scaled = scale_to_load(trace, load, workers, profile)
        s0 = scaled[0].arrival_s
        out = [replace(r, arrival_s=(r.arrival_s - s0) / speed) for r in scaled]
    span = max(r.arrival_s for r in out)
    if not span <= MAX_ARRIVAL_S:  # inf or NaN too: a load generator would sleep for ever
        how = f"rate_scale {rate_scale:g}" if rate_scale is not None else f"load {load:g}"
        raise LoadgenError(
            f"at {how} the slice's arrivals span {span:g} s, more than a year "
            f"({MAX_ARRIVAL_S:g} s): send faster"
        )
    return out


@dataclass(frozen=True)
class Outcome:
    """One request as the load generator saw it (seconds on its own monotonic clock)."""

    arrival_s: float
    """When it was due (its trace arrival from the run's start)."""
    sent_s: float
    first_s: float | None
    """When its first token arrived (None: none did)."""
    end_s: float
    ok: bool
    output_tokens: int = 0
    error: str = ""


def summarize(
    outcomes: Sequence[Outcome],
    *,
    slo_ttft_s: float,
    cache_hits_tokens: float | None = None,
    cache_queries_tokens: float | None = None,
) -> dict[str, Any]:
    """The run's figures under the replay's names. TTFT counts from the request's due time
    (an open-loop client that fell behind still charges the delay). ``hit_rate`` is
    ``cache_hits_tokens / cache_queries_tokens`` (the engines' counters' deltas), None when
    they were not read."""
    ok = [o for o in outcomes if o.ok and o.first_s is not None]
    ttft = [o.first_s - o.arrival_s for o in ok if o.first_s is not None]
    start = min((o.arrival_s for o in outcomes), default=0.0)
    end = max((o.end_s for o in outcomes), default=start)
    span = max(end - start, 1e-9)
    hit: float | None = None
    if cache_hits_tokens is not None and cache_queries_tokens:
        hit = cache_hits_tokens / cache_queries_tokens
    lag = [o.sent_s - o.arrival_s for o in outcomes]
    met = sum(1 for t in ttft if t <= slo_ttft_s)
    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "hit_rate": None if hit is None else round(hit, 6),
        "ttft_mean_s": _round(sum(ttft) / len(ttft)) if ttft else None,
        "ttft_p50_s": _round(percentile(ttft, 50)),
        "ttft_p90_s": _round(percentile(ttft, 90)),
        "ttft_p99_s": _round(percentile(ttft, 99)),
        "e2e_p50_s": _round(percentile([o.end_s - o.arrival_s for o in ok], 50)),
        "throughput_rps": _round(len(ok) / span),
        "goodput_rps": _round(met / span),
        "slo_met": met,
        "slo_attainment": _round(met / len(outcomes)) if outcomes else None,
        "slo_ttft_s": slo_ttft_s,
        "span_s": _round(span),
        "output_tokens": sum(o.output_tokens for o in ok),
        "send_lag_p99_s": _round(percentile(lag, 99)),
        "cache_hits_tokens": cache_hits_tokens,
        "cache_queries_tokens": cache_queries_tokens,
    }


def _round(v: float) -> float | None:
    return None if math.isnan(v) else round(v, 6)

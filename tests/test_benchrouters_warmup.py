"""What ``sluice bench-routers`` sends before each run of its slice (pure: no process starts)."""

from __future__ import annotations

import pytest

from sluice.cli.benchrouters import BenchConfig, BenchRoutersError, warmup_slice
from sluice.sim.traces import TraceRequest, earlier_turns


def _trace() -> list[TraceRequest]:
    # Requests 0-5 are first turns (blocks 0, 10 + i); 6-9 continue 2, 3, 4 and 5.
    first = [TraceRequest(i, 1024, 50, (0, 10 + i)) for i in range(6)]
    second = [TraceRequest(6 + i, 1536, 50, (0, 12 + i, 30 + i)) for i in range(4)]
    return [*first, *second]


def test_the_warm_up_is_the_earlier_turns_all_requests_or_nothing_prefill_only() -> None:
    """Fails if the warm-up keeps its answers (``output_tokens=1`` dropped), if ``turns`` sends
    every request before the slice (the ``earlier_turns`` filter dropped), or if it looks
    further back than ``warmup_requests``."""
    trace = _trace()
    cfg = BenchConfig(trace="-", start=6, requests=4, warmup_requests=3)
    turns = warmup_slice(cfg, trace)
    # Only the 3 requests before the slice count (3, 4, 5): 2 is further back.
    assert [r.arrival_s for r in turns] == [3, 4, 5]
    assert [r.block_ids for r in turns] == [
        r.block_ids for r in earlier_turns(trace[3:6], trace[6:])
    ]
    assert all(r.output_tokens == 1 for r in turns)  # prefill only
    every = warmup_slice(BenchConfig(trace="-", start=6, requests=2, warmup="all"), trace)
    assert [r.arrival_s for r in every] == [0, 1, 2, 3, 4, 5]  # 600 back: from the trace's start
    assert all(r.output_tokens == 1 for r in every)
    # The slice of requests 6-7 continues 2 and 3 only.
    two = warmup_slice(BenchConfig(trace="-", start=6, requests=2), trace)
    assert [r.arrival_s for r in two] == [2, 3]
    assert warmup_slice(BenchConfig(trace="-", start=6, warmup="none"), trace) == []
    assert warmup_slice(BenchConfig(trace="-", start=6, warmup_requests=0), trace) == []
    assert warmup_slice(BenchConfig(trace="-", start=0), trace) == []  # nothing before
    with pytest.raises(BenchRoutersError, match="unknown warm-up"):
        warmup_slice(BenchConfig(trace="-", start=6, warmup="hot"), trace)

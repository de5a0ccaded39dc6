"""What ``sluice bench-routers`` sends before each run of its slice, and ``--simulate``, which
replays the same slice and warm-up in the simulator (pure: no process starts)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sluice.cli.benchrouters import BenchConfig, BenchRoutersError, simulate, warmup_slice
from sluice.sim.traces import TraceRequest, earlier_turns, write_jsonl


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


def test_simulate_replays_the_warm_up_before_the_slice(tmp_path: Path) -> None:
    """``--simulate``: the slice's second turns hit only what the warm-up of first turns left
    (nothing among themselves). Fails if the warm-up is not replayed before the slice (hit
    rate 0 for every policy) or is measured with it (8 completed instead of 4)."""
    path = tmp_path / "t.jsonl"
    first = [TraceRequest(float(i), 1024, 8, (10 + i, 20 + i)) for i in range(4)]
    second = [TraceRequest(4.0 + i, 1536, 8, (10 + i, 20 + i, 30 + i)) for i in range(4)]
    write_jsonl([*first, *second], path)
    cfg = BenchConfig(trace=str(path), engines=2, loads=(1.0,), start=4, requests=4)
    warm = simulate(cfg)
    assert (warm["warmup_requests"], warm["hit_ceiling"], warm["hit_ceiling_cold"]) == (
        4, pytest.approx(2 / 3, abs=1e-4), 0.0,
    )  # fmt: skip
    for policy, by_load in warm["runs"].items():
        f = by_load[1.0]
        assert f["bands"]["interactive"]["completed"] == 4, policy
        assert f["hit_rate"] > 0 and f["warmup_s"] > 0, policy
    assert warm["runs"]["sluice"][1.0]["hit_rate"] == pytest.approx(2 / 3)
    cold = simulate(dataclasses.replace(cfg, warmup="none"))
    assert all(by_load[1.0]["hit_rate"] == 0 for by_load in cold["runs"].values())

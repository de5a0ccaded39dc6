"""``sluice bench-routers`` at a tiny size, every arm (round-robin, sglang-router 0.3.2, smg 1.13
and the Sluice stack), so that the head-to-head benchmark keeps working, its warm-up included
(skip its sends in ``_warm_up`` and round-robin's hit rate is 0.0). The SGLang routers come
from ``make routers`` (``make test`` builds them): a missing one fails this test, it is never
skipped. The benchmark process stops every process it started by PID; this test stops the
benchmark by its PID (SIGTERM, which the benchmark handles as Ctrl-C), also on failure."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.cli.benchrouters import ARMS
from sluice.sim.traces import TraceRequest, write_jsonl

pytestmark = [pytest.mark.bench, pytest.mark.timeout(400)]


def test_bench_routers_runs_every_arm_at_a_tiny_size(tmp_path: Path) -> None:
    trace, out = tmp_path / "t.jsonl", tmp_path / "out.json"
    # Four first turns, then the slice: four second turns, each continuing one of them with a
    # block of its own and sharing nothing with the others. Every arm can only hit what the
    # warm-up (the first turns, unmeasured) left: without it the hit rate is 0.
    first = [TraceRequest(0.5 * i, 2 * 512, 4, (10 + i, 20 + i)) for i in range(4)]
    second = [TraceRequest(2 + 0.5 * i, 3 * 512, 4, (10 + i, 20 + i, 100 + i)) for i in range(4)]
    write_jsonl([*first, *second], trace)
    cmd = [
        sys.executable, "-m", "sluice.cli", "bench-routers", "--trace", str(trace),
        "--engines", "2", "--speed", "10", "--loads", "1.0", "--start", "4", "--requests", "4",
        "--warmup-requests", "4", "--latency-requests", "3", "--json", str(out),
        "--no-progress",
    ]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=360)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert p.returncode == 0, stderr + stdout
    r = json.loads(out.read_text())
    assert set(r["runs"]) == set(ARMS)
    assert (r["warmup"], r["warmup_requests"], r["hit_ceiling_cold"]) == ("turns", 4, 0)
    for arm, runs in r["runs"].items():
        f = runs["1.0"]
        assert (f["completed"], f["failed"], f["warmup_failed"]) == (4, 0, 0), (arm, f)
        assert f["hit_rate"] > 0, (arm, f)  # read from the engines' counters, after the warm-up
        assert f["goodput_rps"] is not None and f["ttft_p99_s"] is not None
    assert set(r["latency"]) == set(ARMS) - {"round-robin"}
    for arm, f in r["latency"].items():
        assert f["stream_p50_ms"] > 0 and f["plain_p50_ms"] > 0, arm
        assert f["direct_stream_p50_ms"] > 0 and f["direct_plain_p50_ms"] > 0, arm
    assert "sluice goodput" in stdout  # the verdict line

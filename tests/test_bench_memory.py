"""``sluice bench-memory`` keeps working: run at a tiny size, it reports every figure (no
thresholds: memory is measured in the benchmark, not asserted here)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

from sluice.cli import benchmemory


def test_the_memory_benchmark_reports_every_term_as_json() -> None:
    cmd = [sys.executable, "-m", "sluice.cli", "bench-memory", "--json", "--runs", "1"]
    cmd += ["--queued", "60", "--workers", "6", "--blocks", "300", "--prefixes", "50"]
    cmd += ["--prompts", "40"]
    cmd += ["--prompt-tokens", "1100"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["sizes"] == {
        "queued": 60,
        "workers": 6,
        "blocks": 300,
        "prefixes": 50,
        "prompts": 40,
        "prompt_tokens": 1100,
        "runs": 1,
    }
    assert set(r["terms"]) == {
        "queued_request",
        "queued_request_short",
        "worker",
        "indexed_block",
        "prefix_key",
        "served_prompt",
        "kv_prompt",
    }
    lines, first = inspect.getsourcelines(benchmemory._rss_bytes)
    measuring = {f"cli/benchmemory.py:{first + i}" for i in range(len(lines))}
    for term in r["terms"].values():
        for figure in ("bytes_per_item", "live_bytes_per_item", "growth_bytes"):
            assert set(term[figure]) == {"min", "median", "max"}
        # Live growth is trimmed after against trimmed before (it took an untrimmed before,
        # and was negative at small sizes: -156,058 B a worker at 10 of them).
        assert term["live_bytes_per_item"]["min"] >= 0, term
        assert term["bytes_per_item"]["min"] >= 0, term  # (both from one trimmed before)
        assert term["attribution"]["items"] == term["params"]["items"]
        assert term["attribution"]["top"], "tracemalloc named no source line"
        # (The measuring itself, libc loaded and /proc read, was 52 % of one term's lines.)
        places = {row["site"] for row in term["attribution"]["top"]}
        assert not {p for p in places if "ctypes" in p} | (places & measuring), places
    assert r["baseline_rss_bytes"]["median"] > 0
    assert set(r["queued_request_formula"]) == {"fixed_bytes", "bytes_per_prompt_token"}
    for key in ("growth_bytes", "rss_bytes", "predicted_growth_bytes", "rss_over_target"):
        assert key in r["dispatcher"]
    for key in ("served_rss_bytes", "kv_events_rss_bytes", "rss_over_target"):
        assert key in r["agent"]

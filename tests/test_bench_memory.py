"""``sluice bench-memory`` keeps working: run at a tiny size, it reports every figure (no
thresholds: memory is measured in the benchmark, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys


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
    for term in r["terms"].values():
        for figure in ("bytes_per_item", "live_bytes_per_item", "growth_bytes"):
            assert set(term[figure]) == {"min", "median", "max"}
        assert term["attribution"]["items"] == term["params"]["items"]
        assert term["attribution"]["top"], "tracemalloc named no source line"
    assert r["baseline_rss_bytes"]["median"] > 0
    assert set(r["queued_request_formula"]) == {"fixed_bytes", "bytes_per_prompt_token"}
    for key in ("growth_bytes", "rss_bytes", "predicted_growth_bytes", "rss_over_target"):
        assert key in r["dispatcher"]
    for key in ("served_rss_bytes", "kv_events_rss_bytes", "rss_over_target"):
        assert key in r["agent"]

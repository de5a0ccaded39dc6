"""``sluice bench-routers``' pure parts: ``--repeat`` (the rounds' medians, their order, a verdict
from each round's paired ratios) and the routing settings it gives a dispatcher of sped-up
engines. No process starts."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from rich.console import Console

from sluice.cli.benchrouters import (
    SCALED_ROUTING,
    RoutersResult,
    dispatcher_env,
    median_runs,
    round_order,
    table,
    verdict,
)
from sluice.dispatcher.cacheaware import CacheAwareConfig
from sluice.dispatcher.runtime.settings import DispatcherSettings


def _f(goodput: float | None, p99: float | None, **kw: Any) -> dict[str, Any]:
    return {
        "goodput_rps": goodput, "ttft_p99_s": p99, "ttft_p50_s": 0.5, "hit_rate": None,
        "completed": 300, "requests": 300, "policy": "x", **kw,
    }  # fmt: skip


def _result(rounds: list[dict[str, dict[float, dict[str, Any]]]]) -> RoutersResult:
    r = RoutersResult(16, 2.0, 300, "t.jsonl", 1.0, rounds=rounds)
    r.runs = median_runs(rounds)
    return r


def test_arms_run_in_their_order_then_reversed_alternately() -> None:
    arms = ("round-robin", "sglang-router", "sluice")
    assert [round_order(arms, i) for i in range(3)] == [arms, arms[::-1], arms]


def test_each_number_is_the_median_of_the_rounds_that_measured_it() -> None:
    rounds = [
        {"sluice": {0.8: _f(8.0, 5.0, flag=True)}, "smg": {0.8: _f(1.0, 9.0)}},
        {"sluice": {0.8: _f(6.0, None, flag=False)}},
        {"sluice": {0.8: _f(7.0, 7.0, flag=False)}, "smg": {1.0: _f(2.0, 3.0)}},
    ]
    med = median_runs(rounds)
    s = med["sluice"][0.8]
    assert (s["goodput_rps"], s["ttft_p99_s"], s["completed"]) == (7.0, 6.0, 300)  # None left out
    assert (s["policy"], s["flag"]) == ("x", True)  # not numbers: the first round's
    assert med["smg"] == {0.8: _f(1.0, 9.0), 1.0: _f(2.0, 3.0)}  # one round each: as measured


def test_the_verdict_is_the_median_of_each_rounds_ratio_to_its_stronger_router() -> None:
    """Paired per round: round 2's stronger router is smg (round 1's sglang-router), and the
    verdict's ratios are the medians of x1.5 / x1.0 / x1.3, not the ratio of the medians."""
    rounds = [
        {"sglang-router": {0.8: _f(8.0, 6.0)}, "smg": {0.8: _f(6.0, 6.0)},
         "sluice": {0.8: _f(12.0, 3.0)}},
        {"sglang-router": {0.8: _f(4.0, 6.0)}, "smg": {0.8: _f(9.0, 8.0)},
         "sluice": {0.8: _f(9.0, 8.0)}},
        {"sglang-router": {0.8: _f(10.0, 5.0)}, "smg": {0.8: _f(5.0, 6.0)},
         "sluice": {0.8: _f(13.0, 3.0)}},
    ]  # fmt: skip
    r = _result(rounds)
    assert r.ratios(0.8) == [(1.5, 0.5), (1.0, 1.0), (1.3, 0.6)]
    (line,) = verdict(r)
    assert "goodput x1.30" in line and "P99 TTFT x0.60" in line and line.count("MET") == 1
    assert "median of 3 rounds: goodput x1.50 / x1.00 / x1.30, P99 x0.50 / x1.00 / x0.60" in line
    console = Console(width=200, record=True)
    console.print(table(r))
    assert "x1.30 / x0.60" in console.export_text()  # the table's cell is the verdict's
    one = _result(rounds[1:2])
    (line,) = verdict(one)
    assert "goodput x1.00 of smg" in line and "MISSED" in line and "rounds" not in line


def test_a_dispatcher_of_engines_at_x2_gets_every_routing_duration_halved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the dispatcher of the head to head reads from its environment: the defaults'
    durations over the speed-up, their prior prefill speed times it, the rest as they are."""
    for name, value in dispatcher_env("sim", 2.0, 512).items():
        monkeypatch.setenv(name, value)
    settings = DispatcherSettings()
    assert (settings.models, settings.global_limit) == (["sim"], 512)
    got, base = settings.routing(), CacheAwareConfig()
    for f in dataclasses.fields(CacheAwareConfig):
        want = getattr(base, f.name)
        if f.name in SCALED_ROUTING:
            want /= 2
        elif f.name == "prefill_tokens_per_s":
            want *= 2
        assert getattr(got, f.name) == pytest.approx(want), f.name
    assert got.ttft_scale_s == 0.5 and got.hard_ttft_s == 1.5  # what decides load against hits

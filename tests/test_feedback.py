"""Admission feedback: waits, rates, expected wait, scale signals (pure)."""

from __future__ import annotations

import math

import pytest

from sluice.dispatcher.feedback import Feedback, ScaleAdvisor, WaitFigures


def test_figures_over_the_window() -> None:
    fb = Feedback(window_s=10.0)
    for i in range(20):  # 2 admissions per second over 10 s, waits 0.0 .. 1.9 s
        fb.admitted("m", "interactive", i / 10, i * 0.5)
    fb.rejected("m", "interactive", 9.0)
    f = fb.figures("m", "interactive", queued=6, running=3, now_s=10.0)
    assert math.isclose(f.admitted_per_s, 2.0, rel_tol=0.06)
    # Percentiles interpolate linearly (sluice.dispatcher.stats.percentile, numpy's default).
    assert math.isclose(f.wait_p50_s, 0.95) and math.isclose(f.wait_p99_s, 1.881)
    assert math.isclose(f.rejected_per_s, 0.1)
    assert f.expected_wait_s is not None and math.isclose(f.expected_wait_s, 3.0, rel_tol=0.06)
    assert fb.figures("m", "interactive", 0, 3, 10.0).expected_wait_s == 0.0
    # Old samples leave the window; a queue with no recent admission has no known wait.
    later = fb.figures("m", "interactive", queued=2, running=0, now_s=30.0)
    assert later.admitted_per_s == 0.0 and later.expected_wait_s is None
    assert fb.figures("other", "batch", 0, 0, 30.0).wait_p99_s == 0.0


def _f(queued: int, running: int, expected: float | None) -> WaitFigures:
    return WaitFigures("m", "interactive", queued, running, 0, 0, 1, 0, expected)


def test_scale_up_after_a_sustained_wait_once_until_it_clears() -> None:
    adv = ScaleAdvisor(up_wait_s=5.0, up_sustain_s=10.0, down_idle_s=60.0)
    assert adv.observe(_f(10, 5, 8.0), 0.0) is None
    assert adv.observe(_f(10, 5, 8.0), 9.0) is None  # not sustained yet
    up = adv.observe(_f(10, 5, 8.0), 10.0)
    assert up is not None and up.direction == "up" and "8.0 s" in up.reason
    assert adv.observe(_f(12, 5, 9.0), 11.0) is None  # said once
    assert adv.state("m", "interactive") == "up"
    assert adv.observe(_f(1, 5, 0.5), 12.0) is None  # cleared
    assert adv.state("m", "interactive") is None
    assert adv.observe(_f(10, 5, None), 13.0) is None  # queued, nothing admitted: slow too
    again = adv.observe(_f(10, 5, None), 23.0)
    assert again is not None and again.direction == "up" and "unknown" in again.reason


def test_scale_down_after_a_sustained_idle_band() -> None:
    adv = ScaleAdvisor(down_idle_s=60.0)
    assert adv.observe(_f(0, 0, 0.0), 0.0) is None
    assert adv.observe(_f(0, 1, 0.0), 30.0) is None  # one running: not idle, the clock restarts
    assert adv.observe(_f(0, 0, 0.0), 31.0) is None
    down = adv.observe(_f(0, 0, 0.0), 91.0)
    assert down is not None and down.direction == "down"
    assert adv.observe(_f(0, 0, 0.0), 200.0) is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Feedback(window_s=0)
    with pytest.raises(ValueError):
        ScaleAdvisor(up_wait_s=0)

"""Feedback on admission (pure): waits, rates, expected wait, and scale signals.

Per model and band, over a sliding window (``window_s``): the queue waits of admitted requests
(P50/P99), admissions and rejections per second, and the **expected wait** of a request
arriving now: the requests queued ahead of it divided by the rate at which that queue was
served over the window (0 with no queue; None when a queue exists but nothing was admitted in
the window, so no rate is known).

:class:`ScaleAdvisor` turns those into signals an autoscaler can consume, on transitions only:
``up`` when a band's expected wait has stayed above ``up_wait_s`` for ``up_sustain_s`` (or is
unknown with requests queued), ``down`` when a band has had nothing queued or running for
``down_idle_s``. Queue wait, not GPU utilisation, is the scaling signal (DESIGN.md).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from sluice.dispatcher.defaults import (
    FEEDBACK_WINDOW_S,
    SCALE_DOWN_IDLE_S,
    SCALE_UP_SUSTAIN_S,
    SCALE_UP_WAIT_S,
)
from sluice.dispatcher.stats import percentile

Key = tuple[str, str]
"""(model, band)"""


@dataclass(frozen=True)
class WaitFigures:
    """What a producer or an autoscaler wants to know about one model and band."""

    model: str
    band: str
    queued: int
    running: int
    wait_p50_s: float
    wait_p99_s: float
    admitted_per_s: float
    rejected_per_s: float
    expected_wait_s: float | None


@dataclass
class _Series:
    waits: deque[tuple[float, float]] = field(default_factory=deque)
    rejected: deque[float] = field(default_factory=deque)
    first_s: float | None = None


class Feedback:
    """Sliding-window waits and rates per (model, band)."""

    def __init__(self, window_s: float = FEEDBACK_WINDOW_S, max_samples: int = 4096) -> None:
        if window_s <= 0 or max_samples < 1:
            raise ValueError("window_s must be > 0 and max_samples >= 1")
        self.window_s = window_s
        self.max_samples = max_samples
        self._series: dict[Key, _Series] = {}

    def _get(self, model: str, band: str, now_s: float) -> _Series:
        s = self._series.get((model, band))
        if s is None:
            s = self._series[(model, band)] = _Series(first_s=now_s)
        return s

    def admitted(self, model: str, band: str, wait_s: float, now_s: float) -> None:
        s = self._get(model, band, now_s)
        s.waits.append((now_s, max(0.0, wait_s)))
        self._trim(s, now_s)

    def rejected(self, model: str, band: str, now_s: float) -> None:
        s = self._get(model, band, now_s)
        s.rejected.append(now_s)
        self._trim(s, now_s)

    def keys(self) -> list[Key]:
        return sorted(self._series)

    def _trim(self, s: _Series, now_s: float) -> None:
        start = now_s - self.window_s
        while s.waits and (s.waits[0][0] < start or len(s.waits) > self.max_samples):
            s.waits.popleft()
        while s.rejected and (s.rejected[0] < start or len(s.rejected) > self.max_samples):
            s.rejected.popleft()

    def figures(
        self, model: str, band: str, queued: int, running: int, now_s: float
    ) -> WaitFigures:
        """The figures of (model, band) now, given its current queue and running counts."""
        s = self._series.get((model, band))
        if s is None:
            s = _Series(first_s=now_s)
        self._trim(s, now_s)
        first = now_s if s.first_s is None else s.first_s
        span = min(self.window_s, max(now_s - first, 1e-9))
        waits = [w for _, w in s.waits]
        admitted_rate = len(s.waits) / span if s.waits else 0.0
        expected: float | None
        if queued == 0:
            expected = 0.0
        elif admitted_rate > 0:
            expected = queued / admitted_rate
        else:
            expected = None
        return WaitFigures(
            model=model,
            band=band,
            queued=queued,
            running=running,
            wait_p50_s=percentile(waits, 50) if waits else 0.0,
            wait_p99_s=percentile(waits, 99) if waits else 0.0,
            admitted_per_s=admitted_rate,
            rejected_per_s=len(s.rejected) / span if s.rejected else 0.0,
            expected_wait_s=expected,
        )


Direction = Literal["up", "down"]


@dataclass(frozen=True)
class ScaleSignal:
    """A scale-up or scale-down signal for one model and band."""

    model: str
    band: str
    direction: Direction
    reason: str
    expected_wait_s: float | None


@dataclass
class _State:
    slow_since_s: float | None = None
    idle_since_s: float | None = None
    signalled: Direction | None = None


class ScaleAdvisor:
    """Signals on transitions: ``up`` after a sustained long expected wait, ``down`` after a
    sustained idle band; a signal is repeated only after the condition cleared."""

    def __init__(
        self,
        *,
        up_wait_s: float = SCALE_UP_WAIT_S,
        up_sustain_s: float = SCALE_UP_SUSTAIN_S,
        down_idle_s: float = SCALE_DOWN_IDLE_S,
    ) -> None:
        if up_wait_s <= 0 or up_sustain_s < 0 or down_idle_s <= 0:
            raise ValueError("up_wait_s and down_idle_s must be > 0, up_sustain_s >= 0")
        self.up_wait_s = up_wait_s
        self.up_sustain_s = up_sustain_s
        self.down_idle_s = down_idle_s
        self._state: dict[Key, _State] = {}

    def state(self, model: str, band: str) -> Direction | None:
        """The last signal of (model, band) that still holds (None: steady)."""
        st = self._state.get((model, band))
        return st.signalled if st else None

    def observe(self, f: WaitFigures, now_s: float) -> ScaleSignal | None:
        st = self._state.setdefault((f.model, f.band), _State())
        slow = f.queued > 0 and (f.expected_wait_s is None or f.expected_wait_s > self.up_wait_s)
        idle = f.queued == 0 and f.running == 0
        if not slow:
            st.slow_since_s = None
            if st.signalled == "up":
                st.signalled = None  # cleared: the next sustained wait signals again
        elif st.slow_since_s is None:
            st.slow_since_s = now_s
        if not idle:
            st.idle_since_s = None
            if st.signalled == "down":
                st.signalled = None
        elif st.idle_since_s is None:
            st.idle_since_s = now_s
        if st.slow_since_s is not None and now_s - st.slow_since_s >= self.up_sustain_s:
            if st.signalled == "up":
                return None
            st.signalled = "up"
            wait = "unknown" if f.expected_wait_s is None else f"{f.expected_wait_s:.1f} s"
            reason = (
                f"expected wait {wait} above {self.up_wait_s:g} s for "
                f"{now_s - st.slow_since_s:.0f} s with {f.queued} queued"
            )
            return ScaleSignal(f.model, f.band, "up", reason, f.expected_wait_s)
        if st.idle_since_s is not None and now_s - st.idle_since_s >= self.down_idle_s:
            if st.signalled == "down":
                return None
            st.signalled = "down"
            reason = f"nothing queued or running for {now_s - st.idle_since_s:.0f} s"
            return ScaleSignal(f.model, f.band, "down", reason, f.expected_wait_s)
        return None


def wait_bound(admitted_per_s: float, wait_s: float, min_msgs: int, max_msgs: int) -> int:
    """A queue bound sized by an acceptable wait: a queue of ``admitted_per_s x wait_s``
    requests drains in about ``wait_s`` at the rate it is served now (the article's rule),
    kept within ``[min_msgs, max_msgs]`` (``max_msgs`` when no rate is known yet)."""
    if wait_s <= 0 or min_msgs < 1 or max_msgs < min_msgs:
        raise ValueError("wait_s must be > 0 and 1 <= min_msgs <= max_msgs")
    if admitted_per_s <= 0:
        return max_msgs
    return max(min_msgs, min(max_msgs, math.ceil(admitted_per_s * wait_s)))

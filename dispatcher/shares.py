"""Engine-time shares of the fleet (pure: time is passed in): the floor and the idle capacity
of each offline band.

A band with a *floor* ``f`` (``AdmissionConfig.band_floors``; by default the ``batch`` band,
3 %) is offline work. It runs on two budgets of engine time, both token buckets in
engine-seconds (:mod:`sluice.dispatcher.enginetime` prices each request):

- its **floor**, refilled at ``f x C`` engine-seconds per second, where ``C`` is the fleet's
  supply (one engine-second per second per live worker). The floor is spent whether or not a
  more urgent band waits: it is what offline work is guaranteed.
- the **idle capacity**, refilled at ``max(0, C x (1 - headroom) - D)``, where ``D`` is the
  engine time per second that the bands before it were dispatched (a decayed rate over
  ``demand_window_s``). It is spent only while no more urgent band waits in the dispatcher.

A dispatch needs a budget with credit >= 0 and then takes the request's whole cost from it (the
credit may go below zero by one request), floor first. A band with floor credit is planned
before every other band (ahead of the aging order), so online requests that sort before it
cannot take the free slots its floor is owed. Each bucket holds at most ``burst_s``
seconds of its rate, so offline work never arrives in a flood that online bursts would then
wait behind.

**Starvation bound.** While a request ``R`` of a floored band is its band's next (no request of
the band is ahead of it in priority order), the floor's credit reaches 0 within ``c / (f x C)``
seconds of the band's last dispatch, of cost ``c``; then ``R`` is dispatched at the first plan
in which a worker of its model has a free slot and its quotas have room. A request with
requests of its band ahead of it that cost ``E`` engine-seconds in all waits at most
``(E + c) / (f x C)`` plus that slot wait. Online work cannot take the floor away, and offline
work cannot take more than its floor while online work waits: ``test_engine_shares.py`` proves
both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

ShareKind = Literal["", "floor", "idle"]
"""The budget a dispatch is charged to: "" (an urgent band: counted as demand)."""

DEFAULT_BAND_FLOORS: Mapping[str, float] = {"batch": 0.03}
DEFAULT_IDLE_HEADROOM = 0.1
DEFAULT_DEMAND_WINDOW_S = 30.0
DEFAULT_BURST_S = 2.0


@dataclass
class _Bucket:
    credit: float
    at_s: float
    rate: float
    depth: float

    def at(self, now_s: float) -> float:
        if now_s <= self.at_s:
            return self.credit
        return min(max(self.credit, self.depth), self.credit + self.rate * (now_s - self.at_s))

    def advance(self, now_s: float, rate: float, depth: float) -> None:
        self.credit = self.at(now_s)
        self.at_s = max(self.at_s, now_s)
        self.rate, self.depth = rate, depth


class BandMeter:
    """The floor and idle buckets of every floored band, and the demand of every band."""

    def __init__(
        self,
        bands: Sequence[str],
        floors: Mapping[str, float],
        *,
        headroom: float = DEFAULT_IDLE_HEADROOM,
        window_s: float = DEFAULT_DEMAND_WINDOW_S,
        burst_s: float = DEFAULT_BURST_S,
    ) -> None:
        self.bands = tuple(bands)
        self.floors = dict(floors)
        self.headroom, self.window_s, self.burst_s = headroom, window_s, burst_s
        self.capacity = 0.0
        """Engine-seconds per second the fleet supplies (live workers)."""
        self._floor = {b: _Bucket(0.0, 0.0, 0.0, 0.0) for b in self.floors}
        self._idle = {b: _Bucket(0.0, 0.0, 0.0, 0.0) for b in self.floors}
        self._demand: dict[str, float] = dict.fromkeys(self.bands, 0.0)
        self._demand_at_s = 0.0
        self.spent_s: dict[str, float] = dict.fromkeys(self.bands, 0.0)
        """Engine-seconds dispatched per band since the start (floor + idle + urgent)."""

    def floored(self, band: str) -> bool:
        return band in self.floors

    def floor_rate(self, band: str) -> float:
        return self.floors.get(band, 0.0) * self.capacity

    def demand_rate(self, band: str, now_s: float) -> float:
        """Engine-seconds per second dispatched to ``band`` lately (decayed)."""
        return self._decayed(now_s) * self._demand[band] / self.window_s

    def idle_rate(self, band: str, now_s: float) -> float:
        """The idle capacity ``band`` may borrow now (engine-seconds per second)."""
        urgent = 0.0
        for b in self.bands:
            if b == band:
                break
            urgent += self.demand_rate(b, now_s)
        return max(0.0, self.capacity * (1.0 - self.headroom) - urgent)

    def floor_credit(self, band: str, now_s: float) -> float:
        return self._floor[band].at(now_s)

    def idle_credit(self, band: str, now_s: float) -> float:
        return self._idle[band].at(now_s)

    def set_capacity(self, capacity: float, now_s: float) -> None:
        """The fleet now supplies ``capacity`` engine-seconds per second."""
        self.capacity = max(0.0, capacity)
        self.advance(now_s)

    def advance(self, now_s: float) -> None:
        """Bring every bucket to ``now_s`` and set its rate from the current demand."""
        for b in self.floors:
            fr = self.floor_rate(b)
            self._floor[b].advance(now_s, fr, fr * self.burst_s)
            ir = self.idle_rate(b, now_s)
            self._idle[b].advance(now_s, ir, ir * self.burst_s)

    def charge(self, band: str, kind: ShareKind, cost_s: float, now_s: float) -> None:
        """A dispatch of ``cost_s`` engine-seconds was booked for ``band``, charged to
        ``kind``."""
        self.advance(now_s)
        decay = self._decayed(now_s)
        for b in self._demand:
            self._demand[b] *= decay
        self._demand_at_s = max(self._demand_at_s, now_s)
        self._demand[band] = self._demand.get(band, 0.0) + cost_s
        self.spent_s[band] = self.spent_s.get(band, 0.0) + cost_s
        if kind == "floor":
            self._floor[band].credit -= cost_s
        elif kind == "idle":
            self._idle[band].credit -= cost_s

    def _decayed(self, now_s: float) -> float:
        dt = now_s - self._demand_at_s
        return math.exp(-dt / self.window_s) if dt > 0 else 1.0

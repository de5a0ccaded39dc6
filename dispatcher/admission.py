"""Admission policy: concurrency limits and priority aging (pure: time is passed in).

Aging rule. Each band has a *delay* ``d_band`` (interactive 0 s by default). A request that
arrived at ``t`` gets the virtual deadline ``key = t + d_band``, and queued requests are served
in ascending key order (earliest virtual deadline first), subject to the limits. Waiting lowers
nothing; it is newer arrivals that sort behind: a request that arrives after ``key_R`` has a key
greater than ``key_R``, so it can never overtake ``R``.

Starvation bound: a request ``R`` is overtaken only by requests that arrived before ``key_R``,
a finite set, so ``R`` runs as soon as those ahead of it are served and capacity frees. In
particular, once a batch request has waited ``d_batch - d_interactive`` seconds, no interactive
request arriving from then on goes before it. ``test_starvation_bound`` in
``tests/test_scheduler.py`` proves both.

This order holds between bands within their shares. Offline bands (those with an engine-time
floor, ``band_floors``; ``batch`` by default) never overtake online work beyond their floor:
while an online request waits, an offline one is dispatched only on its floor's engine time,
and the floor bounds its starvation instead (:mod:`sluice.dispatcher.shares`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sluice.dispatcher.defaults import MAX_PROMPT_TOKENS
from sluice.dispatcher.quotas import Quotas
from sluice.dispatcher.shares import (
    DEFAULT_BAND_FLOORS,
    DEFAULT_BURST_S,
    DEFAULT_DEMAND_WINDOW_S,
    DEFAULT_IDLE_HEADROOM,
)
from sluice.schemas.names import DEFAULT_BANDS

DEFAULT_BAND_DELAY_S: Mapping[str, float] = {"interactive": 0.0, "standard": 2.0, "batch": 10.0}


@dataclass(frozen=True)
class AdmissionConfig:
    """Limits and aging for one dispatcher.

    ``global_limit`` caps the requests running at once across the fleet; ``band_limits`` caps
    each band (a band missing from it is capped only by the global limit). ``band_delay_s`` is
    the aging delay of each band (see the module docstring). ``quotas`` are each model's own
    limits (total, per band, per tenant: :mod:`sluice.dispatcher.quotas`).

    ``band_shares`` is borrowing and degradation. A band with a share may use idle room beyond
    it (up to its limit), but while a more urgent band (earlier in ``bands``) has requests
    waiting, it gets no new room beyond its share: as its requests finish, the room goes to the
    urgent band (offline gives way to online), and it takes its share back, and more, once the
    urgent band no longer waits. A band always gets its share, so a share above 0 bounds how long
    its requests can be held back. A band without a share is never held back this way. These
    shares count requests (slots); ``band_floors`` are shares in engine time, the default unit.

    ``band_floors`` are the engine-time shares of offline bands (fractions of the fleet, see
    :mod:`sluice.dispatcher.shares`): a band with a floor gets that share of the fleet's engine
    time always, and the idle capacity (less ``idle_headroom``) only while no more urgent band
    waits. None: ``batch`` gets 3 % if it is one of the bands. A band without a floor is online
    work: it is never held back for offline work.
    """

    bands: tuple[str, ...] = DEFAULT_BANDS
    global_limit: int = 64
    band_limits: Mapping[str, int] = field(default_factory=dict)
    band_delay_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_BAND_DELAY_S))
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    max_attempts: int = 3
    quotas: Quotas = field(default_factory=Quotas)
    band_shares: Mapping[str, int] = field(default_factory=dict)
    band_floors: Mapping[str, float] | None = None
    idle_headroom: float = DEFAULT_IDLE_HEADROOM
    demand_window_s: float = DEFAULT_DEMAND_WINDOW_S
    burst_s: float = DEFAULT_BURST_S

    @property
    def floors(self) -> dict[str, float]:
        """The engine-time floors in force (the default if ``band_floors`` is None)."""
        if self.band_floors is None:
            return {b: f for b, f in DEFAULT_BAND_FLOORS.items() if b in self.bands}
        return dict(self.band_floors)

    def __post_init__(self) -> None:
        if not self.bands:
            raise ValueError("at least one band is required")
        if self.global_limit < 1:
            raise ValueError("global_limit must be >= 1")
        named = set(self.band_limits) | set(self.band_delay_s) | set(self.band_shares)
        named |= set(self.floors)
        unknown = named - set(self.bands)
        if unknown:
            raise ValueError(f"limits, delays or shares for unknown bands: {sorted(unknown)}")
        if any(v < 0 for v in self.band_shares.values()):
            raise ValueError("band shares must be >= 0")
        if any(not 0 <= v <= 1 for v in self.floors.values()) or sum(self.floors.values()) > 1:
            raise ValueError("band floors are fractions of the fleet: each within [0, 1], sum <= 1")
        if self.floors and self.bands[0] in self.floors:
            raise ValueError(f"the most urgent band {self.bands[0]!r} cannot have a floor")
        if not 0 <= self.idle_headroom < 1 or self.demand_window_s <= 0 or self.burst_s <= 0:
            raise ValueError("idle_headroom within [0, 1), demand_window_s and burst_s > 0")
        if any(v < 0 for v in self.band_limits.values()):
            raise ValueError("band limits must be >= 0")
        if any(v < 0 for v in self.band_delay_s.values()):
            raise ValueError("band delays must be >= 0")
        for model, q in [*self.quotas.models.items(), ("(default)", self.quotas.default)]:
            unknown = set(q.band_limits) - set(self.bands)
            if unknown:
                raise ValueError(f"quota of model {model} names unknown bands: {sorted(unknown)}")

    def delay_s(self, band: str) -> float:
        """The aging delay of ``band`` (bands not listed get the largest configured delay)."""
        if band in self.band_delay_s:
            return self.band_delay_s[band]
        return max(self.band_delay_s.values(), default=0.0)

    def band_limit(self, band: str) -> int:
        """The concurrency cap of ``band``."""
        return self.band_limits.get(band, self.global_limit)


def priority_key(arrived_s: float, band_delay_s: float) -> float:
    """The virtual deadline that orders queued requests (smaller runs first)."""
    return arrived_s + band_delay_s

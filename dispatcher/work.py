"""The scheduler's plain data: requests, workers, decisions, bookings and outcomes (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sluice.dispatcher.frozen import fast_init
from sluice.dispatcher.routing import Choice, RouteRequest
from sluice.dispatcher.shares import ShareKind
from sluice.schemas.models import Rejection


@fast_init
@dataclass(frozen=True)
class Request:
    """A request as the scheduler holds it. ``arrived_s`` and ``deadline_s`` are on the
    caller's clock (the same clock as every ``now_s``)."""

    request_id: str
    band: str
    model: str
    tenant: str
    prompt_tokens: int
    max_tokens: int
    arrived_s: float
    deadline_s: float | None = None
    block_hashes: tuple[int, ...] = ()
    attempt: int = 1
    """The attempt this request will run as when next dispatched."""
    engine_ms: int = 0
    """Its estimated engine time at a median worker without cache hits, in milliseconds
    (priced by the scheduler when it is queued; what ``engine_ms`` quotas count)."""
    affinity_key: int | None = None
    """Its session's key, when the producer named a session."""
    failed_on: frozenset[str] = frozenset()
    """Workers an earlier attempt failed on (or was lost with): a plan offers it to them
    again only once no other worker of its model may take work
    (:func:`sluice.dispatcher.planner.kept_off`)."""

    def priced(self, engine_ms: int) -> Request:
        """The same request with its estimated engine time set."""
        return self._copy(self.attempt, engine_ms, self.failed_on)

    def next_attempt(self, failed_on: str | None = None) -> Request:
        """The same request, to run as its next attempt; ``failed_on``: the worker the last
        attempt failed on."""
        on = self.failed_on if failed_on is None else self.failed_on | {failed_on}
        return self._copy(self.attempt + 1, self.engine_ms, on)

    def as_attempt(self, attempt: int) -> Request:
        """The same request, as attempt ``attempt``."""
        return self._copy(attempt, self.engine_ms, self.failed_on)

    def _copy(self, attempt: int, engine_ms: int, failed_on: frozenset[str]) -> Request:
        # The constructor itself: dataclasses.replace() costs twice as much, once per request.
        return Request(
            self.request_id,
            self.band,
            self.model,
            self.tenant,
            self.prompt_tokens,
            self.max_tokens,
            self.arrived_s,
            self.deadline_s,
            self.block_hashes,
            attempt,
            engine_ms,
            self.affinity_key,
            failed_on,
        )

    @property
    def work_tokens(self) -> int:
        """The work the request brings to a worker, in tokens."""
        return self.prompt_tokens + self.max_tokens

    def route_view(self) -> RouteRequest:
        """What a policy may know of it (made once: the plan, the booking and the completion
        each hand it to the policy)."""
        # Kept in the instance's dict, which a frozen dataclass allows (functools'
        # cached_property does the same behind a lock: 0.58 against 0.23 µs on Python 3.11,
        # docs/BENCHMARKS.md). A copy
        # (priced(), next_attempt()) is a new instance, and with it a new view.
        d = self.__dict__
        view: RouteRequest | None = d.get("_route_view")
        if view is None:
            view = d["_route_view"] = RouteRequest(
                self.request_id,
                self.model,
                self.prompt_tokens,
                self.max_tokens,
                self.block_hashes,
                self.affinity_key,
            )
        return view


@fast_init
@dataclass(frozen=True)
class WorkerInfo:
    """A live worker as its last heartbeat described it."""

    worker_id: str
    models: frozenset[str]
    capacity: int
    draining: bool = False
    reported_pending_tokens: int = 0
    reported_in_flight: frozenset[str] = frozenset()
    reported_prefill_tokens: int = 0
    """Prompt tokens still to prefill at the heartbeat."""
    reported_s: float = 0.0
    """When the heartbeat arrived, on the scheduler's clock."""


@fast_init
@dataclass(frozen=True)
class Dispatch:
    """Decision: offer ``request`` to ``worker_id``."""

    request: Request
    worker_id: str
    choice: Choice | None = None
    """The policy's full decision (expected hit, reason, score terms)."""
    share: ShareKind = ""
    """The engine-time budget it is charged to (:mod:`sluice.dispatcher.shares`)."""
    engine_s: float = 0.0
    """Its estimated cost on that worker, in engine-seconds."""

    @property
    def expected_hit_tokens(self) -> int:
        return self.choice.expected_hit_tokens if self.choice else 0

    @property
    def expected_prefill_tokens(self) -> int:
        """The prefill this decision brings to its worker: the prompt less the expected hit
        (at least one token: engines always compute one)."""
        return max(1, self.request.prompt_tokens - self.expected_hit_tokens)


@fast_init
@dataclass(frozen=True)
class Booking:
    """A request running on a worker, as this dispatcher booked it."""

    request: Request
    worker_id: str
    booked_s: float
    expected_hit_tokens: int = 0


@fast_init
@dataclass(frozen=True)
class Ended:
    """A request that leaves the scheduler without running (a typed rejection)."""

    request: Request
    rejection: Rejection


@fast_init
@dataclass(frozen=True)
class EnqueueOutcome:
    """``queued``; ``adopted``: a worker's last heartbeat reports running it, so it was booked
    there at once (a dispatcher that took over gets it redelivered); ``duplicate``: queued or
    running already; ``rejected``: with ``rejection``."""

    status: Literal["queued", "adopted", "duplicate", "rejected"]
    rejection: Rejection | None = None


@dataclass(frozen=True)
class BandSnapshot:
    band: str
    queued: int
    running: int
    limit: int
    oldest_wait_s: float

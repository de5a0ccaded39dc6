"""Reconciliation (pure): the dispatcher's books against what the workers report running.

Every heartbeat lists the requests its worker holds (``in_flight``). Compared with the books,
in both directions:

- **orphaned**: booked on a worker whose heartbeats, for longer than ``grace_s`` after the
  booking, never list it, and that no other worker lists either (the worker lost it without a
  report: an engine that dropped it, a lost failure report). It is released (its quota
  returns) and queued again as its next attempt, as a failure would be; a completion of it
  that still comes ends it wherever it is then.
- **moved**: booked on one worker, reported by another only: the booking follows the report.
- **adopted**: reported by a worker and queued here (not booked): booked there.
- **unknown**: reported by a worker and neither queued nor booked here (it ended here, or
  another dispatcher's): reported only; its worker finishes it and its result is deduplicated.

:func:`find_drift` only reads; :meth:`Scheduler.reconcile` applies what it found.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sluice.dispatcher.work import Booking, Ended, Request, WorkerInfo


@dataclass(frozen=True)
class Drift:
    """What the books and the reports disagree on (request ids, sorted)."""

    orphaned: tuple[str, ...] = ()
    moved: tuple[tuple[str, str], ...] = ()
    """(request id, the worker that reports it)."""
    adopted: tuple[tuple[str, str], ...] = ()
    """(request id, the worker that reports it)."""
    unknown: tuple[tuple[str, str], ...] = ()
    """(request id, the worker that reports it)."""

    @property
    def size(self) -> int:
        return len(self.orphaned) + len(self.moved) + len(self.adopted) + len(self.unknown)


@dataclass
class Reconciliation:
    """What reconciling changed: the drift, and the orphans' retries."""

    drift: Drift
    requeued: list[Request] = field(default_factory=list)
    ended: list[Ended] = field(default_factory=list)


def find_drift(
    bookings: Iterable[Booking],
    workers: Mapping[str, WorkerInfo],
    queued: Iterable[str],
    now_s: float,
    grace_s: float,
) -> Drift:
    """Compare the books with the workers' last reports (changes nothing). A booking is an
    orphan only when its worker reported at least ``grace_s`` after the booking and the
    booking is older than ``grace_s``: a report that may predate it proves nothing."""
    reported_by: dict[str, str] = {}
    for w, report in workers.items():
        for rid in report.reported_in_flight:
            reported_by.setdefault(rid, w)
    booked: dict[str, str] = {}
    orphaned: list[str] = []
    moved: list[tuple[str, str]] = []
    for b in bookings:
        rid, w = b.request.request_id, b.worker_id
        booked[rid] = w
        info = workers.get(w)
        if info is None or rid in info.reported_in_flight:
            continue
        other = reported_by.get(rid)
        if other is not None:
            moved.append((rid, other))
        elif now_s - b.booked_s > grace_s and info.reported_s - b.booked_s > grace_s:
            orphaned.append(rid)
    queued_ids = set(queued)
    adopted: list[tuple[str, str]] = []
    unknown: list[tuple[str, str]] = []
    for rid, w in reported_by.items():
        if rid in booked:
            continue
        (adopted if rid in queued_ids else unknown).append((rid, w))
    return Drift(
        tuple(sorted(orphaned)),
        tuple(sorted(moved)),
        tuple(sorted(adopted)),
        tuple(sorted(unknown)),
    )

"""The books (pure): what runs where, and how much of every quota level it uses.

A booking is made once, when its offer goes out (``book``; the scheduler confirms it once the
worker accepted, and ``restamp`` then dates it from the acceptance), and released once, when
the request completes, fails, loses its worker or its worker refused it (``release``). The
books also keep, per worker, the prefill expected from bookings its last heartbeat did not
list yet, so that routing counts work the worker has not reported.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from sluice.dispatcher.quotas import Level, Usage
from sluice.dispatcher.work import Booking


class Books:
    """Bookings by request, band and worker, and quota usage."""

    def __init__(self) -> None:
        self._running: dict[str, Booking] = {}
        self.by_band: Counter[str] = Counter()
        self._by_worker: dict[str, set[str]] = {}
        self._tokens: Counter[str] = Counter()
        # Per worker: booked requests its last heartbeat did not list yet -> prefill expected.
        self._unreported: dict[str, dict[str, int]] = {}
        self._unreported_sum: Counter[str] = Counter()
        self.usage = Usage()

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._running

    def get(self, request_id: str) -> Booking | None:
        return self._running.get(request_id)

    def bookings(self) -> Iterable[Booking]:
        return self._running.values()

    def on(self, worker_id: str) -> set[str]:
        """Request ids booked on ``worker_id`` (the live set: do not change it)."""
        return self._by_worker.get(worker_id, set())

    def tokens_on(self, worker_id: str) -> int:
        """Prompt plus maximum output tokens of the requests booked on ``worker_id``."""
        return self._tokens[worker_id]

    def unreported_prefill(self, worker_id: str) -> int:
        return self._unreported_sum[worker_id]

    def book(
        self,
        booking: Booking,
        levels: Iterable[Level],
        amount: int,
        *,
        reported: bool,
        expected_prefill_tokens: int,
    ) -> None:
        """Record a booking. ``reported``: the worker's last heartbeat already lists it."""
        r, w = booking.request, booking.worker_id
        self._running[r.request_id] = booking
        self.by_band[r.band] += 1
        self._by_worker.setdefault(w, set()).add(r.request_id)
        self._tokens[w] += r.work_tokens
        self.usage.add(levels, amount)
        if not reported:
            pending = self._unreported.setdefault(w, {})
            self._unreported_sum[w] += expected_prefill_tokens - pending.get(r.request_id, 0)
            pending[r.request_id] = expected_prefill_tokens

    def restamp(self, request_id: str, booked_s: float) -> None:
        """Date a booking from ``booked_s`` (its worker's acceptance): reconciliation's grace
        counts from there, as it did when bookings were made only after the acceptance."""
        b = self._running[request_id]
        self._running[request_id] = Booking(b.request, b.worker_id, booked_s, b.expected_hit_tokens)

    def release(self, request_id: str, levels: Iterable[Level], amount: int) -> Booking:
        booking = self._running.pop(request_id)
        r, w = booking.request, booking.worker_id
        self.by_band[r.band] -= 1
        self._by_worker.get(w, set()).discard(request_id)
        self._tokens[w] -= r.work_tokens
        self.usage.remove(levels, amount)
        self._unreported_sum[w] -= self._unreported.get(w, {}).pop(request_id, 0)
        return booking

    def reported(self, worker_id: str, in_flight: frozenset[str]) -> None:
        """A heartbeat listed ``in_flight``: bookings it lists (or that ended) are reported."""
        self._by_worker.setdefault(worker_id, set())
        pending = self._unreported.get(worker_id)
        if pending:
            booked = self._by_worker[worker_id]
            for rid in [r for r in pending if r in in_flight or r not in booked]:
                self._unreported_sum[worker_id] -= pending.pop(rid)

    def forget_worker(self, worker_id: str) -> list[str]:
        """Drop a worker's bookkeeping; returns the requests still booked on it (sorted), which
        the caller releases."""
        booked = sorted(self._by_worker.pop(worker_id, set()))
        self._tokens.pop(worker_id, None)
        self._unreported.pop(worker_id, None)
        self._unreported_sum.pop(worker_id, None)
        return booked

    def drift(self, worker_id: str, in_flight: frozenset[str], now_s: float, grace_s: float) -> int:
        """Bookings older than ``grace_s`` on ``worker_id`` that ``in_flight`` does not list."""
        return sum(
            1
            for rid in self._by_worker.get(worker_id, ())
            if now_s - self._running[rid].booked_s > grace_s and rid not in in_flight
        )

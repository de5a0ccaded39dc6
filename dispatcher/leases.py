"""Worker leases (pure): a worker is alive while its heartbeats keep arriving.

Each lease also remembers the worker's *registration* (a number the agent raises whenever it
registers afresh: at start, and after a remove notice). A lease that expires is *removed*: the
table keeps its registration, so that heartbeats of that registration (a worker that was
silent, say stopped by ``SIGSTOP``, and comes back without having seen its remove notice yet)
are told apart from a fresh registration. Registration 0 is an agent that predates them: its
heartbeats are always taken as they come.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from sluice.dispatcher.defaults import REMOVED_WORKERS_MAX

Standing = Literal["current", "stale", "replaced"]
"""How a heartbeat stands against the table: ``current`` (renew the lease), ``stale`` (of a
registration that was removed, or older than the lease's: ignore it), ``replaced`` (a newer
registration of a worker holding a lease: what the old one ran is gone)."""


class LeaseTable:
    """Lease bookkeeping: ``renew`` on each heartbeat, ``expired`` finds the silent ones."""

    def __init__(self, lease_s: float, max_removed: int = REMOVED_WORKERS_MAX) -> None:
        """``max_removed``: removed registrations remembered at most (oldest forgotten first:
        a worker that never comes back must not be remembered forever)."""
        if lease_s <= 0 or max_removed < 1:
            raise ValueError("lease_s must be > 0 and max_removed >= 1")
        self.lease_s = lease_s
        self.max_removed = max_removed
        self._last_s: dict[str, float] = {}
        self._registration: dict[str, int] = {}
        self._removed: dict[str, int] = {}

    def standing(self, worker_id: str, registration: int) -> Standing:
        """How a heartbeat of ``registration`` stands (see :data:`Standing`)."""
        if registration == 0:
            return "current"
        removed = self._removed.get(worker_id)
        if removed is not None and registration <= removed:
            return "stale"
        known = self._registration.get(worker_id, 0)
        if worker_id not in self._last_s or known == 0 or registration == known:
            return "current"
        return "replaced" if registration > known else "stale"

    def renew(self, worker_id: str, now_s: float, registration: int = 0) -> bool:
        """Record a (current) heartbeat; returns True if the worker was not known (a new
        lease)."""
        new = worker_id not in self._last_s
        self._last_s[worker_id] = max(now_s, self._last_s.get(worker_id, now_s))
        self._registration[worker_id] = registration
        removed = self._removed.get(worker_id)
        if removed is not None and registration > removed:
            del self._removed[worker_id]
        return new

    def expired(self, now_s: float) -> list[str]:
        """Workers whose last heartbeat is older than the lease, oldest first."""
        late = [(t, w) for w, t in self._last_s.items() if now_s - t > self.lease_s]
        return [w for _, w in sorted(late)]

    def age_s(self, worker_id: str, now_s: float) -> float:
        """Seconds since the worker's last heartbeat (0 for a worker without a lease)."""
        last = self._last_s.get(worker_id)
        return 0.0 if last is None else max(0.0, now_s - last)

    def renew_all(self, now_s: float) -> None:
        """Give every known worker a fresh lease: after *we* were cut off from the broker,
        their silence says nothing about them."""
        for worker_id in self._last_s:
            self._last_s[worker_id] = max(now_s, self._last_s[worker_id])

    def remove(self, worker_id: str) -> int:
        """Take a worker's lease away (it expired): returns its registration, remembered so
        that its later heartbeats of that registration are ``stale``."""
        self._last_s.pop(worker_id, None)
        registration = self._registration.pop(worker_id, 0)
        if registration:
            self._removed.pop(worker_id, None)  # re-inserted last: the newest removal
            self._removed[worker_id] = registration
            while len(self._removed) > self.max_removed:
                del self._removed[next(iter(self._removed))]
        return registration

    def removed(self, worker_id: str) -> int | None:
        """The registration whose lease was taken away, until the worker registers afresh."""
        return self._removed.get(worker_id)

    def drop(self, worker_id: str) -> None:
        """Forget a worker (it left)."""
        self._last_s.pop(worker_id, None)
        self._registration.pop(worker_id, None)
        self._removed.pop(worker_id, None)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._last_s

    def __len__(self) -> int:
        return len(self._last_s)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._last_s))

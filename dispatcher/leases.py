"""Worker leases (pure): a worker is alive while its heartbeats keep arriving."""

from __future__ import annotations


class LeaseTable:
    """Lease bookkeeping: ``renew`` on each heartbeat, ``expired`` finds the silent ones."""

    def __init__(self, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.lease_s = lease_s
        self._last_s: dict[str, float] = {}

    def renew(self, worker_id: str, now_s: float) -> bool:
        """Record a heartbeat; returns True if the worker was not known (a new lease)."""
        new = worker_id not in self._last_s
        self._last_s[worker_id] = max(now_s, self._last_s.get(worker_id, now_s))
        return new

    def expired(self, now_s: float) -> list[str]:
        """Workers whose last heartbeat is older than the lease, oldest first."""
        late = [(t, w) for w, t in self._last_s.items() if now_s - t > self.lease_s]
        return [w for _, w in sorted(late)]

    def renew_all(self, now_s: float) -> None:
        """Give every known worker a fresh lease: after *we* were cut off from the broker,
        their silence says nothing about them."""
        for worker_id in self._last_s:
            self._last_s[worker_id] = max(now_s, self._last_s[worker_id])

    def drop(self, worker_id: str) -> None:
        """Forget a worker (its lease ended, or it left)."""
        self._last_s.pop(worker_id, None)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._last_s

    def __len__(self) -> int:
        return len(self._last_s)

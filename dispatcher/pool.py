"""The workers that can take work, per model, in load order (pure).

The scheduler keeps this up to date as workers heartbeat, are booked, finish and leave, so a
decision never looks at the whole fleet: the planner reads the few least-loaded workers of a
model from the front of its order, and any other worker by id, at a cost that does not grow
with the number of workers (each order is a :mod:`~sluice.dispatcher.orders` order: an update
costs O(log n) comparisons of doubles and one move of the pairs between its old place and its
new).

More orders, by booked share (booked / capacity) and by prefill queued (reported by the worker
plus booked here since: the queue at its last report, before it drained), answer with the
first which workers may be under a share, a load key and a queue without reading the others:
on a fleet whose workers are nearly all over the hard limit, a decision finds the few a
sticky prefix could still go to at the front of one of them. An order by report time gives
the oldest reports, which bound how much the other queues drained since.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping

from sluice.dispatcher.orders import WorkerOrder, new_order

_Entry = tuple[float, str]
_Placed = tuple[float, float, float, float]
"""A worker's load key, booked share, prefill queued and report time."""
_INF = float("inf")
_NONE: Mapping[str, float] = {}
_EMPTY: WorkerOrder = new_order()
"""The order of a model without workers with room (never changed)."""
_STALE_TRIES = (0, 1, 2, 4, 8, 16)
"""How many of the oldest reports :meth:`FreeWorkers.under` tries taking whole."""


def _first(front: tuple[int, WorkerOrder]) -> int:
    return front[0]


class FreeWorkers:
    """Per model: the live workers with free capacity, ordered by a load key (lowest first,
    ties by worker id), by booked share, by prefill queued and by report time."""

    def __init__(self) -> None:
        self._order: dict[str, WorkerOrder] = {}
        self._keys: dict[str, dict[str, float]] = {}
        self._shares: dict[str, WorkerOrder] = {}
        self._queues: dict[str, WorkerOrder] = {}
        self._reports: dict[str, WorkerOrder] = {}
        self._placed: dict[str, tuple[_Placed, frozenset[str]]] = {}

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._placed

    def put(
        self,
        worker_id: str,
        models: Iterable[str],
        key: float,
        share: float = 0.0,
        queue: float = 0.0,
        reported_s: float = 0.0,
    ) -> None:
        """``worker_id`` has room now, with this load key, this share of its capacity
        booked, this many prefill tokens queued (at its last report, which was at
        ``reported_s``, and booked since; placed or moved)."""
        models = frozenset(models)
        placed = (key, share, queue, reported_s)
        old = self._placed.get(worker_id)
        if old is not None and old[1] == models:
            was = old[0]
            if was == placed:
                return
            # Moved: only the orders whose value changed (a booking leaves the report time,
            # a heartbeat often the share).
            self._placed[worker_id] = (placed, models)
            k0, s0, q0, t0 = was
            for m in models:
                if k0 != key:
                    self._order[m].move(k0, key, worker_id)
                    self._keys[m][worker_id] = key
                if s0 != share:
                    self._shares[m].move(s0, share, worker_id)
                if q0 != queue:
                    self._queues[m].move(q0, queue, worker_id)
                if t0 != reported_s:
                    self._reports[m].move(t0, reported_s, worker_id)
            return
        if old is not None:
            self.discard(worker_id)
        self._placed[worker_id] = (placed, models)
        for m in models:
            for orders, value in zip(self._orders(), placed, strict=True):
                order = orders.get(m)
                if order is None:
                    order = orders[m] = new_order()
                order.add(value, worker_id)
            self._keys.setdefault(m, {})[worker_id] = key

    def _orders(self) -> tuple[dict[str, WorkerOrder], ...]:
        return self._order, self._shares, self._queues, self._reports

    def discard(self, worker_id: str) -> None:
        """``worker_id`` has no room, is draining, refused or gone."""
        old = self._placed.pop(worker_id, None)
        if old is None:
            return
        placed, models = old
        for m in models:
            for orders, value in zip(self._orders(), placed, strict=True):
                order = orders[m]
                order.remove(value, worker_id)
                if not order:
                    del orders[m]
            del self._keys[m][worker_id]
            if not self._keys[m]:
                del self._keys[m]

    def under(
        self,
        model: str,
        share: float,
        key: float,
        queue: float = _INF,
        drain: float = 0.0,
        now_s: float = 0.0,
    ) -> tuple[int, Iterator[str]]:
        """Of ``model``'s workers with room, a set that holds every one with less than
        ``share`` of its capacity booked, a load key under ``key``, and a prefill queue
        under ``queue`` tokens once what it reported drained at ``drain`` tokens/s since its
        report: the shortest of the orders' fronts, or of the queue front and the oldest
        reports together (at most how many, and they, each once)."""
        shares, keys = self._shares.get(model, _EMPTY), self._order.get(model, _EMPTY)
        n, order = min(
            (shares.count_below(share), shares), (keys.count_below(key), keys), key=_first
        )
        if self._reports.get(model) and queue < _INF:
            q, stale = self._queue_front(model, queue, drain, now_s)
            if q + len(stale) < n:
                queues = self._queues[model]
                return q + len(stale), itertools.chain(
                    stale, (w for _, w in itertools.islice(queues, q))
                )
        return n, (w for _, w in itertools.islice(order, n))

    def _queue_front(
        self, model: str, queue: float, drain: float, now_s: float
    ) -> tuple[int, list[str]]:
        """The workers that may be under ``queue`` once drained, as the first ``q`` of the
        queue order (those queued at most a limit when they reported) and the ones of the k
        oldest reports that are not among them: (q, those), k chosen for the fewest in all.
        No other worker drained more than the (k+1)-th oldest report lets it, so that one
        silent worker does not widen the front for the whole fleet."""
        reports, queues = self._reports[model], self._queues[model]
        tries = []  # (in all, k, q, limit); the caller has reports, so k = 0 is tried
        for k in _STALE_TRIES:
            if k >= len(reports):
                break
            age = now_s - reports[k][0]
            limit = queue + (age if age > 0.0 else 0.0) * drain
            q = queues.count_at_most(limit)
            tries.append((q + k, k, q, limit))
            if drain <= 0.0:
                break  # nothing drains: the oldest reports change nothing
        _, k, q, limit = min(tries)
        placed = self._placed
        stale = [w for _, w in itertools.islice(reports, k) if placed[w][0][2] > limit]
        return q, stale

    def count(self, model: str) -> int:
        """Workers of ``model`` with room."""
        return len(self._order.get(model, _EMPTY))

    def models(self) -> Iterable[str]:
        """Models with at least one worker with room."""
        return self._order.keys()

    def ordered(self, model: str) -> Iterator[_Entry]:
        """(key, worker) of ``model``'s workers with room, least loaded first (do not change
        the pool while iterating)."""
        return iter(self._order.get(model, _EMPTY))

    def entries(self, model: str) -> WorkerOrder:
        """(key, worker) of ``model``'s workers with room, least loaded first (a live view:
        do not change the pool while reading it)."""
        return self._order.get(model, _EMPTY)

    def workers(self, model: str) -> list[str]:
        """``model``'s workers with room, least loaded first."""
        return [w for _, w in self._order.get(model, _EMPTY)]

    def keys(self, model: str) -> Mapping[str, float]:
        """Worker -> load key of ``model``'s workers with room (a live view: do not change)."""
        return self._keys.get(model, _NONE)

    def key(self, worker_id: str) -> float | None:
        placed = self._placed.get(worker_id)
        return None if placed is None else placed[0][0]

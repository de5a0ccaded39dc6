"""The workers that can take work, per model, in load order (pure).

The scheduler keeps this up to date as workers heartbeat, are booked, finish and leave, so a
decision never looks at the whole fleet: the planner reads the few least-loaded workers of a
model from the front of its order, and any other worker by id, at a cost that does not grow
with the number of workers (an update costs O(log n) comparisons and one list move).

A second order, by booked share (booked / capacity), answers with the first which workers may
be under a share and a load key without reading the others: on a fleet whose workers are
nearly all over the hard limit, a decision finds the few a sticky prefix could still go to at
the front of one of them.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence

_Entry = tuple[float, str]
_NONE: Mapping[str, float] = {}


class FreeWorkers:
    """Per model: the live workers with free capacity, ordered by a load key (lowest first,
    ties by worker id), and by booked share."""

    def __init__(self) -> None:
        self._order: dict[str, list[_Entry]] = {}
        self._keys: dict[str, dict[str, float]] = {}
        self._shares: dict[str, list[_Entry]] = {}
        self._placed: dict[str, tuple[float, float, frozenset[str]]] = {}

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._placed

    def put(self, worker_id: str, models: Iterable[str], key: float, share: float = 0.0) -> None:
        """``worker_id`` has room now, with this load key and this share of its capacity
        booked (placed or moved)."""
        models = frozenset(models)
        old = self._placed.get(worker_id)
        if old == (key, share, models):
            return
        if old is not None:
            self.discard(worker_id)
        self._placed[worker_id] = (key, share, models)
        for m in models:
            bisect.insort(self._order.setdefault(m, []), (key, worker_id))
            bisect.insort(self._shares.setdefault(m, []), (share, worker_id))
            self._keys.setdefault(m, {})[worker_id] = key

    def discard(self, worker_id: str) -> None:
        """``worker_id`` has no room, is draining, refused or gone."""
        old = self._placed.pop(worker_id, None)
        if old is None:
            return
        key, share, models = old
        for m in models:
            order, shares = self._order[m], self._shares[m]
            del order[bisect.bisect_left(order, (key, worker_id))]
            del shares[bisect.bisect_left(shares, (share, worker_id))]
            del self._keys[m][worker_id]
            if not order:
                del self._order[m]
                del self._keys[m]
                del self._shares[m]

    def under(self, model: str, share: float, key: float) -> tuple[int, Iterator[str]]:
        """Of ``model``'s workers with room, a set that holds every one with less than
        ``share`` of its capacity booked and a load key under ``key``: the shorter of the
        two orders' fronts (how many, and they)."""
        shares, order = self._shares.get(model, ()), self._order.get(model, ())
        by_share = bisect.bisect_left(shares, (share,))
        by_key = bisect.bisect_left(order, (key,))
        front = shares if by_share <= by_key else order
        n = min(by_share, by_key)
        return n, (w for _, w in itertools.islice(front, n))

    def count(self, model: str) -> int:
        """Workers of ``model`` with room."""
        return len(self._order.get(model, ()))

    def models(self) -> Iterable[str]:
        """Models with at least one worker with room."""
        return self._order.keys()

    def ordered(self, model: str) -> Iterator[_Entry]:
        """(key, worker) of ``model``'s workers with room, least loaded first (do not change
        the pool while iterating)."""
        return iter(self._order.get(model, ()))

    def entries(self, model: str) -> Sequence[_Entry]:
        """(key, worker) of ``model``'s workers with room, least loaded first (a live view:
        do not change the pool while reading it)."""
        return self._order.get(model, ())

    def workers(self, model: str) -> list[str]:
        """``model``'s workers with room, least loaded first."""
        return [w for _, w in self._order.get(model, ())]

    def keys(self, model: str) -> Mapping[str, float]:
        """Worker -> load key of ``model``'s workers with room (a live view: do not change)."""
        return self._keys.get(model, _NONE)

    def key(self, worker_id: str) -> float | None:
        placed = self._placed.get(worker_id)
        return None if placed is None else placed[0]

    def share(self, worker_id: str) -> float | None:
        """The worker's booked share, as last put."""
        placed = self._placed.get(worker_id)
        return None if placed is None else placed[1]

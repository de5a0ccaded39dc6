"""Prefix affinity (pure): which workers a prefix sticks to, and how many it may have.

A *prefix key* names a request's leading ``key_blocks`` blocks (the chained hash of the last of
them, or of its last full block when shorter). For each key this keeps:

- its **replicas**: the workers recently routed that prefix, each until ``window_s`` after it
  was last used (stickiness: the policy keeps the prefix on them inside that window);
- its **frequency**: an exponentially decayed request count (time constant ``tau_s``), so its
  *share* of recent traffic is known. A prefix's **replica budget** grows with that share: a
  prefix carrying a fraction ``f`` of the traffic of ``n`` workers may use
  ``ceil(f x n x headroom)`` of them (at least 1, at most ``max_replicas``): a prefix gets more
  holders only when it is hot, enough for its traffic to spread without herding.

Reads (``replicas``, ``budget``) never change anything; ``used`` records a booking. Memory is
bounded by ``max_keys`` (least recently used keys forgotten first).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.dispatcher.defaults import (
    HOT_TAU_S,
    MAX_REPLICAS,
    PREFIX_MAX_KEYS,
    REPLICA_HEADROOM,
    STICKY_WINDOW_S,
)


def prefix_key(block_hashes: Sequence[int], key_blocks: int) -> int | None:
    """The key of a request's leading prefix, or None if it has no full block."""
    if not block_hashes:
        return None
    return block_hashes[min(key_blocks, len(block_hashes)) - 1]


@dataclass(slots=True)
class _Key:
    count: float = 0.0
    at_s: float = 0.0
    replicas: dict[str, float] = field(default_factory=dict)
    """worker -> last used (oldest first: a use moves it last). A plain dict: an OrderedDict
    costs twice the memory, for every one of up to ``max_keys`` keys."""


class Affinity:
    """Replica sets and traffic shares of prefix keys."""

    def __init__(
        self,
        *,
        window_s: float = STICKY_WINDOW_S,
        tau_s: float = HOT_TAU_S,
        headroom: float = REPLICA_HEADROOM,
        max_replicas: int = MAX_REPLICAS,
        max_keys: int = PREFIX_MAX_KEYS,
    ) -> None:
        if window_s <= 0 or tau_s <= 0 or headroom <= 0 or max_replicas < 1 or max_keys < 1:
            raise ValueError("affinity settings must be positive")
        self.window_s = window_s
        self.tau_s = tau_s
        self.headroom = headroom
        self.max_replicas = max_replicas
        self.max_keys = max_keys
        self._keys: OrderedDict[int, _Key] = OrderedDict()
        self._total = _Key()

    def __len__(self) -> int:
        return len(self._keys)

    def _decayed(self, k: _Key, now_s: float) -> float:
        return k.count * math.exp(-max(0.0, now_s - k.at_s) / self.tau_s)

    def share(self, key: int, now_s: float) -> float:
        """The key's fraction of recent traffic (0 for an unknown key)."""
        k = self._keys.get(key)
        total = self._decayed(self._total, now_s)
        if k is None or total <= 0:
            return 0.0
        return min(1.0, self._decayed(k, now_s) / total)

    def budget(self, key: int, workers: int, now_s: float) -> int:
        """How many workers the key may be spread over."""
        need = math.ceil(self.share(key, now_s) * workers * self.headroom)
        return max(1, min(self.max_replicas, workers, need))

    def replicas(self, key: int, now_s: float) -> list[str]:
        """The workers the key sticks to now (used within ``window_s``), oldest use first."""
        k = self._keys.get(key)
        if k is None:
            return []
        return [w for w, t in k.replicas.items() if now_s - t < self.window_s]

    def used(self, key: int, worker_id: str, budget: int, now_s: float) -> None:
        """A request with this key was booked on ``worker_id``. The worker becomes (or stays)
        a replica if the budget has room after expired replicas are dropped."""
        self._total.count = self._decayed(self._total, now_s) + 1.0
        self._total.at_s = now_s
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = _Key()
        else:
            self._keys.move_to_end(key)
        k.count = self._decayed(k, now_s) + 1.0
        k.at_s = now_s
        for w in [w for w, t in k.replicas.items() if now_s - t >= self.window_s]:
            del k.replicas[w]
        if worker_id in k.replicas:
            del k.replicas[worker_id]
            k.replicas[worker_id] = now_s
        elif len(k.replicas) < budget:
            k.replicas[worker_id] = now_s
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def replica_counts(self, now_s: float) -> list[int]:
        """Live replica-set sizes of every key (for metrics)."""
        return [len(self.replicas(key, now_s)) for key in self._keys]

    def remove_worker(self, worker_id: str) -> None:
        for k in self._keys.values():
            k.replicas.pop(worker_id, None)

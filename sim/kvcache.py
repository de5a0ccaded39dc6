"""A KV cache of finite capacity in blocks, with prefix reuse and LRU eviction (pure)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

KVListener = Callable[[str, list[int]], None]
"""Told ``("stored", hashes)`` when blocks enter the cache and ``("removed", [hash])`` when
one is evicted (an engine's KV events)."""


class KVCache:
    """Blocks are identified by chained prefix hashes. A running sequence *pins* its prompt
    blocks (shared between sequences, counted once) and *reserves* private blocks for its
    partial last prompt block and its output. Unpinned blocks stay cached for reuse until space
    is needed, least recently used first."""

    def __init__(self, capacity_blocks: int, listener: KVListener | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.listener = listener
        self._pinned: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._reserved = 0
        self.evicted_blocks = 0
        # The digest journal: blocks reported to the dispatcher, and the changes since the
        # last drain (a block stored and evicted in between cancels out).
        self._reported: set[int] = set()
        self._stored: dict[int, None] = {}
        self._evicted: dict[int, None] = {}

    @property
    def used_blocks(self) -> int:
        return len(self._pinned) + len(self._idle) + self._reserved

    @property
    def busy_blocks(self) -> int:
        """Blocks that running requests hold (pinned or reserved); the idle cached ones are
        free to evict, as vLLM and SGLang count them in their KV usage figures."""
        return len(self._pinned) + self._reserved

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._pinned or block_hash in self._idle

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached."""
        n = 0
        for h in hashes:
            if h not in self._pinned and h not in self._idle:
                break
            n += 1
        return n

    def fits(self, hashes: Sequence[int], reserve_blocks: int) -> bool:
        """Whether pinning ``hashes`` and reserving ``reserve_blocks`` fits, evicting idle
        blocks that are not among ``hashes``."""
        new = 0
        idle_hits = 0
        for h in hashes:
            if h in self._idle:
                idle_hits += 1
            elif h not in self._pinned:
                new += 1
        free = self.capacity_blocks - self.used_blocks
        return new + reserve_blocks <= free + len(self._idle) - idle_hits

    def admit(
        self, hashes: Sequence[int], reserve_blocks: int, *, report: Sequence[int] = ()
    ) -> bool:
        """Pin ``hashes`` and reserve ``reserve_blocks``; False (and no change) if it cannot
        fit even after evicting every idle block. ``report``: those of ``hashes`` to journal
        for the cache digest (see :meth:`drain_digest`)."""
        if not self.fits(hashes, reserve_blocks):
            return False
        new: list[int] = []
        for h in hashes:
            if h in self._idle:
                del self._idle[h]
                self._pinned[h] = 1
            else:
                if h not in self._pinned:
                    new.append(h)
                self._pinned[h] = self._pinned.get(h, 0) + 1
        for h in report:
            if h not in self._reported:
                self._reported.add(h)
                if self._evicted.pop(h, 0) is None:
                    continue  # evicted and stored again since the last drain: no change
                self._stored[h] = None
        self._reserved += reserve_blocks
        self._evict_to_capacity()
        if new and self.listener is not None:
            self.listener("stored", new)
        return True

    def _evict_to_capacity(self) -> None:
        while self.used_blocks > self.capacity_blocks:
            self._evict_oldest()

    def flush(self) -> int:
        """Evict every idle (unpinned) block, as an engine's cache flush does; how many."""
        n = len(self._idle)
        while self._idle:
            self._evict_oldest()
        return n

    def _evict_oldest(self) -> None:
        h, _ = self._idle.popitem(last=False)
        self.evicted_blocks += 1
        if self.listener is not None:
            self.listener("removed", [h])
        if h in self._reported:
            self._reported.discard(h)
            if self._stored.pop(h, 0) is None:
                return  # stored and evicted since the last drain: no change
            self._evicted[h] = None

    def drain_digest(self) -> tuple[list[int], list[int]]:
        """Reported blocks stored and evicted since the last drain."""
        stored, evicted = list(self._stored), list(self._evicted)
        self._stored.clear()
        self._evicted.clear()
        return stored, evicted

    def reported_blocks(self) -> list[int]:
        """Every block currently reported (a digest snapshot)."""
        return list(self._reported)

    def release(self, hashes: Sequence[int], reserve_blocks: int) -> None:
        """Unpin ``hashes`` (they stay cached, most recently used) and free the reservation."""
        for h in hashes:
            refs = self._pinned[h] - 1
            if refs:
                self._pinned[h] = refs
            else:
                del self._pinned[h]
                self._idle[h] = None
        self._reserved -= reserve_blocks

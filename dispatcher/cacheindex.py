"""The cluster cache index (pure): which workers hold which prompt prefix blocks.

Keys are chained block hashes (``sluice.schemas.hashing``), so a block's hash names the whole
prefix up to it and "worker W holds block i" implies W holds blocks 0..i-1 as engines cache
them. Three sources feed it:

- **reports**: digests from agents, as deltas (blocks stored and evicted, numbered) and periodic
  full snapshots; a missed delta number means the worker's view is stale until its next
  snapshot (``apply_delta`` says so);
- **guesses**: what the dispatcher itself routed to a worker, kept for ``guess_ttl_s``;
- **completions**: a finished request's prefix is held by its worker (its reported
  ``cached_tokens``, compared with the hit expected at routing, measures the index's error).

Memory is bounded: at most ``max_blocks`` block hashes, least recently used dropped first.
Lookups cost O(prefix blocks x holders per block), independent of the fleet size.

Two implementations with the same semantics: :class:`PureCacheIndex`, here, is the
reference; ``sluice.dispatcher._cacheindex`` (``dispatcher/_cacheindex.c``) keeps the same
thing in native data (lookups about six times faster, a third of the memory:
docs/BENCHMARKS.md, "A native cache index"). :data:`CacheIndex` is the native one where it
was built (``pip install`` compiles it; without a C compiler the install goes on without it),
else the reference. ``tests/test_cacheindex.py`` drives both with the same random operations
and compares every answer. Block hashes are 64-bit unsigned ints, as the wire's digests carry
them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from sluice.dispatcher.defaults import GUESS_TTL_S, INDEX_MAX_BLOCKS, INDEX_MEMO_MIN_HOLDERS

_REPORTED = float("inf")
_NO_GUESS = float("-inf")


class PureCacheIndex:
    """Chained block hash -> workers holding it, from reports, guesses and corrections.

    A hold is one float, so that a block's holders are a dict of strings to floats (which the
    garbage collector does not track): the time a guess expires, ``inf`` while the worker's
    reports list the block (a guess made meanwhile waits in ``_under``), ``-inf`` for
    neither. Alive means greater than now.
    """

    def __init__(
        self,
        *,
        max_blocks: int = INDEX_MAX_BLOCKS,
        guess_ttl_s: float = GUESS_TTL_S,
        memo_min_holders: int = INDEX_MEMO_MIN_HOLDERS,
    ) -> None:
        if max_blocks < 1 or guess_ttl_s <= 0:
            raise ValueError("max_blocks must be >= 1 and guess_ttl_s > 0")
        if memo_min_holders < 1:
            raise ValueError("memo_min_holders must be >= 1")
        self.max_blocks = max_blocks
        self.guess_ttl_s = guess_ttl_s
        self.memo_min_holders = memo_min_holders
        """The native index's memo threshold (:meth:`match_split`); no memo here."""
        self._blocks: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._under: dict[tuple[int, str], float] = {}
        """(block, worker) -> until when a guess holds under the worker's report."""
        self._seq: dict[str, int] = {}
        self._stale: set[str] = set()
        self._reported: dict[str, set[int]] = {}
        """Per worker, the blocks its reports say it holds (a snapshot diffs against it)."""
        self._sweep: list[int] = []
        """The blocks a bounded :meth:`expire` goes through, from ``_sweep_at`` on."""
        self._sweep_at = 0

    def __len__(self) -> int:
        return len(self._blocks)

    # ------------------------------------------------------------------ reports

    def apply_delta(
        self,
        worker_id: str,
        seq: int,
        stored: Iterable[int],
        evicted: Iterable[int],
        now_s: float,
    ) -> bool:
        """Apply digest delta number ``seq``. Returns False (and applies nothing) if a delta
        was missed: the worker's reports are stale until :meth:`apply_snapshot`."""
        last = self._seq.get(worker_id)
        if worker_id in self._stale or (last is not None and seq != last + 1):
            self._stale.add(worker_id)
            return False
        self._seq[worker_id] = seq
        for h in evicted:
            # An eviction also ends a guess: the worker no longer holds the block whatever
            # the dispatcher expected (a request routed there since will store it again).
            self._unreport(worker_id, h, forget_guess=True)
        mine = self._reported.setdefault(worker_id, set())
        for h in stored:
            self._report(h, worker_id)
            mine.add(h)
        self._trim()
        return True

    def apply_snapshot(self, worker_id: str, seq: int, blocks: Iterable[int], now_s: float) -> None:
        """Replace everything a worker reported by a full snapshot numbered ``seq``; the
        next delta must be ``seq + 1``."""
        keep = set(blocks)
        old = self._reported.get(worker_id, set())
        for h in old - keep:
            self._unreport(worker_id, h)
        for h in keep - old:
            self._report(h, worker_id)
        self._reported[worker_id] = keep
        self._seq[worker_id] = seq
        self._stale.discard(worker_id)
        self._trim()

    def needs_snapshot(self, worker_id: str) -> bool:
        """True after a missed delta, until the worker's next snapshot."""
        return worker_id in self._stale

    # ------------------------------------------------------------------ guesses and corrections

    def guess(self, worker_id: str, hashes: Sequence[int], now_s: float) -> None:
        """The dispatcher routed a request with these prefix blocks to ``worker_id``: it will
        hold them soon (until ``guess_ttl_s`` from now, unless reports say more)."""
        until = now_s + self.guess_ttl_s
        blocks = self._blocks
        get, to_end = blocks.get, blocks.move_to_end  # the hot path of every booking
        for h in hashes:
            holders = get(h)
            if holders is None:
                blocks[h] = {worker_id: until}
                continue
            to_end(h)
            hold = holders.get(worker_id)
            if hold is None or hold < until:
                holders[worker_id] = until
            elif hold == _REPORTED and self._under.get((h, worker_id), _NO_GUESS) < until:
                self._under[(h, worker_id)] = until
        if len(blocks) > self.max_blocks:
            self._trim()

    def completed(self, worker_id: str, hashes: Sequence[int], now_s: float) -> None:
        """A request with these prefix blocks finished on ``worker_id``: it computed the blocks
        it did not have, so it holds the whole prefix now (a fresh guess until reports say
        more). How far the index was off (expected hit at routing against the reported
        ``cached_tokens``) is the caller's to measure: it knows what it expected."""
        self.guess(worker_id, hashes, now_s)

    # ------------------------------------------------------------------ lookups

    def match(self, hashes: Sequence[int], now_s: float) -> dict[str, int]:
        """For each worker holding the first block: how many leading blocks it holds. A pure
        read (recency is kept by what is stored and routed, not by lookups). It costs
        O(blocks x holders), whatever the size of the fleet or of the index."""
        result: dict[str, int] = {}
        alive: set[str] | None = None
        blocks = self._blocks
        for i, h in enumerate(hashes):
            holders = blocks.get(h)
            if not holders:
                here: set[str] = set()
            else:
                # Set operations and min() run in C, a comprehension per holder does not:
                # a shared prefix has tens of holders at every one of its blocks. A hold
                # past its time (a guess waiting for expire()) is rare: only then is each
                # holder checked.
                here = set(holders) if alive is None else alive & holders.keys()
                if here and min(holders.values()) <= now_s:
                    here = {w for w in here if holders[w] > now_s}
            if alive is not None and len(here) < len(alive):
                for w in alive - here:
                    result[w] = i
            alive = here
            if not alive:
                break
        for w in alive or ():
            result[w] = len(hashes)
        return result

    def match_split(
        self, hashes: Sequence[int], now_s: float
    ) -> tuple[frozenset[str], int, dict[str, int]]:
        """:meth:`match`'s answer in two parts, ``(common, common_blocks, own)``: each worker
        of ``own`` holds its count, each other worker of ``common`` holds ``common_blocks``.
        The native index keeps ``common`` for a chain of entries many workers hold (a system
        prompt every worker caches) and hands out the same set until one of its entries
        changes holds, so that a decision need not list them; here ``common`` is empty."""
        return frozenset(), 0, self.match(hashes, now_s)

    def reported_blocks(self, worker_id: str) -> int:
        """How many of the index's blocks the worker's own reports list (not guesses)."""
        return len(self._reported.get(worker_id, ()))

    def holders(self, block_hash: int, now_s: float) -> set[str]:
        """The workers holding a block at ``now_s``."""
        holders = self._blocks.get(block_hash, {})
        return {w for w, until in holders.items() if until > now_s}

    def blocks_of(self, worker_id: str) -> int:
        """How many blocks hold anything of the worker, alive or past its time (O(index):
        for tests and inspection, not the hot path)."""
        return sum(1 for holders in self._blocks.values() if worker_id in holders)

    # ------------------------------------------------------------------ lifecycle

    def remove_worker(self, worker_id: str) -> None:
        """A worker lost its lease or left: forget everything about it."""
        for h in list(self._blocks):
            holders = self._blocks[h]
            if holders.pop(worker_id, None) is not None and not holders:
                del self._blocks[h]
        for key in [k for k in self._under if k[1] == worker_id]:
            del self._under[key]
        self._seq.pop(worker_id, None)
        self._stale.discard(worker_id)
        self._reported.pop(worker_id, None)

    def expire(self, now_s: float, max_blocks: int | None = None) -> int:
        """Drop guesses past their TTL (lookups ignore them anyway); returns blocks freed.
        Without ``max_blocks``, one pass over every block. With it (a live caller bounds each
        call), a sweep: each call looks at the next ``max_blocks`` blocks of a list of the
        index's blocks taken when the previous sweep ended, so that successive calls reach
        every block (a block that keeps a live hold stays where it is in the recency order:
        looking only at the least recently used would meet the same ones every time)."""
        blocks = self._blocks
        if max_blocks is not None and max_blocks < 0:
            raise ValueError("max_blocks must be >= 0")
        if max_blocks is None:
            keys = list(blocks)
        else:
            if self._sweep_at >= len(self._sweep):
                self._sweep, self._sweep_at = list(blocks), 0
            keys = self._sweep[self._sweep_at : self._sweep_at + max_blocks]
            self._sweep_at += len(keys)
        freed = 0
        for h in keys:
            holders = blocks.get(h)
            if holders is None or min(holders.values(), default=_NO_GUESS) > now_s:
                continue  # gone since the sweep began, or nothing expired (most blocks)
            for w in [w for w, until in holders.items() if until <= now_s]:
                del holders[w]
            if not holders:
                del blocks[h]
                freed += 1
        return freed

    def _report(self, h: int, worker_id: str) -> None:
        holders = self._blocks.get(h)
        if holders is None:
            holders = self._blocks[h] = {}
        else:
            self._blocks.move_to_end(h)
        hold = holders.get(worker_id, _NO_GUESS)
        if hold != _REPORTED:
            if hold != _NO_GUESS:
                self._under[(h, worker_id)] = hold
            holders[worker_id] = _REPORTED

    def _unreport(self, worker_id: str, h: int, *, forget_guess: bool = False) -> None:
        holders = self._blocks.get(h)
        if holders is None or worker_id not in holders:
            return
        mine = self._reported.get(worker_id)
        if mine is not None:
            mine.discard(h)
        under = self._under.pop((h, worker_id), _NO_GUESS)
        if holders[worker_id] != _REPORTED:
            under = holders[worker_id]
        if forget_guess or under == _NO_GUESS:
            del holders[worker_id]
        else:
            holders[worker_id] = under
        if not holders:
            del self._blocks[h]

    def _trim(self) -> None:
        while len(self._blocks) > self.max_blocks:
            h, holders = self._blocks.popitem(last=False)
            for w, until in holders.items():
                if until == _REPORTED:
                    self._reported[w].discard(h)
                    self._under.pop((h, w), None)


NATIVE: bool
"""Whether :data:`CacheIndex` is the native index."""
try:
    from sluice.dispatcher._cacheindex import CacheIndex as CacheIndex

    NATIVE = True
except ImportError:  # installed without a C compiler: the reference, slower and larger
    CacheIndex = PureCacheIndex  # type: ignore[misc,assignment]
    NATIVE = False

"""Sluice's routing policy: cache-aware, load-balanced, sticky, self-calibrating (pure).

For a request and each candidate worker (live, with free capacity) the policy computes:

- **hit**: the longest run of the request's chained block hashes the worker holds, from the
  :class:`~sluice.dispatcher.cacheindex.CacheIndex` (agents' digests, the dispatcher's own
  recent placements, corrected by completions);
- **predicted TTFT**: prefill still queued on the worker (its last heartbeat, drained at its
  learned speed since, plus what was booked there after it) and this request's *uncached*
  tokens, times the worker's effective prefill cost per token learned from its completions
  (:mod:`~sluice.dispatcher.calibration`), plus one decode step;
- **score** (lower wins) ``w_load x ttft / ttft_scale_s + w_cache x miss + w_stable x moved``:
  ``miss`` is ``1 - hit/prefix`` but 1 when the hit is under ``min_hit_fraction`` (a small
  hit is not worth a detour); ``moved`` is 1 when the prefix has replicas and this worker is
  not one of them.

Then the safeguards, per request (there is no fleet-wide switch):

- **stickiness**: a prefix whose replica set is full (see
  :mod:`~sluice.dispatcher.affinity`) goes to one of its replicas for ``sticky_window_s``
  unless every one of them is over the hard limit (``hard_load_fraction`` of its capacity
  booked, or a predicted TTFT over ``hard_ttft_s``); then it spills to the best worker;
- **replica budget**: while the prefix's budget (from its share of traffic) has room, any
  worker may win and become a replica; balance among replicas is the load term;
- **cold start**: a share ``explore_share`` of requests goes to the best worker that joined
  less than ``explore_window_s`` ago, while some are that new and some are not;
- **tie-breaks**: by a hash of request and worker ids, so equal workers share misses evenly
  and ``choose`` stays free of side effects.

**Who is scored**: given the planner's :class:`~sluice.dispatcher.routing.CandidatePool`, not
the whole fleet: its replicas (past ``shortlist_workers`` of them, the ``shortlist_per_group``
least loaded of each match length), the ``shortlist_per_group`` least-loaded holders of each
match length, the ``shortlist_workers`` least-loaded workers and, for a request that explores,
the new workers; then any other replica or worker whose load key (a lower bound of its load)
could still beat the best so far. A prefix every worker caches (a shared system prompt) makes
every worker a replica: they are walked in load order too, so a decision still scores a few; and
the index hands them over as one set it keeps between changes
(:meth:`~sluice.dispatcher.cacheindex.PureCacheIndex.match_split`), so a decision never lists
them either. When none of the replicas scored is under the hard limit, the pool names those
that may be (:meth:`~sluice.dispatcher.routing.CandidatePool.under`: by booked share, by
load key and by prefill queued), and only those are scored to find one that sticks (a
saturated fleet).
The choice is the one scoring everyone would make, but for ties.

``choose`` changes nothing; ``observe`` (called by the scheduler once the worker accepted)
records the placement. ``heartbeat``, ``completed`` and ``remove_worker`` feed the index and
the speeds from the runtime (or the simulator).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import operator
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from sluice.dispatcher.affinity import Affinity, prefix_key
from sluice.dispatcher.cacheindex import CacheIndex
from sluice.dispatcher.calibration import Calibration
from sluice.dispatcher.defaults import (
    GUESS_TTL_S,
    HOT_TAU_S,
    INDEX_MAX_BLOCKS,
    INDEX_MEMO_MIN_HOLDERS,
    KEY_TOKENS,
    MAX_REPLICAS,
    PREFIX_MAX_KEYS,
    REPLICA_HEADROOM,
    SHORTLIST_PER_GROUP,
    SHORTLIST_WORKERS,
    STICKY_WINDOW_S,
    key_blocks,
)
from sluice.dispatcher.routing import (
    Candidate,
    CandidatePool,
    Choice,
    Digest,
    Outcome,
    PolicyStats,
    RouteRequest,
    request_hash,
    tie_rank,
)
from sluice.dispatcher.scoring import LEAST_MAX, Best, Weights, held_at_least, keep, score_into
from sluice.schemas.hashing import DEFAULT_BLOCK_TOKENS, DEFAULT_INDEX_TOKENS, index_stride

_U64 = float(2**64)
_NOBODY: frozenset[str] = frozenset()
_COMMON_SHARE = 4
"""A common set (:attr:`_Context.common`) under a quarter of the candidates is listed like any
holders: walking the load order to find its least loaded would read past too many others."""
_COMMON_WALK = 8
"""A walk of the load order for the least loaded of a common set gives up after this many
workers per one it wants (most of the candidates are full or hold other prefixes), and the
set is read whole."""


@dataclass(frozen=True)
class CacheAwareConfig:
    """The policy's settings (the dispatcher's ``routing_*`` settings map onto these)."""

    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """The engines' KV block size: the granularity of prompt block hashes."""
    index_tokens: int = DEFAULT_INDEX_TOKENS
    """Prompt tokens per index entry: the index keeps every :attr:`index_stride`-th block hash
    of a prompt, which is what agents' digests must report."""
    w_load: float = 1.2
    w_cache: float = 0.7
    w_stable: float = 0.3
    ttft_scale_s: float = 1.0
    w_busy: float = 4.0
    min_hit_fraction: float = 0.3
    key_tokens: int = KEY_TOKENS
    sticky_window_s: float = STICKY_WINDOW_S
    hard_load_fraction: float = 0.9
    hard_ttft_s: float = 3.0
    replica_headroom: float = REPLICA_HEADROOM
    max_replicas: int = MAX_REPLICAS
    hot_tau_s: float = HOT_TAU_S
    explore_share: float = 0.05
    explore_window_s: float = 60.0
    prefill_tokens_per_s: float = 8000.0
    decode_step_s: float = 0.03
    guess_ttl_s: float = GUESS_TTL_S
    index_max_blocks: int = INDEX_MAX_BLOCKS
    index_memo_min_holders: int = INDEX_MEMO_MIN_HOLDERS
    """A chain of index entries this many workers hold is one set to a decision (the native
    index's memo; the pure reference keeps none), never listed: a system prompt every worker
    caches costs a decision about the same on 256 or 1,024 workers. Any value gives the same
    choices and scores the same workers."""
    prefix_max_keys: int = PREFIX_MAX_KEYS
    """Prefix keys the stickiness (and the flap meter) remember at most."""
    explain: bool = False
    sticky_cached: bool = True
    calibrate: bool = True
    """Learn each worker's speeds from completions (False: always the prior)."""
    shortlist_workers: int = SHORTLIST_WORKERS
    """Score only the prefix's holders and replicas, the newly joined workers and this many
    least-loaded others (0: score every candidate)."""
    shortlist_per_group: int = SHORTLIST_PER_GROUP
    """Of the holders (and of a prefix's many replicas) holding as much of the prompt, score
    this many least loaded first; the rest of the group only while one could still win."""

    @property
    def index_stride(self) -> int:
        """Every this-many-th block hash of a prompt is indexed."""
        return index_stride(self.block_tokens, self.index_tokens)

    @property
    def key_blocks(self) -> int:
        """Leading blocks that name a prefix."""
        return key_blocks(self.block_tokens, self.key_tokens)

    def __post_init__(self) -> None:
        if min(self.block_tokens, self.key_tokens, self.index_tokens) < 1:
            raise ValueError("block_tokens, key_tokens and index_tokens must be >= 1")
        if min(self.w_load, self.w_cache, self.w_stable, self.w_busy) < 0 or self.ttft_scale_s <= 0:
            raise ValueError("weights must be >= 0 and ttft_scale_s > 0")
        if not 0 <= self.min_hit_fraction <= 1 or not 0 <= self.explore_share <= 1:
            raise ValueError("min_hit_fraction and explore_share must be within [0, 1]")
        if not 0 < self.hard_load_fraction <= 1:
            raise ValueError("hard_load_fraction must be within (0, 1]")
        if self.shortlist_workers < 0:
            raise ValueError("shortlist_workers must be >= 0")
        if self.shortlist_per_group < 1:
            raise ValueError("shortlist_per_group must be >= 1")
        if self.index_memo_min_holders < 1:
            raise ValueError("index_memo_min_holders must be >= 1")


@dataclass(slots=True)
class Scored:
    """One candidate's terms for one request."""

    candidate: Candidate
    hit_tokens: int
    ttft_s: float
    load: float
    queue: float
    """The load without this request's own prefill: what a new replica is chosen by."""
    miss: float
    moved: float
    score: float
    over_hard: bool
    tie: float


class _Context(NamedTuple):
    """What a decision knows before it scores anyone (a named tuple: one per decision, and a
    frozen dataclass of its seven fields costs three times as much to make)."""

    indexed: int
    """Index entries of the request's prompt."""
    matches: dict[str, int]
    """Worker -> leading index entries of the prompt it holds, for every holder but the
    others of ``common`` (every replica among the holders is here)."""
    reps: list[str]
    """The replicas, but the others of ``common`` if ``rep_common``."""
    budget: int
    rep_set: frozenset[str]
    request_hash: int
    others: int = 0
    """Holders of the prompt that are no replica."""
    common: frozenset[str] = frozenset()
    """Workers holding ``common_blocks`` entries (unless ``matches`` says more): a chain many
    workers hold, as the index's memo keeps it (:meth:`CacheIndex.match_split`), never
    listed by a decision."""
    common_blocks: int = 0
    rep_common: bool = False
    """Every worker of ``common`` is a replica (it caches the whole key prefix)."""
    n_reps: int = 0
    """How many replicas, ``common``'s included."""
    n_affinity: int = 0
    """The first this many of ``reps`` are the affinity's (the rest: holders caching the key
    prefix, in the index's order)."""

    def blocks(self, worker_id: str) -> int:
        """Index entries of the prompt the worker holds."""
        got = self.matches.get(worker_id)
        if got is not None:
            return got
        return self.common_blocks if worker_id in self.common else 0

    def is_rep(self, worker_id: str) -> bool:
        """Whether the worker is one of the prefix's replicas."""
        return worker_id in self.rep_set or (self.rep_common and worker_id in self.common)

    def all_reps(self) -> list[str]:
        """Every replica (``common``'s listed: not for the hot path)."""
        if not self.rep_common:
            return self.reps
        return self.reps + sorted(w for w in self.common if w not in self.matches)


_SLACK = 1e-9
"""A worker left off the shortlist is scored only if its lower bound beats the best so far by
more than this: a tie (or a difference of rounding) is not worth a look, and looking would
walk a whole fleet of equally idle workers at every decision."""


_AHEAD_ROUNDING = 1e-6
"""Tokens: the prefill a replica may still have ahead of it under the hard TTFT limit can
compute a hair below 0 for a replica exactly at the limit (which is under it)."""


class CacheAware:
    """The ``sluice`` routing policy (see the module docstring)."""

    name = "sluice"
    uses_digests = True

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = c = config or CacheAwareConfig()
        self.index = CacheIndex(
            max_blocks=c.index_max_blocks,
            guess_ttl_s=c.guess_ttl_s,
            memo_min_holders=c.index_memo_min_holders,
        )
        self.calibration = Calibration(
            prefill_tokens_per_s=c.prefill_tokens_per_s, decode_step_s=c.decode_step_s
        )
        self.affinity = Affinity(
            window_s=c.sticky_window_s,
            tau_s=c.hot_tau_s,
            headroom=c.replica_headroom,
            max_replicas=c.max_replicas,
            max_keys=c.prefix_max_keys,
        )
        self._key_blocks = c.key_blocks
        self._stride = c.index_stride
        self.index_block_tokens = c.block_tokens * c.index_stride
        """Tokens per index entry: what a digest's ``block_tokens`` must say."""
        self._fleet: set[str] = set()
        self.stale_reports = 0
        self._weights = Weights(
            self.index_block_tokens,
            c.min_hit_fraction,
            c.ttft_scale_s,
            c.w_busy,
            c.w_load,
            c.w_cache,
            c.w_stable,
            c.hard_load_fraction,
            c.hard_ttft_s,
            c.explore_window_s,
        )

    # ------------------------------------------------------------------ selection (pure)

    def score(
        self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float
    ) -> tuple[list[Scored], list[str], int]:
        """Every candidate's terms, the prefix's replicas and its budget. Changes nothing."""
        ctx = self._context(request, len(candidates), now_s)
        return self._score(request, ctx, candidates), ctx.all_reps(), ctx.budget

    def _context(self, request: RouteRequest, candidates: int, now_s: float) -> _Context:
        indexed = self._indexed(request.block_hashes)
        if indexed:
            common, cb, matches = self.index.match_split(indexed, now_s)
        else:
            common, cb, matches = _NOBODY, 0, {}
        key = self._key(request)
        fleet = max(len(self._fleet), candidates)
        reps = self.affinity.replicas(key, now_s) if key is not None else []
        n_affinity = len(reps)
        if common:
            if _COMMON_SHARE * len(common) < candidates:
                # Too few of the candidates to find the least loaded of them by walking the
                # load order: listed, as any holder.
                matches, common = _listed(common, cb, matches), _NOBODY
            elif reps:
                # Every replica among the holders by count (set operations run in C: a hot
                # prefix has up to max_replicas of them).
                for w in common.intersection(reps).difference(matches):
                    matches[w] = cb
        # The others of common: holders not in matches (the chain's, never listed).
        # (frozenset.intersection reads its argument, matches, not the set, as `keys() & set`
        # does: the set may be the whole fleet.)
        implicit = len(common) - len(common.intersection(matches)) if common else 0
        if common and not implicit:
            common = _NOBODY  # all of it listed by count already
        # Holders that are no replica (on a fleet that caches one system prompt everywhere,
        # none: then nobody walks the holders again to find that out).
        others = len(matches) + implicit - (len(matches.keys() & reps) if reps else 0)
        rep_common = False
        if key is not None and self.config.sticky_cached:
            # Workers that still cache the whole key prefix hold it too, however long ago
            # it was routed there.
            need = min(self._key_blocks // self._stride, len(indexed)) or 1
            cached = held_at_least(matches, need, set(reps) if reps else None)
            others -= len(cached)
            reps += cached
            if implicit and cb >= need:
                rep_common = True
                others -= implicit
        budget = self.affinity.budget(key, fleet, now_s) if key is not None else 1
        rh = request_hash(request.request_id)
        n_reps = len(reps) + (implicit if rep_common else 0)
        return _Context(
            len(indexed), matches, reps, budget, frozenset(reps), rh, others,
            common, cb, rep_common, n_reps, n_affinity,
        )  # fmt: skip

    def _score(
        self, request: RouteRequest, ctx: _Context, candidates: Sequence[Candidate]
    ) -> list[Scored]:
        c = self.config
        blocks_of, is_rep, has_reps = ctx.blocks, ctx.is_rep, ctx.n_reps > 0
        rh = ctx.request_hash
        # The loop below runs for every scored candidate of every decision: constants hoisted.
        n_indexed = ctx.indexed
        prompt = request.prompt_tokens
        ibt = self.index_block_tokens
        min_hit, scale, w_busy = c.min_hit_fraction, c.ttft_scale_s, c.w_busy
        w_load, w_cache, w_stable = c.w_load, c.w_cache, c.w_stable
        hard_fraction, hard_ttft = c.hard_load_fraction, c.hard_ttft_s
        speeds = self.calibration.speeds if c.calibrate else None
        prior = self.calibration.prior
        out = []
        for cand in candidates:
            w = cand.worker_id
            blocks = blocks_of(w)
            hit = min(blocks * ibt, prompt - 1) if blocks else 0
            fraction = blocks / n_indexed if n_indexed else 0.0
            miss = 1.0 - fraction if fraction >= min_hit else 1.0
            sp = speeds(w) if speeds else prior
            per_token = sp.prefill_s_per_token
            ahead = cand.reported_prefill_tokens - cand.report_age_s / per_token
            ahead = (ahead if ahead > 0.0 else 0.0) + cand.unreported_prefill_tokens
            own = prompt - hit if prompt - hit > 1 else 1
            ttft = (ahead + own) * per_token + sp.decode_s_per_token
            moved = 1.0 if has_reps and not is_rep(w) else 0.0
            busy = w_busy * cand.booked / (cand.capacity or 1)
            load = ttft / scale + busy
            queue = ahead * per_token / scale + busy
            s = w_load * load + w_cache * miss + w_stable * moved
            over = cand.booked >= hard_fraction * cand.capacity or ttft > hard_ttft
            tie = tie_rank(rh, w)
            out.append(Scored(cand, hit, ttft, load, queue, miss, moved, s, over, tie))
        return out

    def shortlist(
        self, request: RouteRequest, pool: CandidatePool, now_s: float
    ) -> list[Candidate]:
        """The candidates a decision scores first: the prefix's replicas, the least-loaded
        holders of each match length (``shortlist_per_group`` of each), the
        ``shortlist_workers`` least loaded and, if the request is one that explores, the newly
        joined workers (module docstring)."""
        ctx = self._context(request, len(pool), now_s)
        return self._shortlist(ctx, pool, now_s, self._explores(request))

    def _shortlist(
        self,
        ctx: _Context,
        pool: CandidatePool,
        now_s: float,
        explores: bool,
        left: list[tuple[int, _Rest]] | None = None,
        walk: Iterator[tuple[float, str]] | None = None,
        left_reps: list[tuple[int, _Rest]] | None = None,
    ) -> list[Candidate]:
        """The shortlist; ``left`` (``left_reps``) gets, per match length, the holders (the
        replicas) left off it (:class:`_Rest`), and the least loaded are taken from ``walk``
        (the pool's load order), which :meth:`_beyond` then goes on with."""
        picked: dict[str, Candidate] = {}
        matches = ctx.matches
        self._replicas(ctx, pool, picked, left_reps)
        if ctx.others:
            self._groups(matches, matches, ctx.rep_set, pool, picked, left)
            if ctx.common and not ctx.rep_common:
                self._common_group(ctx, pool, picked, left)
                if left:
                    # In the order the listed holders come (by how much they hold), so that
                    # the walk of the groups left off scores what it would without the set.
                    left.sort(key=operator.itemgetter(0))
        if explores:
            # Only a request that explores needs every new worker (and how many there are).
            # A little early, so that the exact test in choose() decides who is new.
            for cand in pool.joined_after(now_s - self.config.explore_window_s - 1.0):
                picked.setdefault(cand.worker_id, cand)
        k = self.config.shortlist_workers
        if walk is None:
            for cand in pool.least_loaded(k):
                picked.setdefault(cand.worker_id, cand)
        else:
            for _, w in itertools.islice(walk, k):
                if w not in picked and (got := pool.get(w)) is not None:
                    picked[w] = got
        return list(picked.values())

    def _replicas(
        self,
        ctx: _Context,
        pool: CandidatePool,
        picked: dict[str, Candidate],
        left_reps: list[tuple[int, _Rest]] | None,
    ) -> None:
        """The shortlist's replicas: all of a few; of many (a hot prefix, a system prompt
        every worker caches), grouped by how much of the prompt they hold, as the holders
        are, k of each group."""
        matches = ctx.matches
        if ctx.n_reps <= self.config.shortlist_workers:
            for w in ctx.all_reps():
                if w not in picked and (cand := pool.get(w)) is not None:
                    picked[w] = cand
        elif ctx.rep_common:
            # Those of common holding no more than it are in its group.
            common, cb = ctx.common, ctx.common_blocks
            listed = [w for w in ctx.reps if w not in common or matches[w] != cb]
            self._groups(listed, matches, None, pool, picked, left_reps)
            self._common_group(ctx, pool, picked, left_reps)
            if left_reps:
                # In the order the listed replicas' groups come (the affinity's first).
                order = _rep_group_order(ctx, pool)
                left_reps.sort(key=lambda group: order[group[0]])
        else:
            self._groups(ctx.reps, matches, None, pool, picked, left_reps)

    def _groups(
        self,
        workers: Iterable[str],
        matches: dict[str, int],
        skip: frozenset[str] | None,
        pool: CandidatePool,
        picked: dict[str, Candidate],
        left: list[tuple[int, _Rest]] | None,
    ) -> None:
        """Into ``picked``: of each group of ``workers`` but ``skip`` that hold as much of the
        prompt (they differ only in load, unless their speeds do), the k least loaded
        (``shortlist_per_group``); ``left`` gets the rest of each group (:class:`_Rest`). The
        pool lists only the k + ``shortlist_workers`` least of each group: a group may be the
        whole fleet, and a decision rarely looks past them (of a group that is most of the
        fleet, the shortlist's least loaded of all are the next few, scored already). Those
        holding nothing are the group least_loaded() gives."""
        # Fewer than shortlist_workers: of a group, the least loaded by its key is the likely
        # winner, and _beyond() scores the others exactly as far as one could still beat it
        # (docs/BENCHMARKS.md, eighteenth pass: the decision's routing phase at 256 workers).
        k = self.config.shortlist_per_group
        listed = min(LEAST_MAX, k + self.config.shortlist_workers)
        for blocks, (least, count) in pool.least_groups(workers, matches, skip, listed).items():
            for _, w in least[:k]:
                if w not in picked and (cand := pool.get(w)) is not None:
                    picked[w] = cand
            if count > k and left is not None:
                more = None
                if count > len(least):

                    def more(b: int = blocks, after: tuple[float, str] = least[-1]) -> _Heap:
                        group = pool.keyed_groups(workers, matches, skip).get(b, [])
                        rest = [kw for kw in group if kw > after]
                        heapq.heapify(rest)
                        return rest

                left.append((blocks, _Rest(least[k:], more)))

    def _common_group(
        self,
        ctx: _Context,
        pool: CandidatePool,
        picked: dict[str, Candidate],
        left: list[tuple[int, _Rest]] | None,
    ) -> None:
        """:meth:`_groups` for the others of ``ctx.common`` (one group: they hold as much),
        found by walking the pool's load order, which reads a few workers when the set is
        most of the fleet, instead of reading the whole set."""
        k = self.config.shortlist_per_group
        listed = min(LEAST_MAX, k + self.config.shortlist_workers)
        common, matches, cb = ctx.common, ctx.matches, ctx.common_blocks
        # Who of common is not in the group: those holding more (and, unless they are all
        # replicas, the replicas listed, which are in the replicas' groups).
        skip: Container[str] = (
            {w for w, b in matches.items() if b != cb} if ctx.rep_common else matches
        )
        least: _Heap = []
        whole = False
        budget = _COMMON_WALK * listed
        for key, w in pool.ids_by_load():
            if w in common and w not in skip:
                least.append((key, w))
                if len(least) == listed:
                    break
            budget -= 1
            if budget == 0:
                # Most of the order is not the set's: read the set instead.
                least, count = pool.least_groups(common, _NO_BLOCKS, skip, listed).get(0, ([], 0))
                whole = count <= len(least)
                break
        else:
            whole = True  # the order ended: these are all
        for _, w in least[:k]:
            if w not in picked and (cand := pool.get(w)) is not None:
                picked[w] = cand
        if left is None or (whole and len(least) <= k):
            return
        more = None
        if not whole and least:

            def more(after: tuple[float, str] = least[-1]) -> _Heap:
                group = pool.keyed_groups(common, _NO_BLOCKS, skip).get(0, [])
                rest = [kw for kw in group if kw > after]
                heapq.heapify(rest)
                return rest

        left.append((ctx.common_blocks, _Rest(least[k:], more)))

    def load_key(self, booked: int, capacity: int, unreported_prefill_tokens: int) -> float:
        """The queue term (``queue`` of :class:`Scored`) of a worker with this work whose
        reported queue has drained, at the prior speed: the order the least-loaded part of
        the shortlist is taken in, and (scaled by the fastest speed) a lower bound of it."""
        c = self.config
        per_token = self.calibration.prior.prefill_s_per_token
        busy = c.w_busy * booked / (capacity or 1)
        return unreported_prefill_tokens * per_token / c.ttft_scale_s + busy

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float
    ) -> Choice:
        """The decision (module docstring). Given a :class:`CandidatePool`, it scores only
        the shortlist (unless ``shortlist_workers`` is 0 or the candidates are at most twice
        that many), then any other worker whose load
        key shows it could still win (its lower bound under the best so far): the same
        choice as scoring every candidate, but for ties among workers left off."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        c = self.config
        n = len(candidates)
        ctx = self._context(request, n, now_s)
        explores = self._explores(request)
        acc = Best()
        scored: list[Candidate] = []
        if isinstance(candidates, CandidatePool) and 0 < 2 * c.shortlist_workers < n:
            # (A fleet of twice the shortlist or fewer costs less scored whole.)
            left: list[tuple[int, _Rest]] = []
            left_reps: list[tuple[int, _Rest]] = []
            walk = candidates.ids_by_load()
            short = self._shortlist(ctx, candidates, now_s, explores, left, walk, left_reps)
            scored.extend(short)
            self._score_into(acc, request, ctx, short, now_s, explores)
            rule = self._rule(acc, ctx, n)
            if rule in ("score", "spill", "expand") or (left_reps and rule == "sticky"):
                seen = {cand.worker_id for cand in short}
                more = self._beyond(
                    acc, request, ctx, candidates, seen, scored, left, walk, left_reps
                )
                self._score_into(acc, request, ctx, more, now_s, explores)
        else:
            scored.extend(candidates)
            self._score_into(acc, request, ctx, candidates, now_s, explores)
        choice = self._verdict(acc, ctx, n)
        if c.explain:
            choice = self._explained(choice, request, ctx, scored, now_s)
        return choice

    def _explained(
        self,
        choice: Choice,
        request: RouteRequest,
        ctx: _Context,
        scored: Sequence[Candidate],
        now_s: float,
    ) -> Choice:
        """The choice with every scored candidate's terms (the decision log)."""
        window = self.config.explore_window_s

        def allowed(s: Scored) -> bool:
            if choice.reason == "explore":
                return now_s - s.candidate.joined_s < window
            if choice.reason == "sticky":
                return ctx.is_rep(s.candidate.worker_id) and not s.over_hard
            return True

        terms = tuple(_terms(s, allowed(s)) for s in self._score(request, ctx, scored))
        return Choice(choice.worker_id, choice.expected_hit_tokens, choice.reason, terms)

    def _score_into(
        self,
        acc: Best,
        request: RouteRequest,
        ctx: _Context,
        candidates: Iterable[Candidate],
        now_s: float,
        explores: bool,
    ) -> None:
        """Score candidates, keeping in ``acc`` only the minimum each rule needs: the same
        terms as :meth:`_score` (kept in step with it), in one pass
        (:func:`~sluice.dispatcher.scoring.score_into`). ``candidates`` may be a generator
        that reads ``acc`` between two of them."""
        score_into(
            acc,
            keep,
            candidates,
            self._weights,
            ctx.matches,
            ctx.rep_set,
            ctx.indexed,
            request.prompt_tokens,
            ctx.request_hash,
            self.calibration.table() if self.config.calibrate else None,
            self.calibration.prior,
            explores,
            now_s,
            ctx.common,
            ctx.common_blocks,
            ctx.rep_common,
        )

    def _rule(self, acc: Best, ctx: _Context, n: int) -> str:
        """Which rule decides (module docstring), from what was scored."""
        if acc.cold is not None and acc.n_cold < n:
            return "explore"
        if acc.sticky is not None:
            return "sticky" if ctx.n_reps >= ctx.budget else "expand"
        return "spill" if ctx.n_reps else "score"

    def _verdict(self, acc: Best, ctx: _Context, n: int) -> Choice:
        rule = self._rule(acc, ctx, n)
        if rule == "expand":
            # The prefix is hot and may gain a replica: whoever serves it soonest (its miss
            # is in its predicted TTFT) wins, so its traffic spreads instead of herding.
            assert acc.expand is not None
            return Choice(acc.expand[3], acc.expand[4], rule)
        best = acc.cold if rule == "explore" else acc.sticky if rule == "sticky" else acc.best
        assert best is not None
        return Choice(best[2], best[3], rule)

    def _beyond(
        self,
        acc: Best,
        request: RouteRequest,
        ctx: _Context,
        pool: CandidatePool,
        seen: set[str],
        scored: list[Candidate],
        left: list[tuple[int, _Rest]],
        walk: Iterator[tuple[float, str]],
        left_reps: list[tuple[int, _Rest]] | None = None,
    ) -> Iterator[Candidate]:
        """Candidates off the shortlist that could still win (:class:`_Bounds`), in load
        order, to the first that cannot (the bound grows with the key). Ties with the best
        are not looked for. The replicas left off come first; then, unless the rule is
        settled on the replicas by then, the other holders and workers."""
        bounds = _Bounds(self, acc, request, ctx)
        n = len(pool)
        if left_reps and acc.sticky is None:
            # No replica scored can stick. One over the hard limit's booked share, or with
            # more prefill ahead of it (unreported, or reported and not drained yet at the
            # fastest speed) than the TTFT limit leaves, never can: if the pool says fewer
            # workers may be under all of these than there are replicas (a saturated fleet),
            # score those of them that are replicas, instead of every replica to learn that
            # none is under the limit; the others can then win only by their score (spill)
            # or queue (expand).
            ahead = bounds.stick_ahead()
            if ahead is None:  # the prompt's own prefill is over the limit anywhere
                bounds.stickers_scored = True
            else:
                under = pool.under(
                    self.config.hard_load_fraction,
                    bounds.stick_key(ahead),
                    ahead,
                    bounds.fastest_drain,
                )
                if under is not None and under[0] < ctx.n_reps:
                    yield from _may_stick(ctx, pool, under[1], seen, scored)
                    bounds.stickers_scored = True
        yield from _walk_groups(left_reps or (), bounds.replica_could_win, pool, seen, scored)
        if self._rule(acc, ctx, n) not in ("score", "spill", "expand"):
            return
        bounds.settle()
        # The holders the shortlist's groups left off, then the others.
        yield from _walk_groups(left, bounds.could_win, pool, seen, scored)
        matches, rep_set, common = ctx.matches, ctx.rep_set, ctx.common
        for key, w in walk:  # the others, in load order, on from the shortlist's least loaded
            # The bound first, also for a worker passed over: no other further on (holding
            # nothing, at a key as high or higher) could win either. Passing over first read
            # a fleet of replicas whole (a system prompt everywhere, all over the hard limit).
            if not bounds.could_win(key, 0):
                return
            if w in seen or w in matches or w in rep_set or w in common:
                continue
            if (cand := pool.get(w)) is not None:
                scored.append(cand)
                yield cand

    def _key(self, request: RouteRequest) -> int | None:
        """What the request sticks by: its session, or its prompt prefix."""
        if request.affinity_key is not None:
            return request.affinity_key
        return prefix_key(request.block_hashes, self._key_blocks)

    def _indexed(self, hashes: Sequence[int]) -> Sequence[int]:
        s = self._stride
        return hashes if s == 1 else hashes[s - 1 :: s]

    def _explores(self, request: RouteRequest) -> bool:
        h = xxhash.xxh64_intdigest(f"{request.request_id}/explore".encode()) / _U64
        return h < self.config.explore_share

    # ------------------------------------------------------------------ learning

    def observe(self, request: RouteRequest, worker_id: str, now_s: float) -> None:
        """The worker accepted the request: record the placement."""
        hashes = request.block_hashes
        indexed = self._indexed(hashes)
        if indexed:
            self.index.guess(worker_id, indexed, now_s)
        key = self._key(request)
        if key is None:
            return
        fleet = max(len(self._fleet), 1)
        self.affinity.used(key, worker_id, self.affinity.budget(key, fleet, now_s), now_s)

    def heartbeat(self, worker_id: str, digest: Digest | None, now_s: float) -> bool:
        """A worker's heartbeat, with its cache digest if it sent one. Returns False if the
        digest was a delta after a gap (ignored until the worker's next snapshot)."""
        self._fleet.add(worker_id)
        if digest is None:
            return True
        if digest.snapshot:
            self.index.apply_snapshot(worker_id, digest.seq, digest.stored, now_s)
            return True
        ok = self.index.apply_delta(worker_id, digest.seq, digest.stored, digest.evicted, now_s)
        if not ok:
            self.stale_reports += 1
        return ok

    def completed(self, worker_id: str, request: RouteRequest, outcome: Outcome) -> None:
        """A request finished on ``worker_id``: it holds the prefix now, and its timings
        teach the worker's speeds."""
        indexed = self._indexed(request.block_hashes)
        if indexed:
            self.index.completed(worker_id, indexed, outcome.now_s)
        self.calibration.observe(
            worker_id,
            uncached_tokens=max(0, request.prompt_tokens - outcome.cached_tokens),
            prefill_s=outcome.prefill_s,
            output_tokens=outcome.output_tokens,
            decode_s=outcome.decode_s,
        )

    def remove_worker(self, worker_id: str) -> None:
        """The worker lost its lease or left: forget what it held."""
        self._fleet.discard(worker_id)
        self.index.remove_worker(worker_id)
        self.affinity.remove_worker(worker_id)
        self.calibration.remove_worker(worker_id)

    def expire(self, now_s: float, max_blocks: int | None = None) -> int:
        """Drop expired guesses from the index (call now and then; ``max_blocks`` bounds the
        work of one call, oldest blocks first)."""
        return self.index.expire(now_s, max_blocks)

    def stats(self, now_s: float) -> PolicyStats:
        counts = [n for n in self.affinity.replica_counts(now_s) if n]
        sets = dict(collections.Counter(counts))
        return PolicyStats(len(self.index), len(counts), max(counts, default=0), sets)


def _listed(common: frozenset[str], blocks: int, matches: dict[str, int]) -> dict[str, int]:
    """``matches`` with every other worker of ``common`` holding ``blocks``, in the index's
    order (by how much each holds), as ``CacheIndex.match`` answers."""
    out = {w: b for w, b in matches.items() if b < blocks}
    out.update(dict.fromkeys(common.difference(matches), blocks))
    out.update({w: b for w, b in matches.items() if b >= blocks})
    return out


def _rep_group_order(ctx: _Context, pool: CandidatePool) -> dict[int, int]:
    """Blocks held -> the rank of that group of replicas as listing every replica orders them:
    by the first candidate of each, the affinity's first (as they come), then those caching
    the key prefix (by how much they hold, ``ctx.common``'s among them)."""
    order: dict[int, int] = {}
    matches = ctx.matches
    for w in ctx.reps[: ctx.n_affinity]:
        b = matches.get(w, 0)
        if b not in order and pool.load_key(w) is not None:
            order[b] = len(order)
    rest = {matches[w] for w in ctx.reps[ctx.n_affinity :]}
    rest.add(ctx.common_blocks)
    for b in sorted(rest):
        order.setdefault(b, len(order))
    return order


_Heap = list[tuple[float, str]]
"""(load key, worker) pairs in heap order (least on top); a sorted list is one."""
_NO_BLOCKS: dict[str, int] = {}
"""Grouping a common set's others by their blocks: none listed, one group (0)."""


class _Rest:
    """The workers of a group a shortlist left off, least loaded first: a heap of those the
    pool listed and, if it listed only the least of the group, how to get the others."""

    __slots__ = ("heap", "more")

    def __init__(self, heap: _Heap, more: Callable[[], _Heap] | None) -> None:
        self.heap, self.more = heap, more

    def peek(self) -> tuple[float, str] | None:
        """The least loaded left, or None."""
        if not self.heap and self.more is not None:
            self.heap, self.more = self.more(), None
        return self.heap[0] if self.heap else None


def _may_stick(
    ctx: _Context,
    pool: CandidatePool,
    under: Iterator[str],
    seen: set[str],
    scored: list[Candidate],
) -> Iterator[Candidate]:
    """The replicas among ``under`` (workers that may be under the hard limit) not scored
    yet."""
    for w in under:
        if w in seen or not ctx.is_rep(w):
            continue
        if (cand := pool.get(w)) is not None:
            seen.add(w)
            scored.append(cand)
            yield cand


def _walk_groups(
    groups: Iterable[tuple[int, _Rest]],
    could_win: Callable[[float, int], bool],
    pool: CandidatePool,
    seen: set[str],
    scored: list[Candidate],
) -> Iterator[Candidate]:
    """Of each group (index entries held, the workers left off), the candidates in load order
    up to the first that cannot win; those already scored are passed over (a group's worker
    left off its group's few may be among the least loaded of all, on the shortlist), but
    their bound still ends the walk: passing over one that cannot win would read on into the
    group's rest, which for a group of the whole fleet lists every worker."""
    for blocks, rest in groups:
        while (top := rest.peek()) is not None:
            key, w = top
            if not could_win(key, blocks):
                break
            heapq.heappop(rest.heap)
            if w in seen:
                continue
            if (cand := pool.get(w)) is not None:
                seen.add(w)
                scored.append(cand)
                yield cand


class _Bounds:
    """Lower bounds of the terms of a candidate not scored yet, from its load key (booked
    work only, no reported queue) scaled by the fleet's fastest speeds, against the best so
    far in ``acc`` as it improves."""

    __slots__ = (
        "_acc", "_c", "_expand", "_f", "_fast_decode", "_fast_prefill", "_ibt", "_indexed",
        "_may_expand", "_prior_prefill", "_prompt", "_w_moved", "stickers_scored",
    )  # fmt: skip

    def __init__(self, policy: CacheAware, acc: Best, request: RouteRequest, ctx: _Context):
        c = self._c = policy.config
        prior = policy.calibration.prior
        self._fast_prefill, self._fast_decode = (
            policy.calibration.fastest()
            if c.calibrate
            else (prior.prefill_s_per_token, prior.decode_s_per_token)
        )
        self._prior_prefill = prior.prefill_s_per_token
        self._f = min(1.0, self._fast_prefill / prior.prefill_s_per_token)
        self._acc = acc
        self._prompt, self._ibt = request.prompt_tokens, policy.index_block_tokens
        self._indexed = ctx.indexed
        self._may_expand = ctx.n_reps < ctx.budget
        # Who is left off once the replicas are done is no replica: moved is the same for all.
        self._w_moved = c.w_stable if ctx.n_reps else 0.0
        self._expand = False
        self.stickers_scored = False
        """Every replica that may be under the hard limit was scored: the others can win
        only the spill rule (by their score) or the expand rule (by their queue)."""

    def stick_ahead(self) -> float | None:
        """The most prefill tokens a replica under the hard limit can have ahead of it (its
        predicted TTFT holds them, and at least the prompt's own tokens not held by anyone,
        at the fastest speeds), or None if even with none ahead its TTFT is over the limit."""
        c = self._c
        most = min(self._indexed * self._ibt, self._prompt - 1) if self._indexed else 0
        own = self._prompt - most if self._prompt - most > 1 else 1
        ahead = (c.hard_ttft_s - self._fast_decode) / self._fast_prefill - own
        if ahead < -_AHEAD_ROUNDING:
            return None
        # (A TTFT exactly at the limit is under it, and this difference may round below 0.)
        return (ahead if ahead > 0.0 else 0.0) + _AHEAD_ROUNDING

    def stick_key(self, ahead: float) -> float:
        """A load key no replica with at most ``ahead`` prefill tokens ahead of it and less
        than the hard limit's share of its capacity booked reaches: the key holds its
        prefill not yet reported and ``w_busy`` of its booked share."""
        c = self._c
        limit = ahead * self._prior_prefill / c.ttft_scale_s + c.w_busy * c.hard_load_fraction
        return limit + _SLACK

    @property
    def fastest_drain(self) -> float:
        """Prefill tokens per second of the fastest worker: no queue drains faster."""
        return 1.0 / self._fast_prefill

    def score(self, key: float, blocks: int) -> float:
        """The lowest score a candidate with this load key holding ``blocks`` index entries
        of the prompt can have, moved or not aside."""
        c = self._c
        prompt = self._prompt
        hit = min(blocks * self._ibt, prompt - 1) if blocks else 0
        miss = self._miss(blocks)
        own = prompt - hit if prompt - hit > 1 else 1
        load = self._f * key + (own * self._fast_prefill + self._fast_decode) / c.ttft_scale_s
        return c.w_load * load + c.w_cache * miss

    def _miss(self, blocks: int) -> float:
        """The miss of a candidate holding ``blocks`` index entries of the prompt (exact: the
        scoring's own)."""
        n_indexed = self._indexed
        fraction = blocks / n_indexed if n_indexed else 0.0
        return 1.0 - fraction if fraction >= self._c.min_hit_fraction else 1.0

    def queue_beats(self, key: float, blocks: int) -> bool:
        """Whether a candidate with this load key holding ``blocks`` index entries could beat
        the best of the expand rule: by its rounded queue, or by the same rounded queue and
        less of a miss (not by the tie rank alone: a tie is not worth a look)."""
        expand = self._acc.expand
        if expand is None:
            return True
        queue = round(self._f * key - _SLACK, 2)
        return queue < expand[0] or (queue <= expand[0] and self._miss(blocks) < expand[1])

    def replica_could_win(self, key: float, blocks: int) -> bool:
        """A replica left off: while no replica under the hard limit was scored it may
        still win the sticky rule; then if its score could beat the best replica's (the
        best replica is never better than the best of all: that covers both), or, for a
        prefix that may gain a replica, its queue the best queue. Once every replica that
        may be under the limit was scored (:attr:`stickers_scored`), only the spill rule by
        its score, or the expand rule by its queue."""
        sticky = self._acc.sticky
        if self.stickers_scored:
            if sticky is None:
                best = self._acc.best
                assert best is not None
                return self.score(key, blocks) < best[0] - _SLACK
            return self._may_expand and self.queue_beats(key, blocks)
        if sticky is None or self.score(key, blocks) < sticky[0] - _SLACK:
            return True
        return self._may_expand and self.queue_beats(key, blocks)

    def settle(self) -> None:
        """The replicas are done: a replica under the hard limit was found (the other
        workers can only win the expand rule, by their queue) or not (the score rule)."""
        self._expand = self._acc.sticky is not None

    def could_win(self, key: float, blocks: int) -> bool:
        """A worker that is no replica, after :meth:`settle`."""
        if self._expand:
            return self.queue_beats(key, blocks)
        best = self._acc.best
        assert best is not None
        return self.score(key, blocks) + self._w_moved < best[0] - _SLACK


def _terms(s: Scored, allowed: bool) -> dict[str, float | str]:
    return {
        "worker": s.candidate.worker_id,
        "hit_tokens": s.hit_tokens,
        "ttft_s": round(s.ttft_s, 6),
        "load": round(s.load, 6),
        "queue": round(s.queue, 6),
        "miss": round(s.miss, 4),
        "moved": s.moved,
        "score": round(s.score, 6),
        "over_hard": float(s.over_hard),
        "allowed": float(allowed),
        "booked": s.candidate.booked,
    }

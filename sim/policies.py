"""Baseline routing policies for the replay, behind the dispatcher's ``RoutingPolicy``
interface, and the factory that names them (pure, seeded).

Policies that need to see the fleet (cache contents, engine load) get a :class:`FleetView`;
policies that learn from their own decisions get ``observe(request, worker_id, now_s)`` after
each booking.
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import xxhash

from sluice.dispatcher.cacheaware import CacheAware, CacheAwareConfig
from sluice.dispatcher.routing import Candidate, RouteRequest, RoutingPolicy
from sluice.sim.profiles import REFERENCE, EngineProfile


class FleetView(Protocol):
    """What a policy may look up about a worker (in the replay: the engines' exact state, as
    KV events would report it)."""

    def cached_blocks(self, worker_id: str, hashes: Sequence[int]) -> int: ...
    def pending_prefill_blocks(self, worker_id: str) -> int: ...
    def active_blocks(self, worker_id: str) -> int: ...
    def pending_tokens(self, worker_id: str) -> int: ...


class RandomPolicy:
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        return self._rng.choice(candidates).worker_id


class RoundRobin:
    """Workers in a fixed cycle; a worker without room is skipped."""

    name = "round-robin"

    def __init__(self, workers: Sequence[str]) -> None:
        self._order = list(workers)
        self._next = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        eligible = {c.worker_id for c in candidates}
        for step in range(len(self._order)):
            w = self._order[(self._next + step) % len(self._order)]
            if w in eligible:
                self._next = (self._next + step + 1) % len(self._order)
                return w
        return candidates[0].worker_id


class LeastPending:
    """``least-loaded``: the fewest pending tokens, the work left on the engine (prompt
    tokens still to prefill plus output tokens still to generate); random among ties."""

    name = "least-loaded"

    def __init__(self, view: FleetView, rng: random.Random) -> None:
        self._view = view
        self._rng = rng

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        loads = [(self._view.pending_tokens(c.worker_id), c.worker_id) for c in candidates]
        best = min(load for load, _ in loads)
        return self._rng.choice([w for load, w in loads if load == best])


class ConsistentHash:
    """Hash the request's leading prefix onto a ring of workers (100 virtual nodes each);
    bounded load: skip a worker already over ``bound`` x the mean booked requests."""

    name = "consistent-hash"

    def __init__(self, workers: Sequence[str], prefix_blocks: int = 2, bound: float = 1.25):
        self._ring = sorted(
            (xxhash.xxh64_intdigest(f"{w}#{v}".encode()), w) for w in workers for v in range(100)
        )
        self._keys = [k for k, _ in self._ring]
        self._prefix_blocks = prefix_blocks
        self._bound = bound

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        head = request.block_hashes[: self._prefix_blocks]
        key = (
            xxhash.xxh64_intdigest(repr(head).encode())
            if head
            else xxhash.xxh64_intdigest(request.request_id.encode())
        )
        by_id = {c.worker_id: c for c in candidates}
        mean = sum(c.booked for c in candidates) / len(candidates)
        limit = max(1.0, self._bound * (mean + 1))
        i = bisect.bisect_left(self._keys, key)
        fallback = None
        for step in range(len(self._ring)):
            w = self._ring[(i + step) % len(self._ring)][1]
            c = by_id.get(w)
            if c is None:
                continue
            fallback = fallback or w
            if c.booked + 1 <= limit:
                return w
        return fallback or candidates[0].worker_id


class SglangCacheAware:
    """The SGLang gateway's ``cache_aware`` policy (REFERENCES.md): per worker, a prefix tree
    of what *it routed there* (chained block hashes: a radix tree over blocks), LRU-bounded;
    a fleet-wide imbalance gate on in-flight requests (max - min > 64 and max > 1.5 x min →
    least loaded); else the longest match if its ratio exceeds 0.3, otherwise least loaded."""

    name = "sglang-cache-aware"

    def __init__(
        self,
        rng: random.Random,
        *,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        tree_blocks: int = 1 << 20,
    ) -> None:
        self._rng = rng
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._tree_blocks = tree_blocks
        self._trees: dict[str, OrderedDict[int, None]] = {}

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > lo * self.balance_rel

    def _least_loaded(self, candidates: Sequence[Candidate]) -> str:
        lo = min(c.booked for c in candidates)
        return self._rng.choice([c.worker_id for c in candidates if c.booked == lo])

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        if self.imbalanced([c.booked for c in candidates]) or not request.block_hashes:
            return self._least_loaded(candidates)
        best_w, best_n = "", 0
        for c in candidates:
            tree = self._trees.get(c.worker_id)
            n = 0
            if tree is not None:
                for h in request.block_hashes:
                    if h not in tree:
                        break
                    n += 1
            if n > best_n:
                best_w, best_n = c.worker_id, n
        if best_n / len(request.block_hashes) > self.cache_threshold:
            return best_w
        return self._least_loaded(candidates)

    def observe(self, request: RouteRequest, worker_id: str, now_s: float) -> None:
        tree = self._trees.setdefault(worker_id, OrderedDict())
        for h in request.block_hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self._tree_blocks:
            tree.popitem(last=False)


class DynamoCost:
    """NVIDIA Dynamo's KV router cost, ``overlap_weight x prefill blocks + active blocks``,
    argmin with random tie-breaks. As in Dynamo's scheduler, the prefill term is the worker's
    outstanding prefill plus this request's blocks not cached there (exact overlap, as KV
    events give it), and the active term counts the KV blocks of every sequence on the worker."""

    name = "dynamo-cost"

    def __init__(self, view: FleetView, rng: random.Random, overlap_weight: float = 1.0):
        self._view = view
        self._rng = rng
        self.overlap_weight = overlap_weight

    def cost(self, request: RouteRequest, worker_id: str) -> float:
        v = self._view
        blocks = len(request.block_hashes) or 1
        new = blocks - v.cached_blocks(worker_id, request.block_hashes)
        prefill = v.pending_prefill_blocks(worker_id) + new
        return self.overlap_weight * prefill + v.active_blocks(worker_id)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        costs = [(self.cost(request, c.worker_id), c.worker_id) for c in candidates]
        best = min(cost for cost, _ in costs)
        return self._rng.choice([w for cost, w in costs if cost == best])


BASELINES = (
    "random",
    "round-robin",
    "least-loaded",
    "consistent-hash",
    "sglang-cache-aware",
    "dynamo-cost",
)
POLICIES = ("sluice", *BASELINES)
ABLATIONS = ("sluice-uncalibrated",)
"""Variants of ``sluice`` for ablations; not in the default comparison."""


def make_policy(
    name: str,
    view: FleetView,
    workers: Sequence[str],
    seed: int,
    *,
    profile: EngineProfile = REFERENCE,
    key_tokens: int = 1024,
    explain: bool = False,
) -> RoutingPolicy:
    """A policy by its name in :data:`POLICIES`; ``sluice`` is the live dispatcher's default,
    with its prior speeds taken from ``profile``."""
    rng = random.Random(seed)
    if name in ("sluice", "sluice-uncalibrated"):
        return CacheAware(
            CacheAwareConfig(
                block_tokens=profile.block_tokens,
                index_stride=1,  # trace blocks are already coarse (128-512 tokens)
                key_tokens=key_tokens,
                prefill_tokens_per_s=profile.prefill_tokens_per_s,
                decode_step_s=profile.decode_base_s + 16 * profile.decode_per_seq_s,
                explain=explain,
                calibrate=name == "sluice",
            )
        )
    if name == "random":
        return RandomPolicy(rng)
    if name == "round-robin":
        return RoundRobin(workers)
    if name == "least-loaded":
        return LeastPending(view, rng)
    if name == "consistent-hash":
        return ConsistentHash(workers)
    if name == "sglang-cache-aware":
        return SglangCacheAware(rng)
    if name == "dynamo-cost":
        return DynamoCost(view, rng)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES + ABLATIONS)}")

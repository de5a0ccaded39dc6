"""Baseline routing policies for the replay, behind the dispatcher's ``RoutingPolicy``
interface, and the factory that names them (pure, seeded).

``sluice`` and ``least-loaded`` are the live dispatcher's policies, built by the same function
(:func:`sluice.dispatcher.policies.build_policy`). Baselines that need to see the fleet (cache
contents, engine load) get a :class:`FleetView`; those that learn from their own decisions do
it in ``observe``, after each booking. Every ``choose`` is free of side effects: ties and
random picks are broken by hashes (:func:`~sluice.dispatcher.routing.tie_rank`), and a plan's
earlier decisions are seen through the candidates' ``planned*`` fields.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import xxhash

from sluice.dispatcher.cacheaware import CacheAwareConfig
from sluice.dispatcher.policies import build_policy
from sluice.dispatcher.routing import (
    Candidate,
    RouteRequest,
    RoutingPolicy,
    StatelessPolicy,
    pick_tied,
)


class FleetView(Protocol):
    """What a policy may look up about a worker (in the replay: the engines' exact state, as
    KV events would report it)."""

    def cached_blocks(self, worker_id: str, hashes: Sequence[int]) -> int: ...
    def pending_prefill_blocks(self, worker_id: str) -> int: ...
    def active_blocks(self, worker_id: str) -> int: ...
    def pending_tokens(self, worker_id: str) -> int: ...


class RandomPolicy(StatelessPolicy):
    """A uniformly random worker per request (by hash: the same seed, the same choices)."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self._seed = seed

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        return pick_tied(request.request_id, candidates, self._seed)


class RoundRobin(StatelessPolicy):
    """Workers in a fixed cycle; a worker without room is skipped (the worker with the fewest
    requests sent so far, counting this plan's, first in the cycle among equals)."""

    name = "round-robin"

    def __init__(self, workers: Sequence[str]) -> None:
        self._position = {w: i for i, w in enumerate(workers)}
        self._sent: Counter[str] = Counter()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        last = len(self._position)
        return min(
            candidates,
            key=lambda c: (
                self._sent[c.worker_id] + c.planned,
                self._position.get(c.worker_id, last),
            ),
        ).worker_id

    def observe(self, request: RouteRequest, worker_id: str, now_s: float) -> None:
        self._sent[worker_id] += 1


class LeastPending(StatelessPolicy):
    """``least-pending``: the fewest pending tokens on the engine (prompt tokens still to
    prefill plus output tokens still to generate, as the engine knows them, plus this plan's
    decisions); ties by hash. The live ``least-loaded`` counts what the dispatcher booked and
    what heartbeats report instead."""

    name = "least-pending"

    def __init__(self, view: FleetView, seed: int) -> None:
        self._view = view
        self._seed = seed

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        loads = [(self._view.pending_tokens(c.worker_id) + c.planned_tokens, c) for c in candidates]
        best = min(load for load, _ in loads)
        return pick_tied(request.request_id, [c for load, c in loads if load == best], self._seed)


class ConsistentHash(StatelessPolicy):
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


class SglangCacheAware(StatelessPolicy):
    """The SGLang gateway's ``cache_aware`` policy (REFERENCES.md): per worker, a prefix tree
    of what *it routed there* (chained block hashes: a radix tree over blocks), LRU-bounded;
    a fleet-wide imbalance gate on in-flight requests (max - min > 64 and max > 1.5 x min →
    least loaded); else the longest match if its ratio exceeds 0.3, otherwise least loaded."""

    name = "sglang-cache-aware"

    def __init__(
        self,
        seed: int,
        *,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        tree_blocks: int = 1 << 20,
    ) -> None:
        self._seed = seed
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._tree_blocks = tree_blocks
        self._trees: dict[str, OrderedDict[int, None]] = {}

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > lo * self.balance_rel

    def _least_loaded(self, request: RouteRequest, candidates: Sequence[Candidate]) -> str:
        lo = min(c.booked for c in candidates)
        tied = [c for c in candidates if c.booked == lo]
        return pick_tied(request.request_id, tied, self._seed)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        if self.imbalanced([c.booked for c in candidates]) or not request.block_hashes:
            return self._least_loaded(request, candidates)
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
        return self._least_loaded(request, candidates)

    def observe(self, request: RouteRequest, worker_id: str, now_s: float) -> None:
        tree = self._trees.setdefault(worker_id, OrderedDict())
        for h in request.block_hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self._tree_blocks:
            tree.popitem(last=False)


class DynamoCost(StatelessPolicy):
    """NVIDIA Dynamo's KV router cost, ``overlap_weight x prefill blocks + active blocks``,
    argmin with random tie-breaks. As in Dynamo's scheduler, the prefill term is the worker's
    outstanding prefill plus this request's blocks not cached there (exact overlap, as KV
    events give it), and the active term counts the KV blocks of every sequence on the worker."""

    name = "dynamo-cost"

    def __init__(
        self, view: FleetView, seed: int, block_tokens: int, overlap_weight: float = 1.0
    ) -> None:
        self._view = view
        self._seed = seed
        self._block_tokens = block_tokens
        self.overlap_weight = overlap_weight

    def cost(self, request: RouteRequest, c: Candidate) -> float:
        """The worker's cost; this plan's earlier decisions add their prefill to the worker's
        pending prefill and to its active blocks, as Dynamo's router books them."""
        v, w = self._view, c.worker_id
        blocks = len(request.block_hashes) or 1
        new = blocks - v.cached_blocks(w, request.block_hashes)
        planned = c.planned_prefill_tokens // self._block_tokens
        prefill = v.pending_prefill_blocks(w) + planned + new
        return self.overlap_weight * prefill + v.active_blocks(w) + planned

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        costs = [(self.cost(request, c), c) for c in candidates]
        best = min(cost for cost, _ in costs)
        return pick_tied(request.request_id, [c for cost, c in costs if cost == best], self._seed)


BASELINES = (
    "random",
    "round-robin",
    "least-loaded",
    "least-pending",
    "consistent-hash",
    "sglang-cache-aware",
    "dynamo-cost",
)
POLICIES = ("sluice", *BASELINES)
ABLATIONS = ("sluice-uncalibrated",)
"""Variants of ``sluice`` for ablations; not in the default comparison."""


def make_policy(
    name: str, view: FleetView, workers: Sequence[str], seed: int, routing: CacheAwareConfig
) -> RoutingPolicy:
    """A policy by its name in :data:`POLICIES` or :data:`ABLATIONS`. ``routing`` is the live
    dispatcher's routing configuration for this fleet: ``sluice`` is exactly the policy a live
    dispatcher builds from it, and ``least-loaded`` the live least-loaded policy."""
    if name == "sluice":
        return build_policy("cache-aware", routing, seed)
    if name == "sluice-uncalibrated":
        return build_policy("cache-aware", replace(routing, calibrate=False), seed)
    if name == "least-loaded":
        return build_policy("least-loaded", routing, seed)
    if name == "random":
        return RandomPolicy(seed)
    if name == "round-robin":
        return RoundRobin(workers)
    if name == "least-pending":
        return LeastPending(view, seed)
    if name == "consistent-hash":
        return ConsistentHash(workers)
    if name == "sglang-cache-aware":
        return SglangCacheAware(seed)
    if name == "dynamo-cost":
        return DynamoCost(view, seed, routing.block_tokens)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES + ABLATIONS)}")

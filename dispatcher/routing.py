"""The routing-policy interface and the least-loaded policy (pure).

A policy *selects*; it never books. The scheduler hands it the candidates that can take the
request now (live, not draining, with free capacity) with the load the scheduler has already
planned onto them, and books the choice only after the worker accepted.

Every policy has the same hooks (:class:`RoutingPolicy`), so the runtime and the replay feed
any policy the same way: ``observe`` after a booking, ``heartbeat`` with a worker's cache
digest, ``completed`` with a completion's figures, ``remove_worker`` when a lease ends and
``expire`` now and then. :class:`StatelessPolicy` gives a policy that learns nothing the no-op
hooks.
"""

from __future__ import annotations

import abc
import functools
import itertools
import math
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, overload, runtime_checkable

import xxhash

from sluice.dispatcher.frozen import fast_init


class Candidate(NamedTuple):
    """A worker that could take a request now, as the policy sees it (a named tuple: the
    scheduler builds one per worker for every decision, and tuples are cheap to build)."""

    worker_id: str
    capacity: int
    """How many requests the worker takes at once."""
    booked: int
    """Requests booked (or planned) on it by this dispatcher."""
    booked_tokens: int
    """Prompt plus maximum output tokens of those requests: the work they bring."""
    reported_pending_tokens: int = 0
    """Pending prefill plus active decode tokens in the worker's last heartbeat."""
    reported_prefill_tokens: int = 0
    """Prompt tokens still to prefill on the worker at its last heartbeat."""
    unreported_prefill_tokens: int = 0
    """Prefill expected from requests booked here that the last heartbeat did not list yet
    (prompt minus the hit expected at routing)."""
    report_age_s: float = 0.0
    """How old the last heartbeat is."""
    joined_s: float = float("-inf")
    """When the worker first heartbeated (cold-start exploration)."""
    planned: int = 0
    """Requests planned onto it earlier in the same plan (counted in ``booked`` too)."""
    planned_tokens: int = 0
    """Their prompt plus maximum output tokens (counted in ``booked_tokens`` too)."""
    planned_prefill_tokens: int = 0
    """Their expected prefill (counted in ``unreported_prefill_tokens`` too)."""


class CandidatePool(Sequence[Candidate], abc.ABC):
    """The candidates of one decision, built on demand: a policy that scores only a few
    workers asks for them by id (:meth:`get`) and by load (:meth:`least_loaded`,
    :meth:`joined_after`); one that iterates gets every candidate, as from a list.

    The planner hands one to every policy; the order "least loaded" is the policy's
    :meth:`Shortlisting.load_key` when it has one (a policy without one gets no order).
    """

    @abc.abstractmethod
    def get(self, worker_id: str) -> Candidate | None:
        """The candidate ``worker_id``, or None if it cannot take the request now."""

    @abc.abstractmethod
    def load_key(self, worker_id: str) -> float | None:
        """The candidate's place in the load order, or None if it is not a candidate."""

    def keyed_groups(
        self,
        worker_ids: Iterable[str],
        blocks_of: Mapping[str, int],
        skip: Container[str] | None = None,
    ) -> dict[int, list[tuple[float, str]]]:
        """(load key, worker) of those of ``worker_ids`` not in ``skip`` that are candidates,
        in the order given, grouped by ``blocks_of`` (the index entries of the prompt each
        holds; 0 if absent)."""
        groups: dict[int, list[tuple[float, str]]] = {}
        for w in worker_ids:
            if skip is not None and w in skip:
                continue
            key = self.load_key(w)
            if key is not None:
                groups.setdefault(blocks_of.get(w, 0), []).append((key, w))
        return groups

    def least_groups(
        self,
        worker_ids: Iterable[str],
        blocks_of: Mapping[str, int],
        skip: Container[str] | None,
        m: int,
    ) -> dict[int, tuple[list[tuple[float, str]], int]]:
        """:meth:`keyed_groups`, each group as its ``m`` least (load key, worker), least
        first, and how many it has."""
        groups = self.keyed_groups(worker_ids, blocks_of, skip)
        return {b: (sorted(g)[:m], len(g)) for b, g in groups.items()}

    @abc.abstractmethod
    def ids_by_load(self) -> Iterator[tuple[float, str]]:
        """(load key, worker) of every candidate in load order (lowest key first), without
        building the candidates: a policy builds (:meth:`get`) only those it scores."""

    def by_load(self) -> Iterator[tuple[float, Candidate]]:
        """(load key, candidate) in load order (lowest key first), built as they are taken."""
        for key, w in self.ids_by_load():
            c = self.get(w)
            if c is not None:
                yield key, c

    def least_loaded(self, n: int) -> list[Candidate]:
        """Up to ``n`` candidates with the lowest load key, lowest first."""
        return [c for _, c in itertools.islice(self.by_load(), n)]

    @abc.abstractmethod
    def joined_after(self, t_s: float) -> list[Candidate]:
        """Every candidate whose worker first heartbeated after ``t_s``."""

    def under(
        self, share: float, key: float, queue: float = math.inf, drain: float = 0.0
    ) -> tuple[int, Iterator[str]] | None:
        """How many candidates may have less than ``share`` of their capacity booked, a
        load key under ``key`` and at most ``queue`` prefill tokens ahead (what they reported,
        drained at ``drain`` tokens/s since, plus what was booked since), and they (every
        candidate that has, perhaps a few more), without reading the others; None if the pool
        keeps no such order."""
        return None

    @abc.abstractmethod
    def _all(self) -> Sequence[Candidate]:
        """Every candidate (built once, on the first iteration or index)."""

    def __len__(self) -> int:
        return len(self._all())

    @overload
    def __getitem__(self, i: int) -> Candidate: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Candidate]: ...
    def __getitem__(self, i: int | slice) -> Candidate | Sequence[Candidate]:
        return self._all()[i]

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self._all())


class ListPool(CandidatePool):
    """A :class:`CandidatePool` over a list (tests, and callers that have every candidate)."""

    def __init__(self, candidates: Sequence[Candidate], key: LoadKey | None = None) -> None:
        self._list = list(candidates)
        self._by_id = {c.worker_id: c for c in self._list}
        k = key or default_load_key
        self._key = {
            c.worker_id: k(c.booked, c.capacity, c.unreported_prefill_tokens) for c in self._list
        }
        self._order = sorted(self._list, key=lambda c: (self._key[c.worker_id], c.worker_id))

    def get(self, worker_id: str) -> Candidate | None:
        return self._by_id.get(worker_id)

    def load_key(self, worker_id: str) -> float | None:
        return self._key.get(worker_id)

    def ids_by_load(self) -> Iterator[tuple[float, str]]:
        return ((self._key[c.worker_id], c.worker_id) for c in self._order)

    def by_load(self) -> Iterator[tuple[float, Candidate]]:
        return ((self._key[c.worker_id], c) for c in self._order)

    def joined_after(self, t_s: float) -> list[Candidate]:
        return [c for c in self._list if c.joined_s > t_s]

    def under(
        self, share: float, key: float, queue: float = math.inf, drain: float = 0.0
    ) -> tuple[int, Iterator[str]] | None:
        keys = self._key
        under = [
            c.worker_id
            for c in self._list
            if c.booked < share * c.capacity
            and keys[c.worker_id] < key
            and c.reported_prefill_tokens - c.report_age_s * drain + c.unreported_prefill_tokens
            <= queue
        ]
        return len(under), iter(under)

    def _all(self) -> Sequence[Candidate]:
        return self._list


class ExcludingPool(CandidatePool):
    """``inner`` without the workers in ``off`` (the planner's pool for a retried request,
    kept off the workers it failed on)."""

    __slots__ = ("_inner", "_list", "_off", "_skip")

    def __init__(self, inner: CandidatePool, off: frozenset[str]) -> None:
        self._inner, self._off = inner, off
        self._skip = _Either(off)
        self._list: list[Candidate] | None = None

    def __len__(self) -> int:
        inner = self._inner
        return len(inner) - sum(1 for w in self._off if inner.load_key(w) is not None)

    def get(self, worker_id: str) -> Candidate | None:
        return None if worker_id in self._off else self._inner.get(worker_id)

    def load_key(self, worker_id: str) -> float | None:
        return None if worker_id in self._off else self._inner.load_key(worker_id)

    def keyed_groups(
        self,
        worker_ids: Iterable[str],
        blocks_of: Mapping[str, int],
        skip: Container[str] | None = None,
    ) -> dict[int, list[tuple[float, str]]]:
        return self._inner.keyed_groups(worker_ids, blocks_of, self._skip.with_(skip))

    def least_groups(
        self,
        worker_ids: Iterable[str],
        blocks_of: Mapping[str, int],
        skip: Container[str] | None,
        m: int,
    ) -> dict[int, tuple[list[tuple[float, str]], int]]:
        return self._inner.least_groups(worker_ids, blocks_of, self._skip.with_(skip), m)

    def ids_by_load(self) -> Iterator[tuple[float, str]]:
        off = self._off
        return ((k, w) for k, w in self._inner.ids_by_load() if w not in off)

    def by_load(self) -> Iterator[tuple[float, Candidate]]:
        off = self._off
        return ((k, c) for k, c in self._inner.by_load() if c.worker_id not in off)

    def joined_after(self, t_s: float) -> list[Candidate]:
        return [c for c in self._inner.joined_after(t_s) if c.worker_id not in self._off]

    def under(
        self, share: float, key: float, queue: float = math.inf, drain: float = 0.0
    ) -> tuple[int, Iterator[str]] | None:
        under = self._inner.under(share, key, queue, drain)
        if under is None:
            return None
        kept = [w for w in under[1] if w not in self._off]
        return len(kept), iter(kept)

    def _all(self) -> Sequence[Candidate]:
        if self._list is None:
            self._list = [c for c in self._inner if c.worker_id not in self._off]
        return self._list


class _Either:
    """``off``, or ``off`` and a policy's own ``skip``: one container for the native loops."""

    __slots__ = ("_off", "_skip")

    def __init__(self, off: Container[str], skip: Container[str] | None = None) -> None:
        self._off, self._skip = off, skip

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._off or (self._skip is not None and worker_id in self._skip)

    def with_(self, skip: Container[str] | None) -> _Either:
        return self if skip is None else _Either(self._off, skip)


class LoadKey(Protocol):
    """A worker's place in the "least loaded" order, from what changes only when it is
    booked or released (never with the clock): its requests booked here, its capacity and
    the prefill booked here that its heartbeats did not report yet. What it reports itself
    decays with the clock, so it is left out: the key is a lower bound of the load, and a
    policy may stop looking once that bound exceeds its best so far."""

    def __call__(self, booked: int, capacity: int, unreported_prefill_tokens: int) -> float: ...


@runtime_checkable
class Shortlisting(Protocol):
    """A policy that scores only a shortlist: it orders workers by its own load key."""

    def load_key(self, booked: int, capacity: int, unreported_prefill_tokens: int) -> float:
        """The worker's place in the order (lower: less loaded); see :class:`LoadKey`."""
        ...


def default_load_key(booked: int, capacity: int, unreported_prefill_tokens: int) -> float:
    """Booked share of the capacity, then booked prefill (a policy without its own key)."""
    return booked / (capacity or 1) + unreported_prefill_tokens * 1e-9


@fast_init
@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[int, ...] = ()
    affinity_key: int | None = None
    """A session's key (:func:`~sluice.schemas.hashing.session_key`): it sticks by this instead
    of its prompt prefix."""


@fast_init
@dataclass(frozen=True)
class Choice:
    """A policy's decision, with what it expects and (when asked) why: the decision log."""

    worker_id: str
    expected_hit_tokens: int = 0
    """Prompt tokens the policy expects the worker to find in its KV cache."""
    reason: str = ""
    """Which rule decided (for example ``sticky``, ``spill``, ``explore``)."""
    terms: tuple[dict[str, float | str], ...] = ()
    """Per candidate: its score terms (filled only when the policy explains itself)."""


@fast_init
@dataclass(frozen=True)
class Digest:
    """A worker's cache report, as a policy takes it: a numbered delta or a full snapshot of
    the block hashes it holds (see :class:`~sluice.schemas.models.CacheDigest`)."""

    seq: int
    snapshot: bool
    stored: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()


class RoutingPolicy(Protocol):
    """Chooses one of the candidates for a request, and learns from what happens.

    ``choose`` must not change any state: a choice may be discarded if the worker refuses,
    and a plan asks for several choices before any is booked. Learning happens in the hooks.
    """

    name: str
    uses_digests: bool
    """Whether ``heartbeat`` wants workers' cache digests (the replay builds them only then)."""

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float
    ) -> str | Choice:
        """Return one of ``candidates`` (never empty), by ``worker_id`` or as a ``Choice``."""
        ...

    def observe(self, request: RouteRequest, worker_id: str, now_s: float) -> None:
        """The worker accepted ``request``: it was booked there."""
        ...

    def heartbeat(self, worker_id: str, digest: Digest | None, now_s: float) -> bool:
        """A worker's heartbeat with its cache digest; False if the digest was not usable
        (a delta after a gap)."""
        ...

    def completed(self, worker_id: str, request: RouteRequest, outcome: Outcome) -> None:
        """``request`` finished on ``worker_id``."""
        ...

    def remove_worker(self, worker_id: str) -> None:
        """The worker's lease ended or it left."""
        ...

    def expire(self, now_s: float, max_blocks: int | None = None) -> int:
        """Forget what has expired (bounded by ``max_blocks``); returns how much was dropped."""
        ...

    def stats(self, now_s: float) -> PolicyStats:
        """Figures for the dispatcher's gauges."""
        ...


@dataclass(frozen=True)
class PolicyStats:
    """What a policy knows about the fleet's cache, for gauges."""

    index_blocks: int = 0
    """Block hashes in its cache index."""
    replicated_prefixes: int = 0
    """Prefixes with a live replica set."""
    max_replicas: int = 0
    """The largest replica set."""
    replica_sets: Mapping[int, int] = field(default_factory=dict)
    """Replica-set size -> how many prefixes have a live set of that size."""


@fast_init
@dataclass(frozen=True)
class Outcome:
    """What a completion tells a policy: the hit the engine found and the timings."""

    cached_tokens: int
    prefill_s: float
    output_tokens: int
    decode_s: float
    now_s: float


class StatelessPolicy:
    """The hooks of a policy that learns nothing from bookings, heartbeats or completions."""

    name = "stateless"
    uses_digests = False

    def observe(self, request: RouteRequest, worker_id: str, now_s: float) -> None:
        return None

    def heartbeat(self, worker_id: str, digest: Digest | None, now_s: float) -> bool:
        return True

    def completed(self, worker_id: str, request: RouteRequest, outcome: Outcome) -> None:
        return None

    def remove_worker(self, worker_id: str) -> None:
        return None

    def expire(self, now_s: float, max_blocks: int | None = None) -> int:
        return 0

    def stats(self, now_s: float) -> PolicyStats:
        return PolicyStats()


def load_of(c: Candidate) -> float:
    """Work on a worker in tokens: what this dispatcher booked, or what it reports, whichever
    is larger (the report lags; the books miss other dispatchers' work)."""
    return float(max(c.booked_tokens, c.reported_pending_tokens))


_U64 = float(2**64)
_MASK = 2**64 - 1
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying by it mixes the bits of request x worker


@functools.lru_cache(maxsize=65536)
def worker_hash(worker_id: str) -> int:
    """A worker id's 64-bit hash (cached: a fleet has few workers, each seen at every decision)."""
    return xxhash.xxh64_intdigest(worker_id.encode())


def request_hash(request_id: str, seed: int = 0) -> int:
    """A request id's 64-bit hash, salted by ``seed``: the input of :func:`tie_rank`."""
    return xxhash.xxh64_intdigest(request_id.encode()) ^ (seed * _MIX & _MASK)


def tie_rank(request_hash: int, worker_id: str) -> float:
    """A pseudo-random rank in [0, 1) of ``worker_id`` for a request (by its
    :func:`request_hash`). Ties broken by it spread evenly over workers (never by position),
    deterministically, and without side effects: no random generator advances."""
    return (((request_hash ^ worker_hash(worker_id)) * _MIX) & _MASK) / _U64


def pick_tied(request_id: str, tied: Sequence[Candidate], seed: int = 0) -> str:
    """One of ``tied`` (never empty) by :func:`tie_rank`."""
    if len(tied) == 1:
        return tied[0].worker_id
    rh = request_hash(request_id, seed)
    return min(tied, key=lambda c: tie_rank(rh, c.worker_id)).worker_id


class LeastLoaded(StatelessPolicy):
    """The worker with the least work in tokens; ties broken by :func:`tie_rank`, not by
    position."""

    name = "least-loaded"

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        # Least token load, then the relatively emptiest worker, then chance (never position).
        best: tuple[float, float] | None = None
        tied: list[Candidate] = []
        for c in candidates:
            key = (load_of(c), c.booked / max(c.capacity, 1))
            if best is None or key < best:
                best, tied = key, [c]
            elif key == best:
                tied.append(c)
        return pick_tied(request.request_id, tied, self._seed)

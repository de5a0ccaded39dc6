"""Scoring a decision's candidates (pure): the loop that runs for every scored candidate of
every cache-aware decision, keeping only the minimum each rule of
:mod:`sluice.dispatcher.cacheaware` needs.

:func:`score_into_pure` is the reference; ``sluice.dispatcher._scoring``
(``dispatcher/_scoring.c``) runs the same loop in C, calling back into :func:`keep` for a
candidate that could tie or win a minimum (most lose on their score alone, and the minimums
stay in Python tuples). :func:`score_into` is the native loop where it was built, else the
reference. ``tests/test_scoring.py`` drives both with the same random candidates and compares
what they keep.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from sluice.dispatcher.routing import Candidate, tie_rank


@dataclass(slots=True)
class Best:
    """The minimum each rule needs, over the candidates scored so far: (score, tie rank,
    worker, hit) for the score, sticky and explore rules, (rounded queue, miss, tie rank,
    worker, hit) for the expand rule."""

    best: tuple[float, float, str, int] | None = None
    sticky: tuple[float, float, str, int] | None = None
    cold: tuple[float, float, str, int] | None = None
    expand: tuple[float, float, float, str, int] | None = None
    n_cold: int = 0


def keep(
    acc: Best,
    rh: int,
    w: str,
    hit: int,
    score: float,
    queue: tuple[float, float] | None,
    sticky: bool,
    cold: bool,
) -> None:
    """Keep a scored candidate in each minimum of ``acc`` it beats (``queue``: its rounded
    queue and miss, for the expand rule; ``sticky``: a replica under the hard limit; ``cold``:
    new and the request explores)."""
    tie = tie_rank(rh, w)
    key = (score, tie, w, hit)
    if acc.best is None or key < acc.best:
        acc.best = key
    if sticky and (acc.sticky is None or key < acc.sticky):
        acc.sticky = key
    if queue is not None:
        q = (queue[0], queue[1], tie, w, hit)
        if acc.expand is None or q < acc.expand:
            acc.expand = q
    if cold:
        acc.n_cold += 1
        if acc.cold is None or key < acc.cold:
            acc.cold = key


class Weights(NamedTuple):
    """A policy's constants of the score (from its config)."""

    index_block_tokens: int
    min_hit_fraction: float
    ttft_scale_s: float
    w_busy: float
    w_load: float
    w_cache: float
    w_stable: float
    hard_load_fraction: float
    hard_ttft_s: float
    explore_window_s: float


class SpeedsLike(Protocol):
    """A worker's speeds (:class:`~sluice.dispatcher.calibration.Speeds`)."""

    @property
    def prefill_s_per_token(self) -> float: ...
    @property
    def decode_s_per_token(self) -> float: ...


class ScoreInto(Protocol):
    """The signature :func:`score_into_pure` and the native loop share."""

    def __call__(
        self,
        acc: Best,
        keep: Callable[[Best, int, str, int, float, tuple[float, float] | None, bool, bool], None],
        candidates: Iterable[Candidate],
        weights: Weights,
        matches: dict[str, int],
        rep_set: frozenset[str],
        n_indexed: int,
        prompt: int,
        rh: int,
        speeds: Mapping[str, SpeedsLike] | None,
        prior: SpeedsLike,
        explores: bool,
        now_s: float,
        common: frozenset[str],
        common_blocks: int,
        rep_common: bool,
        /,
    ) -> None: ...


def score_into_pure(
    acc: Best,
    keep: Callable[[Best, int, str, int, float, tuple[float, float] | None, bool, bool], None],
    candidates: Iterable[Candidate],
    weights: Weights,
    matches: dict[str, int],
    rep_set: frozenset[str],
    n_indexed: int,
    prompt: int,
    rh: int,
    speeds: Mapping[str, SpeedsLike] | None,
    prior: SpeedsLike,
    explores: bool,
    now_s: float,
    common: frozenset[str],
    common_blocks: int,
    rep_common: bool,
    /,
) -> None:
    """Score ``candidates`` into ``acc`` (the terms of
    :meth:`~sluice.dispatcher.cacheaware.CacheAware.score`, in one pass). ``candidates`` may
    be a generator that reads ``acc`` between two of them; ``speeds``: every worker's learned
    speeds by id (a dict, which may compute a missing one: ``Calibration.table()``), or None
    for ``prior`` for all. The prompt's holders as ``CacheIndex.match_split`` gives them: each
    of ``matches`` holds its count of index entries, each other of ``common`` holds
    ``common_blocks``; the replicas are ``rep_set`` and, if ``rep_common``, ``common``."""
    ibt, min_hit, scale, w_busy, w_load, w_cache, w_stable, hard_fraction, hard_ttft, window = (
        weights
    )
    best, sticky, expand = acc.best, acc.sticky, acc.expand
    has_reps = bool(rep_set) or (rep_common and bool(common))
    for cand in candidates:
        w = cand.worker_id
        blocks = matches.get(w, common_blocks if w in common else 0)
        hit = min(blocks * ibt, prompt - 1) if blocks else 0
        fraction = blocks / n_indexed if n_indexed else 0.0
        miss = 1.0 - fraction if fraction >= min_hit else 1.0
        sp = speeds[w] if speeds is not None else prior
        per_token = sp.prefill_s_per_token
        ahead = cand.reported_prefill_tokens - cand.report_age_s / per_token
        ahead = (ahead if ahead > 0.0 else 0.0) + cand.unreported_prefill_tokens
        own = prompt - hit if prompt - hit > 1 else 1
        ttft = (ahead + own) * per_token + sp.decode_s_per_token
        busy = w_busy * cand.booked / (cand.capacity or 1)
        is_rep = w in rep_set or (rep_common and w in common)
        moved = 1.0 if has_reps and not is_rep else 0.0
        s = w_load * (ttft / scale + busy) + w_cache * miss + w_stable * moved
        cold = explores and now_s - cand.joined_s < window
        # Most candidates lose on the score (and queue) alone: only one that could tie or
        # win a rule's minimum gets its tie rank hashed and its tuples compared. Without
        # replicas neither the sticky nor the expand rule can decide.
        if has_reps:
            rq = round(ahead * per_token / scale + busy, 2)
            if not (
                cold
                or best is None
                or s <= best[0]
                or (is_rep and (sticky is None or s <= sticky[0]))
                or expand is None
                or rq <= expand[0]
            ):
                continue
            over = cand.booked >= hard_fraction * cand.capacity or ttft > hard_ttft
            keep(acc, rh, w, hit, s, (rq, miss), is_rep and not over, cold)
            best, sticky, expand = acc.best, acc.sticky, acc.expand
        elif cold or best is None or s <= best[0]:
            keep(acc, rh, w, hit, s, None, False, cold)
            best = acc.best


_INF = float("inf")


def group_keys_pure(
    workers: Iterable[str],
    blocks_of: Mapping[str, int],
    skip: Container[str] | None,
    moved_key: Mapping[str, float],
    keys: Mapping[str, float],
    /,
) -> dict[int, list[tuple[float, str]]]:
    """Per index entries of the prompt held (``blocks_of``, 0 for a worker not in it), the
    (load key, worker) of each of ``workers`` not in ``skip`` that is a candidate: its key in
    ``moved_key`` (the plan's own bookings moved it; inf: it is full) if there, else in
    ``keys`` (the scheduler's order of workers with room); in neither, it is none. The loop a
    decision runs over every holder of its prefix (on a fleet that caches one system prompt
    everywhere, every worker)."""
    groups: dict[int, list[tuple[float, str]]] = {}
    for w in workers:
        if skip is not None and w in skip:
            continue
        key = moved_key.get(w)
        if key is None:
            key = keys.get(w)
            if key is None:
                continue
        elif key == _INF:
            continue
        blocks = blocks_of.get(w, 0)
        group = groups.get(blocks)
        if group is None:
            groups[blocks] = [(key, w)]
        else:
            group.append((key, w))
    return groups


def held_at_least_pure(
    matches: dict[str, int], need: int, exclude: Container[str] | None, /
) -> list[str]:
    """The workers of ``matches`` (worker -> index entries of the prompt it holds) holding at
    least ``need``, but those in ``exclude``, in ``matches``' order."""
    if exclude is None:
        return [w for w, b in matches.items() if b >= need]
    return [w for w, b in matches.items() if b >= need and w not in exclude]


class HeldAtLeast(Protocol):
    """The signature :func:`held_at_least_pure` and the native loop share."""

    def __call__(
        self, matches: dict[str, int], need: int, exclude: Container[str] | None, /
    ) -> list[str]: ...


LEAST_MAX = 64
"""The most :func:`least_keys` keeps per group (the native loop's bound)."""


def least_keys_pure(
    workers: Iterable[str],
    blocks_of: Mapping[str, int],
    skip: Container[str] | None,
    moved_key: Mapping[str, float],
    keys: Mapping[str, float],
    m: int,
    /,
) -> dict[int, tuple[list[tuple[float, str]], int]]:
    """:func:`group_keys_pure`'s groups, each as its ``m`` least (load key, worker), least
    first, and how many it has: a decision takes the k least of each and looks further only
    as far as a bound could still win, so a group of a whole fleet is never listed."""
    if not 1 <= m <= LEAST_MAX:
        raise ValueError(f"least_keys(): m must be within [1, {LEAST_MAX}]")
    groups = group_keys_pure(workers, blocks_of, skip, moved_key, keys)
    return {b: (sorted(g)[:m], len(g)) for b, g in groups.items()}


class LeastKeys(Protocol):
    """The signature :func:`least_keys_pure` and the native loop share."""

    def __call__(
        self,
        workers: Iterable[str],
        blocks_of: Mapping[str, int],
        skip: Container[str] | None,
        moved_key: Mapping[str, float],
        keys: Mapping[str, float],
        m: int,
        /,
    ) -> dict[int, tuple[list[tuple[float, str]], int]]: ...


class GroupKeys(Protocol):
    """The signature :func:`group_keys_pure` and the native loop share."""

    def __call__(
        self,
        workers: Iterable[str],
        blocks_of: Mapping[str, int],
        skip: Container[str] | None,
        moved_key: Mapping[str, float],
        keys: Mapping[str, float],
        /,
    ) -> dict[int, list[tuple[float, str]]]: ...


NATIVE: bool
"""Whether :func:`score_into`, :func:`group_keys`, :func:`least_keys` and
:func:`held_at_least` are the native loops (else the references)."""
score_into: ScoreInto
group_keys: GroupKeys
held_at_least: HeldAtLeast
least_keys: LeastKeys
try:
    from sluice.dispatcher._scoring import group_keys as _native_groups
    from sluice.dispatcher._scoring import held_at_least as _native_held
    from sluice.dispatcher._scoring import least_keys as _native_least
    from sluice.dispatcher._scoring import score_into as _native

    score_into = _native
    group_keys = _native_groups
    held_at_least = _native_held
    least_keys = _native_least
    NATIVE = True
except ImportError:  # installed without a C compiler: the references
    score_into = score_into_pure
    group_keys = group_keys_pure
    held_at_least = held_at_least_pure
    least_keys = least_keys_pure
    NATIVE = False

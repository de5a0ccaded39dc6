"""Planning (pure): which queued requests go to which workers now, within every limit.

:func:`plan` walks the heads of the (band, model) queues in priority order (earliest virtual
deadline first, see :mod:`sluice.dispatcher.admission`) and asks the routing policy to choose
among the workers that can take each request. It changes nothing: it counts what it has
planned (room, quota, load) only in its own scratch state, so the candidates of each decision
already carry the load of the decisions before it in the same plan.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.books import Books
from sluice.dispatcher.enginetime import EngineTime
from sluice.dispatcher.pool import FreeWorkers
from sluice.dispatcher.queues import Queues
from sluice.dispatcher.quotas import Level, Quotas
from sluice.dispatcher.routing import (
    Candidate,
    CandidatePool,
    Choice,
    ExcludingPool,
    LoadKey,
    RoutingPolicy,
)
from sluice.dispatcher.scoring import LEAST_MAX, group_keys, least_keys
from sluice.dispatcher.shares import BandMeter, ShareKind
from sluice.dispatcher.work import Dispatch, Request, WorkerInfo

SCAN_LIMIT = 256
"""Queued requests of one (band, model) queue that one plan looks past when quotas block them."""

_Head = tuple[float, int, str, str, int]
"""(priority key, seq, band, model, index in its queue)"""


@dataclass
class _Scratch:
    """What this plan has taken so far, per worker, band and quota level."""

    planned: Counter[str] = field(default_factory=Counter)
    planned_tokens: Counter[str] = field(default_factory=Counter)
    planned_prefill: Counter[str] = field(default_factory=Counter)
    band_room: dict[str, int] = field(default_factory=dict)
    running_in: Counter[str] = field(default_factory=Counter)
    levels: Counter[Level] = field(default_factory=Counter)
    charged: dict[tuple[str, str], float] = field(default_factory=dict)
    """Engine-seconds this plan charged to each (band, budget)."""
    filled: Counter[str] = field(default_factory=Counter)
    """Per model: its workers this plan filled (they had room when it began)."""
    moved: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    """Per model: (load key, worker) of its workers this plan booked onto that still have
    room, sorted."""
    walked: dict[str, int] = field(default_factory=dict)
    """Per model: how many entries at the front of the scheduler's order this plan moved
    (a walk starts past them: the plan moves workers, never back)."""
    moved_key: dict[str, float] = field(default_factory=dict)
    made: dict[str, Candidate | None] = field(default_factory=dict)
    """Candidates built so far in this plan (a worker's changes only when it is planned)."""
    kept: dict[tuple[str, frozenset[str]], frozenset[str]] = field(default_factory=dict)
    """(model, workers failed on) -> :func:`kept_off`'s answer, in this plan."""


@dataclass(frozen=True)
class PlanInput:
    """Everything a plan reads (the scheduler's state, by reference; nothing is changed)."""

    config: AdmissionConfig
    policy: RoutingPolicy
    queues: Queues
    books: Books
    workers: Mapping[str, WorkerInfo]
    refused: frozenset[str] | set[str]
    joined_s: Mapping[str, float]
    meter: BandMeter
    engine_time: EngineTime
    free: FreeWorkers
    """The live workers with room, per model, in load order (kept by the scheduler)."""
    served: Mapping[str, int]
    """Models a live, not draining worker serves (-> how many)."""
    joins: Sequence[tuple[float, str]]
    """(first heartbeat, worker), oldest first; entries of departed workers linger."""
    load_key: LoadKey


def plan(state: PlanInput, now_s: float, max_decisions: int | None = None) -> list[Dispatch]:
    """Propose dispatches for now, in priority order, within every limit (see the module
    docstring). ``max_decisions`` stops after that many."""
    cfg = state.config
    global_room = cfg.global_limit - len(state.books)
    if global_room <= 0 or not len(state.queues):
        return []
    scratch = _scratch(state)
    pressed = pressed_bands(state)
    heads = _heads(state, scratch, now_s)
    decisions: list[Dispatch] = []
    skipped: Counter[tuple[str, str]] = Counter()
    limit = global_room if max_decisions is None else min(max_decisions, global_room)
    while heads and len(decisions) < limit:
        _, _, band, model, idx = heapq.heappop(heads)
        if scratch.band_room[band] <= 0:
            continue
        if (
            band in pressed
            and band in cfg.band_shares
            and scratch.running_in[band] >= cfg.band_shares[band]
        ):
            continue  # a more urgent band waits: this one gets no more than its share
        kind = share_kind(state.meter, band, band in pressed, now_s, scratch.charged)
        if kind is None:
            continue  # an offline band without engine time left in its floor or the idle
        q = state.queues.queue(band, model)
        request = state.queues.get(q[idx][2])
        assert request is not None
        levels, amount = quota_use(cfg.quotas, request)
        blocked = state.books.usage.blocked_by(
            cfg.quotas, model, band, request.tenant, amount, scratch.levels
        )
        if blocked is not None:
            # A full tenant must not hold up other tenants behind it. A full model or
            # model-band holds up its whole queue, also with token quotas (where a smaller
            # request might fit): letting it pass could starve the big one.
            skipped[(band, model)] += 1
            if blocked[0] == "model-tenant" and skipped[(band, model)] < SCAN_LIMIT:
                _push_next(heads, q, band, model, idx)
            continue
        if state.free.count(model) <= scratch.filled.get(model, 0):
            continue  # every worker of this model is full: drop its queues from this plan
        if request.deadline_s is None or request.deadline_s > now_s:  # never run an expired one
            pool = _pool(state, scratch, request, now_s)
            if pool is not None:
                d = _decide(state, request, pool, now_s, kind)
                decisions.append(d)
                _take(state, scratch, d, levels, amount)
            else:
                # Kept off every worker with room: it waits for another, and those behind
                # it go, as far as a quota's skip goes (a worker that fails every request
                # fast, always with room, makes a queue of them).
                skipped[(band, model)] += 1
                if skipped[(band, model)] >= SCAN_LIMIT:
                    continue
        _push_next(heads, q, band, model, idx)
    return decisions


def share_kind(
    meter: BandMeter,
    band: str,
    pressed: bool,
    now_s: float,
    charged: Mapping[tuple[str, str], float] | None = None,
) -> ShareKind | None:
    """The engine-time budget a dispatch of ``band`` is charged to now ("" for online bands),
    or None if it has none left: its floor first, then, unless a more urgent band waits
    (``pressed``), the idle capacity (:mod:`sluice.dispatcher.shares`)."""
    if not meter.floored(band):
        return ""
    taken = charged or {}
    if meter.floor_credit(band, now_s) - taken.get((band, "floor"), 0.0) >= 0:
        return "floor"
    if not pressed and meter.idle_credit(band, now_s) - taken.get((band, "idle"), 0.0) >= 0:
        return "idle"
    return None


def _pool(state: PlanInput, s: _Scratch, request: Request, now_s: float) -> CandidatePool | None:
    """The candidates of ``request``'s decision, without the workers it is kept off; None if
    that leaves none."""
    pool = _Pool(state, s, request.model, now_s)
    if not request.failed_on:
        return pool
    key = (request.model, request.failed_on)
    off = s.kept.get(key)
    if off is None:  # (once a plan: a worker that fails every request makes many alike)
        off = s.kept[key] = kept_off(state, request)
    if not off:
        return pool
    kept = ExcludingPool(pool, off)
    return kept if len(kept) else None


def kept_off(state: PlanInput, request: Request) -> frozenset[str]:
    """The workers of its model a plan keeps ``request`` off: those an earlier attempt failed
    on, while the model has another worker that may take work (live, not draining, with a
    capacity, not refused); else none: any may run it again (one engine that failed once may
    well serve the next attempt, and there is no other)."""
    model, workers = request.model, state.workers
    off = frozenset(
        w
        for w in request.failed_on
        if (info := workers.get(w)) is not None and model in info.models
    )
    if not off:
        return off
    refused = state.refused
    for w, info in workers.items():  # (most often the first few have one)
        if (
            w not in off
            and model in info.models
            and info.capacity > 0
            and not info.draining
            and w not in refused
        ):
            return off
    return frozenset()


def _scratch(state: PlanInput) -> _Scratch:
    # Nothing per worker: a plan reads each worker it considers from the books, plus what it
    # planned itself (the scratch's counters).
    s = _Scratch()
    cfg = state.config
    s.band_room = {b: cfg.band_limit(b) - state.books.by_band[b] for b in cfg.bands}
    s.running_in = Counter(state.books.by_band)
    return s


def pressed_bands(state: PlanInput) -> set[str]:
    """Bands held to their shares: a more urgent band has requests waiting that a live worker
    of their model could serve (see ``AdmissionConfig.band_shares``)."""
    cfg = state.config
    served = state.served
    waiting = {band for (band, model), _ in state.queues.queues() if model in served}
    return {
        b
        for i, b in enumerate(cfg.bands)
        if (b in cfg.band_shares or state.meter.floored(b))
        and any(u in waiting for u in cfg.bands[:i])
    }


def _heads(state: PlanInput, scratch: _Scratch, now_s: float) -> list[_Head]:
    # An offline band with floor credit goes first: its floor is guaranteed, also while online
    # requests that sort before it by aging take every slot that frees.
    meter = state.meter
    heads = [
        (
            _FIRST if meter.floored(band) and meter.floor_credit(band, now_s) >= 0 else q[0][0],
            q[0][1],
            band,
            model,
            0,
        )
        for (band, model), q in state.queues.queues()
        if scratch.band_room.get(band, 0) > 0 and state.free.count(model) > 0
    ]
    heapq.heapify(heads)
    return heads


_FIRST = float("-inf")


def _push_next(
    heads: list[_Head], q: Sequence[tuple[float, int, str]], band: str, model: str, idx: int
) -> None:
    if idx + 1 < len(q):
        key, seq, _ = q[idx + 1]
        heapq.heappush(heads, (key, seq, band, model, idx + 1))


def quota_use(quotas: Quotas, r: Request) -> tuple[Sequence[Level], int]:
    """The quota levels ``r`` uses, and how much of each (in its model's unit)."""
    return quotas.use(r.model, r.band, r.tenant, r.prompt_tokens, r.max_tokens, r.engine_ms)


class _Pool(CandidatePool):
    """The candidates of one decision (the live workers of the model with room left in this
    plan), built one by one on demand: a shortlisting policy asks for a few; one that
    iterates gets them all, in the order workers first heartbeated."""

    __slots__ = ("_all_list", "_model", "_now_s", "_s", "_state")

    def __init__(self, state: PlanInput, s: _Scratch, model: str, now_s: float) -> None:
        self._state, self._s, self._model, self._now_s = state, s, model, now_s
        self._all_list: list[Candidate] | None = None

    def __len__(self) -> int:
        return self._state.free.count(self._model) - self._s.filled.get(self._model, 0)

    def get(self, worker_id: str) -> Candidate | None:
        info = self._state.workers.get(worker_id)
        if info is None or self._model not in info.models:
            return None
        made = self._s.made  # only workers with room are ever made
        if worker_id in made:
            return made[worker_id]
        if worker_id not in self._state.free:
            return None
        c = made[worker_id] = self._build(worker_id, info)
        return c

    def load_key(self, worker_id: str) -> float | None:
        moved = self._s.moved_key.get(worker_id)
        if moved is not None:
            return None if moved == float("inf") else moved
        info = self._state.workers.get(worker_id)
        if info is None or self._model not in info.models:
            return None
        return self._state.free.key(worker_id)

    def keyed_groups(
        self,
        worker_ids: Iterable[str],
        blocks_of: Mapping[str, int],
        skip: Container[str] | None = None,
    ) -> dict[int, list[tuple[float, str]]]:
        # load_key() for many workers at once (a decision asks for every holder of its
        # prefix): the same answers, from the model's key map, in one native loop (on a fleet
        # that caches one system prompt everywhere, every worker is a holder).
        return group_keys(
            worker_ids, blocks_of, skip, self._s.moved_key, self._state.free.keys(self._model)
        )

    def least_groups(
        self,
        worker_ids: Iterable[str],
        blocks_of: Mapping[str, int],
        skip: Container[str] | None,
        m: int,
    ) -> dict[int, tuple[list[tuple[float, str]], int]]:
        if m > LEAST_MAX:
            return super().least_groups(worker_ids, blocks_of, skip, m)
        keys = self._state.free.keys(self._model)
        return least_keys(worker_ids, blocks_of, skip, self._s.moved_key, keys, m)

    def ids_by_load(self) -> Iterator[tuple[float, str]]:
        # The plan's own bookings moved some workers in the order: merge those (kept sorted
        # in the scratch) with the scheduler's order, which still has them at their old place.
        s, model = self._s, self._model
        moved, moved_key = s.moved.get(model, _NO_MOVES), s.moved_key
        order = self._state.free.entries(model)
        # The front of the order the plan moved away: skipped once per plan, not per walk
        # (a plan books the least loaded first, so that front grows with every decision).
        start = s.walked.get(model, 0)
        while start < len(order) and order[start][1] in moved_key:
            start += 1
        s.walked[model] = start
        i = 0
        for key, w in order.iter_from(start):
            if w in moved_key:
                continue
            while i < len(moved) and moved[i] < (key, w):
                yield moved[i]
                i += 1
            yield key, w
        yield from moved[i:]

    def by_load(self) -> Iterator[tuple[float, Candidate]]:
        made = self._made
        for key, w in self.ids_by_load():
            yield key, made(w)

    def joined_after(self, t_s: float) -> list[Candidate]:
        joins, joined = self._state.joins, self._state.joined_s
        out = []
        for j in range(len(joins) - 1, -1, -1):
            t, w = joins[j]
            if t <= t_s:
                break
            c = self.get(w) if joined.get(w) == t else None
            if c is not None:
                out.append(c)
        return out

    def under(
        self, share: float, key: float, queue: float = math.inf, drain: float = 0.0
    ) -> tuple[int, Iterator[str]] | None:
        # The scheduler's orders, by booked share, load key and prefill queued, all of which
        # the plan's own bookings only raise: a worker over one there is over it here too.
        # (Those the plan filled are no candidates: get() says so.) The margin keeps in a
        # worker whose share, key or queue rounds to the limit.
        free, m, now = self._state.free, self._model, self._now_s
        return free.under(m, share + _MARGIN, key + _MARGIN, queue + _MARGIN, drain, now)

    def _all(self) -> Sequence[Candidate]:
        if self._all_list is None:
            state, model = self._state, self._model
            free, out = state.free, []
            for w, info in state.workers.items():
                if w in free and model in info.models:
                    c = self._candidate(w, info)
                    if c is not None:
                        out.append(c)
            self._all_list = out
        return self._all_list

    def _made(self, worker_id: str) -> Candidate:
        c = self._candidate(worker_id, self._state.workers[worker_id])
        assert c is not None  # in the order, with room: a candidate
        return c

    def _candidate(self, w: str, info: WorkerInfo) -> Candidate | None:
        made = self._s.made
        if w in made:
            return made[w]
        c = made[w] = self._build(w, info)
        return c

    def _build(self, w: str, info: WorkerInfo) -> Candidate | None:
        s, books = self._s, self._state.books
        # .get, not [w]: a Counter's missing key costs a Python-level call, and most
        # candidates were not planned onto yet.
        planned = s.planned.get(w, 0)
        booked = len(books.on(w)) + planned
        if booked >= info.capacity:
            return None
        age = self._now_s - info.reported_s
        planned_prefill = s.planned_prefill.get(w, 0)
        planned_tokens = s.planned_tokens.get(w, 0)
        return Candidate(
            w,
            info.capacity,
            booked,
            books.tokens_on(w) + planned_tokens,
            info.reported_pending_tokens,
            info.reported_prefill_tokens,
            books.unreported_prefill(w) + planned_prefill,
            age if age > 0.0 else 0.0,
            self._state.joined_s.get(w, _NEVER),
            planned,
            planned_tokens,
            planned_prefill,
        )


_NEVER = float("-inf")
_MARGIN = 1e-9
_NO_MOVES: list[tuple[float, str]] = []


def _decide(
    state: PlanInput,
    request: Request,
    candidates: CandidatePool,
    now_s: float,
    kind: ShareKind,
) -> Dispatch:
    picked = state.policy.choose(request.route_view(), candidates, now_s)
    choice = picked if isinstance(picked, Choice) else Choice(picked)
    cost = state.engine_time.cost_s(request, choice.worker_id, choice.expected_hit_tokens)
    return Dispatch(request, choice.worker_id, choice, share=kind, engine_s=cost)


def _take(state: PlanInput, s: _Scratch, d: Dispatch, levels: Sequence[Level], amount: int) -> None:
    r, w = d.request, d.worker_id
    prefill = d.expected_prefill_tokens
    s.planned[w] += 1
    s.planned_tokens[w] += r.work_tokens
    s.planned_prefill[w] += prefill
    s.made.pop(w, None)
    _moved(state, s, w)
    s.band_room[r.band] -= 1
    s.running_in[r.band] += 1
    if d.share:
        key = (r.band, d.share)
        s.charged[key] = s.charged.get(key, 0.0) + d.engine_s
    for level in levels:
        s.levels[level] += amount


def _moved(state: PlanInput, s: _Scratch, w: str) -> None:
    info, books = state.workers[w], state.books
    old = s.moved_key.pop(w, None)
    if old is not None and old != float("inf"):
        for m in info.models:
            order = s.moved[m]
            del order[bisect.bisect_left(order, (old, w))]
    booked = len(books.on(w)) + s.planned[w]
    if booked >= info.capacity:
        for m in info.models:
            s.filled[m] += 1
        s.moved_key[w] = float("inf")  # out of the order for the rest of the plan
        return
    unreported = books.unreported_prefill(w) + s.planned_prefill[w]
    key = state.load_key(booked, info.capacity, unreported)
    s.moved_key[w] = key
    for m in info.models:
        bisect.insort(s.moved.setdefault(m, []), (key, w))


HOLD_REASONS = (
    "global-limit",
    "band-limit",
    "band-share",
    "band-floor",
    "band-idle",
    "quota:model",
    "quota:model-band",
    "quota:model-tenant",
    "no-worker-room",
    "queue",
)
"""Why a queued request is not running (the first layer that holds it, in this order)."""


def hold_reason(
    state: PlanInput, request: Request, now_s: float, pressed: set[str] | None = None
) -> str:
    """The layer that holds ``request`` in the queue now (one of :data:`HOLD_REASONS`): a
    limit, an engine-time budget or a quota without room for it, no live worker of its model
    with room (but those it is kept off, :func:`kept_off`), or else the requests ahead of it.
    ``pressed``: the bands held to their shares, if already known. Pure, like :func:`plan`."""
    cfg, books = state.config, state.books
    band = request.band
    if len(books) >= cfg.global_limit:
        return "global-limit"
    if books.by_band[band] >= cfg.band_limit(band):
        return "band-limit"
    pressed = pressed_bands(state) if pressed is None else pressed
    is_pressed = band in pressed
    if is_pressed and band in cfg.band_shares and books.by_band[band] >= cfg.band_shares[band]:
        return "band-share"
    if share_kind(state.meter, band, is_pressed, now_s) is None:
        return "band-floor" if is_pressed else "band-idle"
    _, amount = quota_use(cfg.quotas, request)
    blocked = books.usage.blocked_by(cfg.quotas, request.model, band, request.tenant, amount, None)
    if blocked is not None:
        return f"quota:{blocked[0]}"
    off = kept_off(state, request) if request.failed_on else frozenset()
    for wid, info in state.workers.items():
        if (
            request.model in info.models
            and not info.draining
            and wid not in state.refused
            and wid not in off
            and info.capacity > len(books.on(wid))
        ):
            return "queue"
    return "no-worker-room"

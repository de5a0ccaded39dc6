"""Planning (pure): which queued requests go to which workers now, within every limit.

:func:`plan` walks the heads of the (band, model) queues in priority order (earliest virtual
deadline first, see :mod:`sluice.dispatcher.admission`) and asks the routing policy to choose
among the workers that can take each request. It changes nothing: it counts what it has
planned (room, quota, load) only in its own scratch state, so the candidates of each decision
already carry the load of the decisions before it in the same plan.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.books import Books
from sluice.dispatcher.enginetime import EngineTime
from sluice.dispatcher.queues import Queues
from sluice.dispatcher.quotas import Level, Quotas
from sluice.dispatcher.routing import Candidate, Choice, RoutingPolicy
from sluice.dispatcher.shares import BandMeter, ShareKind
from sluice.dispatcher.work import Dispatch, Request, WorkerInfo

SCAN_LIMIT = 256
"""Queued requests of one (band, model) queue that one plan looks past when quotas block them."""

_Head = tuple[float, int, str, str, int]
"""(priority key, seq, band, model, index in its queue)"""


@dataclass
class _Scratch:
    """What this plan has taken so far, per worker, band and quota level."""

    free: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    unreported: dict[str, int] = field(default_factory=dict)
    by_model: dict[str, list[str]] = field(default_factory=dict)
    planned: Counter[str] = field(default_factory=Counter)
    planned_tokens: Counter[str] = field(default_factory=Counter)
    planned_prefill: Counter[str] = field(default_factory=Counter)
    band_room: dict[str, int] = field(default_factory=dict)
    running_in: Counter[str] = field(default_factory=Counter)
    levels: Counter[Level] = field(default_factory=Counter)
    charged: dict[tuple[str, str], float] = field(default_factory=dict)
    """Engine-seconds this plan charged to each (band, budget)."""


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
        candidates = _candidates(state, scratch, model, now_s)
        if not candidates:
            continue  # every worker of this model is full: drop its queues from this plan
        if request.deadline_s is None or request.deadline_s > now_s:  # never run an expired one
            d = _decide(state, request, candidates, now_s, kind)
            decisions.append(d)
            _take(scratch, d, levels, amount)
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


def _scratch(state: PlanInput) -> _Scratch:
    s = _Scratch()
    cfg = state.config
    s.band_room = {b: cfg.band_limit(b) - state.books.by_band[b] for b in cfg.bands}
    s.running_in = Counter(state.books.by_band)
    for wid, info in state.workers.items():
        if info.draining or wid in state.refused:
            continue
        room = info.capacity - len(state.books.on(wid))
        if room <= 0:
            continue
        s.free[wid] = room
        s.tokens[wid] = state.books.tokens_on(wid)
        s.unreported[wid] = state.books.unreported_prefill(wid)
        for m in info.models:
            s.by_model.setdefault(m, []).append(wid)
    return s


def pressed_bands(state: PlanInput) -> set[str]:
    """Bands held to their shares: a more urgent band has requests waiting that a live worker
    of their model could serve (see ``AdmissionConfig.band_shares``)."""
    cfg = state.config
    served = {m for i in state.workers.values() if not i.draining for m in i.models}
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
        if scratch.band_room.get(band, 0) > 0 and model in scratch.by_model
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


def quota_use(quotas: Quotas, r: Request) -> tuple[list[Level], int]:
    """The quota levels ``r`` uses, and how much of each (in its model's unit)."""
    return quotas.use(r.model, r.band, r.tenant, r.prompt_tokens, r.max_tokens, r.engine_ms)


def _candidates(state: PlanInput, s: _Scratch, model: str, now_s: float) -> list[Candidate]:
    # This runs for every worker of every decision: positional fields, hoisted lookups.
    out: list[Candidate] = []
    workers, joined, free_of = state.workers, state.joined_s, s.free
    tokens, unreported = s.tokens, s.unreported
    planned, planned_tokens, planned_prefill = s.planned, s.planned_tokens, s.planned_prefill
    for w in s.by_model[model]:
        free = free_of[w]
        if free <= 0:
            continue
        info = workers[w]
        age = now_s - info.reported_s
        out.append(
            Candidate(
                w,
                info.capacity,
                info.capacity - free,
                tokens[w],
                info.reported_pending_tokens,
                info.reported_prefill_tokens,
                unreported[w],
                age if age > 0.0 else 0.0,
                joined.get(w, _NEVER),
                planned[w],
                planned_tokens[w],
                planned_prefill[w],
            )
        )
    return out


_NEVER = float("-inf")


def _decide(
    state: PlanInput,
    request: Request,
    candidates: Sequence[Candidate],
    now_s: float,
    kind: ShareKind,
) -> Dispatch:
    picked = state.policy.choose(request.route_view(), candidates, now_s)
    choice = picked if isinstance(picked, Choice) else Choice(picked)
    cost = state.engine_time.cost_s(request, choice.worker_id, choice.expected_hit_tokens)
    return Dispatch(request, choice.worker_id, choice, share=kind, engine_s=cost)


def _take(s: _Scratch, d: Dispatch, levels: list[Level], amount: int) -> None:
    r, w = d.request, d.worker_id
    prefill = d.expected_prefill_tokens
    s.free[w] -= 1
    s.tokens[w] += r.work_tokens
    s.unreported[w] += prefill
    s.planned[w] += 1
    s.planned_tokens[w] += r.work_tokens
    s.planned_prefill[w] += prefill
    s.band_room[r.band] -= 1
    s.running_in[r.band] += 1
    if d.share:
        key = (r.band, d.share)
        s.charged[key] = s.charged.get(key, 0.0) + d.engine_s
    for level in levels:
        s.levels[level] += amount


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
    with room, or else the requests ahead of it. ``pressed``: the bands held to their shares,
    if already known. Pure, like :func:`plan`."""
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
    for wid, info in state.workers.items():
        if (
            request.model in info.models
            and not info.draining
            and wid not in state.refused
            and info.capacity > len(books.on(wid))
        ):
            return "queue"
    return "no-worker-room"

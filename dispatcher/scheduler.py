"""The scheduler core (pure): queues, limits, worker books, plan → book.

``plan(now)`` is side-effect free: it walks the queued requests in priority order (see
:mod:`sluice.dispatcher.admission`) and proposes ``Dispatch`` decisions that respect every limit
and every worker's free capacity, counting the decisions it has already proposed. The runtime
offers each one to its worker, and only a worker's acceptance ``book``s it: quota is taken once,
after the worker said yes. A refusal leaves the request queued and the worker out of plans until
its next heartbeat.

The live dispatcher and the simulator drive this same class; nothing here reads a clock,
touches NATS or asyncio.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from sluice.dispatcher.admission import AdmissionConfig, priority_key
from sluice.dispatcher.quotas import Level, Usage
from sluice.dispatcher.routing import Candidate, Choice, RouteRequest, RoutingPolicy
from sluice.schemas.models import Rejection, RejectReason


@dataclass(frozen=True)
class Request:
    """A request as the scheduler holds it. ``arrived_s`` and ``deadline_s`` are on the
    caller's clock (the same clock as every ``now_s``)."""

    request_id: str
    band: str
    model: str
    tenant: str
    prompt_tokens: int
    max_tokens: int
    arrived_s: float
    deadline_s: float | None = None
    block_hashes: tuple[int, ...] = ()
    attempt: int = 1
    """The attempt this request will run as when next dispatched."""

    @property
    def work_tokens(self) -> int:
        """The work the request brings to a worker, in tokens."""
        return self.prompt_tokens + self.max_tokens

    def route_view(self) -> RouteRequest:
        return RouteRequest(
            self.request_id, self.model, self.prompt_tokens, self.max_tokens, self.block_hashes
        )


@dataclass(frozen=True)
class WorkerInfo:
    """A live worker as its last heartbeat described it."""

    worker_id: str
    models: frozenset[str]
    capacity: int
    draining: bool = False
    reported_pending_tokens: int = 0
    reported_in_flight: frozenset[str] = frozenset()
    reported_prefill_tokens: int = 0
    """Prompt tokens still to prefill at the heartbeat."""
    reported_s: float = 0.0
    """When the heartbeat arrived, on the scheduler's clock."""


@dataclass(frozen=True)
class Dispatch:
    """Decision: offer ``request`` to ``worker_id``."""

    request: Request
    worker_id: str
    choice: Choice | None = None
    """The policy's full decision (expected hit, reason, score terms)."""

    @property
    def expected_hit_tokens(self) -> int:
        return self.choice.expected_hit_tokens if self.choice else 0


@dataclass(frozen=True)
class Booking:
    """A request running on a worker, as this dispatcher booked it."""

    request: Request
    worker_id: str
    booked_s: float
    expected_hit_tokens: int = 0


@dataclass(frozen=True)
class Ended:
    """A request that leaves the scheduler without running (a typed rejection)."""

    request: Request
    rejection: Rejection


@dataclass(frozen=True)
class EnqueueOutcome:
    status: Literal["queued", "duplicate", "rejected"]
    rejection: Rejection | None = None


@dataclass(frozen=True)
class BandSnapshot:
    band: str
    queued: int
    running: int
    limit: int
    oldest_wait_s: float


@dataclass
class _Entry:
    key: float
    seq: int
    request: Request = field(compare=False)


class Scheduler:
    """Global admission and worker selection over plain data; time is always passed in.

    ``models``: the models this dispatcher serves. Empty means *discover*: a model is known once
    a worker announced it, and a request for a model nobody announced is held for
    ``model_grace_s`` after ``started_s`` (workers may still be starting) before it is rejected
    as ``unknown_model``.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        policy: RoutingPolicy,
        *,
        models: Iterable[str] = (),
        model_grace_s: float = 5.0,
        started_s: float = 0.0,
    ) -> None:
        self.config = config
        self.policy = policy
        self._configured_models = frozenset(models)
        self._seen_models: set[str] = set()
        self._model_grace_until_s = started_s + model_grace_s
        self._seq = 0
        # (band, model) -> entries sorted by (key, seq)
        self._queues: dict[tuple[str, str], list[tuple[float, int, str]]] = {}
        self._queued: dict[str, _Entry] = {}
        self._running: dict[str, Booking] = {}
        self._running_by_band: Counter[str] = Counter()
        self._workers: dict[str, WorkerInfo] = {}
        self._worker_booked: dict[str, set[str]] = {}
        self._worker_tokens: Counter[str] = Counter()
        # Per worker: booked requests its last heartbeat did not list yet -> prefill expected.
        self._unreported: dict[str, dict[str, int]] = {}
        self._joined_s: dict[str, float] = {}
        self._refused: set[str] = set()
        self._observe = getattr(policy, "observe", None)
        self._usage = Usage()
        # So that a sweep costs what it ends, not the queue's length: deadlines in a heap
        # (entries of requests no longer queued are skipped), and the requests whose model was
        # unknown when queued (a model, once known, stays known).
        self._deadlines: list[tuple[float, int, str]] = []
        self._maybe_unknown: set[str] = set()

    # ----------------------------------------------------------------------------- queries

    @property
    def running(self) -> int:
        """Requests booked on workers now."""
        return len(self._running)

    @property
    def queued(self) -> int:
        """Requests waiting for admission or a worker."""
        return len(self._queued)

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queued

    def booking(self, request_id: str) -> Booking | None:
        return self._running.get(request_id)

    def queued_request(self, request_id: str) -> Request | None:
        entry = self._queued.get(request_id)
        return entry.request if entry else None

    def workers(self) -> dict[str, WorkerInfo]:
        return dict(self._workers)

    def booked_on(self, worker_id: str) -> frozenset[str]:
        return frozenset(self._worker_booked.get(worker_id, ()))

    def quota_levels(self, request: Request) -> tuple[list[Level], int]:
        """The per-model quota levels ``request`` uses, and how much of each."""
        quotas = self.config.quotas
        levels = [lv for lv, _ in quotas.levels(request.model, request.band, request.tenant)]
        return levels, quotas.of(request.model).cost(request.prompt_tokens, request.max_tokens)

    def counts(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(model, band) -> (queued, running), for every pair with requests."""
        out: dict[tuple[str, str], list[int]] = {}
        for (band, model), q in self._queues.items():
            out.setdefault((model, band), [0, 0])[0] = len(q)
        for b in self._running.values():
            out.setdefault((b.request.model, b.request.band), [0, 0])[1] += 1
        return {k: (v[0], v[1]) for k, v in out.items()}

    def usage(self) -> dict[Level, int]:
        """What runs at every per-model quota level now."""
        return self._usage.snapshot()

    def known_model(self, model: str) -> bool:
        if self._configured_models:
            return model in self._configured_models
        return model in self._seen_models

    def band_snapshots(self, now_s: float) -> list[BandSnapshot]:
        oldest: dict[str, float] = {}
        queued: Counter[str] = Counter()
        for entry in self._queued.values():
            r = entry.request
            queued[r.band] += 1
            oldest[r.band] = max(oldest.get(r.band, 0.0), now_s - r.arrived_s)
        return [
            BandSnapshot(
                band=b,
                queued=queued[b],
                running=self._running_by_band[b],
                limit=self.config.band_limit(b),
                oldest_wait_s=max(0.0, oldest.get(b, 0.0)),
            )
            for b in self.config.bands
        ]

    # ----------------------------------------------------------------------------- input

    def enqueue(self, request: Request, now_s: float) -> EnqueueOutcome:
        """Queue a new request, or say why not. A request id already queued or running is a
        duplicate (the first copy wins)."""
        rid = request.request_id
        if rid in self._queued or rid in self._running:
            return EnqueueOutcome("duplicate")
        rejection = self._validate(request, now_s)
        if rejection is not None:
            return EnqueueOutcome("rejected", rejection)
        self._insert(request)
        return EnqueueOutcome("queued")

    def _validate(self, request: Request, now_s: float) -> Rejection | None:
        if request.band not in self.config.bands:
            return Rejection(
                reason=RejectReason.UNKNOWN_BAND,
                message=f"unknown band {request.band!r}; bands are {list(self.config.bands)}",
            )
        if request.prompt_tokens > self.config.max_prompt_tokens:
            return Rejection(
                reason=RejectReason.PROMPT_TOO_LONG,
                message=(
                    f"prompt of {request.prompt_tokens} tokens exceeds the limit of "
                    f"{self.config.max_prompt_tokens}"
                ),
            )
        if request.deadline_s is not None and request.deadline_s <= now_s:
            return _deadline_rejection()
        if not self.known_model(request.model) and now_s >= self._model_grace_until_s:
            return self._unknown_model(request.model)
        return None

    def _unknown_model(self, model: str) -> Rejection:
        known = sorted(self._configured_models or self._seen_models)
        return Rejection(
            reason=RejectReason.UNKNOWN_MODEL,
            message=f"no worker serves model {model!r}; known models: {known}",
        )

    def _insert(self, request: Request) -> None:
        self._seq += 1
        key = priority_key(request.arrived_s, self.config.delay_s(request.band))
        entry = _Entry(key, self._seq, request)
        self._queued[request.request_id] = entry
        if request.deadline_s is not None:
            heapq.heappush(self._deadlines, (request.deadline_s, self._seq, request.request_id))
            if len(self._deadlines) > 2 * len(self._queued) + 1024:
                # Entries of requests that left the queue stay until their deadline; with far
                # deadlines they would pile up: keep only the queued ones.
                self._deadlines = [
                    (e.request.deadline_s, e.seq, rid)
                    for rid, e in self._queued.items()
                    if e.request.deadline_s is not None
                ]
                heapq.heapify(self._deadlines)
        if not self.known_model(request.model):
            self._maybe_unknown.add(request.request_id)
        q = self._queues.setdefault((request.band, request.model), [])
        bisect.insort(q, (key, self._seq, request.request_id))

    def _unqueue(self, request_id: str) -> Request:
        entry = self._queued.pop(request_id)
        r = entry.request
        q = self._queues[(r.band, r.model)]
        i = bisect.bisect_left(q, (entry.key, entry.seq, request_id))
        del q[i]
        if not q:
            del self._queues[(r.band, r.model)]
        return r

    def reconfigure(self, config: AdmissionConfig) -> None:
        """Take new limits, shares and quotas at run time. Requests already running stay; the
        next plan applies the new limits (a lowered limit frees no room until enough requests
        end). Bands and aging delays cannot change: queued requests are ordered by them."""
        if config.bands != self.config.bands or dict(config.band_delay_s) != dict(
            self.config.band_delay_s
        ):
            raise ValueError("bands and aging delays cannot change at run time")
        self.config = config

    def update_worker(self, info: WorkerInfo) -> None:
        """Record a worker's heartbeat (its lease is the runtime's ``LeaseTable``)."""
        self._workers[info.worker_id] = info
        self._joined_s.setdefault(info.worker_id, info.reported_s)
        booked = self._worker_booked.setdefault(info.worker_id, set())
        pending = self._unreported.get(info.worker_id)
        if pending:
            for rid in [r for r in pending if r in info.reported_in_flight or r not in booked]:
                del pending[rid]
        self._seen_models.update(info.models)
        self._refused.discard(info.worker_id)

    def remove_worker(self, worker_id: str) -> tuple[list[Request], list[Ended]]:
        """A worker left or lost its lease: its bookings are released and its requests queued
        again as their next attempt (keeping their place), or ended once out of attempts."""
        self._workers.pop(worker_id, None)
        self._refused.discard(worker_id)
        requeued: list[Request] = []
        ended: list[Ended] = []
        for rid in sorted(self._worker_booked.pop(worker_id, set())):
            booking = self._release(rid)
            retry = self._retry(booking.request)
            if isinstance(retry, Ended):
                ended.append(retry)
            else:
                requeued.append(retry)
        self._worker_tokens.pop(worker_id, None)
        self._unreported.pop(worker_id, None)
        self._joined_s.pop(worker_id, None)
        return requeued, ended

    def _retry(self, request: Request) -> Request | Ended:
        if request.attempt >= self.config.max_attempts:
            return Ended(
                request,
                Rejection(
                    reason=RejectReason.MAX_ATTEMPTS,
                    message=f"failed on {request.attempt} workers; giving up",
                ),
            )
        again = replace(request, attempt=request.attempt + 1)
        self._insert(again)
        return again

    # ----------------------------------------------------------------------------- decide

    def plan(self, now_s: float, max_decisions: int | None = None) -> list[Dispatch]:
        """Propose dispatches for now, in priority order, within every limit. Pure.

        ``max_decisions`` stops after that many: a caller whose policy reads live worker
        state (the replay's fleet view) plans one decision at a time, so each sees the last."""
        global_room = self.config.global_limit - len(self._running)
        if global_room <= 0 or not self._queues:
            return []
        band_room = {
            b: self.config.band_limit(b) - self._running_by_band[b] for b in self.config.bands
        }
        free: dict[str, int] = {}
        tokens: dict[str, int] = {}
        unreported: dict[str, int] = {}
        by_model: dict[str, list[str]] = {}
        for wid, info in self._workers.items():
            if info.draining or wid in self._refused:
                continue
            room = info.capacity - len(self._worker_booked.get(wid, ()))
            if room <= 0:
                continue
            free[wid] = room
            tokens[wid] = self._worker_tokens[wid]
            unreported[wid] = sum(self._unreported.get(wid, {}).values())
            for m in info.models:
                by_model.setdefault(m, []).append(wid)

        # Pressure: a band holds back the bands after it (their shares, see AdmissionConfig)
        # while it has requests waiting that a live worker of their model could serve.
        served = {m for i in self._workers.values() if not i.draining for m in i.models}
        waiting = {band for (band, model) in self._queues if model in served}
        shares = self.config.band_shares
        pressed: set[str] = set()
        for i, b in enumerate(self.config.bands):
            if b in shares and any(u in waiting for u in self.config.bands[:i]):
                pressed.add(b)
        running_in = Counter(self._running_by_band)

        heads: list[tuple[float, int, str, str, int]] = []
        for (band, model), q in self._queues.items():
            if band_room.get(band, 0) > 0 and model in by_model:
                key, seq, _ = q[0]
                heads.append((key, seq, band, model, 0))
        heapq.heapify(heads)

        decisions: list[Dispatch] = []
        planned: Counter[Level] = Counter()
        skipped: Counter[tuple[str, str]] = Counter()
        quotas = self.config.quotas
        limit = max_decisions if max_decisions is not None else global_room
        while heads and global_room > 0 and len(decisions) < limit:
            _, _, band, model, idx = heapq.heappop(heads)
            if band_room[band] <= 0:
                continue
            if band in pressed and running_in[band] >= shares[band]:
                continue  # a more urgent band waits: this one gets no more than its share
            q = self._queues[(band, model)]
            request = self._queued[q[idx][2]].request
            levels, amount = self.quota_levels(request)
            blocked = self._usage.blocked_by(quotas, model, band, request.tenant, amount, planned)
            if blocked is not None:
                # A full tenant must not hold up other tenants behind it. A full model or
                # model-band holds up its whole queue, also with token quotas (where a smaller
                # request might fit): letting it pass could starve the big one.
                skipped[(band, model)] += 1
                if (
                    blocked[0] == "model-tenant"
                    and idx + 1 < len(q)
                    and skipped[(band, model)] < _SCAN_LIMIT
                ):
                    key, seq, _ = q[idx + 1]
                    heapq.heappush(heads, (key, seq, band, model, idx + 1))
                continue
            candidates: list[Candidate] = []
            for w in by_model[model]:
                if free[w] <= 0:
                    continue
                info = self._workers[w]
                candidates.append(
                    Candidate(
                        worker_id=w,
                        capacity=info.capacity,
                        booked=info.capacity - free[w],
                        booked_tokens=tokens[w],
                        reported_pending_tokens=info.reported_pending_tokens,
                        reported_prefill_tokens=info.reported_prefill_tokens,
                        unreported_prefill_tokens=unreported[w],
                        report_age_s=max(0.0, now_s - info.reported_s),
                        joined_s=self._joined_s.get(w, float("-inf")),
                    )
                )
            if not candidates:
                continue  # every worker of this model is full: drop its queues from this plan
            if request.deadline_s is not None and request.deadline_s <= now_s:
                chosen = None  # the sweep ends it; never run an expired request
            else:
                picked = self.policy.choose(request.route_view(), candidates, now_s)
                choice = picked if isinstance(picked, Choice) else Choice(picked)
                chosen = choice.worker_id
                decisions.append(Dispatch(request, chosen, choice))
                free[chosen] -= 1
                tokens[chosen] += request.work_tokens
                unreported[chosen] += _expected_prefill(request, choice)
                global_room -= 1
                band_room[band] -= 1
                running_in[band] += 1
                for level in levels:
                    planned[level] += amount
            if idx + 1 < len(q):
                key, seq, _ = q[idx + 1]
                heapq.heappush(heads, (key, seq, band, model, idx + 1))
        return decisions

    # ----------------------------------------------------------------------------- outcomes

    def book(self, dispatch: Dispatch, now_s: float) -> bool:
        """The worker accepted: take the quota and record the booking. Returns False if the
        decision went stale meanwhile (request no longer queued as that attempt)."""
        r = dispatch.request
        entry = self._queued.get(r.request_id)
        if entry is None or entry.request.attempt != r.attempt:
            return False
        if dispatch.worker_id not in self._workers:
            return False  # the worker was lost meanwhile: the request stays queued
        self._unqueue(r.request_id)
        w = dispatch.worker_id
        self._running[r.request_id] = Booking(r, w, now_s, dispatch.expected_hit_tokens)
        self._running_by_band[r.band] += 1
        self._worker_booked.setdefault(w, set()).add(r.request_id)
        self._worker_tokens[w] += r.work_tokens
        levels, amount = self.quota_levels(r)
        self._usage.add(levels, amount)
        if r.request_id not in self._workers[w].reported_in_flight:
            expected = _expected_prefill(r, dispatch.choice)
            self._unreported.setdefault(w, {})[r.request_id] = expected
        if self._observe is not None:
            self._observe(r.route_view(), w, now_s)
        return True

    def refused(self, dispatch: Dispatch) -> None:
        """The worker refused or did not answer: keep it out of plans until it heartbeats."""
        self._refused.add(dispatch.worker_id)

    def complete(self, request_id: str) -> Request | None:
        """A worker finished a request successfully: its result is published, so the request
        is done wherever this dispatcher thinks it is (running, or still queued because an
        acceptance or a completion of an earlier attempt got lost). Returns the request, or
        None if it is not known here (already ended)."""
        if request_id in self._running:
            return self._release(request_id).request
        if request_id in self._queued:
            return self._unqueue(request_id)
        return None

    def adopt(self, request_id: str, worker_id: str, now_s: float) -> bool:
        """A worker reports running a request this dispatcher has queued (it was dispatched
        before a failover, or its acceptance is still in flight): book it there."""
        entry = self._queued.get(request_id)
        if entry is None or worker_id not in self._workers:
            return False
        return self.book(Dispatch(entry.request, worker_id), now_s)

    def fail(self, request_id: str, worker_id: str, attempt: int) -> Request | Ended | None:
        """A worker reports it could not finish a request: release and retry it elsewhere."""
        booking = self._running.get(request_id)
        if booking is None or booking.worker_id != worker_id or booking.request.attempt != attempt:
            return None
        self._release(request_id)
        return self._retry(booking.request)

    def cancel(self, request_id: str) -> Request | None:
        """Remove a queued request (e.g. its result already exists)."""
        if request_id in self._queued:
            return self._unqueue(request_id)
        return None

    def _release(self, request_id: str) -> Booking:
        booking = self._running.pop(request_id)
        self._running_by_band[booking.request.band] -= 1
        booked = self._worker_booked.get(booking.worker_id)
        if booked is not None:
            booked.discard(request_id)
        self._worker_tokens[booking.worker_id] -= booking.request.work_tokens
        levels, amount = self.quota_levels(booking.request)
        self._usage.remove(levels, amount)
        self._unreported.get(booking.worker_id, {}).pop(request_id, None)
        return booking

    def sweep(self, now_s: float) -> list[Ended]:
        """End queued requests that must not run: deadline passed, or model still unknown
        after the discovery grace. Returns them with their typed rejections."""
        ended: list[Ended] = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, seq, rid = heapq.heappop(self._deadlines)
            entry = self._queued.get(rid)
            if entry is not None and entry.seq == seq:
                ended.append(Ended(self._unqueue(rid), _deadline_rejection()))
        if self._maybe_unknown and now_s >= self._model_grace_until_s:
            for rid in sorted(self._maybe_unknown):
                entry = self._queued.get(rid)
                if entry is None or self.known_model(entry.request.model):
                    self._maybe_unknown.discard(rid)
                    continue
                self._maybe_unknown.discard(rid)
                ended.append(Ended(self._unqueue(rid), self._unknown_model(entry.request.model)))
        return ended

    def drift(self, worker_id: str, now_s: float, grace_s: float) -> int:
        """How far this dispatcher's books disagree with the worker's reported in-flight ids
        (bookings younger than ``grace_s`` are not counted: the report may predate them)."""
        info = self._workers.get(worker_id)
        if info is None:
            return 0
        booked = {
            rid
            for rid in self._worker_booked.get(worker_id, ())
            if now_s - self._running[rid].booked_s > grace_s
        }
        return len(booked - info.reported_in_flight)

    def order(self) -> Sequence[str]:
        """Queued request ids in the order ``plan`` considers them (for tests and stats)."""
        return [rid for _, _, rid in sorted((e.key, e.seq, rid) for rid, e in self._queued.items())]


_SCAN_LIMIT = 256
"""Queued requests of one (band, model) queue that one plan looks past when quotas block them."""


def _expected_prefill(request: Request, choice: Choice | None) -> int:
    hit = choice.expected_hit_tokens if choice else 0
    return max(1, request.prompt_tokens - hit)


def _deadline_rejection() -> Rejection:
    return Rejection(reason=RejectReason.DEADLINE_EXCEEDED, message="deadline passed while queued")

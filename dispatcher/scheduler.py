"""The scheduler core (pure): the façade over the queues, the books and the planner.

``plan(now)`` is side-effect free: it proposes ``Dispatch`` decisions that respect every limit
and every worker's free capacity (:mod:`sluice.dispatcher.planner`). The runtime offers each
one to its worker, and only a worker's acceptance ``book``s it: quota is taken once, after the
worker said yes (:mod:`sluice.dispatcher.books`). A refusal leaves the request queued
(:mod:`sluice.dispatcher.queues`) and the worker out of plans until its next heartbeat.

The live dispatcher and the simulator drive this same class; nothing here reads a clock,
touches NATS or asyncio.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Sequence

from sluice.dispatcher.admission import AdmissionConfig, priority_key
from sluice.dispatcher.books import Books
from sluice.dispatcher.defaults import key_blocks
from sluice.dispatcher.enginetime import EngineTime, EngineTimeConfig
from sluice.dispatcher.flaps import FlapMeter
from sluice.dispatcher.planner import PlanInput, hold_reason, plan, pressed_bands, quota_use
from sluice.dispatcher.pool import FreeWorkers
from sluice.dispatcher.queues import Queues
from sluice.dispatcher.quotas import Level
from sluice.dispatcher.reconcile import Reconciliation, find_drift
from sluice.dispatcher.routing import LoadKey, RoutingPolicy, Shortlisting, default_load_key
from sluice.dispatcher.shares import BandMeter
from sluice.dispatcher.work import (
    BandSnapshot,
    Booking,
    Dispatch,
    Ended,
    EnqueueOutcome,
    Request,
    WorkerInfo,
)
from sluice.schemas.hashing import DEFAULT_BLOCK_TOKENS
from sluice.schemas.models import Rejection, RejectReason

__all__ = [
    "BandSnapshot",
    "Booking",
    "Dispatch",
    "Ended",
    "EnqueueOutcome",
    "Request",
    "Scheduler",
    "WorkerInfo",
]


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
        flaps: FlapMeter | None = None,
        engine_time: EngineTimeConfig | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self._configured_models = frozenset(models)
        self._seen_models: set[str] = set()
        self._model_grace_until_s = started_s + model_grace_s
        self._queues = Queues()
        self._books = Books()
        self._workers: dict[str, WorkerInfo] = {}
        self._joined_s: dict[str, float] = {}
        self._refused: set[str] = set()
        # Requests whose model was unknown when queued (a model, once known, stays known).
        self._maybe_unknown: set[str] = set()
        # Request id -> the worker whose last heartbeat reports running it: a request that
        # arrives (is redelivered) while a worker runs it is booked there, never run twice.
        self._reported_on: dict[str, str] = {}
        # Request id -> the worker that reported failing it: a heartbeat it sent before the
        # failure still lists it, and must not book the retry back onto that worker.
        self._failed_on: dict[str, str] = {}
        # Requests booked where a worker reported running them, not dispatched by this
        # scheduler: the attempt the worker runs is not known here (a new leader's books start
        # from the attempt a message comes back as, without the old leader's retries).
        self._adopted: set[str] = set()
        self.flaps = flaps or FlapMeter(key_blocks(DEFAULT_BLOCK_TOKENS))
        """Flaps of booked decisions (:mod:`sluice.dispatcher.flaps`)."""
        self.engine_time = EngineTime(engine_time)
        """What requests cost in engine time (:mod:`sluice.dispatcher.enginetime`)."""
        self.meter = _meter(config)
        """The engine-time floors and idle capacity of offline bands."""
        self._now_s = started_s
        # Kept as workers heartbeat, are booked, finish and leave, so that a plan never walks
        # the whole fleet: who has room (in load order), which models a live worker serves,
        # and who joined when (oldest first).
        self._free = FreeWorkers()
        self._load_key: LoadKey = (
            policy.load_key if isinstance(policy, Shortlisting) else default_load_key
        )
        self._served: Counter[str] = Counter()
        self._joins: list[tuple[float, str]] = []
        # Request id -> its dispatch whose offer is in flight (booked, not yet confirmed).
        self._reserved: dict[str, Dispatch] = {}

    # ----------------------------------------------------------------------------- queries

    @property
    def running(self) -> int:
        """Requests booked on workers now."""
        return len(self._books)

    @property
    def queued(self) -> int:
        """Requests waiting for admission or a worker."""
        return len(self._queues)

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queues

    def booking(self, request_id: str) -> Booking | None:
        return self._books.get(request_id)

    def queued_request(self, request_id: str) -> Request | None:
        return self._queues.get(request_id)

    def workers(self) -> dict[str, WorkerInfo]:
        return dict(self._workers)

    def booked_on(self, worker_id: str) -> frozenset[str]:
        return frozenset(self._books.on(worker_id))

    def quota_levels(self, request: Request) -> tuple[Sequence[Level], int]:
        """The per-model quota levels ``request`` uses, and how much of each."""
        return quota_use(self.config.quotas, request)

    def counts(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(model, band) -> (queued, running), for every pair with requests."""
        out: dict[tuple[str, str], list[int]] = {}
        for (band, model), q in self._queues.queues():
            out.setdefault((model, band), [0, 0])[0] = len(q)
        for b in self._books.bookings():
            out.setdefault((b.request.model, b.request.band), [0, 0])[1] += 1
        return {k: (v[0], v[1]) for k, v in out.items()}

    def usage(self) -> dict[Level, int]:
        """What runs at every per-model quota level now."""
        return self._books.usage.snapshot()

    def known_models(self) -> list[str]:
        """The models it serves (configured, or announced by a worker), sorted: what
        ``known_model`` accepts."""
        return sorted(self._configured_models or self._seen_models)

    def known_model(self, model: str) -> bool:
        if self._configured_models:
            return model in self._configured_models
        return model in self._seen_models

    def band_snapshots(self, now_s: float) -> list[BandSnapshot]:
        oldest: dict[str, float] = {}
        queued: Counter[str] = Counter()
        for r in self._queues.requests():
            queued[r.band] += 1
            oldest[r.band] = max(oldest.get(r.band, 0.0), now_s - r.arrived_s)
        return [
            BandSnapshot(
                band=b,
                queued=queued[b],
                running=self._books.by_band[b],
                limit=self.config.band_limit(b),
                oldest_wait_s=max(0.0, oldest.get(b, 0.0)),
            )
            for b in self.config.bands
        ]

    def engine_figures(self, now_s: float) -> dict[str, dict[str, float]]:
        """Per band: its floor and idle rates and credits, its recent demand and its total
        engine-seconds dispatched (for stats and the replay). Pure."""
        m = self.meter
        out: dict[str, dict[str, float]] = {}
        for b in self.config.bands:
            row = {"demand_s_per_s": m.demand_rate(b, now_s), "spent_s": m.spent_s.get(b, 0.0)}
            if m.floored(b):
                row |= {
                    "floor_s_per_s": m.floor_rate(b),
                    "idle_s_per_s": m.idle_rate(b, now_s),
                    "floor_credit_s": m.floor_credit(b, now_s),
                    "idle_credit_s": m.idle_credit(b, now_s),
                }
            out[b] = row
        return out

    def order(self) -> Sequence[str]:
        """Queued request ids in the order ``plan`` considers them (for tests and stats)."""
        return self._queues.order()

    # ----------------------------------------------------------------------------- input

    def enqueue(self, request: Request, now_s: float) -> EnqueueOutcome:
        """Queue a new request, or say why not. A request id already queued or running is a
        duplicate (the first copy wins)."""
        rid = request.request_id
        if rid in self._queues or rid in self._books:
            return EnqueueOutcome("duplicate")
        rejection = self._validate(request, now_s)
        if rejection is not None:
            return EnqueueOutcome("rejected", rejection)
        if not request.engine_ms:
            cost_ms = math.ceil(self.engine_time.cost_s(request) * 1000)
            request = request.priced(max(1, cost_ms))
        self._insert(request)
        worker = self._reported_on.get(rid)
        if worker is not None and self.adopt(rid, worker, now_s):
            return EnqueueOutcome("adopted")
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
        if not self.known_model(request.model) and (
            self._configured_models or now_s >= self._model_grace_until_s
        ):
            return self._unknown_model(request.model)  # the grace is for discovery only
        return None

    def _unknown_model(self, model: str) -> Rejection:
        known = self.known_models()
        return Rejection(
            reason=RejectReason.UNKNOWN_MODEL,
            message=f"no worker serves model {model!r}; known models: {known}",
        )

    def _insert(self, request: Request) -> None:
        self._queues.insert(
            request, priority_key(request.arrived_s, self.config.delay_s(request.band))
        )
        if not self.known_model(request.model):
            self._maybe_unknown.add(request.request_id)

    def reconfigure(self, config: AdmissionConfig) -> None:
        """Take new limits, shares and quotas at run time. Requests already running stay; the
        next plan applies the new limits (a lowered limit frees no room until enough requests
        end). Bands and aging delays cannot change: queued requests are ordered by them."""
        if config.bands != self.config.bands or dict(config.band_delay_s) != dict(
            self.config.band_delay_s
        ):
            raise ValueError("bands and aging delays cannot change at run time")
        self.config = config
        old, self.meter = self.meter, _meter(config)
        self.meter.spent_s = old.spent_s
        self._set_capacity(self._now_s)

    def update_worker(self, info: WorkerInfo) -> None:
        """Record a worker's heartbeat (its lease is the runtime's ``LeaseTable``)."""
        old = self._workers.get(info.worker_id)
        self._note_reported(info.worker_id, old.reported_in_flight if old else frozenset(), info)
        self._workers[info.worker_id] = info
        if old is None or old.draining != info.draining or old.models != info.models:
            self._serve(old, -1)
            self._serve(info, 1)
        if info.worker_id not in self._joined_s:
            self._joined_s[info.worker_id] = info.reported_s
            self._joined(info.worker_id, info.reported_s)
        self._books.reported(info.worker_id, info.reported_in_flight)
        if self._failed_on:
            for rid in [r for r, w in self._failed_on.items() if w == info.worker_id]:
                if rid not in info.reported_in_flight:
                    del self._failed_on[rid]
        self._seen_models.update(info.models)
        self._refused.discard(info.worker_id)
        self._refresh(info.worker_id)
        if old is None or old.draining != info.draining:
            self._set_capacity(info.reported_s)
        else:  # the idle capacity follows the decaying demand even when nothing is dispatched
            self._now_s = max(self._now_s, info.reported_s)
            self.meter.advance(self._now_s)

    def _set_capacity(self, now_s: float) -> None:
        # Each live worker supplies one engine-second per second (costs are priced at its speed).
        self._now_s = max(self._now_s, now_s)
        live = sum(1 for i in self._workers.values() if not i.draining)
        self.meter.set_capacity(float(live), self._now_s)

    def remove_worker(self, worker_id: str) -> tuple[list[Request], list[Ended]]:
        """A worker left or lost its lease: its bookings are released and its requests queued
        again as their next attempt (keeping their place), or ended once out of attempts."""
        old = self._workers.pop(worker_id, None)
        if old is not None:
            self._note_reported(worker_id, old.reported_in_flight, None)
            self._serve(old, -1)
        self._free.discard(worker_id)
        self._refused.discard(worker_id)
        self._joined_s.pop(worker_id, None)
        for rid in [r for r, w in self._failed_on.items() if w == worker_id]:
            del self._failed_on[rid]
        self.engine_time.remove_worker(worker_id)
        self._set_capacity(self._now_s)
        requeued: list[Request] = []
        ended: list[Ended] = []
        for rid in self._books.forget_worker(worker_id):
            retry = self._retry(self._release(rid).request, worker_id)
            if isinstance(retry, Ended):
                ended.append(retry)
            else:
                requeued.append(retry)
        return requeued, ended

    def _refresh(self, worker_id: str) -> None:
        """Place the worker in (or take it out of) the order of workers with room."""
        info = self._workers.get(worker_id)
        if info is None or info.draining or worker_id in self._refused:
            self._free.discard(worker_id)
            return
        booked = len(self._books.on(worker_id))
        if booked >= info.capacity:
            self._free.discard(worker_id)
            return
        unreported = self._books.unreported_prefill(worker_id)
        key = self._load_key(booked, info.capacity, unreported)
        queue = info.reported_prefill_tokens + unreported
        self._free.put(worker_id, info.models, key, booked / info.capacity, queue, info.reported_s)

    def _serve(self, info: WorkerInfo | None, sign: int) -> None:
        if info is None or info.draining:
            return
        for m in info.models:
            self._served[m] += sign
            if self._served[m] <= 0:
                del self._served[m]

    def _joined(self, worker_id: str, t_s: float) -> None:
        bisect.insort(self._joins, (t_s, worker_id))
        if len(self._joins) > 2 * len(self._joined_s) + 64:  # entries of workers long gone
            self._joins = sorted((t, w) for w, t in self._joined_s.items())

    def _note_reported(
        self, worker_id: str, before: frozenset[str], info: WorkerInfo | None
    ) -> None:
        now = info.reported_in_flight if info is not None else frozenset()
        if now == before:
            return
        for rid in before - now:
            if self._reported_on.get(rid) == worker_id:
                del self._reported_on[rid]
        for rid in now - before:
            self._reported_on[rid] = worker_id

    def _retry(self, request: Request, worker_id: str, error: str = "") -> Request | Ended:
        """Queue ``request`` again as its next attempt, kept off ``worker_id`` (the worker its
        last attempt failed on) while its model has another, or end it out of attempts."""
        if request.attempt >= self.config.max_attempts:
            last = f" (the last: {error[:300]})" if error else ""
            on = ", ".join(sorted(request.failed_on | {worker_id}))
            return Ended(
                request,
                Rejection(
                    reason=RejectReason.MAX_ATTEMPTS,
                    message=f"{request.attempt} attempts failed (on {on}); giving up{last}",
                ),
            )
        again = request.next_attempt(worker_id)
        self._insert(again)
        return again

    # ----------------------------------------------------------------------------- decide

    def plan(self, now_s: float, max_decisions: int | None = None) -> list[Dispatch]:
        """Propose dispatches for now, in priority order, within every limit. Pure."""
        return plan(self._plan_input(), now_s, max_decisions)

    def _plan_input(self) -> PlanInput:
        return PlanInput(
            self.config,
            self.policy,
            self._queues,
            self._books,
            self._workers,
            self._refused,
            self._joined_s,
            self.meter,
            self.engine_time,
            self._free,
            self._served,
            self._joins,
            self._load_key,
        )

    def hold_reasons(self, request_ids: Iterable[str], now_s: float) -> dict[str, str]:
        """The layer that holds each of these queued requests (``planner.HOLD_REASONS``);
        ids not queued are left out. Pure."""
        state = self._plan_input()
        pressed = pressed_bands(state)
        queued = ((rid, self._queues.get(rid)) for rid in request_ids)
        return {rid: hold_reason(state, r, now_s, pressed) for rid, r in queued if r is not None}

    def hold_reason(self, request_id: str, now_s: float) -> str | None:
        """The layer that holds one queued request; None if it is not queued. Pure."""
        return self.hold_reasons([request_id], now_s).get(request_id)

    def held_by(self, now_s: float) -> dict[str, int]:
        """Queued requests by the layer that holds them. Pure; costs one check per queued
        request (call it once a second, not per decision)."""
        ids = [r.request_id for r in self._queues.requests()]
        return dict(Counter(self.hold_reasons(ids, now_s).values()))

    def position(self, request_id: str) -> int | None:
        """A queued request's place in its band's queue for its model (1: next)."""
        return self._queues.position(request_id)

    # ----------------------------------------------------------------------------- outcomes

    def book(self, dispatch: Dispatch, now_s: float) -> bool:
        """The worker accepted at once: :meth:`reserve` and :meth:`confirm` in one (the
        simulator's workers, and a worker's report of running a request). Returns False if the
        decision went stale meanwhile (request no longer queued as that attempt)."""
        return self.reserve(dispatch, now_s) and self.confirm(dispatch, now_s)

    def reserve(self, dispatch: Dispatch, now_s: float) -> bool:
        """Book a planned dispatch while its offer is in flight: the request leaves the queue
        and counts on its worker (its quota and its room taken), and the routing policy, the
        flap meter and the engine-time meter learn of it now, so that the next plan sees it
        as every plan saw the bookings before it (it neither plans it again nor overfills that
        worker, and a prefix's next request finds it). The worker's answer settles it:
        :meth:`confirm` or :meth:`withdraw` (a refusal leaves the policy's note of it to expire
        as a guess does). False if the decision went stale (the request is no longer queued as
        that attempt, or its worker left)."""
        r = dispatch.request
        queued = self._queues.get(r.request_id)
        if queued is None or queued.attempt != r.attempt:
            return False
        w = dispatch.worker_id
        info = self._workers.get(w)
        if info is None:
            return False  # the worker was lost meanwhile: the request stays queued
        self._queues.remove(r.request_id)
        levels, amount = self.quota_levels(r)
        self._books.book(
            Booking(r, w, now_s, dispatch.expected_hit_tokens),
            levels,
            amount,
            reported=r.request_id in info.reported_in_flight,
            expected_prefill_tokens=dispatch.expected_prefill_tokens,
        )
        self._refresh(w)
        self.policy.observe(r.route_view(), w, now_s)
        self.flaps.booked(r.block_hashes, w, now_s)
        self._now_s = max(self._now_s, now_s)
        cost = dispatch.engine_s or self.engine_time.cost_s(r, w, dispatch.expected_hit_tokens)
        self.meter.charge(r.band, dispatch.share, cost, now_s)
        self._reserved[r.request_id] = dispatch
        return True

    def confirm(self, dispatch: Dispatch, now_s: float) -> bool:
        """Its worker accepted a reserved dispatch: the booking stands, dated from now (the
        acceptance: reconciliation's grace counts from there). False if the reservation is
        gone: its request ended, failed or was stopped, or its worker left, while the offer
        was in flight."""
        r = dispatch.request
        if self._reserved.get(r.request_id) is not dispatch:
            return False
        del self._reserved[r.request_id]
        booking = self._books.get(r.request_id)  # a reservation is booked until released
        if booking is not None and booking.booked_s != now_s:
            self._books.restamp(r.request_id, now_s)
        return True

    def withdraw(self, dispatch: Dispatch) -> None:
        """Its worker refused a reserved dispatch, or did not answer: the request goes back to
        its place in the queue (the same attempt), and the worker stays out of plans until it
        heartbeats (:meth:`refused`). A reservation already gone changes nothing but that."""
        r = dispatch.request
        if self._reserved.get(r.request_id) is dispatch:
            self._release(r.request_id)
            self._insert(r)
        self.refused(dispatch)

    @property
    def reserved(self) -> int:
        """Dispatches whose offers are in flight."""
        return len(self._reserved)

    def refused(self, dispatch: Dispatch) -> None:
        """The worker refused or did not answer: keep it out of plans until it heartbeats."""
        self._refused.add(dispatch.worker_id)
        self._free.discard(dispatch.worker_id)

    def complete(self, request_id: str) -> Request | None:
        """A worker finished a request successfully: its result is published, so the request
        is done wherever this dispatcher thinks it is (running, or still queued because an
        acceptance or a completion of an earlier attempt got lost). Returns the request, or
        None if it is not known here (already ended)."""
        if request_id in self._books:
            return self._release(request_id).request
        if request_id in self._queues:
            return self._queues.remove(request_id)
        return None

    def adopt(self, request_id: str, worker_id: str, now_s: float) -> bool:
        """A worker reports running a request this dispatcher has queued (it was dispatched
        before a failover, or its acceptance is still in flight): book it there."""
        request = self._queues.get(request_id)
        if request is None or worker_id not in self._workers:
            return False
        if self._failed_on.get(request_id) == worker_id:
            return False  # a heartbeat from before its failure report
        booked = self.book(Dispatch(request, worker_id), now_s)
        if booked:
            self._adopted.add(request_id)
        return booked

    def fail(
        self, request_id: str, worker_id: str, attempt: int, error: str = ""
    ) -> Request | Ended | None:
        """A worker reports it could not finish a request (``error``: why): release and retry
        it elsewhere. A report of another attempt than the one booked there is stale, unless
        the booking was adopted (:meth:`adopt`) and the report's attempt is later: then it is
        of the run adopted there, whose attempt was not known here (a new leader adopts a
        request as the attempt its message came back as, without the old leader's retries)."""
        booking = self._books.get(request_id)
        if booking is None or booking.worker_id != worker_id:
            return None
        booked = booking.request.attempt
        if attempt != booked and not (request_id in self._adopted and attempt > booked):
            return None
        self._release(request_id)
        self._failed_on[request_id] = worker_id
        request = booking.request
        if attempt > request.attempt:
            request = request.as_attempt(attempt)
        return self._retry(request, worker_id, error)

    def cancel(self, request_id: str) -> Request | None:
        """Remove a queued request (cancelled, or its result already exists)."""
        if request_id in self._queues:
            return self._queues.remove(request_id)
        return None

    def stop_running(self, request_id: str) -> Booking | None:
        """A running request is cancelled: release its booking (its quota returns at once,
        before its worker has stopped it) and return it; None if it is not running here. A
        later completion or failure report of it finds no booking and changes nothing."""
        if request_id not in self._books:
            return None
        return self._release(request_id)

    def _release(self, request_id: str) -> Booking:
        booking = self._books.get(request_id)
        assert booking is not None
        self._reserved.pop(request_id, None)
        self._adopted.discard(request_id)
        levels, amount = self.quota_levels(booking.request)
        released = self._books.release(request_id, levels, amount)
        self._refresh(released.worker_id)
        return released

    def sweep(self, now_s: float) -> list[Ended]:
        """End queued requests that must not run: deadline passed, or model still unknown
        after the discovery grace. Returns them with their typed rejections."""
        ended = [Ended(r, _deadline_rejection()) for r in self._queues.expired(now_s)]
        if self._maybe_unknown and now_s >= self._model_grace_until_s:
            for rid in sorted(self._maybe_unknown):
                self._maybe_unknown.discard(rid)
                request = self._queues.get(rid)
                if request is not None and not self.known_model(request.model):
                    self._queues.remove(rid)
                    ended.append(Ended(request, self._unknown_model(request.model)))
        return ended

    def reconcile(self, now_s: float, grace_s: float) -> Reconciliation:
        """Compare the books with the workers' reports and correct them
        (:mod:`sluice.dispatcher.reconcile`): orphans are released and queued again as their
        next attempt (or end, out of attempts), moved bookings follow their reports, queued
        requests a worker reports are booked there."""
        drift = find_drift(self._books.bookings(), self._workers, self.order(), now_s, grace_s)
        out = Reconciliation(drift)
        for rid in drift.orphaned:
            booking = self._release(rid)
            self._failed_on[rid] = booking.worker_id  # a stale report must not re-adopt it
            retry = self._retry(booking.request, booking.worker_id)
            if isinstance(retry, Ended):
                out.ended.append(retry)
            else:
                out.requeued.append(retry)
        for rid, worker_id in drift.moved:
            request = self._release(rid).request
            self._insert(request)
            if self.book(Dispatch(request, worker_id), now_s):
                self._adopted.add(rid)  # (the run there: its attempt is that worker's)
        for rid, worker_id in drift.adopted:
            self.adopt(rid, worker_id, now_s)
        return out

    def drift(self, worker_id: str, now_s: float, grace_s: float) -> int:
        """How far this dispatcher's books disagree with the worker's reported in-flight ids
        (bookings younger than ``grace_s`` are not counted: the report may predate them)."""
        info = self._workers.get(worker_id)
        if info is None:
            return 0
        return self._books.drift(worker_id, info.reported_in_flight, now_s, grace_s)


def _meter(config: AdmissionConfig) -> BandMeter:
    return BandMeter(
        config.bands,
        config.floors,
        headroom=config.idle_headroom,
        window_s=config.demand_window_s,
        burst_s=config.burst_s,
    )


def _deadline_rejection() -> Rejection:
    return Rejection(reason=RejectReason.DEADLINE_EXCEEDED, message="deadline passed while queued")

"""The live dispatcher: the pure scheduler wrapped in an asyncio/NATS runtime.

Tasks: one long-poll pull task per band feeding the scheduler; one scheduling loop (sweep,
leases, plan, concurrent hand-offs, book); one task keeping held request messages alive with
in-progress acks. Heartbeats, completions and stats queries arrive on core NATS subscriptions.

A request's message stays un-acked in its band stream until the request ends (completion or
typed rejection), so a dispatcher crash loses nothing: the next one gets it redelivered, spends
its first ``learn_s`` only listening to heartbeats (which requests are already running where),
and skips requests whose result already exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from sluice.common.aio import finish_tasks, wait_event
from sluice.common.transport import connect
from sluice.dispatcher.cacheaware import CacheAware, Digest
from sluice.dispatcher.decisions import DecisionLog, decision_record
from sluice.dispatcher.feedback import Feedback, ScaleAdvisor, WaitFigures
from sluice.dispatcher.leases import LeaseTable
from sluice.dispatcher.routing import LeastLoaded, RoutingPolicy
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.settings import DispatcherSettings
from sluice.dispatcher.runtime.streams import config_bucket, ensure_streams
from sluice.dispatcher.scheduler import Booking, Dispatch, Ended, Request, Scheduler, WorkerInfo
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.hashing import prompt_hashes, prompt_length
from sluice.schemas.models import (
    AdmissionOverrides,
    Assignment,
    AssignmentReply,
    BandStats,
    Completion,
    DeadLetter,
    DispatcherStats,
    Heartbeat,
    Rejection,
    RejectReason,
    Result,
    ScaleEvent,
    SubmitRequest,
    WaitEstimate,
    WaitQuery,
)

log = logging.getLogger("sluice.dispatcher")

_REQUEST_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")


@dataclass
class _Held:
    """A request message the dispatcher holds un-acked until the request ends."""

    msg: Msg
    request: SubmitRequest
    stream_seq: int


class Dispatcher:
    """One dispatcher. ``async with Dispatcher(settings) as d:`` runs it until the block ends."""

    def __init__(
        self,
        settings: DispatcherSettings,
        *,
        nc: NATS | None = None,
        policy: RoutingPolicy | None = None,
    ) -> None:
        self.settings = settings
        self._nc = nc
        self._own_nc = nc is None
        if policy is None and settings.routing_policy == "cache-aware":
            policy = CacheAware(settings.routing())
        self._policy = policy or LeastLoaded(random.Random(settings.seed))
        self._cache_aware = self._policy if isinstance(self._policy, CacheAware) else None
        self._decisions = (
            DecisionLog(settings.decision_log, settings.decision_log_max_bytes)
            if settings.decision_log is not None
            else None
        )
        self._last_expire_s = 0.0
        self._feedback = Feedback(settings.feedback_window_s)
        self._advisor = ScaleAdvisor(
            up_wait_s=settings.scale_up_wait_s,
            up_sustain_s=settings.scale_up_sustain_s,
            down_idle_s=settings.scale_down_idle_s,
        )
        self._last_feedback_s = 0.0
        self._hit_tokens: Counter[str] = Counter()
        self._prompt_tokens: Counter[str] = Counter()
        self._started_s = time.monotonic()
        self.scheduler = Scheduler(
            settings.admission(),
            self._policy,
            models=settings.models,
            model_grace_s=settings.effective_model_grace_s,
            started_s=self._started_s,
        )
        self.leases = LeaseTable(settings.lease_s)
        self._held: dict[str, _Held] = {}
        self._held_by_band: Counter[str] = Counter()
        self._room = {b: asyncio.Event() for b in settings.bands}
        self._kick = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Subscription] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._running = False
        self._config_watch: KeyValue.KeyWatcher | None = None

    @property
    def nc(self) -> NATS:
        assert self._nc is not None, "dispatcher not started"
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Dispatcher:
        s = self.settings
        if self._nc is None:
            self._nc = await connect(
                s.nats_url, f"sluice-{s.dispatcher_id}", reconnected_cb=self._on_reconnected
            )
        await ensure_streams(self.js, s)
        self._started_s = time.monotonic()
        self._running = True
        self._subs = [
            await self.nc.subscribe(names.HEARTBEAT_SUBJECTS, cb=self._on_heartbeat),
            await self.nc.subscribe(names.COMPLETION_SUBJECTS, cb=self._on_completion),
            await self.nc.subscribe(names.STATS_SUBJECT, cb=self._on_stats),
            await self.nc.subscribe(names.WAIT_SUBJECT, cb=self._on_wait),
        ]
        for band in s.bands:
            self._subs.append(
                await self.nc.subscribe(
                    names.max_deliveries_advisory(band), cb=self._on_max_deliveries
                )
            )
        for band in s.bands:
            psub = await self.js.pull_subscribe_bind(
                durable=names.dispatcher_consumer(band), stream=names.request_stream(band)
            )
            self._tasks.append(
                asyncio.create_task(self._pull_loop(band, psub), name=f"pull-{band}")
            )
        kv = await config_bucket(self.js, s)
        self._config_watch = await kv.watch(names.ADMISSION_KEY)
        self._tasks.append(asyncio.create_task(self._config_loop(), name="config"))
        self._tasks.append(asyncio.create_task(self._schedule_loop(), name="schedule"))
        self._tasks.append(asyncio.create_task(self._keepalive_loop(), name="keepalive"))
        log.info("dispatcher %s started on %s", s.dispatcher_id, s.nats_url)
        return self

    async def stop(self) -> None:
        """Stop pulling and dispatching. Held requests are handed back (nak) so the next
        dispatcher gets them redelivered at once; it learns from heartbeats which of them are
        running already."""
        await self._halt(hand_back=True)

    async def kill(self) -> None:
        """Stop as a crash would: held requests come back only after ``ack_wait_s``."""
        await self._halt(hand_back=False)

    async def _halt(self, *, hand_back: bool) -> None:
        if not self._running:
            return
        self._running = False
        self._stopping.set()
        # The loops see the flag within one fetch timeout or tick. nats-py's fetch() does not
        # reliably honour cancellation, so cancel only what has not stopped by then.
        self._kick.set()
        for room in self._room.values():
            room.set()
        if self._config_watch is not None:
            with contextlib.suppress(Exception):
                # Ends the config loop's iteration (no cancellation needed).
                await self._config_watch.stop()  # type: ignore[no-untyped-call]
        await finish_tasks(self._tasks, self.settings.fetch_timeout_s + 1.0)
        self._tasks = []
        await finish_tasks(list(self._background), 2.0)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        if hand_back:
            for held in self._held.values():
                with contextlib.suppress(Exception):
                    await held.msg.nak()
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
        self._held.clear()
        if self._decisions is not None:
            self._decisions.close()
        if self._own_nc and self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None

    async def __aenter__(self) -> Dispatcher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ requests in

    async def _pull_loop(self, band: str, psub: JetStreamContext.PullSubscription) -> None:
        room = self._room[band]
        while self._running:
            free = self.settings.max_buffered - self._held_by_band[band]
            if free <= 0:
                room.clear()
                await room.wait()
                continue
            try:
                msgs = await psub.fetch(batch=min(free, 128), timeout=self.settings.fetch_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
                await asyncio.sleep(0.2)
                continue
            except Exception:
                log.exception("fetch on band %s failed; retrying", band)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    await self._on_request(band, msg)
                except Exception:  # never let one message stop the band
                    log.exception("unexpected error on a request of band %s", band)
            self._kick.set()

    async def _on_request(self, band: str, msg: Msg) -> None:
        now = time.monotonic()
        meta = msg.metadata
        try:
            s_band, s_model, s_tenant = names.parse_request_subject(msg.subject)
        except ValueError:
            s_band, s_model, s_tenant = band, "", "default"
        header_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        try:
            req = decode(msg.data, SubmitRequest)
        except DecodeError as exc:
            partial = exc.partial if isinstance(exc.partial, dict) else {}
            rid = header_id or str(partial.get("request_id", ""))
            await self._reject_raw(msg, s_tenant, rid, RejectReason.MALFORMED, str(exc))
            return
        if (req.band, req.model, req.tenant) != (s_band, s_model, s_tenant):
            await self._reject_raw(
                msg,
                s_tenant,
                req.request_id,
                RejectReason.MALFORMED,
                f"body says band/model/tenant {req.band}/{req.model}/{req.tenant} but it was "
                f"published on {msg.subject}",
            )
            return
        rid = req.request_id
        held = self._held.get(rid)
        if held is not None:
            if held.stream_seq == meta.sequence.stream:
                held.msg = msg  # a redelivery of the message we hold: keep the newest handle
            else:
                metrics.DUPLICATES.inc()
                await _ack(msg)
            return
        if meta.num_delivered > 1 and await self._result_exists(req.tenant, rid):
            metrics.DUPLICATES.inc()
            await _ack(msg)
            return
        wall = time.time()
        stored_s = meta.timestamp.timestamp() if meta.timestamp else wall
        deadline_s = None
        if req.deadline_unix_ms is not None:
            deadline_s = now + (req.deadline_unix_ms / 1000 - wall)
        request = Request(
            request_id=rid,
            band=req.band,
            model=req.model,
            tenant=req.tenant,
            prompt_tokens=prompt_length(req.prompt_tokens, req.prompt_text),
            max_tokens=req.max_tokens,
            arrived_s=now - max(0.0, wall - stored_s),
            deadline_s=deadline_s,
            block_hashes=tuple(prompt_hashes(req.prompt_tokens, req.prompt_text)),
        )
        outcome = self.scheduler.enqueue(request, now)
        if outcome.status == "queued":
            self._held[rid] = _Held(msg, req, meta.sequence.stream)
            self._held_by_band[req.band] += 1
        elif outcome.status == "duplicate":
            metrics.DUPLICATES.inc()
            await _ack(msg)
        else:
            assert outcome.rejection is not None
            await self._publish_rejection(req, outcome.rejection)
            await _ack(msg)

    async def _result_exists(self, tenant: str, request_id: str) -> bool:
        try:
            await self.js.get_last_msg(
                names.RESULT_STREAM, names.result_subject(tenant, request_id), direct=True
            )
        except NotFoundError:
            return False
        except Exception:
            return False  # unsure: run it again; the client deduplicates results
        return True

    # ------------------------------------------------------------------ answers

    async def _publish_rejection(self, req: SubmitRequest, rejection: Rejection) -> None:
        result = Result(
            request_id=req.request_id,
            ok=False,
            model=req.model,
            tenant=req.tenant,
            band=req.band,
            rejection=rejection,
        )
        metrics.REJECTED.labels(rejection.reason.value).inc()
        self._feedback.rejected(req.model, req.band, time.monotonic())
        await self._publish_result(result)

    async def _publish_result(self, result: Result) -> None:
        subject = names.result_subject(result.tenant, result.request_id)
        for attempt in range(5):
            try:
                await self.js.publish(
                    subject, encode(result), headers={"Nats-Msg-Id": result.request_id}
                )
                return
            except Exception:
                await asyncio.sleep(0.2 * (attempt + 1))
        log.error("could not publish the result of %s", result.request_id)

    async def _reject_raw(
        self, msg: Msg, tenant: str, request_id: str, reason: RejectReason, message: str
    ) -> None:
        """Answer input that is not a valid request: on its result subject when it names a
        usable request id, else into the dead-letter stream. Then ack it: it will never run."""
        metrics.REJECTED.labels(reason.value).inc()
        if request_id and len(request_id) <= 128 and set(request_id) <= _REQUEST_ID_CHARS:
            await self._publish_result(
                Result(
                    request_id=request_id,
                    ok=False,
                    tenant=tenant,
                    rejection=Rejection(reason=reason, message=message),
                )
            )
        else:
            letter = DeadLetter(
                reason=reason,
                message=message,
                subject=msg.subject,
                payload=msg.data,
                received_unix_ms=int(time.time() * 1000),
            )
            with contextlib.suppress(Exception):
                await self.js.publish(names.dead_letter_subject(reason.value), encode(letter))
        await _ack(msg)

    async def _end(self, ended: Ended) -> None:
        held = self._release_held(ended.request.request_id)
        if held is None:
            return
        await self._publish_rejection(held.request, ended.rejection)
        await _ack(held.msg)

    def _release_held(self, request_id: str) -> _Held | None:
        held = self._held.pop(request_id, None)
        if held is not None:
            band = held.request.band
            self._held_by_band[band] -= 1
            self._room[band].set()
        return held

    # ------------------------------------------------------------------ scheduling

    async def _schedule_loop(self) -> None:
        s = self.settings
        while self._running:
            await wait_event(self._kick, s.tick_s)
            self._kick.clear()
            try:
                await self._schedule_once()
            except Exception:
                log.exception("scheduling pass failed; continuing")
                await asyncio.sleep(s.tick_s)

    async def _schedule_once(self) -> None:
        now = time.monotonic()
        if not self.nc.is_connected:
            return  # cut off: no heartbeats reach us, so no lease may expire; nothing to send
        for worker_id in self.leases.expired(now):
            metrics.LEASES_EXPIRED.inc()
            log.warning("worker %s lost its lease; re-queueing its requests", worker_id)
            await self._lose_worker(worker_id)
        for ended in self.scheduler.sweep(now):
            await self._end(ended)
        self._update_gauges()
        if now - self._started_s < self.settings.effective_learn_s:
            return  # learning mode: only listen to heartbeats
        decisions = self.scheduler.plan(now)
        if not decisions:
            return
        accepted = await asyncio.gather(*(self._offer(d) for d in decisions))
        booked_s = time.monotonic()
        for d, ok in zip(decisions, accepted, strict=True):
            if not ok:
                metrics.HANDOFF_REFUSED.inc()
                self.scheduler.refused(d)
                continue
            r = d.request
            booked = self.scheduler.book(d, booked_s)
            # The worker's heartbeat may have listed it first (adopted): still this decision.
            b = self.scheduler.booking(r.request_id)
            if booked or (
                b is not None and b.worker_id == d.worker_id and b.request.attempt == r.attempt
            ):
                metrics.ADMITTED.labels(r.band).inc()
                metrics.QUEUE_WAIT.labels(r.band).observe(max(0.0, booked_s - r.arrived_s))
                self._feedback.admitted(r.model, r.band, booked_s - r.arrived_s, booked_s)
                metrics.ROUTED.labels(d.choice.reason if d.choice else "").inc()
                if self._decisions is not None:
                    self._decisions.write(decision_record(d, booked_s))
        self._kick.set()  # room may remain: plan again at once

    async def _offer(self, d: Dispatch) -> bool:
        held = self._held.get(d.request.request_id)
        if held is None:
            return False
        wall = time.time()
        assignment = Assignment(
            request=held.request,
            attempt=d.request.attempt,
            dispatcher_id=self.settings.dispatcher_id,
            queued_s=max(0.0, wall - held.request.submitted_unix_ms / 1000),
        )
        t0 = time.perf_counter()
        try:
            reply = await self.nc.request(
                names.work_subject(d.worker_id),
                encode(assignment),
                timeout=self.settings.handoff_timeout_s,
            )
            answer = decode(reply.data, AssignmentReply)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, DecodeError):
            return False
        except Exception:
            log.exception("hand-off of %s to %s failed", d.request.request_id, d.worker_id)
            return False
        metrics.HANDOFF.observe(time.perf_counter() - t0)
        return answer.accepted

    async def _lose_worker(self, worker_id: str) -> None:
        self.leases.drop(worker_id)
        requeued, ended = self.scheduler.remove_worker(worker_id)
        if self._cache_aware is not None:
            self._cache_aware.remove_worker(worker_id)
        with contextlib.suppress(KeyError):
            metrics.DRIFT.remove(worker_id)
        for e in ended:
            await self._end(e)
        for r in requeued:
            metrics.REQUEUED.inc()
            held = self._held.get(r.request_id)
            if held is not None and await self._result_exists(r.tenant, r.request_id):
                # It finished but its completion was lost with the worker.
                self.scheduler.cancel(r.request_id)
                self._release_held(r.request_id)
                await _ack(held.msg)
        self._kick.set()

    def wait_figures(self, model: str, band: str, now: float) -> WaitFigures:
        """The feedback figures of one model and band now."""
        queued, running = self.scheduler.counts().get((model, band), (0, 0))
        return self._feedback.figures(model, band, queued, running, now)

    def _publish_feedback(self, now: float) -> None:
        counts = self.scheduler.counts()
        keys = set(counts) | set(self._feedback.keys())
        for model, band in sorted(keys):
            queued, running = counts.get((model, band), (0, 0))
            f = self._feedback.figures(model, band, queued, running, now)
            metrics.QUEUE_DEPTH.labels(model, band).set(queued)
            metrics.WAIT_P50.labels(model, band).set(f.wait_p50_s)
            metrics.WAIT_P99.labels(model, band).set(f.wait_p99_s)
            metrics.ADMIT_RATE.labels(model, band).set(f.admitted_per_s)
            metrics.REJECT_RATE.labels(model, band).set(f.rejected_per_s)
            expected = math.nan if f.expected_wait_s is None else f.expected_wait_s
            metrics.EXPECTED_WAIT.labels(model, band).set(expected)
            signal = self._advisor.observe(f, now)
            state = self._advisor.state(model, band)
            metrics.SCALE_SIGNAL.labels(model, band).set(
                1 if state == "up" else -1 if state == "down" else 0
            )
            if signal is not None:
                metrics.SCALE_EVENTS.labels(signal.direction).inc()
                log.info("scale %s for %s/%s: %s", signal.direction, model, band, signal.reason)
                event = ScaleEvent(
                    dispatcher_id=self.settings.dispatcher_id,
                    model=signal.model,
                    band=signal.band,
                    direction=signal.direction,
                    reason=signal.reason,
                    expected_wait_s=signal.expected_wait_s,
                    at_unix_ms=int(time.time() * 1000),
                )
                self._spawn(self.nc.publish(names.SCALE_EVENTS_SUBJECT, encode(event)))

    async def _on_wait(self, msg: Msg) -> None:
        try:
            q = decode(msg.data, WaitQuery)
        except DecodeError:
            metrics.BAD_INPUT.labels("wait").inc()
            return
        f = self.wait_figures(q.model, q.band, time.monotonic())
        reply = WaitEstimate(**dataclasses.asdict(f))
        with contextlib.suppress(Exception):
            await msg.respond(encode(reply))

    async def _config_loop(self) -> None:
        """Apply the operators' run-time admission configuration as it changes."""
        assert self._config_watch is not None
        async for entry in self._config_watch:
            if entry is None:
                continue  # the end of the initial value(s)
            deleted = entry.operation is not None  # a delete or purge: back to the settings
            self.apply_overrides(None if deleted else entry.value)

    def apply_overrides(self, data: bytes | None) -> bool:
        """Apply a run-time configuration (JSON of ``AdmissionOverrides``; None: back to this
        dispatcher's settings). An invalid one is logged and ignored; returns whether it took."""
        try:
            if data is None:
                config = self.settings.admission()
            else:
                overrides = AdmissionOverrides.model_validate_json(data)
                config = self.settings.with_overrides(overrides)
            self.scheduler.reconfigure(config)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            metrics.CONFIG_UPDATES.labels("rejected").inc()
            log.error("run-time admission configuration ignored: %s", exc)
            return False
        metrics.CONFIG_UPDATES.labels("applied").inc()
        log.info("run-time admission configuration applied")
        self._kick.set()
        return True

    def _update_gauges(self) -> None:
        now = time.monotonic()
        metrics.WORKERS.set(len(self.leases))
        for snap in self.scheduler.band_snapshots(now):
            metrics.QUEUED.labels(snap.band).set(snap.queued)
            metrics.RUNNING.labels(snap.band).set(snap.running)
        if now - self._last_feedback_s >= self.settings.feedback_every_s:
            self._last_feedback_s = now
            self._publish_feedback(now)
        p = self._cache_aware
        if p is not None and now - self._last_expire_s >= 10.0:
            self._last_expire_s = now
            p.expire(now, max_blocks=20_000)  # bounded: the event loop must not stall
            metrics.INDEX_BLOCKS.set(len(p.index))
            counts = [n for n in p.affinity.replica_counts(now) if n]
            metrics.REPLICAS.labels("prefixes").set(len(counts))
            metrics.REPLICAS.labels("max").set(max(counts, default=0))
            metrics.FLAP_RATE.set(p.flaps / max(1, p.decisions))
            if self._decisions is not None:
                self._decisions.flush()

    async def _on_reconnected(self) -> None:
        log.warning("reconnected to NATS; renewing every worker's lease")
        self.leases.renew_all(time.monotonic())
        self._kick.set()

    # ------------------------------------------------------------------ worker traffic

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
        except DecodeError:
            metrics.BAD_INPUT.labels("heartbeat").inc()
            return
        if hb.leaving:
            if hb.worker_id in self.leases:
                await self._lose_worker(hb.worker_id)
            return
        now = time.monotonic()
        self.leases.renew(hb.worker_id, now)
        self.scheduler.update_worker(
            WorkerInfo(
                worker_id=hb.worker_id,
                models=frozenset(hb.models),
                capacity=hb.capacity,
                draining=hb.draining,
                reported_pending_tokens=hb.load.pending_prefill_tokens
                + hb.load.active_decode_tokens,
                reported_in_flight=frozenset(hb.in_flight),
                reported_prefill_tokens=hb.load.pending_prefill_tokens,
                reported_s=now,
            )
        )
        if self._cache_aware is not None:
            self._feed_digest(hb, now)
        for rid in hb.in_flight:
            if self.scheduler.is_queued(rid):
                self.scheduler.adopt(rid, hb.worker_id, now)
        drift = self.scheduler.drift(hb.worker_id, now, grace_s=2 * self.settings.lease_s)
        metrics.DRIFT.labels(hb.worker_id).set(drift)
        self._kick.set()

    def _feed_digest(self, hb: Heartbeat, now: float) -> None:
        assert self._cache_aware is not None
        d = hb.cache
        expected = self._cache_aware.index_block_tokens
        if d is not None and d.block_tokens != expected:
            metrics.BAD_INPUT.labels("digest").inc()
            log.warning(
                "worker %s reports %d-token index blocks; this dispatcher indexes %d "
                "(block size x routing_index_stride_blocks): digest ignored",
                hb.worker_id,
                d.block_tokens,
                expected,
            )
            d = None
        digest = None if d is None else Digest(d.seq, d.snapshot, tuple(d.stored), tuple(d.evicted))
        if not self._cache_aware.heartbeat(hb.worker_id, digest, now):
            metrics.STALE_DIGESTS.inc()

    def _learn(self, c: Completion, booking: Booking | None, request: Request) -> None:
        """Teach the policy from a completion, and count the worker's hit rate."""
        w = c.worker_id
        self._prompt_tokens[w] += c.prompt_tokens
        self._hit_tokens[w] += c.cached_tokens
        metrics.WORKER_PROMPT_TOKENS.labels(w).inc(c.prompt_tokens)
        metrics.WORKER_CACHED_TOKENS.labels(w).inc(c.cached_tokens)
        metrics.WORKER_HIT_RATE.labels(w).set(self._hit_tokens[w] / max(1, self._prompt_tokens[w]))
        if booking is not None and booking.worker_id == w:
            metrics.HIT_ERROR.observe(c.cached_tokens - booking.expected_hit_tokens)
        if self._cache_aware is not None:
            self._cache_aware.completed(
                w,
                request.route_view(),
                cached_tokens=c.cached_tokens,
                prefill_s=c.prefill_s,
                output_tokens=c.output_tokens,
                decode_s=c.decode_s,
                now_s=time.monotonic(),
            )

    async def _on_completion(self, msg: Msg) -> None:
        try:
            c = decode(msg.data, Completion)
        except DecodeError:
            metrics.BAD_INPUT.labels("completion").inc()
            await _respond(msg)
            return
        if c.ok:
            booking = self.scheduler.booking(c.request_id)
            request = self.scheduler.complete(c.request_id)
            if request is not None:
                self._learn(c, booking, request)
            held = self._release_held(c.request_id)
            if held is not None:
                await _ack(held.msg)
                if request is not None:
                    metrics.COMPLETED.labels(request.band).inc()
        else:
            outcome = self.scheduler.fail(c.request_id, c.worker_id, c.attempt)
            if isinstance(outcome, Ended):
                await self._end(outcome)
            elif outcome is not None:
                log.warning(
                    "worker %s failed %s (%s); retrying", c.worker_id, c.request_id, c.error
                )
        await _respond(msg)
        self._kick.set()

    async def _on_max_deliveries(self, msg: Msg) -> None:
        """A request exhausted ``max_deliver``: the broker will not deliver it again, but it
        still sits in its work-queue stream. Answer its producer, keep a dead letter, and
        remove it from the queue."""
        try:
            advisory = json.loads(msg.data)
            stream, seq = str(advisory["stream"]), int(advisory["stream_seq"])
            deliveries = int(advisory.get("deliveries", 0))
            raw = await self.js.get_msg(stream, seq=seq)
        except Exception:
            log.exception("cannot handle a max-deliveries advisory")
            return
        message = f"delivered {deliveries} times without finishing; moved to the dead-letter stream"
        data = raw.data or b""
        if self._held.get(_request_id_of(data)) is not None:
            return  # we hold it now (a delivery raced the advisory): it is being served
        letter = DeadLetter(
            reason=RejectReason.UNDELIVERABLE,
            message=message,
            subject=raw.subject or "",
            payload=data,
            received_unix_ms=int(time.time() * 1000),
        )
        try:
            # Keep the letter first, then free the queue; only then answer the producer.
            await self.js.publish(
                names.dead_letter_subject(RejectReason.UNDELIVERABLE.value), encode(letter)
            )
            await self.js.delete_msg(stream, seq)
        except Exception:
            log.exception("cannot dead-letter the request at %s #%d", stream, seq)
            return
        log.warning("request at %s #%d was undeliverable; dead-lettered", stream, seq)
        with contextlib.suppress(DecodeError):
            req = decode(data, SubmitRequest)
            await self._publish_rejection(
                req, Rejection(reason=RejectReason.UNDELIVERABLE, message=message)
            )

    async def _on_stats(self, msg: Msg) -> None:
        now = time.monotonic()
        stats = DispatcherStats(
            dispatcher_id=self.settings.dispatcher_id,
            running=self.scheduler.running,
            global_limit=self.settings.global_limit,
            workers=len(self.leases),
            bands=[
                BandStats(
                    band=b.band,
                    queued=b.queued,
                    running=b.running,
                    limit=b.limit,
                    oldest_wait_s=b.oldest_wait_s,
                )
                for b in self.scheduler.band_snapshots(now)
            ],
        )
        await _respond(msg, encode(stats))

    # ------------------------------------------------------------------ keep held alive

    async def _keepalive_loop(self) -> None:
        interval = self.settings.ack_wait_s / 3
        while self._running:
            if await wait_event(self._stopping, interval):
                break
            for held in list(self._held.values()):
                with contextlib.suppress(Exception):
                    await held.msg.in_progress()


def _request_id_of(data: bytes) -> str:
    try:
        return decode(data, SubmitRequest).request_id
    except DecodeError:
        return ""


async def _ack(msg: Msg) -> None:
    with contextlib.suppress(Exception):
        await msg.ack()


async def _respond(msg: Msg, data: bytes = b"") -> None:
    if msg.reply:
        with contextlib.suppress(Exception):
            await msg.respond(data)

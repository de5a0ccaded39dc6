"""The live agent: takes assignments, drives its engine, streams tokens, reports back.

One asyncio task steps the engine on a clock that is ``speed`` times faster than real time (it
sleeps to an absolute target, so per-step timer overshoot does not accumulate). Tokens are
coalesced (:mod:`sluice.agent.coalesce`). A finished request's result goes to JetStream
(deduplicated by request id), then its completion to the dispatcher; both wait in the bounded
outbox (:mod:`sluice.agent.outbox`) and are retried after every heartbeat, in the background,
until the dispatcher confirms. What it accepts and what it reports are the pure modules beside
this package.

Draining: :meth:`Agent.drain` (SIGTERM, through :meth:`Agent.stop`) or an operator's
:class:`~sluice.schemas.models.DrainRequest` (``sluice drain``) stops it taking work; it
heartbeats ``draining``, finishes what it runs, then heartbeats ``drained`` (and, asked to
``exit``, sets :meth:`Agent.wait_exit`). An undrain takes work again. A
:class:`~sluice.schemas.models.RemoveNotice` (a dispatcher took its lease away while it was
silent) makes it drop what it runs (the dispatcher queued it again) and heartbeat as a fresh
registration; its finished reports are still delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from sluice.agent import reports
from sluice.agent.acceptance import review
from sluice.agent.coalesce import TokenBuffer
from sluice.agent.engine import Engine, EngineError, Failed, Finished, TokensOut
from sluice.agent.errors import AgentBrokerUnreachable, AgentNotStarted
from sluice.agent.outbox import Outbox, Report
from sluice.agent.runtime import metrics
from sluice.agent.runtime.settings import AgentSettings
from sluice.common.aio import finish_tasks, wait_event
from sluice.common.errors import TransportError, internal_error
from sluice.common.probes import Probe, nats_state
from sluice.common.tokenizer import Tokenizers
from sluice.common.transport import connect
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.hashing import index_stride, prompt_hashes, prompt_length
from sluice.schemas.models import (
    Assignment,
    AssignmentReply,
    DrainReply,
    DrainRequest,
    LeaderLease,
    RemoveNotice,
    StopWork,
    StopWorkReply,
    TokenChunk,
    WorkerState,
)

log = logging.getLogger("sluice.agent")

Observer = Callable[[str, int], None]
"""Called with ``(worker_id, in_flight)`` whenever the agent's in-flight count changes."""

_NEVER_STORED = (nats.errors.MaxPayloadError, OverflowError)
"""What storing a result raises that no retry changes: more than the broker's ``max_payload``,
a number the encoding cannot hold."""
_BROKER_ERRORS = (nats.errors.Error, OSError, TimeoutError)
"""What a publish or request may raise while the broker or the peer is away (nats-py's
JetStream errors derive from ``nats.errors.Error``): expected, retried, not internal errors."""


@dataclass
class _Running:
    assignment: Assignment
    accepted_unix_s: float
    out: TokenBuffer = field(default_factory=TokenBuffer)

    def __post_init__(self) -> None:
        if self.top_logprobs >= 0:
            self.out.logprobs = []

    @property
    def top_logprobs(self) -> int:
        """The alternatives per token its logprobs name (-1: it asked for none)."""
        sampling = self.assignment.request.sampling
        return -1 if sampling is None or sampling.logprobs is None else sampling.logprobs

    @property
    def request_id(self) -> str:
        return self.assignment.request.request_id

    @property
    def attempt(self) -> int:
        return self.assignment.attempt


class Agent:
    """One worker: an engine behind the Sluice protocol.

    ``async with Agent(settings, engine) as agent:`` starts it (connecting to
    ``settings.nats_url`` unless a connection is passed in) and stops it cleanly (drain, then a
    *leaving* heartbeat). :meth:`kill` stops it abruptly, as a crash would, for fault tests.
    """

    def __init__(
        self,
        settings: AgentSettings,
        engine: Engine,
        *,
        nc: NATS | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.engine = engine
        self._tokenizers = Tokenizers(settings.tokenizer)
        stride = index_stride(engine.block_tokens, settings.digest_index_tokens)
        self._digests = reports.DigestBuilder(
            engine.block_tokens * stride,
            snapshot_every=settings.digest_snapshot_every,
            max_blocks=settings.digest_max_blocks,
        )
        self._nc = nc
        self._own_nc = nc is None
        self._observer = observer
        self._running: dict[str, _Running] = {}
        self._outbox = Outbox(settings.outbox_max_reports)
        self._delivering: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Subscription] = []
        self._hb_seq = 0
        self._busy_counted_s = 0.0
        self._kv_counted: dict[str, int] = {}
        """The engine's KV event counts already in ``sluice_agent_engine_kv_events_total``."""
        """Engine busy seconds already counted in ``sluice_agent_engine_busy_seconds_total``."""
        self._draining = False
        self._exit_when_drained = False
        self._announced_drained = False
        self._exit = asyncio.Event()
        self._registration = int(time.time() * 1000)
        self.removed = 0
        """Remove notices obeyed (a dispatcher took the lease away while it was silent)."""
        self._started = False
        self._alive = False
        self._hb_stop = asyncio.Event()
        self._sending: set[asyncio.Task[None]] = set()
        self._retrying: asyncio.Task[None] | None = None
        """The outbox's retry pass in the background, while one runs (one at a time)."""
        self.completed = 0
        self.epoch = 0
        """The newest leadership epoch seen (assignments and leader announcements)."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise AgentNotStarted("call start() first")
        return self._nc

    @property
    def in_flight(self) -> int:
        return len(self._running)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def state(self) -> WorkerState:
        """``serving``, ``draining``, or ``drained`` (draining with nothing running and no
        report waiting)."""
        if not self._draining:
            return "serving"
        return "draining" if self._running or len(self._outbox) else "drained"

    @property
    def registration(self) -> int:
        """The number its heartbeats carry; raised when it registers afresh."""
        return self._registration

    def probe(self) -> Probe:
        """For ``/healthz`` and ``/readyz`` (:mod:`sluice.common.probes`): live while it runs,
        its engine loop runs and its NATS connection is not closed; ready while it is also
        connected, serving (not draining, not stopping) and its engine takes work."""
        nats = nats_state(self._nc)
        live = self._alive and nats != "closed"  # also while a stop drains it
        available = self.engine.available
        detail = {
            "worker": self.worker_id,
            "nats": nats,
            "state": self.state if self._alive else "stopped",
            "engine": "available" if available else "unavailable",
        }
        ready = live and nats == "connected" and self.state == "serving" and available
        return Probe(live=live, ready=ready, detail=detail)

    async def wait_exit(self) -> None:
        """Return once an operator's drain with ``exit`` has drained it."""
        await self._exit.wait()

    async def start(self) -> Agent:
        if self._nc is None:
            try:
                self._nc = await connect(
                    self.settings.nats_url,
                    f"sluice-agent-{self.worker_id}",
                    auth=self.settings.broker_auth(),
                )
            except TransportError as exc:
                raise AgentBrokerUnreachable(str(exc)) from exc
        self._subs = [
            await self.nc.subscribe(names.work_subject(self.worker_id), cb=self._on_assignment),
            await self.nc.subscribe(names.control_subject(self.worker_id), cb=self._on_stop),
            await self.nc.subscribe(names.drain_subject(self.worker_id), cb=self._on_drain),
            await self.nc.subscribe(names.remove_subject(self.worker_id), cb=self._on_remove),
            await self.nc.subscribe(names.LEADER_SUBJECT, cb=self._on_leader),
        ]
        try:
            await self.engine.open()
        except Exception:  # (not a cancellation: the process is stopping, and awaits none)
            # (An engine whose KV event socket cannot be opened, say: the agent does not
            # start, and leaves no subscription or connection behind.)
            await self._close_nats()
            raise
        await self._heartbeat()
        self._alive = True
        self._hb_stop.clear()
        self._tasks = [
            asyncio.create_task(self._engine_loop(), name=f"engine-{self.worker_id}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{self.worker_id}"),
        ]
        self._tasks[0].add_done_callback(self._engine_died)
        self._started = True
        return self

    async def drain(self, *, exit: bool = False) -> None:
        """Take no new work from now on (announced with the next heartbeat, sent at once);
        what runs finishes. ``exit``: once drained, :meth:`wait_exit` returns."""
        self._draining = True
        self._exit_when_drained = self._exit_when_drained or exit
        await self._heartbeat_safely()
        self._check_drained()

    async def undrain(self) -> None:
        """Take work again (a pending exit is called off)."""
        self._draining = False
        self._exit_when_drained = False
        self._announced_drained = False
        await self._heartbeat_safely()

    async def stop(self, *, drain: bool = True) -> None:
        """Stop taking work, finish what is running (up to ``drain_timeout_s``), say goodbye."""
        if not self._started:
            return
        self._started = False
        await self.drain()
        if drain:
            deadline = time.monotonic() + self.settings.drain_timeout_s
            while (self._running or len(self._outbox)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                if len(self._outbox):
                    await self._redeliver()
        await self._heartbeat_safely(leaving=True)
        await self._shutdown()

    def _engine_died(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A broken engine must not keep heartbeating: stop them, so the dispatcher's lease
        # expires and the requests held here run elsewhere.
        log.error("engine of %s crashed", self.worker_id, exc_info=task.exception())
        self._alive = False
        self._hb_stop.set()

    async def kill(self) -> None:
        """Die abruptly: no drain, no goodbye (the dispatcher finds out by the lease)."""
        self._started = False
        await self._shutdown()

    async def _shutdown(self) -> None:
        self._alive = False
        self._wake.set()
        self._hb_stop.set()
        retrying = [self._retrying] if self._retrying is not None else []
        await finish_tasks([*self._tasks, *retrying], grace_s=2.0)
        self._tasks, self._retrying = [], None
        try:
            await self.engine.close()
        except Exception:  # a broken engine must not keep the agent from stopping
            internal_error(log, "agent.engine-close", "engine of %s did not close", self.worker_id)
        await self._close_nats()
        metrics.IN_FLIGHT.labels(self.worker_id).set(0)

    async def _close_nats(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(*_BROKER_ERRORS):
                await sub.unsubscribe()
        self._subs = []
        if self._own_nc and self._nc is not None:
            with contextlib.suppress(*_BROKER_ERRORS):
                await self._nc.close()
            self._nc = None

    async def __aenter__(self) -> Agent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ assignments

    async def _on_assignment(self, msg: Msg) -> None:
        try:
            assignment = decode(msg.data, Assignment)
        except DecodeError as exc:
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, "malformed").inc()
            await self._reply(msg, "invalid", False, f"malformed assignment: {exc}")
            return
        req = assignment.request
        rid = req.request_id
        if not self._alive:  # its engine crashed, or it is stopping
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, "stopped").inc()
            await self._reply(msg, rid, False, "stopped: the agent's engine is not running")
            return
        verdict = review(
            assignment,
            running=self._running,
            reported=self._outbox.succeeded,
            draining=self._draining,
            in_flight=len(self._running),
            capacity=self.settings.capacity,
            outbox_full=self._outbox.full,
            models=self.settings.models,
            epoch=self.epoch,
        )
        if verdict.action != "refuse":
            self.epoch = max(self.epoch, assignment.epoch)
        if verdict.action == "run" and not self.engine.available:
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, "engine-unavailable").inc()
            why = "engine-unavailable: unhealthy, busy (429/503) or its metrics stale"
            await self._reply(msg, rid, False, why)
            return
        if verdict.action == "confirm":
            if rid in self._running:  # a repeated hand-off: keep the newest assignment
                self._running[rid].assignment = assignment
            await self._reply(msg, rid, True)
            return
        if verdict.action == "refuse":
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, verdict.reason.split(":")[0]).inc()
            await self._reply(msg, rid, False, verdict.reason)
            return
        bt = self.engine.block_tokens
        # A text prompt tokenized here goes to the engine as those ids: it caches what we hash.
        ids = self._tokenizers.prompt_ids(req.model, req.prompt_tokens, req.prompt_text)
        n_prompt = prompt_length(ids, req.prompt_text)
        hashes = prompt_hashes(ids, req.prompt_text, bt) if self.engine.uses_prompt_hashes else []
        run = self._running[rid] = _Running(assignment, time.time())
        self._changed()
        # Into the engine before the reply's await: a stop arriving meanwhile finds it there.
        error: str | None = None
        try:
            prompt = ids if ids is not None else req.prompt_text
            self.engine.add(
                rid, n_prompt, req.max_tokens, hashes, time.monotonic(), prompt, req.sampling
            )
            self._wake.set()
        except EngineError as exc:
            error = str(exc)
        await self._reply(msg, rid, True)
        if error is not None and self._running.get(rid) is run:
            # Accepted, then failed at once: the dispatcher runs it elsewhere (attempt + 1).
            self._finish_failed(self._running.pop(rid), error)
            self._changed()

    async def _on_leader(self, msg: Msg) -> None:
        """A leader announces its epoch: from now on, older epochs are refused."""
        try:
            lease = decode(msg.data, LeaderLease)
        except DecodeError:
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, "malformed").inc()
            return
        self.epoch = max(self.epoch, lease.epoch)

    async def _reply(self, msg: Msg, rid: str, accepted: bool, reason: str = "") -> None:
        if not msg.reply:
            return
        rid = rid if rid and rid != "invalid" else "invalid"
        data = encode(AssignmentReply(request_id=rid, accepted=accepted, reason=reason))
        try:
            await msg.respond(data)
        except _BROKER_ERRORS:
            # The dispatcher re-offers or learns from the next heartbeat which we run.
            log.debug("could not answer the assignment of %s", rid)

    async def _on_stop(self, msg: Msg) -> None:
        """The dispatcher cancels a running request: stop it in the engine, store its result
        (``cancelled``, with the tokens produced so far), then answer."""
        try:
            stop = decode(msg.data, StopWork)
        except DecodeError:
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, "malformed").inc()
            return
        run = self._running.get(stop.request_id)
        # A cancel stops whatever attempt runs here: after an adoption the dispatcher's
        # attempt number need not be the one this worker was handed.
        if run is None:
            await self._answer_stop(msg, StopWorkReply(request_id=stop.request_id, stopped=False))
            return
        del self._running[stop.request_id]
        self.engine.cancel(stop.request_id)
        self._changed()
        now = time.time()
        await self._flush(run, now)
        req = run.assignment.request
        result = reports.cancelled(
            req,
            self.worker_id,
            run.attempt,
            tokens=run.out.tokens,
            text=self.engine.detokenize(run.out.tokens),
            logprobs=run.out.logprobs,
        )
        metrics.REQUESTS.labels(self.worker_id, "cancelled").inc()
        failed = reports.failure(self.worker_id, req.request_id, run.attempt, "cancelled")
        report = Report(result, failed)
        self._outbox.put(report)
        try:
            await self._store_result(report)  # stored before the answer: the dispatcher acks
        except _BROKER_ERRORS:
            log.debug("cancelled result of %s not stored yet", req.request_id)
        reply = StopWorkReply(
            request_id=req.request_id,
            stopped=report.result is None,
            output_tokens=len(run.out.tokens),
        )
        await self._answer_stop(msg, reply)
        self._report(report)  # the completion (and the result, if not stored) follow

    async def _on_drain(self, msg: Msg) -> None:
        """An operator drains (or undrains) this worker; the reply is sent once it refuses
        new work."""
        try:
            req = decode(msg.data, DrainRequest)
        except DecodeError:
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, "malformed").inc()
            return
        if req.drain:
            log.info("%s drains (exit when drained: %s)", self.worker_id, req.exit)
            await self.drain(exit=req.exit)
        else:
            log.info("%s takes work again", self.worker_id)
            await self.undrain()
        reply = DrainReply(
            worker_id=self.worker_id, state=self.state, in_flight=list(self._running)
        )
        if msg.reply:
            try:
                await msg.respond(encode(reply))
            except _BROKER_ERRORS:
                log.debug("could not answer the drain of %s", self.worker_id)

    async def _on_remove(self, msg: Msg) -> None:
        """A dispatcher took this worker's lease away (it was silent for longer than the
        lease) and queued what it ran again: drop that and register afresh. A notice for an
        earlier registration (already obeyed) changes nothing."""
        try:
            notice = decode(msg.data, RemoveNotice)
        except DecodeError:
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, "malformed").inc()
            return
        if notice.registration < self._registration:
            return
        dropped = list(self._running)
        for rid in dropped:
            self.engine.cancel(rid)
        self._running.clear()
        self._registration = max(self._registration + 1, int(time.time() * 1000))
        self._digests.restart()  # the dispatcher forgot our cache: a snapshot next
        self.removed += 1
        log.warning(
            "%s lost its lease at %s; dropped %d running requests (queued again there), "
            "registering afresh",
            self.worker_id,
            notice.dispatcher_id,
            len(dropped),
        )
        self._changed()
        if self._alive:  # (a crashed engine's agent stays silent: its lease must expire)
            await self._heartbeat_safely()

    async def _answer_stop(self, msg: Msg, reply: StopWorkReply) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(encode(reply))
        except _BROKER_ERRORS:
            log.debug("could not answer the stop of %s", reply.request_id)

    def _changed(self) -> None:
        metrics.IN_FLIGHT.labels(self.worker_id).set(len(self._running))
        if self._observer is not None:
            self._observer(self.worker_id, len(self._running))
        self._check_drained()

    def _check_drained(self) -> None:
        """Once a drain has nothing left, say so at once (and exit, if asked to)."""
        if self.state != "drained":
            return
        if self._exit_when_drained:
            self._exit.set()
        if self._announced_drained:
            return
        self._announced_drained = True
        log.info("%s is drained", self.worker_id)
        if self._alive:
            task = asyncio.create_task(self._heartbeat_safely())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    # ------------------------------------------------------------------ engine

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        speed = self.settings.speed
        anchor_real = loop.time()
        sim_elapsed = 0.0
        # A real engine's step reports what already happened: handle it at once, then wait
        # for its next delivery (at most a step). A simulated step's events happen during the
        # step: they are handled once its time has passed.
        delivered = getattr(self.engine, "delivered", None)
        if not isinstance(delivered, asyncio.Event):
            delivered = None
        while self._alive:
            if not self.engine.has_work:
                self._wake.clear()
                await self._flush_all()
                await self._wake.wait()
                if not self._alive:
                    break
                anchor_real, sim_elapsed = loop.time(), 0.0
            if delivered is not None:
                delivered.clear()  # before the step: a delivery after it wakes the wait below
            step = self.engine.step()
            if step.duration_s <= 0:
                # Nothing could be admitted (KV full): wait for new work or a finish.
                self._wake.clear()
                await self._wake.wait()
                continue
            if delivered is not None:
                await self._on_events(step.events, time.time())
                await wait_event(delivered, step.duration_s)
                continue
            sim_elapsed += step.duration_s
            delay = anchor_real + sim_elapsed / speed - loop.time()
            await asyncio.sleep(max(0.0, delay))  # 0: let the rest of the process run
            await self._on_events(step.events, time.time())

    async def _on_events(self, events: Sequence[TokensOut | Finished | Failed], now: float) -> None:
        for ev in events:
            if isinstance(ev, TokensOut):
                await self._on_tokens(ev, now)
            elif isinstance(ev, Finished):
                await self._on_finished(ev, now)
            elif isinstance(ev, Failed):
                await self._on_failed(ev, now)
        await self._flush_due(now)

    async def _on_tokens(self, ev: TokensOut, now: float) -> None:
        run = self._running.get(ev.request_id)
        if run is None:
            return
        start = len(run.out.tokens)
        ids = self.engine.output_tokens(ev.request_id, start, ev.count)
        lps = None
        if run.out.logprobs is not None:
            top = run.top_logprobs
            lps = self.engine.output_logprobs(ev.request_id, start, ev.count, top)
        try:
            run.out.add(ids, now, first=ev.first, logprobs=lps)
        except ValueError as exc:  # an engine that broke its promise of one per token
            del self._running[ev.request_id]
            self.engine.cancel(ev.request_id)
            self._finish_failed(run, f"the engine's logprobs: {exc}")
            self._changed()
            return
        if ev.first:
            submitted = run.assignment.request.submitted_unix_ms / 1000
            metrics.TTFT.labels(self.worker_id).observe(max(0.0, now - submitted))
            await self._flush(run, now)  # the first token goes out at once

    async def _flush_due(self, now: float) -> None:
        s = self.settings
        for run in list(self._running.values()):  # a stop may remove one meanwhile
            if run.out.due(now, s.token_flush_ms, s.token_flush_tokens):
                await self._flush(run, now)

    async def _flush_all(self) -> None:
        now = time.time()
        for run in list(self._running.values()):  # a stop may remove one meanwhile
            await self._flush(run, now)

    async def _flush(self, run: _Running, now: float) -> None:
        taken = run.out.take(now)
        if taken is None:
            return
        index, chunk = taken
        msg = TokenChunk(
            request_id=run.request_id,
            attempt=run.attempt,
            index=index,
            tokens=chunk,
            text=self.engine.detokenize(chunk),
            logprobs=run.out.logprobs_of(index, len(chunk)),
        )
        try:
            await self.nc.publish(
                names.token_subject(run.assignment.request.tenant, run.request_id), encode(msg)
            )
        except _BROKER_ERRORS:
            # Live tokens are best effort: the stored result carries every token.
            metrics.TOKEN_CHUNKS_LOST.labels(self.worker_id).inc()

    async def _on_finished(self, ev: Finished, now: float) -> None:
        run = self._running.pop(ev.request_id, None)
        if run is None:
            return
        await self._flush(run, now)
        req = run.assignment.request
        done = reports.completion(
            self.worker_id, req.request_id, run.attempt, ev, speed=self.settings.speed
        )
        result = reports.result(
            req,
            done,
            tokens=run.out.tokens,
            text=self.engine.detokenize(run.out.tokens),
            logprobs=run.out.logprobs,
            accepted_unix_s=run.accepted_unix_s,
            first_token_unix_s=run.out.first_token_s,
            finished_unix_s=now,
        )
        metrics.REQUESTS.labels(self.worker_id, "ok").inc()
        metrics.PROMPT_TOKENS.labels(self.worker_id).inc(ev.prompt_tokens)
        metrics.CACHED_TOKENS.labels(self.worker_id).inc(ev.cached_tokens)
        metrics.OUTPUT_TOKENS.labels(self.worker_id).inc(ev.output_tokens)
        self.completed += 1
        self._changed()
        self._report(Report(result, done))

    async def _on_failed(self, ev: Failed, now: float) -> None:
        """The engine lost a request (it died, hung, or answered garbage): the dispatcher runs
        it elsewhere as its next attempt; the client sees one result."""
        run = self._running.pop(ev.request_id, None)
        if run is None:
            return
        log.warning("engine failed %s on %s: %s", ev.request_id, self.worker_id, ev.error)
        self._finish_failed(run, ev.error)
        self._changed()

    def _finish_failed(self, run: _Running, error: str) -> None:
        metrics.REQUESTS.labels(self.worker_id, "failed").inc()
        self._report(
            Report(None, reports.failure(self.worker_id, run.request_id, run.attempt, error))
        )

    # ------------------------------------------------------------------ reporting

    def _report(self, report: Report) -> None:
        """Queue a finished request's report and start delivering it. The engine loop never
        waits for the broker; undelivered reports are retried with every heartbeat."""
        self._outbox.put(report)  # (again, for a report already there: the same one)
        metrics.OUTBOX.labels(self.worker_id).set(len(self._outbox))
        task = asyncio.create_task(self._deliver(report.completion.request_id))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _deliver(self, request_id: str) -> None:
        """Store the result in JetStream, *then* tell the dispatcher. The order matters: the
        dispatcher acks the request on the completion, so a completion must never get ahead
        of a result that is not stored yet (a broker outage would lose it)."""
        if request_id in self._delivering:
            return  # that delivery also takes a report put meanwhile (the loop below)
        self._delivering.add(request_id)
        try:
            while (report := self._outbox.get(request_id)) is not None:
                try:
                    await self._store_result(report)
                except _NEVER_STORED as exc:
                    # No retry stores it: its attempt fails, and the dispatcher decides.
                    log.error("the result of %s cannot be stored: %r", request_id, exc)
                    error = f"its result cannot be stored: {exc!r}"
                    attempt = report.completion.attempt
                    failed = reports.failure(self.worker_id, request_id, attempt, error)
                    if self._outbox.get(request_id) is report:  # (not over a newer attempt's)
                        self._outbox.put(Report(None, failed))
                    continue
                await self.nc.request(
                    names.completion_subject(self.worker_id),
                    encode(report.completion),
                    timeout=1.0,
                )
                self._outbox.done(report)
                metrics.OUTBOX.labels(self.worker_id).set(len(self._outbox))
                self._check_drained()
        except _BROKER_ERRORS:
            return  # broker or dispatcher unreachable: retried with the next heartbeat
        finally:
            self._delivering.discard(request_id)

    async def _store_result(self, report: Report) -> None:
        """Store a report's result in JetStream (once: then it is None)."""
        if report.result is None:
            return
        rid = report.completion.request_id
        await self.nc.jetstream().publish(
            names.result_subject(report.result.tenant, rid),
            encode(report.result),
            headers={names.MSG_ID_HEADER: rid},  # a retried publish is deduplicated
            timeout=2.0,
        )
        report.result = None

    async def _redeliver(self) -> None:
        for request_id in self._outbox:
            if not self._alive:
                return  # shutting down
            await self._deliver(request_id)

    # ------------------------------------------------------------------ heartbeat

    async def _heartbeat_loop(self) -> None:
        while self._alive:
            if await wait_event(self._hb_stop, self.settings.heartbeat_s):
                break
            await self._heartbeat_safely()
            self._retry_outbox()

    def _retry_outbox(self) -> None:
        """Retry the undelivered reports in the background, one after the other, one pass at
        a time. A delivery may wait out its timeouts (a results stream without a leader, a
        dispatcher cut off while it reconnects), and the heartbeats must not wait with it:
        they keep this worker's lease, and list the results it still holds (else the
        dispatcher runs those requests again elsewhere)."""
        if not len(self._outbox) or (self._retrying is not None and not self._retrying.done()):
            return
        self._retrying = asyncio.create_task(self._redeliver(), name=f"retry-{self.worker_id}")
        self._retrying.add_done_callback(self._retried)

    def _retried(self, task: asyncio.Task[None]) -> None:
        # Broker errors end in _deliver; anything else is a bug, and must not vanish with the
        # task (the next heartbeat starts another pass).
        if not task.cancelled() and (exc := task.exception()) is not None:
            internal_error(
                log, "agent.outbox", "retrying %s's outbox failed", self.worker_id, exc=exc
            )

    async def _heartbeat_safely(self, *, leaving: bool = False) -> None:
        try:
            await self._heartbeat(leaving=leaving)
        except _BROKER_ERRORS:
            log.debug("heartbeat of %s not sent: broker unreachable", self.worker_id)
        except Exception:  # a bug here would silently cost the lease: log and count it
            internal_error(log, "agent.heartbeat", "heartbeat of %s failed", self.worker_id)

    async def _heartbeat(self, *, leaving: bool = False) -> None:
        load = self.engine.load()
        metrics.KV_USAGE.labels(self.worker_id).set(load.kv_blocks_used / load.kv_blocks_total)
        metrics.ENGINE_WAITING.labels(self.worker_id).set(load.waiting)
        busy_s = load.busy_s / self.settings.speed
        metrics.ENGINE_BUSY.labels(self.worker_id).inc(max(0.0, busy_s - self._busy_counted_s))
        self._busy_counted_s = max(busy_s, self._busy_counted_s)
        for outcome, n in load.kv_events:  # cumulative counts: the counter takes what is new
            # Every outcome's series from the first heartbeat on, at 0: an alert on its
            # increase() missed the first incident of a series that appeared at 1.
            counter = metrics.ENGINE_KV_EVENTS.labels(self.worker_id, outcome)
            if n > (counted := self._kv_counted.get(outcome, 0)):
                counter.inc(n - counted)
                self._kv_counted[outcome] = n
        self._hb_seq += 1
        full = self._outbox.full
        hb = reports.heartbeat(
            worker_id=self.worker_id,
            models=self.settings.models,
            seq=self._hb_seq,
            sent_unix_ms=int(time.time() * 1000),
            capacity=0 if full or not self.engine.available else self.settings.capacity,
            # What it runs, and what ran here but is not stored yet: it still holds those.
            in_flight=[*self._running, *self._outbox.unstored()],
            load=reports.worker_load(load, self.settings.speed),
            draining=self._draining,
            leaving=leaving,
            cache=None if leaving else self._digests.next(self.engine),
            state=self.state,
            registration=self._registration,
        )
        await self.nc.publish(names.heartbeat_subject(self.worker_id), encode(hb))

"""The agent: takes assignments, drives the engine, streams tokens, reports back.

One asyncio task drives the simulated engine step by step on a clock that is ``speed`` times
faster than real time (it sleeps to an absolute target, so per-step timer overshoot does not
accumulate). Tokens are coalesced: a request's first token goes out at once, later ones every
``token_flush_ms`` or ``token_flush_tokens``. A finished request's result goes to JetStream
(deduplicated by request id), then its completion to the dispatcher, re-sent with every
heartbeat until the dispatcher confirms it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from sluice.agent.errors import AgentNotStarted
from sluice.agent.runtime import metrics
from sluice.agent.runtime.settings import AgentSettings
from sluice.common.aio import finish_tasks, wait_event
from sluice.common.transport import connect
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.hashing import prompt_hashes, prompt_length
from sluice.schemas.models import (
    Assignment,
    AssignmentReply,
    CacheDigest,
    Completion,
    Heartbeat,
    Result,
    Timings,
    TokenChunk,
    WorkerLoad,
)
from sluice.sim.engine import EngineError, Finished, SimEngine, TokensOut
from sluice.sim.profiles import get_profile
from sluice.sim.tokens import detokenize, output_token

log = logging.getLogger("sluice.agent")

Observer = Callable[[str, int], None]
"""Called with ``(worker_id, in_flight)`` whenever the agent's in-flight count changes."""


@dataclass
class _Running:
    assignment: Assignment
    accepted_unix_s: float
    tokens: list[int] = field(default_factory=list)
    sent: int = 0
    last_flush_s: float = 0.0
    first_token_unix_s: float | None = None

    @property
    def request_id(self) -> str:
        return self.assignment.request.request_id

    @property
    def attempt(self) -> int:
        return self.assignment.attempt


@dataclass
class _Report:
    """A finished request still to be reported: its result (None once stored, or for a
    failure) and its completion."""

    result: Result | None
    completion: Completion


class Agent:
    """One worker: a simulated engine behind the Sluice protocol.

    ``async with Agent(settings) as agent:`` starts it (connecting to ``settings.nats_url``
    unless a connection is passed in) and stops it cleanly (drain, then a *leaving*
    heartbeat). :meth:`kill` stops it abruptly, as a crash would, for fault tests.
    """

    def __init__(
        self, settings: AgentSettings, *, nc: NATS | None = None, observer: Observer | None = None
    ) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.engine = SimEngine(
            get_profile(settings.profile),
            digest_min_tokens=settings.digest_min_prefix_tokens,
            digest_stride=settings.digest_stride_blocks,
        )
        self._digest_seq = -1
        self._nc = nc
        self._own_nc = nc is None
        self._observer = observer
        self._running: dict[str, _Running] = {}
        self._outbox: dict[str, _Report] = {}
        self._delivering: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Subscription | None = None
        self._hb_seq = 0
        self._draining = False
        self._started = False
        self._alive = False
        self._hb_stop = asyncio.Event()
        self._sending: set[asyncio.Task[None]] = set()
        self.completed = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise AgentNotStarted("call start() first")
        return self._nc

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def start(self) -> Agent:
        if self._nc is None:
            self._nc = await connect(self.settings.nats_url, f"sluice-agent-{self.worker_id}")
        self._sub = await self.nc.subscribe(
            names.work_subject(self.worker_id), cb=self._on_assignment
        )
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

    async def stop(self, *, drain: bool = True) -> None:
        """Stop taking work, finish what is running (up to ``drain_timeout_s``), say goodbye."""
        if not self._started:
            return
        self._started = False
        self._draining = True
        with contextlib.suppress(Exception):
            await self._heartbeat()
        if drain:
            deadline = time.monotonic() + self.settings.drain_timeout_s
            while (self._running or self._outbox) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                if self._outbox:
                    await self._redeliver()
        with contextlib.suppress(Exception):
            await self._heartbeat(leaving=True)
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
        await finish_tasks(self._tasks, grace_s=2.0)
        self._tasks = []
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        if self._own_nc and self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None
        metrics.IN_FLIGHT.labels(self.worker_id).set(0)

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
        if rid in self._running:
            # A repeated hand-off (our earlier reply was lost): we already run it.
            self._running[rid].assignment = assignment
            await self._reply(msg, rid, True)
            return
        if rid in self._outbox:
            # Finished here already; its report is still on the way. Running it again would
            # only duplicate work: confirm, and let the pending report end the request.
            await self._reply(msg, rid, True)
            return
        reason = self._refusal(assignment)
        if reason:
            metrics.ASSIGNMENTS_REFUSED.labels(self.worker_id, reason.split(":")[0]).inc()
            await self._reply(msg, rid, False, reason)
            return
        bt = self.engine.profile.block_tokens
        n_prompt = prompt_length(req.prompt_tokens, req.prompt_text)
        hashes = prompt_hashes(req.prompt_tokens, req.prompt_text, bt)
        self._running[rid] = _Running(assignment, time.time())
        self._changed()
        await self._reply(msg, rid, True)
        try:
            self.engine.add(rid, n_prompt, req.max_tokens, hashes, time.monotonic())
        except EngineError as exc:
            await self._finish_failed(self._running.pop(rid), str(exc))
            self._changed()
            return
        self._wake.set()

    def _refusal(self, a: Assignment) -> str:
        if self._draining:
            return "draining"
        if len(self._running) >= self.settings.capacity:
            return f"full: {len(self._running)}/{self.settings.capacity} running"
        if a.request.model not in self.settings.models:
            return f"model: {a.request.model!r} is not served here"
        return ""

    async def _reply(self, msg: Msg, rid: str, accepted: bool, reason: str = "") -> None:
        if not msg.reply:
            return
        rid = rid if rid and rid != "invalid" else "invalid"
        with contextlib.suppress(Exception):
            await msg.respond(
                encode(AssignmentReply(request_id=rid, accepted=accepted, reason=reason))
            )

    def _changed(self) -> None:
        metrics.IN_FLIGHT.labels(self.worker_id).set(len(self._running))
        if self._observer is not None:
            self._observer(self.worker_id, len(self._running))

    # ------------------------------------------------------------------ engine

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        speed = self.settings.speed
        anchor_real = loop.time()
        sim_elapsed = 0.0
        while self._alive:
            if not self.engine.has_work:
                self._wake.clear()
                await self._flush_all()
                await self._wake.wait()
                if not self._alive:
                    break
                anchor_real, sim_elapsed = loop.time(), 0.0
            step = self.engine.step()
            if step.duration_s > 0:
                sim_elapsed += step.duration_s
                delay = anchor_real + sim_elapsed / speed - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)  # let the rest of the process run
            else:
                # Nothing could be admitted (KV full): wait for new work or a finish.
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.time()
            for ev in step.events:
                if isinstance(ev, TokensOut):
                    await self._on_tokens(ev, now)
                elif isinstance(ev, Finished):
                    await self._on_finished(ev, now)
            await self._flush_due(now)

    async def _on_tokens(self, ev: TokensOut, now: float) -> None:
        run = self._running.get(ev.request_id)
        if run is None:
            return
        start = len(run.tokens)
        run.tokens.extend(output_token(ev.request_id, start + i) for i in range(ev.count))
        if ev.first:
            run.first_token_unix_s = now
            submitted = run.assignment.request.submitted_unix_ms / 1000
            metrics.TTFT.labels(self.worker_id).observe(max(0.0, now - submitted))
            await self._flush(run, now)  # the first token goes out at once

    async def _flush_due(self, now: float) -> None:
        s = self.settings
        for run in self._running.values():
            pending = len(run.tokens) - run.sent
            if pending and (
                pending >= s.token_flush_tokens
                or (now - run.last_flush_s) * 1000 >= s.token_flush_ms
            ):
                await self._flush(run, now)

    async def _flush_all(self) -> None:
        now = time.time()
        for run in self._running.values():
            await self._flush(run, now)

    async def _flush(self, run: _Running, now: float) -> None:
        if run.sent >= len(run.tokens):
            return
        chunk = run.tokens[run.sent :]
        msg = TokenChunk(
            request_id=run.request_id,
            attempt=run.attempt,
            index=run.sent,
            tokens=chunk,
            text=detokenize(chunk),
        )
        run.sent = len(run.tokens)
        run.last_flush_s = now
        with contextlib.suppress(Exception):  # live tokens are best effort; the result is not
            await self.nc.publish(names.token_subject(run.request_id), encode(msg))

    async def _on_finished(self, ev: Finished, now: float) -> None:
        run = self._running.pop(ev.request_id, None)
        if run is None:
            return
        await self._flush(run, now)
        req = run.assignment.request
        submitted = req.submitted_unix_ms / 1000
        first = run.first_token_unix_s or now
        result = Result(
            request_id=req.request_id,
            ok=True,
            model=req.model,
            tenant=req.tenant,
            band=req.band,
            worker_id=self.worker_id,
            attempt=run.attempt,
            output_tokens=run.tokens,
            text=detokenize(run.tokens),
            prompt_tokens=ev.prompt_tokens,
            cached_tokens=ev.cached_tokens,
            timings=Timings(
                queued_s=max(0.0, run.accepted_unix_s - submitted),
                ttft_s=max(0.0, first - submitted),
                e2e_s=max(0.0, now - submitted),
                prefill_s=ev.prefill_s / self.settings.speed,
                decode_s=ev.decode_s / self.settings.speed,
            ),
        )
        metrics.REQUESTS.labels(self.worker_id, "ok").inc()
        metrics.PROMPT_TOKENS.labels(self.worker_id).inc(ev.prompt_tokens)
        metrics.CACHED_TOKENS.labels(self.worker_id).inc(ev.cached_tokens)
        metrics.OUTPUT_TOKENS.labels(self.worker_id).inc(ev.output_tokens)
        self.completed += 1
        completion = Completion(
            request_id=req.request_id,
            worker_id=self.worker_id,
            attempt=run.attempt,
            ok=True,
            prompt_tokens=ev.prompt_tokens,
            cached_tokens=ev.cached_tokens,
            output_tokens=ev.output_tokens,
            prefill_s=ev.prefill_s / self.settings.speed,
            decode_s=ev.decode_s / self.settings.speed,
        )
        self._changed()
        self._report(result, completion)

    async def _finish_failed(self, run: _Running, error: str) -> None:
        req = run.assignment.request
        metrics.REQUESTS.labels(self.worker_id, "failed").inc()
        completion = Completion(
            request_id=req.request_id,
            worker_id=self.worker_id,
            attempt=run.attempt,
            ok=False,
            prompt_tokens=0,
            cached_tokens=0,
            output_tokens=0,
            prefill_s=0.0,
            decode_s=0.0,
            error=error,
        )
        self._report(None, completion)

    # ------------------------------------------------------------------ reporting

    def _report(self, result: Result | None, completion: Completion) -> None:
        """Queue a finished request's report and start delivering it. The engine loop never
        waits for the broker; undelivered reports are retried with every heartbeat."""
        self._outbox[completion.request_id] = _Report(result, completion)
        task = asyncio.create_task(self._deliver(completion.request_id))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _deliver(self, request_id: str) -> None:
        """Store the result in JetStream, *then* tell the dispatcher. The order matters: the
        dispatcher acks the request on the completion, so a completion must never get ahead
        of a result that is not stored yet (a broker outage would lose it)."""
        report = self._outbox.get(request_id)
        if report is None or request_id in self._delivering:
            return
        self._delivering.add(request_id)
        try:
            if report.result is not None:
                await self.nc.jetstream().publish(
                    names.result_subject(report.result.tenant, request_id),
                    encode(report.result),
                    headers={"Nats-Msg-Id": request_id},  # a retried publish is deduplicated
                    timeout=2.0,
                )
                report.result = None
            await self.nc.request(
                names.completion_subject(self.worker_id), encode(report.completion), timeout=1.0
            )
            self._outbox.pop(request_id, None)
        except Exception:
            return  # broker or dispatcher unreachable: retried with the next heartbeat
        finally:
            self._delivering.discard(request_id)

    async def _redeliver(self) -> None:
        for request_id in list(self._outbox):
            await self._deliver(request_id)

    # ------------------------------------------------------------------ heartbeat

    async def _heartbeat_loop(self) -> None:
        while self._alive:
            if await wait_event(self._hb_stop, self.settings.heartbeat_s):
                break
            with contextlib.suppress(Exception):
                await self._heartbeat()
            await self._redeliver()

    def _digest(self) -> CacheDigest:
        """The next cache digest: a delta, or a snapshot every ``digest_snapshot_every``
        heartbeats and whenever a delta would exceed ``digest_max_blocks``. A digest lost in
        transit leaves a gap in ``seq``: dispatchers wait for the next snapshot."""
        s = self.settings
        cache = self.engine.cache
        self._digest_seq += 1
        stored, evicted = cache.drain_digest()
        seq = self._digest_seq
        bt = self.engine.profile.block_tokens * s.digest_stride_blocks
        if seq % s.digest_snapshot_every == 0 or len(stored) + len(evicted) > s.digest_max_blocks:
            blocks = cache.reported_blocks()[: s.digest_max_blocks]
            return CacheDigest(seq=seq, snapshot=True, block_tokens=bt, stored=blocks)
        return CacheDigest(seq=seq, block_tokens=bt, stored=stored, evicted=evicted)

    async def _heartbeat(self, *, leaving: bool = False) -> None:
        e = self.engine
        self._hb_seq += 1
        cache = e.cache
        metrics.KV_USAGE.labels(self.worker_id).set(cache.used_blocks / cache.capacity_blocks)
        hb = Heartbeat(
            worker_id=self.worker_id,
            models=list(self.settings.models),
            seq=self._hb_seq,
            sent_unix_ms=int(time.time() * 1000),
            capacity=0 if leaving else self.settings.capacity,
            in_flight=list(self._running),
            load=WorkerLoad(
                running=e.running,
                waiting=e.waiting,
                pending_prefill_tokens=e.pending_prefill_tokens(),
                active_decode_tokens=e.active_decode_tokens(),
                kv_blocks_used=cache.used_blocks,
                kv_blocks_total=cache.capacity_blocks,
                busy_s_total=e.busy_s / self.settings.speed,
            ),
            draining=self._draining,
            leaving=leaving,
            cache=None if leaving else self._digest(),
        )
        await self.nc.publish(names.heartbeat_subject(self.worker_id), encode(hb))

"""The hand-off loop: expire leases and deadlines, plan, reserve every decision and offer it to
its worker (request/reply on its work subject) without waiting for the answer; each answer
books its decision or withdraws it (back into the queue). A pass never waits for a worker."""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors

from sluice.common.aio import wait_event
from sluice.common.errors import internal_error
from sluice.dispatcher.decisions import decision_record
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import Answers
from sluice.dispatcher.runtime.cancels import stop_work
from sluice.dispatcher.runtime.gauges import Gauges
from sluice.dispatcher.runtime.state import BROKER_ERRORS, State
from sluice.dispatcher.runtime.workers import WorkerTraffic
from sluice.dispatcher.scheduler import Dispatch, Scheduler
from sluice.schemas import names
from sluice.schemas.codec import decode, encode, encode_nested
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import AssignmentHead, AssignmentReply, QueuedNotice

log = logging.getLogger("sluice.dispatcher")


class HandOff:
    """The scheduling loop."""

    def __init__(
        self, state: State, answers: Answers, workers: WorkerTraffic, gauges: Gauges
    ) -> None:
        self.state = state
        self.answers = answers
        self.workers = workers
        self.gauges = gauges

    async def loop(self) -> None:
        st = self.state
        while st.running:
            await wait_event(st.kick, st.settings.tick_s)
            st.kick.clear()
            try:
                await self.once()
            except Exception:  # the loop must go on: log and count it
                internal_error(log, "dispatcher.schedule", "scheduling pass failed")
                await asyncio.sleep(st.settings.tick_s)

    async def once(self) -> None:
        st = self.state
        now = time.monotonic()
        if st.cut_off or not st.nc.is_connected:
            return  # cut off: no heartbeats reach us, so no lease may expire; nothing to send
        for worker_id in st.leases.expired(now):
            metrics.LEASES_EXPIRED.inc()
            log.warning("worker %s lost its lease; re-queueing its requests", worker_id)
            await self.workers.expire_worker(worker_id)
        if not st.leadership.leading(now):
            self.gauges.update(now)
            return  # a standby only follows: it ends, answers and dispatches nothing
        for ended in st.scheduler.sweep(now):
            await self.answers.end(ended)
        # Once learned, a term stays open: the count of unbooked requests is only needed
        # before that (it walks every worker's report).
        learning = not st.leadership.may_dispatch(
            now, 0 if st.leadership.learned else unbooked(st.scheduler)
        )
        if not learning:  # while learning, only listen to heartbeats
            await self._dispatch(now)
        # The metrics after the hand-offs: they must not delay a request's start.
        self.gauges.update(now)
        await self._notify(now, learning)

    async def _dispatch(self, now: float) -> None:
        """Offer what the plan decides, without waiting for the answers: each decision is
        reserved (its request out of the queue, its room on the worker taken) and its offer
        runs on its own, so a slow worker's answer holds back neither the next plan nor the
        other offers; each answer books or withdraws its own decision (:meth:`_settle`)."""
        st = self.state
        sched = st.scheduler
        for d in sched.plan(now):
            if sched.reserve(d, now):
                st.spawn(self._settle(sched, d), "hand-off")

    async def _settle(self, sched: Scheduler, d: Dispatch) -> None:
        st = self.state
        ok = await self.offer(d)
        if sched is not st.scheduler:
            return  # the term ended meanwhile: the next leader adopts what the worker runs
        booked_s = time.monotonic()
        if ok:
            if not self._book(d, booked_s) and st.cancelled.has(d.request.request_id, booked_s):
                # Cancelled while its offer was in flight: the worker took it anyway.
                rid, w = d.request.request_id, d.worker_id
                st.spawn(stop_work(st, w, rid, d.request.attempt), "cancel-stop")
        else:
            metrics.HANDOFF_REFUSED.inc()
            sched.withdraw(d)
            st.kick.set()  # back in the queue: plan it again at once

    async def _notify(self, now: float, learning: bool) -> None:
        """Tell the producers of requests queued since the last pass, and still queued after
        it, that they wait: where, how long, and what holds them."""
        st = self.state
        pending, st.unnotified = st.unnotified, set()
        reasons = {} if learning else st.scheduler.hold_reasons(pending, now)
        waits: dict[tuple[str, str], float | None] = {}  # one figure per model and band
        for rid in pending:
            held = st.held.get(rid)
            position = st.scheduler.position(rid)
            if held is None or position is None:
                continue  # it started (or ended) in this pass
            key = (held.model, held.band)
            if key not in waits:
                waits[key] = self.gauges.wait_figures(*key, now).expected_wait_s
            notice = QueuedNotice(
                request_id=rid,
                position=position,
                expected_wait_s=waits[key],
                held_by="learning" if learning else reasons.get(rid, "queue"),
            )
            try:
                await st.nc.publish(names.token_subject(held.request.tenant, rid), encode(notice))
            except BROKER_ERRORS:
                log.debug("queued notice of %s not sent", rid)
            metrics.QUEUED_NOTICES.labels(notice.held_by).inc()

    def _book(self, d: Dispatch, booked_s: float) -> bool:
        st = self.state
        r = d.request
        booked = st.scheduler.confirm(d, booked_s)
        # The worker's heartbeat may have listed it first (adopted): still this decision.
        b = st.scheduler.booking(r.request_id)
        if not booked and (
            b is None or b.worker_id != d.worker_id or b.request.attempt != r.attempt
        ):
            return False
        metrics.ADMITTED.labels(r.model, r.band).inc()
        metrics.QUEUE_WAIT.labels(r.model, r.band).observe(max(0.0, booked_s - r.arrived_s))
        st.feedback.admitted(r.model, r.band, booked_s - r.arrived_s, booked_s)
        metrics.ROUTED.labels(d.choice.reason if d.choice else "").inc()
        if st.decisions is not None:
            st.decisions.write(decision_record(d, booked_s))
        return True

    async def offer(self, d: Dispatch) -> bool:
        """Offer a decision to its worker; True if it accepted."""
        st = self.state
        held = st.held.get(d.request.request_id)
        if held is None or not st.leading():
            return False
        head = AssignmentHead(
            attempt=d.request.attempt,
            dispatcher_id=st.settings.dispatcher_id,
            queued_s=max(0.0, time.time() - held.submitted_unix_ms / 1000),
            epoch=st.leadership.epoch,
        )
        t0 = time.perf_counter()
        try:
            reply = await st.nc.request(
                names.work_subject(d.worker_id),
                encode_nested(head, "request", held.msg.data),  # an Assignment
                timeout=st.settings.handoff_timeout_s,
            )
            answer = decode(reply.data, AssignmentReply)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return False
        except DecodeError:
            metrics.BAD_INPUT.labels("assignment-reply").inc()
            return False
        except BROKER_ERRORS:
            log.warning("hand-off of %s to %s failed", d.request.request_id, d.worker_id)
            return False
        metrics.HANDOFF.observe(time.perf_counter() - t0)
        return answer.accepted


def unbooked(scheduler: Scheduler) -> int:
    """Requests the workers' heartbeats report running that are not booked here."""
    return sum(
        1
        for info in scheduler.workers().values()
        for rid in info.reported_in_flight
        if scheduler.booking(rid) is None
    )

"""Worker traffic: heartbeats renew leases and feed the core (:mod:`sluice.dispatcher.feed`),
completions end or retry requests, and a worker that left or lost its lease is forgotten with
its requests queued again.

A worker whose lease expired is sent a :class:`~sluice.schemas.models.RemoveNotice`: it may
only have been silent (stopped, cut off) and come back. Until it has seen the notice, its
heartbeats (of the removed registration) are ignored and answered with the notice again;
once it has dropped what it ran, it heartbeats as a fresh registration and is taken back.
A known worker heartbeating a newer registration (it restarted within its lease) is
forgotten first: what its earlier registration ran is queued again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from nats.aio.msg import Msg

from sluice.dispatcher import feed
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import Answers, ack, respond
from sluice.dispatcher.runtime.cancels import stop_work
from sluice.dispatcher.runtime.intake import Intake
from sluice.dispatcher.runtime.state import BROKER_ERRORS, State
from sluice.dispatcher.scheduler import Booking, Ended
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import Completion, Heartbeat, RemoveNotice

log = logging.getLogger("sluice.dispatcher")


class WorkerTraffic:
    """Handles heartbeats and completions, and lost workers."""

    def __init__(self, state: State, answers: Answers, intake: Intake) -> None:
        self.state = state
        self.answers = answers
        self.intake = intake
        self._hit_tokens: Counter[str] = Counter()
        self._prompt_tokens: Counter[str] = Counter()
        self._stops: set[asyncio.Task[object]] = set()

    async def on_heartbeat(self, msg: Msg) -> None:
        st = self.state
        try:
            hb = decode(msg.data, Heartbeat)
        except DecodeError:
            metrics.BAD_INPUT.labels("heartbeat").inc()
            return
        standing = st.leases.standing(hb.worker_id, hb.registration)
        if standing == "stale":
            removed = st.leases.removed(hb.worker_id)
            if removed is not None and not hb.leaving:
                self._send_remove(hb.worker_id, removed)  # it missed the notice: again
            return
        if hb.leaving:
            if hb.worker_id in st.leases:
                await self.lose_worker(hb.worker_id)
            return
        if standing == "replaced":
            log.warning("worker %s registered afresh; re-queueing its requests", hb.worker_id)
            await self.lose_worker(hb.worker_id)
        now = time.monotonic()
        st.leases.renew(hb.worker_id, now, hb.registration)
        # Kept for `sluice workers`, without its digest: a snapshot lists up to
        # digest_max_blocks hashes, which the cache index holds already.
        st.heartbeats[hb.worker_id] = (
            hb if hb.cache is None else hb.model_copy(update={"cache": None})
        )
        effects = feed.apply_heartbeat(
            st.scheduler, hb, now, index_block_tokens=st.index_block_tokens
        )
        if effects.mismatch:
            metrics.BAD_INPUT.labels("digest").inc()
            log.warning("digest of worker %s ignored: %s", hb.worker_id, effects.mismatch)
        elif not effects.digest_ok:
            metrics.STALE_DIGESTS.inc()
        drift = st.scheduler.drift(hb.worker_id, now, grace_s=2 * st.settings.lease_s)
        metrics.DRIFT.labels(hb.worker_id).set(drift)
        st.kick.set()

    async def on_completion(self, msg: Msg) -> None:
        st = self.state
        try:
            c = decode(msg.data, Completion)
        except DecodeError:
            metrics.BAD_INPUT.labels("completion").inc()
            await respond(msg)
            return
        effects = feed.apply_completion(st.scheduler, c, time.monotonic())
        if not st.leading():
            # A standby learns from it but does not confirm it: the agent keeps it until the
            # leader (or the next one) does, so the leader acks the request's message.
            return
        if c.ok:
            if effects.request is not None:
                self._count_hits(c, effects.booking)
            other = effects.booking
            if other is not None and (other.worker_id, other.request.attempt) != (
                c.worker_id,
                c.attempt,
            ):
                # A worker that stalled past its lease finished first: its result stands
                # (stored before this report; the other copy's is deduplicated), and the copy
                # running elsewhere is stopped.
                self._stop_copy(other.worker_id, c.request_id, other.request.attempt)
            held = st.release_held(c.request_id)
            if held is not None:
                await ack(held.msg)  # the agent stored the result before it told us
                if effects.request is not None:
                    metrics.COMPLETED.labels(effects.request.band).inc()
        elif isinstance(effects.retry, Ended):
            await self.answers.end(effects.retry)
        elif effects.retry is not None:
            log.warning("worker %s failed %s (%s); retrying", c.worker_id, c.request_id, c.error)
        await respond(msg)
        st.kick.set()

    def _stop_copy(self, worker_id: str, rid: str, attempt: int) -> None:
        metrics.COPIES_STOPPED.inc()
        log.info("%s finished elsewhere first; stopping its copy on %s", rid, worker_id)
        task = asyncio.get_running_loop().create_task(
            stop_work(self.state, worker_id, rid, attempt), name=f"stop-copy-{rid}"
        )
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    def _count_hits(self, c: Completion, booking: Booking | None) -> None:
        w = c.worker_id
        self._prompt_tokens[w] += c.prompt_tokens
        self._hit_tokens[w] += c.cached_tokens
        metrics.WORKER_PROMPT_TOKENS.labels(w).inc(c.prompt_tokens)
        metrics.WORKER_CACHED_TOKENS.labels(w).inc(c.cached_tokens)
        metrics.WORKER_HIT_RATE.labels(w).set(self._hit_tokens[w] / max(1, self._prompt_tokens[w]))
        if booking is not None and booking.worker_id == w:
            metrics.HIT_ERROR.observe(c.cached_tokens - booking.expected_hit_tokens)

    def _forget_counts(self, worker_id: str) -> None:
        """Drop a lost worker's counters and metric series: a fleet whose workers come and go
        under new names would otherwise keep every name it ever saw."""
        self._prompt_tokens.pop(worker_id, None)
        self._hit_tokens.pop(worker_id, None)
        per_worker = (
            metrics.DRIFT,
            metrics.WORKER_PROMPT_TOKENS,
            metrics.WORKER_CACHED_TOKENS,
            metrics.WORKER_HIT_RATE,
        )
        for metric in per_worker:
            with contextlib.suppress(KeyError):  # it had no such series yet
                metric.remove(worker_id)

    async def expire_worker(self, worker_id: str) -> None:
        """The worker's lease expired: forget it, queue its requests again, and tell it (it
        may come back: then it registers afresh)."""
        registration = self.state.leases.remove(worker_id)
        await self.lose_worker(worker_id, left=False)
        self._send_remove(worker_id, registration)

    def _send_remove(self, worker_id: str, registration: int) -> None:
        if not self.state.leading():
            # Only the leader removes workers: a standby, or a deposed leader waking up from a
            # stall (to which every lease looks expired), must not make agents drop their work.
            return
        notice = RemoveNotice(
            dispatcher_id=self.state.settings.dispatcher_id, registration=registration
        )
        metrics.REMOVE_NOTICES.inc()
        self.state.spawn(self._publish(names.remove_subject(worker_id), encode(notice)), "remove")

    async def _publish(self, subject: str, data: bytes) -> None:
        try:
            await self.state.nc.publish(subject, data)
        except BROKER_ERRORS:
            log.debug("remove notice on %s not sent", subject)  # its next heartbeat resends it

    async def lose_worker(self, worker_id: str, *, left: bool = True) -> None:
        """The worker left (``left``) or lost its lease: queue its requests again elsewhere."""
        st = self.state
        if left:
            st.leases.drop(worker_id)
        st.heartbeats.pop(worker_id, None)
        requeued, ended = feed.remove_worker(st.scheduler, worker_id)
        self._forget_counts(worker_id)
        # The requeued first: they must leave the queue before anything awaits
        # (settle_requeued), or the hand-off loop may hand them out again meanwhile.
        await self.intake.settle_requeued(requeued)
        for e in ended:
            await self.answers.end(e)
        st.kick.set()

    async def on_disconnected(self) -> None:
        """The connection dropped: no heartbeat reaches us until the leases are renewed on
        reconnecting (nats-py reports the connection up a round trip before it says so)."""
        self.state.cut_off = True

    async def on_reconnected(self) -> None:
        log.warning("reconnected to NATS; renewing every worker's lease")
        self.state.leases.renew_all(time.monotonic())
        self.state.cut_off = False
        self.state.kick.set()

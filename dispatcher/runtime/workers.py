"""Worker traffic: heartbeats renew leases and feed the core (:mod:`sluice.dispatcher.feed`),
completions end or retry requests, and a worker that left or lost its lease is forgotten with
its requests queued again."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter

from nats.aio.msg import Msg

from sluice.dispatcher import feed
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import Answers, ack, respond
from sluice.dispatcher.runtime.intake import Intake
from sluice.dispatcher.runtime.state import State
from sluice.dispatcher.scheduler import Booking, Ended
from sluice.schemas.codec import decode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import Completion, Heartbeat

log = logging.getLogger("sluice.dispatcher")


class WorkerTraffic:
    """Handles heartbeats and completions, and lost workers."""

    def __init__(self, state: State, answers: Answers, intake: Intake) -> None:
        self.state = state
        self.answers = answers
        self.intake = intake
        self._hit_tokens: Counter[str] = Counter()
        self._prompt_tokens: Counter[str] = Counter()

    async def on_heartbeat(self, msg: Msg) -> None:
        st = self.state
        try:
            hb = decode(msg.data, Heartbeat)
        except DecodeError:
            metrics.BAD_INPUT.labels("heartbeat").inc()
            return
        if hb.leaving:
            if hb.worker_id in st.leases:
                await self.lose_worker(hb.worker_id)
            return
        now = time.monotonic()
        st.leases.renew(hb.worker_id, now)
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

    def _count_hits(self, c: Completion, booking: Booking | None) -> None:
        w = c.worker_id
        self._prompt_tokens[w] += c.prompt_tokens
        self._hit_tokens[w] += c.cached_tokens
        metrics.WORKER_PROMPT_TOKENS.labels(w).inc(c.prompt_tokens)
        metrics.WORKER_CACHED_TOKENS.labels(w).inc(c.cached_tokens)
        metrics.WORKER_HIT_RATE.labels(w).set(self._hit_tokens[w] / max(1, self._prompt_tokens[w]))
        if booking is not None and booking.worker_id == w:
            metrics.HIT_ERROR.observe(c.cached_tokens - booking.expected_hit_tokens)

    async def lose_worker(self, worker_id: str) -> None:
        """The worker left or lost its lease: queue its requests again elsewhere."""
        st = self.state
        st.leases.drop(worker_id)
        requeued, ended = feed.remove_worker(st.scheduler, worker_id)
        with contextlib.suppress(KeyError):  # it had no drift gauge yet
            metrics.DRIFT.remove(worker_id)
        for e in ended:
            await self.answers.end(e)
        for r in requeued:
            metrics.REQUEUED.inc()
            held = st.held.get(r.request_id)
            if held is not None and await self.intake.result_exists(r.tenant, r.request_id):
                # It finished but its completion was lost with the worker.
                st.scheduler.cancel(r.request_id)
                st.release_held(r.request_id)
                await ack(held.msg)
        st.kick.set()

    async def on_reconnected(self) -> None:
        log.warning("reconnected to NATS; renewing every worker's lease")
        self.state.leases.renew_all(time.monotonic())
        self.state.kick.set()

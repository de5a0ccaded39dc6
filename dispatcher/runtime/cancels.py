"""Cancels: a producer (``Client.cancel``) or an operator (``sluice cancel``) stops a request.

A queued request leaves the queue and never runs. A running one's quota returns at once; its
worker is told to stop it, and stores its result (``cancelled``, with the tokens produced so
far) before it answers. Either way the request's message is acked only once a result is
stored; if the worker does not answer, the dispatcher stores the cancelled result itself (the
result stream deduplicates by request id, so a result the worker stored first stands).

Every cancelled id is also kept as a tombstone (``State.cancelled``) for the broker's duplicate
window, so that a cancelled request never runs later: one this dispatcher has not pulled yet
(or whose cancelled result could not be stored, or whose message comes back) is answered
``cancelled`` when it arrives (:mod:`~sluice.dispatcher.runtime.intake`), and a worker that
accepts one whose hand-off was in flight is told to stop it
(:mod:`~sluice.dispatcher.runtime.handoff`). Each cancel runs in its own task.
"""

from __future__ import annotations

import logging
import time

import nats.errors
from nats.aio.msg import Msg

from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import Answers, ack, respond
from sluice.dispatcher.runtime.state import BROKER_ERRORS, State
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import (
    CancelReply,
    CancelRequest,
    Rejection,
    RejectReason,
    StopWork,
    StopWorkReply,
)

log = logging.getLogger("sluice.dispatcher")

STOP_TIMEOUT_S = 4.0
"""How long a worker has to stop a request and store its result (its own store timeout is
2 s)."""


class Cancels:
    """Answers ``sluice.cancel.<tenant>``."""

    def __init__(self, state: State, answers: Answers) -> None:
        self.state = state
        self.answers = answers

    async def on_cancel(self, msg: Msg) -> None:
        if not self.state.leading():
            return  # only the leader answers: it holds the queue and the books
        # One task per cancel: a worker slow to stop must not hold up the others.
        self.state.spawn(self._handle(msg), "cancel")

    async def _handle(self, msg: Msg) -> None:
        try:
            q = decode(msg.data, CancelRequest)
        except DecodeError as exc:
            metrics.BAD_INPUT.labels("cancel").inc()
            bad = CancelReply(request_id="invalid", status="unknown", message=str(exc))
            await respond(msg, encode(bad))
            return
        try:
            tenant = names.parse_cancel_subject(msg.subject)
        except ValueError:
            tenant = None
        if tenant != q.tenant:  # the subject is what the broker's permissions checked
            metrics.BAD_INPUT.labels("cancel").inc()
            wrong = CancelReply(
                request_id=q.request_id,
                status="unknown",
                message=f"a cancel of tenant {q.tenant!r} must be sent to its own subject "
                f"{names.cancel_subject(q.tenant)}",
            )
            await respond(msg, encode(wrong))
            return
        reply = await self.cancel(q)
        metrics.CANCELS.labels(reply.status).inc()
        await respond(msg, encode(reply))

    async def cancel(self, q: CancelRequest) -> CancelReply:
        st = self.state
        rid = q.request_id
        held = st.held.get(rid)
        if held is None or held.tenant != q.tenant:
            return await self._not_held(q)
        st.cancelled.add(rid, time.monotonic())
        sched = st.scheduler
        if sched.cancel(rid) is not None:  # queued: it never runs (a worker that accepts an
            # offer of it still in flight is told to stop it: HandOff)
            await self.answer(rid, "cancelled while queued")
            return CancelReply(request_id=rid, status="cancelled", message="it was queued")
        booking = sched.stop_running(rid)
        if booking is None:  # held but neither queued nor booked: it is ending right now
            return CancelReply(request_id=rid, status="finished", message="it was ending")
        st.kick.set()  # its quota is free again
        answer = await stop_work(st, booking.worker_id, rid, booking.request.attempt)
        if answer is not None and answer.stopped:
            # The worker stored the cancelled result (with its tokens) before answering.
            released = st.release_held(rid)
            if released is not None:
                await ack(released.msg)
            return CancelReply(
                request_id=rid,
                status="cancelled",
                message=f"stopped on {booking.worker_id} after {answer.output_tokens} tokens",
            )
        if await self.answers.result_exists(q.tenant, rid):
            released = st.release_held(rid)  # it finished before the stop reached it
            if released is not None:
                await ack(released.msg)
            return CancelReply(request_id=rid, status="finished", message="it had finished")
        why = "did not confirm the stop" if answer is None else "no longer ran it"
        if not await self.answer(rid, f"cancelled; worker {booking.worker_id} {why}"):
            return CancelReply(request_id=rid, status="finished", message="it had finished")
        return CancelReply(request_id=rid, status="cancelled", message=f"its worker {why}")

    async def answer(self, rid: str, message: str) -> bool:
        """Store the cancelled result of a held request, then ack its message. False if it is
        no longer held (it ended meanwhile). A result that cannot be stored leaves the message
        un-acked: it comes back, and the tombstone answers it then."""
        held = self.state.release_held(rid)
        if held is None:
            return False
        rejection = Rejection(reason=RejectReason.CANCELLED, message=message)
        if await self.answers.publish_result_of(held, rejection):
            await ack(held.msg)
        return True

    async def _not_held(self, q: CancelRequest) -> CancelReply:
        if await self.answers.result_exists(q.tenant, q.request_id):
            return CancelReply(
                request_id=q.request_id, status="finished", message="its result is stored"
            )
        # Not pulled yet (a long queue), or never submitted: if it arrives, it is answered
        # cancelled and never runs.
        self.state.cancelled.add(q.request_id, time.monotonic())
        return CancelReply(
            request_id=q.request_id,
            status="unknown",
            message=(
                f"no request {q.request_id!r} of tenant {q.tenant!r} is queued or running here; "
                "if it arrives later it is cancelled, not run"
            ),
        )


async def stop_work(state: State, worker_id: str, rid: str, attempt: int) -> StopWorkReply | None:
    """Ask a worker to stop a request; None if it did not answer."""
    stop = StopWork(request_id=rid, attempt=attempt)
    try:
        raw = await state.nc.request(
            names.control_subject(worker_id), encode(stop), timeout=STOP_TIMEOUT_S
        )
        return decode(raw.data, StopWorkReply)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, DecodeError):
        return None
    except BROKER_ERRORS:
        log.warning("could not ask %s to stop %s", worker_id, rid)
        return None

"""Cancels: a producer (``Client.cancel``) or an operator (``sluice cancel``) stops a request.

A queued request leaves the queue and never runs. A running one's quota returns at once; its
worker is told to stop it, and stores its result (``cancelled``, with the tokens produced so
far) before it answers. Either way the request's message is acked only once a result is
stored; if the worker does not answer, the dispatcher stores the cancelled result itself (the
result stream deduplicates by request id, so a result the worker stored first stands).
"""

from __future__ import annotations

import logging

import nats.errors
from nats.aio.msg import Msg

from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import Answers, ack, respond
from sluice.dispatcher.runtime.intake import Intake
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

_STOP_TIMEOUT_S = 2.0


class Cancels:
    """Answers ``sluice.cancel``."""

    def __init__(self, state: State, answers: Answers, intake: Intake) -> None:
        self.state = state
        self.answers = answers
        self.intake = intake

    async def on_cancel(self, msg: Msg) -> None:
        try:
            q = decode(msg.data, CancelRequest)
        except DecodeError as exc:
            metrics.BAD_INPUT.labels("cancel").inc()
            await respond(
                msg, encode(CancelReply(request_id="invalid", status="unknown", message=str(exc)))
            )
            return
        reply = await self.cancel(q)
        metrics.CANCELS.labels(reply.status).inc()
        await respond(msg, encode(reply))

    async def cancel(self, q: CancelRequest) -> CancelReply:
        st = self.state
        rid = q.request_id
        held = st.held.get(rid)
        if held is None or held.request.tenant != q.tenant:
            return await self._not_held(q)
        sched = st.scheduler
        if sched.cancel(rid) is not None:  # queued: it never runs
            await self._answer(rid, "cancelled while queued")
            return CancelReply(request_id=rid, status="cancelled", message="it was queued")
        booking = sched.stop_running(rid)
        if booking is None:  # held but neither queued nor booked: it is ending right now
            return CancelReply(request_id=rid, status="finished", message="it was ending")
        st.kick.set()  # its quota is free again
        stop = StopWork(request_id=rid, attempt=booking.request.attempt)
        try:
            raw = await st.nc.request(
                names.control_subject(booking.worker_id), encode(stop), timeout=_STOP_TIMEOUT_S
            )
            answer = decode(raw.data, StopWorkReply)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, DecodeError):
            answer = None
        except BROKER_ERRORS:
            log.warning("could not ask %s to stop %s", booking.worker_id, rid)
            answer = None
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
        if answer is not None and await self.intake.result_exists(q.tenant, rid):
            released = st.release_held(rid)  # it finished before the stop reached it
            if released is not None:
                await ack(released.msg)
            return CancelReply(request_id=rid, status="finished", message="it had finished")
        await self._answer(rid, f"cancelled; worker {booking.worker_id} did not confirm the stop")
        return CancelReply(request_id=rid, status="cancelled", message="its worker did not answer")

    async def _answer(self, rid: str, message: str) -> None:
        """Store the cancelled result of a held request, then ack its message."""
        held = self.state.release_held(rid)
        if held is None:
            return
        rejection = Rejection(reason=RejectReason.CANCELLED, message=message)
        if await self.answers.publish_rejection(held.request, rejection):
            await ack(held.msg)

    async def _not_held(self, q: CancelRequest) -> CancelReply:
        if await self.intake.result_exists(q.tenant, q.request_id):
            return CancelReply(
                request_id=q.request_id, status="finished", message="its result is stored"
            )
        return CancelReply(
            request_id=q.request_id,
            status="unknown",
            message=f"no request {q.request_id!r} of tenant {q.tenant!r} is queued or running",
        )

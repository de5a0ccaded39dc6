"""Answers and dead letters: every request that ends without running gets a typed answer on
its result subject, and input that cannot be answered there is kept as a dead letter. A
request message is acked only after its answer or its dead letter was stored; if neither can
be stored it stays un-acked, is delivered again, and after ``max_deliver`` deliveries reaches
:meth:`Answers.on_max_deliveries`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Protocol

from nats.aio.msg import Msg

from sluice.common.errors import internal_error
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.state import BROKER_ERRORS, State
from sluice.dispatcher.scheduler import Ended
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import DeadLetter, Rejection, RejectReason, Result, SubmitRequest

log = logging.getLogger("sluice.dispatcher")

_REQUEST_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")
_PUBLISH_ATTEMPTS = 3
_PUBLISH_TIMEOUT_S = 1.0
"""An answer not stored within this is retried; a request whose answer is not stored stays
un-acked and is delivered again (bounded: at most ~4 s on the intake path)."""


async def ack(msg: Msg) -> None:
    """Ack a request message. A lost ack only means a redelivery, which the dispatcher
    recognises (the request is held, or its result exists)."""
    try:
        await msg.ack()
    except BROKER_ERRORS:
        metrics.ACK_FAILURES.inc()


async def respond(msg: Msg, data: bytes = b"") -> None:
    """Answer a core-NATS request (a lost answer makes the requester retry)."""
    if not msg.reply:
        return
    try:
        await msg.respond(data)
    except BROKER_ERRORS:
        log.debug("could not respond on %s", msg.reply)


class Named(Protocol):
    """What an answer names of its request (a decoded request, or a held one)."""

    @property
    def request_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def band(self) -> str: ...


class Answers:
    """Publishes results of requests that did not run, and dead letters."""

    def __init__(self, state: State) -> None:
        self.state = state
        self._unserved_advisories: deque[tuple[str, int, int]] = deque(
            maxlen=state.settings.max_kept_advisories
        )
        """Max-deliveries advisories a standby received, for when it leads (bounded)."""

    async def publish_result(self, result: Result) -> bool:
        """Store a result (deduplicated by request id); False if the broker did not take it."""
        subject = names.result_subject(result.tenant, result.request_id)
        for attempt in range(_PUBLISH_ATTEMPTS):
            try:
                await self.state.js.publish(
                    subject,
                    encode(result),
                    headers={names.MSG_ID_HEADER: result.request_id},
                    timeout=_PUBLISH_TIMEOUT_S,
                )
                return True
            except BROKER_ERRORS:
                if attempt + 1 < _PUBLISH_ATTEMPTS:
                    await asyncio.sleep(0.2 * (attempt + 1))
        log.error("could not publish the result of %s", result.request_id)
        metrics.ANSWER_FAILURES.inc()
        return False

    async def publish_rejection(self, req: Named, rejection: Rejection) -> bool:
        """Store the typed rejection of a request, counted as one (metrics and feedback)."""
        st = self.state
        known = st.scheduler.known_model(req.model) and req.band in st.scheduler.config.bands
        # Label values stay bounded: an unknown model or band is counted under "".
        model, band = (req.model, req.band) if known else ("", "")
        metrics.REJECTED.labels(model, band, rejection.reason.value).inc()
        self.state.feedback.rejected(req.model, req.band, time.monotonic())
        return await self.publish_result_of(req, rejection)

    async def publish_result_of(self, req: Named, rejection: Rejection) -> bool:
        """Store a request's not-ok result (a rejection, or a cancel, which is not counted as
        a rejection)."""
        return await self.publish_result(
            Result(
                request_id=req.request_id,
                ok=False,
                model=req.model,
                tenant=req.tenant,
                band=req.band,
                rejection=rejection,
            )
        )

    async def dead_letter(self, letter: DeadLetter) -> bool:
        try:
            await self.state.js.publish(
                names.dead_letter_subject(letter.reason.value),
                encode(letter),
                timeout=_PUBLISH_TIMEOUT_S,
            )
        except BROKER_ERRORS:
            log.error("could not store a dead letter (%s)", letter.reason.value)
            metrics.ANSWER_FAILURES.inc()
            return False
        return True

    async def reject_raw(
        self, msg: Msg, tenant: str, request_id: str, reason: RejectReason, message: str
    ) -> None:
        """Answer input that is not a valid request: on its result subject when it names a
        usable request id, else into the dead-letter stream. Then ack it (it will never run);
        if the answer could not be stored, leave it for redelivery."""
        metrics.REJECTED.labels("", "", reason.value).inc()
        if request_id and len(request_id) <= 128 and set(request_id) <= _REQUEST_ID_CHARS:
            stored = await self.publish_result(
                Result(
                    request_id=request_id,
                    ok=False,
                    tenant=tenant,
                    rejection=Rejection(reason=reason, message=message),
                )
            )
        else:
            stored = await self.dead_letter(
                DeadLetter(
                    reason=reason,
                    message=message,
                    subject=msg.subject,
                    payload=msg.data,
                    received_unix_ms=int(time.time() * 1000),
                )
            )
        if stored:
            await ack(msg)

    async def end(self, ended: Ended) -> None:
        """A held request ends without running: answer its producer, then ack it."""
        held = self.state.release_held(ended.request.request_id)
        if held is None:
            return
        if await self.publish_rejection(held, ended.rejection):
            await ack(held.msg)
        # Not stored: un-acked, it comes back after ack_wait and is rejected again.

    async def on_max_deliveries(self, msg: Msg) -> None:
        """A request exhausted ``max_deliver``: the broker will not deliver it again, but it
        still sits in its work-queue stream. Keep a dead letter, remove it from the queue,
        then answer its producer. The leader does; a standby keeps it for when it leads (the
        broker sends an advisory once: one that reaches no leader, during a takeover, would
        leave its request unanswered)."""
        try:
            advisory = json.loads(msg.data)
            stream, seq = str(advisory["stream"]), int(advisory["stream_seq"])
            deliveries = int(advisory.get("deliveries", 0))
        except (ValueError, KeyError, TypeError):
            internal_error(log, "dispatcher.advisory", "malformed max-deliveries advisory")
            return
        if not self.state.leading():
            self._unserved_advisories.append((stream, seq, deliveries))
            return
        await self._dead_letter_undeliverable(stream, seq, deliveries)

    async def serve_kept_advisories(self) -> None:
        """Dead-letter what exhausted ``max_deliver`` while this dispatcher stood by (it leads
        now)."""
        while self._unserved_advisories:
            await self._dead_letter_undeliverable(*self._unserved_advisories.popleft())

    async def _dead_letter_undeliverable(self, stream: str, seq: int, deliveries: int) -> None:
        try:
            raw = await self.state.js.get_msg(stream, seq=seq)
        except BROKER_ERRORS:
            log.warning(
                "request at %s #%d is gone or unreachable; nothing to dead-letter", stream, seq
            )
            return
        message = f"delivered {deliveries} times without finishing; moved to the dead-letter stream"
        data = raw.data or b""
        if self.state.held.get(_request_id_of(data)) is not None:
            return  # we hold it now (a delivery raced the advisory): it is being served
        letter = DeadLetter(
            reason=RejectReason.UNDELIVERABLE,
            message=message,
            subject=raw.subject or "",
            payload=data,
            received_unix_ms=int(time.time() * 1000),
        )
        if not await self.dead_letter(letter):
            return
        try:
            await self.state.js.delete_msg(stream, seq)
        except BROKER_ERRORS:
            log.error("dead-lettered %s #%d but could not remove it from its queue", stream, seq)
            return
        log.warning("request at %s #%d was undeliverable; dead-lettered", stream, seq)
        try:
            req = decode(data, SubmitRequest)
        except DecodeError:
            return  # no producer to answer: the dead letter keeps the bytes
        await self.publish_rejection(
            req, Rejection(reason=RejectReason.UNDELIVERABLE, message=message)
        )


def _request_id_of(data: bytes) -> str:
    try:
        return decode(data, SubmitRequest).request_id
    except DecodeError:
        return ""

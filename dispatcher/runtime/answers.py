"""Answers and dead letters: every request that ends without running gets a typed answer on
its result subject, and input that cannot be answered there is kept as a dead letter. A
request message is acked only after its answer or its dead letter was stored; if neither can
be stored it stays un-acked, is delivered again, and after ``max_deliver`` deliveries reaches
:meth:`Answers.on_max_deliveries` (through the stored advisory, :meth:`Answers.advisory_loop`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

import nats.errors
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from sluice.common.errors import internal_error
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.renewals import Renewals
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
_ADVISORY_BATCH = 16
"""Most max-deliveries advisories one pull takes."""

NOT_LEADING_WAIT_S = 0.02
"""How often a pull loop looks again whether its lease was renewed, while it is not."""


async def ack(msg: Msg) -> None:
    """Ack a request message. A lost ack only means a redelivery, which the dispatcher
    recognises (the request is held, or its result exists)."""
    try:
        await msg.ack()
    except BROKER_ERRORS:
        metrics.ACK_FAILURES.inc()


async def give_back(msgs: Sequence[Msg]) -> None:
    """Send fetched messages back for redelivery now (a nak), untouched."""
    for msg in msgs:
        try:
            await msg.nak()
        except BROKER_ERRORS:
            log.debug("nak not sent; the message comes back after ack_wait")


async def term_batches(
    st: State,
    psub: JetStreamContext.PullSubscription,
    term: int,
    batch: int | Callable[[], Awaitable[int]],
    what: str,
) -> AsyncIterator[list[Msg]]:
    """Batches fetched from ``psub`` for one leadership term: none while the lease has run
    out locally (its renewal late), and it ends with the term. A failed fetch is retried.
    ``batch``: how many messages a fetch asks for, or a call that waits until some may be
    taken and says how many (0: look again)."""
    while st.running and st.term == term:
        if not st.leading():
            # The lease ran out locally, its renewal late: take nothing until it is renewed
            # (the term goes on) or lost (the term ends, and so does this loop).
            await asyncio.sleep(NOT_LEADING_WAIT_S)
            continue
        n = batch if isinstance(batch, int) else await batch()
        if n <= 0:
            await asyncio.sleep(0)  # (never a busy loop, whatever the call did)
            continue
        try:
            msgs = await psub.fetch(batch=n, timeout=st.settings.fetch_timeout_s)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
            await asyncio.sleep(0.2)
            continue
        except BROKER_ERRORS:
            log.warning("fetching %s failed; retrying", what, exc_info=True)
            await asyncio.sleep(0.5)
            continue
        yield msgs


async def term_messages(st: State, msgs: Sequence[Msg], term: int) -> AsyncIterator[Msg]:
    """The messages of a fetched batch while the term lasts (deposed: the next leader gets
    the rest redelivered) and the lease has not run out (the rest is given back, for this
    leader once renewed, or the next)."""
    for i, msg in enumerate(msgs):
        if st.term != term:
            return
        if not st.leading():
            await give_back(msgs[i:])
            return
        yield msg


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

    def __init__(self, state: State, renewals: Renewals) -> None:
        self.state = state
        self.renewals = renewals

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

    async def dead_letter(self, letter: DeadLetter, msg_id: str | None = None) -> bool:
        """Store a dead letter (once per ``msg_id`` within the duplicate window, if given);
        False if the broker did not take it."""
        try:
            await self.state.js.publish(
                names.dead_letter_subject(letter.reason.value),
                encode(letter),
                headers=None if msg_id is None else {names.MSG_ID_HEADER: msg_id},
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

    async def result_exists(self, tenant: str, request_id: str) -> bool:
        """Whether a result of ``request_id`` is stored (unsure counts as no: running it again
        is safe, the client deduplicates results)."""
        return bool(await self.result_known(tenant, request_id))

    async def result_known(self, tenant: str, request_id: str) -> bool | None:
        """Whether a result of ``request_id`` is stored; None if the lookup failed (the
        broker away, or the result stream electing a leader)."""
        looked, raw = await self._lookup(tenant, request_id)
        return raw is not None if looked else None

    async def _stored_result(self, tenant: str, request_id: str) -> bytes | None:
        """The stored result of ``request_id``, encoded; None if there is none or the lookup
        failed."""
        return (await self._lookup(tenant, request_id))[1]

    async def _lookup(self, tenant: str, request_id: str) -> tuple[bool, bytes | None]:
        """Whether the lookup of ``request_id``'s result worked, and the result (encoded)."""
        try:
            raw = await self.state.js.get_last_msg(
                names.RESULT_STREAM, names.result_subject(tenant, request_id), direct=True
            )
        except NotFoundError:
            return True, None
        except BROKER_ERRORS:
            log.debug("could not look up the result of %s", request_id)
            return False, None
        return True, raw.data or b""

    async def advisory_loop(self, psub: JetStreamContext.PullSubscription, term: int) -> None:
        """Serve the stored max-deliveries advisories for one leadership term (see
        :func:`~sluice.dispatcher.runtime.streams.advisory_stream`): what exhausted its
        deliveries while no dispatcher led comes first. An advisory is acked once its
        request is answered; one not served (the broker failed, or this leader died) comes
        back after ``ack_wait``, to whoever leads then."""
        st = self.state
        what = "max-deliveries advisories"
        async for msgs in term_batches(st, psub, term, _ADVISORY_BATCH, what):
            async for msg in term_messages(st, msgs, term):
                try:
                    served = await self.on_max_deliveries(msg)
                except Exception:
                    # A bug here must not stop the other advisories: logged and counted, and
                    # not acked, so it comes back after ack_wait (its request unanswered yet).
                    internal_error(log, "dispatcher.advisory", "serving an advisory failed")
                    continue
                if served:
                    await ack(msg)

    async def on_max_deliveries(self, msg: Msg) -> bool:
        """A request exhausted ``max_deliver``: the broker will not deliver it again, but it
        still sits in its work-queue stream. Answer its producer, keep a dead letter, then
        remove it from the queue. Each step is idempotent (the result and the dead letter
        are deduplicated by id, and a request gone from its queue was served), so that a
        leader dying midway leaves the advisory to the next one. True once served: the
        advisory may be acked (a malformed one too: it can never be served)."""
        try:
            advisory = json.loads(msg.data)
            stream, seq = str(advisory["stream"]), int(advisory["stream_seq"])
            deliveries = int(advisory.get("deliveries", 0))
        except (ValueError, KeyError, TypeError):
            internal_error(log, "dispatcher.advisory", "malformed max-deliveries advisory")
            return True
        return await self._dead_letter_undeliverable(stream, seq, deliveries)

    async def _dead_letter_undeliverable(self, stream: str, seq: int, deliveries: int) -> bool:
        try:
            raw = await self.state.js.get_msg(stream, seq=seq)
        except NotFoundError:
            return True  # removed already: answered, by this leader or one before it
        except BROKER_ERRORS:
            log.warning("request at %s #%d is unreachable; retried later", stream, seq)
            return False
        data = raw.data or b""
        try:
            req: SubmitRequest | None = decode(data, SubmitRequest)
        except DecodeError:
            req = None  # no producer to answer: the dead letter keeps the bytes
        held = None if req is None else self.state.held.get(req.request_id)
        if held is not None and held.msg.metadata.stream == stream and held.stream_seq == seq:
            return True  # we hold it now (a delivery raced the advisory): it is being served
        if req is not None:
            # Another message of it lives (held here: a renewed copy, or the same id submitted
            # twice; or a renewed copy stored): this one only leaves its queue.
            lives = held is not None or await self.renewals.newer_copy(
                req.band, req.model, req.tenant, req.request_id, stream, seq
            )
            if lives is None:
                log.warning("whether %s was renewed is unknown; retried later", req.request_id)
                return False
            if lives:
                return await self._remove(stream, seq, "superseded by another of its messages")
        stored = None if req is None else await self._stored_result(req.tenant, req.request_id)
        if stored is not None and not _undeliverable(stored):
            # It ran, or ended otherwise (its result was stored while no dispatcher acked it):
            # a rejection now would replace that result, so it only leaves its queue.
            return await self._remove(stream, seq, "already answered; removed from its queue")
        message = f"delivered {deliveries} times without finishing; moved to the dead-letter stream"
        if req is not None and stored is None:  # else answered so by a leader that died since
            rejection = Rejection(reason=RejectReason.UNDELIVERABLE, message=message)
            if not await self.publish_rejection(req, rejection):
                return False
        letter = DeadLetter(
            reason=RejectReason.UNDELIVERABLE,
            message=message,
            subject=raw.subject or "",
            payload=data,
            received_unix_ms=int(time.time() * 1000),
        )
        if not await self.dead_letter(letter, msg_id=f"{stream}:{seq}"):
            return False
        return await self._remove(stream, seq, "undeliverable; dead-lettered")

    async def _remove(self, stream: str, seq: int, why: str) -> bool:
        """Delete an exhausted request from its queue (gone already counts as done)."""
        try:
            await self.state.js.delete_msg(stream, seq)
        except NotFoundError:
            pass
        except BROKER_ERRORS:
            log.error("could not remove request %s #%d from its queue (%s)", stream, seq, why)
            return False
        log.warning("request at %s #%d was %s", stream, seq, why)
        return True


def _undeliverable(result: bytes) -> bool:
    """Whether a stored result is an ``undeliverable`` rejection (an advisory's answer)."""
    try:
        rejection = decode(result, Result).rejection
    except DecodeError:
        return False
    return rejection is not None and rejection.reason is RejectReason.UNDELIVERABLE

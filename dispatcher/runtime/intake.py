"""Intake: one long-poll pull task per band feeds the scheduler. A request's message stays
un-acked (held) until the request ends; a redelivered one whose result exists already is
acked at once; invalid input is answered (:mod:`sluice.dispatcher.runtime.answers`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import nats.errors
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from sluice.common.errors import internal_error
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import (
    NOT_LEADING_WAIT_S,
    Answers,
    ack,
    give_back,
    term_batches,
    term_messages,
)
from sluice.dispatcher.runtime.renewals import Renewals, arrived_unix_ms, generation
from sluice.dispatcher.runtime.state import BROKER_ERRORS, Held, State
from sluice.dispatcher.scheduler import Request
from sluice.schemas import names
from sluice.schemas.codec import decode
from sluice.schemas.errors import DecodeError
from sluice.schemas.hashing import prompt_hashes, prompt_length, session_key
from sluice.schemas.models import Rejection, RejectReason, SubmitRequest

log = logging.getLogger("sluice.dispatcher")


class Intake:
    """Pulls requests from the band streams into the scheduler."""

    def __init__(self, state: State, answers: Answers, renewals: Renewals) -> None:
        self.state = state
        self.answers = answers
        self.renewals = renewals

    async def pull_loop(
        self, band: str, psub: JetStreamContext.PullSubscription, term: int
    ) -> None:
        """Pull ``band`` for one leadership term: it ends as soon as the term does, and
        leaves what it fetched after that untouched (the next leader gets it redelivered).
        Nothing else ends it (a band that stopped being pulled would hold its requests,
        unanswered, for as long as this dispatcher leads): while the lease has run out
        locally, with its renewal late, it takes nothing in and gives back what it fetched;
        an error no branch expects is logged and counted, and the band pulled again."""
        st = self.state
        backlog = True  # a new term starts with what its predecessor left: take it in batches
        while st.running and st.term == term:
            try:
                more = await self._pull_once(band, psub, term, backlog)
            except Exception:
                internal_error(log, "dispatcher.intake", "pulling band %s failed", band)
                await asyncio.sleep(_PULL_RETRY_S)
                continue
            if more is None:
                return
            backlog = more

    async def renewed_loop(self, psub: JetStreamContext.PullSubscription, term: int) -> None:
        """Pull the renewed copies (:mod:`~sluice.dispatcher.runtime.renewals`) for one
        leadership term: each is held instead of its request's older message (or as its
        request's message, by a leader that had none). Only while the bands' buffers have
        room in all (:meth:`State.room_left`): a copy replaces a message its predecessor
        held, and each leader pulls as many of its bands' messages besides, so copies taken
        without room would pile up from one leader to the next. While the buffers are full a
        copy of a request held here waits in the broker: it is held at the next leader
        change, and its deliveries are whole meanwhile."""
        st = self.state
        async for msgs in term_batches(st, psub, term, self._copies_room, "renewed requests"):
            known = await self._results_of_redeliveries(msgs)
            async for msg in term_messages(st, msgs, term):
                try:
                    await self.on_request(_subject_parts(msg.subject, "")[0], msg, known)
                except Exception:
                    internal_error(log, "dispatcher.intake", "a renewed request failed")
            st.kick.set()

    async def _copies_room(self) -> int:
        """How many renewed copies the next pull asks for: the room left in all the bands'
        buffers, waited for while there is none (0 when woken: the caller looks again)."""
        st = self.state
        free = st.room_left()
        if free <= 0:
            st.any_room.clear()
            await st.any_room.wait()
            return 0
        return min(free, PULL_BATCH)

    async def _pull_once(
        self, band: str, psub: JetStreamContext.PullSubscription, term: int, backlog: bool
    ) -> bool | None:
        """One fetch and what it brought in: whether a backlog is likely behind it, or None
        once the term is over."""
        st = self.state
        if not st.leading():
            # The lease ran out locally: a renewal is late (it may still land, and the term
            # goes on) or lost (the election ends the term). Take nothing in meanwhile.
            await asyncio.sleep(NOT_LEADING_WAIT_S)
            return backlog
        free = st.settings.max_buffered - st.held_by_band[band]
        if free <= 0:
            room = st.room[band]
            room.clear()
            await room.wait()
            return backlog
        try:
            msgs = await psub.fetch(
                batch=pull_batch(free, backlog), timeout=st.settings.fetch_timeout_s
            )
        except (TimeoutError, nats.errors.TimeoutError):
            return False  # a whole long-poll and nothing came: the band is idle
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
            await asyncio.sleep(0.2)
            return backlog
        except BROKER_ERRORS:
            log.warning("fetch on band %s failed; retrying", band, exc_info=True)
            await asyncio.sleep(_PULL_RETRY_S)
            return backlog
        if not msgs:
            # nats-py's fetch of a batch returns nothing, rather than time out, when its pull
            # ends on a status (an earlier pull's expiry, a conflict) before any message.
            return False
        known = await self._results_of_redeliveries(msgs)
        for i, msg in enumerate(msgs):
            if st.term != term:
                return None  # deposed while fetching: not ours to ack or hold
            if not st.leading():
                # The lease ran out mid-batch, the term not (yet) over: the rest goes back
                # to the broker at once, for this dispatcher once renewed or the next leader.
                await give_back(msgs[i:])
                return True
            try:
                await self.on_request(band, msg, known)
            except Exception:  # one message must never stop its band: log and count it
                internal_error(log, "dispatcher.intake", "a request of band %s failed", band)
        st.kick.set()
        return more_behind(msgs[-1])

    async def _results_of_redeliveries(self, msgs: list[Msg]) -> dict[tuple[str, str], bool | None]:
        """Whether the results of a batch's redelivered requests exist, by (tenant, request
        id), looked up concurrently: after a takeover every message comes back redelivered,
        and one lookup after the other would cost a round trip per request (renewed copies
        are looked up on their first delivery too). Keyed by the subject's tenant and the
        ``Nats-Msg-Id`` header (a copy's without its generation); :meth:`_seen` uses an
        answer only for a body that says the same (else it looks up itself)."""
        keys: list[tuple[str, str]] = []
        for msg in msgs:
            rid = (msg.headers or {}).get(names.MSG_ID_HEADER, "")
            copy = generation(msg) > 0
            if copy:  # (a renewed copy's id is its request's, with its generation)
                rid = names.renewed_request_id(rid)
            if (msg.metadata.num_delivered <= 1 and not copy) or not rid:
                continue
            _, model, tenant = _subject_parts(msg.subject, "")
            if model:
                keys.append((tenant, rid))
        if not keys:
            return {}
        try:
            found = await asyncio.gather(*(self.answers.result_known(t, rid) for t, rid in keys))
        except Exception:  # a bug here must not stop the band: each request looks up itself
            internal_error(log, "dispatcher.intake", "looking up redelivered results failed")
            return {}
        return dict(zip(keys, found, strict=True))

    async def on_request(
        self, band: str, msg: Msg, known: dict[tuple[str, str], bool | None] | None = None
    ) -> None:
        """One pulled request message. ``known``: whether results exist, looked up already
        for the batch (:meth:`_results_of_redeliveries`)."""
        st = self.state
        now = time.monotonic()
        meta = msg.metadata
        s_band, s_model, s_tenant = _subject_parts(msg.subject, band)
        header_id = (msg.headers or {}).get(names.MSG_ID_HEADER, "")
        try:
            req = decode(msg.data, SubmitRequest)
        except DecodeError as exc:
            partial = exc.partial if isinstance(exc.partial, dict) else {}
            rid = header_id or str(partial.get("request_id", ""))
            await self.answers.reject_raw(msg, s_tenant, rid, RejectReason.MALFORMED, str(exc))
            return
        if (req.band, req.model, req.tenant) != (s_band, s_model, s_tenant):
            await self.answers.reject_raw(
                msg,
                s_tenant,
                req.request_id,
                RejectReason.MALFORMED,
                f"body says band/model/tenant {req.band}/{req.model}/{req.tenant} but it was "
                f"published on {msg.subject}",
            )
            return
        if await self._seen(req, msg, now, known or {}):
            return
        rid = req.request_id
        ids = st.tokenizers.prompt_ids(req.model, req.prompt_tokens, req.prompt_text)
        copy = generation(msg) > 0
        request = _request(req, msg, now, ids, arrived_unix_ms(msg) if copy else None)
        if meta.num_delivered <= 1 and not copy:  # (a redelivery's or a renewed copy's store
            # time says nothing of the intake)
            metrics.INTAKE.labels(band).observe(max(0.0, time.monotonic() - request.arrived_s))
        outcome = st.scheduler.enqueue(request, now)
        if outcome.status in ("queued", "adopted"):
            st.hold(Held.of(msg, req, meta.sequence.stream))
            if outcome.status == "queued":
                st.unnotified.add(rid)
        elif outcome.status == "duplicate":
            metrics.DUPLICATES.inc()
            await ack(msg)
        else:
            assert outcome.rejection is not None
            if await self.answers.publish_rejection(req, outcome.rejection):
                await ack(msg)

    async def _seen(
        self,
        req: SubmitRequest,
        msg: Msg,
        now: float,
        known: dict[tuple[str, str], bool | None],
    ) -> bool:
        """Handle a request this dispatcher has seen before (held, cancelled, or finished):
        True if it was, and is now dealt with."""
        st, rid = self.state, req.request_id
        if await self._held_already(rid, msg):
            return True
        copy = generation(msg) > 0
        if copy:
            self.renewals.arrived(rid)
        if st.cancelled.has(rid, now):  # cancelled before it got here, or coming back
            await self._end_cancelled(req, msg)
            return True
        if not copy and msg.metadata.num_delivered <= 1:
            # (A renewed copy is looked up on its first delivery too: its request may have
            # ended, its older message acked, while the copy waited to be pulled.)
            return False
        key = (req.tenant, rid)
        exists = known[key] if key in known else await self.answers.result_known(*key)
        if exists:
            metrics.DUPLICATES.inc()
            await ack(msg)
            return True
        if exists is None and msg.metadata.num_delivered < st.settings.max_deliver:
            # It may have run (its ack lost with a broker node): running it again would
            # duplicate the work, so it comes back for another look. On its last delivery
            # it runs: a duplicate is safe, an undelivered request is not.
            await self._look_again(msg, rid)
            return True
        # The lookup waited on the broker: another message of the request (its older one, a
        # copy's original pulled by its band meanwhile) may be held by now.
        return await self._held_already(rid, msg)

    async def _held_already(self, rid: str, msg: Msg) -> bool:
        """Deal with ``msg`` if a message of its request is held here (True): a redelivery of
        it, a newer renewed copy (held instead), or a duplicate (acked)."""
        st = self.state
        held = st.held.get(rid)
        if held is None:
            return False
        if same_message(held, msg):
            held.msg = msg  # a redelivery of the message we hold: keep the newest handle
        elif self.renewals.newer(held, msg):  # its renewed copy: held instead of the old
            await ack(st.hold_instead(held, msg))
        else:
            metrics.DUPLICATES.inc()
            await ack(msg)
        return True

    async def settle_requeued(self, requeued: Sequence[Request]) -> None:
        """Requests queued again because their worker was lost (or reconciliation found
        them orphaned), their results looked up concurrently. They leave the queue while
        they are looked up (call this before any await after the requeue): the hand-off loop
        runs during the lookups and would hand one out again, to run a second time, before
        its lookup said it had finished (seen in CI, under load). One whose result is stored
        finished (its completion was lost with the worker): it is acked. One whose result
        could not be looked up may have finished too: it is sent back, so that its
        redelivery looks again (as :meth:`_seen` does), but on its last delivery it runs.
        One without a result goes back to its place in the queue and runs."""
        st = self.state
        mine = [r for r in requeued if r.request_id in st.held]
        metrics.REQUEUED.inc(len(requeued))
        if not mine:
            return
        parked = [st.scheduler.cancel(r.request_id) for r in mine]
        found = await asyncio.gather(
            *(self.answers.result_known(r.tenant, r.request_id) for r in mine)
        )
        now = time.monotonic()
        for r, queued, exists in zip(mine, parked, found, strict=True):
            held = st.held.get(r.request_id)
            if queued is None or held is None:
                continue  # not queued, or its message went meanwhile (it ended)
            last = held.msg.metadata.num_delivered >= st.settings.max_deliver
            if exists is False or (exists is None and last):
                # Its last delivery runs: a duplicate run is safe, no answer is not.
                await self._requeue(queued, held, now)
                continue
            st.release_held(r.request_id)
            if exists:
                await ack(held.msg)
            else:
                await self._look_again(held.msg, r.request_id)

    async def _requeue(self, request: Request, held: Held, now: float) -> None:
        """Queue a parked request again, in its place (its arrival time orders it); one that
        may not run any more (cancelled, or its deadline passed, meanwhile) is answered and
        acked."""
        st = self.state
        if st.cancelled.has(request.request_id, now):  # cancelled while out of the queue
            st.release_held(request.request_id)
            await self._end_cancelled(held.request, held.msg)
            return
        outcome = st.scheduler.enqueue(request, now)
        if outcome.status in ("queued", "adopted", "duplicate"):
            return
        assert outcome.rejection is not None
        st.release_held(request.request_id)
        if await self.answers.publish_rejection(held.request, outcome.rejection):
            await ack(held.msg)

    async def _end_cancelled(self, req: SubmitRequest, msg: Msg) -> None:
        """A request cancelled before it could run: its cancelled result, then the ack."""
        rejection = Rejection(reason=RejectReason.CANCELLED, message="cancelled")
        if await self.answers.publish_result_of(req, rejection):
            await ack(msg)

    async def _look_again(self, msg: Msg, rid: str) -> None:
        """Send back a request whose result could not be looked up, for another look."""
        log.info("the result of %s could not be looked up; it comes back", rid)
        metrics.LOOKUPS_DEFERRED.inc()
        try:
            await msg.nak(delay=UNSURE_RETRY_S)
        except BROKER_ERRORS:
            log.debug("nak of %s not sent; it comes back after ack_wait", rid)


_PULL_RETRY_S = 0.5
"""How long a band's pull waits after a failed fetch or an error no branch expected, before
it pulls again."""

UNSURE_RETRY_S = 1.0
"""How long a redelivered request whose result could not be looked up waits to come back."""

PULL_BATCH = 128
"""Most request messages one pull asks for while a band has a backlog."""


def pull_batch(free: int, backlog: bool) -> int:
    """How many messages the next pull of a band asks for: one while the band is idle (the
    last message pulled said none were pending behind it), a batch while it has a backlog;
    never more than the buffer has room for (``free``).

    A pull for several messages on an idle band waits on the server for the first to arrive
    and then, having it, for the server's "no more messages" status (nats-py's ``fetch``):
    a second wake-up of the dispatcher before the request is even decoded. A pull for one
    returns with that message. The message's ``num_pending`` says whether more wait, and then
    the next pull takes them (up to a batch) in one round trip, as they are available."""
    return min(free, PULL_BATCH) if backlog else 1


def same_message(held: Held, msg: Msg) -> bool:
    """Whether ``msg`` is (a delivery of) the message ``held`` holds."""
    meta = msg.metadata
    return meta.sequence.stream == held.stream_seq and meta.stream == held.msg.metadata.stream


def _subject_parts(subject: str, band: str) -> tuple[str, str, str]:
    """``(band, model, tenant)`` of a request's subject, or of its renewed copy's; for another
    subject, ``band`` and no model (the body, then, does not match it)."""
    for parse in (names.parse_request_subject, names.parse_renewed_subject):
        try:
            return parse(subject)
        except ValueError:
            continue
    return band, "", "default"


def more_behind(msg: Msg) -> bool:
    """Whether more messages likely wait behind ``msg``: the consumer has messages it has not
    delivered yet, or ``msg`` is a redelivery (after a takeover, or once ``ack_wait`` passed,
    a held request comes back with the others that were held with it)."""
    meta = msg.metadata
    return meta.num_pending > 0 or meta.num_delivered > 1


def _request(
    req: SubmitRequest,
    msg: Msg,
    now: float,
    ids: Sequence[int] | None,
    arrived_unix_ms: float | None = None,
) -> Request:
    """The scheduler's view of a submitted request, on the monotonic clock: it arrived when
    the broker stored it (a renewed copy: when its first message was, ``arrived_unix_ms``),
    and its deadline is the producer's wall-clock deadline. ``ids``: its prompt's token ids
    (given or tokenized here), None for the byte fallback."""
    wall = time.time()
    stamp = msg.metadata.timestamp
    stored_s = stamp.timestamp() if stamp else wall
    if arrived_unix_ms is not None:
        stored_s = min(stored_s, arrived_unix_ms / 1000)
    deadline_s = None
    if req.deadline_unix_ms is not None:
        deadline_s = now + (req.deadline_unix_ms / 1000 - wall)
    return Request(
        request_id=req.request_id,
        band=req.band,
        model=req.model,
        tenant=req.tenant,
        prompt_tokens=prompt_length(ids, req.prompt_text),
        max_tokens=req.max_tokens,
        arrived_s=now - max(0.0, wall - stored_s),
        deadline_s=deadline_s,
        block_hashes=tuple(prompt_hashes(ids, req.prompt_text)),
        affinity_key=None if req.session_id is None else session_key(req.tenant, req.session_id),
    )

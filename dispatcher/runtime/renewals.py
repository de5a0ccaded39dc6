"""Renewals: a request held through many leader changes gets its deliveries back.

JetStream counts every delivery of a request message against ``max_deliver``: a dispatcher's
crash, as meant, but also every leader change (the next leader has the held messages
delivered again) and every clean hand-over (a nak). A request that waits long (an offline
batch behind online traffic, through a few rolling redeploys) was dead-lettered after
``max_deliver`` leader changes, for no fault of its own.

So the leader renews a held request whose deliveries are half spent, once it has held it
through a keepalive tick (it did not crash holding it): it publishes the same body again to
:data:`~sluice.schemas.names.RENEWED_STREAM` (outside the bands' bounded queues, so that a full
queue never refuses it; written by dispatchers only, so that its headers are trusted), with
its generation and its request's arrival (the copy keeps its place in the queue). A leader
that has one message of a request and gets another holds the newer copy (by generation, then
stream sequence) and acks the older, whichever comes first (:meth:`Renewals.newer`). A request
is renewed at most ``max_renewals`` times: one that crashes dispatchers is still dead-lettered
after a bounded number of deliveries.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.state import BROKER_ERRORS, Held, State
from sluice.schemas import names

log = logging.getLogger("sluice.dispatcher")

_PUBLISH_TIMEOUT_S = 1.0
_FAILURES_PER_TICK = 3
"""Refused renewals after which a tick stops renewing (the broker is likely away)."""


def generation(msg: Msg) -> int:
    """A request message's renewal generation: 0 for a producer's own, or any message not in
    the renewed stream (a producer cannot make its message a copy by a header)."""
    if msg.metadata.stream != names.RENEWED_STREAM:
        return 0
    value = (msg.headers or {}).get(names.RENEWAL_HEADER, "")
    return int(value) if value.isascii() and value.isdigit() else 0


def order(msg: Msg) -> tuple[int, int]:
    """How new a message of a request is: (generation, stream sequence)."""
    return generation(msg), msg.metadata.sequence.stream


def arrived_unix_ms(msg: Msg) -> float | None:
    """When a renewed copy's request arrived (None for a producer's own message)."""
    if generation(msg) == 0:
        return None
    value = (msg.headers or {}).get(names.ARRIVED_HEADER, "")
    return float(value) if value.isascii() and value.isdigit() else None


def renew_from(max_deliver: int) -> int:
    """The delivery from which a held request is renewed: half of ``max_deliver`` (never the
    first), so that a few leader changes in quick succession, each too short for a keepalive
    tick, do not spend the rest."""
    return max(2, -(-max_deliver // 2))


class Renewals:
    """Renews the held requests whose deliveries run out (see the module docstring)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self._ticked: set[str] = set()
        """Requests held at the last tick from their delivery :func:`renew_from` on: those
        still held at the next may be renewed."""
        self.renewing: dict[str, int] = {}
        """Request id -> the generation of its copy published by this leader and not seen
        back yet (it is not renewed again meanwhile)."""
        self._task: asyncio.Task[None] | None = None

    def forget_term(self) -> None:
        self._ticked.clear()
        self.renewing.clear()

    def tick(self) -> None:
        """Start renewing the held requests that are due (in a task of its own: a tick of
        many renewals must not hold up the in-progress acks that keep every request held);
        a tick still running is not started again. Called by the keepalive loop."""
        if self._task is not None and not self._task.done():
            return
        self._task = self.state.spawn(self._tick(self.state.term), "renewals")

    async def _tick(self, term: int) -> None:
        """Renew each held request that is due: held since the last tick, its deliveries half
        spent, renewals left."""
        st = self.state
        s = st.settings
        if s.max_renewals == 0:
            return
        due_from = renew_from(s.max_deliver)
        before = self._ticked
        # Only the requests far enough in their deliveries (rare): no set of every held one.
        self._ticked = {
            rid for rid, h in st.held.items() if h.msg.metadata.num_delivered >= due_from
        }
        failed = 0
        for rid in before & self._ticked:
            if st.term != term or not st.leading():
                return  # (the next leader renews what it holds)
            held = st.held.get(rid)
            if held is None or rid in self.renewing or generation(held.msg) >= s.max_renewals:
                continue
            # A copy the broker refuses (the broker away, the renewed stream full) is tried
            # again at the next tick; a few refusals end this one.
            if not await self._renew(held, term):
                failed += 1
                if failed >= _FAILURES_PER_TICK:
                    return

    async def _renew(self, held: Held, term: int) -> bool:
        st, rid = self.state, held.request_id
        gen = generation(held.msg) + 1
        headers = {
            names.MSG_ID_HEADER: names.renewal_msg_id(rid, gen),
            names.RENEWAL_HEADER: str(gen),
            names.RENEWED_FROM_HEADER: names.message_ref(held.msg.metadata.stream, held.stream_seq),
        }
        arrived = self._arrived_unix_ms(held)
        if arrived is not None:
            headers[names.ARRIVED_HEADER] = str(arrived)
        # The subject from the body it carries, not from the held request's first message: a
        # request submitted to two bands may be held from one and carry the other's copy.
        body = held.request
        subject = names.renewed_subject(body.band, body.model, body.tenant, rid)
        try:
            await st.js.publish(subject, held.msg.data, headers=headers, timeout=_PUBLISH_TIMEOUT_S)
        except BROKER_ERRORS as exc:
            log.warning("could not renew %s (delivery %d): %s", rid, _delivered(held), exc)
            metrics.RENEWALS_REFUSED.inc()
            return False
        if st.term == term:
            self.renewing[rid] = gen
        metrics.RENEWALS.inc()
        log.info("renewed %s after %d deliveries (renewal %d)", rid, _delivered(held), gen)
        return True

    def _arrived_unix_ms(self, held: Held) -> int | None:
        """When the held request arrived, as the scheduler has it (queued or booked), else
        as its message says (a request out of the queue for a moment, its result being
        looked up)."""
        sched, rid = self.state.scheduler, held.request_id
        request = sched.queued_request(rid)
        if request is None:
            booking = sched.booking(rid)
            request = None if booking is None else booking.request
        if request is not None:
            return int((time.time() - (time.monotonic() - request.arrived_s)) * 1000)
        copied = arrived_unix_ms(held.msg)
        if copied is not None:
            return int(copied)
        stamp = held.msg.metadata.timestamp
        return None if stamp is None else int(stamp.timestamp() * 1000)

    def arrived(self, request_id: str) -> None:
        """A renewed copy of the request reached this leader (held, or its request ended)."""
        self.renewing.pop(request_id, None)

    def newer(self, held: Held, msg: Msg) -> bool:
        """Whether ``msg``, another message of a held request, is a newer renewed copy than
        the one held (a later generation, or the same one stored again after the duplicate
        window): it is then held instead, and the older acked. Two messages of producers
        (the same id submitted twice, to two bands or after the duplicate window) are no
        copies of each other: the one held stays."""
        if generation(msg) == 0 or order(msg) <= order(held.msg):
            return False
        self.arrived(held.request_id)
        return True

    async def newer_copy(
        self, band: str, model: str, tenant: str, request_id: str, stream: str, seq: int
    ) -> bool | None:
        """Whether a renewed copy of the request newer than the message at ``stream`` #
        ``seq`` is stored; None if the broker cannot say."""
        subject = names.renewed_subject(band, model, tenant, request_id)
        try:
            last = await self.state.js.get_last_msg(names.RENEWED_STREAM, subject)
        except NotFoundError:
            return False
        except BROKER_ERRORS:
            return None
        return stream != names.RENEWED_STREAM or (last.seq or 0) > seq


def _delivered(held: Held) -> int:
    return int(held.msg.metadata.num_delivered)

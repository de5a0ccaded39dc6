"""Renewals: a request held through many leader changes gets its deliveries back.

JetStream counts every delivery of a request message against ``max_deliver``: a dispatcher's
crash, as meant, but also every leader change (the next leader has the held messages
delivered again) and every clean hand-over (a nak). A request that waits long (an offline
batch behind online traffic, through a few rolling redeploys) was dead-lettered after
``max_deliver`` leader changes, for no fault of its own.

So the leader renews a held request whose deliveries are half spent, once it has held it
through a keepalive tick (it did not crash holding it): it publishes the same body again under
another message id (:func:`~sluice.schemas.names.renewal_msg_id`, with the
:data:`~sluice.schemas.names.RENEWAL_HEADER` generation), then stores when the request arrived
in :data:`~sluice.schemas.names.RENEWAL_BUCKET`, so that the copy keeps its place in the queue
(a producer cannot claim an arrival: the bucket is the dispatchers'). The old message is acked
only when the copy reaches a leader, which holds the newer generation and acks the older as
a duplicate, whichever comes first (:meth:`Renewals.newer`). A request is renewed at most
``max_renewals`` times: one that crashes dispatchers is still dead-lettered after a bounded
number of deliveries.
"""

from __future__ import annotations

import json
import logging
import time

from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.state import BROKER_ERRORS, Held, State
from sluice.dispatcher.runtime.streams import KEEP_S, kv_bucket
from sluice.schemas import names

log = logging.getLogger("sluice.dispatcher")


def generation(msg: Msg) -> int:
    """A request message's renewal generation: 0 for the producer's own (or a header that
    is not a count)."""
    value = (msg.headers or {}).get(names.RENEWAL_HEADER, "")
    return int(value) if value.isdigit() else 0


def renew_from(max_deliver: int) -> int:
    """The delivery from which a held request is renewed: half of ``max_deliver`` (never the
    first), so that a few leader changes in quick succession, each too short for a keepalive
    tick, do not spend the rest."""
    return max(2, -(-max_deliver // 2))


_FAILURES_PER_TICK = 3
"""Refused renewals after which a keepalive tick stops renewing (the broker is likely away)."""


class Renewals:
    """Renews the held requests whose deliveries run out (see the module docstring)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self._kv: KeyValue | None = None
        self._ticked: set[str] = set()
        """Requests held at the last keepalive tick from their delivery :func:`renew_from`
        on: those held since may be renewed."""
        self.renewing: dict[str, int] = {}
        """Request id -> the generation of its copy published by this leader and not seen
        back yet (not renewed again meanwhile)."""

    async def start(self) -> None:
        """Open (or create) the bucket."""
        st = self.state
        config = api.KeyValueConfig(
            bucket=names.RENEWAL_BUCKET,
            history=1,
            ttl=KEEP_S,
            storage=api.StorageType.FILE,
            replicas=st.settings.stream_replicas,
        )
        self._kv = await kv_bucket(st.js, config, st.settings)

    def forget_term(self) -> None:
        self._ticked.clear()
        self.renewing.clear()

    async def tick(self) -> None:
        """Renew each held request that is due: held since the last tick, its deliveries half
        spent, renewals left. Called by the keepalive loop after its in-progress acks."""
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
            held = st.held.get(rid)
            if held is None or rid in self.renewing or generation(held.msg) >= s.max_renewals:
                continue
            # A copy the broker refuses (the broker away, a tenant's or a band's queue full)
            # is tried again at the next tick; a few refusals end this one.
            if not await self._renew(held):
                failed += 1
                if failed >= _FAILURES_PER_TICK:
                    return

    async def _renew(self, held: Held) -> bool:
        st, rid = self.state, held.request_id
        gen = generation(held.msg) + 1
        arrived_unix_ms = self._arrived_unix_ms(held)
        try:
            ack = await st.js.publish(
                held.msg.subject,
                held.msg.data,
                headers={
                    names.MSG_ID_HEADER: names.renewal_msg_id(rid, gen),
                    names.RENEWAL_HEADER: str(gen),
                },
            )
        except BROKER_ERRORS as exc:
            log.warning("could not renew %s (delivery %d): %s", rid, _delivered(held), exc)
            return False
        self.renewing[rid] = gen
        metrics.RENEWALS.inc()
        log.info("renewed %s after %d deliveries (renewal %d)", rid, _delivered(held), gen)
        if arrived_unix_ms is not None and self._kv is not None:
            value = json.dumps(
                {"request_id": rid, "stream_seq": ack.seq, "arrived_unix_ms": arrived_unix_ms}
            )
            try:
                await self._kv.put(names.renewal_key(rid), value.encode())
            except BROKER_ERRORS:
                # The copy then arrives when it was stored: later in its queue, not lost.
                log.warning("the arrival of renewed %s was not stored", rid)
        return True

    def _arrived_unix_ms(self, held: Held) -> int | None:
        """When the held request arrived, as the scheduler has it (queued or booked), else
        when its message was stored if that is the producer's own (a request out of the
        queue for a moment, its result being looked up)."""
        sched, rid = self.state.scheduler, held.request_id
        request = sched.queued_request(rid)
        if request is None:
            booking = sched.booking(rid)
            request = None if booking is None else booking.request
        if request is not None:
            return int((time.time() - (time.monotonic() - request.arrived_s)) * 1000)
        stamp = held.msg.metadata.timestamp
        if generation(held.msg) == 0 and stamp is not None:
            return int(stamp.timestamp() * 1000)
        return None

    async def arrived_unix_ms(self, msg: Msg, request_id: str) -> float | None:
        """When a renewed copy's request arrived: None for a producer's own message, or when
        the bucket does not know this copy (its entry names another message: a producer's
        header claims nothing); the copy then arrived when it was stored."""
        if generation(msg) == 0:
            return None
        try:
            entry = await self._entry(request_id)
        except BROKER_ERRORS:
            log.warning("the arrival of renewed %s could not be read", request_id)
            return None
        if entry is None or entry[0] != msg.metadata.sequence.stream:
            return None
        return entry[1]

    async def renewed(self, request_id: str, stream_seq: int) -> bool | None:
        """Whether a renewed copy of the request at ``stream_seq`` was stored (the bucket
        names a later message); None if the bucket cannot be read."""
        try:
            entry = await self._entry(request_id)
        except BROKER_ERRORS:
            return None
        return entry is not None and entry[0] > stream_seq

    async def _entry(self, request_id: str) -> tuple[int, float] | None:
        """(the renewed copy's stream sequence, its request's arrival in Unix ms) as the
        bucket has them; None if it has none (or one that does not read)."""
        if self._kv is None:
            return None
        try:
            entry = await self._kv.get(names.renewal_key(request_id))
        except KeyNotFoundError:
            return None
        try:
            value = json.loads(entry.value or b"")
            if value["request_id"] != request_id:
                return None
            return int(value["stream_seq"]), float(value["arrived_unix_ms"])
        except (ValueError, KeyError, TypeError):
            log.warning("the renewal entry of %s does not read", request_id)
            return None

    def arrived(self, request_id: str) -> None:
        """A renewed copy of the request reached this leader (held, or its request ended)."""
        self.renewing.pop(request_id, None)

    def newer(self, held: Held, msg: Msg) -> bool:
        """Whether ``msg``, another message of a held request, is a newer copy than the one
        held (a renewal): it is then held instead, and the older acked."""
        if generation(msg) <= generation(held.msg):
            return False
        self.arrived(held.request_id)
        return True


def _delivered(held: Held) -> int:
    return int(held.msg.metadata.num_delivered)

"""What the dispatcher runtime's rooms share: the core, the held request messages and the
events that wake the loops."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from sluice.common.errors import internal_error
from sluice.common.tokenizer import Tokenizers
from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.decisions import DecisionLog
from sluice.dispatcher.defaults import CANCELLED_MAX_IDS
from sluice.dispatcher.feedback import Feedback, ScaleAdvisor
from sluice.dispatcher.leadership import Leadership
from sluice.dispatcher.leases import LeaseTable
from sluice.dispatcher.policies import build_policy, flap_meter
from sluice.dispatcher.routing import RoutingPolicy
from sluice.dispatcher.runtime.settings import DispatcherSettings
from sluice.dispatcher.scheduler import Scheduler
from sluice.schemas import names
from sluice.schemas.codec import decode
from sluice.schemas.models import Heartbeat, SubmitRequest

log = logging.getLogger("sluice.dispatcher")

BROKER_ERRORS = (nats.errors.Error, OSError, TimeoutError)
"""What a publish, request, ack or fetch may raise while the broker is away (nats-py's
JetStream errors derive from ``nats.errors.Error``): expected, handled where they happen."""


@dataclass(slots=True)
class Held:
    """A request message the dispatcher holds un-acked until the request ends.

    It keeps the message, whose body is the request as its producer encoded it (a few bytes
    per prompt token), and of the decoded request only what the loops read often: the decoded
    prompt would cost some 40 bytes per token id, ten times its body. An offer sends the body
    as it is (:func:`~sluice.schemas.codec.encode_nested`); :attr:`request` decodes it again
    for the rare answers that need it whole."""

    msg: Msg
    stream_seq: int
    request_id: str
    model: str
    tenant: str
    band: str
    submitted_unix_ms: int

    @classmethod
    def of(cls, msg: Msg, request: SubmitRequest, stream_seq: int) -> Held:
        """Hold ``msg``, whose body decoded to ``request``."""
        r = request
        return cls(msg, stream_seq, r.request_id, r.model, r.tenant, r.band, r.submitted_unix_ms)

    @property
    def request(self) -> SubmitRequest:
        """The request, decoded from the message's body (it decoded once, so it does again)."""
        return decode(self.msg.data, SubmitRequest)


def is_copy(msg: Msg) -> bool:
    """Whether ``msg`` is a renewed copy (:mod:`~sluice.dispatcher.runtime.renewals`)."""
    return bool(msg.metadata.stream == names.RENEWED_STREAM)


class Tombstones:
    """Request ids cancelled in the last ``ttl_s`` (the broker's duplicate window: a request
    is not resubmitted under its id after that), at most ``max_ids`` of them. Time is passed
    in."""

    def __init__(self, ttl_s: float, max_ids: int = CANCELLED_MAX_IDS) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str, now_s: float) -> None:
        self._ids[request_id] = now_s
        self._ids.move_to_end(request_id)
        self._trim(now_s)

    def has(self, request_id: str, now_s: float) -> bool:
        self._trim(now_s)
        return request_id in self._ids

    def _trim(self, now_s: float) -> None:
        ids = self._ids
        while ids and (len(ids) > self.max_ids or now_s - next(iter(ids.values())) > self.ttl_s):
            ids.popitem(last=False)


class State:
    """The dispatcher's shared state (one per dispatcher)."""

    def __init__(
        self, settings: DispatcherSettings, policy: RoutingPolicy | None, started_s: float
    ) -> None:
        self.settings = s = settings
        routing = s.routing()
        self.policy = policy or build_policy(s.routing_policy, routing, s.seed)
        self.index_block_tokens = routing.block_tokens * routing.index_stride
        self.decisions = (
            DecisionLog(s.decision_log, s.decision_log_max_bytes)
            if s.decision_log is not None
            else None
        )
        self.feedback = Feedback(s.feedback_window_s)
        self.advisor = ScaleAdvisor(
            up_wait_s=s.scale_up_wait_s,
            up_sustain_s=s.scale_up_sustain_s,
            down_idle_s=s.scale_down_idle_s,
        )
        self.started_s = started_s
        self.admission: AdmissionConfig = s.admission()
        """The admission configuration in force (the settings, or an operator's overrides)."""
        self.scheduler = self._new_scheduler(started_s)
        self.leadership = Leadership(
            lease_s=s.leader_lease_s,
            learn_s=s.effective_learn_s,
            settle_s=s.leader_settle_s,
            started_s=started_s,
            catch_up_s=s.effective_ack_wait_s + s.leader_lease_s,
        )
        self.term = 0
        """Counts the times this dispatcher became leader; a pull task runs for one term."""
        self.tokenizers = Tokenizers(s.tokenizer, s.model_tokenizers)
        """Text prompts become token ids here, as the engines tokenize them."""
        self.leases = LeaseTable(s.lease_s, s.lease_max_removed)
        self.heartbeats: dict[str, Heartbeat] = {}
        """The last heartbeat of every worker holding a lease (``sluice workers``)."""
        self.held: dict[str, Held] = {}
        self.cancelled = Tombstones(s.duplicate_window_s, s.cancelled_max_ids)
        """Requests cancelled here: one that arrives (again) is answered, never run."""
        self.unnotified: set[str] = set()
        """Requests queued since the last scheduling pass: those still queued after it are
        told so (a ``QueuedNotice`` on their token subject)."""
        self.held_by_band: Counter[str] = Counter()
        self.copies_held = 0
        """Held requests whose message is a renewed copy (the message it replaced is acked):
        the ``sluice_dispatcher_renewed_held_requests`` gauge."""
        self.room = {b: asyncio.Event() for b in s.bands}
        """Set when a band's buffer has room again (its pull task waits on it)."""
        self.any_room = asyncio.Event()
        """Set when any band's buffer has room again (the renewed copies' pull waits on it)."""
        self.kick = asyncio.Event()
        """Set when something changed that may let the scheduler plan."""
        self.stopping = asyncio.Event()
        self.running = False
        self.cut_off = False
        """From a disconnect until the leases were renewed on reconnecting: the heartbeats
        of that time never reached us, so no lease may run out on them."""
        self.nc_or_none: NATS | None = None
        self._background: set[asyncio.Task[Any]] = set()

    def _new_scheduler(self, now_s: float) -> Scheduler:
        s = self.settings
        return Scheduler(
            self.admission,
            self.policy,
            models=s.models,
            model_grace_s=s.effective_model_grace_s,
            started_s=now_s,
            flaps=flap_meter(s.routing()),
            engine_time=s.engine_time(),
        )

    def forget_term(self, now_s: float) -> None:
        """Leadership was lost: forget the queue and the books, and drop the held messages
        un-acked (the next leader gets them redelivered and adopts what runs). The routing
        policy, with its cache index, is kept warm."""
        self.scheduler = self._new_scheduler(now_s)
        self.held.clear()
        self.held_by_band.clear()
        self.copies_held = 0
        self.unnotified.clear()
        self.wake_pulls()

    def leading(self) -> bool:
        """Whether this dispatcher leads now (its lease has not run out locally)."""
        return self.leadership.leading(time.monotonic())

    @property
    def nc(self) -> NATS:
        assert self.nc_or_none is not None, "dispatcher not started"
        return self.nc_or_none

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    def spawn(self, coro: Coroutine[Any, Any, Any], site: str) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; an error it ends with is logged and counted."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(lambda t: self._done(t, site))
        return task

    def _done(self, task: asyncio.Task[Any], site: str) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if isinstance(exc, BROKER_ERRORS):
            log.debug("background %s failed: broker unreachable", site)
        else:
            internal_error(log, site, "background task failed", exc=exc)

    @property
    def background(self) -> set[asyncio.Task[Any]]:
        return self._background

    def hold(self, held: Held) -> None:
        self.held[held.request_id] = held
        self.held_by_band[held.band] += 1
        self.copies_held += is_copy(held.msg)

    def hold_instead(self, held: Held, msg: Msg) -> Msg:
        """Hold ``msg``, another message of a held request (its newer renewed copy), instead
        of the one held; returns the one held before (for the caller to ack)."""
        old, held.msg, held.stream_seq = held.msg, msg, msg.metadata.sequence.stream
        self.copies_held += is_copy(msg) - is_copy(old)
        return old

    def release_held(self, request_id: str) -> Held | None:
        held = self.held.pop(request_id, None)
        self.unnotified.discard(request_id)
        if held is not None:
            band = held.band
            self.held_by_band[band] -= 1
            self.copies_held -= is_copy(held.msg)
            self.room[band].set()
            self.any_room.set()
        return held

    def room_left(self) -> int:
        """Requests the bands' buffers have room for in all: ``max_buffered`` each, less every
        request held (renewed copies may hold a band over its own buffer, which takes room
        from the others)."""
        s = self.settings
        return len(s.bands) * s.max_buffered - len(self.held)

    def wake_pulls(self) -> None:
        """Wake every pull waiting for room (to see a new term, or the stop)."""
        for room in self.room.values():
            room.set()
        self.any_room.set()

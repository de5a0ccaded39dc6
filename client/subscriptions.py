"""Durable result subscriptions: every result of a tenant, or of a group (a batch), delivered
once, in order, across disconnects and restarts of the producer.

A subscription is a durable JetStream pull consumer on the results stream, filtered by
:func:`sluice.schemas.names.results_filter`. A result is acked when the caller has taken it: when
the iterator is asked for the next one, or when the subscription is closed after yielding it.
A producer that dies while handling a result gets it again when it subscribes again under the
same name; one that handled it never does. Results of a request that ran twice (a worker lost
after storing it, past the broker's duplicate window) are delivered once per subscription
session: the repeat is acked and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from sluice.client.errors import MalformedResult, ServiceUnavailable
from sluice.schemas import names
from sluice.schemas.codec import decode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import Result

DEFAULT_INACTIVE_S = 24 * 3600.0
"""A subscription nobody reads for this long is removed by the broker."""
DEFAULT_ACK_WAIT_S = 30.0
"""Results a subscriber fetched and never acked (it died) come again after this long."""
_SEEN_MAX = 100_000
_ACK_TRIES = 3
"""An ack the broker does not confirm is tried this often, a second each: a broker that
restarted may have lost the delivery it acks (then the message comes again, and this session
skips it as seen), and a subscriber must not stall on it."""
_NATS_ERRORS = (nats.errors.Error, OSError)
_TRANSIENT = (
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)
"""What a broker restart looks like from here: wait, the connection comes back."""
log = logging.getLogger("sluice.client")


def subscription_name(tenant: str, group: str | None) -> str:
    """The durable consumer of a tenant's (or a group's) results when the caller names none
    (:func:`sluice.schemas.names.results_consumer`)."""
    return names.results_consumer(tenant, group)


class ResultSubscription:
    """An async iterator over stored and future results (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        tenant: str,
        group: str | None = None,
        *,
        name: str | None = None,
        idle_timeout_s: float | None = None,
        fetch_batch: int = 64,
        inactive_s: float = DEFAULT_INACTIVE_S,
        ack_wait_s: float = DEFAULT_ACK_WAIT_S,
    ) -> None:
        self.tenant, self.group = tenant, group
        self.name = name or subscription_name(tenant, group)
        self.filter = names.results_filter(tenant, group)
        self.idle_timeout_s = idle_timeout_s
        """Stop iterating after this long without a new result (None: follow forever)."""
        self._nc = nc
        self._fetch_batch = fetch_batch
        self._inactive_s = inactive_s
        self._ack_wait_s = ack_wait_s
        self._psub: JetStreamContext.PullSubscription | None = None
        self._pending: Msg | None = None
        """The last result handed out: acked when the next is asked for, or on close."""
        self._buffer: deque[Msg] = deque()
        self._seen: OrderedDict[str, None] = OrderedDict()

    async def _open(self) -> JetStreamContext.PullSubscription:
        if self._psub is None:
            config = api.ConsumerConfig(
                durable_name=self.name,
                filter_subject=self.filter,
                ack_policy=api.AckPolicy.EXPLICIT,
                deliver_policy=api.DeliverPolicy.ALL,
                inactive_threshold=self._inactive_s,
                ack_wait=self._ack_wait_s,
                max_ack_pending=self._fetch_batch * 4,
            )
            try:
                self._psub = await self._nc.jetstream().pull_subscribe(
                    self.filter, durable=self.name, stream=names.RESULT_STREAM, config=config
                )
            except _NATS_ERRORS as exc:
                raise ServiceUnavailable(f"cannot follow results on {self.filter}: {exc}") from exc
        return self._psub

    def __aiter__(self) -> ResultSubscription:
        return self

    async def __anext__(self) -> Result:
        """The next result (acking the one before it); ``StopAsyncIteration`` after
        ``idle_timeout_s`` without one."""
        await self._ack_pending()
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            while self._buffer:
                msg = self._buffer.popleft()
                result = self._decode(msg)
                if result.request_id in self._seen:  # a request that ran twice
                    await msg.ack()
                    continue
                self._remember(result.request_id)
                self._pending = msg
                return result
            wait = 1.0
            if self.idle_timeout_s is not None:
                left = self.idle_timeout_s - (loop.time() - started)
                if left <= 0:
                    raise StopAsyncIteration
                wait = min(wait, max(left, 0.05))
            psub = await self._open()
            try:
                self._buffer.extend(await psub.fetch(self._fetch_batch, timeout=wait))
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except _TRANSIENT:  # the broker is away: the connection comes back by itself
                await asyncio.sleep(0.2)
            except _NATS_ERRORS as exc:
                raise ServiceUnavailable(f"results on {self.filter}: {exc}") from exc

    def _decode(self, msg: Msg) -> Result:
        try:
            return decode(msg.data, Result)
        except DecodeError as exc:
            raise MalformedResult(msg.subject, str(exc)) from exc

    def _remember(self, request_id: str) -> None:
        self._seen[request_id] = None
        if len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)

    async def _ack_pending(self) -> None:
        msg, self._pending = self._pending, None
        if msg is None:
            return
        for _ in range(_ACK_TRIES):
            try:
                await msg.ack_sync(timeout=1.0)
                return
            except (*_TRANSIENT, TimeoutError, nats.errors.TimeoutError):
                await asyncio.sleep(0.3)
            except _NATS_ERRORS as exc:
                raise ServiceUnavailable(f"could not ack a result of {self.filter}: {exc}") from exc
        # Not acked: the broker redelivers it after the ack wait; this session skips it (seen),
        # a later one gets it again (at least once, never lost).
        log.warning("a result of %s was not acked; it may come again", self.filter)

    async def close(self) -> None:
        """Stop following (acks the last result taken); the position is kept for the next
        subscription under this name. Fetched results not handed out are redelivered then."""
        await self._ack_pending()
        for msg in self._buffer:
            with contextlib.suppress(*_NATS_ERRORS):
                await msg.nak()
        self._buffer.clear()
        if self._psub is not None:
            psub, self._psub = self._psub, None
            with contextlib.suppress(*_NATS_ERRORS):  # the connection is gone: nothing to stop
                await psub.unsubscribe()

    async def delete(self) -> None:
        """Stop following and forget the position (delete the durable consumer)."""
        await self.close()
        try:
            await self._nc.jetstream().delete_consumer(names.RESULT_STREAM, self.name)
        except NotFoundError:
            pass  # never created, or gone already
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot delete subscription {self.name}: {exc}") from exc

    async def __aenter__(self) -> ResultSubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

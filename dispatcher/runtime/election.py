"""The election's broker side: the leader key in the ``SLUICE_LEADER`` bucket, created if
absent, taken over by compare-and-set once it went unrenewed for a lease, renewed by
compare-and-set, deleted on a clean stop so that a standby takes over at once. The decisions
are the pure :mod:`sluice.dispatcher.leadership`; what becoming leader and stepping down do
to the dispatcher is the caller's (``on_promoted`` and ``on_deposed``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from nats.js import api
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

from sluice.common.aio import wait_event
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.state import BROKER_ERRORS, State
from sluice.dispatcher.runtime.streams import kv_bucket
from sluice.schemas import names
from sluice.schemas.codec import encode
from sluice.schemas.models import LeaderLease

log = logging.getLogger("sluice.dispatcher")

Hook = Callable[[], Awaitable[None]]


async def leader_bucket(state: State) -> KeyValue:
    """The election bucket (created if missing: history 1, a TTL of one lease, so a key left
    by a crashed leader expires on its own too)."""
    js, s = state.js, state.settings
    config = api.KeyValueConfig(
        bucket=names.LEADER_BUCKET,
        history=1,
        ttl=s.leader_lease_s,
        storage=api.StorageType.FILE,
        replicas=s.stream_replicas,
    )
    return await kv_bucket(js, config, s)


class Election:
    """Campaigns, renews and resigns for one dispatcher."""

    def __init__(self, state: State, on_promoted: Hook, on_deposed: Hook) -> None:
        self.state = state
        self.lead = state.leadership
        self._on_promoted = on_promoted
        self._on_deposed = on_deposed
        self._kv: KeyValue | None = None

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "start() first"
        return self._kv

    async def start(self) -> None:
        """Open the bucket and campaign once (a lone dispatcher leads from its start)."""
        self._kv = await leader_bucket(self.state)
        metrics.LEADER.set(0)
        await self.step()

    async def loop(self) -> None:
        st = self.state
        while st.running:
            if await wait_event(st.stopping, self.lead.wake_in(time.monotonic())):
                break
            await self.step()

    async def step(self) -> None:
        """Do what is due: notice a lease that ran out, campaign or renew."""
        lead = self.lead
        if lead.expired(time.monotonic()):
            log.warning("%s: leadership lost (not renewed in time)", self._me)
            await self._deposed()
        action = lead.due(time.monotonic())
        if action == "campaign":
            await self._campaign()
        elif action == "renew":
            await self._renew()

    @property
    def _me(self) -> str:
        return self.state.settings.dispatcher_id

    def _value(self, epoch: int) -> bytes:
        return encode(LeaderLease(dispatcher_id=self._me, epoch=epoch))

    async def _campaign(self) -> None:
        lead, kv = self.lead, self.kv
        sent = time.monotonic()
        try:
            try:
                entry = await kv.get(names.LEADER_KEY)
            except (KeyNotFoundError, KeyDeletedError):
                revision = await kv.create(names.LEADER_KEY, self._value(0))
            else:
                if entry.revision is None or not lead.observed(entry.revision, time.monotonic()):
                    return
                sent = time.monotonic()
                revision = await kv.update(names.LEADER_KEY, self._value(0), last=entry.revision)
        except KeyWrongLastSequenceError:
            lead.beaten(time.monotonic())  # another dispatcher was first
            return
        except BROKER_ERRORS:
            log.debug("campaign of %s failed: broker unreachable", self._me)
            lead.beaten(time.monotonic())
            return
        lead.won(revision, sent, time.monotonic())
        metrics.LEADER.set(1)
        metrics.EPOCH.set(lead.epoch)
        metrics.TAKEOVERS.inc()
        log.warning("%s leads (epoch %d)", self._me, lead.epoch)
        await self._renew()
        if lead.role == "leader":
            await self._on_promoted()

    async def _renew(self) -> None:
        lead = self.lead
        sent = time.monotonic()
        value = self._value(lead.epoch)
        try:
            revision = await self.kv.update(names.LEADER_KEY, value, last=lead.revision)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            log.warning("%s: deposed (the leader key changed hands)", self._me)
            lead.step_down(time.monotonic())
            await self._deposed()
            return
        except BROKER_ERRORS:
            log.debug("renewal of %s failed: broker unreachable", self._me)
            lead.renew_failed(time.monotonic())
            return
        lead.renewed(revision, sent)
        try:
            await self.state.nc.publish(names.LEADER_SUBJECT, value)
        except BROKER_ERRORS:
            log.debug("leader announcement of %s not sent", self._me)

    async def _deposed(self) -> None:
        metrics.LEADER.set(0)
        await self._on_deposed()

    async def resign(self) -> None:
        """A clean stop: delete the key (if it is still ours) so a standby takes over now."""
        lead = self.lead
        if lead.role != "leader":
            return
        revision = lead.revision
        lead.step_down(time.monotonic())
        metrics.LEADER.set(0)
        try:
            await self.kv.delete(names.LEADER_KEY, last=revision)
        except KeyWrongLastSequenceError:
            log.debug("%s: the leader key was no longer ours", self._me)
        except BROKER_ERRORS:
            log.warning("%s could not hand leadership over; a standby waits a lease", self._me)

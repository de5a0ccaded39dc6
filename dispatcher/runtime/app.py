"""The live dispatcher: the pure core in an asyncio/NATS runtime, wired from its rooms.

- :mod:`~sluice.dispatcher.runtime.intake`: one long-poll pull task per band;
- :mod:`~sluice.dispatcher.runtime.handoff`: the scheduling loop (sweep, leases, plan,
  concurrent hand-offs, book);
- :mod:`~sluice.dispatcher.runtime.workers`: heartbeats, completions, lost workers;
- :mod:`~sluice.dispatcher.runtime.answers`: typed answers and dead letters;
- :mod:`~sluice.dispatcher.runtime.gauges`: metrics, scale events, stats and wait queries;
- :mod:`~sluice.dispatcher.runtime.configwatch`: run-time admission changes;
- :mod:`~sluice.dispatcher.runtime.cancels`: cancelling queued and running requests;
- :mod:`~sluice.dispatcher.runtime.reconciler`: the books against the workers' reports, on a
  timer and on demand;
- :mod:`~sluice.dispatcher.runtime.election`: leading, or standing by (the leader key);
- here: start and stop, what taking over and stepping down do, and keeping held messages
  alive with in-progress acks.

Any number of dispatchers may run: one leads (pulls and dispatches), the others follow the
heartbeats, completions and cache digests, so that their books and cache index are warm when
one of them takes over. A new leader gets what its predecessor held un-acked redelivered
(within ``ack_wait_s``, a lease by default), adopts what the workers report running, and
looks up the result of every redelivered message before it runs it.

A request's message stays un-acked in its band stream until the request ends (completion or
typed rejection), so a dispatcher crash loses nothing: the next one gets it redelivered, spends
its first ``learn_s`` only listening to heartbeats (which requests are already running where),
and skips requests whose result already exists.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext

from sluice.common.aio import finish_tasks, wait_event
from sluice.common.errors import TransportError
from sluice.common.probes import Probe, nats_state
from sluice.common.transport import connect
from sluice.dispatcher.errors import BrokerUnreachable
from sluice.dispatcher.feedback import WaitFigures
from sluice.dispatcher.leases import LeaseTable
from sluice.dispatcher.routing import RoutingPolicy
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import Answers
from sluice.dispatcher.runtime.cancels import Cancels
from sluice.dispatcher.runtime.configwatch import ConfigWatch
from sluice.dispatcher.runtime.election import Election
from sluice.dispatcher.runtime.gauges import Gauges
from sluice.dispatcher.runtime.handoff import HandOff
from sluice.dispatcher.runtime.intake import Intake
from sluice.dispatcher.runtime.reconciler import Reconciler
from sluice.dispatcher.runtime.renewals import Renewals
from sluice.dispatcher.runtime.settings import DispatcherSettings
from sluice.dispatcher.runtime.state import BROKER_ERRORS, State
from sluice.dispatcher.runtime.streams import ensure_streams
from sluice.dispatcher.runtime.workers import WorkerTraffic
from sluice.dispatcher.scheduler import Scheduler
from sluice.schemas import names

PullLoop = Callable[[JetStreamContext.PullSubscription, int], Coroutine[Any, Any, None]]
"""A pull loop for one leadership term: ``loop(subscription, term)``."""

log = logging.getLogger("sluice.dispatcher")


class Dispatcher:
    """One dispatcher. ``async with Dispatcher(settings) as d:`` runs it until the block ends.

    ``policy`` replaces the routing policy the settings name (for comparisons and tests)."""

    def __init__(
        self,
        settings: DispatcherSettings,
        *,
        nc: NATS | None = None,
        policy: RoutingPolicy | None = None,
    ) -> None:
        self.settings = settings
        self._own_nc = nc is None
        self._state = st = State(settings, policy, time.monotonic())
        st.nc_or_none = nc
        self._renewals = Renewals(st)
        self._answers = Answers(st, self._renewals)
        self._intake = Intake(st, self._answers, self._renewals)
        self._workers = WorkerTraffic(st, self._answers, self._intake)
        self._gauges = Gauges(st)
        self._handoff = HandOff(st, self._answers, self._workers, self._gauges)
        self._config = ConfigWatch(st)
        self._cancels = Cancels(st, self._answers)
        self.reconciler = Reconciler(st, self._answers, self._intake)
        self._election = Election(st, self._promoted, self._deposed)
        self._tasks: list[asyncio.Task[None]] = []
        self._pulls: list[asyncio.Task[None]] = []
        self._subs: list[Subscription] = []

    @property
    def scheduler(self) -> Scheduler:
        return self._state.scheduler

    @property
    def leases(self) -> LeaseTable:
        return self._state.leases

    @property
    def policy(self) -> RoutingPolicy:
        return self._state.policy

    @property
    def nc(self) -> NATS:
        return self._state.nc

    @property
    def leading(self) -> bool:
        """Whether this dispatcher leads now."""
        return self._state.leading()

    @property
    def dispatching(self) -> bool:
        """Whether it leads and is done learning the fleet for this term: it hands off."""
        st = self._state
        return st.leading() and st.leadership.learned

    @property
    def epoch(self) -> int:
        """Its leadership epoch (of its current or last term; 0 if it never led)."""
        return self._state.leadership.epoch

    @property
    def held(self) -> int:
        """Request messages held un-acked (queued or running)."""
        return len(self._state.held)

    def probe(self) -> Probe:
        """For ``/healthz`` and ``/readyz`` (:mod:`sluice.common.probes`): live while it runs,
        its loops run and its NATS connection is not closed; ready while it is also connected,
        leading or standing by."""
        st = self._state
        nats = nats_state(st.nc_or_none)
        ended = [t.get_name() for t in self._tasks if t.done()]
        live = st.running and not ended and nats != "closed"
        detail = {
            "dispatcher": self.settings.dispatcher_id,
            "nats": nats,
            "role": "leader" if st.running and self.leading else "standby",
        }
        if not st.running:
            detail["state"] = "stopped"
        if ended:
            detail["ended"] = ",".join(ended)
        return Probe(live=live, ready=live and nats == "connected", detail=detail)

    def wait_figures(self, model: str, band: str, now: float) -> WaitFigures:
        """The feedback figures of one model and band now."""
        return self._gauges.wait_figures(model, band, now)

    def apply_overrides(self, data: bytes | None) -> bool:
        """Apply a run-time admission configuration (see :class:`ConfigWatch`)."""
        return self._config.apply(data)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Dispatcher:
        st, s = self._state, self.settings
        if st.nc_or_none is None:
            try:
                st.nc_or_none = await connect(
                    s.nats_url,
                    f"sluice-{s.dispatcher_id}",
                    reconnected_cb=self._workers.on_reconnected,
                    disconnected_cb=self._workers.on_disconnected,
                    auth=s.broker_auth(),
                )
            except TransportError as exc:
                raise BrokerUnreachable(str(exc)) from exc
        st.running = True
        try:
            await self._start_parts()
        except BaseException:  # a start that fails leaves nothing behind, its connection too
            await self._halt(hand_back=False)
            raise
        role = "leads" if self.leading else "stands by"
        log.info("dispatcher %s started on %s; it %s", s.dispatcher_id, s.nats_url, role)
        return self

    async def _start_parts(self) -> None:
        st = self._state
        await ensure_streams(st.js, self.settings)
        st.started_s = time.monotonic()
        nc = st.nc
        self._subs = [
            await nc.subscribe(names.HEARTBEAT_SUBJECTS, cb=self._workers.on_heartbeat),
            await nc.subscribe(names.COMPLETION_SUBJECTS, cb=self._workers.on_completion),
            await nc.subscribe(names.STATS_SUBJECT, cb=self._gauges.on_stats),
            await nc.subscribe(names.WORKERS_SUBJECT, cb=self._gauges.on_workers),
            await nc.subscribe(names.WAIT_SUBJECT, cb=self._gauges.on_wait),
            await nc.subscribe(names.CANCEL_SUBJECTS, cb=self._cancels.on_cancel),
            await nc.subscribe(names.RECONCILE_SUBJECT, cb=self.reconciler.on_request),
        ]
        await self._config.start()
        await self._election.start()
        self._task(self._election.loop(), "election")
        self._task(self._config.loop(), "config")
        self._task(self._handoff.loop(), "schedule")
        self._task(self._keepalive_loop(), "keepalive")
        self._task(self.reconciler.loop(), "reconcile")

    # ------------------------------------------------------------------ leadership

    async def _promoted(self) -> None:
        """This dispatcher became leader: start pulling. What the previous leader held
        un-acked comes here within ``ack_wait_s`` of its last in-progress ack (at once after a
        clean hand-over, which naks it); until what the workers report running is booked
        here, it only listens (:meth:`Leadership.may_dispatch`)."""
        st, s = self._state, self.settings
        st.term += 1
        term = st.term
        self._pulls = [t for t in self._pulls if not t.done()]
        pulls: list[tuple[str, str, str, PullLoop]] = [
            (
                f"pull-{band}",
                names.request_stream(band),
                names.dispatcher_consumer(band),
                functools.partial(self._intake.pull_loop, band),
            )
            for band in s.bands
        ]
        pulls.append(
            (
                "pull-renewed",
                names.RENEWED_STREAM,
                names.RENEWED_CONSUMER,
                self._intake.renewed_loop,
            )
        )
        pulls.append(
            (
                "advisories",
                names.ADVISORY_STREAM,
                names.ADVISORY_CONSUMER,
                self._answers.advisory_loop,
            )
        )
        for name, stream, durable, loop in pulls:
            try:
                psub = await st.js.pull_subscribe_bind(durable=durable, stream=stream)
            except BROKER_ERRORS:
                log.warning("pulling %s failed; stepping down", stream, exc_info=True)
                await self._election.resign()
                await self._deposed()
                return
            self._pulls.append(asyncio.create_task(loop(psub, term), name=name))
        st.kick.set()

    async def _deposed(self) -> None:
        """This dispatcher no longer leads: stop pulling and dispatching at once, and forget
        the term's queue, books and held messages (the next leader gets them redelivered)."""
        st = self._state
        st.term += 1  # the pull tasks of the old term end at their next turn
        st.forget_term(time.monotonic())
        self._renewals.forget_term()
        st.kick.set()

    def _task(self, coro: object, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))  # type: ignore[arg-type]

    async def stop(self) -> None:
        """Stop pulling and dispatching. Held requests are handed back (nak) so the next
        dispatcher gets them redelivered at once; it learns from heartbeats which of them are
        running already."""
        await self._halt(hand_back=True)

    async def kill(self) -> None:
        """Stop as a crash would: held requests come back only after ``ack_wait_s``."""
        await self._halt(hand_back=False)

    async def _halt(self, *, hand_back: bool) -> None:
        st = self._state
        if not st.running:
            return
        st.running = False
        st.stopping.set()
        if hand_back:
            # Hand leadership over first (it stops dispatching here at once): a standby takes
            # over while the loops below wind down, not after them.
            await self._election.resign()
        # The loops see the flag within one fetch timeout or tick. nats-py's fetch() does not
        # reliably honour cancellation, so cancel only what has not stopped by then.
        st.kick.set()
        st.wake_pulls()
        try:
            await self._config.stop()
        except BROKER_ERRORS:
            log.debug("config watch already gone")
        await finish_tasks(self._tasks + self._pulls, self.settings.fetch_timeout_s + 1.0)
        self._tasks, self._pulls = [], []
        await finish_tasks(list(st.background), 2.0)
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except BROKER_ERRORS:
                log.debug("subscription already gone")
        self._subs = []
        if hand_back:
            await self._hand_back()  # what it held goes to the next leader at once
        metrics.LEADER.set(0)
        st.held.clear()
        st.copies_held = 0
        metrics.RENEWED_HELD.set(0)
        if st.decisions is not None:
            st.decisions.close()
        if self._own_nc and st.nc_or_none is not None:
            try:
                await st.nc_or_none.close()
            except BROKER_ERRORS:
                log.debug("connection already closed")
            st.nc_or_none = None

    async def _hand_back(self) -> None:
        st = self._state
        lost = 0
        for held in st.held.values():
            try:
                await held.msg.nak()
            except BROKER_ERRORS:
                lost += 1  # it comes back after ack_wait instead
        try:
            await st.nc.flush(timeout=2)
        except BROKER_ERRORS:
            lost = len(st.held)
        if lost:
            log.warning(
                "%d held requests could not be handed back; they return after ack_wait", lost
            )

    async def __aenter__(self) -> Dispatcher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ keep held alive

    async def _keepalive_loop(self) -> None:
        st = self._state
        interval = self.settings.effective_ack_wait_s / 3
        while st.running:
            if await wait_event(st.stopping, interval):
                break
            if not st.leading():
                continue  # a standby holds nothing; a deposed leader forgot what it held
            for held in list(st.held.values()):
                try:
                    await held.msg.in_progress()
                except BROKER_ERRORS:
                    log.debug("in-progress ack of %s failed", held.request_id)
            if st.leading():
                self._renewals.tick()

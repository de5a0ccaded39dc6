"""Feedback out: the gauges (queue depths, waits, rates, expected waits, scale signals,
routing figures), scale events, and the answers to stats and wait queries."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from nats.aio.msg import Msg

from sluice.dispatcher.feedback import WaitFigures
from sluice.dispatcher.planner import HOLD_REASONS
from sluice.dispatcher.quotas import usage_ratios
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import respond
from sluice.dispatcher.runtime.sizing import QueueSizing
from sluice.dispatcher.runtime.state import State
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import (
    BandStats,
    DispatcherStats,
    ScaleEvent,
    WaitEstimate,
    WaitQuery,
    WorkerList,
    WorkerRow,
)

log = logging.getLogger("sluice.dispatcher")

_EXPIRE_EVERY_S = 10.0
_EXPIRE_MAX_BLOCKS = 20_000
"""One expiry pass looks at this many index blocks, on from where the last one stopped (a
sweep): the event loop must not stall."""


_WORKER_GAUGES = (
    metrics.WORKER_LEASE_AGE,
    metrics.WORKER_IN_FLIGHT,
    metrics.WORKER_BOOKED,
    metrics.WORKER_CAPACITY,
    metrics.WORKER_WAITING,
    metrics.WORKER_KV_USED,
    metrics.WORKER_KV_TOTAL,
)


class Gauges:
    """Keeps the metrics current and answers stats and wait queries."""

    def __init__(self, state: State) -> None:
        self.state = state
        self._last_feedback_s = 0.0
        self._spent: dict[str, float] = {}
        self._last_expire_s = 0.0
        self._last_update_s: float | None = None
        self.sizing = QueueSizing(state)
        self._workers: set[str] = set()
        """Workers with per-worker gauges (removed when their lease ends)."""
        self._replica_sizes: set[str] = set()
        self._quota_levels: set[tuple[str, str]] = set()
        self._flaps_seen = (0, 0)
        """The flap meter's (decisions, flaps) already counted in the counters."""

    def update(self, now: float) -> None:
        """Refresh the metrics, at most once per ``gauges_every_s``: the scheduling loop calls
        this on every pass, and under load it passes once per arrival or completion, far more
        often than anyone scrapes."""
        st = self.state
        last = self._last_update_s
        if last is not None and now - last < st.settings.gauges_every_s:
            return
        self._last_update_s = now
        metrics.WORKERS.set(len(st.leases))
        metrics.RENEWED_HELD.set(st.copies_held)
        for snap in st.scheduler.band_snapshots(now):
            metrics.QUEUED.labels(snap.band).set(snap.queued)
            metrics.RUNNING.labels(snap.band).set(snap.running)
        self._engine_gauges(now)
        if now - self._last_feedback_s >= st.settings.feedback_every_s:
            self._last_feedback_s = now
            self._publish_feedback(now)
            if st.leading():  # the leader alone sizes the queues
                self.sizing.tick(now)
            held = st.scheduler.held_by(now)
            for reason in HOLD_REASONS:
                metrics.HELD.labels(reason).set(held.get(reason, 0))
            self._worker_gauges(now)
            self._quota_gauges(now)
            self._count_flaps()
        if now - self._last_expire_s >= _EXPIRE_EVERY_S:
            self._last_expire_s = now
            st.policy.expire(now, max_blocks=_EXPIRE_MAX_BLOCKS)
            stats = st.policy.stats(now)
            metrics.INDEX_BLOCKS.set(stats.index_blocks)
            metrics.INDEX_CAPACITY.set(st.settings.routing_index_max_blocks)
            sizes = {str(n): count for n, count in stats.replica_sets.items()}
            for size in self._replica_sizes | set(sizes):
                metrics.REPLICA_SETS.labels(size).set(sizes.get(size, 0))
            self._replica_sizes |= set(sizes)
            if st.decisions is not None:
                st.decisions.flush()

    def _count_flaps(self) -> None:
        """Carry the flap meter's counts into the counters (PromQL takes their rate)."""
        meter = self.state.scheduler.flaps
        decisions, flaps = self._flaps_seen
        metrics.FLAP_DECISIONS.inc(max(0, meter.decisions - decisions))
        metrics.FLAPS.inc(max(0, meter.flaps - flaps))
        self._flaps_seen = (meter.decisions, meter.flaps)

    def _worker_gauges(self, now: float) -> None:
        """Per leased worker, from its last heartbeat; a worker gone loses its series."""
        st = self.state
        seen = {w for w in st.leases if w in st.heartbeats}
        for worker_id in seen:
            hb = st.heartbeats[worker_id]
            metrics.WORKER_LEASE_AGE.labels(worker_id).set(st.leases.age_s(worker_id, now))
            metrics.WORKER_IN_FLIGHT.labels(worker_id).set(len(hb.in_flight))
            metrics.WORKER_BOOKED.labels(worker_id).set(len(st.scheduler.booked_on(worker_id)))
            metrics.WORKER_CAPACITY.labels(worker_id).set(hb.capacity)
            metrics.WORKER_WAITING.labels(worker_id).set(hb.load.waiting)
            metrics.WORKER_KV_USED.labels(worker_id).set(hb.load.kv_blocks_used)
            metrics.WORKER_KV_TOTAL.labels(worker_id).set(hb.load.kv_blocks_total)
        for worker_id in self._workers - seen:
            for gauge in _WORKER_GAUGES:
                gauge.remove(worker_id)
        self._workers = seen

    def _quota_gauges(self, now: float) -> None:
        """The used share of every level with a limit (names bounded by the configuration)."""
        sched = self.state.scheduler
        config = sched.config
        ratios = {("global", ""): sched.running / max(1, config.global_limit)}
        for snap in sched.band_snapshots(now):
            if snap.band in config.band_limits:
                ratios["band", snap.band] = snap.running / max(1, snap.limit)
        ratios |= usage_ratios(config.quotas, sched.known_models(), sched.usage())
        for (kind, name), ratio in ratios.items():
            metrics.QUOTA_USAGE.labels(kind, name).set(ratio)
        for kind, name in self._quota_levels - set(ratios):  # a limit removed at run time
            metrics.QUOTA_USAGE.remove(kind, name)
        self._quota_levels = set(ratios)

    def wait_figures(self, model: str, band: str, now: float) -> WaitFigures:
        """The feedback figures of one model and band now."""
        st = self.state
        queued, running = st.scheduler.counts().get((model, band), (0, 0))
        return st.feedback.figures(model, band, queued, running, now)

    def _publish_feedback(self, now: float) -> None:
        st = self.state
        counts = st.scheduler.counts()
        for model, band in sorted(set(counts) | set(st.feedback.keys())):
            queued, running = counts.get((model, band), (0, 0))
            f = st.feedback.figures(model, band, queued, running, now)
            metrics.QUEUE_DEPTH.labels(model, band).set(queued)
            expected = math.nan if f.expected_wait_s is None else f.expected_wait_s
            metrics.EXPECTED_WAIT.labels(model, band).set(expected)
            signal = st.advisor.observe(f, now)
            state = st.advisor.state(model, band)
            metrics.SCALE_SIGNAL.labels(model, band).set(
                1 if state == "up" else -1 if state == "down" else 0
            )
            if signal is None or not st.leading():
                continue  # the leader alone signals autoscalers: it sees the queues
            metrics.SCALE_EVENTS.labels(signal.direction).inc()
            log.info("scale %s for %s/%s: %s", signal.direction, model, band, signal.reason)
            event = ScaleEvent(
                dispatcher_id=st.settings.dispatcher_id,
                model=signal.model,
                band=signal.band,
                direction=signal.direction,
                reason=signal.reason,
                expected_wait_s=signal.expected_wait_s,
                at_unix_ms=int(time.time() * 1000),
            )
            st.spawn(st.nc.publish(names.SCALE_EVENTS_SUBJECT, encode(event)), "scale-event")

    async def on_wait(self, msg: Msg) -> None:
        if not self.state.leading():
            return  # only the leader answers: it holds the queues
        try:
            q = decode(msg.data, WaitQuery)
        except DecodeError:
            metrics.BAD_INPUT.labels("wait").inc()
            return
        f = self.wait_figures(q.model, q.band, time.monotonic())
        await respond(msg, encode(WaitEstimate(**dataclasses.asdict(f))))

    def _engine_gauges(self, now: float) -> None:
        for band, row in self.state.scheduler.engine_figures(now).items():
            metrics.ENGINE_DEMAND.labels(band).set(row["demand_s_per_s"])
            spent = row["spent_s"]
            metrics.ENGINE_SECONDS.labels(band).inc(max(0.0, spent - self._spent.get(band, 0.0)))
            self._spent[band] = spent
            if "floor_s_per_s" in row:
                metrics.ENGINE_FLOOR.labels(band).set(row["floor_s_per_s"])
                metrics.ENGINE_IDLE.labels(band).set(row["idle_s_per_s"])

    async def on_stats(self, msg: Msg) -> None:
        st = self.state
        if not st.leading():
            return  # only the leader answers: it holds the queues
        now = time.monotonic()
        engine = st.scheduler.engine_figures(now)
        stats = DispatcherStats(
            dispatcher_id=st.settings.dispatcher_id,
            running=st.scheduler.running,
            global_limit=st.settings.global_limit,
            workers=len(st.leases),
            held=st.scheduler.held_by(now),
            bands=[
                BandStats(
                    band=b.band,
                    queued=b.queued,
                    running=b.running,
                    limit=b.limit,
                    oldest_wait_s=b.oldest_wait_s,
                    engine_demand_s_per_s=engine[b.band]["demand_s_per_s"],
                    engine_floor_s_per_s=engine[b.band].get("floor_s_per_s"),
                    engine_idle_s_per_s=engine[b.band].get("idle_s_per_s"),
                )
                for b in st.scheduler.band_snapshots(now)
            ],
            models=st.scheduler.known_models(),
            leader=True,
            epoch=st.leadership.epoch,
        )
        await respond(msg, encode(stats))

    async def on_workers(self, msg: Msg) -> None:
        """Answer ``sluice.workers``: every worker holding a lease, from its last heartbeat."""
        st = self.state
        now = time.monotonic()
        rows = []
        for worker_id in st.leases:
            hb = st.heartbeats.get(worker_id)
            if hb is None:
                continue
            rows.append(
                WorkerRow(
                    worker_id=worker_id,
                    state=hb.state if hb.state != "serving" or not hb.draining else "draining",
                    models=list(hb.models),
                    capacity=hb.capacity,
                    in_flight=len(hb.in_flight),
                    booked=len(st.scheduler.booked_on(worker_id)),
                    kv_blocks_used=hb.load.kv_blocks_used,
                    kv_blocks_total=hb.load.kv_blocks_total,
                    lease_age_s=st.leases.age_s(worker_id, now),
                )
            )
        reply = WorkerList(dispatcher_id=st.settings.dispatcher_id, workers=rows)
        await respond(msg, encode(reply))

"""The discrete-event replay: a trace, the dispatcher's own scheduler core and a fleet of
simulated engines on a virtual clock (pure and deterministic for a given seed).

Every arrival is enqueued in the same :class:`~sluice.dispatcher.scheduler.Scheduler` the live
dispatcher runs, with the policy a live dispatcher with default settings builds; the workers
report through the agent's own builders and the same glue (:mod:`sluice.dispatcher.feed`);
every engine runs the same cost model as the agent's. Requests' times are measured on the
virtual clock.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sluice.agent import reports
from sluice.agent.engine import Failed, Finished, TokensOut
from sluice.agent.reports import DEFAULT_DIGEST_MIN_TOKENS, DEFAULT_HEARTBEAT_S, DigestBuilder
from sluice.dispatcher import feed
from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.cacheaware import CacheAwareConfig
from sluice.dispatcher.decisions import DecisionLog, decision_record
from sluice.dispatcher.enginetime import EngineTimeConfig
from sluice.dispatcher.policies import flap_meter
from sluice.dispatcher.scheduler import Request, Scheduler
from sluice.dispatcher.stats import percentile, stdev
from sluice.schemas.names import DEFAULT_BANDS
from sluice.sim.engine import SimEngine
from sluice.sim.policies import make_policy
from sluice.sim.profiles import EngineProfile
from sluice.sim.traces import TraceRequest, upper_bound_hits

DECODE_BATCH_REF = 64
"""Batch size assumed when the fleet's capacity is computed for ``--load`` (see
:func:`request_cost_s`)."""


@dataclass(frozen=True)
class ReplayConfig:
    workers: int
    profile: EngineProfile
    capacity: int | None = None
    """Requests each worker takes at once (the scheduler holds the rest). None: twice the
    profile's batch (``max_running``), so that the slots are a safety cap and engine time
    decides (an engine keeps a short queue of its own)."""
    seed: int = 0
    slo_ttft_s: float = 2.0
    slow_workers: int = 0
    """The first this many workers run ``slow_factor`` times slower (a mixed fleet)."""
    slow_factor: float = 1.0
    batch_share: float | None = None
    """The batch band's share of the slots while a more urgent band waits (None: no share)."""
    batch_limit: float | None = None
    """The batch band's hard limit, as a share of the slots (None: only the global limit)."""
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    """How often workers report their load to the scheduler, as the live agents do."""
    batch_floor: float | None = None
    """The batch band's engine-time floor (None: the default, 3 %)."""
    engine_shares: bool = True
    """False: no engine-time floors at all (the admission before issue 10)."""
    tick_s: float = 0.1
    """While requests are queued, plan at least this often (the live dispatcher's tick)."""
    decode_runs: bool = True
    """Step through a stretch of decode steps that finish nothing as one event (the same
    results, several times fewer events); False: one event per engine step."""
    measure_from: int = 0
    """The figures count the trace's requests from this index on: those before it run (a
    warm-up: they fill the caches and teach the policy) but are not measured. The engine
    figures (``util_std``, ``engine``) still count the whole replay."""

    @property
    def slots(self) -> int:
        return self.capacity if self.capacity is not None else 2 * self.profile.max_running


@dataclass
class _Record:
    arrival_s: float
    prompt: int
    band: str
    first_s: float | None = None
    dispatch_s: float | None = None
    finish_s: float | None = None
    cached: int = 0
    rejected: bool = False
    work_s: float = 0.0
    """Its work as ``--load`` counts it (:func:`request_cost_s`)."""


@dataclass
class PolicyResult:
    """The figures of one policy on one trace (the ``policies`` entries of ``--json``)."""

    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    queue_p50_s: float
    queue_p99_s: float
    e2e_p50_s: float
    throughput_rps: float
    goodput_rps: float
    util_std: float
    flap_rate: float
    rejected: int
    bands: dict[str, dict[str, float | int]] = field(default_factory=dict)
    """Per band: submitted, completed, rejected, queue P50/P99 and TTFT P99 (seconds), and
    the engine-seconds dispatched while the trace arrived and in all."""
    engine: dict[str, float] = field(default_factory=dict)
    """The fleet's engine time over the trace's arrival span: supply, dispatched online and
    the idle capacity left (engine-seconds)."""
    busy: list[float] = field(default_factory=list, repr=False)
    load_series: list[tuple[float, list[int]]] = field(default_factory=list, repr=False)
    """(time, running requests per worker), sampled at the emulated heartbeats."""
    ttfts: list[float] = field(default_factory=list, repr=False)
    last_finish_s: float = 0.0
    """When the last measured request finished (virtual time)."""

    def as_json(self) -> dict[str, Any]:
        keys = (
            "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "queue_p50_s", "queue_p99_s",
            "e2e_p50_s", "throughput_rps", "goodput_rps", "util_std", "flap_rate",
        )  # fmt: skip
        out: dict[str, Any] = {k: _round(getattr(self, k)) for k in keys}
        out["rejected"] = self.rejected
        out["bands"] = self.bands
        out["engine"] = self.engine
        return out


def _round(v: float) -> float:
    return round(v, 6) if math.isfinite(v) else v


class _Fleet:
    """The engines, as the policies' :class:`FleetView` sees them (each brought up to the
    replay's clock before it is read: see :class:`_Run`)."""

    def __init__(self, engines: dict[str, SimEngine]) -> None:
        self.engines = engines
        self.settle: Callable[[str], None] = lambda worker_id: None

    def _engine(self, worker_id: str) -> SimEngine:
        self.settle(worker_id)
        return self.engines[worker_id]

    def cached_blocks(self, worker_id: str, hashes: Sequence[int]) -> int:
        return self._engine(worker_id).cache.match(hashes)

    def pending_prefill_blocks(self, worker_id: str) -> int:
        e = self._engine(worker_id)
        return e.pending_prefill_tokens() // e.profile.block_tokens

    def active_blocks(self, worker_id: str) -> int:
        e = self._engine(worker_id)
        return e.active_context_tokens() // e.profile.block_tokens

    def pending_tokens(self, worker_id: str) -> int:
        e = self._engine(worker_id)
        return e.pending_prefill_tokens() + e.remaining_decode_tokens()


@dataclass
class _Run:
    """An engine's stretch of ``steps`` decode steps of ``step_s`` each, started at
    ``start_s``, of which only the last finishes anything (:meth:`SimEngine.decode_run`).

    It is one event at its end instead of one per step. The steps are applied lazily, when
    the engine is read (a heartbeat, a policy that reads engines) or given work: then the
    stretch is cut at the end of the step in progress, where the next step admits the new
    request as it would have. Step ends are sums of the same floats in the same order as one
    event per step makes them, so the times are the same to the last bit."""

    step_s: float
    steps: int
    starts: list[float]
    """When each step starts, and (last) when the run ends: ``starts[i + 1]`` is
    ``starts[i] + step_s``, as one event per step adds them."""
    applied: int = 0
    """Steps applied to the engine so far."""


def request_cost_s(r: TraceRequest, p: EngineProfile) -> float:
    """One request's work on one worker, in seconds, with no cache reuse: its prefill at the
    profile's rate plus its output at the per-sequence decode cost of a batch of
    :data:`DECODE_BATCH_REF`. The fleet's capacity is ``workers`` such seconds per second."""
    per_token = p.decode_per_seq_s + p.decode_base_s / DECODE_BATCH_REF
    return r.input_tokens / p.prefill_tokens_per_s + r.output_tokens * per_token


def scale_to_load(
    trace: Sequence[TraceRequest], load: float, workers: int, p: EngineProfile
) -> list[TraceRequest]:
    """Stretch or compress arrival times so that offered work is ``load`` x fleet capacity."""
    if load <= 0:
        raise ValueError("load must be > 0")
    duration = trace[-1].arrival_s - trace[0].arrival_s
    if duration <= 0:
        return list(trace)
    work = sum(request_cost_s(r, p) for r in trace)
    factor = (work / (load * workers)) / duration
    t0 = trace[0].arrival_s
    return [replace(r, arrival_s=(r.arrival_s - t0) * factor) for r in trace]


def replay(
    trace: Sequence[TraceRequest],
    policy_name: str,
    cfg: ReplayConfig,
    decisions: DecisionLog | None = None,
) -> PolicyResult:
    """Run ``trace`` through the scheduler with ``policy_name`` on ``cfg.workers`` engines.
    ``decisions``: write every routing decision, and every request's outcome, there (each
    line names the policy; ``request_id`` joins a decision with its outcome)."""
    return _Replay(trace, policy_name, cfg, decisions).run()


class _Replay:
    """One replay. The glue is the live dispatcher's: workers report through the agent's own
    heartbeat, digest and completion builders (:mod:`sluice.agent.reports`), and the reports
    reach the scheduler and the policy through :mod:`sluice.dispatcher.feed`. Every planning
    pass plans as the live dispatcher does (a whole plan at once); a simulated worker always
    accepts, since it only gets work when it has room."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy_name: str,
        cfg: ReplayConfig,
        decisions: DecisionLog | None,
    ) -> None:
        self.trace, self.cfg, self.policy_name, self.log = trace, cfg, policy_name, decisions
        block_tokens = trace[0].block_tokens
        profile = replace(cfg.profile, block_tokens=block_tokens)
        # What a live dispatcher with default settings runs, for engines with these blocks.
        self.routing = CacheAwareConfig(block_tokens=block_tokens, explain=decisions is not None)
        self.ids = [f"w{i:02d}" for i in range(cfg.workers)]
        self.fleet = _Fleet({})
        self.policy = make_policy(policy_name, self.fleet, self.ids, cfg.seed, self.routing)
        digests = self.policy.uses_digests
        slow = replace(
            profile,
            prefill_tokens_per_s=profile.prefill_tokens_per_s / cfg.slow_factor,
            decode_base_s=profile.decode_base_s * cfg.slow_factor,
            decode_per_seq_s=profile.decode_per_seq_s * cfg.slow_factor,
        )
        self.engines = {
            w: SimEngine(
                slow if i < cfg.slow_workers else profile,
                every_token=False,
                digest_min_tokens=DEFAULT_DIGEST_MIN_TOKENS if digests else None,
                digest_stride=self.routing.index_stride,
            )
            for i, w in enumerate(self.ids)
        }
        self.fleet.engines = self.engines
        self.fleet.settle = self._settle
        self.runs: dict[str, _Run] = {}
        self.live_seq: dict[str, int] = {}
        """Worker -> the seq of its one valid entry in ``events`` (cut runs leave others)."""
        self.steps = 0
        """Engine steps simulated (a run counts all of its steps)."""
        self.step_events_seen = 0
        """Step ends the loop handled as events (a run is one)."""
        self.index_block_tokens = block_tokens * self.routing.index_stride
        self.digests = (
            {w: DigestBuilder(self.index_block_tokens) for w in self.ids} if digests else {}
        )
        bands = tuple(dict.fromkeys([*DEFAULT_BANDS, *(r.band for r in trace)]))
        self.models = sorted({r.model for r in trace})
        self.sched = Scheduler(
            AdmissionConfig(
                bands=bands,
                global_limit=cfg.workers * cfg.slots,
                band_shares=_batch_slots(cfg.batch_share, cfg, bands),
                band_limits=_batch_slots(cfg.batch_limit, cfg, bands),
                band_floors=_floors(cfg, bands),
            ),
            self.policy,
            models=self.models,
            flaps=flap_meter(self.routing),
            # The engines' nominal marginal costs, as an operator configures them.
            engine_time=EngineTimeConfig(
                prefill_tokens_per_s=profile.prefill_tokens_per_s,
                decode_token_s=profile.decode_per_seq_s + profile.decode_base_s / DECODE_BATCH_REF,
            ),
        )
        self.records = [
            _Record(r.arrival_s, r.input_tokens, r.band, work_s=request_cost_s(r, cfg.profile))
            for r in trace
        ]
        self.busy_until = dict.fromkeys(self.ids, -1.0)
        self.events: list[tuple[float, int, str]] = []  # (time, seq, worker): a step ends
        self.step_events: dict[str, list[TokensOut | Finished | Failed]] = {}
        self.seq = 0
        self.now = 0.0
        self.last_report = -math.inf
        self.beats = 0
        self.series: list[tuple[float, list[int]]] = []
        self.tick_at = math.inf
        self.span_spent: dict[str, float] = {}

    def run(self) -> PolicyResult:
        trace, n, i_next = self.trace, len(self.trace), 0
        hb_s = self.cfg.heartbeat_s
        while i_next < n or self.events or self.tick_at < math.inf:
            t_arrival = trace[i_next].arrival_s if i_next < n else math.inf
            t_event = self._next_event()
            if t_event == math.inf and i_next >= n and self.tick_at == math.inf:
                break
            t_next = min(t_arrival, t_event, self.tick_at)
            if self.runs and t_next - self.last_report >= hb_s and self._beat_in_run(t_next):
                continue
            if t_arrival <= t_event and t_arrival <= self.tick_at:
                i_next = self._arrive(i_next, t_arrival)
                if i_next == n:
                    self.span_spent = dict(self.sched.meter.spent_s)
            elif self.tick_at < t_event:
                self.now, self.tick_at = self.tick_at, math.inf
            else:
                self.now, _, w = heapq.heappop(self.events)
                self._step_ended(w)
            if self.sched.queued:  # nothing to sweep or plan otherwise (most events: saves time)
                for ended in self.sched.sweep(self.now):
                    self.records[int(ended.request.request_id)].rejected = True
            self._heartbeats()
            self._dispatch()
            if self.sched.queued and self.tick_at == math.inf:
                self.tick_at = self.now + self.cfg.tick_s
            self._after_event()
        measured = self.records[self.cfg.measure_from :]
        if not measured:
            raise ValueError(f"measure_from {self.cfg.measure_from}: no request left to measure")
        result = _summarise(measured, self.engines, self.sched.flaps.rate, self.cfg)
        self._engine_figures(result)
        step = max(1, len(self.series) // 400)  # at most ~400 points per chart
        result.load_series = self.series[::step]
        return result

    def _next_event(self) -> float:
        """When the next step ends (dropping the old ends of runs that were cut)."""
        events = self.events
        while events and self.live_seq.get(events[0][2]) != events[0][1]:
            heapq.heappop(events)
        return events[0][0] if events else math.inf

    def _after_event(self) -> None:
        if not self.sched.queued:
            self.tick_at = math.inf
        elif self.runs:
            # While requests wait, every step end plans again (as one event per step does):
            # no engine may skip over one.
            for w in list(self.runs):
                self._cut(w)

    def _engine_figures(self, result: PolicyResult) -> None:
        span = self.trace[-1].arrival_s - self.trace[0].arrival_s
        total = self.sched.meter.spent_s
        floored = self.sched.meter.floors
        supply = self.cfg.workers * span
        online = sum(v for b, v in self.span_spent.items() if b not in floored)
        offered_online = sum(r.work_s for r in self.records if r.band not in floored)
        result.engine = {
            "span_s": _round(span),
            "supply_s": _round(supply),
            "online_s": _round(online),
            "idle_s": _round(max(0.0, supply - online)),
            "idle_offered_s": _round(max(0.0, supply - offered_online)),
        }
        t_end = self.trace[-1].arrival_s
        for band, row in result.bands.items():
            row["engine_span_s"] = _round(self.span_spent.get(band, 0.0))
            row["engine_total_s"] = _round(total.get(band, 0.0))
            row["work_done_span_s"] = _round(
                sum(
                    r.work_s
                    for r in self.records
                    if r.band == band and r.finish_s is not None and r.finish_s <= t_end
                )
            )

    def _arrive(self, i_next: int, now: float) -> int:
        self.now = now
        trace = self.trace
        while i_next < len(trace) and trace[i_next].arrival_s == now:
            r = trace[i_next]
            self.sched.enqueue(
                Request(
                    request_id=str(i_next),
                    band=r.band,
                    model=r.model,
                    tenant=r.tenant,
                    prompt_tokens=r.input_tokens,
                    max_tokens=r.output_tokens,
                    arrived_s=now,
                    deadline_s=None if r.deadline_ms is None else now + r.deadline_ms / 1000,
                    block_hashes=r.block_ids,
                ),
                now,
            )
            i_next += 1
        return i_next

    def _start_step(self, w: str) -> None:
        e = self.engines[w]
        if self.cfg.decode_runs and not self.sched.queued:
            run = e.decode_run()
            if run is not None and run[1] > 1:
                step_s, steps = run
                # The same sums as one event per step makes (accumulate adds in order).
                starts = list(
                    itertools.accumulate(itertools.repeat(step_s, steps), initial=self.now)
                )
                t = starts[-1]
                self.runs[w] = _Run(step_s, steps, starts)
                self.busy_until[w] = t
                self._push(w, t)
                return
        step = e.step()
        self.steps += 1
        if step.duration_s <= 0:
            self.busy_until[w] = -1.0
            return
        self.busy_until[w] = self.now + step.duration_s
        self.step_events[w] = step.events
        self._push(w, self.now + step.duration_s)

    def _push(self, w: str, at_s: float) -> None:
        self.seq += 1
        self.live_seq[w] = self.seq
        heapq.heappush(self.events, (at_s, self.seq, w))

    def _settle(self, w: str) -> None:
        """Apply the steps of ``w``'s run that started by now (see :class:`_Run`)."""
        run = self.runs.get(w)
        if run is None:
            return
        started = bisect.bisect_right(run.starts, self.now, run.applied, run.steps)
        if started <= run.applied:
            return
        e = self.engines[w]
        last = run.steps - 1
        pure = min(started, last) - run.applied
        if pure > 0:
            e.decode_steps(pure, run.step_s)
        if started > last:
            step = e.step()  # the step that finishes someone
            self.step_events[w] = step.events
        run.applied = started

    def _cut(self, w: str) -> None:
        """End ``w``'s run with the step in progress (new work, or requests waiting)."""
        self._settle(w)
        run = self.runs[w]
        if run.applied < run.steps:
            run.steps = run.applied
            self.busy_until[w] = run.starts[run.steps]
            self._push(w, run.starts[run.steps])

    def _beat_in_run(self, t_next: float) -> bool:
        """A heartbeat falls due at a step end inside a run, before the next event: handle
        that step end (the heartbeat is all it does: runs exist only while nothing waits)."""
        hb_s, last = self.cfg.heartbeat_s, self.last_report
        due = math.inf
        for run in self.runs.values():
            # Step ends inside the run are starts[1 : steps]; the first one the heartbeat is
            # due at (the same test as one event per step makes, on the same floats).
            i = bisect.bisect_left(
                run.starts, True, max(run.applied, 1), run.steps, key=lambda t: t - last >= hb_s
            )
            if i < run.steps and run.starts[i] < min(t_next, due):
                due = run.starts[i]
        if due == math.inf:
            return False
        self.now = due
        self._heartbeats()
        self.step_events_seen += 1
        return True

    def _step_ended(self, w: str) -> None:
        self.step_events_seen += 1
        if w in self.runs:
            self._settle(w)
            run = self.runs.pop(w)
            self.steps += run.steps
        now = self.now
        for ev in self.step_events.pop(w, []):
            rec = self.records[int(ev.request_id)]
            if isinstance(ev, TokensOut):
                rec.first_s = now
                continue
            if isinstance(ev, Failed):  # the simulated engine never fails a request
                raise AssertionError(f"simulated engine failed {ev.request_id}: {ev.error}")
            rec.finish_s = now
            rec.cached = ev.cached_tokens
            feed.apply_completion(self.sched, reports.completion(w, ev.request_id, 1, ev), now)
            if self.log is not None:
                self.log.write(
                    {
                        "policy": self.policy_name,
                        "type": "outcome",
                        "request_id": ev.request_id,
                        "worker": w,
                        "cached_tokens": ev.cached_tokens,
                        "ttft_s": round((rec.first_s or now) - rec.arrival_s, 6),
                        "t_s": round(now, 6),
                    }
                )
        self._start_step(w)

    def _dispatch(self) -> None:
        sched, now = self.sched, self.now
        while sched.queued and (planned := sched.plan(now)):
            for d in planned:
                r = d.request
                if not sched.book(d, now):  # a simulated worker accepts every plan at once
                    raise AssertionError(f"decision for {r.request_id} went stale")  # a bug
                self.records[int(r.request_id)].dispatch_s = now
                if self.log is not None:
                    self.log.write({"policy": self.policy_name, **decision_record(d, now)})
                if d.worker_id in self.runs:
                    self._cut(d.worker_id)
                self.engines[d.worker_id].add(
                    r.request_id, r.prompt_tokens, r.max_tokens, r.block_hashes, now
                )
                if self.busy_until[d.worker_id] < 0:
                    self._start_step(d.worker_id)

    def _heartbeats(self) -> None:
        """What the live agents send, every ``heartbeat_s`` of virtual time."""
        now = self.now
        if now - self.last_report < self.cfg.heartbeat_s:
            return
        self.last_report = now
        engines = self.engines
        for w in self.runs:
            self._settle(w)
        self.series.append((now, [engines[w].running + engines[w].waiting for w in self.ids]))
        for w in self.ids:
            e = engines[w]
            builder = self.digests.get(w)
            hb = reports.heartbeat(
                worker_id=w,
                models=self.models,
                seq=self.beats,
                sent_unix_ms=0,
                capacity=self.cfg.slots,
                in_flight=e.in_flight(),
                load=reports.worker_load(e.load()),
                cache=None if builder is None else builder.next(e),
            )
            feed.apply_heartbeat(self.sched, hb, now, index_block_tokens=self.index_block_tokens)
        if self.beats % 60 == 0:
            self.policy.expire(now)
        self.beats += 1


def _batch_slots(share: float | None, cfg: ReplayConfig, bands: Sequence[str]) -> dict[str, int]:
    if share is None or "batch" not in bands:
        return {}
    return {"batch": int(share * cfg.workers * cfg.slots)}


def _floors(cfg: ReplayConfig, bands: Sequence[str]) -> dict[str, float] | None:
    if not cfg.engine_shares:
        return {}
    if cfg.batch_floor is None or "batch" not in bands:
        return None
    return {"batch": cfg.batch_floor}


def _summarise(
    records: list[_Record], engines: dict[str, SimEngine], flap_rate: float, cfg: ReplayConfig
) -> PolicyResult:
    done = [r for r in records if r.finish_s is not None]
    ttft = [r.first_s - r.arrival_s for r in done if r.first_s is not None]
    queue = [r.dispatch_s - r.arrival_s for r in done if r.dispatch_s is not None]
    e2e = [r.finish_s - r.arrival_s for r in done if r.finish_s is not None]
    start = min(r.arrival_s for r in records)
    end = max((r.finish_s for r in done if r.finish_s is not None), default=start)
    span = max(end - start, 1e-9)
    prompt = sum(r.prompt for r in done)
    busy = [e.busy_s / span for e in engines.values()]
    bands: dict[str, dict[str, float | int]] = {}
    for band in sorted({r.band for r in records}):
        mine = [r for r in records if r.band == band]
        ok = [r for r in mine if r.finish_s is not None]
        bands[band] = {
            "submitted": len(mine),
            "completed": len(ok),
            "rejected": sum(1 for r in mine if r.rejected),
            "queue_p50_s": _round(
                percentile([r.dispatch_s - r.arrival_s for r in ok if r.dispatch_s is not None], 50)
            ),
            "queue_p99_s": _round(
                percentile([r.dispatch_s - r.arrival_s for r in ok if r.dispatch_s is not None], 99)
            ),
            "ttft_p99_s": _round(
                percentile([r.first_s - r.arrival_s for r in ok if r.first_s is not None], 99)
            ),
        }
        if bands[band]["submitted"] != bands[band]["completed"] + bands[band]["rejected"]:
            raise AssertionError(f"band {band}: requests unaccounted for")  # a replay bug
    return PolicyResult(
        bands=bands,
        hit_rate=sum(r.cached for r in done) / prompt if prompt else 0.0,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        queue_p50_s=percentile(queue, 50),
        queue_p99_s=percentile(queue, 99),
        e2e_p50_s=percentile(e2e, 50),
        throughput_rps=len(done) / span,
        goodput_rps=sum(1 for t in ttft if t <= cfg.slo_ttft_s) / span,
        util_std=stdev(busy),
        flap_rate=flap_rate,
        rejected=sum(1 for r in records if r.rejected),
        busy=busy,
        ttfts=ttft,
        last_finish_s=end,
    )


def floor(trace: Sequence[TraceRequest], cfg: ReplayConfig) -> dict[str, float]:
    """An ideal fleet: every request finds the whole reusable part of its prefix cached (the
    infinite shared cache's hit) and never queues; its TTFT is the prefill of the rest. Its
    goodput counts the requests within the SLO over the trace's arrival span; it is left out
    when every request arrives at one instant (there is no span to count over)."""
    p = cfg.profile
    hits = upper_bound_hits(trace)
    ttft = [
        max(1, r.input_tokens - h) / p.prefill_tokens_per_s
        for r, h in zip(trace, hits, strict=True)
    ]
    good = sum(1 for t in ttft if t <= cfg.slo_ttft_s)
    span = trace[-1].arrival_s - trace[0].arrival_s
    out = {
        "ttft_p50_s": _round(percentile(ttft, 50)),
        "ttft_p99_s": _round(percentile(ttft, 99)),
        "slo_fraction": _round(good / len(ttft)),
    }
    if span > 0:  # (clamped to 1 ns, a burst's floor was 10^9 requests a second and more)
        out["goodput_rps"] = _round(good / span)
    return out


def add_batch_load(
    trace: Sequence[TraceRequest],
    batch_load: float,
    workers: int,
    profile: EngineProfile,
    seed: int = 0,
) -> list[TraceRequest]:
    """The trace plus an offline stream in the ``batch`` band worth ``batch_load`` x the fleet's
    capacity over the trace's span (counted as :func:`scale_to_load` counts it): unique prompts
    of 500-4,000 tokens, 100-500 output tokens, arrivals spread uniformly at random."""
    if batch_load < 0:
        raise ValueError("batch_load must be >= 0")
    if batch_load == 0:
        return list(trace)
    rng = random.Random(seed + 7919)
    t0, t1 = trace[0].arrival_s, trace[-1].arrival_s
    target = batch_load * workers * max(t1 - t0, 1e-9)
    bt = trace[0].block_tokens
    extra: list[TraceRequest] = []
    work = 0.0
    while work < target:
        r = TraceRequest(
            arrival_s=rng.uniform(t0, t1),
            input_tokens=rng.randint(500, 4000),
            output_tokens=rng.randint(100, 500),
            block_tokens=bt,
            band="batch",
            tenant="offline",
        )
        work += request_cost_s(r, profile)
        extra.append(r)
    return sorted([*trace, *extra], key=lambda r: r.arrival_s)


def upper_bound_hit_rate(trace: Sequence[TraceRequest]) -> float:
    hits = upper_bound_hits(trace)
    return sum(hits) / sum(r.input_tokens for r in trace)

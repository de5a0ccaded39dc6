"""The pure core's cost per scheduling decision, against a minimal dispatcher in the same run.

- :func:`bench_core`: CPU per decision of the pure scheduler (enqueue, plan, book, complete
  with aging, band limits and the routing policy: the cache-aware default, whose requests share
  prefixes, or least-loaded) against a minimal baseline doing the least any dispatcher must
  (strict-priority FIFO queues, round-robin over workers with free capacity) on the same
  request stream, at one fleet size.
- :func:`decision_costs`: the cache-aware decision at several fleet sizes, each with a cache
  index filled as agents' digests fill it, against the same baseline; :func:`cost_table` says
  how far each figure is from its target.
"""

from __future__ import annotations

import gc
import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.cli.benchsizes import CORE_REQUESTS, DECISION_REQUESTS
from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.cacheaware import CacheAwareConfig
from sluice.dispatcher.cacheindex import PureCacheIndex
from sluice.dispatcher.orders import NATIVE as ORDERS_NATIVE
from sluice.dispatcher.policies import build_policy
from sluice.dispatcher.routing import Digest
from sluice.dispatcher.scheduler import Request, Scheduler, WorkerInfo
from sluice.dispatcher.scoring import NATIVE as SCORING_NATIVE
from sluice.schemas.hashing import index_stride
from sluice.schemas.names import DEFAULT_BANDS

TARGET_US_AT_256 = 20.0
"""Issue 14's target: CPU per cache-aware decision at 256 workers and 100,000 indexed blocks."""
TARGET_GROWTH_1024_VS_16 = 2.0
"""Issue 14's target: a decision at 1,024 workers costs at most this many times one at 16."""
BLOCK_TOKENS = 16
_BATCH = 64
"""Arrivals (and completions) between two plans."""

_Stream = list[tuple[str, str, int, tuple[int, ...]]]


@dataclass(frozen=True)
class CoreResult:
    policy: str
    decisions: int
    sluice_us_per_decision: float
    baseline_us_per_decision: float

    @property
    def ratio(self) -> float:
        return self.sluice_us_per_decision / self.baseline_us_per_decision


def _stream(n: int, seed: int) -> _Stream:
    """Requests of 100-4,000 tokens; most start with one of 64 shared 512-token prefixes."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.getrandbits(63) for _ in range(32)) for _ in range(64)]
    out = []
    for i in range(n):
        tokens = rng.randint(100, 4000)
        shared = prefixes[min(63, int(rng.expovariate(0.1)))] if rng.random() < 0.8 else ()
        own = tuple(rng.getrandbits(63) for _ in range(max(0, tokens // 16 - len(shared))))
        out.append((f"r{i}", rng.choice(DEFAULT_BANDS), tokens, (shared + own)[: tokens // 16]))
    return out


def bench_core(
    requests: int = CORE_REQUESTS,
    workers: int = 16,
    capacity: int = 32,
    seed: int = 0,
    policy: str = "cache-aware",
) -> CoreResult:
    """Drive both dispatchers through the same arrivals and completions; CPU time per
    dispatched request. ``policy``: ``cache-aware`` (the default) or ``least-loaded``."""
    stream = _stream(requests, seed)
    limit = workers * capacity
    chooser = build_policy(policy, CacheAwareConfig(), seed)
    sched = Scheduler(
        # No engine-time floors: the baseline has none, and both must make every decision.
        AdmissionConfig(global_limit=limit, band_limits={"batch": limit // 2}, band_floors={}),
        chooser,
        models=["m"],
    )
    for w in range(workers):
        sched.update_worker(WorkerInfo(f"w{w}", frozenset({"m"}), capacity))
        chooser.heartbeat(f"w{w}", None, 0.0)
    rng = random.Random(seed + 1)
    running: list[str] = []
    _fresh_heap()
    t0 = time.process_time()
    decisions = _drive(sched, stream, running, rng, 0.0)
    sluice_s = time.process_time() - t0
    base_us = _baseline_us(stream, workers, capacity, seed)
    return CoreResult(
        policy=policy,
        decisions=decisions,
        sluice_us_per_decision=sluice_s / max(decisions, 1) * 1e6,
        baseline_us_per_decision=base_us,
    )


def _fresh_heap() -> None:
    """Collect now, outside the timing: every measurement starts from the same heap and pays
    no garbage collection an earlier run or its setup left behind."""
    gc.collect()


def _drive(
    sched: Scheduler,
    stream: _Stream,
    running: list[str],
    rng: random.Random,
    now: float,
    phases: dict[str, float] | None = None,
) -> int:
    """Arrivals in batches, as many random completions before each plan; returns decisions.
    ``phases`` (if given) gets the CPU seconds of each part of the cycle (see
    :data:`PHASES`): the routing policy's ``choose`` is timed on its own, inside the plan."""
    clock = time.process_time
    spent = dict.fromkeys(PHASES, 0.0)
    if phases is not None:
        choose = sched.policy.choose

        def timed(*args: Any) -> Any:
            t = clock()
            try:
                return choose(*args)
            finally:
                spent["routing"] += clock() - t

        sched.policy.choose = timed  # type: ignore[assignment]
    decisions = 0
    for i in range(0, len(stream), _BATCH):
        now += 0.01
        t0 = clock()
        for rid, band, tokens, hashes in stream[i : i + _BATCH]:
            sched.enqueue(Request(rid, band, "m", "t", tokens, 128, now, None, hashes), now)
        t1 = clock()
        for _ in range(min(len(running), _BATCH)):
            j = rng.randrange(len(running))
            running[j], running[-1] = running[-1], running[j]
            sched.complete(running.pop())
        t2 = clock()
        planned = sched.plan(now)
        t3 = clock()
        for d in planned:
            sched.book(d, now)
            running.append(d.request.request_id)
            decisions += 1
        t4 = clock()
        spent["enqueue"] += t1 - t0
        spent["complete"] += t2 - t1
        spent["plan"] += t3 - t2
        spent["book"] += t4 - t3
    if phases is not None:
        del sched.policy.choose
        spent["plan"] -= spent["routing"]
        phases.update({k: v / max(decisions, 1) * 1e6 for k, v in spent.items()})
    return decisions


PHASES = ("enqueue", "plan", "routing", "book", "complete")
"""The parts of a scheduling cycle :func:`decision_costs` breaks a decision into: queueing an
arrival, planning (limits, quotas, candidates; without the routing policy), the routing
policy's choice, booking the accepted dispatch, and releasing a completion."""


def _baseline_us(stream: _Stream, workers: int, capacity: int, seed: int) -> float:
    """The minimal dispatcher (strict-priority FIFO, round-robin over workers with room) on
    the same stream: CPU µs per decision."""
    limit = workers * capacity
    queues: dict[str, deque[str]] = {b: deque() for b in DEFAULT_BANDS}
    free = {f"w{w}": capacity for w in range(workers)}
    where: dict[str, str] = {}
    rr = itertools.cycle(list(free))
    rng = random.Random(seed + 1)
    running: list[str] = []
    decisions = 0
    _fresh_heap()
    t0 = time.process_time()
    for i in range(0, len(stream), _BATCH):
        for rid, band, _, _ in stream[i : i + _BATCH]:
            queues[band].append(rid)
        for _ in range(min(len(running), _BATCH)):
            rid = running.pop(rng.randrange(len(running)))
            free[where.pop(rid)] += 1
        for band in DEFAULT_BANDS:
            q = queues[band]
            while q and len(running) < limit:
                wid = next(rr)
                while free[wid] == 0:
                    wid = next(rr)
                free[wid] -= 1
                rid = q.popleft()
                where[rid] = wid
                running.append(rid)
                decisions += 1
    return (time.process_time() - t0) / max(decisions, 1) * 1e6


@dataclass(frozen=True)
class DecisionCosts:
    """CPU per cache-aware decision by fleet size, and the minimal dispatcher's."""

    decision_us: dict[int, float]
    """Worker count -> CPU µs per cache-aware decision."""
    baseline_decision_us: float
    """The minimal FIFO + round-robin dispatcher, same run, same requests (16 workers)."""
    indexed_blocks: int
    """Block hashes in the cache index before the measured decisions."""
    decisions: dict[int, int]
    """Worker count -> decisions measured."""
    phase_us: dict[str, float] = field(default_factory=dict)
    """CPU µs per decision of each part of the cycle (:data:`PHASES`), at 256 workers (or the
    largest count under it), measured in a run of its own."""
    idle_decision_us: dict[int, float] = field(default_factory=dict)
    """Worker count -> CPU µs per decision on an idle fleet (every request done before the
    next arrivals): its workers all tie, which must not make a decision look at them all."""
    phase_workers: int = 0
    """The fleet size of :attr:`phase_us`."""
    burst_decision_us: dict[int, float] = field(default_factory=dict)
    """Worker count -> CPU µs per decision of one plan placing four requests per worker at
    once onto the idle fleet (a burst: every decision moves a worker in the load order)."""
    shared_prompt_decision_us: dict[int, float] = field(default_factory=dict)
    """Worker count -> CPU µs per decision when every worker caches one 2,048-token system
    prompt that every request starts with: every worker holds the prefix and is its replica,
    which must not make a decision look at them all (:func:`_shared_prompt`)."""
    native_index: bool = False
    """Whether the measured policy's cache index was the native one (else the pure Python
    reference: an install without a C compiler)."""
    native_scoring: bool = False
    """Whether the measured policy scored its candidates with the native loop (else the pure
    Python reference)."""
    saturated_decision_us: dict[int, float] = field(default_factory=dict)
    """Worker count -> CPU µs per decision on :attr:`shared_prompt_decision_us`'s fleet with
    every worker over the hard limit (:data:`SATURATED_SHARE` of its slots booked): no
    replica can stick, which a decision must not learn by scoring every replica (it did, and
    grew with the fleet, until docs/BENCHMARKS.md's twenty-second pass)."""
    native_orders: bool = False
    """Whether the scheduler's worker orders were the native ones (else the pure Python
    reference)."""

    def ratio(self, workers: int) -> float:
        """A decision at ``workers`` against the minimal dispatcher's."""
        return self.decision_us[workers] / self.baseline_decision_us

    def growth(self, workers: int, base: int) -> float:
        """A decision at ``workers`` against one at ``base`` workers."""
        return self.decision_us[workers] / self.decision_us[base]

    def shared_growth(self, workers: int, base: int) -> float:
        """:meth:`growth` where every worker caches the system prompt every request starts
        with."""
        shared = self.shared_prompt_decision_us
        return shared[workers] / shared[base]

    def saturated_growth(self, workers: int, base: int) -> float:
        """:meth:`shared_growth` with every worker over the hard limit
        (:data:`SATURATED_SHARE` of its slots booked)."""
        saturated = self.saturated_decision_us
        return saturated[workers] / saturated[base]


def decision_costs(
    worker_counts: Sequence[int] = (16, 256, 1024),
    indexed_blocks: int = 100_000,
    requests: int = DECISION_REQUESTS,
    seed: int = 0,
    capacity: int = 32,
) -> DecisionCosts:
    """CPU per cache-aware decision at each fleet size. Each fleet joined long ago (no worker
    is new), holds ``indexed_blocks`` index entries reported by snapshot digests (its
    requests' shared prefixes on a few workers each, unrelated prompts on the rest), and runs
    a quarter of its capacity before the measured ``requests`` arrive (between two plans as
    many complete as arrive, so it stays that busy). Then the same requests on the same fleet
    idle (each batch done before the next): ``idle_decision_us``."""
    stream = _stream(requests, seed)
    out: dict[int, float] = {}
    idle: dict[int, float] = {}
    burst: dict[int, float] = {}
    shared: dict[int, float] = {}
    saturated: dict[int, float] = {}
    counts: dict[int, int] = {}
    filled = 0
    for n in worker_counts:
        sched, filled = _fleet(n, capacity, indexed_blocks, stream, seed)
        running = _warm(sched, n * capacity // 4, seed)
        rng = random.Random(seed + 1)
        _fresh_heap()
        t0 = time.process_time()
        counts[n] = _drive(sched, stream, running, rng, 0.0)
        out[n] = (time.process_time() - t0) / max(counts[n], 1) * 1e6
        idle[n] = _drive_idle(_fleet(n, capacity, indexed_blocks, stream, seed)[0], stream)
        burst[n] = _burst(_fleet(n, capacity, indexed_blocks, stream, seed)[0], 4 * n, seed)
        shared[n] = _shared_prompt(n, capacity, indexed_blocks, requests, seed)
    phases: dict[str, float] = {}
    at = max([n for n in worker_counts if n <= 256] or [min(worker_counts)])
    sched, _ = _fleet(at, capacity, indexed_blocks, stream, seed)
    running = _warm(sched, at * capacity // 4, seed)
    _fresh_heap()
    _drive(sched, stream, running, random.Random(seed + 1), 0.0, phases)
    base = _baseline_us(stream, 16, capacity, seed)
    native = not isinstance(getattr(sched.policy, "index", None), PureCacheIndex)
    for n in worker_counts:  # last: its fleets are the largest the process builds
        saturated[n] = _shared_prompt(n, capacity, indexed_blocks, requests, seed, SATURATED_SHARE)
    return DecisionCosts(
        out, base, filled, counts, phases, idle, at, burst, shared, native, SCORING_NATIVE,
        saturated, ORDERS_NATIVE,
    )  # fmt: skip


SYSTEM_PROMPT_BLOCKS = 128
"""The shared system prompt of :func:`_shared_prompt`: 2,048 tokens in 16-token blocks."""


def _shared_prompt(
    workers: int,
    capacity: int,
    indexed_blocks: int,
    requests: int,
    seed: int,
    booked_share: float = 0.25,
) -> float:
    """The busy fleet of :func:`decision_costs` where every worker's digest also reports one
    system prompt that every request starts with (2,100-4,000 tokens each), running
    ``booked_share`` of its capacity: CPU µs per decision."""
    rng = random.Random(seed + 5)
    system = tuple(rng.getrandbits(63) for _ in range(SYSTEM_PROMPT_BLOCKS))
    stream: _Stream = []
    for i in range(requests):
        blocks = rng.randint(2100, 4000) // BLOCK_TOKENS
        own = tuple(rng.getrandbits(63) for _ in range(blocks - len(system)))
        stream.append((f"s{i}", rng.choice(DEFAULT_BANDS), blocks * BLOCK_TOKENS, system + own))
    sched, _ = _fleet(workers, capacity, indexed_blocks, stream, seed)
    stride = index_stride(BLOCK_TOKENS, CacheAwareConfig().index_tokens)
    entries = system[stride - 1 :: stride]
    for w in range(workers):  # a delta after _fleet's snapshot: the prompt beside the rest
        sched.policy.heartbeat(f"w{w}", Digest(1, False, entries), -3600.0)
    running = _warm(sched, int(workers * capacity * booked_share), seed)
    _fresh_heap()
    t0 = time.process_time()
    decisions = _drive(sched, stream, running, random.Random(seed + 1), 0.0)
    return (time.process_time() - t0) / max(decisions, 1) * 1e6


SATURATED_SHARE = 0.95
"""The booked share of :attr:`DecisionCosts.saturated_decision_us`'s fleet: every worker over
the routing policy's hard limit (0.9 of its capacity), so that no replica of the system prompt
can stick."""


def _burst(sched: Scheduler, n: int, seed: int) -> float:
    """``n`` requests queued at once onto an idle fleet, placed by one plan: CPU µs per
    decision."""
    for rid, band, tokens, hashes in _stream(n, seed + 4):
        sched.enqueue(Request(rid, band, "m", "t", tokens, 128, 0.0, None, hashes), 0.0)
    _fresh_heap()
    t0 = time.process_time()
    decisions = len(sched.plan(0.0))
    return (time.process_time() - t0) / max(decisions, 1) * 1e6


def _drive_idle(sched: Scheduler, stream: _Stream) -> float:
    """Arrivals in batches on an idle fleet, each batch done before the next: CPU µs per
    decision."""
    decisions, now = 0, 0.0
    t0 = time.process_time()
    for i in range(0, len(stream), _BATCH):
        now += 0.01
        for rid, band, tokens, hashes in stream[i : i + _BATCH]:
            sched.enqueue(Request(rid, band, "m", "t", tokens, 128, now, None, hashes), now)
        planned = sched.plan(now)
        for d in planned:
            sched.book(d, now)
        for d in planned:
            sched.complete(d.request.request_id)
        decisions += len(planned)
    return (time.process_time() - t0) / max(decisions, 1) * 1e6


def _fleet(
    workers: int, capacity: int, indexed_blocks: int, stream: _Stream, seed: int
) -> tuple[Scheduler, int]:
    routing = CacheAwareConfig(block_tokens=BLOCK_TOKENS)
    chooser = build_policy("cache-aware", routing, seed)
    limit = workers * capacity
    sched = Scheduler(
        AdmissionConfig(global_limit=limit, band_limits={"batch": limit // 2}, band_floors={}),
        chooser,
        models=["m"],
    )
    ids = [f"w{w}" for w in range(workers)]
    joined = -3600.0
    for w in ids:
        sched.update_worker(WorkerInfo(w, frozenset({"m"}), capacity, reported_s=joined))
    rng = random.Random(seed + 2)
    stride = index_stride(BLOCK_TOKENS, routing.index_tokens)
    held: dict[str, list[int]] = {w: [] for w in ids}
    # The shared prefixes of the stream, each on 1-4 workers, as their digests report them.
    shared = {hashes[:32] for _, _, _, hashes in stream if len(hashes) >= 32}
    distinct: set[int] = set()
    for prefix in sorted(shared):
        entries = prefix[stride - 1 :: stride]
        distinct.update(entries)
        for w in rng.sample(ids, min(len(ids), rng.randint(1, 4))):
            held[w].extend(entries)
    # Unrelated cached prompts fill the rest: chains of 4-64 index entries on one worker each.
    while len(distinct) < indexed_blocks:
        chain = [
            rng.getrandbits(63)
            for _ in range(min(rng.randint(4, 64), indexed_blocks - len(distinct)))
        ]
        held[rng.choice(ids)].extend(chain)
        distinct.update(chain)
    for w in ids:
        chooser.heartbeat(w, Digest(0, True, tuple(held[w])), joined)
    return sched, len(getattr(chooser, "index", ()))


def _warm(sched: Scheduler, target: int, seed: int) -> list[str]:
    """Fill the fleet to ``target`` running requests (not measured); returns them."""
    running: list[str] = []
    rng = random.Random(seed + 3)
    now = -1.0
    for i in range(0, target, 1024):
        for j in range(i, min(target, i + 1024)):
            # No prompt blocks: the warm-up adds load, not index entries.
            band = rng.choice(DEFAULT_BANDS)
            request = Request(f"warm{j}", band, "m", "t", rng.randint(100, 4000), 128, now)
            sched.enqueue(request, now)
        for d in sched.plan(now):
            sched.book(d, now)
            running.append(d.request.request_id)
    return running


def cost_table(costs: DecisionCosts) -> list[tuple[str, str, str, str]]:
    """Rows of (figure, value, against the minimal dispatcher, against its target)."""
    rows = []
    for n, us in sorted(costs.decision_us.items()):
        target = ""
        if n == 256:
            target = f"target <= {TARGET_US_AT_256:.0f} us: {us / TARGET_US_AT_256:.2f}x of it"
        rows.append(
            (
                f"cache-aware decision, {n:,} workers",
                f"{us:.1f} us",
                f"{costs.ratio(n):.1f}x",
                target,
            )
        )
    for phase, us in costs.phase_us.items():
        rows.append((f"  {costs.phase_workers:,} workers: {phase}", f"{us:.1f} us", "", ""))
    for n, us in sorted(costs.idle_decision_us.items()):
        rows.append((f"the same, idle fleet, {n:,} workers", f"{us:.1f} us", "", ""))
    for n, us in sorted(costs.burst_decision_us.items()):
        rows.append((f"one plan of {4 * n:,} onto {n:,} idle workers", f"{us:.1f} us", "", ""))
    for n, us in sorted(costs.shared_prompt_decision_us.items()):
        label = f"a system prompt on all {n:,} workers"
        rows.append((label, f"{us:.1f} us", f"{us / costs.baseline_decision_us:.1f}x", ""))
    for n, us in sorted(costs.saturated_decision_us.items()):
        label = f"the same, {SATURATED_SHARE:.0%} booked (none can stick), {n:,} workers"
        rows.append((label, f"{us:.1f} us", f"{us / costs.baseline_decision_us:.1f}x", ""))
    rows.append(("minimal FIFO + round-robin", f"{costs.baseline_decision_us:.2f} us", "1.0x", ""))
    most = TARGET_GROWTH_1024_VS_16
    if 16 in costs.decision_us and 1024 in costs.decision_us:
        g = costs.growth(1024, 16)
        row = ("1,024 workers / 16 workers", f"{g:.2f}x", "")
        rows.append((*row, f"target <= {most:.0f}x: {g / most:.2f}x of it"))
    if {16, 1024} <= costs.shared_prompt_decision_us.keys():
        g = costs.shared_growth(1024, 16)
        row = ("the same, a system prompt on all", f"{g:.2f}x", "")
        rows.append((*row, f"target <= {most:.0f}x: {g / most:.2f}x of it"))
    if {16, 1024} <= costs.saturated_decision_us.keys():
        g = costs.saturated_growth(1024, 16)
        row = (f"the same, {SATURATED_SHARE:.0%} booked", f"{g:.2f}x", "")
        rows.append((*row, f"target <= {most:.0f}x: {g / most:.2f}x of it"))
    return rows


def print_costs(costs: DecisionCosts, echo: Callable[[str], object] = print) -> None:
    """Print :func:`cost_table` as aligned text through ``echo``."""
    rows = [("figure", "CPU", "vs minimal", "vs target"), *cost_table(costs)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    kind = "native" if costs.native_index else "pure Python (the native index was not built)"
    echo(f"cache index before the measured decisions: {costs.indexed_blocks:,} blocks ({kind})")
    loop = "native" if costs.native_scoring else "pure Python (the native loop was not built)"
    echo(f"scoring loop: {loop}")
    orders = "native" if costs.native_orders else "pure Python (the native orders were not built)"
    echo(f"worker orders: {orders}")
    for r in rows:
        echo("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())

"""``sluice bench``: what the dispatcher itself costs, against baselines measured in the same run.

- ``core``: CPU per scheduling decision of the pure scheduler (enqueue, plan, book, complete
  with aging, band limits and the routing policy: the cache-aware default, whose requests share
  prefixes, or least-loaded) against a minimal baseline
  doing the least any dispatcher must (strict-priority FIFO queues, round-robin over workers with
  free capacity) on the same request stream.
- ``live``: in :mod:`sluice.cli.benchlive` (a fleet of processes).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.cacheaware import CacheAwareConfig
from sluice.dispatcher.policies import build_policy
from sluice.dispatcher.scheduler import Request, Scheduler, WorkerInfo
from sluice.schemas.names import DEFAULT_BANDS


@dataclass(frozen=True)
class CoreResult:
    policy: str
    decisions: int
    sluice_us_per_decision: float
    baseline_us_per_decision: float

    @property
    def ratio(self) -> float:
        return self.sluice_us_per_decision / self.baseline_us_per_decision


def _stream(n: int, seed: int) -> list[tuple[str, str, int, tuple[int, ...]]]:
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
    requests: int = 50_000,
    workers: int = 16,
    capacity: int = 32,
    seed: int = 0,
    policy: str = "cache-aware",
) -> CoreResult:
    """Drive both dispatchers through the same arrivals and completions; CPU time per
    dispatched request. ``policy``: ``cache-aware`` (the default) or ``least-loaded``."""
    stream = _stream(requests, seed)
    limit = workers * capacity

    # --- sluice
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
    decisions = 0
    t0 = time.process_time()
    now = 0.0
    for i in range(0, requests, 64):
        now += 0.01
        for rid, band, tokens, hashes in stream[i : i + 64]:
            sched.enqueue(Request(rid, band, "m", "t", tokens, 128, now, None, hashes), now)
        for _ in range(min(len(running), 64)):
            sched.complete(running.pop(rng.randrange(len(running))))
        for d in sched.plan(now):
            sched.book(d, now)
            running.append(d.request.request_id)
            decisions += 1
    sluice_s = time.process_time() - t0

    # --- baseline: strict-priority FIFO, round-robin over workers with room
    queues: dict[str, deque[str]] = {b: deque() for b in DEFAULT_BANDS}
    free = {f"w{w}": capacity for w in range(workers)}
    where: dict[str, str] = {}
    rr = itertools.cycle(list(free))
    rng = random.Random(seed + 1)
    running_b: list[str] = []
    base_decisions = 0
    t0 = time.process_time()
    for i in range(0, requests, 64):
        for rid, band, _, _ in stream[i : i + 64]:
            queues[band].append(rid)
        for _ in range(min(len(running_b), 64)):
            rid = running_b.pop(rng.randrange(len(running_b)))
            free[where.pop(rid)] += 1
        for band in DEFAULT_BANDS:
            q = queues[band]
            while q and len(running_b) < limit:
                wid = next(rr)
                while free[wid] == 0:
                    wid = next(rr)
                free[wid] -= 1
                rid = q.popleft()
                where[rid] = wid
                running_b.append(rid)
                base_decisions += 1
    base_s = time.process_time() - t0
    return CoreResult(
        policy=policy,
        decisions=decisions,
        sluice_us_per_decision=sluice_s / max(decisions, 1) * 1e6,
        baseline_us_per_decision=base_s / max(base_decisions, 1) * 1e6,
    )

"""``sluice bench-failover``: how long the fleet goes without a dispatcher when its leader dies.

One embedded nats-server, simulated agents in this process, two dispatcher processes
(``python -m sluice.cli dispatcher``) with the default settings but a global limit of 16 (so
that requests queue). Each run keeps the agents busy, kills the leading dispatcher with SIGKILL
and measures, at the agents (a tap on ``sluice.work.*``), the time from the kill to the first
assignment of the new leader; the killed one is restarted as the next standby. Every process is
stopped by its PID at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from tempfile import TemporaryDirectory

from nats.aio.msg import Msg

from sluice.client import Client
from sluice.dispatcher.stats import percentile
from sluice.schemas import names
from sluice.schemas.codec import decode
from sluice.schemas.models import Assignment, LeaderLease
from sluice.testing.cluster import LocalCluster
from sluice.testing.natsserver import EmbeddedNats
from sluice.testing.processes import DIE_WITH_PARENT, SLUICE, stop_processes

_PROMPT = list(range(9000, 9128))
_DISPATCHER = [*SLUICE, "dispatcher"]
_GLOBAL_LIMIT = 16
"""Below what the agents could take, so that requests queue: there is work to dispatch when
the leader dies."""


@dataclass
class FailoverFigures:
    """Seconds from each kill to the new leader's first dispatch."""

    takeovers_s: list[float] = field(default_factory=list)
    requests: int = 0
    runs_at_agents: int = 0
    """Requests completed by the agents: equal to ``requests`` when nothing ran twice."""
    failed: int = 0
    """Requests without a successful result (lost or rejected)."""

    @property
    def min_s(self) -> float:
        return min(self.takeovers_s)

    @property
    def median_s(self) -> float:
        return percentile(self.takeovers_s, 50)

    @property
    def max_s(self) -> float:
        return max(self.takeovers_s)


@dataclass
class _Tap:
    assignments: list[tuple[float, str]] = field(default_factory=list)
    leader: str = ""

    async def on_work(self, msg: Msg) -> None:
        self.assignments.append((time.monotonic(), decode(msg.data, Assignment).dispatcher_id))

    async def on_leader(self, msg: Msg) -> None:
        self.leader = decode(msg.data, LeaderLease).dispatcher_id

    def dispatched_after(self, t0: float, not_from: str) -> bool:
        return self.first_after(t0, not_from) > 0

    def first_after(self, t0: float, not_from: str) -> float:
        """When another dispatcher than ``not_from`` first dispatched after ``t0`` (0: not yet)."""
        return min((t for t, d in self.assignments if t > t0 and d != not_from), default=0.0)


def _start(nats_url: str, dispatcher_id: str, logs: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SLUICE_NATS_URL": nats_url,
        "SLUICE_DISPATCHER_DISPATCHER_ID": dispatcher_id,
        "SLUICE_DISPATCHER_MODELS": '["sim"]',
        "SLUICE_DISPATCHER_GLOBAL_LIMIT": str(_GLOBAL_LIMIT),
    }
    with (logs / f"{dispatcher_id}.log").open("ab") as log:
        return subprocess.Popen(
            _DISPATCHER, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=DIE_WITH_PARENT
        )


async def _until(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the fleet did not get there in time")
        await asyncio.sleep(0.05)


async def bench_failover(runs: int = 5, workers: int = 4) -> FailoverFigures:
    """Kill the leader ``runs`` times under load; the takeover times."""
    figures = FailoverFigures()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with EmbeddedNats() as server, TemporaryDirectory() as tmp:
        logs = Path(tmp)
        cluster = LocalCluster(
            server.url, workers=workers, with_dispatcher=False, agent={"speed": 20.0}
        )
        tap = _Tap()
        try:
            async with cluster, Client(server.url) as c:
                await c.nc.subscribe("sluice.work.*", cb=tap.on_work)
                await c.nc.subscribe(names.LEADER_SUBJECT, cb=tap.on_leader)
                for name in ("d-0", "d-1"):
                    procs[name] = _start(server.url, name, logs)
                    await _until(lambda: bool(tap.leader), 30)
                for run in range(runs):
                    await _until(lambda: tap.leader in procs, 30)
                    leader = tap.leader
                    await asyncio.sleep(5.0)  # the standby follows for learn_s (one lease)
                    handles = [
                        await c.submit("sim", _PROMPT, max_tokens=4000, request_id=f"f{run}-{i}")
                        for i in range(_GLOBAL_LIMIT * 3)
                    ]
                    await _until(lambda: any(a.in_flight for a in cluster.agents), 30)
                    await asyncio.sleep(1.0)
                    killed_at = time.monotonic()
                    os.kill(procs[leader].pid, signal.SIGKILL)
                    procs[leader].wait(5)
                    await _until(partial(tap.dispatched_after, killed_at, leader), 60)
                    figures.takeovers_s.append(tap.first_after(killed_at, leader) - killed_at)
                    for h in handles:
                        figures.failed += not (await h.result(timeout_s=120)).ok
                    figures.requests += len(handles)
                    procs[leader] = _start(server.url, leader, logs)  # the next standby
                await asyncio.sleep(1.0)  # a second run of anything would finish meanwhile
                figures.runs_at_agents = sum(a.completed for a in cluster.agents)
        finally:
            stop_processes(procs.values())
    return figures

"""``sluice bench-lease``: from a worker going silent to its quota reclaimed.

An embedded nats-server, a dispatcher and simulated agents in this process; each run fills
one worker with long requests, then cuts that agent off without a word (its NATS connection is
closed under it: no heartbeat, no leaving notice, as a worker whose machine died) and measures
the time until the dispatcher has released every booking of that worker (its requests queued
again elsewhere, their quota back). The lease (``lease_s``) decides it; the figure says how
much the expiry check adds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

from sluice.client import Client
from sluice.dispatcher.scheduler import Scheduler
from sluice.testing.cluster import LocalCluster
from sluice.testing.natsserver import EmbeddedNats

PROMPT = list(range(4000, 4064))


@dataclass(frozen=True)
class LeaseFigures:
    lease_s: float
    reclaimed_s: list[float]
    """Per run: the silence to every booking of the silent worker released."""

    @property
    def min_s(self) -> float:
        return min(self.reclaimed_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.reclaimed_s)

    @property
    def max_s(self) -> float:
        return max(self.reclaimed_s)


async def _until_booked(
    scheduler: Scheduler, worker_id: str, booked: bool, timeout_s: float
) -> None:
    """Poll every 5 ms (the figure's resolution) until the worker has bookings its agent
    accepted (``booked``: no offer in flight, which cut off would end at the offer's
    timeout, not at the lease) or has none."""
    deadline = time.monotonic() + timeout_s

    def there() -> bool:
        if not booked:
            return not scheduler.booked_on(worker_id)
        return bool(scheduler.booked_on(worker_id)) and scheduler.reserved == 0

    while not there():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{worker_id} still {'un' if booked else ''}booked after {timeout_s:g} s"
            )
        await asyncio.sleep(0.005)  # the scheduler has no event to wait on: poll


async def bench_lease(
    runs: int = 5, lease_s: float = 4.0, heartbeat_s: float = 1.0
) -> LeaseFigures:
    """``runs`` silences, each on a fresh worker (the silent one is replaced)."""
    out: list[float] = []
    with EmbeddedNats() as nats:
        cluster = LocalCluster(
            nats.url,
            workers=2,
            dispatcher={"models": ["sim"], "lease_s": lease_s, "learn_s": 0.3},
            agent={"models": ["sim"], "speed": 20.0, "heartbeat_s": heartbeat_s, "capacity": 8},
        )
        async with cluster, Client(nats.url) as c:
            d = cluster.dispatcher
            for run in range(runs):
                victim = cluster.agents[0]
                handles = [
                    await c.submit("sim", PROMPT, max_tokens=200_000, request_id=f"l{run}-{i}")
                    for i in range(8)
                ]
                await _until_booked(d.scheduler, victim.worker_id, True, 30.0)
                silent_at = time.monotonic()
                await victim.nc.close()  # cut off: no heartbeat, no leaving notice
                await _until_booked(d.scheduler, victim.worker_id, False, 60.0)
                out.append(time.monotonic() - silent_at)
                for h in handles:  # this run's work is not needed: cancel it everywhere
                    await h.cancel()
                cluster.agents.remove(victim)
                await victim.stop(drain=False)
                await cluster.add_agent(f"worker-r{run}")
                cluster.agents.insert(0, cluster.agents.pop())
    return LeaseFigures(lease_s, out)

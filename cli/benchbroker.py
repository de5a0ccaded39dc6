"""``sluice bench-broker-failover``: how long submits stall when a node of a three-node JetStream
cluster is killed.

Each run starts a fresh :class:`~sluice.testing.natsserver.NatsCluster`, creates Sluice's
streams at R3 (no dispatcher: only the publish path is measured), starts a submit
(``Client.enqueue``, default client settings unless given) every ``interval_s``, each as its
own task, and after ``warmup_s`` SIGKILLs the leader of the standard band's stream (or the
JetStream meta leader, or the node the client is connected to). It records the time from the
kill to the acknowledgement of the first submit *started after* the kill ("next accepted
publish"), the longest a single submit took (those in flight at the kill ride out the
election in ``Client._publish``'s retry), and the submits that failed (none should).
Wall-clock figures: recorded in docs/BENCHMARKS.md, never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from sluice.client import Client, SluiceError
from sluice.client.settings import DEFAULT_PUBLISH_TIMEOUT_S
from sluice.dispatcher.runtime import DispatcherSettings
from sluice.dispatcher.runtime.streams import ensure_streams
from sluice.schemas import names
from sluice.testing.natsserver import NatsCluster

PROMPT = list(range(100, 164))
TARGETS = ("stream-leader", "meta-leader", "client-node")


class BenchError(Exception):
    """A failover run could not be measured (no leader, no submit accepted after the kill)."""


@dataclass
class _Submit:
    started: float
    ended: float | None = None
    error: str | None = None


@dataclass
class FailoverRun:
    """One run: which node was killed and what the producers saw."""

    killed: str
    client_on_killed: bool
    next_accepted_s: float
    longest_submit_s: float
    accepted: int
    failed: int
    errors: list[str] = field(default_factory=list)


async def _one_run(
    target: str, interval_s: float, warmup_s: float, publish_timeout_s: float | None
) -> FailoverRun:
    with NatsCluster(3) as cluster:
        timeout = DEFAULT_PUBLISH_TIMEOUT_S if publish_timeout_s is None else publish_timeout_s
        async with Client(cluster.url, publish_timeout_s=timeout) as client:
            js = client.nc.jetstream()
            await ensure_streams(js, DispatcherSettings(nats_url=cluster.url, stream_replicas=3))
            submits: list[_Submit] = []
            tasks: set[asyncio.Task[None]] = set()
            killed: list[float] = []  # when the node was killed, once it was
            recovered = asyncio.Event()  # a submit started after the kill was accepted

            async def submit(k: int) -> None:
                s = _Submit(time.monotonic())
                submits.append(s)
                try:
                    await client.enqueue("sim", PROMPT, max_tokens=4, request_id=f"f{k}")
                except SluiceError as exc:
                    s.error = str(exc)
                s.ended = time.monotonic()
                if s.error is None and killed and s.started >= killed[0]:
                    recovered.set()

            async def launch(until: asyncio.Event) -> None:
                k = 0
                while not until.is_set():
                    t = asyncio.create_task(submit(k))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    k += 1
                    await asyncio.sleep(interval_s)

            done = asyncio.Event()
            launcher = asyncio.create_task(launch(done))
            await asyncio.sleep(warmup_s)
            victim = await _victim(cluster, client, target)
            url = client.nc.connected_url
            on_killed = url is not None and url.port == cluster.nodes[victim].client_port
            cluster.kill(victim)
            killed_at = time.monotonic()
            killed.append(killed_at)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(recovered.wait(), timeout=60.0)
            await asyncio.sleep(0.5)
            done.set()
            await launcher
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=30.0)
    first = _accepted_after(submits, killed_at)
    if first is None:
        raise BenchError(f"no submit accepted within 60 s of killing {cluster.nodes[victim].name}")
    ended = [s for s in submits if s.ended is not None]
    failed = [s for s in ended if s.error is not None]
    return FailoverRun(
        killed=cluster.nodes[victim].name,
        client_on_killed=on_killed,
        next_accepted_s=first - killed_at,
        longest_submit_s=max(s.ended - s.started for s in ended if s.ended is not None),
        accepted=len(ended) - len(failed),
        failed=len(failed),
        errors=[s.error for s in failed[:3] if s.error],
    )


async def _victim(cluster: NatsCluster, client: Client, target: str) -> int:
    if target == "meta-leader":
        return cluster.index_of(cluster.meta_leader())
    if target == "client-node":
        url = client.nc.connected_url
        for node in cluster.nodes:
            if url is not None and url.port == node.client_port:
                return node.index
        raise BenchError(f"the client is connected to no node of the cluster ({url})")
    js = client.nc.jetstream()
    info = await js.stream_info(names.request_stream("standard"))
    if info.cluster is None or not info.cluster.leader:
        raise BenchError("the standard band's stream reports no leader")
    return cluster.index_of(info.cluster.leader)


def _accepted_after(submits: list[_Submit], t0: float) -> float | None:
    """When the first submit started after ``t0`` was acknowledged (None: none yet)."""
    acks = [s.ended for s in submits if s.started >= t0 and s.ended is not None and not s.error]
    return min(acks) if acks else None


async def bench_broker_failover(
    runs: int,
    target: str,
    interval_s: float,
    warmup_s: float,
    publish_timeout_s: float | None = None,
) -> list[FailoverRun]:
    """``runs`` runs, each on a fresh cluster."""
    if target not in TARGETS:
        raise BenchError(f"--target is one of {', '.join(TARGETS)}, not {target!r}")
    return [await _one_run(target, interval_s, warmup_s, publish_timeout_s) for _ in range(runs)]

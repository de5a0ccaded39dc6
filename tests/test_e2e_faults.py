"""Nothing is lost: a worker or a dispatcher dies mid-request (real nats-server)."""

from __future__ import annotations

import asyncio

import pytest

from sluice.client import Client
from sluice.cluster import LocalCluster
from sluice.dispatcher import Dispatcher

from .conftest import cluster_kwargs

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

PROMPT = list(range(5000, 5128))


async def test_worker_death_reruns_request_elsewhere_with_one_result(nats_url: str) -> None:
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=2)) as cluster,
        Client(nats_url) as c,
    ):
        handle = await c.submit("sim", PROMPT, max_tokens=3000, request_id="long-one")
        streamed: list[int] = []
        stream = handle.__aiter__()
        first = await anext(stream)
        streamed += first.tokens
        victim = next(a for a in cluster.agents if a.in_flight)
        await victim.kill()  # no drain, no goodbye: only the lease tells

        async for chunk in stream:
            streamed += chunk.tokens
        result = await handle.result(timeout_s=30)

    assert result.ok
    assert result.attempt == 2
    assert result.worker_id != victim.worker_id
    assert len(result.output_tokens) == 3000
    assert streamed == result.output_tokens  # the client stitched both attempts seamlessly


async def test_dispatcher_restart_loses_nothing(nats_url: str) -> None:
    kw = cluster_kwargs(workers=2, dispatcher={"global_limit": 4})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        handles = [
            await c.submit("sim", PROMPT, max_tokens=400, request_id=f"r{i}") for i in range(12)
        ]
        await asyncio.sleep(0.5)  # some run, some wait in the dispatcher
        assert cluster.dispatcher.scheduler.running > 0
        await cluster.dispatcher.stop()
        successor = Dispatcher(cluster.dispatcher_settings)
        cluster.dispatcher = successor
        await successor.start()
        results = [await h.result(timeout_s=60) for h in handles]
        await asyncio.sleep(0.5)
        runs = sum(a.completed for a in cluster.agents)

    assert all(r.ok for r in results)
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(12))
    assert runs == 12, f"{runs} runs for 12 requests: a running request was started again"


async def test_dispatcher_crash_redelivers_after_ack_wait(nats_url: str) -> None:
    kw = cluster_kwargs(workers=1, dispatcher={"global_limit": 1, "ack_wait_s": 1.5})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        blocker = await c.submit("sim", PROMPT, max_tokens=300, request_id="running")
        waiting = await c.submit("sim", PROMPT, max_tokens=10, request_id="waiting")
        await asyncio.sleep(0.4)
        await cluster.dispatcher.kill()  # held requests are neither acked nor handed back
        successor = Dispatcher(cluster.dispatcher_settings)
        cluster.dispatcher = successor
        await successor.start()
        r1 = await blocker.result(timeout_s=30)
        r2 = await waiting.result(timeout_s=30)
    assert r1.ok and r2.ok

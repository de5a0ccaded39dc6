"""A producer who is told: a request held in the queue gets a ``QueuedNotice`` (where it
stands, its expected wait, what holds it) before its first token; stats and metrics say which
layer holds every queued request; ``submit(retry=...)`` retries a full queue after its
retry-after and stops after its bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.client import Client, InvalidRequest, QueueFull, Retry
from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.quotas import ModelQuota, Quotas
from sluice.dispatcher.routing import LeastLoaded
from sluice.dispatcher.scheduler import Dispatch, Request, Scheduler, WorkerInfo
from sluice.schemas.models import QueuedNotice, Result
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs, eventually

# ----------------------------------------------------------------------------- pure parts


def _r(rid: str, band: str = "standard", tenant: str = "t", model: str = "m") -> Request:
    return Request(rid, band, model, tenant, 100, 10, 0.0)


def test_the_hold_reason_names_the_first_layer_without_room() -> None:
    quotas = Quotas(models={"m": ModelQuota(tenant_limits={"t": 1})})
    s = Scheduler(
        AdmissionConfig(global_limit=3, band_limits={"batch": 1}, quotas=quotas),
        LeastLoaded(),
        models=["m", "other"],
    )
    s.enqueue(_r("a"), 0.0)
    assert s.hold_reason("a", 0.0) == "no-worker-room"  # no worker at all
    s.update_worker(WorkerInfo("w", frozenset({"m"}), 4))
    assert s.hold_reason("a", 0.0) == "queue"  # room everywhere: only the queue ahead
    assert s.position("a") == 1
    assert s.book(Dispatch(_r("a"), "w"), 0.0)
    s.enqueue(_r("b"), 0.0)
    assert s.hold_reason("b", 0.0) == "quota:model-tenant"  # tenant t's quota of 1 is taken
    s.enqueue(_r("c", tenant="u"), 0.0)
    assert s.hold_reason("c", 0.0) == "queue"
    s.enqueue(_r("x", band="batch", tenant="u"), 0.0)
    s.enqueue(_r("y", band="batch", tenant="v"), 0.0)
    assert s.book(Dispatch(_r("x", band="batch", tenant="u"), "w"), 0.0)
    assert s.hold_reason("y", 0.0) == "band-limit"  # batch is capped at 1
    assert s.book(Dispatch(_r("c", tenant="u"), "w"), 0.0)
    assert s.hold_reason("b", 0.0) == "global-limit"  # 3 of 3 running
    s.enqueue(_r("o", model="other"), 0.0)
    assert s.held_by(0.0) == {"global-limit": 3}
    assert s.hold_reason("gone", 0.0) is None and s.position("gone") is None


def test_positions_follow_the_priority_order_of_a_queue() -> None:
    s = Scheduler(AdmissionConfig(), LeastLoaded(), models=["m"])
    for i in range(4):
        s.enqueue(Request(f"r{i}", "standard", "m", "t", 10, 10, float(i)), float(i))
    assert [s.position(f"r{i}") for i in range(4)] == [1, 2, 3, 4]
    s.cancel("r1")
    assert [s.position(f"r{i}") for i in (0, 2, 3)] == [1, 2, 3]


def test_retry_waits_the_retry_after_with_bounded_jitter() -> None:
    import random

    rng = random.Random(1)
    policy = Retry(attempts=2, jitter=0.25, max_wait_s=5.0)
    waits = [policy.delay(2.0, rng) for _ in range(200)]
    assert all(1.5 <= w <= 2.5 for w in waits) and max(waits) - min(waits) > 0.5
    assert policy.delay(100.0, rng) == 5.0
    with pytest.raises(ValueError):
        Retry(jitter=1.0)
    with pytest.raises(ValueError):
        Retry(attempts=-1)


# ----------------------------------------------------------------------------- live


def _prompt(i: int) -> list[int]:
    return list(range(70_000 + i * 1000, 70_000 + i * 1000 + 256))


async def _dispatching(cluster: LocalCluster) -> None:
    """Wait until the dispatcher is done learning and knows the worker (a request submitted
    while it learns is held by "learning", whatever the test is about)."""
    d = cluster.dispatcher

    async def ready() -> bool:
        return d.dispatching and all(a.worker_id in d.leases for a in cluster.agents)

    await eventually(ready)


@pytest.mark.e2e
async def test_a_held_request_is_told_before_its_first_token(nats_url: str) -> None:
    kw = cluster_kwargs(workers=1, agent={"capacity": 1, "speed": 5.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        await _dispatching(cluster)
        first = await c.submit("sim", _prompt(0), max_tokens=200)
        assert await asyncio.wait_for(first.queued, 5) is None  # it started at once
        held = await c.submit("sim", _prompt(1), max_tokens=8)
        notice = await asyncio.wait_for(held.queued, 5)
        told = time.monotonic()
        assert isinstance(notice, QueuedNotice), notice
        assert notice.position == 1 and notice.held_by == "no-worker-room"
        stats = await c.stats()
        assert stats.held == {"no-worker-room": 1}
        chunks = []
        async for chunk in held:
            chunks.append((time.monotonic(), chunk))
        assert chunks and chunks[0][0] >= told  # the notice came before the first token
        assert (await held.result()).ok
        assert cluster.agents[0].completed == 2


@pytest.mark.e2e
async def test_the_expected_wait_is_near_the_real_wait_in_a_steady_load(nats_url: str) -> None:
    # One slot, each request ~0.26 s; a standing queue of ~4 kept by arrivals at the service
    # rate: every request waits about as long as the notice says.
    kw = cluster_kwargs(workers=1, agent={"capacity": 1, "speed": 5.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        await _dispatching(cluster)
        handles = [await c.submit("sim", _prompt(i), max_tokens=200) for i in range(5)]
        for i in range(5, 17):
            await asyncio.sleep(0.26)
            handles.append(await c.submit("sim", _prompt(i), max_tokens=200))
        notices = [await asyncio.wait_for(h.queued, 10) for h in handles]
        results: list[Result] = [await h.result(timeout_s=60) for h in handles]
    pairs = [
        (n.expected_wait_s, r.timings.queued_s)
        for n, r in zip(notices[9:], results[9:], strict=True)
        if n is not None and n.expected_wait_s is not None and r.timings is not None
    ]
    assert len(pairs) >= 6, pairs
    for expected, real in pairs:
        assert real / 3 <= expected <= real * 3, pairs


@pytest.mark.e2e
async def test_retry_stops_after_its_bound_on_a_queue_that_stays_full(nats_url: str) -> None:
    kw = cluster_kwargs(workers=0, dispatcher={"global_limit": 1, "queue_max_msgs": 1})
    async with LocalCluster(nats_url, **kw), Client(nats_url, queue_full_retry_after_s=0.3) as c:
        for i in range(2):  # the stream holds queue_max_msgs + global_limit requests
            await c.submit("sim", _prompt(i), max_tokens=4)
        t0 = time.monotonic()
        with pytest.raises(QueueFull):
            await c.submit("sim", _prompt(2), max_tokens=4, retry=Retry(attempts=2, jitter=0.0))
        elapsed = time.monotonic() - t0
        assert 0.6 <= elapsed < 3.0, elapsed  # two waits of 0.3 s, then it gave up
        t0 = time.monotonic()
        with pytest.raises(QueueFull):
            await c.submit("sim", _prompt(3), max_tokens=4)  # no retry: refused at once
        assert time.monotonic() - t0 < 0.6
        with pytest.raises(InvalidRequest, match="retry"):
            await c.submit("sim", _prompt(4), max_tokens=4, retry=2.5)  # type: ignore[arg-type]


@pytest.mark.e2e
async def test_retry_gets_in_once_the_queue_has_room(nats_url: str) -> None:
    kw = cluster_kwargs(workers=0, dispatcher={"global_limit": 1, "queue_max_msgs": 1})
    async with (
        LocalCluster(nats_url, **kw) as cluster,
        Client(nats_url, queue_full_retry_after_s=0.3) as c,
    ):
        held = [await c.submit("sim", _prompt(i), max_tokens=4) for i in range(2)]

        async def both_held() -> bool:
            return cluster.dispatcher.held == 2

        await eventually(both_held)

        async def free_a_place() -> None:
            await asyncio.sleep(0.4)
            assert (await held[0].cancel()).status == "cancelled"

        freeing = asyncio.create_task(free_a_place())
        t0 = time.monotonic()
        late = await c.submit("sim", _prompt(2), max_tokens=4, retry=Retry(attempts=10, jitter=0.0))
        await freeing
        assert time.monotonic() - t0 >= 0.3  # refused first, then in after a retry-after
        assert late.request_id

        async def queued() -> bool:
            return cluster.dispatcher.scheduler.is_queued(late.request_id)

        await eventually(queued)

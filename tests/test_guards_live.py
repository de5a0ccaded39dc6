"""Guards of the live mechanisms, over a real nats-server: drain, adoption after a dispatcher
restart, and the retry-after of a full queue. Each test fails when its mechanism is removed by
hand (the ``info.draining`` skip in ``planner._scratch``; the adoption loop in
``feed.apply_heartbeat`` or the adoption at arrival in ``Scheduler.enqueue``; the expected
wait in ``Client._publish``)."""

from __future__ import annotations

import asyncio
import collections

import nats
import pytest
from nats.aio.msg import Msg

from sluice.client import Client, QueueFull
from sluice.dispatcher.runtime import Dispatcher
from sluice.schemas import names
from sluice.schemas.codec import decode
from sluice.schemas.models import Assignment
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs, eventually

pytestmark = pytest.mark.e2e


def _prompt(i: int) -> list[int]:
    """A distinct 128-token prompt per request: no shared prefix, nothing in the agents'
    digests (under digest_min_prefix_tokens), so the cache plays no part in routing."""
    return list(range(10_000 + i * 1000, 10_000 + i * 1000 + 128))


class _Peaks:
    """The observer of every agent: the highest in-flight count each worker reached."""

    def __init__(self) -> None:
        self.peak: collections.Counter[str] = collections.Counter()

    def __call__(self, worker_id: str, in_flight: int) -> None:
        self.peak[worker_id] = max(self.peak[worker_id], in_flight)


async def _results_stored(nats_url: str) -> dict[str, int]:
    """Result messages in the result stream, per request id."""
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().stream_info(
            names.RESULT_STREAM, subjects_filter=names.RESULT_SUBJECTS
        )
        subjects = info.state.subjects or {}
        return {s.rsplit(".", 1)[-1]: n for s, n in subjects.items()}
    finally:
        await nc.close()


# ----------------------------------------------------------------------- 7. drain


async def test_a_draining_worker_is_offered_no_new_work_and_finishes_its_own(
    nats_url: str,
) -> None:
    # speed 2: the long request runs ~4 s, the drain spans all of the new work.
    kw = cluster_kwargs(workers=2, agent={"speed": 2.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        d = cluster.dispatcher
        long = await c.submit("sim", _prompt(0), max_tokens=1200, request_id="long")
        await anext(aiter(long))  # it runs now
        draining = next(a for a in cluster.agents if a.in_flight)
        other = next(a for a in cluster.agents if a is not draining)

        offered: list[str] = []

        async def tap(msg: Msg) -> None:  # sees every assignment offered to the worker
            offered.append(decode(msg.data, Assignment).request.request_id)

        await c.nc.subscribe(names.work_subject(draining.worker_id), cb=tap)
        await c.nc.flush()
        # Agent.stop() is the public way to drain: it heartbeats draining=True at once, then
        # waits (up to drain_timeout_s) for what runs before it leaves.
        stopping = asyncio.create_task(draining.stop())

        async def seen_draining() -> bool:
            info = d.scheduler.workers().get(draining.worker_id)
            return info is not None and info.draining

        await eventually(seen_draining, timeout_s=3.0)
        assert draining.in_flight == 1, "the long request ended before the drain was seen"
        offered.clear()
        # A burst of distinct requests, planned together: without the drain skip the
        # policy would spread them over both workers.
        handles = await asyncio.gather(
            *(
                c.submit("sim", _prompt(i), max_tokens=100, request_id=f"new-{i}")
                for i in range(1, 9)
            )
        )
        results = [await h.result(timeout_s=20) for h in handles]
        assert draining.in_flight == 1, "the long request ended before the new work did"
        assert offered == [], f"work was offered to the draining worker: {offered}"
        assert all(r.ok and r.worker_id == other.worker_id for r in results)

        done = await long.result(timeout_s=20)
        await asyncio.wait_for(stopping, timeout=10)
    assert done.ok and done.worker_id == draining.worker_id and done.attempt == 1
    assert len(done.output_tokens) == 1200
    assert draining.completed == 1 and other.completed == 8


# ----------------------------------------------------------------------- 8. adoption


@pytest.mark.parametrize(
    ("how", "learn_s", "ack_wait_s"),
    [("stop", 2.0, 1.0), ("kill", 2.0, 1.0), ("kill", 0.3, 1.5)],
    ids=["stop", "kill-within-learning", "kill-after-learning"],
)
async def test_a_new_dispatcher_adopts_the_requests_running_on_the_agents(
    nats_url: str, how: str, learn_s: float, ack_wait_s: float
) -> None:
    """Four requests run for ~5 s on worker-0; the dispatcher is replaced mid-run. The new
    one must book each on worker-0, where its heartbeats say they run, so that it does not
    offer them to the idle worker-1 as well: each runs once, and every producer gets one
    result. After a stop they come back at once, while the successor learns (the heartbeat
    adopts them); after a kill they come back after ack_wait_s, inside or after the
    successor's learning (then the arrival itself adopts them: the defaults are
    ack_wait_s 30 s, learn_s = lease_s 4 s)."""
    peaks = _Peaks()
    dispatcher = {"learn_s": learn_s, "ack_wait_s": ack_wait_s}
    kw = cluster_kwargs(workers=1, dispatcher=dispatcher, agent={"speed": 2.0})
    rids = [f"long-{i}" for i in range(4)]
    async with LocalCluster(nats_url, observer=peaks, **kw) as cluster, Client(nats_url) as c:
        runner = cluster.agents[0]
        handles = [
            await c.submit("sim", _prompt(i), max_tokens=1500, request_id=rid)
            for i, rid in enumerate(rids)
        ]

        async def all_running() -> bool:
            return all(rid in runner._running for rid in rids)

        await eventually(all_running, timeout_s=5.0)
        idle = await cluster.add_agent("worker-1")  # would take half of a fresh plan

        old = cluster.dispatcher
        await (old.stop() if how == "stop" else old.kill())
        successor = Dispatcher(cluster.dispatcher_settings)
        cluster.dispatcher = successor
        await successor.start()
        started = asyncio.get_running_loop().time()

        async def all_booked() -> bool:
            return all(successor.scheduler.booking(rid) is not None for rid in rids)

        await eventually(all_booked, timeout_s=4.0)
        # Look once the successor has planned (learning is over, the requests are back), while
        # the requests still run.
        learned = started + max(learn_s, ack_wait_s) + 0.3
        await asyncio.sleep(max(0.0, learned - asyncio.get_running_loop().time()))
        booked = {rid: successor.scheduler.booking(rid) for rid in rids}
        still = [rid for rid in rids if rid in runner._running]
        assert still == rids, f"only {still} still ran: the test needs them running"
        where = {rid: b.worker_id if b else None for rid, b in booked.items()}
        assert set(where.values()) == {runner.worker_id}, f"booked on {where}"

        results = [await h.result(timeout_s=20) for h in handles]

        async def reported() -> bool:
            return runner.completed == 4 and runner.in_flight == 0

        await eventually(reported, timeout_s=5.0)
        stored = await _results_stored(nats_url)
        idle_peak, idle_completed = peaks.peak[idle.worker_id], idle.completed
    assert all(r.ok and r.worker_id == runner.worker_id and r.attempt == 1 for r in results)
    assert stored == dict.fromkeys(rids, 1), stored
    assert idle_peak == 0 and idle_completed == 0, "a running request was started again"


# ----------------------------------------------------------------------- 9. retry-after


async def test_queue_full_retry_after_is_the_dispatchers_expected_wait(nats_url: str) -> None:
    kw = cluster_kwargs(
        workers=1,
        dispatcher={"queue_max_msgs": 3, "global_limit": 1, "band_queue_max_msgs": {}},
        agent={"capacity": 1},
    )
    default = 42.0  # the configured fallback: must not be what the client says
    async with (
        LocalCluster(nats_url, **kw) as cluster,
        Client(nats_url, queue_full_retry_after_s=default) as c,
    ):
        # A few admissions teach the dispatcher how fast the batch band is served...
        for i in range(3):
            h = await c.submit("sim", _prompt(i), max_tokens=5, band="batch")
            await h.result(timeout_s=10)
        # ...then one long request holds the only slot and three wait: the band is full.
        blocker = await c.submit("sim", _prompt(9), max_tokens=10_000, band="batch")
        await anext(aiter(blocker))
        for i in range(3):
            await c.submit("sim", _prompt(10 + i), max_tokens=5, band="batch")

        async def three_queued() -> bool:
            return (await c.estimate_wait("sim", "batch")).queued == 3

        await eventually(three_queued, timeout_s=5.0)
        before = await c.estimate_wait("sim", "batch")
        with pytest.raises(QueueFull) as info:
            await c.submit("sim", _prompt(20), max_tokens=5, band="batch")
        after = await c.estimate_wait("sim", "batch")
        for a in cluster.agents:
            await a.kill()  # no need to wait for the blocker
    assert before.queued == after.queued == 3 and info.value.queued == 3
    assert before.expected_wait_s is not None and after.expected_wait_s is not None
    assert before.expected_wait_s > 0
    # Nothing is admitted meanwhile, so the expected wait only grows with the window's span:
    # the client's retry-after was read between the two estimates.
    retry = info.value.retry_after_s
    assert retry != default
    assert before.expected_wait_s <= retry <= after.expected_wait_s, (before, retry, after)
    assert after.expected_wait_s - before.expected_wait_s < 0.5


async def test_a_new_leader_is_dispatching_only_once_it_learned(nats_url: str) -> None:
    """``Dispatcher.dispatching`` is False while a new leader learns the fleet (it leads and
    hands off nothing) and True once it hands off. Fails if it says only whether it leads
    (return ``st.leading()`` alone): the first check sees a leader still learning."""
    kw = cluster_kwargs(workers=1, dispatcher={"learn_s": 2.0, "leader_settle_s": 2.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        d = cluster.dispatcher

        async def leads() -> bool:
            return d.leading

        await eventually(leads)
        assert not d.dispatching  # it learns for 2 s after it began to lead
        handle = await c.submit("sim", list(range(32)), max_tokens=2)
        assert (await handle.result(timeout_s=20)).ok

        async def dispatching() -> bool:  # a late lease renewal may hide it for a moment
            return d.dispatching

        await eventually(dispatching)


async def test_no_lease_runs_out_between_a_reconnect_and_the_leases_renewal(nats_url: str) -> None:
    """From a disconnect until the leases are renewed on reconnecting, the dispatcher may not
    end a lease on the heartbeats it missed: nats-py says the connection is up a round trip
    before its reconnected callback runs, and a pass in between expired every worker whose
    heartbeats the cut had held back (in CI: their requests queued again and run twice). The
    test drives the callbacks nats-py calls. Fails without the ``cut_off`` check in
    ``HandOff.once``: the silent worker loses its lease while the dispatcher is cut off."""
    async with LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster:  # lease 1 s
        d, agent = cluster.dispatcher, cluster.agents[0]

        async def holds() -> bool:
            return agent.worker_id in d.leases

        await eventually(holds)
        await d._workers.on_disconnected()
        await agent.kill()  # silent from now on, as a worker whose heartbeats the cut held
        await asyncio.sleep(d.settings.lease_s + 0.5)
        assert await holds(), "a lease ran out on heartbeats missed while cut off"
        await d._workers.on_reconnected()  # renewed: now its silence counts

        async def lost() -> bool:
            return agent.worker_id not in d.leases

        await eventually(lost, timeout_s=5.0)

"""Cancel: a queued request never runs, a running one stops at its worker (its quota returns at
once, its result says ``cancelled`` with the tokens so far), and cancelling an unknown or
finished request is a clear no-op answer. Real nats-server, dispatcher and agents."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import nats
import pytest
from nats.aio.msg import Msg

from sluice.client import Cancelled, Client
from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.routing import LeastLoaded
from sluice.dispatcher.scheduler import Dispatch, Request, Scheduler, WorkerInfo
from sluice.schemas import names
from sluice.schemas.codec import decode
from sluice.schemas.models import RejectReason, TokenChunk
from sluice.sim.engine import SimEngine
from sluice.sim.profiles import REFERENCE
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs, eventually

# ----------------------------------------------------------------------------- pure parts


def test_the_engine_drops_a_cancelled_request_and_frees_its_blocks() -> None:
    e = SimEngine(REFERENCE)
    bt = REFERENCE.block_tokens
    e.add("a", 4 * bt, 500, [1, 2, 3, 4], 0.0)
    e.add("b", 2 * bt, 500, [9, 8], 0.0)
    e.add("c", 2 * bt, 500, [7, 6], 0.0)
    e.step()  # a, b and c are admitted and prefilling
    used = e.cache.used_blocks
    assert e.cancel("a") and not e.cancel("a")  # a second cancel finds nothing
    assert e.cache.used_blocks < used  # its reserved blocks are free again
    assert 1 in e.cache  # its prompt blocks stay cached, as after a finish
    assert "a" not in e.in_flight()
    for _ in range(600):  # run the rest to the end: nothing more comes from "a"
        for ev in e.step().events:
            assert ev.request_id != "a"
    assert not e.has_work


def test_the_engine_drops_a_request_still_waiting() -> None:
    e = SimEngine(REFERENCE)
    e.add("w", 32, 10, [], 0.0)
    assert e.cancel("w") and not e.has_work and e.cache.used_blocks == 0


def test_stopping_a_running_request_returns_its_quota_at_once() -> None:
    s = Scheduler(AdmissionConfig(global_limit=1), LeastLoaded(), models=["m"])
    s.update_worker(WorkerInfo("w", frozenset({"m"}), 4))
    r = Request("r", "standard", "m", "t", 100, 10, 0.0)
    s.enqueue(r, 0.0)
    assert s.book(Dispatch(r, "w"), 0.0)
    s.enqueue(Request("next", "standard", "m", "t", 100, 10, 0.0), 0.0)
    assert s.plan(1.0) == []  # the global limit is taken
    stopped = s.stop_running("r")
    assert stopped is not None and stopped.worker_id == "w"
    assert s.running == 0 and s.usage() == {}
    assert [d.request.request_id for d in s.plan(1.0)] == ["next"]  # the room is back
    assert s.fail("r", "w", 1) is None and s.complete("r") is None  # later reports: no-ops
    assert s.stop_running("r") is None


def test_tombstones_last_their_window_and_stay_bounded() -> None:
    from sluice.dispatcher.runtime.state import Tombstones

    t = Tombstones(ttl_s=10.0, max_ids=2)
    t.add("a", 0.0)
    assert t.has("a", 9.0) and not t.has("a", 10.5)  # gone after the duplicate window
    t.add("b", 11.0)
    t.add("c", 12.0)
    t.add("d", 13.0)
    assert not t.has("b", 13.0) and t.has("c", 13.0) and t.has("d", 13.0)  # oldest first


# ----------------------------------------------------------------------------- live


def _prompt(i: int) -> list[int]:
    return list(range(50_000 + i * 1000, 50_000 + i * 1000 + 256))


@pytest.mark.e2e
async def test_a_queued_request_cancelled_never_runs(nats_url: str) -> None:
    kw = cluster_kwargs(workers=1, agent={"capacity": 1, "speed": 2.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        agent = cluster.agents[0]
        busy = await c.submit("sim", _prompt(0), max_tokens=300)  # ~2 s at speed 2
        await eventually(lambda: _true(agent.in_flight == 1), timeout_s=5)
        waiting = await c.submit("sim", _prompt(1), max_tokens=4)

        async def queued() -> bool:
            return cluster.dispatcher.scheduler.is_queued(waiting.request_id)

        await eventually(queued, timeout_s=5)
        reply = await waiting.cancel()
        assert reply.status == "cancelled", reply
        with pytest.raises(Cancelled) as info:
            await waiting.result(timeout_s=5)
        assert info.value.reason is RejectReason.CANCELLED
        assert (await busy.result(timeout_s=30)).ok
        await asyncio.sleep(0.5)  # room again: a cancelled request must still not run
        assert agent.completed == 1
        assert not cluster.dispatcher.scheduler.is_queued(waiting.request_id)
        await eventually(lambda: _true(cluster.dispatcher.held == 0), timeout_s=5)  # all acked


@pytest.mark.e2e
async def test_a_running_request_cancelled_stops_with_its_tokens_so_far(nats_url: str) -> None:
    kw = cluster_kwargs(workers=1, dispatcher={"global_limit": 1}, agent={"speed": 2.0})
    async with (
        LocalCluster(nats_url, **kw) as cluster,
        Client(nats_url) as c,
        _TokenTap(nats_url) as tap,
    ):
        agent = cluster.agents[0]
        handle = await c.submit("sim", _prompt(2), max_tokens=2000)  # ~12 s at speed 2
        got = 0
        async for chunk in handle:
            got += len(chunk.tokens)
            if got >= 20:
                break
        reply = await handle.cancel()
        assert reply.status == "cancelled", reply
        # Its quota is back at once, and the engine stopped generating.
        assert cluster.dispatcher.scheduler.running == 0
        assert agent.in_flight == 0 and not agent.engine.has_work
        at_cancel = tap.tokens(handle.request_id)
        with pytest.raises(Cancelled) as info:
            await handle.result(timeout_s=5)
        result = info.value.result
        assert result is not None and result.worker_id == agent.worker_id
        assert got <= len(result.output_tokens) < 2000
        assert len(result.output_tokens) == at_cancel  # every streamed token is in the result
        other = await c.submit("sim", _prompt(3), max_tokens=4)  # the freed room is usable
        assert (await other.result(timeout_s=10)).ok
        assert tap.tokens(handle.request_id) == at_cancel  # nothing after the cancel
        await eventually(lambda: _true(cluster.dispatcher.held == 0), timeout_s=5)  # all acked


@pytest.mark.e2e
async def test_cancelling_an_unknown_or_finished_request_is_a_no_op(nats_url: str) -> None:
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        done = await c.submit("sim", _prompt(4), max_tokens=4)
        assert (await done.result(timeout_s=10)).ok
        finished = await done.cancel()
        assert finished.status == "finished"
        assert (await c.fetch_result(done.request_id)) is not None  # its result stands
        unknown = await c.cancel("no-such-request")
        assert unknown.status == "unknown" and "no-such-request" in unknown.message
        assert cluster.agents[0].completed == 1


@pytest.mark.e2e
async def test_a_request_cancelled_before_the_dispatcher_pulled_it_never_runs(
    nats_url: str,
) -> None:
    # max_buffered=1: the dispatcher holds one request of the band at a time, so the third
    # request waits in the stream, unseen, when it is cancelled.
    kw = cluster_kwargs(
        workers=1, dispatcher={"max_buffered": 1}, agent={"capacity": 1, "speed": 5.0}
    )
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        agent = cluster.agents[0]
        # About a second of work: the dispatcher holds it (its one buffered request) until
        # well after the cancel is answered, even on a slow machine.
        running = await c.submit("sim", _prompt(5), max_tokens=800)
        await eventually(lambda: _true(agent.in_flight == 1), timeout_s=5)
        unseen = await c.submit("sim", _prompt(6), max_tokens=4)
        reply = await unseen.cancel()
        assert reply.status == "unknown" and "not run" in reply.message, reply
        with pytest.raises(Cancelled):
            await unseen.result(timeout_s=15)  # answered when it arrives, never run
        assert (await running.result(timeout_s=15)).ok
        await asyncio.sleep(0.3)
        assert agent.completed == 1


@pytest.mark.e2e
async def test_sluice_cancel_answers_on_the_command_line(nats_url: str) -> None:
    async with LocalCluster(nats_url, **cluster_kwargs(workers=1)):
        env = {**os.environ, "SLUICE_NATS_URL": nats_url}
        p = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "sluice.cli", "cancel", "nope"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert p.returncode == 1, p.stderr
    assert "nope: unknown" in p.stdout


async def _true(value: bool) -> bool:
    return value


class _TokenTap:
    """Every token chunk published, by request id (a raw subscription beside the client's)."""

    def __init__(self, nats_url: str) -> None:
        self._url = nats_url
        self._seen: dict[str, int] = {}

    def tokens(self, request_id: str) -> int:
        """How many tokens of ``request_id`` were published (up to the highest index)."""
        return self._seen.get(request_id, 0)

    async def _on(self, msg: Msg) -> None:
        chunk = decode(msg.data, TokenChunk)
        end = chunk.index + len(chunk.tokens)
        self._seen[chunk.request_id] = max(self._seen.get(chunk.request_id, 0), end)

    async def __aenter__(self) -> _TokenTap:
        self._nc = await nats.connect(self._url)
        await self._nc.subscribe(names.TOKEN_SUBJECTS, cb=self._on)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._nc.close()

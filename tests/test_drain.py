"""Operator drain and the remove notice, over a real nats-server with real agents, real
dispatchers and real ``sluice`` processes (every process is stopped by its PID, also when an
assertion fails).

Mechanism checks (each edit was made by hand once and the named test failed):

- ``acceptance.review`` without its ``draining`` refusal: the drain-under-load test sees an
  offer sent after the drain reply accepted.
- The agent's heartbeat with ``draining=False``: the drain-under-load test sees the
  dispatcher offer new work to the draining worker.
- ``Agent._check_drained`` returning at once: the ``--exit`` agent process never exits.
- ``Agent._on_remove`` returning at once (the notice ignored): the SIGSTOP test never sees
  the worker registered afresh (its heartbeats stay stale).
- ``Agent._on_remove`` keeping what it runs: the SIGSTOP test finds the stale first attempt
  finishing and storing the result instead of the retry.
- ``WorkerTraffic.on_heartbeat`` ignoring a ``replaced`` standing: the restart test's result
  never comes (its request stays booked on a worker that lost it).

The stale-heartbeat check of ``on_heartbeat`` is a second line there (with it gone the
SIGSTOP test still passes: the agent obeys the notice and the ``replaced`` path requeues);
the pure ``LeaseTable`` tests in ``tests/test_scheduler.py`` guard it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from nats.aio.msg import Msg

from sluice.client import Client, DrainTimeout, UnknownWorker
from sluice.client.admin import drain_worker
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.models import Assignment, AssignmentReply, Heartbeat, Result, SubmitRequest
from sluice.testing.cluster import LocalCluster

from .conftest import FAST_AGENT, FAST_DISPATCHER, cluster_kwargs, eventually

pytestmark = pytest.mark.e2e

SLUICE = [sys.executable, "-m", "sluice.cli"]


def _prompt(i: int) -> list[int]:
    """A distinct 128-token prompt per request: the cache plays no part in routing."""
    return list(range(10_000 + i * 1000, 10_000 + i * 1000 + 128))


def _env(nats_url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "SLUICE_NATS_URL": nats_url, **extra}


async def _cli(nats_url: str, *args: str, timeout_s: float = 60.0) -> tuple[int, str, str]:
    """Run ``sluice ARGS`` as its own process; killed by its PID if it outlives the wait."""
    proc = await asyncio.create_subprocess_exec(
        *SLUICE,
        *args,
        env=_env(nats_url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@asynccontextmanager
async def _agent_process(
    nats_url: str, worker_id: str, **env: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A ``sluice agent`` process; stopped by its PID (SIGCONT first, in case it was
    stopped, then SIGTERM, then SIGKILL) when the block ends."""
    proc = await asyncio.create_subprocess_exec(
        *SLUICE,
        "agent",
        "--worker-id",
        worker_id,
        env=_env(nats_url, SLUICE_AGENT_HEARTBEAT_S="0.2", **env),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


class _Offers:
    """Every assignment offered to one worker, with when it was offered."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str]] = []

    async def tap(self, msg: Msg) -> None:
        self.seen.append((time.monotonic(), decode(msg.data, Assignment).request.request_id))

    def after(self, t: float) -> list[str]:
        return [rid for at, rid in self.seen if at > t]


async def _stored_results(c: Client, tenant: str, rid: str) -> list[Result]:
    """Every result stored for ``rid`` (the stream deduplicates: there must be one)."""
    js = c.nc.jetstream()
    sub = await js.pull_subscribe(names.result_subject(tenant, rid), durable=None)
    out: list[Result] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(10, timeout=1.0)
            except TimeoutError:
                break
            out.extend(decode(m.data, Result) for m in msgs)
    finally:
        await sub.unsubscribe()
    return out


# ------------------------------------------------------------------ drain under load


async def test_drain_under_load_runs_no_new_work_there_and_loses_nothing(nats_url: str) -> None:
    kw = cluster_kwargs(workers=3, agent={"speed": 2.0, "capacity": 8})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        target = cluster.agents[0]
        offers = _Offers()
        await c.nc.subscribe(names.work_subject(target.worker_id), cb=offers.tap)
        await c.nc.flush()

        finished: dict[str, tuple[float, Result]] = {}

        async def submit(i: int) -> None:
            h = await c.submit("sim", _prompt(i), max_tokens=150, request_id=f"r-{i}")
            r = await h.result(timeout_s=60)
            finished[r.request_id] = (time.monotonic(), r)

        first = [asyncio.create_task(submit(i)) for i in range(12)]
        await eventually(lambda: _true(target.in_flight >= 2), timeout_s=10)

        reply = await drain_worker(c.nc, target.worker_id)
        replied_s = time.monotonic()
        assert reply.state == "draining" and reply.in_flight, reply
        assert target.state == "draining"
        # An offer that was on its way when the drain came (sent as a dispatcher sends it)
        # is refused: after the reply, nothing new starts there whatever a dispatcher knows.
        late = SubmitRequest(
            request_id="late", model="sim", prompt_tokens=_prompt(99), submitted_unix_ms=1
        )
        offer = Assignment(
            request=late,
            attempt=1,
            dispatcher_id="test",
            queued_s=0.0,
            epoch=cluster.dispatcher.epoch,  # as the leader sends it
        )
        raw = await c.nc.request(names.work_subject(target.worker_id), encode(offer), timeout=2)
        answer = decode(raw.data, AssignmentReply)
        assert not answer.accepted and answer.reason == "draining", answer

        # Load goes on while it drains.
        more = [asyncio.create_task(submit(i)) for i in range(12, 36)]

        async def seen_draining() -> bool:
            rows = {w.worker_id: w for w in (await c.workers()).workers}
            return rows[target.worker_id].state in ("draining", "drained")

        await eventually(seen_draining, timeout_s=3)
        seen_s = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*first, *more), 90)

        # Nothing lost: every request has exactly one ok result, and each ran exactly once.
        assert sorted(finished) == sorted(f"r-{i}" for i in range(36))
        assert all(r.ok and r.attempt == 1 for _, r in finished.values())
        assert sum(a.completed for a in cluster.agents) == 36
        # The drained worker finished what it ran at the reply, and took nothing new after.
        ran_there = {rid for rid, (_, r) in finished.items() if r.worker_id == target.worker_id}
        before = {
            rid
            for rid, (at, r) in finished.items()
            if r.worker_id == target.worker_id and at <= replied_s
        }
        assert set(reply.in_flight) <= ran_there
        new_there = ran_there - before - set(reply.in_flight)
        assert not new_there, f"new work ran on the drained worker: {sorted(new_there)}"
        assert offers.after(seen_s) == [], "the dispatcher offered work to a draining worker"
        assert all(a.completed > 0 for a in cluster.agents[1:])

        # Drained: nothing runs there, it says so, and the dispatcher shows it.
        await eventually(lambda: _true(target.state == "drained"), timeout_s=5)

        async def shown_drained() -> bool:
            rows = {w.worker_id: w for w in (await c.workers()).workers}
            return rows[target.worker_id].state == "drained"

        await eventually(shown_drained, timeout_s=3)

        # Undrain: it takes work again.
        back = await drain_worker(c.nc, target.worker_id, drain=False)
        assert back.state == "serving"
        before_count = target.completed
        again = [asyncio.create_task(submit(i)) for i in range(36, 60)]
        await asyncio.wait_for(asyncio.gather(*again), 90)
        assert target.completed > before_count, "the undrained worker took no work"


async def _true(value: bool) -> bool:
    return value


# ------------------------------------------------------------------ the CLI


async def test_sluice_workers_and_drain_wait_as_processes(nats_url: str) -> None:
    kw = cluster_kwargs(workers=3, agent={"speed": 2.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        a0, a1, a2 = cluster.agents
        await eventually(lambda: _true(len(cluster.dispatcher.leases) == 3), timeout_s=5)

        # A long request on some worker; drain that one with --wait.
        # Long enough (~10 s) to outlast the CLI processes started while it runs.
        long = await c.submit("sim", _prompt(0), max_tokens=3000, request_id="long")
        await anext(aiter(long))
        busy = next(a for a in cluster.agents if a.in_flight)
        idle = [a for a in cluster.agents if a is not busy]

        # --wait with a too short timeout: exit code 1, a clear message, still draining.
        code, out, err = await _cli(nats_url, "drain", busy.worker_id, "--wait", "--timeout", "0.3")
        assert code == 1, (code, out, err)
        assert f"worker {busy.worker_id!r} was still draining after 0.3 s" in err
        assert busy.state == "draining" and busy.in_flight == 1

        # An idle worker drains at once.
        code, out, err = await _cli(nats_url, "drain", idle[0].worker_id, "--wait")
        assert code == 0, err
        assert f"{idle[0].worker_id}: drained, 0 running" in out

        # `sluice workers` lists every worker with its state.
        code, out, err = await _cli(nats_url, "workers", "--json")
        assert code == 0, err
        rows = {w["worker_id"]: w for w in json.loads(out)["workers"]}
        assert set(rows) == {a0.worker_id, a1.worker_id, a2.worker_id}
        assert rows[busy.worker_id]["state"] == "draining"
        assert rows[busy.worker_id]["in_flight"] == 1
        assert rows[idle[0].worker_id]["state"] == "drained"
        assert rows[idle[1].worker_id]["state"] == "serving"
        assert rows[idle[1].worker_id]["capacity"] == 32
        code, out, err = await _cli(nats_url, "workers")
        assert code == 0, err
        for a, state in ((busy, "draining"), (idle[0], "drained"), (idle[1], "serving")):
            line = next(ln for ln in out.splitlines() if a.worker_id in ln)
            assert state in line, out

        # --wait until the long request is done: exit code 0, and it finished there.
        code, out, err = await _cli(nats_url, "drain", busy.worker_id, "--wait", "--timeout", "60")
        assert code == 0, err
        assert f"{busy.worker_id}: drained, 0 running" in out
        done = await long.result(timeout_s=5)
        assert done.ok and done.worker_id == busy.worker_id and done.attempt == 1
        assert len(done.output_tokens) == 3000

        # Undrain through the CLI; an unknown worker is exit code 2 with a clear error.
        code, out, err = await _cli(nats_url, "undrain", idle[0].worker_id)
        assert code == 0 and f"{idle[0].worker_id}: serving" in out, (out, err)
        assert idle[0].state == "serving"
        code, out, err = await _cli(nats_url, "drain", "nope", "--wait")
        assert code == 2 and "no worker 'nope' answered" in err, (code, err)
        with pytest.raises(UnknownWorker):
            await drain_worker(c.nc, "nope")
        with pytest.raises(DrainTimeout):
            long2 = await c.submit("sim", _prompt(1), max_tokens=1200, band="interactive")
            await anext(aiter(long2))
            runner = next(a for a in cluster.agents if a.in_flight)
            await drain_worker(c.nc, runner.worker_id, wait_s=0.2)


async def test_drain_exit_stops_a_sluice_agent_process_after_its_work(nats_url: str) -> None:
    kw = cluster_kwargs(workers=0)
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        d = cluster.dispatcher
        async with _agent_process(nats_url, "proc-w", SLUICE_AGENT_SPEED="2") as proc:
            await eventually(lambda: _true("proc-w" in d.leases), timeout_s=20)
            long = await c.submit("sim", _prompt(0), max_tokens=3000, request_id="long")
            await anext(aiter(long))  # it runs on proc-w, the only worker
            assert d.scheduler.booked_on("proc-w") == {"long"}
            code, out, err = await _cli(nats_url, "drain", "proc-w", "--wait", "--exit")
            assert code == 0, err
            assert "proc-w: drained, 0 running" in out
            rc = await asyncio.wait_for(proc.wait(), 15)
            stderr = (await proc.stderr.read()).decode() if proc.stderr else ""
            assert rc == 0, stderr
        done = await long.result(timeout_s=5)
        assert done.ok and done.worker_id == "proc-w" and done.attempt == 1
        assert len(done.output_tokens) == 3000
        await eventually(lambda: _true("proc-w" not in d.leases), timeout_s=3)


# ------------------------------------------------------------------ the remove notice


@pytest.mark.fault
async def test_a_worker_back_from_sigstop_is_removed_and_registers_afresh(
    nats_url: str,
) -> None:
    """SIGSTOP an agent process past its lease: the dispatcher requeues its request (it runs
    elsewhere as attempt 2) and sends it a remove notice. After SIGCONT the agent drops the
    request (its first attempt never stores a result), registers afresh and serves again."""
    kw: dict[str, Any] = {
        "workers": 0,
        "dispatcher": {**FAST_DISPATCHER},
        "agent": {**FAST_AGENT, "speed": 2.0},
    }
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        d = cluster.dispatcher
        beats: list[Heartbeat] = []

        async def on_beat(msg: Msg) -> None:
            beats.append(decode(msg.data, Heartbeat))

        await c.nc.subscribe(names.heartbeat_subject("proc-w"), cb=on_beat)
        async with _agent_process(nats_url, "proc-w", SLUICE_AGENT_SPEED="2") as proc:
            await eventually(lambda: _true("proc-w" in d.leases), timeout_s=20)
            first_registration = beats[-1].registration
            long = await c.submit("sim", _prompt(0), max_tokens=2000, request_id="long")
            tokens = 0
            async for chunk in long:  # well under way on proc-w
                tokens = chunk.index + len(chunk.tokens)
                if tokens >= 400:
                    break
            other = await cluster.add_agent("worker-0")

            os.kill(proc.pid, signal.SIGSTOP)
            try:
                await eventually(lambda: _true("proc-w" not in d.leases), timeout_s=10)
                # Requeued as attempt 2 and running on the other worker.
                await eventually(lambda: _true(other.in_flight == 1), timeout_s=10)
            finally:
                os.kill(proc.pid, signal.SIGCONT)

            async def fresh() -> bool:
                return (
                    "proc-w" in d.leases
                    and bool(beats)
                    and beats[-1].registration > first_registration
                    and not beats[-1].in_flight
                )

            await eventually(fresh, timeout_s=10)
            assert d.scheduler.booked_on("proc-w") == frozenset()

            result = await long.result(timeout_s=60)
            assert result.ok and result.worker_id == "worker-0" and result.attempt == 2
            assert len(result.output_tokens) == 2000
            stored = await _stored_results(c, "default", "long")
            assert [(r.worker_id, r.attempt) for r in stored] == [("worker-0", 2)]

            # It serves again: with the other worker drained, new work runs on proc-w.
            await drain_worker(c.nc, "worker-0", wait_s=10)
            h = await c.submit("sim", _prompt(1), max_tokens=20, request_id="after")
            after = await h.result(timeout_s=20)
            assert after.ok and after.worker_id == "proc-w"


@pytest.mark.fault
async def test_an_agent_restarted_within_its_lease_gets_its_old_work_requeued(
    nats_url: str,
) -> None:
    """An agent process killed and started again (same worker id) before its lease ends
    heartbeats a newer registration: the dispatcher forgets the old one's bookings and runs
    its request again at once, instead of leaving it booked on a worker that lost it until
    the (here: one minute) lease would expire. Fails if ``WorkerTraffic.on_heartbeat`` no
    longer acts on a ``replaced`` standing (the result wait times out)."""
    kw: dict[str, Any] = {
        "workers": 0,
        "dispatcher": {**FAST_DISPATCHER, "lease_s": 60.0},
        "agent": {**FAST_AGENT},
    }
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        d = cluster.dispatcher
        async with _agent_process(nats_url, "proc-w", SLUICE_AGENT_SPEED="2") as first:
            await eventually(lambda: _true("proc-w" in d.leases), timeout_s=20)
            long = await c.submit("sim", _prompt(0), max_tokens=400, request_id="long")
            await anext(aiter(long))
            first.kill()  # SIGKILL by its PID: no drain, no goodbye
            await first.wait()
        assert "proc-w" in d.leases and d.scheduler.booked_on("proc-w") == {"long"}
        async with _agent_process(nats_url, "proc-w", SLUICE_AGENT_SPEED="2"):
            result = await long.result(timeout_s=40)
            assert result.ok and result.worker_id == "proc-w" and result.attempt == 2
            assert len(result.output_tokens) == 400

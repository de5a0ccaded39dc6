"""Leader and standbys: dispatchers as real processes (``python -m sluice.cli dispatcher``), the
agents in this process (a :class:`LocalCluster` without a dispatcher), one real nats-server.

What is measured is measured at the agents: the runs they completed, their in-flight counts
(the observer hook, on every change), and the assignments they were sent (a tap on
``sluice.work.*``). Every process is stopped by its PID, also when an assertion fails.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from sluice.client import Client
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.models import Assignment, AssignmentReply, LeaderLease
from sluice.testing.cluster import LocalCluster

from .conftest import FAST_AGENT, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

SLUICE = [sys.executable, "-m", "sluice.cli", "dispatcher"]
PROMPT = list(range(7000, 7128))
TAKEOVER_TARGET_S = 5.0


LEASE_S = 9.0
"""The leadership lease of the hand-over test: renewed every third (3 s), so a standby that
waits it out takes over 6 to 9 s after the leader's last act."""


def dispatcher_env(nats_url: str, dispatcher_id: str, **extra: object) -> dict[str, str]:
    """Fast test settings for a dispatcher process (the leadership lease keeps its default
    unless ``extra`` says otherwise)."""
    env = {
        "SLUICE_NATS_URL": nats_url,
        "SLUICE_DISPATCHER_DISPATCHER_ID": dispatcher_id,
        "SLUICE_DISPATCHER_MODELS": '["sim"]',
        "SLUICE_DISPATCHER_LEASE_S": "2.0",  # ten heartbeats, as FAST_DISPATCHER's
        "SLUICE_DISPATCHER_LEARN_S": "0.3",
        "SLUICE_DISPATCHER_HANDOFF_TIMEOUT_S": "1.0",
        "SLUICE_DISPATCHER_FETCH_TIMEOUT_S": "0.5",
        "SLUICE_DISPATCHER_TICK_S": "0.02",
        "SLUICE_DISPATCHER_ENGINE_PREFILL_TOKENS_PER_S": str(8000.0 * 20),
        "SLUICE_DISPATCHER_ENGINE_DECODE_TOKEN_S": str((0.00035 + 0.006 / 64) / 20),
    }
    env.update({f"SLUICE_DISPATCHER_{k.upper()}": str(v) for k, v in extra.items()})
    return env


class Dispatchers:
    """Dispatcher processes, stopped by PID at the end (SIGCONT first, then SIGTERM, then
    SIGKILL for one that does not stop)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, dispatcher_id: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{dispatcher_id}.log").open("wb")
        p = subprocess.Popen(
            SLUICE, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.procs[dispatcher_id] = p
        return p

    def log_of(self, dispatcher_id: str) -> str:
        return (self.logs / f"{dispatcher_id}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)


@pytest.fixture
def dispatchers(tmp_path: Path) -> Iterator[Dispatchers]:
    ds = Dispatchers(tmp_path)
    try:
        yield ds
    finally:
        ds.stop_all()


@dataclass
class Tap:
    """What the agents were sent and what the leaders announced, with arrival times."""

    assignments: list[tuple[float, Assignment]] = field(default_factory=list)
    leaders: list[tuple[float, LeaderLease]] = field(default_factory=list)

    async def on_work(self, msg: Msg) -> None:
        self.assignments.append((time.monotonic(), decode(msg.data, Assignment)))

    async def on_leader(self, msg: Msg) -> None:
        self.leaders.append((time.monotonic(), decode(msg.data, LeaderLease)))

    def leader(self) -> LeaderLease | None:
        return self.leaders[-1][1] if self.leaders else None

    def first_from(self, dispatcher_id: str, after: float) -> tuple[float, Assignment] | None:
        return next(
            ((t, a) for t, a in self.assignments if a.dispatcher_id == dispatcher_id and t > after),
            None,
        )


@dataclass
class Fleet:
    cluster: LocalCluster
    tap: Tap
    nc: NATS
    in_flight: dict[str, int] = field(default_factory=dict)
    max_in_flight: int = 0

    def observe(self, worker_id: str, n: int) -> None:
        self.in_flight[worker_id] = n
        self.max_in_flight = max(self.max_in_flight, sum(self.in_flight.values()))

    @property
    def runs(self) -> int:
        return sum(a.completed for a in self.cluster.agents)


@pytest.fixture
async def fleet(nats_url: str) -> AsyncIterator[Fleet]:
    """Four simulated agents (capacity 8 each: 32 slots), taps on the work and leader
    subjects."""
    tap = Tap()
    holder: list[Fleet] = []
    cluster = LocalCluster(
        nats_url,
        workers=4,
        with_dispatcher=False,
        agent={**FAST_AGENT, "capacity": 8},
        observer=lambda w, n: holder[0].observe(w, n),
    )
    async with Client(nats_url) as c:
        nc = c.nc
        await nc.subscribe("sluice.work.*", cb=tap.on_work)
        await nc.subscribe(names.LEADER_SUBJECT, cb=tap.on_leader)
        f = Fleet(cluster, tap, nc)
        holder.append(f)
        async with cluster:
            yield f


async def _leads(tap: Tap, dispatcher_id: str, timeout_s: float = 15.0) -> LeaderLease:
    async def announced() -> bool:
        lease = tap.leader()
        return lease is not None and lease.dispatcher_id == dispatcher_id and lease.epoch > 0

    await eventually(announced, timeout_s=timeout_s)
    lease = tap.leader()
    assert lease is not None
    return lease


async def _submit(c: Client, n: int, max_tokens: int, prefix: str) -> list[Any]:
    return [
        await c.submit("sim", PROMPT, max_tokens=max_tokens, request_id=f"{prefix}{i}")
        for i in range(n)
    ]


async def test_kill_9_of_the_leader_under_load_a_standby_takes_over(
    nats_url: str, dispatchers: Dispatchers, fleet: Fleet
) -> None:
    """(a) The leader dies (SIGKILL) mid-load with a standby running: the standby dispatches
    within the target, nothing is lost and nothing runs twice."""
    a = dispatchers.start("d-a", dispatcher_env(nats_url, "d-a", global_limit=8))
    first = await _leads(fleet.tap, "d-a")
    dispatchers.start("d-b", dispatcher_env(nats_url, "d-b", global_limit=8))
    await asyncio.sleep(1.5)  # b follows the heartbeats
    async with Client(nats_url) as c:
        handles = await _submit(c, 48, max_tokens=2000, prefix="k")

        async def busy() -> bool:
            return sum(fleet.in_flight.values()) >= 8

        await eventually(busy, timeout_s=10)
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        os.kill(a.pid, signal.SIGKILL)
        a.wait(5)
        results = [await h.result(timeout_s=90) for h in handles]
        await asyncio.sleep(0.5)  # a second run of anything would complete meanwhile

    first_b = fleet.tap.first_from("d-b", killed_at)
    assert first_b is not None, "the standby never dispatched"
    takeover_s = first_b[0] - killed_at
    print(f"takeover: kill -9 to the new leader's first dispatch in {takeover_s:.2f} s")
    assert takeover_s <= TAKEOVER_TARGET_S
    assert first_b[1].epoch > first.epoch
    assert all(r.ok for r in results)
    assert sorted(r.request_id for r in results) == sorted(f"k{i}" for i in range(48))
    assert fleet.runs == 48, f"{fleet.runs} runs for 48 requests: something ran twice"
    assert fleet.max_in_flight <= 8


async def test_a_new_leader_books_what_runs_before_it_dispatches(
    nats_url: str, dispatchers: Dispatchers, fleet: Fleet
) -> None:
    """The dead leader's held requests return only after an ack wait longer than the lease,
    while new requests are there at once: the new leader first adopts the running ones (it
    waits until what the workers report running is booked), so the global limit holds across
    the takeover and nothing runs twice."""
    env = {"global_limit": 8, "ack_wait_s": 6.0}
    a = dispatchers.start("d-a", dispatcher_env(nats_url, "d-a", **env))
    await _leads(fleet.tap, "d-a")
    dispatchers.start("d-b", dispatcher_env(nats_url, "d-b", **env))
    await asyncio.sleep(1.5)
    async with Client(nats_url) as c:
        handles = await _submit(c, 12, max_tokens=12000, prefix="old")

        async def busy() -> bool:
            return sum(fleet.in_flight.values()) >= 8

        await eventually(busy, timeout_s=10)
        killed_at = time.monotonic()
        os.kill(a.pid, signal.SIGKILL)
        a.wait(5)
        handles += await _submit(c, 12, max_tokens=200, prefix="new")

        async def b_dispatches() -> bool:
            return fleet.tap.first_from("d-b", killed_at) is not None

        await eventually(b_dispatches, timeout_s=20)
        results = [await h.result(timeout_s=90) for h in handles]
        await asyncio.sleep(0.5)

    assert all(r.ok for r in results)
    assert fleet.runs == 24, f"{fleet.runs} runs for 24 requests: something ran twice"
    assert fleet.max_in_flight <= 8, f"the agents held {fleet.max_in_flight} at once (limit 8)"


async def test_a_deposed_leader_that_wakes_up_cannot_dispatch(
    nats_url: str, dispatchers: Dispatchers, fleet: Fleet
) -> None:
    """(b) The leader is frozen (SIGSTOP) until a standby took over, then resumed (SIGCONT):
    none of its assignments is accepted; the agents refuse its epoch."""
    env = {"global_limit": 8, "leader_lease_s": 1.0}
    a = dispatchers.start("d-a", dispatcher_env(nats_url, "d-a", **env))
    await _leads(fleet.tap, "d-a")
    dispatchers.start("d-b", dispatcher_env(nats_url, "d-b", **env))
    await asyncio.sleep(1.0)
    async with Client(nats_url) as c:
        handles = await _submit(c, 32, max_tokens=1500, prefix="p")

        async def dispatched() -> bool:
            return fleet.tap.first_from("d-a", 0.0) is not None and fleet.max_in_flight >= 4

        await eventually(dispatched, timeout_s=10)
        stale = fleet.tap.first_from("d-a", 0.0)
        assert stale is not None
        os.kill(a.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()

        async def b_dispatches() -> bool:
            return fleet.tap.first_from("d-b", stopped_at) is not None

        await eventually(b_dispatches, timeout_s=15)
        b_epoch = next(a2.epoch for t, a2 in fleet.tap.assignments if a2.dispatcher_id == "d-b")
        resumed_at = time.monotonic()
        os.kill(a.pid, signal.SIGCONT)
        # The deposed leader wakes up: whatever it still sends carries its old epoch. One of its
        # real assignments, sent again now (under a fresh request id), is refused by the agent.
        ghost = stale[1].model_copy(
            update={"request": stale[1].request.model_copy(update={"request_id": "ghost"})}
        )
        reply = decode(
            (await c.nc.request(names.work_subject("worker-0"), encode(ghost), timeout=2.0)).data,
            AssignmentReply,
        )
        results = [await h.result(timeout_s=90) for h in handles]
        await asyncio.sleep(0.5)

    assert not reply.accepted and reply.reason.startswith("epoch:"), reply
    assert all(agent.epoch >= b_epoch > stale[1].epoch for agent in fleet.cluster.agents)
    late = [x for t, x in fleet.tap.assignments if x.dispatcher_id == "d-a" and t > resumed_at]
    assert all(x.epoch < b_epoch for x in late)
    assert all(r.ok for r in results)
    assert fleet.runs == 32, f"{fleet.runs} runs for 32 requests: something ran twice"
    assert fleet.max_in_flight <= 8
    assert all(agent.in_flight == 0 for agent in fleet.cluster.agents)
    assert a.poll() is None  # it lives on, as a standby
    log = dispatchers.log_of("d-a")
    assert "deposed" in log or "leadership lost" in log, log[-2000:]


async def test_three_dispatchers_keep_the_global_limit(
    nats_url: str, dispatchers: Dispatchers, fleet: Fleet
) -> None:
    """(c) Three dispatchers at once, a global limit of 8 and 32 slots at the agents: the
    agents never hold more than 8, also while the leader stops cleanly and hands over (at
    once: a standby dispatches before the leader's lease would have run out)."""
    # A long lease: the hand-over must beat its wait by more than a loaded machine's delays
    # (3.85 s was seen in a full local run under load, against the default 3 s lease, which
    # a standby waiting it out meets 2 to 3 s after the stop: the guard could not tell).
    lease = {"global_limit": 8, "leader_lease_s": LEASE_S}
    d0 = dispatchers.start("d-0", dispatcher_env(nats_url, "d-0", **lease))
    await _leads(fleet.tap, "d-0")
    for name in ("d-1", "d-2"):
        dispatchers.start(name, dispatcher_env(nats_url, name, **lease))
    await asyncio.sleep(1.0)
    async with Client(nats_url) as c:
        handles = await _submit(c, 60, max_tokens=1500, prefix="c")

        async def half() -> bool:
            return fleet.runs >= 20

        await eventually(half, timeout_s=30)
        stopped_at = time.monotonic()
        os.kill(d0.pid, signal.SIGTERM)  # a clean stop: it hands leadership over
        results = [await h.result(timeout_s=90) for h in handles]
        await asyncio.sleep(0.5)
        assert d0.wait(10) == 0

    nxt = [
        fleet.tap.first_from(name, stopped_at) for name in ("d-1", "d-2")
    ]  # one of them took over
    firsts = [x[0] for x in nxt if x is not None]
    assert firsts, "no standby took over"
    handover_s = min(firsts) - stopped_at
    print(f"clean hand-over: SIGTERM to the next leader's first dispatch in {handover_s:.2f} s")
    # Handed over, not waited out: without the clean hand-over a standby takes over only when
    # the leader's lease runs out, two thirds of it at the soonest. The time is a benchmark's.
    assert handover_s < LEASE_S * 2 / 3
    assert all(r.ok for r in results)
    assert fleet.runs == 60, f"{fleet.runs} runs for 60 requests: something ran twice"
    assert fleet.max_in_flight <= 8, f"the agents held {fleet.max_in_flight} at once (limit 8)"
    before = {x.dispatcher_id for t, x in fleet.tap.assignments if t < stopped_at}
    assert before == {"d-0"}, f"standbys dispatched: {before}"


@pytest.mark.fault
async def test_an_agent_heartbeats_on_while_its_completions_go_unanswered(
    nats_url: str, dispatchers: Dispatchers, fleet: Fleet
) -> None:
    """A dispatcher that does not answer completions (stopped here; after a broker node is
    killed, one cut off while it reconnects) leaves the finished requests in their agents'
    outboxes, and each retry of one waits out the completion's timeout (1 s). The agents'
    heartbeats must keep their cadence meanwhile: they keep each worker's lease and list the
    results it still holds (else the dispatcher runs those requests again). Fails when the
    heartbeat loop waits for the outbox's retries: silences of 4.9-5.0 s here, a second per
    finished request (a suite run saw 112 runs for 104 requests after a broker node was
    killed). The bound is 2 s (ten heartbeats), not one, for a machine that runs other tests
    too."""
    a = dispatchers.start("d-a", dispatcher_env(nats_url, "d-a", global_limit=32))
    await _leads(fleet.tap, "d-a")
    beats: dict[str, list[float]] = {}

    async def on_heartbeat(msg: Msg) -> None:
        beats.setdefault(msg.subject, []).append(time.monotonic())

    await fleet.nc.subscribe(names.HEARTBEAT_SUBJECTS, cb=on_heartbeat)
    async with Client(nats_url) as c:
        handles = await _submit(c, 24, max_tokens=20_000, prefix="u")

        async def running() -> bool:
            return sum(fleet.in_flight.values()) >= 24

        await eventually(running, timeout_s=10)
        os.kill(a.pid, signal.SIGSTOP)  # its subscriptions stay: completions time out
        stopped = time.monotonic()

        async def finished() -> bool:
            return sum(len(agent._outbox) for agent in fleet.cluster.agents) >= 24

        await eventually(finished, timeout_s=30)
        # The first deliveries give up after their timeouts; then the retries, a few rounds.
        await asyncio.sleep(6.0)
        watched = time.monotonic()
        os.kill(a.pid, signal.SIGCONT)
        results = [await h.result(timeout_s=30) for h in handles]

    def longest_silence(ts: list[float]) -> float:
        points = [stopped, *(t for t in ts if stopped <= t <= watched), watched]
        return max(t1 - t0 for t0, t1 in itertools.pairwise(points))

    gaps = {subject: round(longest_silence(ts), 2) for subject, ts in beats.items()}
    print(f"longest silence per worker while completions went unanswered (s): {gaps}")
    assert len(gaps) == 4, f"heartbeats seen from {sorted(beats)}"
    assert max(gaps.values()) < 2.0, f"longest silence per worker (s): {gaps}"
    assert all(r.ok for r in results)
    assert fleet.runs == 24, f"{fleet.runs} runs for 24 requests"

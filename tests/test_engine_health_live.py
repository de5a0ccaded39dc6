"""An engine that stops answering: its agent stops taking work within the health bound, and
returns when the engine does. Real processes throughout: a nats-server, a dispatcher, two agents
with the ``openai-http`` backend, each in front of its own ``sluice engine`` process on
127.0.0.1.

The hang is a SIGSTOP of one engine process: the kernel still accepts its TCP connections and
buffers the requests, but nothing answers, as with a wedged engine. Only the health check
(``GET /health`` every ``engine_health_every_s``, bounded by ``engine_connect_timeout_s``) can
notice that here: nothing is in flight on the hung engine, and its metrics can only go stale
after ``engine_metrics_stale_s``, set far beyond the test.

Fails when the mechanism is gone: with ``HttpEngine.available`` returning ``True``, or the
health check's ``timeout=`` dropped (a hung check never ends), the hung worker never shows no
free capacity and the test fails at "the hung engine's worker ... still had capacity"; with
``_check_health`` never setting ``_healthy`` back to True, it fails at "the engine answers
again, but its worker ... had capacity 0".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest

from sluice.agent.runtime import Agent, AgentSettings
from sluice.client import Client
from sluice.schemas.models import Result
from sluice.testing.cluster import LocalCluster
from sluice.testing.engines import build_engine

from .conftest import FAST_AGENT, cluster_kwargs, eventually, live_scheduler
from .test_engine_server import _free_port, _start, _stop, _wait_healthy

pytestmark = pytest.mark.e2e

HEALTH_EVERY_S = 0.2
HEALTH_TIMEOUT_S = 0.5  # engine_connect_timeout_s bounds the whole health request
HEARTBEAT_S = FAST_AGENT["heartbeat_s"]
# SIGSTOP (or SIGCONT) to the dispatcher seeing it: at most one interval until the next check,
# the check's timeout, then the next heartbeat. The margin is for a busy machine's scheduling.
HEALTH_BOUND_S = HEALTH_EVERY_S + HEALTH_TIMEOUT_S + HEARTBEAT_S
MARGIN_S = 1.5
BOUND_S = HEALTH_BOUND_S + MARGIN_S
CAPACITY = 4


def _agent(nats_url: str, worker_id: str, url: str) -> Agent:
    fast = {k: v for k, v in FAST_AGENT.items() if k != "speed"}  # the engine has the clock
    settings = AgentSettings(
        nats_url=nats_url,
        worker_id=worker_id,
        models=["sim"],
        capacity=CAPACITY,
        engine="openai-http",
        engine_url=url,
        engine_health_every_s=HEALTH_EVERY_S,
        engine_connect_timeout_s=HEALTH_TIMEOUT_S,
        engine_metrics_every_s=0.2,
        engine_metrics_stale_s=120.0,  # staleness must not be what takes the worker out
        engine_first_token_timeout_s=10.0,
        engine_token_timeout_s=10.0,
        **fast,
    )
    return Agent(settings, build_engine(settings))


@contextlib.contextmanager
def _hung(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """The engine process stopped (SIGSTOP) for the block; always continued (SIGCONT) after."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


async def _within(holds: Callable[[], Awaitable[bool]], failure: Callable[[], str]) -> None:
    """``holds`` comes true within the health bound (plus margin), else fail with ``failure``."""
    try:
        await eventually(holds, timeout_s=BOUND_S, every_s=0.02)
    except AssertionError:
        raise AssertionError(failure()) from None


def _prompt(phase: int, i: int) -> list[int]:
    """A prompt no other request shares: no cache term pulls it to either worker."""
    start = 10_000 + (phase * 100 + i) * 1000
    return list(range(start, start + 256))


async def _run_batch(c: Client, phase: int, n: int = 8) -> list[Result]:
    handles = [await c.submit("sim", _prompt(phase, i), max_tokens=16) for i in range(n)]
    return list(await asyncio.gather(*(h.result(timeout_s=30) for h in handles)))


async def test_a_hung_engine_takes_its_worker_out_within_the_health_bound_and_back(
    nats_url: str,
) -> None:
    ports = {"a": _free_port(), "b": _free_port()}
    # Real time (speed 1): a batch's requests overlap, so that while both workers are
    # available the load term spreads it over both.
    procs = {}
    for n, port in ports.items():
        procs[n] = _start(["--host", "127.0.0.1", "--port", str(port), "--speed", "1"])
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    try:
        for n, proc in procs.items():
            with httpx.Client(base_url=urls[n], timeout=30) as hc:
                _wait_healthy(hc, proc)
        kw = cluster_kwargs(workers=0, dispatcher={"routing_explore_share": 0.0})
        async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
            sched = live_scheduler(cluster)
            agents = {n: _agent(nats_url, f"http-{n}", urls[n]) for n in procs}
            try:
                for a in agents.values():
                    await a.start()
                hung_id, other_id = agents["a"].worker_id, agents["b"].worker_id

                def capacity(worker_id: str) -> int | None:
                    info = sched().workers().get(worker_id)
                    return None if info is None else info.capacity

                async def both_known() -> bool:
                    return capacity(hung_id) == capacity(other_id) == CAPACITY

                await eventually(both_known)
                # The premise: while both answer, a batch is spread over both workers.
                before = await _run_batch(c, 1)
                assert all(r.ok for r in before)
                assert {r.worker_id for r in before} == {hung_id, other_id}, "not spread"

                async def idle() -> bool:
                    return sched().running == 0

                await eventually(idle)  # nothing in flight on the engine about to hang

                loop = asyncio.get_running_loop()
                with _hung(procs["a"]):
                    t0 = loop.time()

                    async def out() -> bool:
                        return capacity(hung_id) == 0

                    await _within(
                        out,
                        lambda: (
                            f"the hung engine's worker {hung_id} still had capacity "
                            f"{capacity(hung_id)} at the dispatcher {BOUND_S:.1f} s after SIGSTOP "
                            f"(engine available: {agents['a'].engine.available})"
                        ),
                    )
                    took_s = loop.time() - t0
                    assert not agents["a"].engine.available
                    # While it hangs, every request runs on the other worker, first time.
                    during = await _run_batch(c, 2)
                    assert all(r.ok for r in during)
                    assert [(r.worker_id, r.attempt) for r in during] == [(other_id, 1)] * 8
                    # And still out once that batch is done: the checks go on failing.
                    assert capacity(hung_id) == 0 and not agents["a"].engine.available
                    t1 = loop.time()
                # SIGCONT: the next health check passes and the heartbeat offers capacity again.

                async def back() -> bool:
                    return capacity(hung_id) == CAPACITY and agents["a"].engine.available

                await _within(
                    back,
                    lambda: (
                        f"the engine answers again, but its worker {hung_id} had capacity "
                        f"{capacity(hung_id)} at the dispatcher {BOUND_S:.1f} s after SIGCONT "
                        f"(engine available: {agents['a'].engine.available})"
                    ),
                )
                back_s = loop.time() - t1
                after = await _run_batch(c, 3)
                assert all(r.ok and r.attempt == 1 for r in after)
                assert hung_id in {r.worker_id for r in after}, "the returned worker took none"
                print(f"out after {took_s:.2f} s, back after {back_s:.2f} s")
            finally:
                for proc in procs.values():  # never leave an agent's engine stopped
                    _continue(proc)
                for a in agents.values():
                    await a.stop(drain=False)
    finally:
        for proc in procs.values():
            _continue(proc)  # a stopped process would not act on SIGTERM
            _stop(proc)


def _continue(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)

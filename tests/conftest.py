"""Fixtures: a real nats-server per test (embedded by default), and an in-process cluster.

``SLUICE_NATS_URL`` points the tests at an existing server instead (its Sluice streams are
deleted before each test); ``SLUICE_TEST_NATS=testcontainers`` starts NATS in Docker.
"""

from __future__ import annotations

import asyncio
import contextlib
import linecache
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import nats
import pytest
from nats.js.client import JetStreamContext

from sluice.client import Client
from sluice.dispatcher.scheduler import Scheduler
from sluice.schemas import names
from sluice.schemas.codec import encode
from sluice.schemas.models import Result
from sluice.testing.cluster import LocalCluster
from sluice.testing.natsserver import EmbeddedNats
from sluice.testing.processes import stop_processes

# Fast settings for tests: short heartbeats and leases, a fast simulated clock. A lease of ten
# heartbeats: a test process starved of the CPU for a second (the suite runs several tests at
# once on 2 cores) must not lose its in-process workers.
FAST_DISPATCHER: dict[str, Any] = {
    "lease_s": 2.0,
    "learn_s": 0.3,
    "leader_lease_s": 1.0,
    "model_grace_s": 0.5,
    "handoff_timeout_s": 1.0,
    "fetch_timeout_s": 0.5,
    "tick_s": 0.02,
    "models": ["sim"],
    # The agents' engines run 20x faster than the reference engine: engine time says so.
    "engine_prefill_tokens_per_s": 8000.0 * 20,
    "engine_decode_token_s": (0.00035 + 0.006 / 64) / 20,
}
FAST_AGENT: dict[str, Any] = {"speed": 20.0, "heartbeat_s": 0.2, "drain_timeout_s": 5.0}


def pytest_configure(config: pytest.Config) -> None:
    # One external server for every test: tests run at once would delete each other's streams.
    workers = config.getoption("numprocesses", default=None)
    if os.environ.get("SLUICE_NATS_URL") and (isinstance(workers, str) or (workers or 0) > 1):
        raise pytest.UsageError(
            "SLUICE_NATS_URL points every test at one server, whose Sluice streams each test "
            "deletes: run the tests one at a time (-n 0, or make test TEST_WORKERS=0), "
            f"not {workers} at once"
        )


@pytest.fixture
def nats_url() -> Iterator[str]:
    external = os.environ.get("SLUICE_NATS_URL")
    if external:
        yield external
        return
    if os.environ.get("SLUICE_TEST_NATS") == "testcontainers":
        tc = pytest.importorskip("testcontainers.nats")
        with tc.NatsContainer(command="-js") as container:  # pragma: no cover - needs Docker
            yield container.nats_uri()
        return
    with EmbeddedNats() as server:
        yield server.url


def _await_chain(task: asyncio.Task[object]) -> str:
    frames = []
    coro: object = task.get_coro()
    while coro is not None:
        frame = next(
            (
                getattr(coro, a)
                for a in ("cr_frame", "ag_frame", "gi_frame")
                if getattr(coro, a, None)
            ),
            None,
        )
        if frame is not None:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            frames.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {line}")
        coro = next(
            (
                getattr(coro, a)
                for a in ("cr_await", "ag_await", "gi_yieldfrom")
                if getattr(coro, a, None)
            ),
            None,
        )
    return " > ".join(frames)


@pytest.fixture(autouse=True)
async def _hang_report() -> AsyncIterator[None]:
    """If a test is still running after 15 s, print where every task is waiting (a hang
    otherwise shows only the event loop's select() in pytest-timeout's report)."""

    async def watch() -> None:
        await asyncio.sleep(15)
        for task in asyncio.all_tasks():
            print(f"[hang-report] {task.get_name()}: {_await_chain(task)}", file=sys.stderr)

    watcher = asyncio.create_task(watch())
    yield
    watcher.cancel()


@pytest.fixture(autouse=True)
async def _clean_external_server(request: pytest.FixtureRequest) -> None:
    if "nats_url" not in request.fixturenames or not os.environ.get("SLUICE_NATS_URL"):
        return
    nc = await nats.connect(os.environ["SLUICE_NATS_URL"])
    js = nc.jetstream()
    for info in await js.streams_info():
        # ...and the leader bucket: a key left by a killed dispatcher would delay the next one
        if info.config.name and info.config.name.startswith(("SLUICE_", "KV_SLUICE_LEADER")):
            await js.delete_stream(info.config.name)
    await nc.close()


async def eventually(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, every_s: float = 0.05
) -> None:
    """Poll ``predicate`` until it holds; fail the test if it does not within ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(every_s)


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """A real HTTP server (uvicorn, a free loopback port, in this loop) serving the ASGI
    ``app``; yields its base URL, and stops it on exit (waiting for its handlers: a handler
    must not sleep for long)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    task = asyncio.create_task(server.serve())
    try:

        async def started() -> bool:
            return bool(server.started) or task.done()

        await eventually(started)
        if task.done():
            task.result()  # (its error, if it could not start)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def store_result(js: JetStreamContext, result: Result, tenant: str = "default") -> None:
    """Store ``result`` in the result stream as a worker's agent does (deduplicated by its
    request id): a run that finished, whatever happens to its completion report."""
    await js.publish(
        names.result_subject(tenant, result.request_id),
        encode(result),
        headers={names.MSG_ID_HEADER: result.request_id},
    )


def cluster_kwargs(
    workers: int = 2, dispatcher: dict[str, Any] | None = None, agent: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "workers": workers,
        "dispatcher": {**FAST_DISPATCHER, **(dispatcher or {})},
        "agent": {**FAST_AGENT, **(agent or {})},
    }


def live_scheduler(cluster: LocalCluster) -> Callable[[], Scheduler]:
    """The cluster's dispatcher's scheduler, read at each call: a test process starved of the
    CPU may lose leadership for a moment, and a new term makes a new scheduler (the old one's
    books stay as they were)."""
    return lambda: cluster.dispatcher.scheduler


@pytest.fixture
async def cluster(nats_url: str) -> AsyncIterator[LocalCluster]:
    async with LocalCluster(nats_url, **cluster_kwargs()) as c:
        yield c


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[Client]:
    async with Client(nats_url) as c:
        yield c


SLUICE = [sys.executable, "-m", "sluice.cli"]
"""The command line as a process: ``python -m sluice.cli`` of this interpreter."""


class Procs:
    """``sluice`` processes a test started; :meth:`stop_all` stops each by its PID (SIGTERM,
    then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            SLUICE + args,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        stop_processes(self.procs)


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    try:
        yield ps
    finally:
        ps.stop_all()

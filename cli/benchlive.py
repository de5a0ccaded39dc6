"""``sluice bench``'s live figures: the hot path of a real fleet against the broker's own speed.

One embedded nats-server, one dispatcher and ``agents`` agents with instant engines (the
simulated engine at a huge clock speed-up), each a separate ``sluice`` process, as in
production. On it, in one run:

- **dispatch latency** on an idle cluster: sequential requests, from just before the client's
  submit until the worker accepted the assignment (the agent's clock, the same machine's), p50
  and p99; against a JetStream publish acknowledgement and a core request/reply measured in the
  same run, on the same server;
- **end-to-end throughput**: ``submitters`` concurrent submitters, each submitting and waiting
  for the result, requests/s; against the raw JetStream loop in the same run, on a work-queue
  stream like a band's: publish a message and await its ack, fetch it, ack it, again,
  messages/s (and, for reference, the broker's pace with as many concurrent publishers and a
  consumer fetching batches).

The targets (issue 14): dispatch p50 at most 4x the publish ack, p99 at most 3 ms; throughput at
least 0.4x the raw loop. :func:`verdicts` says how far each figure is from its target.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js import api

from sluice.cli.benchsizes import (
    AGENTS,
    LATENCY_REQUESTS,
    PROMPT_TOKENS,
    SUBMITTERS,
    THROUGHPUT_REQUESTS,
)
from sluice.client import Client, ServiceUnavailable
from sluice.common.aio import stop_if_cancelled
from sluice.dispatcher.stats import percentile
from sluice.schemas.codec import encode
from sluice.schemas.models import SubmitRequest
from sluice.testing.natsserver import EmbeddedNats
from sluice.testing.processes import DIE_WITH_PARENT, SLUICE, stop_processes

DISPATCH_RATIO_TARGET = 4.0
"""Dispatch latency p50 at most this many publish acks (measured in the same run)."""
DISPATCH_P99_TARGET_MS = 3.0
THROUGHPUT_RATIO_TARGET = 0.4
"""End-to-end requests/s at least this fraction of the raw JetStream loop's messages/s."""


class BenchError(Exception):
    """The fleet did not come up, or a request of the benchmark did not run."""


_MODEL = "sim"
_READY_TIMEOUT_S = 60.0
_INSTANT_SPEED = 1e6
"""The simulated engine's clock speed-up: a 256-token prefill and one token take ~0 s."""


@dataclass(frozen=True)
class HotSizes:
    """How much each live figure measures (the CLI's defaults)."""

    latency_requests: int = LATENCY_REQUESTS
    throughput_requests: int = THROUGHPUT_REQUESTS
    submitters: int = SUBMITTERS
    agents: int = AGENTS
    prompt_tokens: int = PROMPT_TOKENS
    """Tokens of every request's prompt (the same prompt each time, so cached after the
    first): what the dispatcher decodes and hashes, and the baselines publish, per request."""


@dataclass(frozen=True)
class HotFigures:
    """Every live figure of one run."""

    latency_requests: int
    dispatch_p50_ms: float
    dispatch_p99_ms: float
    publish_ack_p50_ms: float
    """JetStream publish acks back to back, before the fleet starts (the issue's baseline)."""
    publish_ack_between_p50_ms: float
    """A JetStream publish ack after each of the sequential dispatches, with the fleet up: the
    broker and the machine as each dispatch meets them (idle a moment, not back to back)."""
    submit_p50_ms: float
    """``Client.submit`` returning (the request's own publish acknowledged), in the fleet."""
    request_reply_p50_ms: float
    throughput_requests: int
    submitters: int
    agents: int
    prompt_tokens: int
    throughput_rps: float
    dispatcher_cpu_ms_per_request: float
    """The dispatcher process's CPU time over the throughput run, per request (-1: unknown)."""
    agent_cpu_ms_per_request: float
    """The agent processes' CPU time over the throughput run, per request (-1: unknown)."""
    raw_jetstream_rps: float
    """The raw loop: publish, fetch, ack, one message at a time."""
    raw_jetstream_concurrent_rps: float
    """Concurrent publishers and a batching consumer (for reference; no target)."""

    @property
    def dispatch_ratio(self) -> float:
        return self.dispatch_p50_ms / self.publish_ack_p50_ms

    @property
    def dispatch_ratio_between(self) -> float:
        """The dispatch p50 against the publish ack measured between the dispatches."""
        return self.dispatch_p50_ms / self.publish_ack_between_p50_ms

    @property
    def throughput_ratio(self) -> float:
        return self.throughput_rps / self.raw_jetstream_rps

    def as_dict(self) -> dict[str, float | int]:
        """The figures and their ratios, flat (for ``sluice bench --json``)."""
        return {
            **asdict(self),
            "dispatch_ratio": self.dispatch_ratio,
            "dispatch_ratio_between": self.dispatch_ratio_between,
            "throughput_ratio": self.throughput_ratio,
        }


@dataclass(frozen=True)
class Verdict:
    """One figure against its target."""

    name: str
    value: float
    target: float
    higher_is_better: bool

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    @property
    def off_by(self) -> float:
        """How far from the target, as a factor (< 1: within it by that much)."""
        return self.target / self.value if self.higher_is_better else self.value / self.target


def verdicts(f: HotFigures) -> list[Verdict]:
    """The three targets of the hot path (the first against both publish-ack baselines)."""
    return [
        Verdict("dispatch p50 / publish ack", f.dispatch_ratio, DISPATCH_RATIO_TARGET, False),
        Verdict(
            "dispatch p50 / publish ack between dispatches",
            f.dispatch_ratio_between,
            DISPATCH_RATIO_TARGET,
            False,
        ),
        Verdict("dispatch p99 (ms)", f.dispatch_p99_ms, DISPATCH_P99_TARGET_MS, False),
        Verdict("throughput / raw JetStream", f.throughput_ratio, THROUGHPUT_RATIO_TARGET, True),
    ]


async def bench_hot(sizes: HotSizes | None = None) -> HotFigures:
    """Start the fleet, measure every live figure, stop every process it started."""
    z = sizes or HotSizes()
    prompt = list(range(z.prompt_tokens))
    payload = _request_bytes(prompt)
    with EmbeddedNats() as server, TemporaryDirectory(prefix="sluice-bench-") as tmp:
        pub_ms, rr_ms = await _broker_rtts(server.url, z.latency_requests, payload)
        raw_rps, raw_concurrent_rps = await _raw_jetstream(
            server.url, z.throughput_requests, z.submitters, payload
        )
        procs: dict[subprocess.Popen[bytes], Path] = {}  # each with its log
        try:
            fleet = [("dispatcher", _dispatcher_env(server.url), Path(tmp) / "d.log")]
            fleet += [
                ("agent", _agent_env(server.url, i), Path(tmp) / f"a{i}.log")
                for i in range(z.agents)
            ]
            for part, env, log in fleet:
                procs[_spawn([part], env, log)] = log
            async with Client(server.url) as client:
                await _ready(client, z.agents, procs, prompt)
                dispatch_ms, submit_ms, between_ms = await _dispatch_latency(
                    client, z.latency_requests, prompt, payload
                )
                cpu0 = [_cpu_s(p.pid) for p in procs]
                rps = await _throughput(client, z.throughput_requests, z.submitters, prompt)
                cpu = [b - a for a, b in zip(cpu0, [_cpu_s(p.pid) for p in procs], strict=True)]
        finally:
            stop_processes(procs)
    return HotFigures(
        latency_requests=z.latency_requests,
        dispatch_p50_ms=percentile(dispatch_ms, 50),
        dispatch_p99_ms=percentile(dispatch_ms, 99),
        publish_ack_p50_ms=percentile(pub_ms, 50),
        publish_ack_between_p50_ms=percentile(between_ms, 50),
        submit_p50_ms=percentile(submit_ms, 50),
        request_reply_p50_ms=percentile(rr_ms, 50),
        throughput_requests=z.throughput_requests,
        submitters=z.submitters,
        agents=z.agents,
        prompt_tokens=z.prompt_tokens,
        throughput_rps=rps,
        dispatcher_cpu_ms_per_request=_per_request_ms(cpu[:1], z.throughput_requests),
        agent_cpu_ms_per_request=_per_request_ms(cpu[1:], z.throughput_requests),
        raw_jetstream_rps=raw_rps,
        raw_jetstream_concurrent_rps=raw_concurrent_rps,
    )


# ---------------------------------------------------------------------- the baselines


def _request_bytes(prompt: list[int]) -> bytes:
    """A submitted request as the client encodes it: the baselines move the same bytes."""
    r = SubmitRequest(
        request_id="0" * 32,
        model=_MODEL,
        tenant="default",
        band="interactive",
        prompt_tokens=prompt,
        max_tokens=1,
        submitted_unix_ms=int(time.time() * 1000),
    )
    return encode(r)


async def _broker_rtts(url: str, n: int, payload: bytes) -> tuple[list[float], list[float]]:
    """JetStream publish acks and core request/replies, sequential, in ms."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="BENCH_RTT", subjects=["bench.rtt"], storage=api.StorageType.FILE)

        async def echo(msg: Msg) -> None:
            await msg.respond(b"")

        await nc.subscribe("bench.echo", cb=echo)
        pub_ms, rr_ms = [], []
        for i in range(n):
            stop_if_cancelled()
            t = time.perf_counter()
            await js.publish("bench.rtt", payload, headers={"Nats-Msg-Id": f"rtt-{i}"})
            pub_ms.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            await nc.request("bench.echo", b"x", timeout=2)
            rr_ms.append((time.perf_counter() - t) * 1000)
        await js.delete_stream("BENCH_RTT")
    finally:
        await nc.close()
    return pub_ms, rr_ms


async def _raw_jetstream(url: str, n: int, publishers: int, payload: bytes) -> tuple[float, float]:
    """The broker's own pace on a work-queue stream like a band's, messages/s: the raw loop
    (publish one message and await its ack, fetch it, ack it, again), and the same with
    ``publishers`` concurrent publishers and one consumer fetching batches."""
    pub_nc, sub_nc = await nats.connect(url), await nats.connect(url)
    try:
        js, sjs = pub_nc.jetstream(), sub_nc.jetstream()
        await js.add_stream(
            name="BENCH_RAW",
            subjects=["bench.raw.>"],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
        )
        await js.add_consumer(
            "BENCH_RAW", durable_name="raw", ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=-1
        )
        psub = await sjs.pull_subscribe_bind(durable="raw", stream="BENCH_RAW")

        async def publish(p: int, count: int) -> None:
            for i in range(count):
                stop_if_cancelled()
                await js.publish("bench.raw.m", payload, headers={"Nats-Msg-Id": f"r{p}-{i}"})

        async def consume(count: int, batch: int) -> None:
            got = 0
            while got < count:
                stop_if_cancelled()
                try:
                    msgs = await psub.fetch(batch=min(batch, count - got), timeout=0.2)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                for m in msgs:
                    await m.ack()
                got += len(msgs)
            await sub_nc.flush()

        t0 = time.perf_counter()
        for i in range(n):
            await publish(-i - 1, 1)
            await consume(1, 1)
        loop_rps = n / (time.perf_counter() - t0)
        per = [n // publishers + (i < n % publishers) for i in range(publishers)]
        t0 = time.perf_counter()
        await asyncio.gather(consume(n, 128), *(publish(p, c) for p, c in enumerate(per)))
        concurrent_rps = n / (time.perf_counter() - t0)
        await js.delete_stream("BENCH_RAW")
    finally:
        await pub_nc.close()
        await sub_nc.close()
    return loop_rps, concurrent_rps


# ---------------------------------------------------------------------- the fleet


def _dispatcher_settings() -> dict[str, Any]:
    """The fleet's dispatcher's settings, over the environment's."""
    return {"dispatcher_id": "bench-d", "models": [_MODEL], "learn_s": 0.2, "leader_settle_s": 0.2}


def _agent_settings(i: int) -> dict[str, Any]:
    """The fleet's agent ``i``'s settings, over the environment's."""
    return {"worker_id": f"worker-{i}", "models": [_MODEL], "speed": _INSTANT_SPEED}


def _env(url: str, prefix: str, settings: dict[str, Any]) -> dict[str, str]:
    out = {"SLUICE_NATS_URL": url}
    for name, value in settings.items():
        out[f"{prefix}{name.upper()}"] = (
            json.dumps(value) if isinstance(value, list) else str(value)
        )
    return out


def _dispatcher_env(url: str) -> dict[str, str]:
    return _env(url, "SLUICE_DISPATCHER_", _dispatcher_settings())


def _agent_env(url: str, i: int) -> dict[str, str]:
    return _env(url, "SLUICE_AGENT_", _agent_settings(i))


def check_fleet_settings() -> None:
    """The settings the fleet's processes will read (the environment's and its config file's,
    with the fleet's own over them), checked here: a bad ``SLUICE_…`` variable was a process
    that died, said only "a fleet process ended early", after the core's minutes. Raises
    ``ConfigError``."""
    from sluice.agent.runtime import AgentSettings
    from sluice.dispatcher.runtime import DispatcherSettings

    url = "nats://127.0.0.1:4222"  # (its own broker's, not known yet)
    DispatcherSettings.load(None, nats_url=url, **_dispatcher_settings())
    AgentSettings.load(None, nats_url=url, **_agent_settings(0))


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [*SLUICE, *args],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=DIE_WITH_PARENT,
        )


def _died(proc: subprocess.Popen[bytes], log: Path) -> str:
    """A fleet process that ended early, and what it said last (its log goes with the run's
    temporary folder: it said only "a fleet process ended early")."""
    try:
        said = log.read_text(errors="replace").strip().splitlines()[-12:]
    except OSError:
        said = []
    name = " ".join(str(a) for a in proc.args[len(SLUICE) :]) if isinstance(proc.args, list) else ""
    return (
        f"a fleet process (sluice {name}) ended early (exit code {proc.returncode}):\n"
        + "\n".join(said)
    )


def _cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc; -1 where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _per_request_ms(cpu_s: list[float], requests: int) -> float:
    if any(c < 0 for c in cpu_s):
        return -1.0
    return sum(cpu_s) / requests * 1000


async def _ready(
    client: Client, agents: int, procs: dict[subprocess.Popen[bytes], Path], prompt: list[int]
) -> None:
    """Until the dispatcher leads with every agent registered and a request has run."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while True:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise BenchError(_died(dead[0], procs[dead[0]]))
        if time.monotonic() > deadline:
            raise BenchError(f"the fleet did not come up within {_READY_TIMEOUT_S:.0f} s")
        try:
            if len((await client.workers(timeout_s=0.5)).workers) >= agents:
                break
        except ServiceUnavailable:  # no leader yet (no responders, timeout): ask again
            pass
        await asyncio.sleep(0.1)
    for _ in range(20):  # warm every agent's and the dispatcher's first-use paths
        h = await client.submit(_MODEL, prompt, max_tokens=1, band="interactive")
        await h.result(timeout_s=_READY_TIMEOUT_S)


async def _dispatch_latency(
    client: Client, n: int, prompt: list[int], payload: bytes
) -> tuple[list[float], list[float], list[float]]:
    """Sequential requests on the idle fleet, in ms: submit until a worker accepted it, and
    until ``submit`` returned (its publish acknowledged); and after each, one JetStream publish
    ack on a stream of its own (the baseline as the dispatches meet the broker). The agent's
    accept time is the result's ``queued_s`` after the request's submission stamp."""
    js = client.nc.jetstream()
    await js.add_stream(
        name="BENCH_BETWEEN", subjects=["bench.between"], storage=api.StorageType.FILE
    )
    out, submits, between = [], [], []
    try:
        for i in range(n):
            stop_if_cancelled()
            t0 = time.time()
            h = await client.submit(_MODEL, prompt, max_tokens=1, band="interactive")
            submits.append((time.time() - t0) * 1000)
            r = await h.result(timeout_s=30)
            if r.timings is None:
                raise BenchError(f"request {r.request_id} did not run: {r.rejection}")
            accepted_unix_s = h.request.submitted_unix_ms / 1000 + r.timings.queued_s
            out.append((accepted_unix_s - t0) * 1000)
            t = time.perf_counter()
            await js.publish("bench.between", payload, headers={"Nats-Msg-Id": f"between-{i}"})
            between.append((time.perf_counter() - t) * 1000)
    finally:
        await js.delete_stream("BENCH_BETWEEN")
    return out, submits, between


async def _throughput(client: Client, n: int, submitters: int, prompt: list[int]) -> float:
    """``submitters`` concurrent loops of submit and wait for the result: requests/s."""
    per = [n // submitters + (i < n % submitters) for i in range(submitters)]
    failed = 0

    async def submitter(count: int) -> None:
        nonlocal failed
        for _ in range(count):
            h = await client.submit(_MODEL, prompt, max_tokens=1, band="interactive")
            failed += not (await h.result(timeout_s=60)).ok

    t0 = time.perf_counter()
    await asyncio.gather(*(submitter(c) for c in per))
    elapsed = time.perf_counter() - t0
    if failed:
        raise BenchError(f"{failed} of {n} requests failed")
    return n / elapsed

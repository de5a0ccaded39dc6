"""``sluice bench-gateway``: what ``sluice gateway`` adds to the client library, in one run.

Two paths serve the same kind of requests (a prompt of its own ``PROMPT_TOKENS`` token ids, so
no request hits another's cache; ``max_tokens`` output tokens) on one cluster (an embedded
nats-server, a dispatcher and simulated agents in this process):

- **client library**: ``Client.submit`` and its token stream, in this process: the baseline;
- **gateway**: a ``sluice gateway`` process (open, on a free loopback port) streaming
  ``POST /v1/completions`` as server-sent events to an httpx client in this process.

First the time to the first token, one request at a time, the paths alternating (each takes
the first place in turn), so that the machine's noise falls on both. Then the requests per
second each path relays at a given concurrency (64 by default): a burst of requests with that
many in flight at once (that many workers, each with its own HTTP connection on the gateway
path), the paths in the order client, gateway, gateway, client (each twice, so that neither
always runs on a warmer or a colder machine). Every ratio is against the
client library of the same run. The gateway's own count of the answers it sent (its
``/metrics``) is read at the end: every request of the gateway path went through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

import httpx
from rich.table import Table

from sluice.client import Client
from sluice.common.aio import stop_if_cancelled
from sluice.dispatcher.stats import percentile
from sluice.testing.cluster import LocalCluster
from sluice.testing.errors import GatewayProcessError
from sluice.testing.gateway import GatewayProcess
from sluice.testing.natsserver import EmbeddedNats

PROMPT_TOKENS = 256
"""Every request's prompt: this many token ids of its own."""
ANSWERED = 'sluice_gateway_requests_total{route="/v1/completions",status="200"}'
"""The gateway's count of completions it answered (its /metrics sample)."""

Path = Callable[[int, int], Awaitable[float]]
"""A path's request ``i`` with ``max_tokens``: returns the seconds to its first token, after
the whole answer arrived."""


class BenchError(Exception):
    """A request of the benchmark did not complete as it should."""


@dataclass(frozen=True)
class PathFigures:
    ttft_p50_ms: float
    ttft_p99_ms: float
    rps: float
    """Requests per second relayed at the benchmark's concurrency (mean of its runs)."""


@dataclass(frozen=True)
class GatewayBenchResult:
    requests: int
    burst: int
    concurrency: int
    max_tokens: int
    speed: float
    workers: int
    client: PathFigures
    gateway: PathFigures
    relayed: int
    """Completions the gateway process says it answered (200s, from its own metrics)."""

    @property
    def added_ttft_p50_ms(self) -> float:
        return self.gateway.ttft_p50_ms - self.client.ttft_p50_ms

    @property
    def added_ttft_p99_ms(self) -> float:
        return self.gateway.ttft_p99_ms - self.client.ttft_p99_ms


def _prompt(i: int) -> list[int]:
    start = 10_000 + (PROMPT_TOKENS + 8) * i
    return list(range(start, start + PROMPT_TOKENS))


async def _via_client(c: Client, i: int, max_tokens: int) -> float:
    t0 = time.perf_counter()
    h = await c.submit("sim", _prompt(i), max_tokens=max_tokens)
    first = 0.0
    async for _ in h:
        first = first or time.perf_counter() - t0
    result = await h.result(timeout_s=60)
    if not result.ok or len(result.output_tokens) != max_tokens:
        raise BenchError(f"client request {i} ended with {result}")
    return first


async def _via_gateway(http: httpx.AsyncClient, i: int, max_tokens: int) -> float:
    body = {"model": "sim", "prompt": _prompt(i), "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    first, done = 0.0, False
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise BenchError(f"gateway request {i}: {r.status_code} {(await r.aread())!r}")
        async for line in r.aiter_lines():
            if not first and line.startswith('data: {"id"') and '"text":""' not in line:
                first = time.perf_counter() - t0
            done = done or line == "data: [DONE]"
    if not done:
        raise BenchError(f"gateway request {i}: the stream ended before [DONE]")
    return first


async def _ttfts(paths: dict[str, Path], requests: int, max_tokens: int) -> dict[str, list[float]]:
    names = list(paths)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(requests):
        for k in range(len(names)):  # round i starts with path i mod n
            name = names[(i + k) % len(names)]
            out[name].append(await paths[name](len(names) * i + k, max_tokens))
    return out


async def _rate(workers: Sequence[Path], base: int, burst: int, max_tokens: int) -> float:
    """Requests per second of ``burst`` requests, one worker per path in ``workers`` (so that
    many are in flight at once), each taking the next request when its last one is done."""
    ids = iter(range(base, base + burst))

    async def work(path: Path) -> None:
        for i in ids:
            await path(i, max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(work(path) for path in workers))
    return burst / (time.perf_counter() - t0)


async def _answered(http: httpx.AsyncClient) -> int:
    text = (await http.get("/metrics")).text
    rows = [ln for ln in text.splitlines() if ln.startswith(ANSWERED + " ")]
    return int(float(rows[0].split()[-1])) if rows else 0


def _started(stack: contextlib.ExitStack, gateway: GatewayProcess) -> GatewayProcess:
    """``gateway`` started, stopped with ``stack``; a start cut short by Ctrl-C (the terminal
    signals the gateway too) is the interruption it is, not an error with the gateway's
    traceback (exit code 2)."""
    try:
        return stack.enter_context(gateway)
    except GatewayProcessError:
        stop_if_cancelled()
        raise


async def bench_gateway(
    requests: int = 200,
    burst: int = 1000,
    concurrency: int = 64,
    max_tokens: int = 16,
    speed: float = 50.0,
    workers: int = 4,
) -> GatewayBenchResult:
    """Run both paths (see the module docstring) on ``workers`` simulated agents at
    ``speed`` (a fast engine shows what the gateway itself can relay)."""
    capacity = max(1, -(-concurrency * 2 // workers))  # the engines never hold a path back
    kw = {
        "workers": workers,
        # learn_s: dispatch from the first heartbeat on (a fresh cluster has nothing to adopt)
        "dispatcher": {"models": ["sim"], "global_limit": capacity * workers, "learn_s": 0.5},
        "agent": {"speed": speed, "capacity": capacity},
    }
    with EmbeddedNats() as nats, contextlib.ExitStack() as started:
        # Started before the cluster (its start blocks the event loop for a second, which
        # cost the cluster's dispatcher its leadership), and stopped before it: stopped after
        # the cluster, on a Ctrl-C, it waited its whole grace for streams nobody could finish.
        gw = _started(started, GatewayProcess(nats.url))
        async with (
            LocalCluster(nats.url, **kw),  # type: ignore[arg-type]
            Client(nats.url) as c,
            contextlib.AsyncExitStack() as stack,
        ):
            # In a thread: stopped on the event loop, it held up the cluster that serves
            # its last streams, and waited its whole grace for them all the same.
            stack.push_async_callback(asyncio.to_thread, gw.stop)
            # One HTTP client (one connection) per worker: httpx's pool scans its connections
            # for every request, so one pool of 64 connections limits the load generator, not
            # the gateway (about 150-200 requests/s here against about 740 this way).
            https = [
                await stack.enter_async_context(httpx.AsyncClient(base_url=gw.url, timeout=60))
                for _ in range(concurrency)
            ]
            client_path: Path = partial(_via_client, c)
            gateway_paths: list[Path] = [partial(_via_gateway, h) for h in https]
            paths = {"client": client_path, "gateway": gateway_paths[0]}
            for k in range(8):  # warm up: the agents have joined, connections exist
                for path in paths.values():
                    await path(1_000_000 + k, 2)
            ttft = await _ttfts(paths, requests, max_tokens)
            workers_of = {"client": [client_path] * concurrency, "gateway": gateway_paths}
            rates: dict[str, list[float]] = {"client": [], "gateway": []}
            base = 2 * requests
            for name in ("client", "gateway", "gateway", "client"):
                rates[name].append(await _rate(workers_of[name], base, burst, max_tokens))
                base += burst
            relayed = await _answered(https[0])
    figures = {
        name: PathFigures(
            ttft_p50_ms=percentile(ttft[name], 50) * 1000,
            ttft_p99_ms=percentile(ttft[name], 99) * 1000,
            rps=sum(rates[name]) / len(rates[name]),
        )
        for name in ("client", "gateway")
    }
    return GatewayBenchResult(
        requests,
        burst,
        concurrency,
        max_tokens,
        speed,
        workers,
        figures["client"],
        figures["gateway"],
        relayed,
    )


def _ratio(value: float, base: float) -> str:
    return f"x{value / base:.2f}" if base > 0 else "-"


def table(r: GatewayBenchResult) -> Table:
    """Both paths' figures, the ratios against the client library of the same run."""
    t = Table(
        title=f"{r.requests} sequential requests per path, then {r.burst} x 2 per path at "
        f"concurrency {r.concurrency}; {r.max_tokens} output tokens, {r.workers} workers at "
        f"speed x{r.speed:g}"
    )
    for col in ("path", "TTFT p50", "x client", "TTFT p99", "x client", "requests/s", "x client"):
        t.add_column(col, justify="left" if col == "path" else "right")
    base = r.client
    for label, f in (("client library", r.client), ("gateway (HTTP, SSE)", r.gateway)):
        t.add_row(
            label,
            f"{f.ttft_p50_ms:.2f} ms",
            _ratio(f.ttft_p50_ms, base.ttft_p50_ms),
            f"{f.ttft_p99_ms:.2f} ms",
            _ratio(f.ttft_p99_ms, base.ttft_p99_ms),
            f"{f.rps:,.0f}",
            _ratio(f.rps, base.rps),
        )
    return t


def verdict(r: GatewayBenchResult) -> str:
    return (
        f"the gateway adds {r.added_ttft_p50_ms:+.2f} ms to the first token at p50 "
        f"({r.added_ttft_p99_ms:+.2f} ms at p99) and relays "
        f"{_ratio(r.gateway.rps, r.client.rps)} the client library's requests/s at concurrency "
        f"{r.concurrency}; it answered {r.relayed:,} completions"
    )

"""``sluice bench-engine``: what the ``sluice engine`` server and the agent add to the simulated
engine, each against the path below it, in the same run.

Three paths serve the same requests (a prompt of 512 token ids, ``max_tokens`` output
tokens), on the same engine profile at the same speed:

- **in process**: a :class:`~sluice.testing.engineserver.SimServer` (the server's own engine and
  real-time stepping loop) driven through its ``submit``/``events`` API in this event loop, with
  no HTTP and no second process: the baseline;
- **direct**: an httpx client streaming ``/v1/completions`` from one ``sluice engine`` process
  on a Unix socket (what the server adds: the process hop, HTTP, JSON and SSE);
- **through Sluice**: client → NATS → dispatcher → agent → that engine process, tokens back
  engine → agent → NATS → client, the agent coalescing them (``token_flush_ms``).

Requests rotate between the paths (each takes every position in turn), each with its own
prompt (so all see the same cache behaviour: none), so that the machine's noise falls on all
three. The per-token figure is the mean gap between the first and the last token, not a chunk
interval. Then a burst of concurrent requests on each path gives tokens per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import httpx
from rich.table import Table

from sluice.agent.runtime import Agent, AgentSettings
from sluice.client import Client
from sluice.dispatcher.stats import percentile
from sluice.sim.profiles import get_profile
from sluice.testing.cluster import LocalCluster
from sluice.testing.engines import build_engine
from sluice.testing.engineserver import EngineProcess, SimServer
from sluice.testing.natsserver import EmbeddedNats

SERVER_TTFT_TARGET_MS = 2.0
"""The target for what the ``sluice engine`` server adds to the first token at speed 1 (the
docs state none; this is the benchmark's own)."""

BURST_REQUESTS, BURST_TOKENS = 32, 128
"""The burst: this many concurrent requests of this many output tokens, on each path."""

PathStream = Callable[[int, int], AsyncIterator[None]]
"""A path's stream for prompt ``i`` and ``max_tokens``: one item per arrival of tokens."""


@dataclass(frozen=True)
class PathFigures:
    """One path's figures."""

    ttft_p50_ms: float
    token_ms: float
    """Median over requests of the mean gap between a request's first and last token."""
    burst_tokens_per_s: float


@dataclass(frozen=True)
class EngineBenchResult:
    requests: int
    max_tokens: int
    speed: float
    inproc: PathFigures
    """The simulated engine in this process, no HTTP: the baseline."""
    direct: PathFigures
    """The ``sluice engine`` process reached directly over its Unix socket."""
    sluice: PathFigures
    """The same process through Sluice (``burst_tokens_per_s``: what one agent forwarded)."""

    @property
    def server_added_ttft_ms(self) -> float:
        """What the ``sluice engine`` server adds to the first token (direct - in process)."""
        return self.direct.ttft_p50_ms - self.inproc.ttft_p50_ms

    @property
    def added_ttft_ms(self) -> float:
        """What Sluice adds to the first token (through Sluice - direct)."""
        return self.sluice.ttft_p50_ms - self.direct.ttft_p50_ms

    @property
    def server_ttft_margin_ms(self) -> float:
        """How far under :data:`SERVER_TTFT_TARGET_MS` the server's addition is (negative:
        over it)."""
        return SERVER_TTFT_TARGET_MS - self.server_added_ttft_ms


PROMPT_TOKENS = 512
"""Every request's prompt: this many token ids, its own (no request hits another's cache)."""


def _prompt(i: int) -> list[int]:
    return list(range(10_000 + 600 * i, 10_000 + 600 * i + PROMPT_TOKENS))


async def _inproc(server: SimServer, i: int, max_tokens: int) -> AsyncIterator[None]:
    # The prompt is parsed and hashed here as the HTTP handler does it, so that only the
    # server's HTTP, JSON and process hop separate the two paths.
    rid, stream = server.submit(server.prompt(_prompt(i), "prompt"), max_tokens)
    async for _, fin in server.events(rid, stream):
        if fin is None:
            yield


async def _direct(client: httpx.AsyncClient, i: int, max_tokens: int) -> AsyncIterator[None]:
    body = {"prompt": _prompt(i), "max_tokens": max_tokens, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text":" ' in line.replace(": ", ":"):
                yield


async def _sluice(c: Client, i: int, max_tokens: int) -> AsyncIterator[None]:
    h = await c.submit("sim", _prompt(i), max_tokens=max_tokens)
    async for _ in h:
        yield
    await h.result(timeout_s=60)


async def _timed(path: PathStream, i: int, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, mean seconds between the first and the last) of one
    request; the clock starts before the request is sent."""
    t0 = time.perf_counter()
    first = last = 0.0
    async for _ in path(i, max_tokens):
        now = time.perf_counter()
        first = first or now
        last = now
    return first - t0, (last - first) / max(1, max_tokens - 1)


async def _burst_rate(path: PathStream, base: int) -> float:
    """Output tokens per second of a burst of concurrent requests on ``path``."""
    t0 = time.perf_counter()
    await asyncio.gather(*(_timed(path, base + i, BURST_TOKENS) for i in range(BURST_REQUESTS)))
    return BURST_REQUESTS * BURST_TOKENS / (time.perf_counter() - t0)


async def bench_engine(
    requests: int = 40, max_tokens: int = 32, speed: float = 1.0, profile: str = "reference"
) -> EngineBenchResult:
    """Run the three paths (see the module docstring) on one engine profile; ``speed``: the
    engines' clock speed-up (a fast engine shows what the server and the agent themselves can
    forward)."""
    inproc = SimServer(get_profile(profile), model="sim", speed=speed)
    with contextlib.ExitStack() as stack:  # (a failed start left its folder behind)
        sockets = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="sluice-bench-", ignore_cleanup_errors=True)
        )
        engine = EngineProcess(
            os.path.join(sockets, "e.sock"), model="sim", speed=speed, profile=profile
        ).start()
        stack.callback(engine.stop)
        nats = stack.enter_context(EmbeddedNats())
        settings = AgentSettings(
            nats_url=nats.url,
            worker_id="bench-0",
            engine="openai-http",
            engine_url=engine.url,
            capacity=64,
        )
        transport = httpx.AsyncHTTPTransport(uds=engine.uds)
        async with (
            LocalCluster(nats.url, workers=0, dispatcher={"models": ["sim"]}) as _,
            httpx.AsyncClient(transport=transport, base_url="http://e", timeout=60) as http,
            Client(nats.url) as c,
        ):
            paths: dict[str, PathStream] = {
                "inproc": partial(_inproc, inproc),
                "direct": partial(_direct, http),
                "sluice": partial(_sluice, c),
            }
            agent = Agent(settings, build_engine(settings))
            await agent.start()
            try:
                await inproc.start()
                figures = await _measure(paths, requests, max_tokens)
            finally:
                await inproc.stop()
                await agent.stop(drain=False)
    return EngineBenchResult(
        requests, max_tokens, speed, figures["inproc"], figures["direct"], figures["sluice"]
    )


async def _measure(
    paths: dict[str, PathStream], requests: int, max_tokens: int
) -> dict[str, PathFigures]:
    names = list(paths)
    n = len(names)
    for k, name in enumerate(names):  # warm up: the agent has registered, connections exist
        await _timed(paths[name], 100_000 + k, 2)
    ttft: dict[str, list[float]] = {name: [] for name in names}
    token: dict[str, list[float]] = {name: [] for name in names}
    for i in range(requests):
        for k in range(n):  # round i starts with path i mod n: each path takes each place
            j = (i + k) % n
            first, gap = await _timed(paths[names[j]], n * i + j, max_tokens)
            ttft[names[j]].append(first)
            token[names[j]].append(gap)
    figures = {}
    for k, name in enumerate(names):  # unique prompts after the serial ones
        rate = await _burst_rate(paths[name], n * requests + k * BURST_REQUESTS)
        figures[name] = PathFigures(
            ttft_p50_ms=percentile(ttft[name], 50) * 1000,
            token_ms=percentile(token[name], 50) * 1000,
            burst_tokens_per_s=rate,
        )
    return figures


def _ratio(value: float, base: float) -> str:
    return f"x{value / base:.2f}" if base > 0 else "-"


def table(r: EngineBenchResult) -> Table:
    """The three paths' figures, each ratio against the in-process baseline of the same run;
    "added": first-token time over the path above (the server over in process, Sluice over
    the server reached directly)."""
    t = Table(
        title=f"{r.requests} requests per path, {r.max_tokens} output tokens, speed x{r.speed:g}; "
        f"burst of {BURST_REQUESTS} x {BURST_TOKENS} tokens"
    )
    for col in ("path", "TTFT p50", "added", "x in process", "per token p50", "x in process"):
        t.add_column(col, justify="left" if col == "path" else "right")
    t.add_column("burst tokens/s", justify="right")
    t.add_column("x in process", justify="right")
    base = r.inproc
    rows = [
        ("in process (SimServer, no HTTP)", r.inproc, None),
        ("sluice engine, direct (HTTP, Unix socket)", r.direct, r.server_added_ttft_ms),
        ("through Sluice (one agent)", r.sluice, r.added_ttft_ms),
    ]
    for label, f, added in rows:
        t.add_row(
            label,
            f"{f.ttft_p50_ms:.1f} ms",
            "-" if added is None else f"{added:+.1f} ms",
            _ratio(f.ttft_p50_ms, base.ttft_p50_ms),
            f"{f.token_ms:.3g} ms",
            _ratio(f.token_ms, base.token_ms),
            f"{f.burst_tokens_per_s:,.0f}",
            _ratio(f.burst_tokens_per_s, base.burst_tokens_per_s),
        )
    return t


def verdict(r: EngineBenchResult) -> str:
    """The server's addition to the first token against its target, and Sluice's against the
    server reached directly."""
    margin = r.server_ttft_margin_ms
    met = f"met, {margin:.2f} ms under" if margin >= 0 else f"missed by {-margin:.2f} ms"
    at = "" if r.speed == 1 else f"; this run is at speed x{r.speed:g}"
    return (
        f"the sluice engine server adds {r.server_added_ttft_ms:+.2f} ms to the first token "
        f"(target < {SERVER_TTFT_TARGET_MS:g} ms at speed 1: {met}{at})\n"
        f"Sluice adds {r.added_ttft_ms:+.1f} ms over the direct client "
        f"({_ratio(r.sluice.ttft_p50_ms, r.direct.ttft_p50_ms)}); one agent forwards "
        f"{_ratio(r.sluice.burst_tokens_per_s, r.direct.burst_tokens_per_s)} of the direct "
        "burst rate"
    )

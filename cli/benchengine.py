"""``sluice bench-engine``: what the agent adds in front of an HTTP engine, against a client
talking to the same ``sluice engine`` process directly, in the same run.

Requests alternate between the two paths (direct, through Sluice, direct, ...), each with its
own prompt (so both see the same cache behaviour: none), so that the machine's noise falls on
both. Through Sluice, a request goes client → NATS → dispatcher → agent → engine and its tokens
come back engine → agent → NATS → client, the agent coalescing them (``token_flush_ms``): the
per-token figure is the mean gap between the first and the last token, not a chunk interval.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import httpx

from sluice.agent.runtime import Agent, AgentSettings
from sluice.client import Client
from sluice.dispatcher.stats import percentile
from sluice.testing.cluster import LocalCluster
from sluice.testing.engines import build_engine
from sluice.testing.engineserver import EngineProcess
from sluice.testing.natsserver import EmbeddedNats


@dataclass(frozen=True)
class EngineBenchResult:
    requests: int
    max_tokens: int
    direct_ttft_p50_ms: float
    sluice_ttft_p50_ms: float
    direct_token_ms: float
    sluice_token_ms: float
    burst_tokens_per_s: float
    """Output tokens per second one agent forwarded in a concurrent burst."""
    direct_burst_tokens_per_s: float

    @property
    def added_ttft_ms(self) -> float:
        return self.sluice_ttft_p50_ms - self.direct_ttft_p50_ms


def _prompt(i: int) -> list[int]:
    return list(range(10_000 + 600 * i, 10_000 + 600 * i + 512))


async def _direct(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[float, float]:
    body = {"prompt": _prompt(i), "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    first = last = 0.0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text":" ' in line.replace(": ", ":"):
                now = time.perf_counter()
                first = first or now
                last = now
    return first - t0, (last - first) / max(1, max_tokens - 1)


async def _sluice(c: Client, i: int, max_tokens: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = last = 0.0
    h = await c.submit("sim", _prompt(i), max_tokens=max_tokens)
    async for _ in h:
        now = time.perf_counter()
        first = first or now
        last = now
    await h.result(timeout_s=60)
    return first - t0, (last - first) / max(1, max_tokens - 1)


async def bench_engine(
    requests: int = 40, max_tokens: int = 32, speed: float = 1.0
) -> EngineBenchResult:
    """Run both paths against one engine process (see the module docstring); ``speed``: its
    clock's speed-up (a fast engine shows what the agent itself can forward)."""
    sockets = tempfile.mkdtemp(prefix="sluice-bench-")
    engine = EngineProcess(os.path.join(sockets, "e.sock"), model="sim", speed=speed).start()
    try:
        with EmbeddedNats() as nats:
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
                agent = Agent(settings, build_engine(settings))
                await agent.start()
                try:
                    return await _measure(http, c, requests, max_tokens)
                finally:
                    await agent.stop(drain=False)
    finally:
        engine.stop()
        shutil.rmtree(sockets, ignore_errors=True)


async def _measure(
    http: httpx.AsyncClient, c: Client, requests: int, max_tokens: int
) -> EngineBenchResult:
    import asyncio

    await _sluice(c, 10_000, 2)  # warm up: the agent has registered and connections exist
    await _direct(http, 10_001, 2)
    d_ttft, s_ttft, d_tok, s_tok = [], [], [], []
    for i in range(requests):
        if i % 2 == 0:
            a, b = await _direct(http, 2 * i, max_tokens), await _sluice(c, 2 * i + 1, max_tokens)
        else:
            b, a = await _sluice(c, 2 * i + 1, max_tokens), await _direct(http, 2 * i, max_tokens)
        d_ttft.append(a[0])
        d_tok.append(a[1])
        s_ttft.append(b[0])
        s_tok.append(b[1])
    n, burst_tokens = 32, 128
    t0 = time.perf_counter()
    await asyncio.gather(*(_direct(http, 5000 + i, burst_tokens) for i in range(n)))
    direct_rate = n * burst_tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    await asyncio.gather(*(_sluice(c, 6000 + i, burst_tokens) for i in range(n)))
    rate = n * burst_tokens / (time.perf_counter() - t0)
    return EngineBenchResult(
        requests=requests,
        max_tokens=max_tokens,
        direct_ttft_p50_ms=percentile(d_ttft, 50) * 1000,
        sluice_ttft_p50_ms=percentile(s_ttft, 50) * 1000,
        direct_token_ms=percentile(d_tok, 50) * 1000,
        sluice_token_ms=percentile(s_tok, 50) * 1000,
        burst_tokens_per_s=rate,
        direct_burst_tokens_per_s=direct_rate,
    )

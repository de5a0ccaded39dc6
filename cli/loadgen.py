"""``sluice loadgen``: replay a trace open loop against any OpenAI-compatible endpoint.

Each request is sent at its (scaled) trace arrival, whether or not the earlier ones have
answered (open loop), as a streaming ``POST /v1/completions`` (or ``/v1/chat/completions``)
whose prompt is the trace's blocks as fixed text (:mod:`sluice.sim.loadgen`). With several
``urls`` the requests go round-robin over them (round-robin straight to the engines). The time
to the first token is taken at the first streamed chunk that carries text, counted from the
request's due time. The prefix-cache hit rate is read from the engines' own Prometheus counters
(``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``, or SGLang's
``sglang:cached_tokens_total`` over ``sglang:prompt_tokens_total``), before and after the run,
never from the router in front of them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sluice.sim.loadgen import Outcome, PromptBook, summarize
from sluice.sim.traces import TraceRequest

SLO_TTFT_S = 2.0
"""The TTFT SLO of goodput (the replay's default)."""
TIMEOUT_S = 300.0
"""How long one request may take before it counts as failed."""
CLIENTS = 8
"""HTTP clients the requests are spread over: one pool scans all its connections for every
request, so one pool of hundreds of connections slows the load generator, not the target."""
KEEPALIVE_S = 1.0
"""Idle connections are closed after this, before the server's own keep-alive (uvicorn's 5 s)
closes them under a request just sent (a ReadError that is no fault of the target)."""
HITS = ("vllm:prefix_cache_hits_total", "sglang:cached_tokens_total")
QUERIES = ("vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total")


class LoadgenRunError(Exception):
    """The run could not be made (an engine's metrics unreadable, a bad URL)."""


@dataclass(frozen=True)
class LoadgenConfig:
    urls: tuple[str, ...]
    """Base URLs of the endpoints (``http://host:port``); several: round-robin over them."""
    model: str = "sim"
    api: str = "completions"
    """``completions`` (``/v1/completions``, prompt text) or ``chat`` (one user message)."""
    slo_ttft_s: float = SLO_TTFT_S
    engine_metrics: tuple[str, ...] = ()
    """The engines' ``/metrics`` URLs whose prefix-cache counters give the hit rate."""
    max_output_tokens: int | None = None
    """Cap each request's output tokens at this (None: the trace's own)."""
    timeout_s: float = TIMEOUT_S
    seed: int = 0
    progress: bool = True


def cache_counters(text: str) -> tuple[float, float] | None:
    """(hit tokens, queried tokens) summed over the samples of one engine's metrics text;
    vLLM's names first, SGLang's otherwise; None when it has neither."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in HITS or s.name in QUERIES:
                values[s.name] = values.get(s.name, 0.0) + float(s.value)
    for hits, queries in zip(HITS, QUERIES, strict=True):
        if hits in values and queries in values:
            return values[hits], values[queries]
    return None


async def read_counters(urls: Sequence[str]) -> tuple[float, float]:
    """The engines' counters, summed over ``urls``."""
    hits = queries = 0.0
    async with httpx.AsyncClient(timeout=10) as http:
        for url in urls:
            try:
                r = await http.get(url)
                r.raise_for_status()
            except httpx.HTTPError as exc:
                raise LoadgenRunError(f"cannot read engine metrics {url}: {exc}") from exc
            got = cache_counters(r.text)
            if got is None:
                raise LoadgenRunError(f"{url} has no prefix-cache counters ({HITS[0]} ...)")
            hits, queries = hits + got[0], queries + got[1]
    return hits, queries


def _body(cfg: LoadgenConfig, r: TraceRequest, prompt: str) -> dict[str, Any]:
    out = r.output_tokens if cfg.max_output_tokens is None else cfg.max_output_tokens
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max(1, min(r.output_tokens, out)),
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk(line: str) -> tuple[bool, int | None]:
    """(whether a streamed line carries text, its usage's completion tokens if it has one)."""
    if not line.startswith("data: {"):
        return False, None
    try:
        obj = json.loads(line[6:])
    except json.JSONDecodeError:
        return False, None
    usage = obj.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    text = False
    for c in obj.get("choices") or ():
        piece = c.get("text") or (c.get("delta") or {}).get("content")
        text = text or bool(piece)
    return text, tokens if isinstance(tokens, int) else None


async def _one(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], due_s: float, t0: float
) -> Outcome:
    sent = time.monotonic() - t0
    first: float | None = None
    chunks, usage_tokens, done = 0, None, False
    try:
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                end = time.monotonic() - t0
                return Outcome(due_s, sent, None, end, False, error=f"{resp.status_code} {text}")
            async for line in resp.aiter_lines():
                has_text, tokens = _chunk(line)
                if has_text:
                    chunks += 1
                    if first is None:
                        first = time.monotonic() - t0
                usage_tokens = tokens if tokens is not None else usage_tokens
                done = done or line == "data: [DONE]"
    except httpx.HTTPError as exc:
        return Outcome(due_s, sent, first, time.monotonic() - t0, False, error=repr(exc))
    end = time.monotonic() - t0
    if not done:
        return Outcome(due_s, sent, first, end, False, error="the stream ended before [DONE]")
    return Outcome(due_s, sent, first, end, first is not None, usage_tokens or chunks)


async def run_loadgen(
    trace: Sequence[TraceRequest], cfg: LoadgenConfig, console: Console | None = None
) -> dict[str, Any]:
    """Send ``trace`` (arrivals already scaled, from 0) open loop; the figures of
    :func:`sluice.sim.loadgen.summarize`, plus the errors seen (at most 5)."""
    if not cfg.urls:
        raise LoadgenRunError("no URL to send to")
    if cfg.api not in ("completions", "chat"):
        raise LoadgenRunError(f"api is completions or chat, not {cfg.api!r}")
    book = PromptBook(cfg.seed)
    bodies = [_body(cfg, r, book.prompt(r, i)) for i, r in enumerate(trace)]
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    before = await read_counters(cfg.engine_metrics) if cfg.engine_metrics else None
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S
    )
    per_url = max(1, CLIENTS // len(cfg.urls))
    pools = [
        [
            httpx.AsyncClient(base_url=url, timeout=cfg.timeout_s, limits=limits)
            for _ in range(per_url)
        ]
        for url in cfg.urls
    ]
    clients = [c for pool in pools for c in pool]
    spread = [itertools.cycle(pool) for pool in pools]
    progress = Progress(
        TextColumn("loadgen"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=not cfg.progress or console is None, transient=True,
    )  # fmt: skip
    try:
        with progress:
            bar = progress.add_task("requests", total=len(trace))
            tasks: list[asyncio.Task[Outcome]] = []
            t0 = time.monotonic()
            for i, r in enumerate(trace):
                delay = r.arrival_s - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                http = next(spread[i % len(cfg.urls)])
                task = asyncio.create_task(_one(http, path, bodies[i], r.arrival_s, t0))
                task.add_done_callback(lambda _: progress.advance(bar))
                tasks.append(task)
            outcomes = await asyncio.gather(*tasks)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    hits = queries = None
    if before is not None:
        after = await read_counters(cfg.engine_metrics)
        hits, queries = after[0] - before[0], after[1] - before[1]
    out = summarize(
        outcomes, slo_ttft_s=cfg.slo_ttft_s, cache_hits_tokens=hits, cache_queries_tokens=queries
    )
    out["errors"] = [o.error for o in outcomes if o.error][:5]
    return out


def trace_slice(
    trace: str | None,
    synthetic: str | None,
    *,
    start: int = 0,
    requests: int | None = None,
    seed: int = 0,
    synthetic_rate: float = 20.0,
) -> list[TraceRequest]:
    """Requests ``start`` … ``start + requests`` of a trace file (Mooncake JSONL, Azure CSV, our
    JSONL) or of a synthetic scenario (``requests`` of them, ``synthetic_rate`` a second)."""
    from sluice.sim.errors import LoadgenError
    from sluice.sim.synthetic import SCENARIOS, Shape
    from sluice.sim.traces import load_trace

    if (trace is None) == (synthetic is None):
        raise LoadgenError("give exactly one of a trace file and a synthetic scenario")
    if start < 0 or (requests is not None and requests < 1):
        raise LoadgenError("start must be >= 0 and requests >= 1")
    if synthetic is not None:
        make = SCENARIOS.get(synthetic)
        if make is None:
            raise LoadgenError(f"unknown scenario {synthetic!r}; known: {', '.join(SCENARIOS)}")
        shape = Shape(requests=start + (requests or 1000), rate=synthetic_rate, seed=seed)
        reqs = make(shape)
    else:
        assert trace is not None
        reqs = load_trace(trace)
    end = None if requests is None else start + requests
    out = reqs[start:end]
    if not out:
        raise LoadgenError(f"the slice from {start} has no requests (the trace has {len(reqs)})")
    return out

"""``sluice loadgen``: replay a trace open loop against any OpenAI-compatible endpoint.

Each request is sent at its (scaled) trace arrival, whether or not the earlier ones have
answered (open loop), as a streaming ``POST /v1/completions`` (or ``/v1/chat/completions``)
whose prompt is the trace's blocks as fixed text (:mod:`sluice.sim.loadgen`). With several
``urls`` the requests go round-robin over them (round-robin straight to the engines). The time
to the first token is taken at the first streamed chunk that carries text, counted from the
request's due time. The prefix-cache hit rate is read from the engines' own Prometheus counters
(``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``, or SGLang's
``sglang:cached_tokens_total`` over ``sglang:prompt_tokens_total``), before and after the run,
never from the router in front of them. So are the engines' own latencies, where they export
vLLM's histograms (``vllm:time_to_first_token_seconds``, ``vllm:request_queue_time_seconds``,
``vllm:request_prefill_time_seconds``, or the same under ``sglang:``): ``engine_ttft_p50_s``
and the like, the part of the time to the first token spent in the engines, whatever is in front.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
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


ENGINE_LATENCIES = {
    "ttft": "time_to_first_token_seconds",
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
}
"""The engines' latency histograms read around a run (vLLM's names, under ``vllm:`` or else
``sglang:``), by the short name of the figures they give (``engine_ttft_p50_s``, ...)."""


@dataclass
class Histogram:
    """One latency histogram summed over engines: cumulative counts by upper bound, and the
    sum and count of the observations."""

    buckets: dict[float, float]
    sum: float = 0.0
    count: float = 0.0

    def __sub__(self, other: Histogram) -> Histogram:
        got = {le: n - other.buckets.get(le, 0.0) for le, n in self.buckets.items()}
        return Histogram(got, self.sum - other.sum, self.count - other.count)

    def __add__(self, other: Histogram) -> Histogram:
        got = dict(self.buckets)
        for le, n in other.buckets.items():
            got[le] = got.get(le, 0.0) + n
        return Histogram(got, self.sum + other.sum, self.count + other.count)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def values(self) -> list[float]:
        """Every number it holds (its counts, its sum and its count)."""
        return [*self.buckets.values(), self.sum, self.count]

    def went_down(self) -> bool:
        """As a difference of two readings: whether a count fell between them (an engine
        restarted, its counters from zero)."""
        return self.count < 0 or any(n < 0 for n in self.buckets.values())

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0-1), interpolated linearly within its bucket as Prometheus's
        ``histogram_quantile`` does; None without observations."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lo, below = 0.0, 0.0
        for le in sorted(self.buckets):
            n = self.buckets[le]
            if n >= rank:
                if le == float("inf"):
                    return lo  # past the last finite bound: that bound is all that is known
                return lo + (le - lo) * ((rank - below) / (n - below) if n > below else 1.0)
            lo, below = le, n
        return lo


def engine_histograms(text: str) -> dict[str, Histogram]:
    """The :data:`ENGINE_LATENCIES` histograms of one engine's metrics text, by short name
    (``vllm:`` names first, ``sglang:`` otherwise; a histogram it lacks is left out)."""
    found: dict[str, dict[str, Histogram]] = {"vllm": {}, "sglang": {}}
    names = {
        f"{ns}:{name}": (ns, short) for short, name in ENGINE_LATENCIES.items() for ns in found
    }
    for family in text_string_to_metric_families(text):
        got = names.get(family.name)
        if got is None:
            continue
        h = found[got[0]].setdefault(got[1], Histogram({}))
        for smp in family.samples:
            if smp.name.endswith("_bucket"):
                le = float(smp.labels["le"])
                h.buckets[le] = h.buckets.get(le, 0.0) + smp.value
            elif smp.name.endswith("_sum"):
                h.sum += smp.value
            elif smp.name.endswith("_count"):
                h.count += smp.value
    return found["vllm"] or found["sglang"]


@dataclass
class EngineReading:
    """The engines' counters and latency histograms at one moment, summed over engines."""

    hits: float = 0.0
    queries: float = 0.0
    latencies: dict[str, Histogram] = field(default_factory=dict)

    def __sub__(self, other: EngineReading) -> EngineReading:
        lat = {
            k: h - other.latencies.get(k, Histogram({}))
            for k, h in self.latencies.items()
        }  # fmt: skip
        return EngineReading(self.hits - other.hits, self.queries - other.queries, lat)

    def __add__(self, other: EngineReading) -> EngineReading:
        lat = dict(self.latencies)
        for k, h in other.latencies.items():
            lat[k] = lat[k] + h if k in lat else h
        return EngineReading(self.hits + other.hits, self.queries + other.queries, lat)

    def went_down(self) -> bool:
        """As a difference of two readings: whether a counter fell between them."""
        fell = any(h.went_down() for h in self.latencies.values())
        return self.hits < 0 or self.queries < 0 or fell

    def figures(self) -> dict[str, float | None]:
        """``engine_<name>_{mean,p50,p99}_s`` of each histogram read (the engines' own side of
        the latency: what a router in front of them adds is the difference)."""
        out: dict[str, float | None] = {}
        for short, h in self.latencies.items():
            for label, v in (
                ("mean", h.mean()),
                ("p50", h.quantile(0.5)),
                ("p99", h.quantile(0.99)),
            ):
                out[f"engine_{short}_{label}_s"] = None if v is None else round(v, 6)
        return out


async def read_counters(urls: Sequence[str]) -> list[EngineReading]:
    """Each engine's counters and latency histograms, in the order of ``urls``."""
    out: list[EngineReading] = []
    async with httpx.AsyncClient(timeout=10) as http:
        for url in urls:
            try:
                r = await http.get(url)
            except httpx.HTTPError as exc:
                why = str(exc) or type(exc).__name__  # a timeout's message is empty
                raise LoadgenRunError(f"cannot read engine metrics {url}: {why}") from exc
            if r.status_code != 200:
                raise LoadgenRunError(
                    f"cannot read engine metrics {url}: HTTP {r.status_code} {r.reason_phrase}"
                )
            try:
                got = cache_counters(r.text)
                latencies = engine_histograms(r.text)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                raise LoadgenRunError(f"engine metrics {url} do not parse: {exc}") from exc
            if got is None:
                raise LoadgenRunError(f"{url} has no prefix-cache counters ({HITS[0]} ...)")
            values = [*got, *(v for h in latencies.values() for v in h.values())]
            if not all(math.isfinite(v) for v in values):
                raise LoadgenRunError(f"engine metrics {url} hold a counter that is not finite")
            out.append(EngineReading(got[0], got[1], latencies))
    return out


def run_delta(
    urls: Sequence[str], before: Sequence[EngineReading], after: Sequence[EngineReading]
) -> EngineReading:
    """What the engines counted over a run, summed: each engine's own difference first, so
    that one engine restarted (its counters fell) is not hidden by another's growth."""
    total = EngineReading()
    for url, b, a in zip(urls, before, after, strict=True):
        delta = a - b
        if delta.went_down():
            raise LoadgenRunError(
                f"the counters of {url} went down during the run (the engine restarted?)"
            )
        total = total + delta
    return total


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


class _BadChunk(Exception):
    """A streamed event no OpenAI server sends: its request fails (not the run)."""


class _ErrorEvent(Exception):
    """A streamed ``{"error": ...}`` event (vLLM's, Sluice's gateway's after the stream
    began): its request fails with the server's message."""


def _data(line: str) -> str | None:
    """The value of a server-sent ``data`` field (its one leading space dropped, as the SSE
    standard says: ``data:{...}`` is the same event as ``data: {...}``); None for any other
    line (a comment, another field)."""
    if not line.startswith("data:"):
        return None
    value = line[5:]
    return value[1:] if value.startswith(" ") else value


def _chunk(data: str) -> tuple[bool, int | None]:
    """(whether a streamed event carries text, its usage's completion tokens if it has one);
    raises ``_BadChunk`` for an event that is not a JSON object of the right shape."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        raise _BadChunk(f"an event that is not JSON: {data[:80]}") from None
    if not isinstance(obj, dict):
        raise _BadChunk(f"an event that is not an object: {data[:80]}")
    err = obj.get("error")
    if err is not None:
        message = err.get("message") if isinstance(err, dict) else err
        raise _ErrorEvent(str(message)[:300])
    usage = obj.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    choices = obj.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise _BadChunk(f"choices that are not a list of objects: {data[:80]}")
    text = False
    for c in choices:
        delta = c.get("delta") or {}
        piece = c.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
        text = text or (isinstance(piece, str) and bool(piece))
    good = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
    return text, tokens if good else None


AFTER_DONE_S = 1.0
"""How long the rest of a response may take once ``[DONE]`` came (the chunked body's end,
so that its connection is kept): a server that holds the connection open after it does not
hold the request."""


@dataclass
class _Read:
    """What a streamed answer carried so far (times from the run's start), read as
    server-sent events: an event's ``data:`` lines, joined, are dispatched at the blank line
    that ends it (an event without data is not)."""

    t0: float
    first: float | None = None
    """The first event with text."""
    done: float | None = None
    """``[DONE]``: the answer is whole, and nothing after it counts."""
    chunks: int = 0
    usage_tokens: int | None = None
    lines: list[str] = field(default_factory=list)
    """The data lines of the event being read."""

    def take(self, line: str) -> bool:
        """One line of the stream; True if it ended the ``[DONE]`` event."""
        if not line:
            return self.event()
        data = _data(line)
        if data is not None and self.done is None:
            self.lines.append(data)
        return False

    def event(self) -> bool:
        """Dispatch the event read so far (also at the stream's end: an event whose blank
        line never came still counts); True if it was ``[DONE]``."""
        data, self.lines = "\n".join(self.lines), []
        if not data or self.done is not None:
            return False
        if data == "[DONE]":
            self.done = time.monotonic() - self.t0
            return True
        has_text, tokens = _chunk(data)
        if has_text:
            self.chunks += 1
            if self.first is None:
                self.first = time.monotonic() - self.t0
        self.usage_tokens = tokens if tokens is not None else self.usage_tokens
        return False

    def failed(self, due_s: float, sent: float, error: str) -> Outcome:
        return Outcome(due_s, sent, self.first, time.monotonic() - self.t0, False, error=error)

    def outcome(self, due_s: float, sent: float) -> Outcome:
        if self.done is None:
            return self.failed(due_s, sent, "the stream ended before [DONE]")
        if self.first is None:
            return Outcome(due_s, sent, None, self.done, False, error="the stream carried no text")
        return Outcome(due_s, sent, self.first, self.done, True, self.usage_tokens or self.chunks)


async def _one(
    http: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    due_s: float,
    t0: float,
    timeout_s: float,
) -> Outcome:
    sent = time.monotonic() - t0
    got = _Read(t0)
    try:
        # The whole request within timeout_s (httpx's own timeout is per read: a server
        # trickling a byte at a time held a request for ever).
        async with asyncio.timeout(timeout_s) as budget:
            async with http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:200]
                    return got.failed(due_s, sent, f"{resp.status_code} {text}")
                async for line in resp.aiter_lines():
                    if got.take(line):
                        until = asyncio.get_running_loop().time() + AFTER_DONE_S
                        when = budget.when()
                        budget.reschedule(until if when is None else min(when, until))
                got.event()
    except TimeoutError:
        if got.done is None:
            return got.failed(due_s, sent, f"no whole answer within {timeout_s:g} s")
    except (httpx.HTTPError, _BadChunk) as exc:
        if got.done is None:  # (after [DONE], the answer was whole: its connection's end is not)
            return got.failed(due_s, sent, repr(exc))
    except _ErrorEvent as exc:
        return got.failed(due_s, sent, f"an error event in the stream: {exc}")
    return got.outcome(due_s, sent)


PREBUILT_PROMPT_BYTES = 256 * 2**20
"""Prompt text built before the run starts; the requests after it are built as they come
due. A body takes about a millisecond to build: built in the send loop, bursts of arrivals
went out tens of milliseconds late (the head to head's slice, in a reviewer's measurement:
send lag p99 35 ms against 2 ms); built all before, the whole conversation trace took
gigabytes."""


def _bodies_ahead(
    cfg: LoadgenConfig, trace: Sequence[TraceRequest], book: PromptBook
) -> list[dict[str, Any] | None]:
    """The bodies of the trace's first requests, up to :data:`PREBUILT_PROMPT_BYTES` of
    prompt text."""
    out: list[dict[str, Any] | None] = []
    size = 0
    for i, r in enumerate(trace):
        if size >= PREBUILT_PROMPT_BYTES:
            break
        prompt = book.prompt(r, i)
        size += len(prompt)
        out.append(_body(cfg, r, prompt))
    return out


def _check(cfg: LoadgenConfig) -> None:
    if not cfg.urls:
        raise LoadgenRunError("no URL to send to")
    if cfg.api not in ("completions", "chat"):
        raise LoadgenRunError(f"api is completions or chat, not {cfg.api!r}")
    for url in (*cfg.urls, *cfg.engine_metrics):
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise LoadgenRunError(f"not a URL: {url!r} ({exc})") from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise LoadgenRunError(f"not an http(s) URL: {url!r}")


async def run_loadgen(
    trace: Sequence[TraceRequest], cfg: LoadgenConfig, console: Console | None = None
) -> dict[str, Any]:
    """Send ``trace`` (arrivals already scaled, from 0) open loop; the figures of
    :func:`sluice.sim.loadgen.summarize`, plus the errors seen (at most 5)."""
    _check(cfg)
    book = PromptBook(cfg.seed)
    ready = _bodies_ahead(cfg, trace, book)
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
                if i < len(ready):
                    body, ready[i] = ready[i], None  # (let go once sent)
                else:
                    body = _body(cfg, r, book.prompt(r, i))
                assert body is not None
                delay = r.arrival_s - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                http = next(spread[i % len(cfg.urls)])
                one = _one(http, path, body, r.arrival_s, t0, cfg.timeout_s)
                task = asyncio.create_task(one)
                task.add_done_callback(lambda _: progress.advance(bar))
                tasks.append(task)
            outcomes = await asyncio.gather(*tasks)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    delta = None
    unread = None
    if before is not None:
        try:
            after = await read_counters(cfg.engine_metrics)
            delta = run_delta(cfg.engine_metrics, before, after)
        except LoadgenRunError as exc:  # the run's own figures stand; the hit rate is unknown
            unread = str(exc)
            if console is not None:
                console.print(f"[yellow]warning:[/yellow] {exc}: no hit rate", markup=True)
    out = summarize(
        outcomes,
        slo_ttft_s=cfg.slo_ttft_s,
        cache_hits_tokens=None if delta is None else delta.hits,
        cache_queries_tokens=None if delta is None else delta.queries,
    )
    if delta is not None:
        out.update(delta.figures())
    out["errors"] = [o.error for o in outcomes if o.error][:5]
    if unread is not None:
        out["engine_metrics_error"] = unread
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
    from sluice.sim.synthetic import MAX_REQUESTS, SCENARIOS, Shape
    from sluice.sim.traces import load_trace

    if (trace is None) == (synthetic is None):
        raise LoadgenError("give exactly one of a trace file and a synthetic scenario")
    if start < 0 or (requests is not None and requests < 1):
        raise LoadgenError("start must be >= 0 and requests >= 1")
    if synthetic is not None:
        make = SCENARIOS.get(synthetic)
        if make is None:
            raise LoadgenError(f"unknown scenario {synthetic!r}; known: {', '.join(SCENARIOS)}")
        total = start + (requests or SYNTHETIC_REQUESTS)
        if total > MAX_REQUESTS:  # (generated from its first request, before anything is sent)
            raise LoadgenError(
                f"a synthetic slice ends at request {MAX_REQUESTS:,} at most, not "
                f"{total:,} (start + requests)"
            )
        reqs = make(Shape(requests=total, rate=synthetic_rate, seed=seed))
    else:
        assert trace is not None
        reqs = load_trace(trace)
    end = None if requests is None else start + requests
    out = reqs[start:end]
    if not out:
        raise LoadgenError(f"the slice from {start} has no requests (the trace has {len(reqs)})")
    if requests is not None and len(out) < requests:
        raise LoadgenError(
            f"asked for {requests} requests from {start}, but the trace has {len(out)} there "
            f"({len(reqs)} in all)"
        )
    return out


SYNTHETIC_REQUESTS = 1000
"""Requests of a synthetic slice when ``requests`` is not given."""

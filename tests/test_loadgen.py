"""``sluice loadgen``: the trace's blocks as fixed text (properties of the pure part), the
figures under the replay's names, SGLang's ``/flush_cache`` on ``sluice engine``, and a real
run of the command against two ``sluice engine`` processes whose own counters give the hit
rate. Every process is stopped by its PID, also when an assertion fails."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.cli.loadgen import EngineReading, Histogram, cache_counters, engine_histograms
from sluice.schemas.hashing import TEXT_BYTES_PER_TOKEN, estimate_text_tokens, text_block_hashes
from sluice.sim.errors import LoadgenError
from sluice.sim.loadgen import Outcome, PromptBook, block_text, scale_arrivals, summarize
from sluice.sim.profiles import REFERENCE
from sluice.sim.replay import scale_to_load
from sluice.sim.traces import TraceRequest, earlier_turns, hit_ceiling, write_jsonl
from sluice.testing.fleet import HttpEngineFleet

from .conftest import serving

ENGINE_BLOCK_TOKENS = REFERENCE.block_tokens

chains = st.lists(st.integers(0, 50), min_size=1, max_size=6)


@given(key=st.text(max_size=8), tokens=st.integers(1, 600), seed=st.integers(0, 3))
@settings(max_examples=60, deadline=None)
def test_a_block_is_fixed_text_of_its_size(key: str, tokens: int, seed: int) -> None:
    text = block_text(key, tokens, seed)
    assert text == block_text(key, tokens, seed)
    assert text.isascii() and len(text.encode()) == tokens * TEXT_BYTES_PER_TOKEN


@given(shared=chains, a=chains, b=chains, tail=st.integers(1, 512))
@settings(max_examples=60, deadline=None)
def test_shared_blocks_are_shared_prompt_text_at_the_engine(
    shared: list[int], a: list[int], b: list[int], tail: int
) -> None:
    """Two requests with the same leading blocks have the same leading text, so the engine's
    block hashes of it are the same; its token count is the trace's."""
    a_ids = tuple(shared) + tuple(1000 + x for x in a)
    b_ids = tuple(shared) + tuple(2000 + x for x in b)
    ra = TraceRequest(0, (len(a_ids) - 1) * 512 + tail, 1, a_ids)
    rb = TraceRequest(0, (len(b_ids) - 1) * 512 + tail, 1, b_ids)
    book = PromptBook()
    pa, pb = book.prompt(ra, 0), book.prompt(rb, 1)
    assert estimate_text_tokens(pa) == ra.input_tokens
    assert estimate_text_tokens(pb) == rb.input_tokens
    n = len(shared) * 512 * TEXT_BYTES_PER_TOKEN
    assert pa[:n] == pb[:n]
    ha = text_block_hashes(pa, ENGINE_BLOCK_TOKENS)
    hb = text_block_hashes(pb, ENGINE_BLOCK_TOKENS)
    common = len(shared) * 512 // ENGINE_BLOCK_TOKENS
    assert ha[:common] == hb[:common]
    if len(ha) > common and len(hb) > common:
        assert ha[common] != hb[common]  # the first own block already differs


def test_a_request_without_blocks_gets_text_of_its_own() -> None:
    book = PromptBook()
    r = TraceRequest(0, 700, 1)
    assert book.prompt(r, 0) != book.prompt(r, 1)
    assert estimate_text_tokens(book.prompt(r, 0)) == 700


def test_arrivals_scale_by_rate_or_to_a_load() -> None:
    trace = [TraceRequest(10 + 2 * i, 2000, 50, (i,)) for i in range(5)]
    assert [r.arrival_s for r in scale_arrivals(trace, rate_scale=2)] == [0, 1, 2, 3, 4]
    loaded = scale_arrivals(trace, load=0.5, workers=4, profile=REFERENCE, speed=2)
    want = scale_to_load(trace, 0.5, 4, REFERENCE)
    assert [r.arrival_s for r in loaded] == pytest.approx([r.arrival_s / 2 for r in want])
    with pytest.raises(LoadgenError):
        scale_arrivals(trace, rate_scale=0)
    with pytest.raises(LoadgenError):
        scale_arrivals(trace, rate_scale=1, load=1)
    with pytest.raises(LoadgenError):
        scale_arrivals([], rate_scale=1)


def test_the_warm_up_is_the_latest_earlier_turn_each_request_continues() -> None:
    """bench-routers' warm-up (earlier_turns). Fails if the holder is taken at the first
    matching block instead of the last (6 for every request), if a later holder does not
    replace an earlier one (``latest.setdefault``: 4 instead of 5), or without the
    ``min_shared_blocks`` test (6, which shares only block 0 with request 8, is chosen)."""
    before = [
        TraceRequest(0, 1536, 9, (0, 1, 2)),
        TraceRequest(1, 1024, 9, (0, 1)),
        TraceRequest(2, 2048, 9, (0, 1, 2, 3)),  # the turn after 0: longer
        TraceRequest(3, 1024, 9, (0, 7)),
        TraceRequest(4, 1024, 9, (0, 8)),
        TraceRequest(5, 1024, 9, (0, 8)),  # the same prompt again, later
        TraceRequest(6, 1024, 9, (0, 13)),  # the latest holder of block 0
    ]
    window = [
        TraceRequest(7, 2560, 9, (0, 1, 2, 3, 4)),  # continues 2 (4 blocks; 0 and 1 share 3, 2)
        TraceRequest(8, 1536, 9, (0, 8, 9)),  # continues 5
        TraceRequest(9, 1536, 9, (0, 8, 10)),  # continues 5 as well: sent once
        TraceRequest(10, 1024, 9, (0, 11)),  # only block 0: no earlier turn
    ]
    assert earlier_turns(before, window) == [before[2], before[5]]
    assert earlier_turns(before, window, min_shared_blocks=1) == [before[2], *before[5:]]
    assert earlier_turns(before, window, min_shared_blocks=5) == []
    assert earlier_turns([], window) == []
    # The window's ceiling counts what the warm-up left: 4 + 2 + 2 + 1 blocks of 512 tokens
    # hit after it, 0 + 1 + 2 + 1 from empty caches (block 0 once 7 has run, 8 once 8 has).
    prompt = sum(r.input_tokens for r in window)
    assert hit_ceiling(window, earlier_turns(before, window)) == pytest.approx(9 * 512 / prompt)
    assert hit_ceiling(window) == pytest.approx(4 * 512 / prompt)


def test_goodput_counts_first_tokens_within_the_slo_over_the_span() -> None:
    outs = [
        Outcome(0.0, 0.0, 0.5, 2.0, True, 4),
        Outcome(1.0, 1.0, 1.4, 3.0, True, 4),
        Outcome(2.0, 2.0, 5.0, 6.0, True, 4),  # first token after 3 s: outside a 1 s SLO
        Outcome(3.0, 3.0, None, 4.0, False, error="500"),
    ]
    f = summarize(outs, slo_ttft_s=1.0, cache_hits_tokens=25, cache_queries_tokens=100)
    assert (f["requests"], f["completed"], f["failed"]) == (4, 3, 1)
    assert f["span_s"] == 6.0
    assert f["goodput_rps"] == pytest.approx(2 / 6)
    assert (f["slo_met"], f["slo_attainment"]) == (2, 0.5)  # of every request sent
    assert f["throughput_rps"] == pytest.approx(3 / 6)
    assert f["ttft_p50_s"] == pytest.approx(0.5)
    assert f["hit_rate"] == 0.25


def test_cache_counters_prefer_vllm_names_and_fall_back_to_sglang() -> None:
    vllm = "vllm:prefix_cache_hits_total 3.0\nvllm:prefix_cache_queries_total 10.0\n"
    sglang = "sglang:cached_tokens_total 2.0\nsglang:prompt_tokens_total 8.0\n"
    assert cache_counters(vllm + sglang) == (3.0, 10.0)
    assert cache_counters(sglang) == (2.0, 8.0)
    assert cache_counters("other_total 1.0\n") is None


def _page(ns: str, le_counts: dict[str, int], total: float) -> str:
    name = f"{ns}:time_to_first_token_seconds"
    rows = [f"# TYPE {name} histogram"]
    rows += [f'{name}_bucket{{le="{le}",model_name="m"}} {n}' for le, n in le_counts.items()]
    count = le_counts["+Inf"]
    rows += [f'{name}_sum{{model_name="m"}} {total}', f'{name}_count{{model_name="m"}} {count}']
    return "\n".join(rows) + "\n"


def test_engine_latency_histograms_sum_over_engines_and_give_quantiles() -> None:
    a = engine_histograms(_page("vllm", {"0.1": 2, "0.5": 6, "1.0": 8, "+Inf": 8}, 3.0))
    b = engine_histograms(_page("sglang", {"0.1": 0, "0.5": 2, "1.0": 2, "+Inf": 2}, 0.6))
    assert set(a) == {"ttft"} and set(b) == {"ttft"}  # SGLang's names when vLLM's are absent
    both = EngineReading(latencies={"ttft": a["ttft"] + b["ttft"]})
    h = both.latencies["ttft"]
    assert (h.count, h.sum) == (10, pytest.approx(3.6))
    assert h.mean() == pytest.approx(0.36)
    # 10 observations: 2 up to 0.1 s, 6 more up to 0.5 s, 2 more up to 1 s; the median's rank
    # 5 lies 3/6 of the way through the second bucket, interpolated as Prometheus does.
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * 3 / 6)
    assert h.quantile(0.99) == pytest.approx(0.5 + 0.5 * (9.9 - 8) / 2)
    # A run's figures are the difference of the readings around it.
    before = EngineReading(
        latencies={"ttft": Histogram({0.1: 2.0, 0.5: 2.0, 1.0: 2.0, float("inf"): 2.0}, 0.1, 2)}
    )
    f = (both - before).figures()
    assert f["engine_ttft_mean_s"] == pytest.approx(3.5 / 8)
    assert f["engine_ttft_p50_s"] == pytest.approx(0.1 + 0.4 * 4 / 6)
    assert EngineReading().figures() == {} and Histogram({}).quantile(0.5) is None


# ----------------------------------------------------------------------------- live


@pytest.fixture
def fleet() -> Iterator[HttpEngineFleet]:
    with HttpEngineFleet(2, model="sim", speed=20, tcp=True) as f:
        yield f


def _complete(url: str, prompt: str) -> int:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    r.raise_for_status()
    cached: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_flush_cache_drops_the_engines_prefix_cache(fleet: HttpEngineFleet) -> None:
    url = next(iter(fleet.engines.values())).url
    prompt = block_text("flush", 256)
    _complete(url, prompt)
    assert _complete(url, prompt) > 0
    r = httpx.post(f"{url}/flush_cache", timeout=10)
    assert r.status_code == 200, r.text
    assert _complete(url, prompt) == 0


def _shared_prefix_trace(path: Path, requests: int) -> None:
    """Every request: 2 blocks of one system prompt, then 1 block of its own."""
    write_jsonl(
        [TraceRequest(0.05 * i, 3 * 512, 4, (1, 2, 100 + i)) for i in range(requests)], path
    )


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.mark.e2e
def test_loadgen_replays_a_trace_and_reads_the_hit_rate_from_the_engines(
    fleet: HttpEngineFleet, tmp_path: Path
) -> None:
    trace, out = tmp_path / "t.jsonl", tmp_path / "out.json"
    _shared_prefix_trace(trace, 12)
    urls = [e.url for e in fleet.engines.values()]
    cmd = [
        sys.executable, "-m", "sluice.cli", "loadgen", "--trace", str(trace), "--json", str(out),
        "--no-progress", "--slo-ttft-s", "5",
        *(x for u in urls for x in ("--url", u, "--engine-metrics", f"{u}/metrics")),
    ]  # fmt: skip
    done = _run(cmd, 60)
    assert done.returncode == 0, done.stderr
    f = json.loads(out.read_text())
    for key in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_rps",
                "goodput_rps"):  # fmt: skip
        assert key in f
    assert (f["requests"], f["completed"], f["failed"]) == (12, 12, 0)
    assert f["output_tokens"] == 12 * 4
    # Round-robin over 2 engines: each sees the 2 shared blocks cold once, then hits them.
    assert f["cache_queries_tokens"] == 12 * 3 * 512
    assert f["cache_hits_tokens"] == (12 - 2) * 2 * 512
    assert f["hit_rate"] == pytest.approx(10 * 2 / (12 * 3), abs=1e-6)


def test_loadgen_rejects_bad_input_clearly(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "sluice.cli", "loadgen", "--url", "http://127.0.0.1:9"]
    done = _run([*base, "--trace", str(tmp_path / "missing.jsonl")], 30)
    assert done.returncode == 2 and "trace not found" in done.stderr
    done = _run([*base, "--synthetic", "nope"], 30)
    assert done.returncode == 2 and "unknown scenario" in done.stderr
    done = _run([*base, "--synthetic", "mixed", "--profile", "bogus"], 30)  # ignored, it was
    assert done.returncode == 2 and "give --load with them" in done.stderr
    # Nothing listens at port 9: every request fails, and that is no run to report with 0.
    trace = tmp_path / "t.jsonl"
    _shared_prefix_trace(trace, 3)
    done = _run([*base, "--trace", str(trace), "--no-progress"], 60)
    assert done.returncode == 2 and "every one of the 3 requests failed" in done.stderr


def test_a_cache_flush_evicts_every_idle_block_and_keeps_pinned_ones() -> None:
    from sluice.sim.kvcache import KVCache

    told: list[tuple[str, list[int]]] = []
    cache = KVCache(100, lambda kind, hashes: told.append((kind, hashes)))
    assert cache.admit([1, 2, 3], 0, report=[1, 2, 3])
    cache.release([1, 2, 3], 0)
    assert cache.admit([4], 0, report=[4])  # still running: pinned
    cache.drain_digest()
    assert cache.flush() == 3
    assert 4 in cache and cache.match([1, 2, 3]) == 0
    assert [h for kind, hs in told if kind == "removed" for h in hs] == [1, 2, 3]
    assert cache.drain_digest() == ([], [1, 2, 3])


_TEXT = b'data: {"choices": [{"text": "hi"}]}\n\n'
_DONE = b"data: [DONE]\n\n"
_STREAMS = {
    "good": [_TEXT, b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n', _DONE],
    "bad-chunk": [b'data: {"choices": "abc"}\n\n', _DONE],
    # vLLM's, the gateway's, after the first token:
    "error-event": [_TEXT, b'data: {"error": {"message": "3 attempts failed", "code": 503}}\n\n'],
    "trickle": [],  # then a byte now and then, never an answer
    # An event cut short: it was skipped, and the request counted whole.
    "bad-json": [_TEXT, b'data: {"choices": [{"text": "x"\n\n', _DONE],
    "array-event": [_TEXT, b"data: [1, 2]\n\n", _DONE],
    # Legal SSE: the space after the colon is optional.
    "no-space": [b'data:{"choices": [{"text": "hi"}]}\n\n', b"data:[DONE]\n\n"],
    "done-only": [_DONE],
    "held-open": [_TEXT, _DONE],  # then the connection kept open
    # One event's data over two lines (SSE joins them), and an event without data (not
    # dispatched): both were errors once every data line had to be JSON.
    "split-event": [b'data: {"choices":\ndata: [{"text": "hi"}]}\n\n', _DONE],
    "empty-data": [b"data:\n\n", _TEXT, b"data: \n\n", _DONE],
    "no-blank-end": [_TEXT, b"data: [DONE]"],  # the last event's blank line never comes
}
"""The completions stream of each mode of :class:`_Odd`."""


def _metrics_page(mode: str, reads: int) -> str:
    if mode == "garbage-metrics":
        return "vllm:prefix_cache_hits_total{ 1\n"
    if mode == "nan-metrics":
        return "vllm:prefix_cache_hits_total NaN\nvllm:prefix_cache_queries_total +Inf\n"
    hits, queries = (0, 10)
    if mode == "restarted":  # counters from zero again after the first reading
        hits, queries = (100, 200) if reads == 1 else (10, 20)
    if mode == "growing":
        hits, queries = (1000, 2000) if reads == 1 else (1500, 2500)
    return f"vllm:prefix_cache_hits_total {hits}\nvllm:prefix_cache_queries_total {queries}\n"


class _Odd:
    """A real HTTP server (loopback) that answers completions as ``mode`` says, and serves
    metrics that break once read ``metrics_good`` times."""

    def __init__(self, mode: str, metrics_good: int = 1_000) -> None:
        from starlette.applications import Starlette
        from starlette.responses import PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        self.metrics_reads = 0

        async def completions(_: object) -> StreamingResponse:
            async def body() -> AsyncIterator[bytes]:
                for part in _STREAMS.get(mode, _STREAMS["good"]):
                    yield part
                while mode == "trickle":
                    yield b": ping\n\n"
                    await asyncio.sleep(0.1)
                if mode == "held-open":
                    await asyncio.sleep(3600)

            return StreamingResponse(body(), media_type="text/event-stream")

        async def metrics(_: object) -> PlainTextResponse:
            self.metrics_reads += 1
            if self.metrics_reads > metrics_good:
                return PlainTextResponse("gone", status_code=500)
            return PlainTextResponse(_metrics_page(mode, self.metrics_reads))

        routes = [
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/metrics", metrics),
        ]
        self._serving = serving(Starlette(routes=routes))

    async def __aenter__(self) -> _Odd:
        self.url = await self._serving.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._serving.__aexit__(None, None, None)


def _reqs(n: int) -> list[TraceRequest]:
    return [TraceRequest(0.01 * i, 64, 2) for i in range(n)]


async def test_a_run_survives_odd_answers_and_metrics_gone_after_it() -> None:
    """Each was a traceback and no figures (seen, by a helper's probe): a chunk of the wrong
    shape failed the whole run; a server trickling bytes held a request past its timeout (per
    read in httpx) for ever; metrics unreadable after the run threw the run's figures away;
    a page that does not parse and a URL that is none were tracebacks."""
    from sluice.cli.loadgen import LoadgenConfig, LoadgenRunError, run_loadgen

    async with _Odd("bad-chunk") as odd:
        out = await run_loadgen(_reqs(2), LoadgenConfig(urls=(odd.url,), progress=False))
    assert out["failed"] == 2 and "choices that are not a list" in out["errors"][0]

    # The server's own message, not "the stream ended before [DONE]" (seen so).
    async with _Odd("error-event") as odd:
        out = await run_loadgen(_reqs(1), LoadgenConfig(urls=(odd.url,), progress=False))
    assert out["failed"] == 1 and "error event in the stream: 3 attempts failed" in out["errors"][0]

    async with _Odd("trickle") as odd:
        cfg = LoadgenConfig(urls=(odd.url,), progress=False, timeout_s=0.5)
        out = await run_loadgen(_reqs(1), cfg)
    assert out["failed"] == 1 and "no whole answer within 0.5 s" in out["errors"][0]

    async with _Odd("good", metrics_good=1) as odd:
        cfg = LoadgenConfig(urls=(odd.url,), engine_metrics=(f"{odd.url}/metrics",))
        out = await run_loadgen(_reqs(2), LoadgenConfig(**{**cfg.__dict__, "progress": False}))
    assert out["completed"] == 2 and out["hit_rate"] is None
    assert "cannot read engine metrics" in out["engine_metrics_error"]

    async with _Odd("garbage-metrics") as odd:
        cfg = LoadgenConfig(urls=(odd.url,), engine_metrics=(f"{odd.url}/metrics",))
        with pytest.raises(LoadgenRunError, match="do not parse"):
            await run_loadgen(_reqs(1), cfg)
    with pytest.raises(LoadgenRunError, match="not a URL"):
        await run_loadgen(_reqs(1), LoadgenConfig(urls=("http://[::1",)))


async def test_a_stream_counts_only_when_it_is_whole_and_legal_sse() -> None:
    """Each was wrong before (seen by a helper's probe): an event cut short was skipped and
    its request counted completed; an event that is a JSON array was ignored; ``data:``
    without its optional space failed every request; a stream of only ``[DONE]`` failed with
    no reason; an answer whose server kept the connection open after ``[DONE]`` failed at
    the timeout."""
    from sluice.cli.loadgen import AFTER_DONE_S, LoadgenConfig, run_loadgen

    async def one(mode: str, timeout_s: float = 30.0) -> dict[str, Any]:
        async with _Odd(mode) as odd:
            cfg = LoadgenConfig(urls=(odd.url,), progress=False, timeout_s=timeout_s)
            return await run_loadgen(_reqs(1), cfg)

    out = await one("bad-json")
    assert out["failed"] == 1 and "an event that is not JSON" in out["errors"][0]
    out = await one("array-event")
    assert out["failed"] == 1 and "an event that is not an object" in out["errors"][0]
    out = await one("no-space")
    assert (out["completed"], out["errors"]) == (1, [])
    for mode in ("split-event", "empty-data", "no-blank-end"):
        out = await one(mode)
        assert (out["completed"], out["errors"]) == (1, []), mode
    out = await one("done-only")
    assert out["failed"] == 1 and out["errors"] == ["the stream carried no text"]
    # Its connection is let go soon after [DONE], not held to the request's timeout (an hour).
    out = await asyncio.wait_for(one("held-open", timeout_s=3600), AFTER_DONE_S + 30)
    assert (out["completed"], out["errors"]) == (1, [])
    assert out["e2e_p50_s"] < AFTER_DONE_S  # the answer ended at [DONE], not at the close


async def test_engine_counters_that_are_not_finite_or_went_down_give_no_hit_rate() -> None:
    """A NaN counter made a NaN hit rate (not JSON); an engine restarted during the run made
    its counters fall, and the deltas gave a hit rate of 1.0 from negative tokens."""
    from sluice.cli.loadgen import LoadgenConfig, LoadgenRunError, run_loadgen

    async with _Odd("nan-metrics") as odd:
        cfg = LoadgenConfig(urls=(odd.url,), engine_metrics=(f"{odd.url}/metrics",))
        with pytest.raises(LoadgenRunError, match="not finite"):
            await run_loadgen(_reqs(1), LoadgenConfig(**{**cfg.__dict__, "progress": False}))
    # One engine restarted, another grew more than it fell: the sum of the two hid the fall
    # (a hit rate of 1.28). Each engine's own difference is looked at first.
    async with _Odd("restarted") as odd, _Odd("growing") as other:
        metrics = (f"{odd.url}/metrics", f"{other.url}/metrics")
        cfg = LoadgenConfig(urls=(odd.url,), engine_metrics=metrics, progress=False)
        out = await run_loadgen(_reqs(1), cfg)
    assert out["completed"] == 1 and out["hit_rate"] is None
    assert f"the counters of {odd.url}/metrics went down" in out["engine_metrics_error"]
    json.dumps(out, allow_nan=False)


def test_bodies_are_built_before_the_run_up_to_a_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built in the send loop, a millisecond each, they made bursts of arrivals late; all
    built before the run, the whole trace took gigabytes."""
    from sluice.cli import loadgen

    trace = [TraceRequest(0.0, 512, 2, (i,)) for i in range(10)]
    cfg = loadgen.LoadgenConfig(urls=("http://127.0.0.1:9",))
    assert len(loadgen._bodies_ahead(cfg, trace, PromptBook(0))) == 10
    monkeypatch.setattr(loadgen, "PREBUILT_PROMPT_BYTES", 3 * 512 * TEXT_BYTES_PER_TOKEN)
    assert len(loadgen._bodies_ahead(cfg, trace, PromptBook(0))) == 3


def test_a_slice_that_cannot_be_sent_as_asked_is_refused(tmp_path: Path) -> None:
    """More requests than the trace has there were cut silently; a synthetic slice far out
    generated every request before it (a hang); arrivals stretched past a year slept so."""
    from sluice.cli.loadgen import trace_slice
    from sluice.sim.synthetic import MAX_REQUESTS

    trace = tmp_path / "t.jsonl"
    write_jsonl(_reqs(25), trace)
    assert len(trace_slice(str(trace), None, start=5, requests=20)) == 20
    with pytest.raises(LoadgenError, match="asked for 21 requests from 5, but the trace has 20"):
        trace_slice(str(trace), None, start=5, requests=21)
    with pytest.raises(LoadgenError, match="at most"):
        trace_slice(None, "mixed", start=10**8, requests=1)
    with pytest.raises(LoadgenError, match="at most"):
        trace_slice(None, "mixed", start=MAX_REQUESTS, requests=1)
    for scale in (1e-300, 1e-10):
        with pytest.raises(LoadgenError, match="more than a year"):
            scale_arrivals(_reqs(3), rate_scale=scale)
    with pytest.raises(LoadgenError, match="more than a year"):
        scale_arrivals(_reqs(3), load=1e-300, workers=1, profile=REFERENCE)


async def test_a_run_past_the_prebuilt_bodies_builds_the_rest_as_they_come_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sluice.cli import loadgen

    monkeypatch.setattr(loadgen, "PREBUILT_PROMPT_BYTES", 1)  # one body ahead, the rest later
    async with _Odd("good") as odd:
        cfg = loadgen.LoadgenConfig(urls=(odd.url,), progress=False)
        out = await loadgen.run_loadgen(_reqs(4), cfg)
    assert (out["completed"], out["errors"]) == (4, [])

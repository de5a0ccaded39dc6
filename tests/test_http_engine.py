"""Agents in front of real engine processes: ``sluice engine`` servers reached with the
``openai-http`` backend over TCP and over a Unix socket, a real nats-server and dispatcher.
Tokens stream, results carry the engine's cached tokens, and an engine killed mid-generation
costs its request one attempt, not the request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.agent.engine import Failed, Finished, TokensOut
from sluice.agent.runtime import Agent, AgentSettings
from sluice.agent.runtime.httpengine import HttpEngine, HttpEngineConfig
from sluice.client import Batches, Client
from sluice.testing.cluster import LocalCluster
from sluice.testing.engines import build_engine

from .conftest import FAST_AGENT, cluster_kwargs, eventually, live_scheduler, serving
from .test_engine_server import _free_port, _free_port_pair, _start, _stop, _wait_healthy

pytestmark = pytest.mark.e2e

PROMPT = list(range(5000, 5000 + 512))


def _agent(nats_url: str, worker_id: str, url: str) -> Agent:
    fast = {k: v for k, v in FAST_AGENT.items() if k != "speed"}  # the engine has the clock
    settings = AgentSettings(
        nats_url=nats_url,
        worker_id=worker_id,
        models=["sim"],
        engine="openai-http",
        engine_url=url,
        engine_health_every_s=0.2,
        **fast,
    )
    return Agent(settings, build_engine(settings))


@pytest.fixture
async def fleet(nats_url: str, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """Two engine processes (TCP and a Unix socket) with an agent each, and a dispatcher."""
    port, sock = _free_port(), str(tmp_path / "e.sock")
    # Real time (speed 1): a long generation takes seconds, time enough to kill its engine.
    procs = {
        "tcp": _start(["--port", str(port), "--speed", "1"]),
        "uds": _start(["--uds", sock, "--speed", "1"]),
    }
    urls = {"tcp": f"http://127.0.0.1:{port}", "uds": f"unix://{sock}"}
    agents: list[Agent] = []
    try:
        with httpx.Client(base_url=urls["tcp"], timeout=30) as c:
            _wait_healthy(c, procs["tcp"])
        with httpx.Client(
            transport=httpx.HTTPTransport(uds=sock), base_url="http://e", timeout=30
        ) as c:
            _wait_healthy(c, procs["uds"])
        # No cold-start exploration: a repeated prompt must go where its prefix is cached.
        # (A lease long enough for a test process that shares two cores with CI.)
        kw = cluster_kwargs(
            workers=0, dispatcher={"routing_explore_share": 0.0, "leader_lease_s": 3.0}
        )
        async with LocalCluster(nats_url, **kw) as cluster:
            for name in ("tcp", "uds"):
                agents.append(_agent(nats_url, f"http-{name}", urls[name]))
                await agents[-1].start()
            yield {"cluster": cluster, "procs": procs, "agents": agents, "urls": urls}
            for a in agents:
                await a.stop(drain=False)
    finally:
        for p in procs.values():
            _stop(p)


async def test_tokens_stream_through_http_engines_and_a_repeated_prefix_hits(
    fleet: dict[str, Any], nats_url: str
) -> None:
    async with Client(nats_url) as c:
        h = await c.submit("sim", PROMPT, max_tokens=12)
        chunks = [chunk async for chunk in h]
        first = await h.result(timeout_s=30)
        assert first.ok and len(first.output_tokens) == 12 and first.cached_tokens == 0
        assert "".join(ch.text for ch in chunks) == first.text and first.text.strip()
        sched = live_scheduler(fleet["cluster"])

        async def released() -> bool:  # else its worker is busy, and the prefix may spread
            return sched().running == 0

        await eventually(released)
        again = await (await c.submit("sim", PROMPT, max_tokens=4)).result(timeout_s=30)
    assert again.ok and again.worker_id == first.worker_id  # its prefix is cached there
    assert again.cached_tokens == len(PROMPT) - 1  # as the engine reported it
    assert sum(a.completed for a in fleet["agents"]) == 2


async def test_sampling_fields_reach_the_engine_through_the_gateway(
    fleet: dict[str, Any], nats_url: str
) -> None:
    """The openai package, the gateway, the wire, the dispatcher, the agent, then the engine
    process: a greedy request repeats its output, a sampled one does not, and a stop string
    ends the output before it, in a whole answer and in a stream (``sluice engine`` honours
    them as vLLM does: ``test_engine_server.py``)."""
    from openai import AsyncOpenAI

    from sluice.gateway import GatewayServer, GatewaySettings

    gs = GatewaySettings(nats_url=nats_url, host="127.0.0.1", port=0)
    async with GatewayServer(gs) as gw:
        oa = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0, timeout=30)
        try:

            async def text(**fields: Any) -> tuple[str, str | None]:
                r = await oa.completions.create(
                    model="sim", prompt="once upon a time", max_tokens=16, **fields
                )
                return r.choices[0].text, r.choices[0].finish_reason

            greedy, reason = await text(temperature=0)
            assert reason == "length" and (await text(temperature=0))[0] == greedy
            assert (await text(seed=3)) == (await text(seed=3)) != (await text(seed=4))
            assert (await text())[0] != (await text())[0]  # the engine's default: sampled

            # n choices: a seeded answer's differ (the seed advanced for each) and repeat
            # with it; greedy ones are all the same.
            async def choices(**fields: Any) -> list[str]:
                r = await oa.completions.create(
                    model="sim", prompt="once upon a time", max_tokens=8, n=3, **fields
                )
                return [c.text for c in r.choices]

            seeded = await choices(seed=11)
            assert len(set(seeded)) == 3 and await choices(seed=11) == seeded
            assert (await choices(seed=12))[:2] == seeded[1:]  # choice i is seed + i
            assert len(set(await choices(temperature=0))) == 1
            stop_whole = " " + greedy.split(" ")[4]
            want_whole = greedy[: greedy.find(stop_whole)]
            assert await text(temperature=0, stop=stop_whole) == (want_whole, "stop")
            # The engine's count and finish, though the text held back for a stop string came
            # in no piece of its own: a stop that never matched ends by the length, 16 tokens;
            # one that matched counts the tokens to it, the one that carried it included.
            for stop, count, reason in ((" no-such-word", 16, "length"), (stop_whole, 4, "stop")):
                r = await oa.completions.create(
                    model="sim", prompt="once upon a time", max_tokens=16, temperature=0,
                    stop=stop,
                )  # fmt: skip
                assert r.usage is not None and r.usage.completion_tokens == count, stop
                assert r.choices[0].finish_reason == reason, stop
            stream = await oa.chat.completions.create(
                model="sim",
                messages=[{"role": "user", "content": "once upon a time"}],
                max_tokens=16,
                temperature=0,
                stream=True,
            )
            chat = "".join([c.choices[0].delta.content or "" async for c in stream])
            stop = " " + chat.split(" ")[3]
            stream = await oa.chat.completions.create(
                model="sim",
                messages=[{"role": "user", "content": "once upon a time"}],
                max_tokens=16,
                temperature=0,
                stop=[stop],
                stream=True,
            )
            chunks = [c async for c in stream]
            assert (
                "".join(c.choices[0].delta.content or "" for c in chunks) == chat[: chat.find(stop)]
            )
            assert chunks[-1].choices[0].finish_reason == "stop"
        finally:
            await oa.close()
    # A batch's lines carry theirs too.
    line = {
        "custom_id": "a",
        "url": "/v1/completions",
        "body": {"model": "sim", "prompt": "once upon a time", "max_tokens": 16,
                 "temperature": 0, "stop": stop_whole},
    }  # fmt: skip
    scored = {"custom_id": "b", "url": "/v1/completions",
              "body": {"model": "sim", "prompt": "once upon a time", "max_tokens": 4,
                       "logprobs": 1}}  # fmt: skip
    data = b"\n".join(json.dumps(x).encode() for x in (line, scored))
    async with Client(nats_url) as c:
        b = Batches(c)
        record = await b.create((await b.upload(data, "in.jsonl")).id)
        await b.submit(record.id)
        record = await b.wait(record.id, every_s=0.2, timeout_s=60)
        assert record.status == "completed" and record.output_file_id, record
        outs = [json.loads(x) for x in (await b.content(record.output_file_id)).splitlines()]
    out = {o["custom_id"]: o["response"]["body"]["choices"][0] for o in outs}
    assert (out["a"]["text"], out["a"]["finish_reason"]) == (want_whole, "stop")
    assert out["a"]["logprobs"] is None
    lp = out["b"]["logprobs"]  # (a line's logprobs, in OpenAI's completions shape)
    assert len(lp["tokens"]) == 4 and "".join(lp["tokens"]) == out["b"]["text"]


async def test_logprobs_come_from_the_engine_through_the_gateway(
    fleet: dict[str, Any], nats_url: str
) -> None:
    """The openai package asks the gateway for logprobs, a completion's and a chat's, whole
    and streamed, with ``n`` choices: each answer has one entry per output token (their texts
    make its text) with the alternatives asked for, the very values the engine process gives
    the same greedy request directly."""
    from openai import AsyncOpenAI

    from sluice.gateway import GatewayServer, GatewaySettings

    body = {"model": "sim", "prompt": "once upon a time", "max_tokens": 12, "temperature": 0}
    async with httpx.AsyncClient(base_url=fleet["urls"]["tcp"], timeout=30) as direct:
        want = (await direct.post("/v1/completions", json={**body, "logprobs": 3})).json()
    want_lp = want["choices"][0]["logprobs"]
    gs = GatewaySettings(nats_url=nats_url, host="127.0.0.1", port=0)
    async with GatewayServer(gs) as gw:
        oa = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0, timeout=30)
        try:
            whole = await oa.completions.create(**body, logprobs=3)
            lp = whole.choices[0].logprobs
            assert lp is not None and whole.choices[0].text == want["choices"][0]["text"]
            assert lp.model_dump() == want_lp
            assert "".join(lp.tokens or []) == whole.choices[0].text
            assert whole.usage is not None and len(lp.tokens or []) == 12
            assert all(len(t) in (3, 4) for t in lp.top_logprobs or [])  # (the token too)
            tokens: list[str] = []
            offsets: list[int] = []
            async for c in await oa.completions.create(**body, logprobs=3, stream=True):
                if c.choices and c.choices[0].logprobs is not None:
                    tokens += c.choices[0].logprobs.tokens or []
                    offsets += c.choices[0].logprobs.text_offset or []
            assert tokens == want_lp["tokens"] and offsets == want_lp["text_offset"]

            messages = [{"role": "user", "content": "once upon a time"}]
            chat = {"model": "sim", "messages": messages, "max_tokens": 12, "temperature": 0}
            answer = await oa.chat.completions.create(
                **chat,
                logprobs=True,
                top_logprobs=2,
                n=2,  # type: ignore[arg-type]
            )
            for choice in answer.choices:
                content = choice.logprobs.content if choice.logprobs else None
                assert content is not None and len(content) == 12
                assert "".join(t.token for t in content) == choice.message.content
                assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
                assert bytes(content[0].bytes or []).decode() == content[0].token
            streamed = []
            async for c in await oa.chat.completions.create(
                **chat,
                logprobs=True,
                stream=True,  # type: ignore[arg-type]
            ):
                if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
                    streamed += c.choices[0].logprobs.content
            got = answer.choices[0].logprobs
            assert got is not None and got.content is not None
            assert [(t.token, t.logprob) for t in streamed] == [
                (t.token, t.logprob) for t in got.content
            ]
            assert all(t.top_logprobs == [] for t in streamed)  # top_logprobs unset: none
            plain = await oa.completions.create(**body)
            assert plain.choices[0].logprobs is None
        finally:
            await oa.close()


async def test_structured_output_comes_from_the_engine_through_the_gateway(
    fleet: dict[str, Any], nats_url: str
) -> None:
    """The openai package asks the gateway for a ``json_schema`` and a ``json_object``
    response format: the engine process makes the JSON (it got the format through the wire
    and the agent), whole and streamed, and a batch line's comes back the same."""
    import jsonschema
    from openai import AsyncOpenAI

    from sluice.gateway import GatewayServer, GatewaySettings

    from .test_engine_server import _PERSON

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": _PERSON}}
    messages = [{"role": "user", "content": "who are you?"}]
    gs = GatewaySettings(nats_url=nats_url, host="127.0.0.1", port=0)
    async with GatewayServer(gs) as gw:
        oa = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0, timeout=30)
        try:
            answer = await oa.chat.completions.create(
                model="sim", messages=messages, max_tokens=200, temperature=0,  # type: ignore[arg-type]
                response_format=fmt,  # type: ignore[arg-type]
            )  # fmt: skip
            content = answer.choices[0].message.content or ""
            jsonschema.validate(json.loads(content), _PERSON)
            assert answer.choices[0].finish_reason == "stop"
            parts = []
            async for c in await oa.chat.completions.create(
                model="sim", messages=messages, max_tokens=200, temperature=0,  # type: ignore[arg-type]
                response_format=fmt, stream=True,  # type: ignore[arg-type]
            ):  # fmt: skip
                if c.choices and c.choices[0].delta.content:
                    parts.append(c.choices[0].delta.content)
            assert "".join(parts) == content
            plain = await oa.completions.create(
                model="sim", prompt="x", max_tokens=64,
                extra_body={"response_format": {"type": "json_object"}},  # (vLLM's extension)
            )  # fmt: skip
            assert isinstance(json.loads(plain.choices[0].text), dict)
        finally:
            await oa.close()
    line = {"custom_id": "j", "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": messages, "max_tokens": 200, "temperature": 0,
                     "response_format": fmt}}  # fmt: skip
    async with Client(nats_url) as c:
        b = Batches(c)
        record = await b.create((await b.upload(json.dumps(line).encode(), "in.jsonl")).id)
        await b.submit(record.id)
        record = await b.wait(record.id, every_s=0.2, timeout_s=60)
        assert record.status == "completed" and record.output_file_id, record
        out = json.loads(await b.content(record.output_file_id))
    assert out["response"]["body"]["choices"][0]["message"]["content"] == content


async def test_an_engine_killed_mid_generation_costs_an_attempt_not_the_request(
    fleet: dict[str, Any], nats_url: str
) -> None:
    sched = live_scheduler(fleet["cluster"])
    async with Client(nats_url) as c:
        h = await c.submit("sim", PROMPT, max_tokens=600)  # about 4 s at speed 1

        async def running() -> bool:
            return sched().booking(h.request_id) is not None

        await eventually(running)
        worker = sched().booking(h.request_id).worker_id
        proc = fleet["procs"]["tcp" if worker == "http-tcp" else "uds"]
        await asyncio.sleep(0.3)  # mid-generation
        os.kill(proc.pid, signal.SIGKILL)
        result = await h.result(timeout_s=60)
    assert result.ok and result.attempt == 2 and result.worker_id != worker
    assert len(result.output_tokens) == 600

    async def released() -> bool:
        return sched().running == 0

    await eventually(released)  # the quota is back


async def test_an_unreachable_engine_fails_its_requests_and_is_unavailable() -> None:
    engine = HttpEngine(
        HttpEngineConfig(url=f"http://127.0.0.1:{_free_port()}", model="sim", health_every_s=0.05)
    )
    await engine.open()
    try:
        assert not engine.available  # its agent heartbeats no free capacity
        engine.add("r1", 3, 2, [], 0.0, "hi")
        events: list[Any] = []
        for _ in range(200):
            events += engine.step().events
            if events:
                break
            await asyncio.sleep(0.01)
        assert len(events) == 1 and isinstance(events[0], Failed)
        assert events[0].request_id == "r1" and "engine" in events[0].error
    finally:
        await engine.close()


def test_the_load_parses_from_vllm_and_sglang_pages() -> None:
    from sluice.agent.runtime.scrape import EngineMetricsError, ScrapedLoad, parse_load

    vllm = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="a"} 3\n'
        'vllm:num_requests_running{model_name="b"} 2\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        "vllm:num_requests_waiting 4\n"
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        "vllm:gpu_cache_usage_perc 0.25\n"
    )
    assert parse_load(vllm) == ScrapedLoad(5, 4, 0.25)  # labels summed; the older KV name
    sglang = "sglang:num_running_reqs 7\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n"
    assert parse_load(sglang) == ScrapedLoad(7, 1, 0.5)
    bad_pages = [
        "no_such_metric 1\n",
        "vllm:num_requests_running{ 3\n",
        "",
        # Values that are no load: NaN and infinities failed the rounding with an exception
        # that ended the scraping for good (the engine then counted as saturated until the
        # agent restarted); 1e300 running requests failed every heartbeat's encoding.
        "vllm:num_requests_running NaN\n",
        "vllm:num_requests_waiting +Inf\n",
        "vllm:num_requests_running 1e300\n",
        "vllm:kv_cache_usage_perc NaN\n",
    ]
    for bad in bad_pages:
        with pytest.raises(EngineMetricsError):
            parse_load(bad)


async def test_the_engine_reports_its_scraped_load_and_stale_metrics_saturate_it() -> None:
    port = _free_port()
    proc = _start(["--port", str(port), "--speed", "1"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
        url = f"http://127.0.0.1:{port}"
        engine = HttpEngine(HttpEngineConfig(url=url, model="sim", metrics_every_s=0.05))
        await engine.open()
        try:
            assert engine.available and engine.scraped is not None
            engine.add("r1", 512, 400, [], 0.0, PROMPT)

            async def seen_running() -> bool:
                engine.step()
                return engine.scraped is not None and engine.scraped.running == 1

            await eventually(seen_running)
            assert engine.load().running == 1 and engine.load().kv_blocks_used > 0
            engine.cancel("r1")
        finally:
            await engine.close()
        blind = HttpEngine(
            HttpEngineConfig(url=url, model="sim", metrics_path="/nope", metrics_stale_s=0.2)
        )
        await blind.open()
        try:
            assert blind.scrape_errors >= 1 and blind.metrics_stale and not blind.available
            assert blind.load().kv_blocks_used == blind.load().kv_blocks_total  # saturated
        finally:
            await blind.close()
    finally:
        _stop(proc)


@pytest.mark.parametrize("pages", [[], ["--kv-page-tokens", "1"]], ids=["vllm", "sglang-page-1"])
async def test_kv_events_feed_the_digest_and_a_gap_is_replayed(pages: list[str]) -> None:
    """Of vLLM's blocks, or of SGLang's pages of 1 token (its default ``--page-size``)."""
    from sluice.schemas.hashing import block_hashes

    port, kv = _free_port(), _free_port_pair()
    proc = _start(["--port", str(port), "--kv-events-port", str(kv), *pages])
    other = list(range(9000, 9000 + 256))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as ac:
            # Published before the agent follows the events: batch 0, missed.
            await ac.post("/v1/completions", json={"prompt": other, "max_tokens": 1})
        # The live batch that reveals the gap continues batch 0's chain: its stored blocks'
        # parent is in the missed batch, so it is applied after the replay (applied first,
        # they were orphans, dropped for good: seen failing so).
        longer = other + list(range(20_000, 20_000 + 128))
        engine = HttpEngine(
            HttpEngineConfig(
                url=f"http://127.0.0.1:{port}",
                model="sim",
                kv_events=f"tcp://127.0.0.1:{kv}",
                digest_min_tokens=None,
            )
        )
        await engine.open()
        try:
            tracker = engine.kv_tracker
            assert tracker is not None
            tracker.expected_seq = 0  # as if it had followed from the start: batch 0 is a gap
            await asyncio.sleep(0.3)  # a SUB socket misses what is published before it joined

            async def applied() -> bool:
                engine.step()
                return tracker.stats.batches >= 2

            # The agent hashes no prompt for an engine whose KV events say what it holds.
            assert not engine.uses_prompt_hashes
            engine.add("r1", len(longer), 1, [], 0.0, longer)
            await eventually(applied)
            assert tracker.stats.gaps == 1  # batch 0 came back through the replay socket
            assert tracker.stats.orphans == 0
            held = set(engine.cached_blocks())
            assert set(block_hashes(longer)) <= held
            stored, _ = engine.cache_changes()
            assert set(stored) == held and engine.kv_dropped == 0
        finally:
            await engine.close()
    finally:
        _stop(proc)


async def test_an_engine_that_stops_empties_the_mirror_and_its_successor_is_followed() -> None:
    """The engine dies (its KV event link closes): the mirror empties, since its cache is
    gone; a restarted engine is followed from its first batch. Before, the mirror kept the
    dead engine's blocks until the new engine's sequence went back below the old one's, and
    one heard first at or past it (a crash within its first batches) was never seen
    restarting (seen failing so)."""
    from sluice.schemas.hashing import block_hashes

    port, kv = _free_port(), _free_port_pair()
    args = ["--port", str(port), "--kv-events-port", str(kv)]
    proc = _start(args)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
        engine = HttpEngine(
            HttpEngineConfig(
                url=f"http://127.0.0.1:{port}", model="sim", kv_events=f"tcp://127.0.0.1:{kv}",
                digest_min_tokens=None, health_every_s=0.2,
            )
        )  # fmt: skip
        await engine.open()
        try:
            tracker = engine.kv_tracker
            assert tracker is not None
            await asyncio.sleep(0.3)  # a SUB socket misses what is published before it joined
            engine.add("r1", len(PROMPT), 1, [], 0.0, PROMPT)

            async def held() -> bool:
                engine.step()
                return set(block_hashes(PROMPT)) <= set(engine.cached_blocks())

            await eventually(held)
            proc.kill()
            proc.wait()

            async def emptied() -> bool:
                return tracker.stats.publishers_lost >= 1 and engine.cached_blocks() == []

            await eventually(emptied)
            proc = _start(args)  # the same engine again, its sequence from 0
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                _wait_healthy(c, proc)

            async def available() -> bool:
                return engine.available

            await eventually(available, timeout_s=10.0)
            await asyncio.sleep(0.3)  # the SUB socket reconnects
            other = list(range(30_000, 30_000 + 256))
            engine.add("r2", len(other), 1, [], 0.0, other)

            async def followed() -> bool:
                engine.step()
                return set(block_hashes(other)) <= set(engine.cached_blocks())

            await eventually(followed)
            assert not set(block_hashes(PROMPT)) & set(engine.cached_blocks())
        finally:
            await engine.close()
    finally:
        _stop(proc)


@pytest.mark.parametrize("case", ["connect-to-a-proxy", "bind-and-a-probe"])
async def test_a_link_whose_handshake_failed_is_no_publisher_lost(case: str) -> None:
    """libzmq reports a link closed after a handshake that failed too: a proxy that accepts
    and closes while the engine loads (connect), or a TCP probe of the bound port (bind),
    emptied a live mirror and logged a warning per attempt (a reviewer's probe). Only the
    close of a link whose handshake succeeded is a publisher lost."""
    import socket
    import threading

    import msgpack
    import zmq
    import zmq.asyncio

    from sluice.agent.kvevents import encode_seq

    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    stop = threading.Event()
    if case == "connect-to-a-proxy":
        proxy = socket.create_server(("127.0.0.1", port))
        proxy.settimeout(0.1)

        def accept_and_close() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    proxy.accept()[0].close()

        closer = threading.Thread(target=accept_and_close, daemon=True)
        closer.start()
    try:
        async with _following(endpoint, kv_bind=case == "bind-and-a-probe") as engine:
            tracker = engine.kv_tracker
            assert tracker is not None
            if case == "connect-to-a-proxy":
                await asyncio.sleep(1.0)  # ZeroMQ reconnects every 0.1 s: about 10 closes
            else:
                ctx = zmq.asyncio.Context()
                pub = ctx.socket(zmq.PUB)
                pub.connect(endpoint)  # a live publisher...
                stored = ["BlockStored", [b"a"], None, PROMPT[:16], 16, None, "GPU"]
                payload = msgpack.packb([0.0, [stored], 0])
                seqs = itertools.count()

                async def heard() -> bool:
                    await pub.send_multipart([b"", encode_seq(next(seqs)), payload])
                    return tracker.stats.batches >= 1

                try:
                    await eventually(heard)
                    for _ in range(3):  # ...and a kubelet tcpSocket probe of the port
                        socket.create_connection(("127.0.0.1", port)).close()
                        await asyncio.sleep(0.2)
                    assert engine.cached_blocks()  # the mirror kept its block
                finally:
                    pub.close(linger=0)
                    ctx.term()
            assert tracker.stats.publishers_lost == 0
    finally:
        stop.set()
        if case == "connect-to-a-proxy":
            closer.join()
            proxy.close()


async def test_kv_events_of_another_topic_are_not_followed() -> None:
    """A publisher shared by several engines or models tells them apart by topic: an agent
    follows its own (``engine_kv_topic``). It followed every topic on the socket (a helper's
    probe): another model's blocks went into this worker's digest."""
    port, kv = _free_port(), _free_port_pair()
    proc = _start(["--port", str(port), "--kv-events-port", str(kv)])  # topic "kv-events"
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
        engines = {
            topic: HttpEngine(
                HttpEngineConfig(
                    url=f"http://127.0.0.1:{port}", model="sim", kv_events=f"tcp://127.0.0.1:{kv}",
                    kv_topic=topic, digest_min_tokens=None,
                )
            )
            for topic in ("kv-events", "other-model")
        }  # fmt: skip
        for engine in engines.values():
            await engine.open()
        try:
            await asyncio.sleep(0.3)  # a SUB socket misses what is published before it joined
            mine, theirs = engines["kv-events"], engines["other-model"]
            mine.add("r1", len(PROMPT), 1, [], 0.0, PROMPT)
            assert mine.kv_tracker is not None and theirs.kv_tracker is not None

            async def applied() -> bool:
                mine.step()
                return mine.kv_tracker is not None and mine.kv_tracker.stats.batches >= 1

            await eventually(applied)
            await asyncio.sleep(0.2)  # what reached one SUB socket has reached the other
            assert theirs.kv_tracker.stats.batches == 0 and theirs.cached_blocks() == []
        finally:
            for engine in engines.values():
                await engine.close()
    finally:
        _stop(proc)


@contextlib.asynccontextmanager
async def _following(kv_events: str, **config: Any) -> AsyncIterator[HttpEngine]:
    """A ``sluice engine`` process that publishes no KV events, and an open ``HttpEngine`` for
    it that follows ``kv_events`` (another publisher, or none), while the block runs."""
    port = _free_port()
    proc = _start(["--port", str(port)])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
        url = f"http://127.0.0.1:{port}"
        engine = HttpEngine(
            HttpEngineConfig(url=url, model="sim", kv_events=kv_events, digest_min_tokens=None,
                             **config)
        )  # fmt: skip
        await engine.open()
        try:
            yield engine
        finally:
            await engine.close()
    finally:
        _stop(proc)


async def test_with_kv_bind_an_engine_that_connects_is_followed() -> None:
    """vLLM and SGLang connect their PUB socket to an endpoint that is neither ``ipc://`` nor a
    wildcard (``tcp://127.0.0.1:5557``), so an agent that connected to it as well heard
    nothing; with ``kv_bind`` the agent binds it. A port already taken is an EngineError at
    start, not a KV loop that dies unseen."""
    import msgpack
    import zmq
    import zmq.asyncio

    from sluice.agent.engine import EngineError
    from sluice.agent.kvevents import encode_seq
    from sluice.schemas.hashing import block_hashes

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    async with _following(endpoint, kv_bind=True) as engine:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.connect(endpoint)  # as vLLM's publisher does with this endpoint
        try:
            tracker = engine.kv_tracker
            assert tracker is not None
            stored = ["BlockStored", [b"a", b"b"], None, PROMPT[:32], 16, None, "GPU"]
            payload = msgpack.packb([0.0, [stored], 0])
            seqs = itertools.count()

            async def heard() -> bool:  # a PUB drops what it sends before the link is up
                await pub.send_multipart([b"", encode_seq(next(seqs)), payload])
                return tracker.stats.batches >= 1

            await eventually(heard)
            assert set(block_hashes(PROMPT[:32])) <= set(engine.cached_blocks())
            taken = HttpEngine(engine.config)  # the same endpoint, bound already
            with pytest.raises(EngineError, match="cannot bind the KV event socket"):
                await taken.open()
            assert taken._session is None  # it failed before it opened anything
        finally:
            pub.close(linger=0)
            ctx.term()


async def test_an_agent_that_hears_no_kv_event_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Both sides connecting (or a wrong topic, or an engine that publishes none) was silent:
    the digest stayed empty and nothing said why. Once requests that stored whole blocks have
    finished for ``kv_silence_s`` without an event, the agent warns, once."""
    async with _following(f"tcp://127.0.0.1:{_free_port()}", kv_silence_s=0.3) as engine:
        for i in range(2):
            engine.add(f"r{i}", len(PROMPT), 1, [], 0.0, PROMPT)

            async def done(rid: str = f"r{i}") -> bool:
                return any(
                    not isinstance(e, TokensOut) and e.request_id == rid
                    for e in engine.step().events
                )

            await eventually(done)
            await asyncio.sleep(0.35)
        assert engine.kv_silent
        assert sum("no KV event has come" in r.getMessage() for r in caplog.records) == 1


async def test_an_agent_whose_kv_socket_cannot_open_does_not_start(nats_url: str) -> None:
    """A KV event socket that cannot be bound fails the agent's start with an EngineError
    (`sluice agent` says so, exit code 2), and leaves no broker connection behind."""
    import zmq

    from sluice.agent.engine import EngineError

    kv = _free_port()
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{kv}")
    fast = {k: v for k, v in FAST_AGENT.items() if k != "speed"}
    settings = AgentSettings(
        nats_url=nats_url, worker_id="kv-taken", models=["sim"], engine="openai-http",
        engine_url="http://127.0.0.1:9", engine_kv_events=f"tcp://127.0.0.1:{kv}",
        engine_kv_bind=True, **fast,
    )  # fmt: skip
    agent = Agent(settings, build_engine(settings))
    try:
        with pytest.raises(EngineError, match="cannot bind the KV event socket"):
            await agent.start()
        assert agent._nc is None and agent._subs == []
    finally:
        holder.close(linger=0)
        ctx.term()


async def test_a_replay_is_asked_as_vllm_answers_and_what_it_lacks_is_counted() -> None:
    """The replay request is (identity, empty, sequence) at the engine's ROUTER, as vLLM's and
    SGLang's servers take it (a bare sequence was refused there: no gap was ever filled); the
    batches of a gap the replay does not return (gone from the engine's buffer) are counted,
    not silently lost."""
    import msgpack
    import zmq
    import zmq.asyncio

    from sluice.agent.kvevents import REPLAY_END, decode_seq, encode_seq

    kv = _free_port_pair()
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"tcp://127.0.0.1:{kv}")
    router.bind(f"tcp://127.0.0.1:{kv + 1}")
    empty = msgpack.packb([0.0, [], 0])
    try:
        async with _following(f"tcp://127.0.0.1:{kv}") as engine:
            tracker = engine.kv_tracker
            assert tracker is not None

            async def first() -> bool:  # a PUB drops what it sends before the link is up
                await pub.send_multipart([b"", encode_seq(0), empty])
                return tracker.stats.batches >= 1

            await eventually(first)
            await pub.send_multipart([b"", encode_seq(tracker.expected_seq + 5), empty])
            frames = await asyncio.wait_for(router.recv_multipart(), 10)
            assert len(frames) == 3 and frames[1] == b""  # (identity, empty, sequence)
            start = decode_seq(frames[2])
            assert start == tracker.expected_seq - 6
            for seq in (start + 3, start + 4):  # the buffer kept the last two of the five
                await router.send_multipart([frames[0], b"", encode_seq(seq), empty])
            await router.send_multipart([frames[0], b"", encode_seq(REPLAY_END), b""])

            async def counted() -> bool:
                return tracker.stats.unfilled == 3

            await eventually(counted)
            assert tracker.stats.gaps == 1
    finally:
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()


async def test_the_demo_runs_through_sluice_engine_processes() -> None:
    """``sluice demo --engines http``: one engine process per agent over Unix sockets, every
    request done, prefixes reused at the engines, and every engine process stopped."""
    from sluice.cli.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        duration_s=4.0, workers=2, sessions=6, rag_rate=1.0, batch_rate=1.0, speed=5.0,
        drain_s=20.0, engines="http",
    )  # fmt: skip
    report = await run_demo(cfg)
    assert report.done and not report.rejected and report.unfinished == 0
    assert report.hit_rate() > 0.2  # the engines report what their caches held
    assert {r.worker_id for r in report.done} == {"worker-0", "worker-1"}


def _misbehaving(mode: str) -> contextlib.AbstractAsyncContextManager[str]:
    """A real HTTP server (loopback) whose completions misbehave as ``mode`` says: its URL."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(_: Any) -> Any:
        if mode in _BAD_ANSWERS:
            return await _bad_answer(mode)

        async def body() -> AsyncIterator[bytes]:
            if mode == "slow-first":
                await asyncio.sleep(0.8)  # past the between-token timeout, within the first's
            yield b'data: {"choices": [{"index": 0, "text": " hi"}]}\n\n'
            if mode == "slow-first":
                await asyncio.sleep(3600)
            if mode == "garbage":
                yield b"data: {not json\n\n"
            elif mode == "hang":
                await asyncio.sleep(3600)
            # "truncated": the stream ends without usage or [DONE]

        return StreamingResponse(body(), media_type="text/event-stream")

    async def health(_: Any) -> Any:
        return PlainTextResponse("ok")

    async def metrics(_: Any) -> Any:
        return PlainTextResponse("vllm:num_requests_running{ this is not prometheus\n")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health),
        Route("/metrics", metrics),
    ]
    return serving(Starlette(routes=routes))


async def _until_failed(engine: HttpEngine, most_s: float = 3.0) -> list[Any]:
    """The engine's events, stepped until one is a failure (at most ``most_s``)."""
    events: list[Any] = []
    deadline = time.monotonic() + most_s
    while not any(isinstance(e, Failed) for e in events) and time.monotonic() < deadline:
        events += engine.step().events
        await asyncio.sleep(0.01)
    return events


_TOKEN = b'data: {"choices": [{"index": 0, "text": " hi"}]}\n\n'
_BAD_ANSWERS = {
    # A shape no OpenAI server sends: each failed the stream with an exception nothing
    # caught (the request hung, unanswered), or crashed the agent's engine loop.
    "choices-int": [b'data: {"choices": 5}\n\n'],
    "text-int": [b'data: {"choices": [{"text": 5}]}\n\n'],
    "usage-str": [_TOKEN, b'data: {"choices": [], "usage": "abc"}\n\n', b"data: [DONE]\n\n"],
    "usage-negative": [
        _TOKEN, b'data: {"choices": [], "usage": {"prompt_tokens": -3}}\n\n', b"data: [DONE]\n\n"
    ],
    "usage-inf": [
        _TOKEN,
        b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": Infinity}}\n\n',
        b"data: [DONE]\n\n",
    ],
    # More tokens than asked for (the request asks for 5): the agent took them all, and a
    # result too large to store was retried forever.
    "too-many": [_TOKEN] * 10,
    # Lines without a token do not hold off the first-token timeout.
    "keepalive": "keepalive",
    # No answer at all, not even its head.
    "no-head": "no-head",
    # An error whose body never ends.
    "500-endless": "500-endless",
    # Too busy, come back in a second.
    "busy": "busy",
    # An error the engine streams, in vLLM's shapes, new and old: the old read as a chunk
    # without text, and the request failed as "the stream ended without usage", the reason
    # lost; the new one's message came as the repr of its whole object.
    "error-event": [
        _TOKEN, b'data: {"error": {"message": "too long", "type": "BadRequestError"}}\n\n',
        b"data: [DONE]\n\n",
    ],
    "error-object": [
        _TOKEN, b'data: {"object": "error", "message": "out of memory", "code": 500}\n\n',
        b"data: [DONE]\n\n",
    ],
    # Logprobs asked for (below), and text that comes without them.
    # A lone surrogate: JSON reads it, UTF-8 cannot carry it (the agent's engine loop died
    # encoding the chunk).
    "surrogate": [b'data: {"choices": [{"index": 0, "text": "\\ud83d"}]}\n\n'],
    "no-logprobs": [
        _TOKEN,
        b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n',
        b"data: [DONE]\n\n",
    ],
    # Logprobs as a real tokenizer makes them: a character split over two tokens, whose
    # texts do not add up to the chunk's, and whose text came first, in a chunk without
    # logprobs (SGLang's shape when no new token has its logprob yet); text after the last
    # token's; the engine counts a token more than it streamed with logprobs.
    "split-character": [
        'data: {"choices": [{"index": 0, "text": "\u00e9", "logprobs": null}]}\n\n'.encode(),
        b'data: {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": '
        b'["token_id:195", "token_id:169"], "token_logprobs": [-0.1, -0.2], "top_logprobs": '
        b'[{"token_id:195": -0.1}, {"token_id:169": -0.2}], "text_offset": [0, 0]}}]}\n\n',
        b'data: {"choices": [{"index": 0, "text": "!", "logprobs": {"tokens": ["!"], '
        b'"token_logprobs": [-0.3], "top_logprobs": [{"!": -0.3}], "text_offset": [1]}}]}\n\n',
        b'data: {"choices": [{"index": 0, "text": "?", "finish_reason": "stop", '
        b'"logprobs": null}]}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n',
        b"data: [DONE]\n\n",
    ],
}  # fmt: skip


async def test_logprobs_make_one_piece_per_token_with_the_chunks_text() -> None:
    """With logprobs, each streamed token is a piece of its own, with its logprob: the
    chunk's text goes with its first token (the tokens' texts need not add up to it), and the
    output counts the tokens streamed with logprobs, never more; text without them fails."""
    from sluice.schemas.models import Sampling

    async with _misbehaving("split-character") as url:
        engine = HttpEngine(HttpEngineConfig(url=url, model="sim", metrics_path=None))
        await engine.open()
        try:
            engine.add("r1", 3, 5, [], 0.0, "hello", Sampling(logprobs=1))
            events: list[Any] = []
            deadline = time.monotonic() + 5
            while not any(isinstance(e, Finished) for e in events):
                assert time.monotonic() < deadline, events
                events += engine.step().events
                await asyncio.sleep(0.01)
            (fin,) = [e for e in events if isinstance(e, Finished)]
            assert (
                fin.output_tokens == 3 == sum(e.count for e in events if isinstance(e, TokensOut))
            )
            assert engine.detokenize(engine.output_tokens("r1", 0, 3)) == "\u00e9!?"
            assert engine.detokenize(engine.output_tokens("r1", 0, 1)) == "\u00e9"
            lps = engine.output_logprobs("r1", 0, 3, 1)
            assert [(e.text, e.logprob) for e in lps] == [
                ("token_id:195", -0.1), ("token_id:169", -0.2), ("!", -0.3)
            ]  # fmt: skip
            assert [len(e.top) for e in lps] == [1, 1, 1]
        finally:
            await engine.close()
    async with _misbehaving("no-logprobs") as url:
        engine = HttpEngine(HttpEngineConfig(url=url, model="sim", metrics_path=None))
        await engine.open()
        try:
            engine.add("r1", 3, 5, [], 0.0, "hello", Sampling(logprobs=0))
            failed = [e for e in await _until_failed(engine) if isinstance(e, Failed)]
            assert len(failed) == 1 and "text without the logprobs" in failed[0].error
        finally:
            await engine.close()


async def _bad_answer(mode: str) -> Any:
    from starlette.responses import StreamingResponse

    answer = _BAD_ANSWERS[mode]

    async def body() -> AsyncIterator[bytes]:
        if isinstance(answer, list):
            for line in answer:
                yield line
            await asyncio.sleep(3600)  # no [DONE] unless the lines have it
        elif answer == "keepalive":
            while True:
                yield b": ping\n\n"
                await asyncio.sleep(0.05)
        else:
            yield b"the engine broke: " + b"x" * 100
            await asyncio.sleep(3600)

    if answer == "no-head":  # (not for an hour: the server's stop waits for its handlers)
        await asyncio.sleep(2.0)
    if answer == "busy":
        from starlette.responses import JSONResponse

        return JSONResponse({"error": "busy"}, status_code=429, headers={"Retry-After": "1"})
    status = 500 if answer == "500-endless" else 200
    return StreamingResponse(body(), status_code=status, media_type="text/event-stream")


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("choices-int", "choices that are not a list"),
        ("text-int", "text that is not a string"),
        ("usage-str", "usage that is not an object"),
        ("usage-negative", "prompt_tokens is not a token count"),
        ("usage-inf", "completion_tokens is not a token count"),
        ("too-many", "more than the 5 tokens asked for"),
        ("keepalive", "no first token within first_token_timeout_s of 0.5 s"),
        ("no-head", "no first token within first_token_timeout_s of 0.5 s"),
        ("500-endless", "the engine answered 500: the engine broke"),
        ("error-event", "the engine reported an error: too long"),
        ("error-object", "the engine reported an error: out of memory"),
        ("surrogate", "text that is not Unicode"),
    ],
)
async def test_an_engine_answering_what_no_openai_server_sends_fails_the_request(
    mode: str, error: str
) -> None:
    """Each request fails with a reason (the dispatcher runs it again elsewhere), and a retry
    of the same request on this engine starts afresh: it was refused as "already on the
    engine" until the step after its failure."""
    async with _misbehaving(mode) as url:
        engine = HttpEngine(
            HttpEngineConfig(
                url=url,
                model="sim",
                first_token_timeout_s=0.5,
                token_timeout_s=0.5,
                metrics_path=None,
            )
        )
        await engine.open()
        try:
            for attempt in (1, 2):
                engine.add("r1", 3, 5, [], 0.0, "hello")
                events = await _until_failed(engine)
                failed = [e for e in events if isinstance(e, Failed)]
                assert len(failed) == 1 and error in failed[0].error, (attempt, events)
                engine._healthy = True  # (a timeout marks it unhealthy until a health check)
        finally:
            await engine.close()


async def test_an_engine_that_says_it_is_busy_takes_no_work_for_its_retry_after() -> None:
    """A 429 (or 503) with Retry-After: the request fails (it runs again where there is room)
    and the engine takes no new work for that long. It stayed available, and a one-engine
    fleet spent a request's every attempt on it at once (a helper's probe)."""
    async with _misbehaving("busy") as url:
        engine = HttpEngine(HttpEngineConfig(url=url, model="sim", metrics_path=None))
        await engine.open()
        try:
            engine.add("r1", 3, 5, [], 0.0, "hello")
            failed = [e for e in await _until_failed(engine) if isinstance(e, Failed)]
            assert failed and "answered 429" in failed[0].error
            assert not engine.available
            t0 = time.monotonic()

            async def available() -> bool:
                return engine.available

            await eventually(available, timeout_s=5.0)
            assert 0.5 <= time.monotonic() - t0 <= 1.5
        finally:
            await engine.close()


@pytest.mark.parametrize(
    ("mode", "error"),
    [("garbage", "malformed SSE"), ("truncated", "before [DONE]"), ("hang", "TimeoutError")],
)
async def test_a_misbehaving_engine_fails_the_request_with_a_reason(mode: str, error: str) -> None:
    async with _misbehaving(mode) as url:
        engine = HttpEngine(
            HttpEngineConfig(
                url=url,
                model="sim",
                token_timeout_s=0.5,
                metrics_every_s=0.05,
                metrics_stale_s=0.3,
            )
        )
        await engine.open()
        try:
            engine.add("r1", 3, 5, [], 0.0, "hello")
            events = await _until_failed(engine)
            failed = [e for e in events if isinstance(e, Failed)]
            assert len(failed) == 1 and error in failed[0].error, events
            assert engine.detokenize(engine.output_tokens("r1", 0, 1)) in ("", " hi")
            # Garbage on /metrics is counted, never raised; stale figures saturate the engine.
            assert engine.scrape_errors >= 1
            await asyncio.sleep(0.4)
            assert not engine.available
        finally:
            await engine.close()


async def test_the_engine_benchmark_measures_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The three paths are measured: the in-process baseline (the server's engine and stepping
    loop in this event loop, no HTTP), the sluice engine process reached directly, and that
    process through Sluice. The in-process figures are bounded below by the profile's simulated
    step durations at this speed: the server paces its steps to a clock (asyncio's default
    loop never wakes a sleep early; uvloop, which the command uses, rounds timers down to whole
    milliseconds), so a request's last token comes no earlier than its prefill and decode
    steps add up to, although a late first token lets the next ones catch up. Removing the
    sleep from ``SimServer._run``, or timing the in-process path without streaming its events,
    fails them. Run or refused, it leaves no temporary folder behind (a bad profile or speed
    left one: the folder was made first)."""
    import tempfile

    from rich.console import Console

    from sluice.cli.benchengine import PROMPT_TOKENS, bench_engine, table, verdict
    from sluice.sim.profiles import get_profile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(KeyError, match="unknown engine profile"):
        await bench_engine(requests=4, profile="nope")
    with pytest.raises(ValueError, match="speed"):
        await bench_engine(requests=4, speed=-1.0)
    assert os.listdir(tmp_path) == []
    speed, max_tokens = 50.0, 4
    r = await bench_engine(requests=4, max_tokens=max_tokens, speed=speed)
    assert os.listdir(tmp_path) == []
    p = get_profile("reference")
    prefill_s = PROMPT_TOKENS / p.prefill_tokens_per_s / speed  # one chunk: the whole prompt
    decode_s = (p.decode_base_s + p.decode_per_seq_s) / speed  # a batch of one
    assert r.inproc.ttft_p50_ms >= prefill_s * 1000, r
    last_ms = r.inproc.ttft_p50_ms + r.inproc.token_ms * (max_tokens - 1)
    assert last_ms >= (prefill_s + decode_s * (max_tokens - 1)) * 1000, r
    assert r.direct.ttft_p50_ms > 0 and r.sluice.ttft_p50_ms > 0, r
    for path in (r.inproc, r.direct, r.sluice):
        assert path.burst_tokens_per_s > 0, r
    console = Console(record=True, width=200)
    console.print(table(r))
    console.print(verdict(r))
    out = console.export_text()
    assert f"{r.inproc.ttft_p50_ms:.1f} ms" in out and f"{r.server_added_ttft_ms:+.1f} ms" in out


async def test_a_real_engines_first_token_and_end_wake_the_agent_not_its_poll(
    nats_url: str,
) -> None:
    """The agent handles an HTTP engine's first token and end when they arrive: with a poll
    of 60 s, a request still finishes in seconds (waiting for the poll instead, as the step
    loop did, its first step alone would take a minute)."""
    port = _free_port()
    proc = _start(["--port", str(port), "--speed", "100"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
        settings = _agent(nats_url, "http-slow-poll", f"http://127.0.0.1:{port}").settings
        engine = build_engine(settings)
        assert isinstance(engine, HttpEngine)
        engine.config = dataclasses.replace(engine.config, poll_s=60.0)
        agent = Agent(settings, engine)
        async with LocalCluster(nats_url, **cluster_kwargs(workers=0)):
            await agent.start()
            try:
                async with Client(nats_url) as c:
                    h = await c.submit("sim", PROMPT, max_tokens=8)
                    first = await h.result(timeout_s=20)
                assert first.ok and len(first.output_tokens) == 8
            finally:
                await agent.stop(drain=False)
    finally:
        _stop(proc)


async def test_the_first_token_has_its_own_longer_timeout_and_later_ones_the_shorter() -> None:
    """A first token slower than the between-token timeout still arrives (a stream's reads
    wait as long as the first-token timeout); a stream that stalls after it fails after the
    between-token timeout."""
    async with _misbehaving("slow-first") as url:
        engine = HttpEngine(
            HttpEngineConfig(
                url=url,
                model="sim",
                first_token_timeout_s=5.0,
                token_timeout_s=0.3,
                metrics_path=None,
            )
        )
        await engine.open()
        try:
            engine.add("r1", 3, 5, [], 0.0, "hello")
            t0 = time.monotonic()
            events: list[Any] = []
            first_at = None
            while time.monotonic() - t0 < 4 and not any(isinstance(e, Failed) for e in events):
                got = engine.step().events
                if first_at is None and any(isinstance(e, TokensOut) for e in got):
                    first_at = time.monotonic()
                events += got
                await asyncio.sleep(0.01)
            assert first_at is not None and first_at - t0 >= 0.75, events
            failed = [e for e in events if isinstance(e, Failed)]
            assert len(failed) == 1 and "TimeoutError" in failed[0].error, events
            assert 0.25 <= time.monotonic() - first_at < 2.0
        finally:
            await engine.close()

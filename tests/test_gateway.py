"""``sluice gateway`` end to end: the official ``openai`` package, unchanged, against a real
gateway (uvicorn on a free loopback port, in this process) over a real cluster (nats-server, a
dispatcher, simulated agents), and raw HTTP where the SDK would hide what is sent.

Each test names in its docstring the edit that makes it fail."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sluice.client import Batches, Client, ClientSettings, RejectReason, Result
from sluice.common.chat import render_chat
from sluice.common.tokenizer import PromptTokenizer
from sluice.gateway import ApiKey, GatewayServer, GatewaySettings
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs, eventually

pytestmark = pytest.mark.e2e

SECRET = "sk-gw-3c9d1e77-must-never-be-logged"
OTHER = "sk-gw-other-key"


@asynccontextmanager
async def serving(
    nats_url: str, client: Client | None = None, **settings: Any
) -> AsyncIterator[tuple[GatewayServer, AsyncOpenAI]]:
    """A gateway on a free loopback port and an openai client of it (no retries: the tests
    see every answer)."""
    gs = GatewaySettings(nats_url=nats_url, host="127.0.0.1", port=0, **settings)
    async with GatewayServer(gs, client=client) as gw:
        oa = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0, timeout=30)
        try:
            yield gw, oa
        finally:
            await oa.close()


def _rid(response_id: str) -> str:
    """The Sluice request id in an OpenAI response id (``chatcmpl-ID``, ``cmpl-ID``)."""
    return response_id.split("-", 1)[1]


async def _stored(c: Client, response_id: str, tenant: str = "default") -> Result:
    result = await c.fetch_result(_rid(response_id), tenant=tenant)
    assert result is not None, f"no stored result for {response_id}"
    return result


LONG = " ".join(f"word{i}" for i in range(200))  # 1,290 bytes: 20 text blocks


async def test_the_openai_client_chats_streams_completes_and_lists_models(nats_url: str) -> None:
    """What the SDK gets is what Sluice stored: text, token counts and the engine's cache hit.
    Mutations: ``cached_tokens`` not taken from the result (oaiformat.usage); the usage chunk
    dropped (Chunks.end); the first delta without its role."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        Client(nats_url) as c,
        serving(nats_url) as (_, oa),
    ):
        assert [m.id for m in (await oa.models.list()).data] == ["sim"]
        assert (await oa.models.retrieve("sim")).id == "sim"

        messages: list[Any] = [{"role": "user", "content": LONG}]
        reply = await oa.chat.completions.create(model="sim", messages=messages, max_tokens=6)
        stored = await _stored(c, reply.id)
        assert reply.object == "chat.completion" and reply.model == "sim"
        choice = reply.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == stored.text
        assert choice.finish_reason == "length" and stored.ok
        assert reply.usage is not None and reply.usage.completion_tokens == 6
        assert reply.usage.prompt_tokens == stored.prompt_tokens > 300

        # The same prompt again, streamed: the engine has it cached, and the usage says so.
        stream = await oa.chat.completions.create(
            model="sim",
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        stored = await _stored(c, chunks[0].id)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == stored.text and len(stored.output_tokens) == 8
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == stored.cached_tokens > 0
        assert usage.completion_tokens == 8

        await oa.completions.create(model="sim", prompt=LONG, max_tokens=4)
        done = await oa.completions.create(model="sim", prompt=LONG, max_tokens=4)  # cached now
        stored = await _stored(c, done.id)
        assert done.object == "text_completion" and done.choices[0].text == stored.text
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        assert done.usage.prompt_tokens_details.cached_tokens == stored.cached_tokens > 0

        ids = list(range(5000, 5100))
        pieces = [
            ch.choices[0].text
            async for ch in await oa.completions.create(
                model="sim", prompt=ids, max_tokens=5, stream=True
            )
        ]
        assert len(pieces) >= 2 and pieces[-1] == ""  # text chunks, then the finish
        assert (await c.fetch_result(_rid(done.id))) is not None


async def test_the_gateway_parses_http_with_httptools(nats_url: str) -> None:
    """uvicorn's C parser, not the pure-Python h11 (0.1-0.5 ms more per request here)."""
    async with serving(nats_url) as (gw, _):
        assert gw._server is not None
        assert gw._server.config.http_protocol_class is HttpToolsProtocol


async def test_errors_are_openai_shaped_with_their_status(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Malformed JSON and bad fields 400, an unknown model 404, a bad or missing key 401, a
    band the key may not use 403, a band the fleet lacks 400; the key's tenant and band reach
    Sluice; the key is in no log line and no answer. Mutations: Principal.band allowing any
    band; the tenant not passed to submit; the 404 route handler left to Starlette."""
    caplog.set_level(logging.DEBUG)
    keys = [
        ApiKey(
            name="acme",
            key_sha256=hashlib.sha256(SECRET.encode()).hexdigest(),
            tenant="acme",
            bands=["batch", "gold"],
            default_band="standard",
        ),
        ApiKey(key=OTHER, tenant="beta"),
    ]
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        Client(nats_url) as c,
        serving(nats_url, keys=keys) as (gw, oa),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        auth = {"Authorization": f"Bearer {SECRET}"}
        answers = []
        for body, param in [
            (b"{not json", None),
            (b"[1, 2]", None),
            (b'{"model": "sim"}', "messages"),
            (b'{"model": "sim", "messages": [{"role": "user", "content": "x"}], "n": 17}', "n"),
        ]:
            r = await http.post("/v1/chat/completions", content=body, headers=auth)
            answers.append(r.text)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error" and err["param"] == param
        r = await http.get("/v1/nothing-here", headers=auth)
        assert r.status_code == 404 and set(r.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        r = await http.get("/v1/chat/completions", headers=auth)
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        assert (
            r.json()["error"]["message"]
            == ("GET is not allowed on /v1/chat/completions (use POST)")
            and r.headers["allow"] == "POST"
        ), r.text

        msg: list[Any] = [{"role": "user", "content": "hello"}]
        with pytest.raises(openai.NotFoundError) as nf:
            await oa.chat.completions.create(model="no-such-model", messages=msg, max_tokens=2)
        assert nf.value.code == "model_not_found"
        with pytest.raises(openai.AuthenticationError) as au:
            await oa.with_options(api_key="sk-wrong").chat.completions.create(
                model="sim", messages=msg, max_tokens=2
            )
        answers.append(au.value.response.text)
        r = await http.get("/v1/models")  # no key at all; models need one too
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"

        with pytest.raises(openai.PermissionDeniedError) as pd:
            await oa.chat.completions.create(
                model="sim",
                messages=msg,
                max_tokens=2,
                extra_headers={"x-sluice-priority": "interactive"},
            )
        assert pd.value.code == "band_not_allowed"
        with pytest.raises(openai.BadRequestError) as ub:  # allowed, but no such band
            await oa.chat.completions.create(
                model="sim", messages=msg, max_tokens=2, extra_headers={"x-sluice-priority": "gold"}
            )
        assert ub.value.code == "unknown_band"

        ok = await oa.chat.completions.create(
            model="sim", messages=msg, max_tokens=2, extra_headers={"x-sluice-priority": "batch"}
        )
        plain = await oa.chat.completions.create(model="sim", messages=msg, max_tokens=2)
        beta = await oa.with_options(api_key=OTHER).completions.create(
            model="sim", prompt="hi", max_tokens=2
        )
        assert (await _stored(c, ok.id, "acme")).band == "batch"
        assert (await _stored(c, plain.id, "acme")).band == "standard"  # the key's default
        stored_beta = await _stored(c, beta.id, "beta")
        assert stored_beta.tenant == "beta" and stored_beta.band == "interactive"
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    for text in [logged, *answers]:
        assert SECRET not in text and OTHER not in text


async def test_a_full_queue_is_a_429_with_retry_after_in_whole_seconds(nats_url: str) -> None:
    """No worker, a bound of 3 (+ the global limit 1) in the batch band, filled through the
    client library: the gateway's request is refused at once with 429 and ``Retry-After``, the
    client's retry-after (2.5 s, no admission rate known yet) rounded up. Mutations: the
    header dropped, or the retry-after truncated instead of rounded up."""
    kw = cluster_kwargs(
        workers=0, dispatcher={"queue_max_msgs": 3, "global_limit": 1, "band_queue_max_msgs": {}}
    )
    async with LocalCluster(nats_url, **kw), Client(nats_url) as c:
        for i in range(4):
            await c.submit("sim", "fill", band="batch", request_id=f"fill-{i}")
        gw_client = Client(nats_url, queue_full_retry_after_s=2.5)
        async with serving(nats_url, client=gw_client) as (_, oa):
            with pytest.raises(openai.RateLimitError) as info:
                await oa.completions.create(
                    model="sim",
                    prompt="one more",
                    max_tokens=2,
                    extra_headers={"x-sluice-priority": "batch"},
                )
    assert info.value.status_code == 429 and info.value.code == "queue_full"
    assert info.value.response.headers["retry-after"] == "3"
    assert "batch" in info.value.message


async def test_an_unknown_model_is_refused_before_the_dispatcher_would_hold_it(
    nats_url: str,
) -> None:
    """A discovering dispatcher holds a request for a model no worker announced for
    ``model_grace_s`` (30 s here): the gateway answers 404 at once from the fleet's model list.
    Mutation: Catalog.require_model returning without looking (the request waits 30 s and the
    client's 5 s timeout fails the test)."""
    kw = cluster_kwargs(workers=1, dispatcher={"models": [], "model_grace_s": 30.0})
    async with LocalCluster(nats_url, **kw), serving(nats_url) as (_, oa):

        async def announced() -> bool:
            return [m.id for m in (await oa.models.list()).data] == ["sim"]

        await eventually(announced)
        with pytest.raises(openai.NotFoundError):
            await oa.with_options(timeout=5).completions.create(
                model="not-announced", prompt="hi", max_tokens=2
            )


async def test_no_dispatcher_is_a_503_and_health_follows_the_broker(nats_url: str) -> None:
    """NATS is up but no dispatcher answers: 503, in OpenAI's shape; /health is 200 (the
    gateway's own connection is up). Mutation: ServiceUnavailable not mapped (a 500)."""
    async with (
        serving(nats_url) as (gw, oa),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        with pytest.raises(openai.InternalServerError) as info:
            await oa.completions.create(model="sim", prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.code == "service_unavailable"
        assert (await http.get("/health")).json() == {"status": "ok"}


async def test_a_stale_model_list_is_answered_at_once_and_looked_up_behind(
    nats_url: str,
) -> None:
    """Past its TTL the catalog answers from the list it has while it asks the dispatcher
    again in the background (a busy dispatcher's slow stats answer held every request's first
    token); the lookup failing forgets the list, so the next request gets the 503. Mutation:
    the stale list not answered (the first call waits the stats timeout, then raises)."""
    from sluice.client import ServiceUnavailable
    from sluice.gateway.catalog import STATS_TIMEOUT_S, Catalog

    now = [0.0]
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        catalog = Catalog(c, ttl_s=2.0, clock=lambda: now[0])
        try:
            assert "sim" in (await catalog.fleet()).models
            await cluster.dispatcher.stop()  # nobody answers the stats query now
            now[0] = 10.0
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert "sim" in (await catalog.fleet()).models
            assert loop.time() - t0 < STATS_TIMEOUT_S / 4
            await asyncio.sleep(STATS_TIMEOUT_S + 0.5)  # the lookup behind it timed out
            with pytest.raises(ServiceUnavailable):
                await catalog.fleet()
        finally:
            await catalog.close()


async def test_a_conversation_stays_on_the_worker_that_holds_its_history(nats_url: str) -> None:
    """Eight conversations of four turns through the gateway on four workers, each turn of all
    eight at once: every turn lands on the worker of the conversation's first turn, and the
    engine finds the turns before it in its cache. The dispatcher's cache index is kept blind
    (its guesses expire after 50 ms, and the prompts are shorter than the agents' digests
    report), so only the session can keep a conversation where its history is. Half name their
    session in ``x-session-id``, half in the body's ``user``. Mutations: session_id not passed
    to submit (turns scatter, and miss); a per-request salt in render_chat (no hits)."""
    kw = cluster_kwargs(
        workers=4, dispatcher={"routing_explore_share": 0.0, "routing_guess_ttl_s": 0.05}
    )
    sessions = 8
    history: list[list[Any]] = [
        [{"role": "system", "content": f"You are assistant number {i}. " + "Be kind. " * 8}]
        for i in range(sessions)
    ]
    seen: list[list[Result]] = [[] for _ in range(sessions)]
    async with LocalCluster(nats_url, **kw), Client(nats_url) as c, serving(nats_url) as (_, oa):

        async def turn(i: int, t: int) -> None:
            history[i].append({"role": "user", "content": f"Question {t} of chat {i}: " * 3})
            named: dict[str, Any] = (
                {"extra_headers": {"x-session-id": f"conv-{i}"}} if i % 2 else {"user": f"u{i}"}
            )
            reply = await oa.chat.completions.create(
                model="sim", messages=history[i], max_tokens=8, **named
            )
            history[i].append({"role": "assistant", "content": reply.choices[0].message.content})
            stored = await _stored(c, reply.id)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            assert reply.usage.prompt_tokens_details.cached_tokens == stored.cached_tokens
            seen[i].append(stored)

        for t in range(4):
            await asyncio.gather(*(turn(i, t) for i in range(sessions)))
    for i, results in enumerate(seen):
        workers = [r.worker_id for r in results]
        assert workers == [workers[0]] * 4, f"conversation {i} moved: {workers}"
        for before, after in itertools.pairwise(results):
            # The whole previous prompt is cached, but for its last (partial) block.
            assert after.cached_tokens >= before.prompt_tokens - 32, (i, before, after)
    assert len({results[0].worker_id for results in seen}) > 1  # spread over the workers


async def _running(c: Client) -> int:
    return (await c.stats()).running


@pytest.mark.parametrize("n", [1, 2])
async def test_a_client_that_leaves_mid_stream_cancels_its_request(nats_url: str, n: int) -> None:
    """A stream of 200,000 tokens (about a minute): the client reads its first chunk and
    closes the connection; the request (every choice's, with ``n``) is cancelled (its stored
    result says so, with fewer tokens) and nothing runs any more. Mutation: Relay.abort not
    cancelling (or cancelling the first choice only)."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        Client(nats_url) as c,
        serving(nats_url) as (gw, _),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        body = {
            "model": "sim", "prompt": "a long one", "max_tokens": 200_000, "stream": True, "n": n
        }  # fmt: skip
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            rids = r.headers["x-sluice-request-id"].split(",")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break
        assert len(rids) == n
        # No check that it still runs here: the cancel may already have landed (a race the
        # test lost on a loaded machine). What ended it is in its result: cancelled, short.

        async def cancelled() -> bool:
            results = [await c.fetch_result(rid) for rid in rids]
            return all(r is not None and r.rejection is not None for r in results)

        await eventually(cancelled, timeout_s=10)
        for rid in rids:
            result = await c.fetch_result(rid)
            assert result is not None and result.rejection is not None
            assert result.rejection.reason is RejectReason.CANCELLED
            assert len(result.output_tokens) < 200_000

        async def idle() -> bool:
            return await _running(c) == 0

        await eventually(idle, timeout_s=5)


async def test_a_client_that_leaves_before_a_whole_answer_cancels_its_request(
    nats_url: str,
) -> None:
    """The same without streaming: the client gives up while the request runs (its task is
    cancelled, which closes the connection). Mutation: Relay._guarded not aborting on
    ClientGone."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        Client(nats_url) as c,
        serving(nats_url) as (gw, _),
        httpx.AsyncClient(base_url=gw.url, timeout=60) as http,
    ):
        body = {"model": "sim", "prompt": "a long one", "max_tokens": 200_000}
        waiting = asyncio.ensure_future(http.post("/v1/completions", json=body))

        async def running() -> bool:
            return await _running(c) == 1

        await eventually(running, timeout_s=10)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

        async def idle() -> bool:
            return await _running(c) == 0

        await eventually(idle, timeout_s=10)


async def test_metrics_count_requests_by_route_and_status(nats_url: str) -> None:
    """``/metrics`` counts answers by route and status and times first tokens. Mutation: the
    metering middleware not installed."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        serving(nats_url) as (gw, oa),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):

        def value(text: str, sample: str) -> float:
            rows = [ln for ln in text.splitlines() if ln.startswith(sample + " ")]
            return float(rows[0].split()[-1]) if rows else 0.0

        ok = 'sluice_gateway_requests_total{route="/v1/completions",status="200"}'
        bad = 'sluice_gateway_requests_total{route="/v1/completions",status="400"}'
        ttft = 'sluice_gateway_first_token_seconds_count{route="/v1/completions"}'
        before = (await http.get("/metrics")).text
        await oa.completions.create(model="sim", prompt="hi", max_tokens=2)
        await http.post("/v1/completions", content=b"nope")
        after = (await http.get("/metrics")).text
    assert value(after, ok) == value(before, ok) + 1
    assert value(after, bad) == value(before, bad) + 1
    assert value(after, ttft) == value(before, ttft) + 1
    assert "sluice_gateway_in_flight_requests" in after


async def test_a_request_past_its_time_is_cancelled_with_a_504(nats_url: str) -> None:
    """``request_timeout_s`` = 1: a whole answer that would take a minute is a 504, a stream
    that had started ends with an error event, and both requests are cancelled. Mutation:
    Relay._guarded or EventStream not aborting on their timeouts."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        Client(nats_url) as c,
        serving(nats_url, request_timeout_s=1.0) as (gw, _),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        body = {"model": "sim", "prompt": "a long one", "max_tokens": 200_000}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        whole = r.headers["x-sluice-request-id"]  # it was submitted: the answer names it
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            streamed = s.headers["x-sluice-request-id"]
            events = [line async for line in s.aiter_lines() if line.startswith("data: ")]
        assert '"code":"timeout"' in events[-1] and "[DONE]" not in events[-1]

        async def both_cancelled() -> bool:
            results = [await c.fetch_result(rid) for rid in (whole, streamed)]
            return all(r is not None and r.rejection is not None for r in results)

        await eventually(both_cancelled, timeout_s=10)
        for rid in (whole, streamed):
            result = await c.fetch_result(rid)
            assert result is not None and result.rejection is not None
            assert result.rejection.reason is RejectReason.CANCELLED


async def test_a_gateway_that_stops_cancels_what_it_was_still_answering(nats_url: str) -> None:
    """The gateway is stopped while a long stream is open: once its grace for open answers has
    passed, the request is cancelled, not left running for nobody. Mutations: EventStream not
    calling on_abort when it is cancelled; Gateway.stop closing its connection without waiting
    for the answers still unwinding (the cancel then finds it closed)."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        Client(nats_url) as c,
        httpx.AsyncClient(timeout=30) as http,
    ):
        gs = GatewaySettings(nats_url=nats_url, host="127.0.0.1", port=0)
        server = await GatewayServer(gs).start()
        try:
            body = {"model": "sim", "prompt": "long", "max_tokens": 200_000, "stream": True}
            async with http.stream("POST", f"{server.url}/v1/completions", json=body) as s:
                rid = s.headers["x-sluice-request-id"]
                lines = aiter(s.aiter_lines())
                assert (await anext(lines)).startswith("data: {")
                await server.stop()
        finally:
            await server.stop()
        result = await c.fetch_result(rid)
        assert result is not None and result.rejection is not None
        assert result.rejection.reason is RejectReason.CANCELLED


async def test_with_a_tokenizer_a_chat_is_sent_as_its_token_ids(
    nats_url: str, tmp_path: Path
) -> None:
    """``tokenizer`` set: the rendered chat reaches the engine as the tokenizer's ids (its
    prompt is that many tokens, not the byte estimate), the same ids every time (the second
    identical chat is cached but for its last token). Mutation: the Gateway building its
    client without the tokenizer."""
    words = "alpha beta gamma delta"
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [f"{words} < | > user assistant"], trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    messages: list[Any] = [{"role": "user", "content": " ".join([words] * 40)}]
    ids = PromptTokenizer.from_file(tmp_path / "tokenizer.json").encode(render_chat(messages))
    assert len(ids) != len(render_chat(messages).encode()) // 4  # the estimate would differ
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        serving(nats_url, tokenizer=str(tmp_path / "tokenizer.json")) as (_, oa),
    ):
        usages = []
        for _ in range(2):
            reply = await oa.chat.completions.create(model="sim", messages=messages, max_tokens=2)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            usages.append(reply.usage)
    assert [u.prompt_tokens for u in usages] == [len(ids), len(ids)]
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]  # type: ignore[union-attr]
    assert cached[0] == 0 and cached[1] >= len(ids) - 16


async def test_text_no_encoder_takes_and_a_prompt_over_the_brokers_limit_are_400s(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bad input at the edges of JSON and of the broker's wire is a 400 in OpenAI's shape,
    never a 500 or a retryable 503, and the gateway logs no internal error; a client gone
    while sending its body is a quiet 499. Mutations: parse_json on json.loads again (the
    surrogate, the digits and the nesting were 500s); Client._publish without its size check
    (the large prompt was a 503); guarded() without ClientDisconnect (an internal error)."""
    caplog.set_level(logging.WARNING)
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)),
        serving(nats_url) as (gw, oa),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        for body in [
            b'{"model": "sim", "prompt": "\\ud800"}',
            b'{"model": "sim", "prompt": "\xed\xa0\x80"}',
            b'{"model": "sim", "prompt": "hi", "temperature": ' + b"9" * 5000 + b"}",
            b'{"model": "sim", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b'{"model": "sim", "prompt": "' + b"word " * 300_000 + b'"}',  # 1.5 MB
        ]:
            r = await http.post("/v1/completions", content=body)
            assert r.status_code == 400, (r.status_code, r.text[:300])
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert "max_payload" in r.json()["error"]["message"]
        # A surrogate pair is text, and runs.
        pair = b'{"model": "sim", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'
        r = await http.post("/v1/completions", content=pair)
        assert r.status_code == 200, r.text

        gone = 'sluice_gateway_requests_total{route="/v1/completions",status="499"}'

        async def gone_count() -> float:
            # The registry is the process's: other tests of this process counted 499s too.
            rows = (await http.get("/metrics")).text.splitlines()
            return sum(float(ln.split()[-1]) for ln in rows if ln.startswith(gone + " "))

        before = await gone_count()
        _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model"'
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()

        async def counted() -> bool:
            return await gone_count() == before + 1

        await eventually(counted, timeout_s=10)
        assert (await oa.completions.create(model="sim", prompt="hi", max_tokens=2)).choices
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_a_body_that_stops_coming_is_a_408_within_body_timeout(nats_url: str) -> None:
    """A client that declares a body and stops sending it holds its connection for
    body_timeout_s, then gets a 408 (uvicorn alone waits as long as the connection stays
    open). Mutation: read_body without its timeout (no answer: the read times out here)."""
    async with serving(nats_url, body_timeout_s=0.5) as (gw, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            assert head.startswith(b"HTTP/1.1 408"), head
        finally:
            writer.close()


async def test_a_chat_is_rendered_with_the_models_template(nats_url: str, tmp_path: Path) -> None:
    """``chat_template`` (a tokenizer_config.json): the request the gateway queues carries the
    chat as the model's template renders it, its leading BOS left to the engine. No worker
    runs it, so it waits in its band's stream to be read. Mutation: the gateway's client
    built without the template (the neutral ``<|user|>`` rendering goes out)."""
    from sluice.schemas import names
    from sluice.schemas.codec import decode
    from sluice.schemas.models import SubmitRequest

    config = tmp_path / "tokenizer_config.json"
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + "
        "m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    config.write_text(json.dumps({"bos_token": "<s>", "chat_template": template}))
    kw = cluster_kwargs(workers=0)
    async with (
        LocalCluster(nats_url, **kw),
        Client(nats_url) as c,
        serving(nats_url, chat_template=str(config)) as (_, oa),
    ):
        asking = asyncio.create_task(
            oa.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        )
        js = c.nc.jetstream()
        band = GatewaySettings.model_fields["default_band"].default
        stream, subject = names.request_stream(band), names.request_subject(band, "sim", "default")

        async def queued() -> bool:
            if asking.done():
                asking.result()  # (its error: the gateway refused the chat)
            try:
                await js.get_last_msg(stream, subject)
            except Exception:  # not there yet
                return False
            return True

        try:
            await eventually(queued)
            msg = await js.get_last_msg(stream, subject)
        finally:
            asking.cancel()
            with contextlib.suppress(asyncio.CancelledError, openai.APIError):
                await asking
        sent = decode(msg.data, SubmitRequest)
        assert sent.prompt_text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        # A batch's chat line, through a client with the template (ClientSettings'
        # chat_template, as `sluice batch` reads it), goes out rendered alike.
        settings = ClientSettings(nats_url=nats_url, chat_template=str(config))
        async with Client.from_settings(settings) as bc:
            b = Batches(bc)
            line = {
                "custom_id": "a",
                "url": "/v1/chat/completions",
                "body": {"model": "sim", "messages": [{"role": "user", "content": "hi"}]},
            }
            refused = {**line, "custom_id": "b", "body": {"model": "sim", "messages": [
                {"role": "tool", "content": "x"}]}}  # fmt: skip
            data = b"\n".join(json.dumps(x).encode() for x in (line, refused))
            record = await b.create((await b.upload(data, "in.jsonl")).id)
            # Counted as the template renders them: the refused line is invalid at once.
            assert (record.counts.total, record.counts.invalid) == (1, 1)
        # Submitted by a process without the template (a gateway's sweep, another `sluice
        # batch`): the lines are rendered with the batch's own.
        plain = Batches(c)
        await plain.submit(record.id)
        assert (await plain.refresh(record.id)).counts.invalid == 1
        subject = names.request_subject("batch", "sim", "default")
        msg = await js.get_last_msg(names.request_stream("batch"), subject)
        assert decode(msg.data, SubmitRequest).prompt_text == sent.prompt_text


async def test_n_choices_run_as_n_requests_whole_and_streamed(nats_url: str) -> None:
    """``n``: each choice its own request (its id in ``x-sluice-request-id``), the answer's
    choices by index, the prompt counted once in the usage and every choice's output; a
    stream interleaves the choices' chunks, each with its finish, then one usage. Mutations:
    one request for all choices; the usage of the first choice alone."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=2)),
        serving(nats_url) as (_, oa),
    ):
        raw = await oa.completions.with_raw_response.create(
            model="sim", prompt="count with me", max_tokens=5, n=3
        )
        ids = raw.headers["x-sluice-request-id"].split(",")
        answer = raw.parse()
        assert len(set(ids)) == 3 and answer.id == f"cmpl-{ids[0]}"
        assert [c.index for c in answer.choices] == [0, 1, 2]
        assert all(c.text and c.finish_reason == "length" for c in answer.choices)
        assert answer.usage is not None and answer.usage.completion_tokens == 15
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + 15
        stream = await oa.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": "count with me"}],
            max_tokens=4,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    texts = {0: "", 1: ""}
    finishes: dict[int, str | None] = {}
    roles = []
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.index)
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert all(texts.values()) and finishes == {0: "length", 1: "length"}
    assert sorted(roles) == [0, 1]  # each choice's first delta names the role
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


async def test_a_choice_refused_refuses_the_answer_and_cancels_the_others(nats_url: str) -> None:
    """The band's queue is bounded (3, one queued): of n=4 choices a later one is refused,
    the answer is a 429 that names the choices queued before it, and those are cancelled,
    not left to run for nobody. Mutation: the queued choices not cancelled."""
    kw = cluster_kwargs(
        workers=0, dispatcher={"queue_max_msgs": 3, "global_limit": 1, "band_queue_max_msgs": {}}
    )
    async with LocalCluster(nats_url, **kw), Client(nats_url) as c:
        await c.submit("sim", "fill", band="batch", request_id="fill-0")
        async with serving(nats_url) as (_, oa):
            with pytest.raises(openai.RateLimitError) as info:
                await oa.completions.create(
                    model="sim",
                    prompt="four of these",
                    max_tokens=2,
                    n=4,
                    extra_headers={"x-sluice-priority": "batch"},
                )
            # The answer names the choices that were queued (and are cancelled): not all four.
            named = info.value.response.headers["x-sluice-request-id"].split(",")
            assert 1 <= len(named) < 4, named

            async def cancelled() -> bool:
                stats = await c.stats()
                batch = next(b for b in stats.bands if b.band == "batch")
                return batch.queued == 1  # the fill request alone

            await eventually(cancelled)


async def test_choices_stream_as_they_come_and_one_that_fails_stops_the_others(
    nats_url: str,
) -> None:
    """One request runs at a time (global_limit 1): the first choice streams to its finish
    before the second starts, and the stream did not wait for the second's first token to
    begin. Then a choice cancelled by someone else mid-stream ends the stream with its error
    event and stops the other, in a stream and in a whole answer. Mutations: first() waiting
    for every choice's first chunk; the other choices not stopped on a failure."""
    kw = cluster_kwargs(workers=1, dispatcher={"global_limit": 1, "leader_lease_s": 3.0})
    async with (
        LocalCluster(nats_url, **kw) as cluster,
        Client(nats_url) as c,
        serving(nats_url) as (gw, _),
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        body = {"model": "sim", "prompt": "in turn", "max_tokens": 40, "stream": True, "n": 2}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            events = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                      if line.startswith("data: {")]  # fmt: skip
        order = [(ch["index"], ch["finish_reason"]) for e in events for ch in e["choices"]]
        finished_0 = order.index((0, "length"))
        assert all(i == 0 for i, _ in order[:finished_0]) and (1, "length") in order
        assert order.index((0, "length")) < min(k for k, (i, _) in enumerate(order) if i == 1)

        long = {"model": "sim", "prompt": "long", "max_tokens": 200_000, "n": 2}
        async with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            rids = r.headers["x-sluice-request-id"].split(",")
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            await c.cancel(rids[0])  # the first choice, by someone else
            rest = [line async for line in lines if line.startswith("data: ")]
        assert '"error"' in rest[-1], rest[-3:]
        await eventually(lambda: _ended(c, rids), timeout_s=15)
        # A whole answer: its ids are known only from the worker that runs the first.
        answer = asyncio.create_task(http.post("/v1/completions", json=long))
        agent = cluster.agents[0]

        async def running() -> bool:
            return bool(agent._running)

        await eventually(running)
        await c.cancel(next(iter(agent._running)))
        response = await answer
        assert response.status_code >= 400, response.text
        rids = response.headers["x-sluice-request-id"].split(",")
        await eventually(lambda: _ended(c, rids), timeout_s=15)


async def _ended(c: Client, rids: list[str]) -> bool:
    results = [await c.fetch_result(rid) for rid in rids]
    return all(x is not None and x.rejection is not None for x in results)

"""Log probabilities (``Sampling.logprobs``): asked for by a producer, made by the engine,
carried one per token on the token stream and in the result, across a retry on another
worker too; the simulated engines' pseudo ones are a function of each token."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.agent.coalesce import TokenBuffer
from sluice.agent.engine import EngineError
from sluice.agent.runtime.httpengine import _logprobs
from sluice.client import Client, Sampling, TokenLogprob
from sluice.client.errors import InvalidRequest
from sluice.client.sampling import openai_sampling
from sluice.schemas.models import MAX_LOGPROBS, TokenChunk
from sluice.sim.tokens import VOCAB, detokenize, logprobs
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs

PROMPT = list(range(7000, 7064))


@given(st.lists(st.integers(0, VOCAB - 1), max_size=20), st.integers(0, MAX_LOGPROBS))
@settings(max_examples=200, deadline=None)
def test_pseudo_logprobs_are_a_distribution_of_the_token_and_its_alternatives(
    tokens: list[int], top: int
) -> None:
    out = logprobs(tokens, top)
    assert len(out) == len(tokens) and out == logprobs(tokens, top)  # a function of the tokens
    for t, e in zip(tokens, out, strict=True):
        assert e.text == detokenize([t]) and e.logprob <= 0
        assert len(e.top) == top
        values = [x.logprob for x in e.top]
        assert values == sorted(values, reverse=True)
        assert len({x.text for x in e.top}) == top  # no word twice
        listed = {x.text: x.logprob for x in e.top}
        assert sum(math.exp(v) for v in listed.values()) <= 1 + 1e-9
        # The token is among the most likely exactly when no listed alternative beats it.
        if e.text not in listed and top:
            assert min(values) >= e.logprob


def test_a_token_buffer_keeps_one_logprob_per_token() -> None:
    entries = logprobs([1, 2, 3], 1)
    asked = TokenBuffer(logprobs=[])
    asked.add([1, 2], 0.0, first=True, logprobs=entries[:2])
    asked.add([3], 0.1, first=False, logprobs=entries[2:])
    assert asked.take(0.2) == (0, [1, 2, 3]) and asked.logprobs_of(1, 2) == entries[1:]
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        asked.add([4, 5], 0.3, first=False, logprobs=entries[:1])
    with pytest.raises(ValueError, match="every token of a request or for none"):
        asked.add([4], 0.3, first=False)
    plain = TokenBuffer()
    plain.add([1], 0.0, first=True)
    assert plain.logprobs_of(0, 1) is None
    with pytest.raises(ValueError, match="every token of a request or for none"):
        plain.add([2], 0.1, first=False, logprobs=entries[:1])


def test_the_wire_refuses_logprobs_that_do_not_pair_with_the_tokens() -> None:
    with pytest.raises(ValueError, match="2 logprobs for 1 tokens"):
        TokenChunk(
            request_id="r", attempt=1, index=0, tokens=[1], text=" a", logprobs=logprobs([1, 2], 0)
        )
    with pytest.raises(ValueError):
        TokenLogprob(text="a", logprob=0.5)  # a probability above 1
    with pytest.raises(ValueError):
        TokenLogprob(text="a", logprob=float("-inf"))  # (an engine's -inf is sent as -9999)


def test_an_engines_legacy_logprobs_are_read_and_their_shape_checked() -> None:
    chunk = {
        "choices": [
            {
                "text": " a b",
                "logprobs": {
                    "tokens": [" a", " b"],
                    "token_logprobs": [-0.5, None],
                    "top_logprobs": [{" a": -0.5, " c": -1.5, " d": -0.1}, None],
                    "text_offset": [0, 2],
                },
            }
        ]
    }
    a, b = _logprobs(chunk, 2)
    assert (a.text, a.logprob, [(x.text, x.logprob) for x in a.top]) == (
        " a", -0.5, [(" d", -0.1), (" a", -0.5)]  # the two most likely, most likely first
    )  # fmt: skip
    assert (b.text, b.logprob, b.top) == (" b", -9999.0, [])  # null: log 0
    for bad in (
        {"tokens": [" a"], "token_logprobs": []},
        {"tokens": [" a"], "token_logprobs": ["x"]},
        {"tokens": [" a"], "token_logprobs": [float("nan")]},
        {"tokens": [1], "token_logprobs": [-1.0]},
        {"tokens": [" a"], "token_logprobs": [-1.0], "top_logprobs": [[" a"]]},
        [" a"],
    ):
        with pytest.raises(EngineError):
            _logprobs({"choices": [{"text": " a", "logprobs": bad}]}, 2)
    assert _logprobs({"choices": [{"text": " a", "logprobs": None}]}, 2) == []
    # SGLang asked for none: an empty list of alternatives.
    sglang = {"tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": []}
    (only,) = _logprobs({"choices": [{"text": " a", "logprobs": sglang}]}, 0)
    assert (only.text, only.logprob, only.top) == (" a", -0.5, [])
    # llama.cpp's server streams the chat shape on its completions endpoint too.
    content = [
        {
            "token": " a",
            "logprob": -0.5,
            "bytes": [32, 97],
            "top_logprobs": [{"token": " b", "logprob": -0.2}, {"token": " a", "logprob": -0.5}],
        }
    ]
    (llama,) = _logprobs({"choices": [{"text": " a", "logprobs": {"content": content}}]}, 1)
    assert (llama.text, llama.logprob, [(t.text, t.logprob) for t in llama.top]) == (
        " a", -0.5, [(" b", -0.2)]
    )  # fmt: skip
    for bad in ({"content": 5}, {"content": [{"logprob": -1.0}]},
                {"content": [{"token": " a", "logprob": -1.0, "top_logprobs": [5]}]},
                {"tokens": ["\ud83d"], "token_logprobs": [-1.0]}):  # fmt: skip
        with pytest.raises(EngineError):
            _logprobs({"choices": [{"text": " a", "logprobs": bad}]}, 2)


def test_an_openai_body_asks_by_its_endpoints_meaning() -> None:
    chat = {"messages": [], "logprobs": True, "top_logprobs": 4}
    assert openai_sampling(chat, "chat") == Sampling(logprobs=4)
    assert openai_sampling({"logprobs": 4}, "completion") == Sampling(logprobs=4)
    assert openai_sampling({"logprobs": False}, "chat") is None
    assert openai_sampling({"logprobs": False}, "completion") is None
    for body, kind, param in (
        ({"logprobs": 2, "top_logprobs": 2}, "completion", "top_logprobs"),  # (a chat field)
        ({"top_logprobs": 1}, "chat", "top_logprobs"),
        ({"logprobs": "yes"}, "chat", "logprobs"),
        ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "chat", "top_logprobs"),
        ({"logprobs": True}, "completion", "logprobs"),
        ({"logprobs": -1}, "completion", "logprobs"),
    ):
        with pytest.raises(InvalidRequest) as info:
            openai_sampling(body, kind)  # type: ignore[arg-type]
        assert info.value.param == param, body


@pytest.mark.e2e
async def test_logprobs_stream_with_their_tokens_and_survive_a_retry_elsewhere(
    nats_url: str,
) -> None:
    """Through the wire with simulated agents: every streamed chunk carries its tokens'
    logprobs, the result all of them; a worker killed mid-request costs an attempt, and the
    client stitches the tokens and their logprobs of both attempts as one."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=2)) as cluster,
        Client(nats_url) as c,
    ):
        plain = await (await c.submit("sim", PROMPT, max_tokens=8)).result(timeout_s=30)
        assert plain.logprobs is None
        handle = await c.submit(
            "sim", PROMPT, max_tokens=3000, request_id="lp", sampling=Sampling(logprobs=2)
        )
        stream = handle.__aiter__()
        first = await anext(stream)
        streamed, lps = list(first.tokens), list(first.logprobs or [])
        victim = next(a for a in cluster.agents if a.in_flight)
        await victim.kill()
        async for chunk in stream:
            assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.tokens)
            streamed += chunk.tokens
            lps += chunk.logprobs
        result = await handle.result(timeout_s=30)
    assert result.ok and result.attempt == 2 and len(result.output_tokens) == 3000
    assert streamed == result.output_tokens and lps == result.logprobs
    assert result.logprobs == logprobs(result.output_tokens, 2)


async def test_the_client_stitches_logprobs_with_their_tokens() -> None:
    """A retried attempt streams positions again from 0 (a chunk straddling what was
    delivered is cut, logprobs with tokens), and what the stream missed comes from the
    result: each token's logprob once, in order."""
    import time

    from sluice.client.client import RequestHandle
    from sluice.schemas.models import Result, SubmitRequest

    tokens = list(range(100, 107))
    lps = logprobs(tokens, 1)

    def chunk(attempt: int, start: int, end: int) -> TokenChunk:
        return TokenChunk(
            request_id="r",
            attempt=attempt,
            index=start,
            tokens=tokens[start:end],
            text=detokenize(tokens[start:end]),
            logprobs=lps[start:end],
        )

    request = SubmitRequest(
        request_id="r", model="sim", prompt_text="hi", submitted_unix_ms=int(time.time() * 1000)
    )
    handle = RequestHandle(None, request)  # type: ignore[arg-type]  # (no client is called)
    for c in (chunk(1, 0, 3), chunk(2, 0, 2), chunk(2, 2, 5), None):
        handle._chunks.put_nowait(c)
    text = detokenize(tokens)
    handle._set_result(
        Result(request_id="r", ok=True, attempt=2, output_tokens=tokens, text=text, logprobs=lps)
    )
    got = [c async for c in handle]
    assert [c.index for c in got] == [0, 3, 5]  # the straddling chunk cut, the tail added
    assert [t for c in got for t in c.tokens] == tokens
    assert [e for c in got for e in c.logprobs or []] == lps
    assert "".join(c.text for c in got) == text


@pytest.mark.e2e
async def test_an_engine_that_breaks_one_logprob_per_token_fails_the_request_not_the_agent(
    nats_url: str,
) -> None:
    """An engine whose logprobs do not pair with its tokens: that request fails (each
    attempt, then its rejection says why) and the agent goes on serving (the mismatch was an
    exception in its engine loop)."""
    from sluice.client import Rejected

    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        engine = cluster.agents[0].engine
        engine.output_logprobs = lambda *_: []  # type: ignore[method-assign]
        handle = await c.submit("sim", PROMPT, max_tokens=8, sampling=Sampling(logprobs=1))
        with pytest.raises(Rejected) as rejected:
            await handle.result(timeout_s=30)
        assert "the engine's logprobs: 0 logprobs for" in str(rejected.value)
        plain = await (await c.submit("sim", PROMPT, max_tokens=8)).result(timeout_s=30)
        assert plain.ok

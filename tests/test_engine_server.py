"""``sluice engine``: the simulated engine as a real server process, over TCP and a Unix socket,
spoken to with the real engines' protocols (OpenAI completions and chat, SGLang's /generate,
Prometheus metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.common.chat import render_chat
from sluice.schemas.hashing import DEFAULT_BLOCK_TOKENS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _free_port_pair() -> int:
    """A port ``p`` with ``p + 1`` free beside it on 127.0.0.1 now: a KV events endpoint on
    ``p`` has its replay socket on ``p + 1`` (vLLM's layout), and a port the kernel hands out
    alone says nothing of its neighbour (a client connection may hold it)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port: int = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


def _start(args: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sluice.cli", "engine", "--speed", "20", *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _said(stderr: str) -> str:
    """A command's error message on one line: the console wraps it at its width, and a long
    temporary path put a line break inside the words a test looks for (seen in CI)."""
    return " ".join(stderr.split())


def _wait_healthy(client: httpx.Client, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise AssertionError(f"sluice engine exited: {err}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("sluice engine did not become healthy")


@pytest.fixture
def engine() -> Iterator[httpx.Client]:
    port = _free_port()
    proc = _start(["--port", str(port), "--model", "sim-8b"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            _wait_healthy(client, proc)
            yield client
    finally:
        _stop(proc)


def _events(response: httpx.Response) -> list[Any]:
    """The data of each SSE event, decoded (``[DONE]`` kept as the string)."""
    out: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


PROMPT = list(range(100, 100 + 16 * DEFAULT_BLOCK_TOKENS))  # 16 full blocks


def test_completions_report_usage_and_a_repeated_prefix_is_a_hit(engine: httpx.Client) -> None:
    body = {"model": "sim-8b", "prompt": PROMPT, "max_tokens": 5}
    first = engine.post("/v1/completions", json=body).json()
    assert first["object"] == "text_completion" and first["model"] == "sim-8b"
    assert first["choices"][0]["finish_reason"] == "length" and first["choices"][0]["text"]
    usage = first["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 5)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    again = engine.post("/v1/completions", json=body).json()
    # Every full block is cached; an engine always computes at least one prompt token.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
    assert again["choices"][0]["text"] != first["choices"][0]["text"]  # another request id


def test_streaming_completions_end_with_usage_and_done(engine: httpx.Client) -> None:
    body = {
        "prompt": "a text prompt " * 40,
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with engine.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["prompt_tokens"] == 140  # 560 bytes at 4 bytes a token
    tokens = [e for e in events[:-3] if e["choices"][0]["text"]]
    assert len(tokens) == 7 and all(e["choices"][0]["finish_reason"] is None for e in tokens)
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_chat_streams_deltas_and_renders_one_prefix_per_conversation(
    engine: httpx.Client,
) -> None:
    history = [{"role": "system", "content": "You are terse. " * 30}]
    body = {"messages": [*history, {"role": "user", "content": "hi"}], "max_tokens": 3}
    with engine.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = _events(r)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == "[DONE]"
    # The next turn shares the rendered prefix: the system prompt's blocks are cached.
    turn = {"messages": [*history, {"role": "user", "content": "and more"}], "max_tokens": 2}
    reply = engine.post("/v1/chat/completions", json=turn).json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    # About 470 shared bytes: its 7 full 64-byte blocks (16 tokens each) are hits.
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 7 * DEFAULT_BLOCK_TOKENS


def test_sglang_generate_with_ids_and_streaming(engine: httpx.Client) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
    out = engine.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 4)
    assert meta["finish_reason"] == {"type": "length", "length": 4} and out["text"]
    with engine.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = _events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative


def test_info_endpoints_and_metrics_in_vllm_and_sglang_names(engine: httpx.Client) -> None:
    assert engine.get("/v1/models").json()["data"][0]["id"] == "sim-8b"
    for path in ("/server_info", "/get_server_info"):
        assert engine.get(path).json()["page_size"] == DEFAULT_BLOCK_TOKENS
    for path in ("/model_info", "/get_model_info"):
        assert engine.get(path).json() == {"model_path": "sim-8b", "is_generation": True}
    assert engine.get("/v1/loads").json()["num_running_reqs"] == 0
    engine.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    engine.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    samples = {
        s.name: s.value
        for fam in text_string_to_metric_families(engine.get("/metrics").text)
        for s in fam.samples
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
    ):
        assert name in samples, name
    assert samples["vllm:prompt_tokens_total"] == 2 * len(PROMPT)
    assert samples["vllm:prefix_cache_hits_total"] == len(PROMPT) - 1
    assert samples["sglang:cache_hit_rate"] == pytest.approx((len(PROMPT) - 1) / (2 * len(PROMPT)))
    # vLLM's latency histograms, under both prefixes: one observation per request, and a
    # request's time to its first token is its queue time plus its prefill.
    for ns in ("vllm", "sglang"):
        ttft = samples[f"{ns}:time_to_first_token_seconds_sum"]
        queue = samples[f"{ns}:request_queue_time_seconds_sum"]
        prefill = samples[f"{ns}:request_prefill_time_seconds_sum"]
        assert samples[f"{ns}:time_to_first_token_seconds_count"] == 2
        assert samples[f"{ns}:request_prefill_time_seconds_count"] == 2
        assert ttft > 0 and prefill > 0 and queue >= 0
        assert queue + prefill == pytest.approx(ttft)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, None),
        # These were 500s (a traceback in the log, and the connection closed under the
        # client's next request): a token id past 2**32 in a prompt of a block or more, a lone
        # surrogate, an integer of over 4,300 digits.
        ("/v1/completions", {"prompt": [2**32] * 20, "max_tokens": 2}, "prompt"),
        ("/generate", {"input_ids": [2**40] * 20}, "input_ids"),
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),
        # One choice only (it answered one to n=2); a stream flag that is no boolean (a bare
        # truth test streamed "maybe"); a prompt longer than the KV cache (hashed first).
        ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
        # Sampling as vLLM checks it, stream_options only when streaming, input_ids a list
        # (each was answered 200; "abc" as input_ids was read as text).
        ("/v1/completions", {"prompt": "hi", "temperature": -5}, "temperature"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_p": 7},
            "top_p",
        ),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": "high"}, "presence_penalty"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/generate", {"input_ids": "abc"}, "input_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "stream": "maybe"}, "stream"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"include_usage": [1]}},
            "include_usage",
        ),
        ("/generate", {"text": "hi", "stream": {}}, "stream"),
        ("/v1/completions", {"prompt": [7] * 524_288}, "prompt"),
        ("/generate", {"text": "abcd" * 524_288}, "text"),
    ],
)
def test_bad_requests_get_an_openai_shaped_400(
    engine: httpx.Client, path: str, body: dict[str, Any] | bytes, param: str | None
) -> None:
    r = engine.post(path, content=body) if isinstance(body, bytes) else engine.post(path, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    r = engine.post(path, content=b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    assert engine.get("/health").status_code == 200  # it keeps serving


def test_other_refusals_are_openai_shaped_json_too(engine: httpx.Client) -> None:
    """A model it does not serve is a 404 as vLLM answers it (it was served all the same, so
    an agent's wrong engine_model went unnoticed); a body past the limit a 413 before it is
    read whole (a 300 MB body took 700 MB); an unknown path or method JSON, not text."""
    from sluice.testing.engineserver import MAX_BODY_BYTES

    r = engine.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found" and "nope" in r.text
    r = engine.post(
        "/v1/chat/completions", json={"model": 7, "messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    ok = {"model": "sim-8b", "prompt": "hi", "max_tokens": 2}
    assert engine.post("/v1/completions", json=ok).status_code == 200
    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    r = engine.post("/v1/completions", content=big)
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no content-length: counted as it comes
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"a" * (1 << 20)

    r = engine.post("/v1/completions", content=chunked())
    assert r.status_code == 413, r.text
    for r in (engine.post("/v1/nothing", json={}), engine.get("/v1/completions")):
        assert r.status_code in (404, 405) and r.json()["error"]["message"], r.text
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert engine.post("/v1/chat/completions", json=chat).json()["id"].startswith("chatcmpl-")
    assert engine.get("/health").status_code == 200


def test_metrics_escape_a_model_name_as_prometheus_text_needs() -> None:
    """A model name with a quote or a backslash made the page unparsable (the hand-written
    gauges did not escape their label; the histograms did)."""
    port = _free_port()
    name = 'my "quoted" \\model'
    proc = _start(["--port", str(port), "--model", name])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
            page = c.get("/metrics").text
        labels = {
            s.labels.get("model_name")
            for f in text_string_to_metric_families(page)
            for s in f.samples
            if s.name == "vllm:num_requests_running"
        }
        assert labels == {name}
    finally:
        _stop(proc)


def test_with_a_tokenizer_bad_text_is_a_400_and_a_huge_one_is_refused_before_tokenizing(
    tmp_path: Path,
) -> None:
    """A lone surrogate was the tokenizer library's TypeError, a 500. A text far too long
    for the KV cache was tokenized first, holding every other request (14 s for 30 MB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from sluice.testing.engineserver import MAX_CHARS_PER_TOKEN

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    port = _free_port()
    proc = _start(["--port", str(port), "--tokenizer", str(tmp_path / "tokenizer.json")])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
            for path, body in (
                ("/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}'),
                ("/generate", b'{"text": "a\\ud800"}'),
            ):
                r = c.post(path, content=body)
                assert r.status_code == 400 and "not valid Unicode" in r.text, r.text
            held = c.get("/server_info").json()["max_total_num_tokens"]
            huge = "x" * (held * MAX_CHARS_PER_TOKEN)  # one [UNK] for the tokenizer
            r = c.post("/v1/completions", json={"prompt": huge, "max_tokens": 2})
            assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text
            ok = c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2})
            assert ok.json()["usage"]["prompt_tokens"] == 2
    finally:
        _stop(proc)


def test_stream_flags_read_as_vllm_reads_them(engine: httpx.Client) -> None:
    """``"false"`` and ``0`` do not stream, ``"true"`` does (vLLM's pydantic reading); a bare
    truth test streamed ``"false"``."""
    for flag, streams in (("false", False), (0, False), ("true", True), (None, False)):
        r = engine.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": flag})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream") is streams, flag
    r = engine.post("/generate", json={"text": "hi", "stream": "false"})
    assert r.status_code == 200 and "meta_info" in r.json()
    for n in ("1", 1.0, 1, None):  # n as vLLM reads it
        r = engine.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": n})
        assert r.status_code == 200, n


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100_000}),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 100_000}}),
    ],
)
def test_a_client_that_leaves_a_whole_answer_cancels_its_request(
    engine: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    """As vLLM and SGLang: a non-streaming request whose client left is aborted (it ran on,
    holding its slot and keeping /flush_cache refused, for minutes: seen, by a helper's
    probe; SGLang's /generate, by another's, after the OpenAI endpoints were fixed)."""
    with pytest.raises(httpx.ReadTimeout):
        engine.post(path, json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while engine.get("/v1/loads").json()["num_running_reqs"] != 0:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)


def test_idle_cached_blocks_are_free_in_the_kv_usage_and_aborts_are_no_successes(
    engine: httpx.Client,
) -> None:
    """vLLM and SGLang count an idle engine's cached blocks as free: a warm idle engine read
    as full. request_success counts requests that finished, not those aborted."""

    def figures() -> dict[str, float]:
        page = engine.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}

    for i in range(3):
        engine.post("/v1/completions", json={"prompt": f"{i} " + "word " * 400, "max_tokens": 2})
    before = figures()
    assert before["vllm:kv_cache_usage_perc"] == 0.0 and before["sglang:token_usage"] == 0.0
    body = {"prompt": "other " * 400, "max_tokens": 100_000, "stream": True}
    with engine.stream("POST", "/v1/completions", json=body) as r:
        assert next(r.iter_lines()).startswith("data: ")
        # Read together: under a loaded CPU the request was once seen gone at this point.
        now = figures()
        usage, running = now["vllm:kv_cache_usage_perc"], now["vllm:num_requests_running"]
        assert usage > 0.0 or running == 0.0  # a running request's blocks are used
    deadline = time.monotonic() + 10
    while engine.get("/v1/loads").json()["num_running_reqs"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert figures()["vllm:request_success_total"] == before["vllm:request_success_total"]


def test_a_client_that_leaves_mid_stream_cancels_its_request(engine: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 100_000, "stream": True}
    with engine.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine.get("/v1/loads").json()["num_running_reqs"] == 1
    deadline = time.monotonic() + 10
    while engine.get("/v1/loads").json()["num_running_reqs"] != 0:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)


def test_it_serves_on_a_unix_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    proc = _start(["--uds", path])
    try:
        transport = httpx.HTTPTransport(uds=path)
        with httpx.Client(transport=transport, base_url="http://engine", timeout=30) as c:
            _wait_healthy(c, proc)
            out = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
            assert out["usage"]["completion_tokens"] == 2
    finally:
        _stop(proc)


def test_a_unix_socket_in_use_is_refused_and_a_stale_one_replaced(tmp_path: Path) -> None:
    """A second engine on a live engine's socket took it over (uvicorn removed the file),
    leaving the first unreachable; a regular file there printed the banner, then a
    traceback. A socket file nobody answers on (its server was killed) is replaced, and an
    engine removes its own socket file when it stops."""
    path = str(tmp_path / "engine.sock")
    first = _start(["--uds", path, "--model", "A"])
    try:
        transport = httpx.HTTPTransport(uds=path)
        with httpx.Client(transport=transport, base_url="http://engine", timeout=30) as c:
            _wait_healthy(c, first)
            second = subprocess.run(
                [sys.executable, "-m", "sluice.cli", "engine", "--uds", path, "--model", "B"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert second.returncode == 2 and "already listens" in _said(second.stderr)
            assert c.get("/v1/models").json()["data"][0]["id"] == "A"
        first.kill()  # its socket file stays: stale
        first.wait()
        assert os.path.exists(path)
        third = _start(["--uds", path, "--model", "C"])
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://e") as c:
                _wait_healthy(c, third)
                assert c.get("/v1/models").json()["data"][0]["id"] == "C"
        finally:
            _stop(third)
        assert third.returncode == 0 and not os.path.exists(path)
    finally:
        _stop(first)
    regular = tmp_path / "afile"
    regular.write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "engine", "--uds", str(regular)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "not a socket" in _said(done.stderr), done.stderr
    assert "serving" not in done.stderr and "Traceback" not in done.stderr
    assert regular.read_text() == ""


def test_a_stopping_engine_leaves_its_successors_socket_alone(tmp_path: Path) -> None:
    """A stopping engine's socket file refuses connections for its grace, as a dead one's:
    a successor replaces it, and the first, once it exits, removed the successor's file (its
    own path), leaving it unreachable (a review). The file is open to every user, as
    uvicorn's own was (an agent running as another user could not connect)."""
    path = str(tmp_path / "engine.sock")

    def client() -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://e")

    first = _start(["--uds", path, "--model", "A", "--speed", "1"])
    second = None
    try:
        with client() as c:
            _wait_healthy(c, first)
            assert os.stat(path).st_mode & 0o777 == 0o666
            body = {"prompt": PROMPT, "max_tokens": 100_000, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()  # (kept: a dropped iterator closes the connection)
                assert next(line for line in lines if line.startswith("data:"))
                os.kill(first.pid, signal.SIGTERM)  # it serves this answer 5 s more
                time.sleep(0.5)
                second = _start(["--uds", path, "--model", "B"])
                with client() as b:
                    _wait_healthy(b, second)
                assert first.poll() is None  # still in its grace
        assert first.wait(timeout=20) == 0
        with client() as b:
            assert b.get("/v1/models").json()["data"][0]["id"] == "B"
    finally:
        _stop(first)
        if second is not None:
            _stop(second)


def test_a_socket_whose_server_does_not_answer_is_not_taken_over(tmp_path: Path) -> None:
    """A live server with a full backlog neither takes nor refuses a connection: the look
    at it waited for ever (a review); it is in use."""
    path = str(tmp_path / "busy.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(0)
        waiting = []
        for _ in range(4):  # fill its backlog
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(path)
            waiting.append(c)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "sluice.cli", "engine", "--uds", path],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
        finally:
            for c in waiting:
                c.close()
    assert done.returncode == 2 and "did not answer" in _said(done.stderr), done.stderr


def test_kv_events_on_the_http_port_are_refused() -> None:
    """The HTTP socket was bound but not listening when ZeroMQ bound the KV events: on the
    same port both succeeded, and the engine served ZeroMQ where HTTP was expected."""
    pair = _free_port_pair()
    for http in (pair, pair + 1):  # the events on the HTTP port, or their replay (the next)
        done = subprocess.run(
            [sys.executable, "-m", "sluice.cli", "engine", "--port", str(http),
             "--kv-events-port", str(pair)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2 and "already in use" in _said(done.stderr).lower()
        assert "serving" not in done.stderr


def test_a_second_sigterm_stops_at_once() -> None:
    """An orchestrator's second stop does not wait for the answers still streaming (uvicorn
    forced the exit on a second SIGINT only: a second SIGTERM waited as the first)."""
    port = _free_port()
    proc = _start(["--port", str(port), "--speed", "1"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
            body = {"prompt": PROMPT, "max_tokens": 100_000, "stream": True}  # minutes long
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                os.kill(proc.pid, signal.SIGTERM)
                time.sleep(0.5)
                assert proc.poll() is None  # the first: it waits for the answer
                os.kill(proc.pid, signal.SIGTERM)
                assert proc.wait(timeout=10) == 0
    finally:
        _stop(proc)


def test_sigterm_lets_a_running_answer_finish_and_exits_0() -> None:
    """An orchestrator's stop: the server stops listening, lets the answer it is streaming
    finish, and exits 0 (uvicorn raised the signal again after its shutdown, and the engine
    ended in a KeyboardInterrupt, exit code 130)."""
    port = _free_port()
    proc = _start(["--port", str(port), "--speed", "1"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
            body = {"prompt": PROMPT, "max_tokens": 40, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                os.kill(proc.pid, signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data:")]
            assert rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=20) == 0
    finally:
        _stop(proc)


def test_a_busy_engine_stops_within_its_grace_its_answers_cut_short() -> None:
    """One SIGTERM to an engine running answers of minutes: they may go on for the grace, then
    end (a stream without ``[DONE]``, a whole answer a 503), and the engine exits 0. It ran
    until its last request ended: its stopper waited 10 s and killed it, and the signal a
    killed parent's children get could not stop it at all."""
    from concurrent.futures import ThreadPoolExecutor

    from sluice.testing.engineserver import SHUTDOWN_GRACE_S

    port = _free_port()
    proc = _start(["--port", str(port), "--speed", "1"])
    try:
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c,
            ThreadPoolExecutor(1) as pool,
        ):
            _wait_healthy(c, proc)
            whole = pool.submit(
                c.post, "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100_000}
            )
            body = {"prompt": PROMPT, "max_tokens": 100_000, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                while c.get("/v1/loads").json()["num_running_reqs"] < 2:
                    time.sleep(0.05)
                t0 = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data:")]
                took = time.monotonic() - t0
            assert rest and rest[-1] != "data: [DONE]", rest[-1:]
            answer = whole.result(timeout=30)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["message"] == "the engine is shutting down"
        assert proc.wait(timeout=10) == 0
        assert SHUTDOWN_GRACE_S - 1 < took < SHUTDOWN_GRACE_S + 5, took
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert "Traceback" not in err and "Error" not in err, err
    finally:
        _stop(proc)


def test_the_command_line_refuses_an_unclear_address() -> None:
    both = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "engine", "--port", "1", "--uds", "/tmp/x"],
        capture_output=True,
        timeout=60,
    )
    assert both.returncode == 2 and b"exactly one of --port and --uds" in both.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "engine", "--port", "1", "--profile", "nope"],
        capture_output=True,
        timeout=60,
    )
    assert bad.returncode == 2 and b"unknown engine profile" in bad.stderr


@pytest.mark.parametrize("pages", [None, 1, 4], ids=["vllm", "sglang-page-1", "sglang-page-4"])
def test_kv_events_in_vllm_format_and_their_replay(pages: int | None) -> None:
    """The engine publishes vLLM-format KV events (or SGLang's, an event per page of
    ``--kv-page-tokens``); decoded and re-hashed with Sluice's block hashing they name the
    prompt's blocks; a subscriber that missed them replays them."""
    import zmq

    from sluice.agent.kvevents import (
        REPLAY_END,
        BlockStored,
        KVEventTracker,
        decode_batch,
        decode_message,
        decode_seq,
        encode_seq,
    )
    from sluice.schemas.hashing import block_hashes

    port, kv = _free_port(), _free_port_pair()
    paged = [] if pages is None else ["--kv-page-tokens", str(pages)]
    proc = _start(["--port", str(port), "--kv-events-port", str(kv), *paged])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        sub.connect(f"tcp://127.0.0.1:{kv}")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            _wait_healthy(c, proc)
            _until_subscribed(c, sub)
            c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            while True:  # a warm-up's late batch may still come first
                seq, batch = decode_message(sub.recv_multipart())
                stored = [e for e in batch.events if isinstance(e, BlockStored)]
                if stored and list(stored[0].token_ids)[:1] == PROMPT[:1]:
                    break
        assert stored and stored[0].parent_block_hash is None
        assert list(stored[0].token_ids) == PROMPT[: len(stored[0].token_ids)]
        size = pages or DEFAULT_BLOCK_TOKENS
        assert {e.block_size for e in stored} == {size}
        if pages is not None:  # SGLang's: a page a hash, signed 64-bit, chained page by page
            hashes = [h for e in stored for h in e.block_hashes]
            assert len(hashes) == len(PROMPT) // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS // size
            assert all(isinstance(h, int) and -(2**63) <= h < 2**63 for h in hashes)
            assert len(set(hashes)) == len(hashes)
        tracker = KVEventTracker(DEFAULT_BLOCK_TOKENS)
        assert tracker.apply(seq, batch) is None
        assert tracker.cache_changes()[0] == block_hashes(PROMPT, DEFAULT_BLOCK_TOKENS)

        # As vLLM's and SGLang's replay servers: a request is framed as a REQ socket frames
        # it, (empty, sequence) from a DEALER; a bare sequence gets no answer.
        dealer.connect(f"tcp://127.0.0.1:{kv + 1}")
        dealer.setsockopt(zmq.RCVTIMEO, 500)
        dealer.send(encode_seq(seq))
        with pytest.raises(zmq.Again):
            dealer.recv_multipart()
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.send_multipart([b"", encode_seq(seq)])
        replayed = []
        while True:
            empty, frame_seq, payload = dealer.recv_multipart()
            assert empty == b""
            if decode_seq(frame_seq) == REPLAY_END:
                break
            replayed.append((decode_seq(frame_seq), decode_batch(payload)))
        assert replayed[0] == (seq, batch)
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        _stop(proc)


def _until_subscribed(c: httpx.Client, sub: Any) -> None:
    """A SUB socket misses what is published before it joined: warm-up prompts (sharing no
    block with ``PROMPT``) until their events arrive, then drain what they published."""
    import zmq

    sub.setsockopt(zmq.RCVTIMEO, 200)
    for i in range(100):
        c.post("/v1/completions", json={"prompt": [90_000 + i] * 32, "max_tokens": 1})
        try:
            sub.recv_multipart()
            break
        except zmq.Again:
            continue
    else:
        raise AssertionError("no KV event reached the subscriber")
    while True:
        try:
            sub.recv_multipart()
        except zmq.Again:
            break
    sub.setsockopt(zmq.RCVTIMEO, 10_000)


def test_an_engine_starved_of_its_event_loop_counts_the_clock_it_dropped() -> None:
    """A server whose process cannot keep up does not race to catch up: it drops the lag
    and counts it (``sluice_engine_clock_dropped_seconds_total``), so that a benchmark sees
    when its engines ran slower than their speed-up says."""
    import asyncio

    from sluice.sim.profiles import get_profile
    from sluice.testing.engineserver import SimServer

    async def starve() -> float:
        server = SimServer(get_profile("reference"), model="sim", speed=1.0)
        await server.start()
        try:
            rid, stream = server.submit(server.prompt(list(range(64)), "prompt"), 400)
            await asyncio.sleep(0.05)  # decoding: a step every few ms
            time.sleep(0.4)  # noqa: ASYNC251 (on purpose: the loop is starved, no step runs)
            async for _, fin in server.events(rid, stream):
                if fin is not None:
                    break
        finally:
            await server.stop()
        text = server.metrics_text()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["sluice_engine_clock_dropped_seconds_total"] == server.clock_dropped_s_total
        return server.clock_dropped_s_total

    assert asyncio.run(starve()) >= 0.3  # the 0.4 s it could not step, less the lag it allows


def _completion(engine: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"model": "sim-8b", "prompt": "tell me a story", "max_tokens": 24, **fields}
    response = engine.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def test_greedy_and_seeded_requests_repeat_their_output_and_others_do_not(
    engine: httpx.Client,
) -> None:
    def text(**fields: Any) -> str:
        return str(_completion(engine, **fields)["choices"][0]["text"])

    greedy = text(temperature=0)
    assert text(temperature=0, seed=5) == greedy  # greedy: the prompt alone decides
    assert text(temperature=0, prompt="another story") != greedy
    assert text(seed=5) == text(seed=5, temperature=0.7) != text(seed=6)
    assert text() != text()  # sampled (vLLM's default temperature, 1): two samples


def test_a_stop_string_ends_the_output_before_it(engine: httpx.Client) -> None:
    full = _completion(engine, temperature=0)["choices"][0]["text"]
    words = full.split(" ")
    stop = " " + words[6]  # the sixth word (the text starts with a space)
    want = full[: full.find(stop)]
    answer = _completion(engine, temperature=0, stop=[" no-such-word", stop])
    assert answer["choices"][0]["text"] == want and answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == len(want.split(" ")) - 1 + 1  # + the stop's
    # Streamed, with a stop of two words: the word that might begin it is held back (not
    # streamed before the next shows whether the stop string came), and not lost when not.
    body = {"model": "sim-8b", "prompt": "tell me a story", "max_tokens": 24, "temperature": 0}
    two = " " + " ".join(words[6:8])
    false_start = " " + words[6] + " no-such-word"
    with engine.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stop": [false_start, two]}
    ) as r:
        events = _events(r)
    chunks = [e for e in events if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[: full.find(two)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"
    # A stop string that never comes: the whole output, finished by its length.
    answer = _completion(engine, temperature=0, stop="zzz")
    assert answer["choices"][0]["text"] == full
    assert answer["choices"][0]["finish_reason"] == "length"
    # SGLang's /generate: in sampling_params, and its finish reason names the match.
    got = engine.post(
        "/generate",
        json={"text": "tell me a story", "sampling_params": {"max_new_tokens": 24,
              "temperature": 0, "stop": stop}},
    ).json()  # fmt: skip
    assert got["text"] == want
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_a_stop_token_ends_the_output_at_it(engine: httpx.Client) -> None:
    from sluice.sim.tokens import output_token
    from sluice.testing.engineserver import sample_key

    full = _completion(engine, prompt=PROMPT, temperature=0)["choices"][0]["text"]
    # The engine's own key for this greedy prompt: which pseudo token comes fourth.
    key = sample_key(PROMPT, 0.0, None)
    assert key is not None
    fourth = output_token(key, 3)
    answer = _completion(engine, prompt=PROMPT, temperature=0, stop_token_ids=[fourth])
    words = full.split(" ")[1:]
    first = next(i for i in range(24) if output_token(key, i) == fourth)
    assert answer["choices"][0]["text"] == "".join(" " + w for w in words[:first])
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == first + 1


def test_what_the_simulated_engine_cannot_produce_is_a_400(engine: httpx.Client) -> None:
    for field, value in (("prompt_logprobs", 2), ("echo", True), ("stop", [""]), ("stop", 5),
                         ("stop_token_ids", ["a"]), ("seed", "x"), ("logprobs", 21),
                         ("logprobs", "x")):  # fmt: skip
        response = engine.post(
            "/v1/completions", json={"model": "sim-8b", "prompt": "x", field: value}
        )
        assert response.status_code == 400, (field, value)
        assert response.json()["error"]["param"] == field


def test_a_chat_template_renders_chats_as_vllms_chat_template_flag_does(tmp_path: Path) -> None:
    """``--chat-template``: a chat is the completion of its rendering by the model's template
    (greedy: the same output, the same prompt tokens), not of Sluice's neutral one."""
    from sluice.common.chattemplate import ChatTemplate

    template = tmp_path / "chatml.jinja"
    template.write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "tell me a story"}]
    rendered = ChatTemplate.from_file(template).render(messages)
    port = _free_port()
    proc = _start(["--port", str(port), "--model", "sim-8b", "--chat-template", str(template)])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            _wait_healthy(client, proc)
            body = {"model": "sim-8b", "max_tokens": 8, "temperature": 0}
            chat = client.post("/v1/chat/completions", json={**body, "messages": messages})
            plain = client.post("/v1/completions", json={**body, "prompt": rendered})
            neutral = client.post("/v1/completions", json={**body, "prompt": render_chat(messages)})
    finally:
        _stop(proc)
    said = chat.json()["choices"][0]["message"]["content"]
    assert said == plain.json()["choices"][0]["text"] != neutral.json()["choices"][0]["text"]
    assert chat.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    bad = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "engine", "--port", str(port), "--chat-template",
         str(tmp_path / "missing.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "cannot read the chat template" in _said(bad.stderr)


def test_min_tokens_and_include_stop_str_in_output_as_vllm_has_them(engine: httpx.Client) -> None:
    full = _completion(engine, temperature=0)["choices"][0]["text"]
    stop = " " + full.split(" ")[3]
    cut = full.find(stop)
    kept = _completion(engine, temperature=0, stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == full[: cut + len(stop)]
    # No stop before min_tokens: here never, so the whole output, finished by its length.
    late = _completion(engine, temperature=0, stop=stop, min_tokens=24, ignore_eos=True)
    assert (late["choices"][0]["text"], late["choices"][0]["finish_reason"]) == (full, "length")
    for field, value in (("min_tokens", -1), ("top_k", -2), ("repetition_penalty", 0),
                         ("min_p", 2), ("ignore_eos", "maybe")):  # fmt: skip
        response = engine.post(
            "/v1/completions", json={"model": "sim-8b", "prompt": "x", field: value}
        )
        assert response.status_code == 400, (field, value)


async def test_a_stop_read_late_still_counts_the_tokens_to_the_stop() -> None:
    """The engine steps on while its stream is read; a stream read after the request ran to
    its end sees the stop in the tokens it reads, and the finish counts the tokens to the
    stop, not all the engine made (as a real engine, which stops there)."""
    from sluice.sim.profiles import get_profile
    from sluice.testing.engineserver import SimServer, _sample

    s = SimServer(get_profile("reference"), model="sim", speed=50.0)
    await s.start()
    try:
        p = s.prompt("tell me a story", "prompt")
        rid, stream = s.submit(p, 16, _sample({"temperature": 0}, p, "completion"))
        full, _ = await s.collect(rid, stream)
        stop = " " + full.split(" ")[3]  # the third token's word
        for late in (False, True):
            rid, stream = s.submit(
                p, 16, _sample({"temperature": 0, "stop": stop}, p, "completion")
            )
            if late:
                await asyncio.sleep(1.0)  # 16 tokens at x50 take well under a second
            text, fin = await s.collect(rid, stream)
            assert (text, fin.output_tokens) == (full[: full.find(stop)], 3), late
    finally:
        await s.stop()


def test_logprobs_come_as_vllm_shapes_them_and_what_it_refuses_is_a_400(
    engine: httpx.Client,
) -> None:
    """A completion's ``logprobs`` (a count) in the legacy shape, a chat's ``logprobs`` with
    ``top_logprobs`` in the chat shape: one entry per output token, their texts the output's,
    the same for the same greedy request; ``top_logprobs`` without ``logprobs``, logprobs with
    stops (not simulated) and SGLang's ``return_logprob`` are a 400."""
    body = {"model": "sim-8b", "prompt": "x y z", "max_tokens": 6, "temperature": 0}
    whole = engine.post("/v1/completions", json={**body, "logprobs": 2}).json()
    lp = whole["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == whole["choices"][0]["text"] and len(lp["tokens"]) == 6
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(6)]
    # The two most likely and the token itself, as vLLM gives them (2 or 3 entries).
    assert all(len(t) in (2, 3) for t in lp["top_logprobs"]) and max(lp["token_logprobs"]) <= 0
    assert all(t[tok] == v for t, tok, v in zip(lp["top_logprobs"], lp["tokens"],
                                                 lp["token_logprobs"], strict=True))  # fmt: skip
    again = engine.post("/v1/completions", json={**body, "logprobs": 2}).json()
    assert again["choices"][0]["logprobs"] == lp
    messages = [{"role": "user", "content": "x y z"}]
    chat = {"model": "sim-8b", "messages": messages, "max_tokens": 6, "temperature": 0}
    answer = engine.post(
        "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 3}
    ).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == answer["choices"][0]["message"]["content"]
    assert all(len(t["top_logprobs"]) == 3 and t["bytes"] == list(t["token"].encode())
               for t in content)  # fmt: skip
    plain = engine.post("/v1/chat/completions", json=chat).json()
    assert plain["choices"][0]["logprobs"] is None
    for path, extra, param in (
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 1, "stop": "z"}, "stop"),
        ("/generate", {"return_logprob": True}, "return_logprob"),
    ):
        base = chat if "chat" in path else body
        if path == "/generate":
            base = {"text": "x y z", "sampling_params": {"max_new_tokens": 4}}
        response = engine.post(path, json={**base, **extra})
        assert response.status_code == 400, (path, extra)
        assert response.json()["error"]["param"] == param


_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 18},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "kind": {"enum": ["a", "b"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "kind", "ok"],
}


def test_a_response_format_makes_json_of_its_schema_and_ends_there(engine: httpx.Client) -> None:
    """``response_format`` as vLLM takes it: a ``json_schema``'s output is JSON valid against
    the schema, a ``json_object``'s a JSON object, the answer ending with it (``stop``, its
    tokens counted) or cut at ``max_tokens`` (``length``); the same for the same greedy
    request; what the simulated engine cannot follow, or a format that is not valid, a 400."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": _PERSON}}
    body = {"model": "sim-8b", "prompt": "x y z", "max_tokens": 200, "temperature": 0}
    whole = engine.post("/v1/completions", json={**body, "response_format": fmt}).json()
    text = whole["choices"][0]["text"]
    jsonschema.validate(json.loads(text), _PERSON)
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == -(-len(text) // 4)  # (4 characters a token)
    again = engine.post("/v1/completions", json={**body, "response_format": fmt}).json()
    assert again["choices"][0]["text"] == text
    streamed = "".join(
        json.loads(line[6:])["choices"][0].get("text", "")
        for line in engine.post(
            "/v1/completions", json={**body, "response_format": fmt, "stream": True}
        ).text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )
    assert streamed == text
    messages = [{"role": "user", "content": "x"}]
    chat = engine.post(
        "/v1/chat/completions",
        json={"model": "sim-8b", "messages": messages, "response_format": {"type": "json_object"}},
    ).json()
    assert isinstance(json.loads(chat["choices"][0]["message"]["content"]), dict)
    cut = engine.post(
        "/v1/completions", json={**body, "max_tokens": 3, "response_format": fmt}
    ).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["text"] == text[:12]
    for bad in (
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/a"}}},
        {"type": "xml"},
    ):
        response = engine.post("/v1/completions", json={**body, "response_format": bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == "response_format"
    response = engine.post("/v1/completions", json={**body, "response_format": fmt, "logprobs": 1})
    assert response.status_code == 400


_SCHEMAS = [
    _PERSON,
    {"type": "integer", "maximum": -3},
    {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5},
    {"type": "integer", "minimum": 2.5},
    {"type": "number", "exclusiveMaximum": 0},
    {"type": "array", "items": {"type": "integer"}, "minItems": 20},
    {"type": "array", "maxItems": 0},
    {"type": "string", "minLength": 50, "maxLength": 60},
    {"type": ["null", "string"]},
    {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
    # pydantic's model_json_schema() of a nested model: local references.
    {
        "type": "object",
        "properties": {"owner": {"$ref": "#/$defs/Person"}, "n": {"type": "integer"}},
        "required": ["owner", "n"],
        "$defs": {"Person": _PERSON},
    },
]


@pytest.mark.parametrize("schema", _SCHEMAS, ids=range(len(_SCHEMAS)))
def test_the_simulated_json_is_valid_against_its_schema(schema: dict[str, Any]) -> None:
    import itertools

    import jsonschema

    from sluice.sim.tokens import detokenize, output_token
    from sluice.testing.engineserver import _instance_of

    words = (detokenize([output_token("k", i)]) for i in itertools.count())
    jsonschema.validate(_instance_of(schema, words), schema)


@pytest.mark.parametrize(
    "schema",
    [{"type": "array", "minItems": "x"}, {"$ref": "#/$defs/Nope"}, {"$ref": "http://x"}, []],
)
def test_a_schema_the_simulated_engine_cannot_follow_is_a_400_not_a_500(schema: Any) -> None:
    import itertools

    from sluice.testing.engineserver import BadRequest, _instance_of

    with pytest.raises(BadRequest) as info:
        _instance_of(schema, itertools.repeat(" w"))
    assert info.value.param == "response_format"

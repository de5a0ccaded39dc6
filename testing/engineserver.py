"""``sluice engine``: the simulated engine as a server, speaking the real engines' HTTP protocols.

The same cost model and KV cache as the in-process engine (:class:`sluice.sim.engine.SimEngine`),
stepped in real time (scaled by ``speed``) in its own process, behind the endpoints vLLM and
SGLang serve:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI shapes; streaming as SSE with
  ``data: [DONE]``, a final usage chunk when ``stream_options.include_usage`` is set;
  ``usage.prompt_tokens_details.cached_tokens`` is the engine's prefix-cache hit);
- SGLang's ``POST /generate`` (``text`` or ``input_ids``, ``sampling_params.max_new_tokens``,
  ``stream``; ``meta_info`` with ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``);
- SGLang's ``POST /flush_cache`` (drops the prefix cache while idle, 400 while requests run);
- ``GET /health``, ``GET /v1/models``, ``GET /server_info`` and ``/get_server_info``,
  ``GET /model_info`` and ``/get_model_info``, ``GET /v1/loads``;
- ``GET /metrics`` in the Prometheus text format, with vLLM's names (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:gpu_cache_usage_perc``,
  ``vllm:prompt_tokens_total``, ``vllm:prefix_cache_hits_total``, ...) and SGLang's
  (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
  ``sglang:cache_hit_rate``), and vLLM's latency histograms under both prefixes
  (``time_to_first_token_seconds``, ``request_queue_time_seconds``,
  ``request_prefill_time_seconds``; wall seconds, measured in the server).

A prompt given as token ids is hashed in blocks of the profile's size with Sluice's own block
hashing; a text prompt with the tokenizer-free fallback (4 bytes a token). Output tokens are
the deterministic pseudo tokens of :mod:`sluice.sim.tokens`. A client that disconnects
mid-stream cancels its request in the engine, as vLLM and SGLang do. Bad requests get a 400
with an OpenAI-shaped error body. Nothing here is a stub: every response's timing is the cost
model's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import itertools
import json
import logging
import math
import os
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import xxhash
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from sluice.agent.engine import EngineError, Failed, Finished, TokensOut
from sluice.agent.errors import KVEventError
from sluice.agent.kvevents import REPLAY_END, decode_seq, encode_seq, replay_endpoint
from sluice.client.oaiformat import chat_logprobs, completion_logprobs
from sluice.common.chat import ChatError
from sluice.common.chattemplate import ChatOptions, ChatTemplate, chat_prompt
from sluice.common.errors import ConfigError, internal_error
from sluice.common.tokenizer import PromptTokenizer
from sluice.schemas.hashing import block_hashes, estimate_text_tokens, text_block_hashes
from sluice.schemas.models import MAX_LOGPROBS, response_format
from sluice.sim.engine import SimEngine
from sluice.sim.profiles import EngineProfile
from sluice.sim.tokens import detokenize, logprobs, output_token
from sluice.testing.processes import DIE_WITH_PARENT, SLUICE, stop_processes

_MAX_LAG_S = 0.05
"""A server that fell further behind its clock than this (a busy machine) does not race to
catch up: it drops the lag."""
SHUTDOWN_GRACE_S = 5
"""How long the requests running when the server is told to stop (SIGTERM, SIGINT) may go on
before they are ended: less than :func:`~sluice.testing.processes.stop_processes`' wait, so
that a busy engine stops before its stopper kills it."""
MAX_CHARS_PER_TOKEN = 8
"""A text prompt is taken as having at least one token per this many characters, before it
is tokenized (real tokenizers average about 4 on prose): one too long for the KV cache by
that count is refused without the seconds its tokenizing would hold the server."""
MAX_BODY_BYTES = 32 * 1024 * 1024
"""The largest request body read (a 413 beyond): a prompt the largest profile's KV cache
holds, as token ids, is about 10 MB; a 300 MB body took 700 MB of memory before its 400."""
MAX_TOKENS_DEFAULT = 16
"""Output tokens of a request that names none (OpenAI's completions default)."""
LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5,
    2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Bucket bounds of the engine's latency histograms: finer than vLLM's own between 0.1 and
5 s, where a sped-up fleet's first tokens fall, so that a percentile read from them is close."""
LATENCIES = (
    ("time_to_first_token_seconds", "Wall seconds from a request's arrival to its first token"),
    ("request_queue_time_seconds", "Wall seconds a request waited before its prefill began"),
    ("request_prefill_time_seconds", "Wall seconds of a request's prefill"),
)
"""The latency histograms, each under both ``vllm:`` and ``sglang:`` (the names vLLM uses)."""


class BadRequest(Exception):
    """A request the server answers with 400 (its message says what is wrong)."""

    status = 400
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TooLarge(BadRequest):
    """A request body over :data:`MAX_BODY_BYTES`."""

    status = 413


class UnknownModel(BadRequest):
    """A model the server does not serve, named as OpenAI's API answers it."""

    status = 404
    code = "model_not_found"


@dataclass(frozen=True)
class Prompt:
    tokens: int
    hashes: tuple[int, ...]
    token_ids: tuple[int, ...] = ()
    """The prompt's token ids: given, or for a text prompt one pseudo id per 4 bytes (what the
    KV events of its blocks carry)."""


@dataclass(frozen=True)
class Sample:
    """What a request's sampling fields change in the simulated engine's pseudo output.
    ``key`` picks its tokens: a greedy request's (``temperature`` 0) depend on its prompt
    only, a seeded one's on its prompt and ``seed``, any other's (None) on the request, so
    that two identical prompts get two samples, as from a real engine. ``stop`` strings and
    ``stop_ids`` (token ids) end the output early, as vLLM ends it: the stop string is not in
    the text, and a finish of theirs is ``stop`` rather than ``length``."""

    key: str | None = None
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    """Stops are not looked for before this many tokens (vLLM's ``min_tokens``)."""
    include_stop: bool = False
    """The stop string stays in the text (vLLM's ``include_stop_str_in_output``)."""
    top: int = -1
    """Logprobs asked for, with this many alternatives per token (-1: none)."""
    script: tuple[str, ...] | None = None
    """Structured output asked for (``response_format``): the pieces of the JSON to send, one
    per token, the request finished after the last (None: free text)."""


@dataclass
class _Stream:
    queue: asyncio.Queue[TokensOut | Finished | Failed]
    hashes: tuple[int, ...] = ()
    produced: int = 0
    sample: Sample = Sample()
    text: str = ""
    """The output so far, kept only while a stop string may end it."""
    sent: int = 0
    """How much of :attr:`text` was streamed: the tail that may begin a stop string waits."""
    stopped: bool = False
    """A stop string or token ended it (its finish reason is ``stop``)."""
    matched: str | int | None = None
    """The stop string or token id that ended it."""
    stopped_at: int = 0
    """Its tokens at the stop: what its finish counts, though the engine ran on meanwhile."""
    tokens: list[int] = field(default_factory=list)
    """Its output tokens so far, kept only when it asked for logprobs."""
    submitted_s: float = 0.0
    """``time.monotonic()`` when the request reached the engine."""
    ttft_s: float | None = None
    """Wall seconds from its arrival to its first token, once that came."""


class KVEventPublisher:
    """vLLM's KV event sockets: PUB on ``endpoint`` (``tcp://host:port`` or ``ipc:///path``;
    ``(topic, sequence, payload)`` messages, the payload a msgpack ``[ts, events, dp_rank]``
    with array-like tagged events) and the replay ROUTER beside it
    (:func:`~sluice.agent.kvevents.replay_endpoint`; a request of one 8-byte big-endian
    sequence gets every buffered ``(sequence, payload)`` from it, then sequence -1)."""

    TOPIC = b"kv-events"

    def __init__(self, endpoint: str, buffer: int = 10_000) -> None:
        import zmq
        import zmq.asyncio

        self._zmq = zmq
        # An endpoint it cannot bind leaves nothing open: a context left to the garbage
        # collector with a socket in it hung another test's teardown in its destructor.
        with contextlib.ExitStack() as undo:
            self._sync = zmq.Context()
            undo.callback(self._sync.term)
            self._async = zmq.asyncio.Context()
            undo.callback(self._async.term)
            self.pub = self._sync.socket(zmq.PUB)
            undo.callback(self.pub.close, linger=0)
            self.pub.bind(endpoint)
            self.router = self._async.socket(zmq.ROUTER)
            undo.callback(self.router.close, linger=0)
            self.router.bind(replay_endpoint(endpoint))
            undo.pop_all()
        self.seq = 0
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._task: asyncio.Task[None] | None = None

    def publish(self, events: list[Any]) -> None:
        payload = msgpack.packb([time.time(), events, 0])
        seq, self.seq = self.seq, self.seq + 1
        self.ring.append((seq, payload))
        # PUB never blocks: a subscriber too slow for its high-water mark misses batches and
        # recovers them through the replay socket.
        self.pub.send_multipart([self.TOPIC, encode_seq(seq), payload], flags=self._zmq.NOBLOCK)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._replay(), name="kv-replay")

    async def _replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            # As vLLM's and SGLang's: a request is (identity, empty, sequence), as a REQ
            # socket frames it; anything else is not answered.
            if len(frames) != 3 or frames[1] != b"":
                log.warning("invalid KV event replay request of %d frames", len(frames))
                continue
            client, _, request = frames
            try:
                start = decode_seq(request)
            except KVEventError:
                continue  # not a replay request: nothing to answer
            for seq, payload in list(self.ring):
                if seq >= start:
                    await self.router.send_multipart([client, b"", encode_seq(seq), payload])
            await self.router.send_multipart([client, b"", encode_seq(REPLAY_END), b""])

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self._sync.term()
        self._async.term()


def check_page_tokens(profile: EngineProfile, kv_page_tokens: int | None) -> None:
    """A ``ValueError`` unless the page size divides the profile's blocks (or is None)."""
    if kv_page_tokens is not None and (kv_page_tokens < 1 or profile.block_tokens % kv_page_tokens):
        raise ValueError(
            f"the KV page size divides the profile's {profile.block_tokens}-token blocks "
            f"(1, 2, 4, ...), not {kv_page_tokens}"
        )


def _page_hash(block_hash: int, page: int) -> int:
    """The engine's hash of page ``page`` of a block: signed 64 bits, as SGLang's are."""
    return xxhash.xxh64_intdigest(_PAGE.pack(block_hash, page)) - (1 << 63)


_PAGE = struct.Struct("<QI")


class SimServer:
    """One simulated engine stepped in real time, and the requests streaming from it."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        model: str,
        speed: float = 1.0,
        kv_events: KVEventPublisher | None = None,
        tokenizer: PromptTokenizer | None = None,
        kv_page_tokens: int | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        check_page_tokens(profile, kv_page_tokens)
        self.profile, self.model, self.speed = profile, model, speed
        self.kv_page_tokens = kv_page_tokens
        """Publish KV events as SGLang does, a hash per page of this many tokens (SGLang's
        ``--page-size``, 1 by default), a chain of pages an event; None: vLLM's, a hash per
        block."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        """How a chat becomes its prompt (as vLLM's ``--chat-template``); None: Sluice's
        neutral template."""
        self.kv_events = kv_events
        self._pending_events: list[Any] = []
        # Per prompt block hash: the hash before it and its token ids (for BlockStored).
        self._block_meta: dict[int, tuple[int | None, list[int]]] = {}
        self.engine = SimEngine(profile, kv_listener=self._on_kv if kv_events else None)
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self.closing = False
        """Set by :meth:`stop_taking` (and :meth:`abort_all`): the server is stopping and takes
        no more requests."""
        self.requests_finished_total = 0
        """Requests that ran to their end (not those aborted: vLLM's request_success)."""
        self.generation_tokens_total = 0
        self.clock_dropped_s_total = 0.0
        """Wall seconds the stepping loop fell behind its clock and dropped (a starved
        process): the engine ran that much slower than ``speed`` says."""
        self.started_unix_s = time.time()
        self._registry = CollectorRegistry(auto_describe=True)
        self._latency = {
            name: [
                Histogram(
                    f"{ns}:{name}", doc, ["model_name"], registry=self._registry,
                    buckets=LATENCY_BUCKETS_S,
                ).labels(model)
                for ns in ("vllm", "sglang")
            ]
            for name, doc in LATENCIES
        }  # fmt: skip

    def _observe(self, name: str, value_s: float) -> None:
        for h in self._latency[name]:
            h.observe(max(0.0, value_s))

    # ---------------------------------------------------------------------------- engine

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-engine")
        if self.kv_events is not None:
            await self.kv_events.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.kv_events is not None:
            await self.kv_events.stop()

    def _on_kv(self, kind: str, hashes: list[int]) -> None:
        # vLLM's layout: a hash per block; with kv_page_tokens, SGLang's: a hash per page, a
        # chain of pages in one event (its recorder coalesces them), removals a list of pages.
        engine = self._engine_hashes
        if kind == "removed":
            for h in hashes:
                self._block_meta.pop(h, None)
            gone = [e for h in hashes for e in engine(h)]
            self._pending_events.append(["BlockRemoved", gone, "GPU"])
            return
        bt = self.profile.block_tokens
        parent = self._block_meta.get(hashes[0], (None, []))[0]
        tokens: list[int] = []
        for h in hashes:
            tokens += self._block_meta.get(h, (None, [0] * bt))[1]
        stored = [e for h in hashes for e in engine(h)]
        before = None if parent is None else engine(parent)[-1]
        size = self.kv_page_tokens or bt
        self._pending_events.append(["BlockStored", stored, before, tokens, size, None, "GPU"])

    def _engine_hashes(self, block_hash: int) -> list[int]:
        """The engine's hashes of a block: its own (vLLM's), or its pages' (SGLang's)."""
        if self.kv_page_tokens is None:
            return [block_hash]
        pages = self.profile.block_tokens // self.kv_page_tokens
        return [_page_hash(block_hash, j) for j in range(pages)]

    def _flush_kv(self) -> None:
        if self.kv_events is not None and self._pending_events:
            events, self._pending_events = self._pending_events, []
            self.kv_events.publish(events)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            loop = asyncio.get_running_loop()
            due = loop.time()
            while self.engine.has_work:
                step = self.engine.step()
                self._flush_kv()
                # Steps are paced to a clock, not slept one after another: the time spent
                # streaming tokens between two steps does not lengthen every step. An engine
                # that cannot admit its waiting request (its KV cache is full of running ones)
                # returns an empty step: yield instead of spinning.
                floor = loop.time() - _MAX_LAG_S
                if due < floor:
                    self.clock_dropped_s_total += floor - due
                    due = floor
                due += step.duration_s / self.speed if step.duration_s else 0.001
                await asyncio.sleep(max(0.0, due - loop.time()))
                for ev in step.events:
                    s = self._streams.get(ev.request_id)
                    if s is not None:
                        if s.ttft_s is None and isinstance(ev, TokensOut):
                            s.ttft_s = time.monotonic() - s.submitted_s
                            self._observe("time_to_first_token_seconds", s.ttft_s)
                        elif isinstance(ev, Finished):
                            self._observe_finish(s, ev)
                        s.queue.put_nowait(ev)

    def _observe_finish(self, s: _Stream, fin: Finished) -> None:
        if s.ttft_s is None:
            return
        # Its prefill ran on the engine's clock, `speed` times the wall's. The stepping loop
        # may catch up on a lag (it sleeps less than a step lasts), so the wall can see less
        # than that: a prefill never outlasts the time to the first token, and queue +
        # prefill = TTFT.
        prefill = min(fin.prefill_s / self.speed, s.ttft_s)
        self._observe("request_prefill_time_seconds", prefill)
        self._observe("request_queue_time_seconds", s.ttft_s - prefill)

    def stop_taking(self, grace_s: float) -> None:
        """The server is stopping: no new request is taken (a 503), those running may finish
        for ``grace_s``, then :meth:`abort_all` ends the rest (a busy engine stopped only when
        its last request had: with a request of minutes, never within its stopper's wait)."""
        self.closing = True
        asyncio.get_running_loop().call_later(grace_s, self.abort_all)

    def abort_all(self) -> None:
        """Every request ends now, and no other is taken (an :class:`EngineError` each), as
        an engine shutting down drops what it runs. Their handlers answer at once: a stream
        ends without ``[DONE]``, a whole answer is a 503."""
        self.closing = True
        for rid, stream in self._streams.items():
            stream.queue.put_nowait(Failed(rid, "the engine is shutting down"))

    def submit(
        self, prompt: Prompt, max_tokens: int, sample: Sample = Sample()
    ) -> tuple[str, _Stream]:
        """Queue a request in the engine; its events arrive on the returned stream."""
        if self.closing:
            raise EngineError("the engine is shutting down")
        rid = f"sim-{next(self._ids)}"
        try:
            self.engine.add(rid, prompt.tokens, max_tokens, prompt.hashes, time.monotonic())
        except EngineError as exc:
            raise BadRequest(str(exc)) from exc
        if self.kv_events is not None:
            bt = self.profile.block_tokens
            for i, h in enumerate(prompt.hashes):
                if h not in self._block_meta:
                    tokens = list(prompt.token_ids[i * bt : (i + 1) * bt])
                    self._block_meta[h] = (prompt.hashes[i - 1] if i else None, tokens)
        stream = _Stream(
            asyncio.Queue(), prompt.hashes, submitted_s=time.monotonic(), sample=sample
        )
        self._streams[rid] = stream
        self._wake.set()
        return rid, stream

    def release(self, rid: str) -> None:
        """The request ended or its client left: drop it (cancelled in the engine if it still
        runs, as a real engine aborts a request whose connection closed)."""
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self.engine.cancel(rid)
            for h in stream.hashes:  # blocks that never entered the cache need no metadata
                if h not in self.engine.cache:
                    self._block_meta.pop(h, None)

    async def events(self, rid: str, stream: _Stream) -> AsyncIterator[tuple[str, Finished | None]]:
        """(new text, the finish or None) as the engine produces tokens."""
        try:
            while True:
                ev = await stream.queue.get()
                if isinstance(ev, Failed):
                    raise EngineError(ev.error)  # (only a shutdown fails one)
                if isinstance(ev, TokensOut):
                    if stream.stopped:  # (tokens of the step that finished it anyway)
                        continue
                    key = stream.sample.key or rid
                    tokens = self.engine.output_tokens(key, stream.produced, ev.count)
                    stream.produced += ev.count
                    self.generation_tokens_total += ev.count
                    piece, fin = self._next_piece(rid, stream, tokens)
                    if piece:
                        yield piece, None
                    if fin is not None:
                        self.requests_finished_total += 1
                        yield "", fin
                        return
                else:
                    if stream.sent < len(stream.text):  # held back for a stop string
                        yield stream.text[stream.sent :], None
                    if stream.stopped:  # (it finished before its stop was seen)
                        ev = dataclasses.replace(ev, output_tokens=stream.stopped_at)
                    self.requests_finished_total += 1
                    yield "", ev
                    return
        finally:
            self.release(rid)

    def _next_piece(
        self, rid: str, stream: _Stream, tokens: list[int]
    ) -> tuple[str, Finished | None]:
        """The text of the request's new ``tokens`` that may go out now, and its finish if it
        ended here (a structured output's last piece, a stop)."""
        sample = stream.sample
        if sample.script is not None:
            return self._scripted(rid, stream)
        if sample.stop or sample.stop_ids:
            return self._until_stop(rid, stream, tokens)
        if sample.top >= 0:
            stream.tokens.extend(tokens)
        return self.engine.detokenize(tokens), None

    def _scripted(self, rid: str, stream: _Stream) -> tuple[str, Finished | None]:
        """The pieces of a structured output up to the tokens made so far, and the finish
        once the last is out (it ends there, as an engine ends a JSON its grammar closed)."""
        script = stream.sample.script
        assert script is not None
        start = stream.sent
        stream.sent = min(stream.produced, len(script))
        piece = "".join(script[start : stream.sent])
        if stream.sent < len(script):
            return piece, None
        stream.stopped, stream.stopped_at = True, len(script)
        fin = self.engine.finish_early(rid)
        if fin is None:  # it finished at this very step: its finish is queued
            return piece, None
        fin = dataclasses.replace(fin, output_tokens=len(script))
        self._observe_finish(stream, fin)
        return piece, fin

    def _until_stop(
        self, rid: str, stream: _Stream, tokens: list[int]
    ) -> tuple[str, Finished | None]:
        """The text of ``tokens`` that may be streamed, and the finish when a stop string or
        token ended the request here (it is then finished early in the engine)."""
        sample = stream.sample
        before = stream.produced - len(tokens)  # (tokens made before these)
        cut = next(
            (
                i
                for i, t in enumerate(tokens)
                if t in sample.stop_ids and before + i + 1 > sample.min_tokens
            ),
            None,
        )
        start = len(stream.text)
        stream.text += self.engine.detokenize(tokens if cut is None else tokens[:cut])
        longest = max(map(len, sample.stop), default=1)
        after = max(0, start - longest + 1)  # a stop string may straddle two pieces
        found: list[tuple[int, str]] = []
        if stream.produced > sample.min_tokens:
            found = [(i, x) for x in sample.stop if (i := stream.text.find(x, after)) >= 0]
        if found:
            end, stream.matched = min(found)  # the earliest match (of two there, the first)
            if sample.include_stop:
                end += len(stream.matched)
        elif cut is not None:
            end = len(stream.text)
            stream.matched = tokens[cut]
        else:
            end = max(stream.sent, len(stream.text) - longest + 1)
            piece, stream.sent = stream.text[stream.sent : end], end
            return piece, None
        piece, stream.sent = stream.text[stream.sent : end], end
        stream.text = stream.text[:end]
        stream.stopped = True
        # Its output is what was streamed to the stop (the engine may be steps ahead of this
        # stream), without the tokens after a stop token, never generated in a real engine.
        stream.stopped_at = stream.produced - (0 if cut is None else len(tokens) - cut - 1)
        fin = self.engine.finish_early(rid)
        if fin is None:  # it finished before this stream saw its stop: its finish is queued
            return piece, None
        fin = dataclasses.replace(fin, output_tokens=stream.stopped_at)
        self._observe_finish(stream, fin)
        return piece, fin

    async def collect(self, rid: str, stream: _Stream) -> tuple[str, Finished]:
        """The whole output of a request, and its finish."""
        parts: list[str] = []
        async for piece, fin in self.events(rid, stream):
            if fin is not None:
                return "".join(parts), fin
            parts.append(piece)
        raise EngineError(f"request {rid} ended without finishing")  # pragma: no cover

    # ---------------------------------------------------------------------------- prompts

    def prompt(self, value: Any, param: str) -> Prompt:
        """A text prompt or a list of token ids, hashed as Sluice hashes prompt blocks. One
        longer than the engine's KV cache is a 400 before any hashing (a 64 MB prompt held
        the event loop, every other request with it, while it was hashed)."""
        bt = self.profile.block_tokens
        if isinstance(value, str):
            if not value:
                raise BadRequest(f"{param} must not be empty", param)
            if self.tokenizer is not None:  # as a real engine: its tokenizer's ids
                # (Encoding holds the event loop, and the GIL in any thread: a 30 MB text
                # held every other request for 14 s: taken as a token per 8 characters at
                # least, one longer than that is refused untokenized.)
                self._fits(-(-len(value) // MAX_CHARS_PER_TOKEN), param, "at least ")
                ids = tuple(self.tokenizer.encode(value))
                if not ids:
                    raise BadRequest(f"{param} has no tokens for the tokenizer", param)
                self._fits(len(ids), param)
                return Prompt(len(ids), tuple(block_hashes(ids, bt)), ids)
            self._fits(estimate_text_tokens(value), param)
            data = value.encode("utf-8")
            ids = tuple(int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4))
            return Prompt(estimate_text_tokens(value), tuple(text_block_hashes(value, bt)), ids)
        if isinstance(value, list) and value:
            self._fits(len(value), param)
            if all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value
            ):
                return Prompt(len(value), tuple(block_hashes(value, bt)), tuple(value))
        raise BadRequest(f"{param} must be a non-empty string or list of token ids", param)

    def _fits(self, tokens: int, param: str, bound: str = "") -> None:
        held = self.engine.cache.capacity_blocks * self.profile.block_tokens
        if tokens >= held:  # (a request needs room for one output token too)
            raise BadRequest(
                f"{param} has {bound}{tokens} tokens; the engine's KV cache holds {held}", param
            )

    # ---------------------------------------------------------------------------- figures

    def metrics_text(self) -> str:
        """The engine's figures under vLLM's and SGLang's metric names (Prometheus text)."""
        e, m = self.engine, self.model
        load = e.load()
        # As vLLM's and SGLang's: blocks held by running requests (cached idle ones are free).
        kv = e.cache.busy_blocks / e.cache.capacity_blocks if e.cache.capacity_blocks else 0.0
        hit = e.cached_tokens_total / e.prompt_tokens_total if e.prompt_tokens_total else 0.0
        escaped = m.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        lab = f'{{model_name="{escaped}"}}'  # (as Prometheus's text format escapes a label)
        rows = [
            ("vllm:num_requests_running", "gauge", load.running),
            ("vllm:num_requests_waiting", "gauge", load.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", kv),
            ("vllm:gpu_cache_usage_perc", "gauge", kv),
            ("vllm:prompt_tokens_total", "counter", e.prompt_tokens_total),
            ("vllm:generation_tokens_total", "counter", self.generation_tokens_total),
            ("vllm:prefix_cache_queries_total", "counter", e.prompt_tokens_total),
            ("vllm:prefix_cache_hits_total", "counter", e.cached_tokens_total),
            ("vllm:request_success_total", "counter", self.requests_finished_total),
            ("sglang:num_running_reqs", "gauge", load.running),
            ("sglang:num_queue_reqs", "gauge", load.waiting),
            ("sglang:token_usage", "gauge", kv),
            ("sglang:cache_hit_rate", "gauge", hit),
            ("sglang:prompt_tokens_total", "counter", e.prompt_tokens_total),
            ("sglang:cached_tokens_total", "counter", e.cached_tokens_total),
            ("sluice_engine_clock_dropped_seconds_total", "counter", self.clock_dropped_s_total),
        ]
        out: list[str] = []
        for name, kind, value in rows:
            base = name[: -len("_total")] if kind == "counter" else name
            out.append(f"# HELP {base} {name} of the simulated engine")
            out.append(f"# TYPE {base} {kind}")
            out.append(f"{name}{lab} {float(value)}")
        return "\n".join(out) + "\n" + generate_latest(self._registry).decode()

    def flush_cache(self) -> bool:
        """SGLang's ``/flush_cache``: drop every cached prefix block, only while no request
        runs or waits (SGLang refuses otherwise); its removals go out as KV events."""
        if self.engine.has_work or self._streams:
            return False
        self.engine.cache.flush()
        self._flush_kv()
        return True

    def loads(self) -> dict[str, Any]:
        load = self.engine.load()
        return {
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting,
            "num_pending_prefill_tokens": load.pending_prefill_tokens,
            "kv_blocks_used": load.kv_blocks_used,
            "kv_blocks_total": load.kv_blocks_total,
            "busy_s": round(load.busy_s, 6),
        }

    def server_info(self) -> dict[str, Any]:
        p = self.profile
        return {
            "model_path": self.model,
            "served_model_name": self.model,
            "engine": "sluice-sim",
            "profile": p.name,
            "speed": self.speed,
            "page_size": self.kv_page_tokens or p.block_tokens,
            "max_running_requests": p.max_running,
            "max_total_num_tokens": p.kv_capacity_tokens,
            "chunked_prefill_size": p.prefill_chunk_tokens,
        }


# ------------------------------------------------------------------------------- HTTP face


log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.25
"""How often a whole answer's wait looks whether its client is still there."""


def _error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """Every refusal's body, OpenAI-shaped: ``{"error": {message, type, param, code}}``."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


async def _json(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise TooLarge(f"the body has {declared} bytes; at most {MAX_BODY_BYTES} are read")
    raw = bytearray()
    async for chunk in request.stream():  # (a chunked body declares no length)
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise TooLarge(f"the body has more than {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (JSON errors; an int of over 4,300 digits)
        raise BadRequest(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


_BOOL: TypeAdapter[bool | None] = TypeAdapter(bool | None)


def _flag(body: Mapping[str, Any], key: str) -> bool:
    """A boolean field read as vLLM's pydantic models read it (``"false"`` and ``0`` are
    false: a bare truth test streamed those); anything else is a 400."""
    try:
        return bool(_BOOL.validate_python(body.get(key)))
    except ValidationError:
        raise BadRequest(f"{key} must be a boolean", key) from None


_INT: TypeAdapter[int | None] = TypeAdapter(int | None)


def _one_choice(body: Mapping[str, Any]) -> None:
    # vLLM samples n choices; the simulated engine makes one, and says so rather than
    # answering one to a client that asked for several. (n read as vLLM reads it: "1" is 1.)
    try:
        n = _INT.validate_python(body.get("n"))
    except ValidationError:
        n = None if body.get("n") is None else -1
    if n is not None and n != 1:
        raise BadRequest(
            f"n must be 1: the simulated engine makes one choice, not {body.get('n')!r}", "n"
        )


_FLOAT: TypeAdapter[float | None] = TypeAdapter(float | None)
_SAMPLING: tuple[tuple[str, float, float, bool, str], ...] = (
    ("temperature", 0.0, math.inf, True, ">= 0"),
    ("top_p", 0.0, 1.0, False, "in (0, 1]"),
    ("frequency_penalty", -2.0, 2.0, True, "in [-2, 2]"),
    ("presence_penalty", -2.0, 2.0, True, "in [-2, 2]"),
    ("min_p", 0.0, 1.0, True, "in [0, 1]"),
    ("repetition_penalty", 0.0, math.inf, False, "> 0"),
)
"""Sampling parameters checked as vLLM checks them: (name, low, high, low allowed, rule).
The simulated engine's text does not depend on them; out of range, vLLM answers 400, and so
does it."""


def _sampling(body: Mapping[str, Any]) -> None:
    for key, low, high, closed, rule in _SAMPLING:
        try:
            value = _FLOAT.validate_python(body.get(key))
        except ValidationError:
            raise BadRequest(f"{key} must be a number", key) from None
        if value is None:
            continue
        above = value >= low if closed else value > low
        if not (math.isfinite(value) and above and value <= high):
            raise BadRequest(f"{key} must be {rule}, not {body.get(key)!r}", key)
    for key, least in (("top_k", -1), ("min_tokens", 0)):
        try:
            count = _INT.validate_python(body.get(key))
        except ValidationError:
            raise BadRequest(f"{key} must be an integer", key) from None
        if count is not None and count < least:
            raise BadRequest(f"{key} must be at least {least}, not {count}", key)


_NOT_SIMULATED = ("echo", "prompt_logprobs")
"""Fields whose answer the simulated engine cannot give (it does not echo prompts, nor score
them): a 400 rather than an answer without them."""
Face = Literal["completion", "chat", "generate"]


def _top_logprobs(body: Mapping[str, Any], face: Face) -> int:
    """The alternatives per token a request asks logprobs of (-1: none), as vLLM reads its
    completions' ``logprobs`` (a count) and its chat's ``logprobs`` (a flag) with
    ``top_logprobs``; SGLang's native ``return_logprob`` is not simulated."""
    if face == "generate":
        for name in ("logprobs", "top_logprobs", "return_logprob"):
            if body.get(name):
                raise BadRequest(f"{name}: the simulated engine does not produce it", name)
        return -1
    key = "logprobs" if face == "completion" else "top_logprobs"
    try:
        count = _INT.validate_python(body.get(key))
    except ValidationError:
        raise BadRequest(f"{key} must be an integer", key) from None
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise BadRequest(f"{key} must be from 0 to {MAX_LOGPROBS}, not {count}", key)
    if face == "completion":
        return -1 if count is None else count
    if not _flag(body, "logprobs"):
        if count is not None:
            raise BadRequest("when using top_logprobs, logprobs must be set to true", key)
        return -1
    return count or 0


_INTS: TypeAdapter[list[int] | None] = TypeAdapter(list[int] | None)


def _sample(body: Mapping[str, Any], prompt: Prompt, face: Face) -> Sample:
    """The sampling fields the simulated engine honours (:class:`Sample`), read from an
    OpenAI body or SGLang's ``sampling_params``, checked as vLLM checks them; the others
    (``top_p``, penalties, ...) are checked by :func:`_sampling` and change nothing in its
    pseudo output."""
    for name in _NOT_SIMULATED:
        if body.get(name):
            raise BadRequest(f"{name}: the simulated engine does not produce it", name)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops)
    ):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    try:
        stop_ids = _INTS.validate_python(body.get("stop_token_ids"))
    except ValidationError:
        raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids") from None
    try:
        seed = _INT.validate_python(body.get("seed", body.get("sampling_seed")))
    except ValidationError:
        raise BadRequest("seed must be an integer", "seed") from None
    temperature = body.get("temperature")  # (checked by _sampling)
    t = None if temperature is None else float(temperature)
    key = sample_key(prompt.token_ids, t, seed)
    least = _INT.validate_python(body.get("min_tokens")) or 0  # (checked by _sampling)
    include = _flag(body, "include_stop_str_in_output")
    _flag(body, "ignore_eos")  # (its pseudo output has no end-of-sequence token)
    top = _top_logprobs(body, face)
    if top >= 0 and (stops or stop_ids):
        raise BadRequest("the simulated engine does not combine logprobs with stops", "stop")
    script = _script(body, key or f"free:{time.monotonic_ns()}")
    if script is not None and (top >= 0 or stops or stop_ids):
        raise BadRequest(
            "the simulated engine does not combine response_format with stops or logprobs",
            "response_format",
        )
    return Sample(key, tuple(stops or ()), frozenset(stop_ids or ()), least, include, top, script)


def _script(body: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    """The structured output a ``response_format`` asks for, in pieces of up to 4 characters
    (one per token): a JSON instance of its schema, strings of pseudo words picked by ``key``
    (the same for a greedy or seeded request's prompt), or for ``json_object`` an object with
    one string. A format that is not valid, or a schema it cannot make an instance of, is a
    400."""
    try:
        fmt = response_format(body.get("response_format"))
    except ValueError as exc:
        raise BadRequest(str(exc), "response_format") from None
    if fmt is None:
        return None
    words = (detokenize([output_token(key, i)]) for i in itertools.count())
    if fmt["type"] == "json_object":
        value: Any = {"answer": "".join(itertools.islice(words, 8)).strip()}
    else:
        value = _instance_of(fmt["json_schema"]["schema"], words)
    text = json.dumps(value, ensure_ascii=False)
    return tuple(text[i : i + 4] for i in range(0, len(text), 4))


_MAX_DEPTH = 32
_MAX_ITEMS = 64


def _instance_of(schema: Any, words: Iterator[str]) -> Any:
    """An instance of ``schema`` (:func:`_instance`), or a 400 for one it cannot make."""
    try:
        return _instance(schema, words, 0, schema)
    except BadRequest:
        raise
    except (TypeError, ValueError, OverflowError, KeyError) as exc:  # (a keyword of a bad type)
        raise BadRequest(f"a schema the simulated engine cannot follow: {exc!r}", _FORMAT) from None


_FORMAT = "response_format"


def _instance(schema: Any, words: Iterator[str], depth: int, root: Any) -> Any:
    """An instance of a JSON Schema's common keywords: type (a list: its first but null),
    properties (every one), items and minItems/maxItems (the fewest, at least one unless at
    most none), enum and const, anyOf/oneOf/allOf (the first), minimum/maximum and their
    exclusive forms, minLength/maxLength, and ``$ref`` into the schema's own ``$defs`` or
    ``definitions``; strings of pseudo words. Others (pattern, multipleOf, uniqueItems, not,
    ...) are not followed: the output may not satisfy them."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        raise BadRequest("a schema the simulated engine cannot follow", _FORMAT)
    if "$ref" in schema:
        return _instance(_resolve(schema["$ref"], root), words, depth + 1, root)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _instance(schema[key][0], words, depth + 1, root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties") or {}
        return {k: _instance(v, words, depth + 1, root) for k, v in props.items()}
    if kind == "array":
        count = 0 if schema.get("maxItems") == 0 else max(int(schema.get("minItems", 1)), 1)
        if count > _MAX_ITEMS:
            raise BadRequest(f"minItems over {_MAX_ITEMS}: not simulated", _FORMAT)
        item = schema.get("items", {})
        return [_instance(item, words, depth + 1, root) for _ in range(count)]
    return _scalar(kind, schema, words)


def _resolve(ref: Any, root: Any) -> Any:
    """The schema a local ``$ref`` (``#/$defs/X``, ``#/definitions/X``) names."""
    parts = ref.split("/") if isinstance(ref, str) else []
    if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
        raise BadRequest(f"$ref {ref!r}: the simulated engine follows #/$defs/... only", _FORMAT)
    found = (root.get(parts[1]) or {}).get(parts[2])
    if found is None:
        raise BadRequest(f"$ref {ref!r} names no definition", _FORMAT)
    return found


def _scalar(kind: Any, schema: dict[str, Any], words: Iterator[str]) -> Any:
    """An instance of a schema of one value (a string, a number, ...)."""
    if kind == "string":
        text = "".join(itertools.islice(words, 3)).strip()
        least = int(schema.get("minLength", 0))
        while len(text) < least:
            text += " " + text if text else "x"
        return text[: int(schema.get("maxLength", len(text)))]
    if kind in ("integer", "number"):
        return _number(kind == "integer", schema)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "".join(itertools.islice(words, 2)).strip()  # (any value: a string)


def _number(integer: bool, schema: dict[str, Any]) -> int | float:
    """A number within the schema's bounds: 0 if it may be, else the bound nearest 0."""
    low, high = schema.get("minimum"), schema.get("maximum")
    x_low, x_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    value: float = 0
    if low is not None and value < low:
        value = low
    if x_low is not None and value <= x_low:
        value = math.floor(x_low) + 1 if integer else x_low + (abs(x_low) or 1) * 1e-6
    if high is not None and value > high:
        value = high
    if x_high is not None and value >= x_high:
        value = math.ceil(x_high) - 1 if integer else x_high - (abs(x_high) or 1) * 1e-6
    if integer:
        whole = math.ceil(value)  # (a minimum of 2.5: 3)
        return math.floor(high) if high is not None and whole > high else whole
    return float(value)


def sample_key(token_ids: Sequence[int], temperature: float | None, seed: int | None) -> str | None:
    """:attr:`Sample.key` of a prompt's token ids with this ``temperature`` (None: vLLM's
    default, 1) and ``seed``."""
    greedy = temperature == 0.0
    if not greedy and seed is None:
        return None
    digest = xxhash.xxh64_hexdigest(",".join(map(str, token_ids)).encode())
    return f"greedy:{digest}" if greedy else f"seed:{seed}:{digest}"


def _served(body: Mapping[str, Any], model: str) -> None:
    """The request names the served model, or none (vLLM's default then): another is a 404,
    as in vLLM (an agent with the wrong ``engine_model`` was served all the same)."""
    name = body.get("model")
    if name is None or name == model:
        return
    if not isinstance(name, str):
        raise BadRequest("model must be a string", "model")
    raise UnknownModel(f"The model `{name}` does not exist.", "model")


def _positive_int(body: Mapping[str, Any], key: str, default: int) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"{key} must be an integer >= 1", key)
    return value


def _sse(obj: Mapping[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _usage(fin: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.output_tokens,
        "total_tokens": fin.prompt_tokens + fin.output_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


class _OpenAI:
    """The OpenAI completions and chat completions endpoints."""

    def __init__(self, server: SimServer) -> None:
        self.server = server

    async def completions(self, request: Request) -> Response:
        body = await _json(request)
        prompt = self.server.prompt(body.get("prompt"), "prompt")
        return await self._answer(request, body, prompt, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await _json(request)
        s = self.server
        try:
            options = ChatOptions.from_body(body)
            rendered = chat_prompt(body.get("messages"), options, s.chat_template, s.tokenizer)
        except ChatError as exc:
            raise BadRequest(str(exc), exc.param) from exc
        prompt = s.prompt(rendered, "messages")
        return await self._answer(request, body, prompt, chat=True)

    async def _answer(
        self, request: Request, body: Mapping[str, Any], prompt: Prompt, *, chat: bool
    ) -> Response:
        s = self.server
        _served(body, s.model)
        # vLLM's: max_completion_tokens or max_tokens (a null one is not given).
        given = chat and body.get("max_completion_tokens") is not None
        key = "max_completion_tokens" if given else "max_tokens"
        max_tokens = _positive_int(body, key, MAX_TOKENS_DEFAULT)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        streaming, include_usage = _flag(body, "stream"), _flag(options, "include_usage")
        if options and not streaming:
            raise BadRequest("stream_options is only for stream=true", "stream_options")
        _one_choice(body)
        _sampling(body)
        face: Face = "chat" if chat else "completion"
        rid, stream = s.submit(prompt, max_tokens, _sample(body, prompt, face))
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": s.model,
        }
        if streaming:
            gen = self._stream(rid, stream, head, chat, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        got = await _whole(request, s, rid, stream)
        if got is None:
            return Response(status_code=499)
        text, fin = got
        reason = "stop" if stream.stopped else "length"
        lps = _logprobs_of(face, stream, 0, 0)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": lps}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            head["object"] = "chat.completion"
        else:
            choice["text"] = text
        return JSONResponse({**head, "choices": [choice], "usage": _usage(fin)})

    async def _stream(
        self, rid: str, stream: _Stream, head: dict[str, Any], chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        first = True
        face: Face = "chat" if chat else "completion"
        sent = offset = 0  # tokens whose logprobs went out, characters before them
        async for piece, fin in _until_shutdown(self.server.events(rid, stream)):
            if fin is not None:
                reason = "stop" if stream.stopped else "length"
                done: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
                if chat:
                    done["delta"] = {}
                else:
                    done["text"] = ""
                yield _sse({**head, "choices": [done]})
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(fin)})
                yield _sse("[DONE]")
                return
            lps = _logprobs_of(face, stream, sent, offset)
            sent, offset = len(stream.tokens), offset + len(piece)
            if chat:
                delta: dict[str, Any] = {"content": piece}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
                if lps is not None:
                    choice["logprobs"] = lps
            else:
                choice = {"index": 0, "text": piece, "finish_reason": None, "logprobs": lps}
            first = False
            yield _sse({**head, "choices": [choice]})


def _logprobs_of(face: Face, stream: _Stream, sent: int, offset: int) -> dict[str, Any] | None:
    """The ``logprobs`` of a choice's tokens from ``sent`` on, whose text starts at character
    ``offset`` of the output, in ``face``'s shape (None: not asked for)."""
    top = stream.sample.top
    if top < 0:
        return None
    entries = logprobs(stream.tokens[sent:], top)
    if face == "chat":
        return chat_logprobs(entries)
    return completion_logprobs(entries, offset)


class _SGLang:
    """SGLang's native ``/generate``."""

    def __init__(self, server: SimServer) -> None:
        self.server = server

    async def generate(self, request: Request) -> Response:
        body = await _json(request)
        s = self.server
        if "input_ids" in body:
            if not isinstance(body["input_ids"], list):  # (a string was read as text)
                raise BadRequest("input_ids must be a list of token ids", "input_ids")
            prompt = s.prompt(body["input_ids"], "input_ids")
        else:
            prompt = s.prompt(body.get("text"), "text")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object", "sampling_params")
        max_new = _positive_int(params, "max_new_tokens", 128)
        streaming = _flag(body, "stream")
        _sampling(params)
        _top_logprobs(body, "generate")  # (a 400 if asked for)
        rid, stream = s.submit(prompt, max_new, _sample(params, prompt, "generate"))
        if streaming:
            return StreamingResponse(self._stream(rid, stream), media_type="text/event-stream")
        got = await _whole(request, s, rid, stream)
        if got is None:
            return Response(status_code=499)
        text, fin = got
        meta = _meta(rid, fin, fin.output_tokens, stream)
        return JSONResponse({"text": text, "meta_info": meta})

    async def flush_cache(self, _: Request) -> Response:
        """SGLang's ``/flush_cache``: 200 once flushed, 400 while requests run."""
        if self.server.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(
            "Cache not flushed. Please check if there are running requests.\n", status_code=400
        )

    async def _stream(self, rid: str, stream: _Stream) -> AsyncIterator[bytes]:
        text, n = "", 0
        async for piece, fin in _until_shutdown(self.server.events(rid, stream)):
            if fin is not None:
                meta = _meta(rid, fin, fin.output_tokens, stream)
                yield _sse({"text": text, "meta_info": meta})
                yield _sse("[DONE]")
                return
            text += piece
            n += 1
            meta = {"id": rid, "completion_tokens": n}
            yield _sse({"text": text, "meta_info": meta})


async def _whole(
    request: Request, server: SimServer, rid: str, stream: _Stream
) -> tuple[str, Finished] | None:
    """A whole answer's text and finish; None if its client left first, which aborts the
    request, as in vLLM and SGLang (a stream's does when its next write fails; a whole
    answer's is watched for: SGLang's ``/generate`` ran on for its every token)."""
    collecting = asyncio.ensure_future(server.collect(rid, stream))
    try:
        while not (await asyncio.wait({collecting}, timeout=_DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                return None
    finally:
        if not collecting.done():  # (also when this handler is cancelled: a shutdown)
            collecting.cancel()  # its stream's end releases it from the engine
            with contextlib.suppress(asyncio.CancelledError):
                await collecting
    return collecting.result()


async def _until_shutdown(
    events: AsyncIterator[tuple[str, Finished | None]],
) -> AsyncIterator[tuple[str, Finished | None]]:
    """A stream's events until the server stops it (:meth:`SimServer.abort_all`): then the
    stream just ends, without ``[DONE]``, as a real engine's connection closes when it stops
    (an exception there was a traceback in the log for every open stream)."""
    try:
        async for item in events:
            yield item
    except EngineError:
        return


def _meta(rid: str, fin: Finished, completion: int, stream: _Stream) -> dict[str, Any]:
    reason: dict[str, Any] = {"type": "length", "length": completion}
    if stream.stopped:
        reason = {"type": "stop", "matched": stream.matched}
    return {
        "id": rid,
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": completion,
        "cached_tokens": fin.cached_tokens,
        "finish_reason": reason,
    }


def _guarded(handler: Any) -> Any:
    """``handler`` answering a client's mistake 400 and anything else a JSON 500."""

    async def run(request: Request) -> Response:
        try:
            result: Response = await handler(request)
        except BadRequest as exc:
            return _error(exc.status, str(exc), param=exc.param, code=exc.code)
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") in the text
            return _error(400, f"text that is not valid Unicode: {exc.reason}")
        except ClientDisconnect:  # gone before its body was read: nobody to answer
            return Response(status_code=499)
        except EngineError as exc:  # the server is stopping (SimServer.abort_all)
            return _error(503, str(exc), kind="server_error")
        except Exception:  # answered, in JSON, on a connection that stays open
            internal_error(log, "engine.request", "the engine server failed a request")
            return _error(500, "internal error", kind="server_error")
        return result

    return run


def build_app(server: SimServer) -> Starlette:
    """The ASGI app of ``server`` (its engine starts and stops with the app)."""
    openai, sglang = _OpenAI(server), _SGLang(server)

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok")

    async def models(_: Request) -> Response:
        item: dict[str, Any] = {"id": server.model, "object": "model", "owned_by": "sluice-sim"}
        item["created"] = int(server.started_unix_s)
        return JSONResponse({"object": "list", "data": [item]})

    async def server_info(_: Request) -> Response:
        return JSONResponse(server.server_info())

    async def model_info(_: Request) -> Response:
        return JSONResponse({"model_path": server.model, "is_generation": True})

    async def loads(_: Request) -> Response:
        return JSONResponse(server.loads())

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/completions", _guarded(openai.completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(openai.chat), methods=["POST"]),
        Route("/generate", _guarded(sglang.generate), methods=["POST"]),
        Route("/health", health),
        Route("/v1/models", models),
        Route("/server_info", server_info),
        Route("/get_server_info", server_info),
        Route("/model_info", model_info),
        Route("/get_model_info", model_info),
        Route("/v1/loads", loads),
        Route("/flush_cache", sglang.flush_cache, methods=["GET", "POST"]),
        Route("/metrics", metrics),
    ]

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    async def not_routed(_: Request, exc: Exception) -> Response:
        # An unknown path or method: JSON, as every other answer (Starlette's were text).
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, exc.detail, headers=exc.headers)

    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: not_routed}
    )


def serve(
    profile: EngineProfile,
    *,
    model: str,
    speed: float = 1.0,
    host: str = "127.0.0.1",
    port: int | None = None,
    uds: str | None = None,
    kv_events: str | None = None,
    tokenizer: str | None = None,
    kv_page_tokens: int | None = None,
    announce: Callable[[], object] | None = None,
    chat_template: str | None = None,
) -> None:
    """Run the server until interrupted (on ``host:port``, or on the Unix socket ``uds``);
    ``kv_events``: publish vLLM-format KV events on this ZMQ endpoint (replay beside it), or
    with ``kv_page_tokens`` SGLang's, a hash per page of that many tokens; ``tokenizer``: a
    ``tokenizer.json`` for text prompts (a bad file or page size is a ``ConfigError``);
    ``chat_template``: the model's (a ``tokenizer_config.json`` or a ``.jinja`` file) for
    chats, as vLLM's ``--chat-template``; ``announce`` is called once the server is bound
    and set up, before it serves."""
    import uvicorn

    if (port is None) == (uds is None):
        raise ValueError("give exactly one of port and uds")
    try:
        check_page_tokens(profile, kv_page_tokens)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if kv_page_tokens is not None and kv_events is None:
        raise ConfigError("a KV page size shapes the KV events: give an endpoint for them")
    template = None if chat_template is None else ChatTemplate.from_file(chat_template)
    # Bound here, before anything starts: uvicorn logged a busy port or an unknown host and
    # exited with its own code (3), and a socket in a missing folder was a traceback.
    if port is not None:
        sockets = _listen(host, port)  # OSError: the caller says where
    else:
        assert uds is not None
        if not os.path.isdir(os.path.dirname(os.path.abspath(uds))):
            raise ConfigError(f"no folder for the socket {uds}")
        sockets = [_listen_unix(uds)]
        own = os.lstat(uds)
    with contextlib.ExitStack() as bound:  # (closed if what follows fails)
        for sock in sockets:
            bound.callback(sock.close)
        if uds is not None:
            bound.callback(_remove_own, uds, own)
        server = SimServer(
            profile,
            model=model,
            speed=speed,
            kv_events=_publisher(kv_events),
            tokenizer=None if tokenizer is None else PromptTokenizer.from_file(tokenizer),
            kv_page_tokens=kv_page_tokens,
            chat_template=template,
        )
        bound.pop_all()
    app = build_app(server)
    config = uvicorn.Config(
        app,
        host=host,
        port=port or 0,
        uds=uds,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 2,  # (a handler that never ends)
    )
    if announce is not None:  # (bound and set up: a failure before is the only line)
        announce()
    stopping = functools.partial(server.stop_taking, SHUTDOWN_GRACE_S)
    try:
        _stopped_by_signal(config, stopping).run(sockets=sockets)
    finally:
        if uds is not None:  # (its own socket file, not left behind)
            _remove_own(uds, own)


def _publisher(endpoint: str | None) -> KVEventPublisher | None:
    if endpoint is None:
        return None
    import zmq

    try:
        return KVEventPublisher(endpoint)
    except (KVEventError, zmq.ZMQError) as exc:
        raise ConfigError(f"cannot publish KV events on {endpoint}: {exc}") from exc


_PROBE_S = 1.0
"""How long a look at a socket file already there waits for its server to take the connection."""
_BACKLOG = 2048
"""The listening sockets' backlog (uvicorn's default)."""


def _listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` (an IPv6 one too), as asyncio's
    ``create_server`` binds them for uvicorn; an ``OSError`` closes what was bound."""
    # ("": every address, as asyncio reads it; getaddrinfo refuses it.)
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (its own address only, as asyncio binds it)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            # Listening now, not when uvicorn starts: a socket bound with SO_REUSEADDR and
            # not listening let ZeroMQ bind the KV events on the same port, and the engine
            # served ZeroMQ on its HTTP port.
            sock.listen(_BACKLOG)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _listen_unix(path: str) -> socket.socket:
    """A Unix socket listening at ``path``. A socket file there that nobody answers on (a
    server that died) is replaced; a live server's is refused (uvicorn removed it and took
    over, leaving that server unreachable), and so is anything that is not a socket."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"{path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(_PROBE_S)  # (a live server with a full backlog does not refuse)
            try:
                probe.connect(path)
            except (TimeoutError, BlockingIOError):  # (a Unix socket's full backlog: EAGAIN)
                raise OSError(errno.EADDRINUSE, "a server holds it (it did not answer)") from None
            except (ConnectionRefusedError, FileNotFoundError):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # stale
            else:
                raise OSError(errno.EADDRINUSE, "a server already listens on it")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)  # (as uvicorn's own: an agent of another user connects)
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _remove_own(path: str, own: os.stat_result) -> None:
    """Remove the socket file at ``path`` if it is still the one made (``own``, its
    ``lstat``): a server that replaced a stopping one (whose file refused connections, as a
    dead server's does) has its own there."""
    with contextlib.suppress(OSError):
        if os.path.samestat(os.lstat(path), own):
            os.unlink(path)


def _stopped_by_signal(config: Any, on_stop: Callable[[], None]) -> Any:
    """uvicorn's server, stopped by SIGINT or SIGTERM (a second one: at once), and then done:
    uvicorn raises the signal again once it has stopped, which ended an engine stopped by its
    orchestrator in a ``KeyboardInterrupt`` (exit code 130). The first signal also calls
    ``on_stop`` in the event loop (:meth:`SimServer.stop_taking`)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield  # (signals reach the main thread only)
                return
            self.loop = asyncio.get_running_loop()
            stops = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.stop) for sig in stops}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def stop(self, sig: int, frame: Any) -> None:
            # uvicorn forces the exit on a second SIGINT only; a second SIGTERM too, here.
            if self.should_exit:
                self.force_exit = True
            else:  # (a signal handler interrupts the loop anywhere: the loop calls it)
                self.loop.call_soon_threadsafe(on_stop)
            self.should_exit = True

    return Server(config)


class EngineProcess:
    """A ``sluice engine`` server in its own process on a Unix socket (or, with ``port``, on
    that port of 127.0.0.1, the socket path then only naming its KV event socket), stopped by
    its PID; ``kv_events``: it publishes KV events on ``ipc://UDS.kv`` (replay beside it)."""

    def __init__(
        self,
        uds: str,
        *,
        model: str,
        speed: float = 1.0,
        profile: str = "reference",
        kv_events: bool = False,
        tokenizer: str | None = None,
        port: int | None = None,
        kv_page_tokens: int | None = None,
    ):
        self.uds, self.model, self.speed, self.profile = uds, model, speed, profile
        self.kv_events = f"ipc://{uds}.kv" if kv_events else None
        self.kv_page_tokens = kv_page_tokens
        self.tokenizer = tokenizer
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}" if self.port else f"unix://{self.uds}"

    def start(self, timeout_s: float = 20.0) -> EngineProcess:
        """Start the process and wait until it serves (stopped again if it does not)."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting (:meth:`wait_ready` waits): a fleet starts all
        its engines at once."""
        where = ["--port", str(self.port)] if self.port else ["--uds", self.uds]
        cmd = [
            *SLUICE, "engine", *where, "--model",
            self.model, "--speed", str(self.speed), "--profile", self.profile,
        ]  # fmt: skip
        if self.kv_events is not None:
            cmd += ["--kv-events", self.kv_events]
        if self.tokenizer is not None:
            cmd += ["--tokenizer", self.tokenizer]
        if self.kv_page_tokens is not None:
            cmd += ["--kv-page-tokens", str(self.kv_page_tokens)]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=DIE_WITH_PARENT
        )

    def wait_ready(self, timeout_s: float = 20.0) -> EngineProcess:
        """Wait until the launched process answers ``/health``; stop it if it does not."""
        import httpx

        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        transport = None if self.port else httpx.HTTPTransport(uds=self.uds)
        base = self.url if self.port else "http://engine"
        with httpx.Client(transport=transport, base_url=base, timeout=2) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise EngineError(f"sluice engine on {self.url} exited: {err.strip()}")
                try:
                    if c.get("/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise EngineError(f"sluice engine on {self.url} did not start in {timeout_s:g} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_processes([self.proc])
        self.close()

    def close(self) -> None:
        """Close its stderr pipe (once it stopped)."""
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

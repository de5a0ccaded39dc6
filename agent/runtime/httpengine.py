"""The ``openai-http`` engine: any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server)
behind the agent's :class:`~sluice.agent.engine.Engine` protocol.

Each request is one streaming ``POST /v1/completions`` (SSE, ``stream_options.include_usage``)
on one pooled aiohttp session, over TCP (``http://host:port``) or a Unix socket beside the agent
(``unix:///path/to.sock``). Text chunks become tokens as they arrive (the agent coalesces
them as for the simulated engine); the final ``usage`` gives the completion's prompt, output
and cached tokens (``prompt_tokens_details.cached_tokens``, 0 where the engine reports none).
Cancelling a request closes its stream, and so aborts it in the engine. aiohttp, not httpx as
elsewhere in Sluice: an agent reads every token of every stream its engine serves, and aiohttp
(with its compiled parser) reads one in about a third of httpx's CPU (docs/BENCHMARKS.md,
"Where live Sluice lost its first tokens").

Timeouts: connecting, the first token, and between tokens. A request whose engine dies, hangs
or answers garbage ends as :class:`~sluice.agent.engine.Failed` (the dispatcher runs it
elsewhere as its next attempt; never dropped). A health check (``GET /health``) runs every
``health_every_s``; while it fails the engine is not ``available`` and the agent heartbeats no
free capacity. Its load comes from its Prometheus endpoint (:mod:`.scrape`), scraped on a
jittered interval; figures older than ``metrics_stale_s`` count as a saturated engine, which
takes no work either.

``step()`` returns what the streams delivered since the last one (events that already happened,
unlike a simulated step's), with a duration of ``poll_s``; a first token, an end or a failure sets
``delivered``, on which the agent's step loop waits, so it is relayed when it arrives, not at the
next poll (which cost up to two polls per event). Output token ids are positions in the agent's
record of this engine's output (an OpenAI stream carries text, not the engine's token ids); the
text is the engine's. The cache digest is the agent's record of the prompts it served (every
``stride``-th block of prompts of at least ``digest_min_tokens``, most recent ``max_blocks``),
until KV events stand in for it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sluice.agent.defaults import KV_MAX_BLOCKS, KV_SILENCE_S, RECORD_MAX_BLOCKS
from sluice.agent.engine import EngineError, EngineLoad, Failed, Finished, Step, TokensOut
from sluice.agent.errors import KVEventError
from sluice.agent.kvevents import (
    REPLAY_END,
    KVEventTracker,
    decode_batch,
    decode_message,
    decode_seq,
    encode_seq,
    replay_endpoint,
)
from sluice.agent.runtime.scrape import EngineMetricsError, ScrapedLoad, parse_load
from sluice.common.errors import INTERNAL_ERRORS, internal_error
from sluice.schemas.models import LOGPROB_FLOOR, Sampling, TokenLogprob, TopLogprob
from sluice.schemas.tokens import token_list

log = logging.getLogger(__name__)

KEEPALIVE_S = 2.0
"""Seconds an idle connection to the engine is kept for the next request."""
BUSY_S = (1.0, 30.0)
"""How long an engine that answered 429 or 503 takes no new work: its ``Retry-After``, at least
the first and at most the second (1 s without one)."""
_GONE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
"""Errors that say the engine is gone or hangs (not that it answered badly)."""


@dataclass(frozen=True)
class HttpEngineConfig:
    url: str
    """``http://host:port`` or ``unix:///path/to.sock``."""
    model: str
    block_tokens: int = 16
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 60.0
    token_timeout_s: float = 30.0
    health_every_s: float = 1.0
    metrics_path: str | None = "/metrics"
    """Where its Prometheus metrics are, on the same server (None: no scraping)."""
    metrics_url: str | None = None
    """``http(s)://host:port/path`` of its metrics when they are served apart from the engine's
    server (over ``metrics_path``)."""
    metrics_every_s: float = 1.0
    metrics_stale_s: float = 5.0
    """Figures older than this count as a saturated engine (it takes no work)."""
    kv_events: str | None = None
    """``tcp://host:port`` or ``ipc:///path`` of the engine's KV event publisher (None: the
    served record)."""
    kv_replay: str | None = None
    """Its replay socket (default: :func:`~sluice.agent.kvevents.replay_endpoint`)."""
    kv_topic: str = ""
    """The topic of its events to follow (a prefix, as ZeroMQ matches it; empty: all): a
    publisher shared by several engines or models tells them apart by it."""
    kv_bind: bool = False
    """Bind ``kv_events`` and let the publisher connect: vLLM and SGLang connect to an
    endpoint that is neither ``ipc://`` nor a wildcard (``tcp://127.0.0.1:5557``)."""
    poll_s: float = 0.002
    """The longest the agent's step loop waits for a delivery: a later token waits at most
    this long (plus the coalescing) to be relayed. An agent polls at half its
    ``token_flush_ms``, since it holds later tokens that long anyway: a loop waking every 2 ms
    cost a fleet of busy agents more CPU than their streams (docs/BENCHMARKS.md, "Where live
    Sluice lost its first tokens")."""
    digest_min_tokens: int | None = 256
    stride: int = 1
    max_blocks: int = RECORD_MAX_BLOCKS
    """Block hashes the record of served prompts keeps at most."""
    kv_max_blocks: int = KV_MAX_BLOCKS
    """Engine blocks the KV-event mirror keeps at most."""
    kv_silence_s: float = KV_SILENCE_S
    """Warn once if no KV event has come this long after a request that stored a whole block
    finished."""


@dataclass
class _Run:
    prompt_tokens: int
    max_pieces: int
    pieces: list[int] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    failed: bool = False
    top: int = -1
    """The alternatives per token its logprobs name (-1: it asked for none)."""
    logprobs: list[TokenLogprob] | None = None
    """One per piece, for a request that asked for them: each piece is then one token."""
    held: str = ""
    """Text that came without logprobs: it goes with the next token's piece."""


class HttpEngine:
    """An OpenAI-compatible server as the agent's engine (see the module docstring)."""

    def __init__(self, config: HttpEngineConfig) -> None:
        self.config = c = config
        if c.url.startswith("unix://"):
            self._socket: str | None = c.url[len("unix://") :]
            self._base = "http://engine"
        elif c.url.startswith(("http://", "https://")):
            self._socket, self._base = None, c.url.rstrip("/")
        else:
            raise EngineError(f"engine URL must be http://, https:// or unix://, not {c.url!r}")
        if c.metrics_url is not None and not c.metrics_url.startswith(("http://", "https://")):
            raise EngineError(f"metrics URL must be http:// or https://, not {c.metrics_url!r}")
        self._metrics_at = c.metrics_url
        if self._metrics_at is None and c.metrics_path is not None:
            self._metrics_at = self._base + c.metrics_path
        self._session: aiohttp.ClientSession | None = None
        self._metrics_session: aiohttp.ClientSession | None = None
        # A stream's reads wait as long as its first token may take: the stream's own watch
        # (_Watch) keeps the first-token and between-token timeouts.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, connect=c.connect_timeout_s, sock_read=None
        )
        self._get_timeout = aiohttp.ClientTimeout(total=c.connect_timeout_s)
        self._scrapes = self._metrics_at is not None
        self._runs: dict[str, _Run] = {}
        self._events: list[TokensOut | Finished | Failed] = []
        self.delivered = asyncio.Event()
        """Set when a stream delivers a first token, an end or a failure: the agent's step loop
    waits on it (at most ``poll_s``)."""
        self._text: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._ended: list[str] = []
        self._served: OrderedDict[int, None] = OrderedDict()
        self._stored: list[int] = []
        self._evicted: list[int] = []
        self._healthy = True
        self._busy_until_s = -math.inf
        self._logged: set[str] = set()
        self._health: asyncio.Task[None] | None = None
        self._scraper: asyncio.Task[None] | None = None
        self.scraped: ScrapedLoad | None = None
        self.scraped_at_s = -math.inf
        self.scrape_errors = 0
        self._rng = random.Random()
        self.kv_tracker: KVEventTracker | None = None
        self.kv_dropped = 0
        self._kv_awaited_s: float | None = None  # (when a finished request should have sent one)
        self.kv_silent = False
        """No KV event came within ``kv_silence_s`` of a finished request (warned once)."""
        self._kv_task: asyncio.Task[None] | None = None
        if c.kv_events is not None:
            self.kv_tracker = KVEventTracker(c.block_tokens, c.stride, c.kv_max_blocks)
        self.busy_s = 0.0
        self._last_step_s = time.monotonic()
        self.failures = 0

    # ------------------------------------------------------------------ lifecycle

    def _connector(self) -> aiohttp.BaseConnector:
        # No limit on connections, one kept per stream; idle ones close before a server's
        # keep-alive (uvicorn's 5 s) would close them under a new request.
        if self._socket is not None:
            return aiohttp.UnixConnector(self._socket, limit=0, keepalive_timeout=KEEPALIVE_S)
        return aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineError("the engine is not open")
        return self._session

    async def open(self) -> None:
        # The KV event socket first: one that cannot be bound or connected fails the start
        # before anything else is open.
        kv = self._kv_socket() if self.kv_tracker is not None else None
        try:
            self._session = aiohttp.ClientSession(connector=self._connector())
            if self.config.metrics_url is not None:
                self._metrics_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector())
            await self._check_health()
            self._health = asyncio.create_task(self._health_loop(), name="engine-health")
            if self._scrapes:
                await self._scrape()
                self._scraper = asyncio.create_task(self._scrape_loop(), name="engine-metrics")
        except Exception:  # a failed start leaves nothing open behind
            if kv is not None:
                _close_kv(*kv)
            await self.close()
            raise
        except asyncio.CancelledError:  # (a stop while it starts: it awaits nothing more)
            if kv is not None:
                _close_kv(*kv)
            raise
        if kv is not None:
            self._kv_task = asyncio.create_task(self._kv_loop(*kv), name="engine-kv-events")

    async def close(self) -> None:
        background = [t for t in (self._health, self._scraper, self._kv_task) if t is not None]
        tasks = [r.task for r in self._runs.values() if r.task is not None]
        for t in [*background, *tasks]:
            t.cancel()
        await asyncio.gather(*tasks, *background, return_exceptions=True)
        for session in (self._session, self._metrics_session):
            if session is not None:
                await session.close()

    async def _scrape_loop(self) -> None:
        while True:
            # Jittered, so that a fleet of agents does not scrape in step.
            await asyncio.sleep(self.config.metrics_every_s * self._rng.uniform(0.8, 1.2))
            try:
                await self._scrape()
            except Exception:  # a page nothing expects must not end the scraping for good
                self.scrape_errors += 1
                self._unexpected("agent.engine-metrics", "scraping %s failed", self._metrics_at)

    async def _scrape(self) -> None:
        assert self._metrics_at is not None
        session = self._metrics_session or self._http
        try:
            async with session.get(self._metrics_at, timeout=self._get_timeout) as r:
                if r.status != 200:
                    raise EngineMetricsError(f"the metrics endpoint answered {r.status}")
                text = await r.text()
            self.scraped = parse_load(text)
            self.scraped_at_s = time.monotonic()
        except (aiohttp.ClientError, TimeoutError, EngineMetricsError, UnicodeDecodeError) as exc:
            self.scrape_errors += 1
            log.debug("metrics of %s not read: %s", self.config.url, exc)

    def _kv_socket(self) -> tuple[Any, Any, _Links]:
        """The SUB socket of the engine's KV events, connected to its publisher (or bound,
        with ``kv_bind``, for a publisher that connects); an ``EngineError`` if it cannot."""
        import zmq
        import zmq.asyncio

        c = self.config
        assert c.kv_events is not None
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, c.kv_topic.encode())
        # The link monitor before the first link: its handshake must be seen to count it.
        links = _Links(sub)
        try:
            if c.kv_bind:
                sub.bind(c.kv_events)
            else:
                sub.connect(c.kv_events)
        except zmq.ZMQError as exc:
            _close_kv(ctx, sub, links)
            how = "bind" if c.kv_bind else "connect"
            raise EngineError(f"cannot {how} the KV event socket at {c.kv_events}: {exc}") from exc
        return ctx, sub, links

    async def _kv_loop(self, ctx: Any, sub: Any, links: _Links) -> None:
        """Follow the engine's KV events; a gap is filled from its replay socket first. A
        closed link to the publisher (its engine stopped) empties the mirror: what it held
        is gone with the engine, and a restarted one is heard afresh."""
        import zmq
        import zmq.asyncio

        c, tracker = self.config, self.kv_tracker
        assert c.kv_events is not None and tracker is not None
        try:
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(links.monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                if sub in ready:
                    await self._kv_drain(ctx, sub)
                if links.monitor in ready and await links.read():
                    # What the dead engine sent before its link closed: dropped, not applied
                    # after the mirror empties (the two sockets are read in no set order).
                    await self._kv_drain(ctx, sub, apply=False)
                    tracker.publisher_lost()
                    log.warning(
                        "the KV event publisher of %s went away: its cache is taken as "
                        "empty until its events say otherwise", c.url,
                    )  # fmt: skip
        finally:
            _close_kv(ctx, sub, links)

    async def _kv_drain(self, ctx: Any, sub: Any, *, apply: bool = True) -> None:
        """Every message waiting on the SUB socket: applied, or only read (``apply``)."""
        import zmq

        while True:
            try:
                frames = await sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if apply:
                await self._kv_message(ctx, frames)

    async def _kv_message(self, ctx: Any, frames: list[bytes]) -> None:
        c, tracker = self.config, self.kv_tracker
        assert tracker is not None
        try:
            seq, batch = decode_message(frames)
        except KVEventError as exc:
            self.kv_dropped += 1
            log.debug("KV event from %s dropped: %s", c.kv_events, exc)
            return
        except Exception:  # nothing the engine sends may end the following for good
            self.kv_dropped += 1
            self._unexpected("agent.kv-events", "a KV event from %s", c.kv_events)
            return
        restarts = tracker.stats.restarts
        gap = tracker.check(seq)
        if tracker.stats.restarts != restarts:
            log.warning("KV events of %s start again at %d: its engine restarted", c.url, seq)
        if gap is not None:
            # The missed batches first: the live one may continue a chain they began (a
            # prefill's blocks stored over several steps), which was orphaned.
            await self._kv_replay(ctx, gap, seq)
        tracker.fill(seq, batch)
        if batch.malformed:
            log.debug("KV events of %s skipped: %s", c.kv_events, batch.error)

    async def _kv_replay(self, ctx: Any, start: int, upto: int) -> None:
        import zmq

        tracker = self.kv_tracker
        assert tracker is not None and self.config.kv_events is not None
        address = self.config.kv_replay or replay_endpoint(self.config.kv_events)
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        got = 0
        try:
            # As a REQ socket frames it: vLLM's and SGLang's replay servers answer only a
            # request of three frames at their ROUTER, (identity, empty, sequence); a bare
            # sequence was refused there ("Invalid replay request"), and no gap was filled.
            await sock.send_multipart([b"", encode_seq(start)])
            while True:
                async with asyncio.timeout(self.config.connect_timeout_s):
                    frames = await sock.recv_multipart()
                try:
                    seq = decode_seq(frames[-2])
                    if seq == REPLAY_END or seq >= upto:
                        return
                    if seq >= start:
                        tracker.fill(seq, decode_batch(frames[-1]))
                        got += 1
                except (KVEventError, IndexError) as exc:
                    self.kv_dropped += 1
                    log.debug("KV replay frame dropped: %s", exc)
        except TimeoutError:
            log.warning("KV event replay from %s timed out", address)
        finally:
            sock.close(linger=0)
            missing = upto - start - got
            # (From 0, after a restart or a lost link, the buffer may well have rotated past
            # what the mirror never had: no shortfall of a gap.)
            if missing > 0 and start > 0:  # gone from the engine's replay buffer, or late
                tracker.stats.unfilled += missing
                log.warning(
                    "KV events %d-%d of %s could not be replayed (%d missing): the mirror "
                    "may keep blocks the engine evicted until its bound drops them",
                    start,
                    upto - 1,
                    self.config.url,
                    missing,
                )

    def _unexpected(self, site: str, message: str, *args: object) -> None:
        """An exception nothing expects, from an engine that may repeat it every second: its
        first logged with its traceback and counted, the rest counted (and logged at debug)."""
        if site in self._logged:
            INTERNAL_ERRORS.labels(site).inc()
            log.debug("[%s] " + message, site, *args, exc_info=True)
            return
        self._logged.add(site)
        internal_error(log, site, message + " (later ones: counted only)", *args)

    @property
    def metrics_stale(self) -> bool:
        """Scraping is on and its last figures are older than their bound."""
        if not self._scrapes:
            return False
        return time.monotonic() - self.scraped_at_s > self.config.metrics_stale_s

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_every_s)
            await self._check_health()

    async def _check_health(self) -> None:
        try:
            async with self._http.get(f"{self._base}/health", timeout=self._get_timeout) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok != self._healthy:
            log.warning("engine at %s is %s", self.config.url, "healthy" if ok else "unhealthy")
        self._healthy = ok

    @property
    def available(self) -> bool:
        """Healthy, not backing off (a 429 or 503 said it is busy), and its load known (stale
        metrics count as a saturated engine)."""
        return self._healthy and time.monotonic() >= self._busy_until_s and not self.metrics_stale

    def _back_off(self, retry_after: str | None) -> None:
        """The engine said it is busy: take no work for its ``Retry-After`` (seconds), within
        ``BUSY_S``; the request that heard it fails and runs again where there is room."""
        try:
            wait_s = float(retry_after) if retry_after is not None else BUSY_S[0]
        except ValueError:
            wait_s = BUSY_S[0]  # (an HTTP date, or garbage)
        if not math.isfinite(wait_s):
            wait_s = BUSY_S[0]
        wait_s = min(max(wait_s, BUSY_S[0]), BUSY_S[1])
        self._busy_until_s = max(self._busy_until_s, time.monotonic() + wait_s)
        log.warning("engine at %s is busy: no new work for %.1f s", self.config.url, wait_s)

    # ------------------------------------------------------------------ the protocol

    @property
    def block_tokens(self) -> int:
        return self.config.block_tokens

    @property
    def uses_prompt_hashes(self) -> bool:
        c = self.config
        return self.kv_tracker is None and c.digest_min_tokens is not None

    @property
    def has_work(self) -> bool:
        return bool(self._runs or self._events)

    def add(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        hashes: Sequence[int],
        now_s: float,
        prompt: str | Sequence[int] | None = None,
        sampling: Sampling | None = None,
    ) -> None:
        if prompt is None:
            raise EngineError("an HTTP engine needs the prompt's text or token ids")
        old = self._runs.get(request_id)
        if old is not None and not old.failed:
            raise EngineError(f"request {request_id} is already on the engine")
        if old is not None:  # its failure is reported: a retry here starts afresh
            self._drop(request_id)
            if request_id in self._ended:  # (the next step must not drop the new run)
                self._ended.remove(request_id)
        run = self._runs[request_id] = _Run(prompt_tokens, max(output_tokens, 1))
        if sampling is not None and sampling.logprobs is not None:
            run.top, run.logprobs = sampling.logprobs, []
        body: dict[str, Any] = {
            "model": self.config.model,
            "prompt": prompt if isinstance(prompt, str) else token_list(prompt),
            "max_tokens": output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling is not None:
            body.update(sampling.engine_fields())
        run.task = asyncio.create_task(self._stream(request_id, body), name=f"http-{request_id}")
        self._record(prompt_tokens, hashes)

    def step(self) -> Step:
        now = time.monotonic()
        if self._runs:  # busy: it has something to do (its utilisation, not summed requests)
            self.busy_s += now - self._last_step_s
        self._last_step_s = now
        for rid in self._ended:  # their text was read after the step that ended them
            for i in self._runs.pop(rid, _Run(0, 1)).pieces:
                self._text.pop(i, None)
        self._ended = []
        events, self._events = self._events, []
        for ev in events:
            if not isinstance(ev, TokensOut):
                self._ended.append(ev.request_id)
        return Step(self.config.poll_s, events)

    def cancel(self, request_id: str) -> bool:
        return self._drop(request_id)

    def _drop(self, request_id: str) -> bool:
        run = self._runs.pop(request_id, None)
        if run is None:
            return False
        if run.task is not None:
            run.task.cancel()  # closes the stream: the engine aborts the request
        for i in run.pieces:
            self._text.pop(i, None)
        return True

    def load(self) -> EngineLoad:
        """Its scraped load where known (at least what this agent has in flight there)."""
        m = self.scraped if not self.metrics_stale else None
        per_mille = 1000 if m is None and self._scrapes else 0
        if m is not None:
            per_mille = round(m.kv_usage * 1000)
        return EngineLoad(
            running=max(len(self._runs), m.running if m else 0),
            waiting=m.waiting if m else 0,
            pending_prefill_tokens=0,
            active_decode_tokens=0,
            kv_blocks_used=per_mille,
            kv_blocks_total=1000,
            busy_s=self.busy_s,
            kv_events=self._kv_counts(),
        )

    def _kv_counts(self) -> tuple[tuple[str, int], ...]:
        t = self.kv_tracker
        if t is None:
            return ()
        s = t.stats
        return (
            ("applied", s.batches),
            ("dropped", self.kv_dropped),
            ("gap", s.gaps),
            ("restart", s.restarts),
            ("orphan_block", s.orphans),
            ("other_tier_event", s.other_tier_events),
            ("conflicting_block", s.conflicts),
            ("unfilled", s.unfilled),
            ("malformed_event", s.malformed_events),
            ("publisher_lost", s.publishers_lost),
        )

    def in_flight(self) -> list[str]:
        return list(self._runs)

    def cache_changes(self) -> tuple[list[int], list[int]]:
        if self.kv_tracker is not None:
            return self.kv_tracker.cache_changes()
        out = (self._stored, self._evicted)
        self._stored, self._evicted = [], []
        return out

    def cached_blocks(self) -> list[int]:
        if self.kv_tracker is not None:
            return self.kv_tracker.cached_blocks()
        return list(self._served)

    def output_tokens(self, request_id: str, start: int, count: int) -> list[int]:
        run = self._runs.get(request_id)
        return [] if run is None else run.pieces[start : start + count]

    def output_logprobs(
        self, request_id: str, start: int, count: int, top: int
    ) -> list[TokenLogprob]:
        """The logprobs the engine streamed (``top`` was asked of it at :meth:`add`)."""
        run = self._runs.get(request_id)
        if run is None or run.logprobs is None:
            return []
        return run.logprobs[start : start + count]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(self._text.get(t, "") for t in tokens)

    # ------------------------------------------------------------------ streaming

    async def _stream(self, rid: str, body: dict[str, Any]) -> None:
        c = self.config
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        t_first: float | None = None
        watch: _Watch | None = None
        try:
            async with asyncio.timeout(None) as deadline:
                # One timer per stream, not a timeout per read: a token only notes its time.
                # It runs from the request (the wait for the answer's head counts) to the
                # first token, then between tokens: lines without text (keep-alive comments,
                # empty chunks) do not hold it off.
                watch = _Watch(loop, deadline, c.first_token_timeout_s, c.token_timeout_s)
                try:
                    async with self._http.post(
                        f"{self._base}/v1/completions", json=body, timeout=self._stream_timeout
                    ) as r:
                        if r.status in (429, 503):  # busy: no new work here for a while
                            self._back_off(r.headers.get("Retry-After"))
                        if r.status != 200:
                            # A bounded read: an error body may be huge, or never end.
                            detail = (await r.content.read(_ERROR_BYTES)).decode(errors="replace")
                            raise EngineError(f"the engine answered {r.status}: {detail}")
                        usage: dict[str, Any] | None = None
                        async for chunk in self._chunks(r):
                            if chunk.get("usage") is not None:
                                usage = chunk["usage"]
                            if self._take(rid, chunk):
                                watch.token(loop.time())
                                if t_first is None:
                                    t_first = time.monotonic()
                finally:
                    watch.stop()
            if usage is None:
                raise EngineError("the stream ended without usage")
            self._finished(rid, usage, t0, t_first)
        except asyncio.CancelledError:
            raise
        except TimeoutError as exc:
            why = watch.why() if watch is not None and watch.fired else ""
            self._fail(rid, exc, gone=True, why=why)
        except (aiohttp.ClientError, EngineError, ValueError) as exc:
            self._fail(rid, exc, gone=isinstance(exc, _GONE))
        except Exception as exc:  # an answer nothing above expects: the request fails, typed
            self._unexpected("agent.engine-stream", "engine at %s answered %s", c.url, rid)
            self._fail(rid, exc, gone=False)

    def _fail(self, rid: str, exc: BaseException, *, gone: bool, why: str = "") -> None:
        self.failures += 1
        if gone:
            # The engine is gone or hangs: take no more work until a health check passes
            # (its agent refuses assignments and heartbeats no free capacity meanwhile).
            self._healthy = False
        run = self._runs.get(rid)
        if run is not None and not run.failed:
            run.failed = True
            what = f"{exc!r} ({why})" if why else repr(exc)
            self._emit(Failed(rid, f"engine {self.config.url}: {what}"))

    async def _chunks(self, r: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        """The stream's JSON events; raises ``EngineError`` on a malformed line or a stream
        cut before ``[DONE]``."""
        async for raw in r.content:
            line = raw.strip()
            if not line or line.startswith(b":"):
                continue
            if not line.startswith(b"data:"):
                raise EngineError(f"not an SSE data line: {line[:80]!r}")
            data = line[5:].lstrip()
            if data == b"[DONE]":
                return
            try:
                chunk = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise EngineError(f"a malformed SSE event: {data[:80]!r}") from exc
            if not isinstance(chunk, dict):
                raise EngineError("an SSE event that is not an object")
            reported = _reported(chunk)
            if reported is not None:
                raise EngineError(f"the engine reported an error: {reported}")
            yield chunk
        raise EngineError("the stream ended before [DONE]")

    def _has(self, rid: str) -> bool:
        run = self._runs.get(rid)
        return bool(run and run.pieces)

    def _emit(self, event: TokensOut | Finished | Failed) -> None:
        self._events.append(event)
        # A first token, an end or a failure is relayed at once; later tokens are coalesced
        # into chunks anyway (token_flush_ms), so they wait for the poll instead of waking the
        # loop once each.
        if not isinstance(event, TokensOut) or event.first:
            self.delivered.set()

    def _take(self, rid: str, chunk: dict[str, Any]) -> bool:
        """Make pieces of a chunk's text (one per token, with its logprobs, for a request
        that asked for them); whether it had any."""
        run = self._runs.get(rid)
        if run is None or run.logprobs is None:
            texts = _texts(chunk)
            for text in texts:
                self._piece(rid, text, first=not self._has(rid))
            return bool(texts)
        text = run.held + "".join(_texts(chunk))
        entries = _logprobs(chunk, run.top)
        if not entries:  # (SGLang may send a chunk's text before its tokens' logprobs)
            run.held = text
            return False
        run.held = ""
        for i, e in enumerate(entries):
            # The chunk's text on its first token: the tokens' own texts need not add up to
            # it (a character split over two tokens decodes to nothing whole on either).
            self._piece(rid, text if i == 0 else "", first=not self._has(rid), logprob=e)
        return bool(entries)

    def _piece(
        self, rid: str, text: str, *, first: bool, logprob: TokenLogprob | None = None
    ) -> None:
        run = self._runs.get(rid)
        if run is None:
            return
        if len(run.pieces) >= run.max_pieces:  # each piece is one token or more
            raise EngineError(f"the engine sent more than the {run.max_pieces} tokens asked for")
        i = next(self._ids)
        self._text[i] = text
        run.pieces.append(i)
        if run.logprobs is not None and logprob is not None:
            run.logprobs.append(logprob)
        self._emit(TokensOut(rid, 1, first))

    def _finished(self, rid: str, usage: dict[str, Any], t0: float, t_first: float | None) -> None:
        run = self._runs.get(rid)
        if run is None:
            return
        if not isinstance(usage, dict):
            raise EngineError(f"usage that is not an object: {str(usage)[:80]}")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = _count(usage.get("prompt_tokens"), "prompt_tokens") or run.prompt_tokens
        output = _count(usage.get("completion_tokens"), "completion_tokens") or len(run.pieces)
        if output > run.max_pieces:
            raise EngineError(f"the engine counted {output} tokens, {run.max_pieces} asked for")
        if run.logprobs is not None:
            output = len(run.pieces)  # one per token streamed with its logprobs, no more
            if run.held:  # text after the last token's logprobs: the last piece's
                if not run.pieces:
                    raise EngineError("the engine streamed text without the logprobs asked for")
                self._text[run.pieces[-1]] += run.held
        if output > len(run.pieces):
            # Tokens whose text came in another token's piece (an engine streams several
            # tokens at once under load) or never came (held back for a stop string that then
            # matched, a special token): counted, with no text, so that the result has the
            # engine's count and its finish reason follows (``length`` only at max_tokens).
            gap, none_yet = output - len(run.pieces), not run.pieces
            run.pieces.extend(itertools.islice(self._ids, gap))
            self._emit(TokensOut(rid, gap, none_yet))
        # More cached than prompt tokens is no engine's count: at most the prompt was cached.
        cached_n = min(_count(cached, "cached_tokens"), prompt)
        now = time.monotonic()
        first = t_first if t_first is not None else now
        self._emit(Finished(rid, prompt, cached_n, output, first - t0, now - first))
        if prompt >= self.config.block_tokens:
            self._kv_heard(now)

    def _kv_heard(self, now: float) -> None:
        t = self.kv_tracker
        if t is None or self.kv_silent or t.stats.batches:
            return
        if self._kv_awaited_s is None:
            self._kv_awaited_s = now
        elif now - self._kv_awaited_s >= self.config.kv_silence_s:
            self.kv_silent = True
            log.warning(
                "no KV event has come from %s's publisher at %s in %.0f s of finished "
                "requests: vLLM and SGLang bind an ipc:// endpoint or one with '*' and "
                "connect to any other (then set engine_kv_bind), the topic must match "
                "(engine_kv_topic %r), and the engine must publish (--kv-events-config, "
                "prefix caching on); until then the digest is empty",
                self.config.url, self.config.kv_events, now - self._kv_awaited_s,
                self.config.kv_topic,
            )  # fmt: skip

    def _record(self, prompt_tokens: int, hashes: Sequence[int]) -> None:
        """The digest stand-in: blocks of the prompts this engine served, most recent kept."""
        c = self.config
        # Not with KV events: the engine's own events say what it holds.
        if not self.uses_prompt_hashes or len(hashes) * c.block_tokens < (c.digest_min_tokens or 0):
            return
        for h in hashes[c.stride - 1 :: c.stride]:
            if h in self._served:
                self._served.move_to_end(h)
                continue
            self._served[h] = None
            self._stored.append(h)
            while len(self._served) > c.max_blocks:
                old, _ = self._served.popitem(last=False)
                self._evicted.append(old)


_ERROR_BYTES = 300
"""What an error answer's body is read of, at most (for its message)."""
_MOST_TOKENS = 1 << 31
"""A token count above this is no engine's."""


def _reported(chunk: dict[str, Any]) -> str | None:
    """The message of an error the engine streamed: vLLM's ``{"error": {"message": ...}}``,
    or its older ``{"object": "error", "message": ...}`` (which read as a chunk without text,
    and failed its request as a stream "without usage", the engine's reason lost)."""
    err = chunk.get("error")
    if err is None and chunk.get("object") == "error":
        err = chunk
    if err is None:
        return None
    message = err.get("message") if isinstance(err, dict) else None
    return str(message if message is not None else err)[:300]


def _texts(chunk: dict[str, Any]) -> list[str]:
    """The text of each of a chunk's choices (OpenAI's completion chunk), its shape checked:
    an engine's garbage fails the request instead of passing for an answer."""
    choices = chunk.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list):
        raise EngineError(f"choices that are not a list: {str(choices)[:80]}")
    out = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise EngineError(f"a choice that is not an object: {str(choice)[:80]}")
        text = choice.get("text")
        if text is None:
            continue
        if not isinstance(text, str):
            raise EngineError(f"a choice's text that is not a string: {str(text)[:80]}")
        _encodable(text)
        if text:
            out.append(text)
    return out


def _encodable(text: str) -> str:
    """``text``, if it can be sent (JSON's lone surrogates, ``"\\ud83d"``, cannot: the agent
    failed to encode the chunk, its engine loop with it)."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise EngineError(f"text that is not Unicode: {exc}") from None
    return text


def _logprobs(chunk: dict[str, Any], top: int) -> list[TokenLogprob]:
    """The logprobs of a completion chunk's tokens (OpenAI's legacy completions shape, which
    vLLM and SGLang send: ``tokens``, ``token_logprobs``, ``top_logprobs``; or the chat shape,
    ``content``, which llama.cpp's server sends), with the ``top`` most likely tokens at each
    position; their shape checked as :func:`_texts` checks text."""
    out: list[TokenLogprob] = []
    for choice in chunk.get("choices") or ():
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if lp is None:
            continue
        if not isinstance(lp, dict):
            raise EngineError(f"logprobs that are not an object: {str(lp)[:80]}")
        if "content" in lp and "tokens" not in lp:
            out += _chat_shaped(lp["content"], top)
            continue
        tokens, values, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
        if not tops and isinstance(tokens, list):  # (SGLang sends [] when none were asked)
            tops = [None] * len(tokens)
        if not (
            isinstance(tokens, list)
            and isinstance(values, list)
            and isinstance(tops, list)
            and len(tokens) == len(values) == len(tops)
        ):
            raise EngineError(f"logprobs whose lists do not pair up: {str(lp)[:80]}")
        for token, value, alternatives in zip(tokens, values, tops, strict=True):
            if not isinstance(token, str):
                raise EngineError(f"a logprob token that is not a string: {str(token)[:80]}")
            entry = TokenLogprob(
                text=_encodable(token), logprob=_logprob(value), top=_top(alternatives, top)
            )
            out.append(entry)
    return out


def _chat_shaped(content: Any, top: int) -> list[TokenLogprob]:
    """``content: [{token, logprob, top_logprobs: [{token, logprob}]}]`` as entries."""
    if not isinstance(content, list):
        raise EngineError(f"logprobs content that is not a list: {str(content)[:80]}")
    out = []
    for item in content:
        if not isinstance(item, dict) or not isinstance(item.get("token"), str):
            raise EngineError(f"a logprobs content entry without a token: {str(item)[:80]}")
        alternatives = item.get("top_logprobs") or []
        if not isinstance(alternatives, list) or not all(
            isinstance(a, dict) and isinstance(a.get("token"), str) for a in alternatives
        ):
            raise EngineError(f"top logprobs that are not a list of tokens: {str(item)[:80]}")
        ranked = {a["token"]: a.get("logprob") for a in alternatives}
        out.append(
            TokenLogprob(
                text=_encodable(item["token"]),
                logprob=_logprob(item.get("logprob")),
                top=_top(ranked, top),
            )
        )
    return out


def _logprob(value: Any) -> float:
    """A log probability as engines send it (null for none: vLLM's -inf), kept within the
    wire's range."""
    if value is None:
        return LOGPROB_FLOOR
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise EngineError(f"a logprob that is not a number: {str(value)[:80]}")
    return min(0.0, max(LOGPROB_FLOOR, float(value)))


def _top(alternatives: Any, top: int) -> list[TopLogprob]:
    """The ``top`` most likely of a position's ``{token: logprob}`` (vLLM adds the chosen
    token to them, wherever it ranks)."""
    if alternatives is None:
        return []
    if not isinstance(alternatives, dict):
        raise EngineError(f"top logprobs that are not an object: {str(alternatives)[:80]}")
    ranked = sorted(
        ((_logprob(v), _encodable(str(k))) for k, v in alternatives.items()), reverse=True
    )
    return [TopLogprob(text=k, logprob=v) for v, k in ranked[:top]]


def _count(value: Any, name: str) -> int:
    """A token count of the engine's usage: a whole number from 0 to 2**31 (0 if absent)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MOST_TOKENS:
        raise EngineError(f"usage {name} is not a token count: {str(value)[:40]}")
    return value


class _Watch:
    """The first-token and between-token timeouts of one stream: a timer checks, when a
    timeout could have passed, whether a token came since (then it waits again from that
    token), and otherwise moves the stream's deadline to now, which cancels its read."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: asyncio.Timeout,
        first_s: float,
        between_s: float,
    ) -> None:
        self.loop, self.deadline, self.between_s = loop, deadline, between_s
        self.first_s = first_s
        self.fired = False
        """The stream's deadline was moved to now: a timeout passed."""
        self.first = True
        """No token yet: the first-token timeout runs."""
        self.last_s = loop.time()
        self._handle = loop.call_at(self.last_s + first_s, self._check)

    def token(self, now_s: float) -> None:
        """A token came: from now on the between-token timeout runs, from this one."""
        self.last_s = now_s
        if self.first:
            self.first = False
            self._handle.cancel()
            self._handle = self.loop.call_at(now_s + self.between_s, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if self.first:  # no token yet: the first-token timeout has passed
            self.fired = True
            self.deadline.reschedule(now)
            return
        due = self.last_s + self.between_s
        if due <= now:
            self.fired = True
            self.deadline.reschedule(now)
        else:
            self._handle = self.loop.call_at(due, self._check)

    def stop(self) -> None:
        self._handle.cancel()

    def why(self) -> str:
        """Which timeout passed."""
        if self.first:
            return f"no first token within first_token_timeout_s of {self.first_s:g} s"
        return f"no token within token_timeout_s of {self.between_s:g} s of the last"


class _Links:
    """The links of a KV event SUB socket, from a monitor of it: a link counts once its
    ZeroMQ handshake succeeded, and only the close of such a link is a publisher lost.
    libzmq also reports a link closed after a handshake that failed (a proxy that accepts and
    closes while the engine loads; a TCP probe of a bound port), which emptied a live mirror
    (a reviewer's probe)."""

    def __init__(self, sub: Any) -> None:
        import zmq

        self.failures = frozenset(
            (
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
            )
        )
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        for event in self.failures:
            events |= event
        self.monitor = sub.get_monitor_socket(events)
        self.up = 0
        self.failed = 0

    async def read(self) -> bool:
        """Read the monitor's waiting events; True if the last live link closed."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        lost = False
        while True:
            try:
                frames = await self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return lost
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up += 1
            elif event in self.failures:
                self.failed += 1
            elif event == zmq.EVENT_DISCONNECTED:
                if self.failed:  # the close of a link that never came up
                    self.failed -= 1
                elif self.up:
                    self.up -= 1
                    lost = lost or self.up == 0


def _close_kv(ctx: Any, sub: Any, links: _Links) -> None:
    """Close a KV event socket, its monitor and their context."""
    sub.disable_monitor()
    links.monitor.close(linger=0)
    sub.close(linger=0)
    ctx.term()

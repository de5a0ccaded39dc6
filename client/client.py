"""The producer library: submit requests, stream their tokens, await their results."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError
from pydantic import BaseModel, ValidationError

from sluice.client.errors import (
    InvalidRequest,
    MalformedResult,
    NotConnected,
    QueueFull,
    ResultTimeout,
    ServiceUnavailable,
    SluiceError,
    rejection_error,
)
from sluice.client.sampling import sampling_of
from sluice.client.settings import (
    DEFAULT_PUBLISH_RETRY_S,
    DEFAULT_PUBLISH_TIMEOUT_S,
    ClientSettings,
)
from sluice.client.subscriptions import DEFAULT_ACK_WAIT_S, ResultSubscription
from sluice.common.aio import stop_if_cancelled, wait_at_most
from sluice.common.chattemplate import ChatOptions, ChatTemplate, chat_prompt
from sluice.common.tokenizer import PromptTokenizer
from sluice.common.transport import BrokerAuth, TransportError, connect
from sluice.schemas import names
from sluice.schemas.codec import decode, encode, summarise
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import (
    CancelReply,
    CancelRequest,
    DispatcherStats,
    QueuedNotice,
    ReconcileReport,
    Result,
    Sampling,
    SubmitRequest,
    TokenChunk,
    WaitEstimate,
    WaitQuery,
    WorkerList,
)
from sluice.schemas.tokens import TokenIds

_RESULT_POLL_S = 2.0
_NATS_ERRORS = (nats.errors.Error, OSError)
"""What nats-py raises when the broker is away or the connection closed (its JetStream
errors derive from ``nats.errors.Error``): the client raises ``ServiceUnavailable`` for them."""
_RECONNECTING_ERRORS = (
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
)
"""What a publish may raise while the client moves to another server: retried."""
_PUBLISH_BACKOFF_S = (0.05, 1.0)
"""The first and the largest wait between two publishes of one submit (doubling, with
jitter)."""
_STREAM_LOOKUP_TIMEOUT_S = 1.0
_HEADER_BYTES = 64
"""A request message's header block but its message id (``NATS/1.0``, the header name)."""
log = logging.getLogger("sluice.client")
R = TypeVar("R", bound=BaseModel)


class _Transient(Exception):
    """A publish failure that a leader change or a reconnect explains: published again."""


@contextlib.contextmanager
def unavailable_on_broker_errors(what: str) -> Iterator[None]:
    """Translate nats-py's errors into :class:`ServiceUnavailable` (the client raises only
    its own types)."""
    try:
        yield
    except _NATS_ERRORS as exc:
        raise ServiceUnavailable(f"cannot {what}: {exc}") from exc


class RequestHandle:
    """One submitted request. ``async for chunk in handle`` streams its tokens as the worker
    produces them (each chunk once, in order, even across a retry on another worker);
    ``await handle.result()`` returns the final :class:`Result` or raises ``Rejected``."""

    def __init__(self, client: Client, request: SubmitRequest) -> None:
        self._client = client
        self.request = request
        self.request_id = request.request_id
        self._chunks: asyncio.Queue[TokenChunk | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._result: asyncio.Future[Result] = loop.create_future()
        self._delivered = 0  # tokens handed to the iterator so far
        self._subs: list[Subscription] = []
        self._cleanup: asyncio.Task[None] | None = None
        self.queued: asyncio.Future[QueuedNotice | None] = loop.create_future()
        """Resolves with the dispatcher's :class:`QueuedNotice` when the request is held in
        the queue (where it stands, its expected wait, what holds it), or with None once it
        started (or ended) without being held: ``notice = await handle.queued``."""

    # -- subscriptions (set up before the publish, so nothing is missed)

    async def _subscribe(self, nc: NATS) -> None:
        with unavailable_on_broker_errors("subscribe to the request's results"):
            try:  # each subscription is kept as it is made, so a failure drops what was made
                self._subs.append(
                    await nc.subscribe(
                        names.token_subject(self.request.tenant, self.request_id), cb=self._on_chunk
                    )
                )
                self._subs.append(
                    await nc.subscribe(
                        names.result_subject(self.request.tenant, self.request_id),
                        cb=self._on_result,
                    )
                )
            except BaseException:
                await self._unsubscribe()
                raise

    async def _unsubscribe(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            # A closed connection has dropped its subscriptions already.
            with contextlib.suppress(*_NATS_ERRORS):
                await sub.unsubscribe()

    async def _on_chunk(self, msg: Msg) -> None:
        try:
            chunk = decode(msg.data, TokenChunk)
        except DecodeError as exc:
            try:  # the request's stream also carries the dispatcher's queued notice
                self._notice(decode(msg.data, QueuedNotice))
            except DecodeError:
                # Live tokens are best effort: the result carries every token.
                log.warning("malformed token chunk for %s dropped: %s", self.request_id, exc)
            return
        self._notice(None)
        self._chunks.put_nowait(chunk)

    def _notice(self, notice: QueuedNotice | None) -> None:
        if not self.queued.done():
            self.queued.set_result(notice)

    async def _on_result(self, msg: Msg) -> None:
        try:
            result = decode(msg.data, Result)
        except DecodeError as exc:
            self._end(MalformedResult(self.request_id, str(exc)))
            return
        self._set_result(result)

    def _set_result(self, result: Result) -> None:
        if not self._result.done():  # the first result wins: results are deduplicated here
            self._result.set_result(result)
            self._closed()

    def _end(self, error: SluiceError) -> None:
        if not self._result.done():
            self._result.set_exception(error)
            self._closed()

    def _closed(self) -> None:
        self._notice(None)
        self._chunks.put_nowait(None)
        self._cleanup = asyncio.get_running_loop().create_task(self._unsubscribe())

    # -- public API

    @property
    def done(self) -> bool:
        return self._result.done()

    async def result(self, timeout_s: float | None = None) -> Result:
        """The final result. Raises ``Rejected`` (or ``DeadlineExceeded``) if the request was
        not run, ``ResultTimeout`` after ``timeout_s`` seconds without one."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._result.done():
            wait = _RESULT_POLL_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise ResultTimeout(
                        f"no result for {self.request_id} after {timeout_s}s; it may still "
                        "finish: Client.fetch_result() picks it up later"
                    )
            await wait_at_most(asyncio.shield(self._result), wait)
            if not self._result.done():
                # A result published while we were reconnecting is still in the stream.
                try:
                    found = await self._client._lookup_result(self.request.tenant, self.request_id)
                except ServiceUnavailable:
                    if self._client.closed:
                        raise  # a closed connection never delivers the result
                    continue  # the broker is away: keep waiting, the subscription may deliver
                except MalformedResult as exc:
                    self._end(exc)
                    continue
                if found is not None:
                    self._set_result(found)
        result = self._result.result()
        if not result.ok and result.rejection is not None:
            raise rejection_error(self.request_id, result.rejection, result)
        return result

    async def cancel(self, timeout_s: float = 10.0) -> CancelReply:
        """Cancel this request: queued, it never runs; running, its worker stops it. Its
        result then raises :class:`Cancelled` (with the tokens produced so far), and the token
        stream ends. The reply says ``cancelled``, ``finished`` (it had ended: its result
        stands) or ``unknown``."""
        return await self._client.cancel(
            self.request_id, tenant=self.request.tenant, timeout_s=timeout_s
        )

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[TokenChunk]:
        while True:
            chunk = await self._chunks.get()
            if chunk is None:
                break
            if chunk.index + len(chunk.tokens) <= self._delivered:
                continue  # already delivered (a retried attempt streams the same positions)
            skip = max(0, self._delivered - chunk.index)
            if skip or chunk.index > self._delivered:
                if chunk.index > self._delivered:
                    continue  # a gap (a lost chunk): the result fills it in below
                tokens = chunk.tokens[skip:]
                chunk = TokenChunk(
                    request_id=chunk.request_id,
                    attempt=chunk.attempt,
                    index=self._delivered,
                    tokens=tokens,
                    text=_text_of(chunk, skip),
                    logprobs=None if chunk.logprobs is None else chunk.logprobs[skip:],
                )
            self._delivered += len(chunk.tokens)
            yield chunk
        result = await self.result()  # raises Rejected for a request that did not run
        if len(result.output_tokens) > self._delivered:
            rest = result.output_tokens[self._delivered :]
            lps = result.logprobs
            tail = TokenChunk(
                request_id=self.request_id,
                attempt=result.attempt or 1,
                index=self._delivered,
                tokens=rest,
                text=_tail_text(result, self._delivered),
                logprobs=None if lps is None else lps[self._delivered :],
            )
            self._delivered = len(result.output_tokens)
            yield tail


def _text_of(chunk: TokenChunk, skip: int) -> str:
    # Token text is one leading-space word per token for simulated engines; for real engines
    # a chunk's text cannot be split by token, so a partially repeated chunk keeps its text.
    words = chunk.text.split(" ")[1:]
    if len(words) == len(chunk.tokens):
        return "".join(" " + w for w in words[skip:])
    return chunk.text


def _tail_text(result: Result, delivered: int) -> str:
    words = result.text.split(" ")[1:]
    if len(words) == len(result.output_tokens):
        return "".join(" " + w for w in words[delivered:])
    return ""


@dataclass(frozen=True)
class Retry:
    """How ``Client.submit`` retries a ``QueueFull``: up to ``attempts`` more times, each after
    the queue's retry-after (the dispatcher's expected wait) times a random factor within
    ``1 ± jitter`` (so that refused producers do not all come back at once), at most
    ``max_wait_s`` per wait. The same request id is submitted again: it never runs twice."""

    attempts: int = 3
    jitter: float = 0.25
    max_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 0 or not 0 <= self.jitter < 1 or self.max_wait_s <= 0:
            raise InvalidRequest("retry needs attempts >= 0, 0 <= jitter < 1, max_wait_s > 0")

    def delay(self, retry_after_s: float, rng: random.Random) -> float:
        """The wait before the next attempt."""
        factor = rng.uniform(1 - self.jitter, 1 + self.jitter)
        return min(self.max_wait_s, max(0.0, retry_after_s) * factor)


class Client:
    """Connects to NATS and submits requests to Sluice.

    ``async with Client("nats://127.0.0.1:4222") as c: h = await c.submit("m", "hi")``.
    """

    def __init__(
        self,
        nats_url: str = "nats://127.0.0.1:4222",
        *,
        tenant: str = "default",
        band: str = "standard",
        nc: NATS | None = None,
        publish_timeout_s: float = DEFAULT_PUBLISH_TIMEOUT_S,
        publish_retry_s: float = DEFAULT_PUBLISH_RETRY_S,
        queue_full_retry_after_s: float = 1.0,
        tokenizer: PromptTokenizer | None = None,
        auth: BrokerAuth | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.auth = auth
        """Who the client is on the broker (its role's user, inbox prefix, TLS); None:
        anonymous, plain TCP."""
        self.tokenizer = tokenizer
        """Turns text prompts into token ids before they are sent
        (:mod:`sluice.common.tokenizer`)."""
        self.chat_template = chat_template
        """Renders chats (:meth:`chat_prompt`) as the model reads them; None: Sluice's
        neutral template (:func:`sluice.common.chat.render_chat`)."""
        self.tenant = tenant
        self.band = band
        self.publish_timeout_s = publish_timeout_s
        self.publish_retry_s = publish_retry_s
        """How long a submit publishes again after a transient failure (a timeout, no
        responders or a 503 while a JetStream stream leader moves, a reconnect), with the
        same ``Nats-Msg-Id`` so the broker stores it once; then ``ServiceUnavailable``."""
        self.queue_full_retry_after_s = queue_full_retry_after_s
        self._nc = nc
        self._own_nc = nc is None
        self._rng = random.Random()

    @classmethod
    def from_settings(cls, settings: ClientSettings) -> Client:
        return cls(
            settings.nats_url,
            tenant=settings.tenant,
            band=settings.band,
            publish_timeout_s=settings.publish_timeout_s,
            publish_retry_s=settings.publish_retry_s,
            queue_full_retry_after_s=settings.queue_full_retry_after_s,
            auth=settings.broker_auth(),
            tokenizer=(
                None
                if settings.tokenizer is None
                else PromptTokenizer.from_file(settings.tokenizer)
            ),
            chat_template=(
                None
                if settings.chat_template is None
                else ChatTemplate.from_file(settings.chat_template)
            ),
        )

    def chat_prompt(self, messages: Any, options: ChatOptions | None = None) -> str | list[int]:
        """The prompt of an OpenAI ``messages`` list: rendered with :attr:`chat_template` (as
        token ids with :attr:`tokenizer`), or Sluice's neutral template. Raises
        :class:`~sluice.common.chat.ChatError`."""
        return chat_prompt(messages, options, self.chat_template, self.tokenizer)

    async def connect(self) -> Client:
        if self._nc is None:
            try:
                self._nc = await connect(self.nats_url, "sluice-client", auth=self.auth)
            except TransportError as exc:
                raise ServiceUnavailable(str(exc)) from exc
        return self

    async def close(self) -> None:
        if self._own_nc and self._nc is not None:
            # Closing a broken connection: nats-py also writes what it still had to send to
            # a transport the event loop closed when the broker died (uvloop: RuntimeError).
            with contextlib.suppress(*_NATS_ERRORS, RuntimeError):
                await self._nc.close()
        self._nc = None

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        """Whether the connection is gone for good (closed, or never opened)."""
        return self._nc is None or self._nc.is_closed

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise NotConnected("client is not connected: use 'async with Client(...)'")
        return self._nc

    async def submit(
        self,
        model: str,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        band: str | None = None,
        tenant: str | None = None,
        request_id: str | None = None,
        deadline_s: float | None = None,
        retry: Retry | int | None = None,
        session_id: str | None = None,
        sampling: Sampling | Mapping[str, Any] | None = None,
    ) -> RequestHandle:
        """Queue a request and return its handle.

        ``prompt`` is text or token ids. ``request_id`` is the idempotency key: submitting the
        same id again (within the broker's duplicate window) does not run it twice.
        ``deadline_s``: if still queued this many seconds from now, it is rejected with
        ``deadline_exceeded`` instead of run. Raises ``QueueFull`` at once when the band's
        queue is at its bound, unless ``retry`` (a :class:`Retry`, or a number of retries)
        says to submit again after the queue's retry-after, with jitter, a bounded number of
        times; ``InvalidRequest`` for bad arguments; ``ServiceUnavailable`` when no dispatcher
        serves the band, or when the broker did not take the request within
        ``publish_retry_s`` (a publish that times out or meets a leader change of a JetStream
        cluster is sent again until then, with the same id). ``session_id``: the requests of
        one session (a conversation) stick to the workers that served it. ``sampling``: how
        the engine samples the output (:class:`~sluice.schemas.models.Sampling`, or a mapping
        of its fields: ``temperature``, ``top_p``, ``seed``, ``stop``, ...); unset fields
        keep the engine's defaults.
        """
        if retry is not None and not isinstance(retry, Retry | int):
            raise InvalidRequest(f"retry must be a Retry or a number of retries, not {retry!r}")
        policy = Retry(attempts=retry) if isinstance(retry, int) else retry or Retry(attempts=0)
        request = self._build(
            model, prompt, max_tokens, band, tenant, request_id, deadline_s, session_id, sampling
        )
        handle = RequestHandle(self, request)
        await handle._subscribe(self.nc)
        started = time.monotonic()
        try:
            for attempt in range(policy.attempts + 1):
                try:
                    await self._publish(request)
                    break
                except QueueFull as exc:
                    wait = policy.delay(exc.retry_after_s, self._rng)
                    late = deadline_s is not None and time.monotonic() - started + wait > deadline_s
                    if attempt == policy.attempts or late:
                        raise
                    await asyncio.sleep(wait)
            # nats-py swallows a cancellation that meets its publish path: a caller told to
            # stop ran on (a benchmark's loop of submits, in one try of two).
            stop_if_cancelled()
        except BaseException:
            await handle._unsubscribe()
            raise
        return handle

    def _build(
        self,
        model: str,
        prompt: str | Sequence[int],
        max_tokens: int,
        band: str | None,
        tenant: str | None,
        request_id: str | None,
        deadline_s: float | None,
        session_id: str | None = None,
        sampling: Sampling | Mapping[str, Any] | None = None,
    ) -> SubmitRequest:
        if deadline_s is not None and deadline_s <= 0:
            raise InvalidRequest(f"deadline_s must be > 0, got {deadline_s}")
        tokens: Sequence[int] | None
        text: str | None
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty")
            if not prompt.isascii():  # (O(1) for ASCII text: no copy on the common path)
                try:  # a lone surrogate failed the publish with a bare UnicodeEncodeError
                    prompt.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise InvalidRequest(
                        f"the prompt is not valid Unicode: {exc.reason} at {exc.start}"
                    ) from None
            tokens, text = None, prompt
            if self.tokenizer is not None:
                tokens, text = self.tokenizer.encode(prompt), None
                if not tokens:
                    raise InvalidRequest("the prompt has no tokens for the configured tokenizer")
        else:
            try:  # checked in C: a Python check per id cost more than the rest of a submit
                tokens, text = TokenIds(prompt), None
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
            if not tokens:
                raise InvalidRequest("prompt has no tokens")
        now_ms = int(time.time() * 1000)
        try:
            return SubmitRequest(
                request_id=request_id or uuid.uuid4().hex,
                model=model,
                tenant=tenant or self.tenant,
                band=band or self.band,
                prompt_tokens=tokens,
                prompt_text=text,
                max_tokens=max_tokens,
                submitted_unix_ms=now_ms,
                deadline_unix_ms=None if deadline_s is None else now_ms + int(deadline_s * 1000),
                session_id=session_id,
                sampling=sampling_of(sampling),
            )
        except ValidationError as exc:
            raise InvalidRequest(str(exc)) from exc

    async def enqueue(
        self,
        model: str,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        band: str | None = None,
        tenant: str | None = None,
        request_id: str | None = None,
        deadline_s: float | None = None,
        session_id: str | None = None,
        sampling: Sampling | Mapping[str, Any] | None = None,
    ) -> str:
        """Queue a request without following it (offline work: its result is picked up
        later, with :meth:`fetch_result` or :meth:`results`); returns its request id. Raises
        as :meth:`submit` does (``QueueFull`` at once: no retry here)."""
        request = self._build(
            model, prompt, max_tokens, band, tenant, request_id, deadline_s, session_id, sampling
        )
        await self._publish(request)
        return request.request_id

    async def _publish(self, r: SubmitRequest) -> None:
        """Publish a request and wait for the broker's acknowledgement. A transient failure
        (no acknowledgement in ``publish_timeout_s``, no responders or a 503 while a stream
        leader is elected, a reconnect to another server) is published again, with backoff,
        for up to ``publish_retry_s``: the same ``Nats-Msg-Id`` (the request id) makes the
        broker store it once however many attempts reached it. ``QueueFull`` and permanent
        errors are raised at once."""
        subject = names.request_subject(r.band, r.model, r.tenant)
        try:
            payload = encode(r)
        except UnicodeEncodeError as exc:  # a str holding a lone surrogate: no UTF-8 for it
            raise InvalidRequest(
                f"the request holds text that is not valid Unicode ({exc.reason}): "
                f"{exc.object[exc.start : exc.end]!a}"
            ) from None
        limit = self.nc.max_payload
        # The broker counts the headers too (the message id, in a NATS/1.0 header block).
        size = len(payload) + len(r.request_id) + _HEADER_BYTES
        if limit and size > limit:  # it would refuse it on every attempt
            raise InvalidRequest(
                f"the request is {size} bytes on the wire, more than the broker's max_payload "
                f"of {limit} bytes: shorten the prompt (or raise max_payload in the NATS "
                "server's configuration)"
            )
        deadline = time.monotonic() + self.publish_retry_s
        backoff, most = _PUBLISH_BACKOFF_S
        while True:
            try:
                await self._publish_once(r, subject, payload)
                return
            except _Transient as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServiceUnavailable(str(exc)) from exc.__cause__
                log.debug("submit of %s published again: %s", r.request_id, exc)
                await asyncio.sleep(min(left, backoff * self._rng.uniform(0.75, 1.25)))
                backoff = min(most, backoff * 2)

    async def _publish_once(self, r: SubmitRequest, subject: str, payload: bytes) -> None:
        """One attempt; raises ``_Transient`` for what another attempt may get through."""
        try:
            await self.nc.jetstream().publish(
                subject,
                payload,
                headers={names.MSG_ID_HEADER: r.request_id},
                timeout=self.publish_timeout_s,
            )
        except APIError as exc:
            if exc.err_code == names.JS_ERR_MAX_MSGS:
                raise await self._queue_full(r, exc) from exc
            if exc.code == 503:  # JetStream or the stream's leader is being elected
                raise _Transient(f"submit to {subject} failed: {exc}") from exc
            raise ServiceUnavailable(f"submit to {subject} failed: {exc}") from exc
        except NoStreamResponseError as exc:
            if await self._no_stream_for(subject):
                raise ServiceUnavailable(
                    f"no stream accepts {subject}: band {r.band!r} is unknown or no dispatcher "
                    "has started"
                ) from exc
            raise _Transient(f"no stream leader answered on {subject}") from exc
        except (nats.errors.TimeoutError, TimeoutError, *_RECONNECTING_ERRORS) as exc:
            raise _Transient(
                f"submit of {r.request_id} not confirmed within {self.publish_timeout_s}s "
                f"(published again for {self.publish_retry_s}s); submitting again with the "
                "same request_id is safe"
            ) from exc
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"submit to {subject} failed: {exc}") from exc

    async def _queue_full(self, r: SubmitRequest, exc: APIError) -> QueueFull:
        retry_after, queued = self.queue_full_retry_after_s, None
        with contextlib.suppress(ServiceUnavailable):
            est = await self.estimate_wait(r.model, r.band, timeout_s=0.5)
            queued = est.queued
            if est.expected_wait_s:
                retry_after = est.expected_wait_s
        detail = exc.description or ""
        scope = "tenant" if "per subject" in detail else "band"
        return QueueFull(r.band, r.model, retry_after, detail, queued=queued, scope=scope)

    async def _no_stream_for(self, subject: str) -> bool:
        """Whether no stream holds ``subject`` (a band nobody set up): False while that
        cannot be told (the meta leader is being elected), so the publish is tried again."""
        js = self.nc.jetstream(timeout=_STREAM_LOOKUP_TIMEOUT_S)
        try:
            await js.find_stream_name_by_subject(subject)
        except NotFoundError:
            return True
        except _NATS_ERRORS:
            return False
        return False

    async def fetch_result(self, request_id: str, *, tenant: str | None = None) -> Result | None:
        """The stored result of an earlier request, or None if there is none (yet)."""
        return await self._lookup_result(tenant or self.tenant, request_id)

    def results(
        self,
        *,
        tenant: str | None = None,
        batch_id: str | None = None,
        group: str | None = None,
        name: str | None = None,
        idle_timeout_s: float | None = None,
        ack_wait_s: float = DEFAULT_ACK_WAIT_S,
    ) -> ResultSubscription:
        """Every result of ``tenant`` (default: the client's), or of one batch (``batch_id``)
        or request group (``group``: request ids ``GROUP:KEY``) of it, stored and future, as
        a durable async iterator that resumes where the last subscription under ``name``
        stopped (default: one name per tenant and group); results taken by a subscriber that
        died unacked come again after ``ack_wait_s`` (fixed when the subscription is first
        made). Use it as ``async with
        client.results(batch_id=b) as sub: async for result in sub: ...``
        (:mod:`sluice.client.subscriptions`)."""
        if batch_id is not None and group is not None and batch_id != group:
            raise InvalidRequest("give batch_id or group, not both")
        return ResultSubscription(
            self.nc,
            tenant or self.tenant,
            batch_id if batch_id is not None else group,
            name=name,
            idle_timeout_s=idle_timeout_s,
            ack_wait_s=ack_wait_s,
        )

    async def _lookup_result(self, tenant: str, request_id: str) -> Result | None:
        try:
            raw = await self.nc.jetstream().get_last_msg(
                names.RESULT_STREAM, names.result_subject(tenant, request_id), direct=True
            )
        except (NotFoundError, NoStreamResponseError, nats.errors.NoRespondersError):
            return None
        except APIError:
            return None
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot look up the result of {request_id}: {exc}") from exc
        if raw.data is None:
            return None
        try:
            return decode(raw.data, Result)
        except DecodeError as exc:
            raise MalformedResult(request_id, str(exc)) from exc

    async def estimate_wait(
        self, model: str, band: str | None = None, timeout_s: float = 2.0
    ) -> WaitEstimate:
        """How long a request to ``model`` in ``band`` would wait for admission now, with the
        queue depth, recent wait percentiles and admission and rejection rates."""
        query = WaitQuery(model=model, band=band or self.band)
        return await self._ask(names.WAIT_SUBJECT, encode(query), WaitEstimate, "wait", timeout_s)

    async def cancel(
        self, request_id: str, *, tenant: str | None = None, timeout_s: float = 10.0
    ) -> CancelReply:
        """Cancel a request by its id (see :meth:`RequestHandle.cancel`); raises
        ``ServiceUnavailable`` if no dispatcher answers within ``timeout_s`` (a running
        request's worker has 4 s to stop it and store its result)."""
        try:
            query = CancelRequest(request_id=request_id, tenant=tenant or self.tenant)
        except ValidationError as exc:  # an empty id, or characters no request id has
            raise InvalidRequest(f"cannot cancel {request_id!r}: {summarise(exc)}") from None
        return await self._ask(
            names.cancel_subject(query.tenant), encode(query), CancelReply, "cancel", timeout_s
        )

    async def reconcile(self, timeout_s: float = 10.0) -> ReconcileReport:
        """Ask a dispatcher to reconcile its books with the workers' reports now; what it
        found and corrected."""
        return await self._ask(
            names.RECONCILE_SUBJECT, b"", ReconcileReport, "reconcile", timeout_s
        )

    async def stats(self, timeout_s: float = 2.0) -> DispatcherStats:
        """Queue depths and in-flight counts from a dispatcher."""
        return await self._ask(names.STATS_SUBJECT, b"", DispatcherStats, "stats", timeout_s)

    async def workers(self, timeout_s: float = 2.0) -> WorkerList:
        """Every worker holding a lease at a dispatcher: its state, load and lease age."""
        return await self._ask(names.WORKERS_SUBJECT, b"", WorkerList, "workers", timeout_s)

    async def _ask(
        self, subject: str, payload: bytes, reply: type[R], what: str, timeout_s: float
    ) -> R:
        """A request/reply to the dispatcher; every failure is ``ServiceUnavailable``."""
        try:
            msg = await self.nc.request(subject, payload, timeout=timeout_s)
            stop_if_cancelled()  # (as in submit)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise ServiceUnavailable(f"no dispatcher answered the {what} query") from exc
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"the {what} query failed: {exc}") from exc
        try:
            return decode(msg.data, reply)
        except DecodeError as exc:
            raise ServiceUnavailable(f"bad {what} reply: {exc}") from exc

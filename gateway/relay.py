"""One request relayed from its HTTP client to Sluice and back.

The request is submitted through the client library; then the gateway waits for its first
token (or its end) before it answers, so that a request the dispatcher refuses (an unknown
model, a prompt too long, a full tenant queue) still gets its HTTP status. A streamed answer
relays every chunk as it arrives; one that does not stream waits for the result.

**A client that leaves cancels its request.** Every wait watches the connection
(``http.disconnect`` on the ASGI receive channel): a client that disconnects while its request
is queued or running, streaming or not, has it cancelled (``RequestHandle.cancel()``), so no
worker keeps running work nobody reads. So is a request that is not finished within
``request_timeout_s`` (504, or an error event on a stream that had started), and one still
being answered when the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sluice.client import RequestHandle, Result, SluiceError, TokenChunk
from sluice.gateway import metrics
from sluice.gateway.chat import Job
from sluice.gateway.errors import GatewayTimeout, from_client_error
from sluice.gateway.shapes import Chunks, sse

log = logging.getLogger("sluice.gateway")
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


async def until_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (read the request body first)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel_quietly(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def race(aw: Awaitable[T], receive: Receive, deadline: float) -> T:
    """``aw``'s value, unless the client disconnects first (``ClientGone``) or the event
    loop's clock passes ``deadline`` (``GatewayTimeout``); ``aw`` is then cancelled."""
    work: asyncio.Future[T] = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(until_disconnect(receive))
    both: set[asyncio.Future[Any]] = {work, gone}
    try:
        async with asyncio.timeout_at(deadline):
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    except TimeoutError as exc:
        raise GatewayTimeout("the request did not finish in time; it was cancelled") from exc
    finally:
        finished = work.done()  # before anything is cancelled
        await _cancel_quietly(gone)
        if not finished:
            await _cancel_quietly(work)
    if finished:
        return work.result()
    raise ClientGone


async def _each(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Every one's value, in order; if one raises, the others are cancelled (and awaited)
    before its error goes on (``asyncio.gather`` leaves them running)."""
    if len(aws) == 1:  # (one choice, the common case: no task of its own)
        return [await aws[0]]
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Relay:
    """The relay of one answer's submitted requests (one per choice: ``n``): their first
    events, then their streams or their results.

    ``cancel(handle, reason)`` is called (once for each request) when the answer must stop
    because its client left or its time ran out; the gateway runs it in the background."""

    def __init__(
        self,
        handles: Sequence[RequestHandle],
        job: Job,
        *,
        route: str,
        arrived: float,
        deadline: float,
        created: int,
        cancel: Callable[[RequestHandle, str], None],
    ) -> None:
        self.handles = list(handles)
        self.handle = self.handles[0]
        """The first choice's request: its id is the answer's."""
        self.job = job
        self.route = route
        self.arrived = arrived
        """``time.perf_counter()`` when the HTTP request arrived (for the first-token time)."""
        self.deadline = deadline
        """The event loop's time by which the request must be finished."""
        self.created = created
        self._cancel = cancel
        self._stopped = False
        self._chunks = [aiter(h) for h in self.handles]

    def abort(self, reason: str) -> None:
        """Stop the requests in Sluice (the client left, its time ran out, the server is
        stopping, or another choice failed), once, each unless it ended; ``reason`` labels
        the count of cancels."""
        if self._stopped:
            return
        self._stopped = True
        for handle in self.handles:
            if not handle.done:
                metrics.CANCELLED.labels(reason).inc()
                self._cancel(handle, reason)

    async def _guarded(self, aw: Awaitable[T], receive: Receive, failing: str) -> T:
        """``aw``'s value; the choices are stopped when the client leaves, the time runs out,
        the server stops, or a choice fails (``failing``: the label of its cancels)."""
        try:
            return await race(aw, receive, self.deadline)
        except ClientGone:
            self.abort("disconnect")
            raise
        except GatewayTimeout:
            self.abort("timeout")
            raise
        except asyncio.CancelledError:  # the server is stopping: nobody will read the answer
            self.abort("shutdown")
            raise
        except SluiceError as exc:
            self.abort(failing)  # (the other choices: nobody will read them)
            raise from_client_error(exc, self.job.model) from exc

    async def first(self, receive: Receive) -> TokenChunk | None:
        """The first choice's first chunk of tokens (None: it ended without output); raises
        the ``ApiError`` of a request that was refused. (The other choices are not waited
        for: a refusal of a prompt or a model refuses them all alike, and they stream as
        they come.)"""
        chunk = await self._guarded(anext(self._chunks[0], None), receive, "refused")
        if chunk is not None:
            metrics.TTFT.labels(self.route).observe(time.perf_counter() - self.arrived)
        return chunk

    async def result(self, receive: Receive) -> list[Result]:
        """Each choice's final result (for an answer that does not stream)."""
        results = _each([h.result() for h in self.handles])
        return await self._guarded(results, receive, "failed")

    async def events(self, first: TokenChunk | None) -> AsyncIterator[bytes]:
        """The server-sent events of the answer, from the first choice's first chunk to
        ``[DONE]``, the choices' chunks as they come; an error after the stream started is an
        error event (``data: {"error": ...}``) that ends it (and stops the other choices)."""
        chunks = Chunks(self.job, self.handle.request_id, self.created)
        if first is not None:
            yield chunks.text(first.text, 0, first.logprobs)
        rest = self._one(chunks) if len(self.handles) == 1 else self._many(chunks)
        try:
            async for event in rest:
                yield event
        finally:  # (closed early, by a client that left: its choices' pumps stop now)
            await rest.aclose()

    async def _one(self, chunks: Chunks) -> AsyncGenerator[bytes, None]:
        # One choice, the common case: read in place, no task of its own.
        try:
            async for chunk in self._chunks[0]:
                yield chunks.text(chunk.text, 0, chunk.logprobs)
            result = await self.handle.result()
        except SluiceError as exc:
            yield sse(from_client_error(exc, self.job.model).body())
            return
        yield chunks.finish(result) + chunks.close([result])

    async def _many(self, chunks: Chunks) -> AsyncGenerator[bytes, None]:
        came: asyncio.Queue[tuple[int, TokenChunk | Result | Exception]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for chunk in self._chunks[i]:
                    came.put_nowait((i, chunk))
                came.put_nowait((i, await self.handles[i].result()))
            except Exception as exc:  # (any: the stream must not wait on a pump that died)
                came.put_nowait((i, exc))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(self.handles))]
        try:
            results: dict[int, Result] = {}
            while len(results) < len(self.handles):
                i, item = await came.get()
                if isinstance(item, Exception):
                    self.abort("failed")
                    if not isinstance(item, SluiceError):
                        raise item  # (as with one choice: the stream fails, logged)
                    yield sse(from_client_error(item, self.job.model).body())
                    return
                if isinstance(item, Result):
                    results[i] = item
                    yield chunks.finish(item, i)
                else:
                    yield chunks.text(item.text, i, item.logprobs)
            yield chunks.close([results[i] for i in range(len(self.handles))])
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


class EventStream(Response):
    """A ``text/event-stream`` answer that watches its client: when the client disconnects
    (or ``deadline`` passes, or the server stops) before the last event, the stream stops and
    ``on_abort`` is called with ``disconnect`` (``timeout``: an error event is sent then;
    ``shutdown``)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        deadline: float,
        on_abort: Callable[[str], None],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.events = events
        self.deadline = deadline
        self.on_abort = on_abort
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def _pump(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async with asyncio.timeout_at(self.deadline):
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
        except TimeoutError:
            self.on_abort("timeout")
            late = GatewayTimeout("the request did not finish in time; it was cancelled")
            await send({"type": "http.response.body", "body": sse(late.body()), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left = gone.done()  # else the server is stopping (this task was cancelled)
            await _cancel_quietly(gone)
            if not pump.done():
                self.on_abort("disconnect" if left else "shutdown")
                await _cancel_quietly(pump)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        failed = None if pump.cancelled() else pump.exception()
        if failed is not None:
            raise failed


def stream_response(
    relay: Relay, first: TokenChunk | None, headers: Mapping[str, str]
) -> EventStream:
    """The streamed answer of ``relay``."""
    return EventStream(
        relay.events(first), deadline=relay.deadline, on_abort=relay.abort, headers=headers
    )

"""The gateway's ASGI app: OpenAI's completion endpoints over the Sluice client library.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and
``/v1/models/{model}``), ``GET /health``, ``GET /metrics``. :func:`build_app` takes more
routes (``routes=``): the place for endpoints built elsewhere (the Files and Batches APIs).
Such a route finds the shared :class:`Gateway` as ``gateway_of(request)``, authenticates with
``gateway.authenticate(request)`` (an API key's :class:`~sluice.gateway.keys.Principal`), and
gets the gateway's error answers by wrapping its endpoint in :func:`guarded`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.client import Client, RequestHandle, SluiceError
from sluice.common.aio import finish_tasks, wait_event
from sluice.common.chattemplate import ChatTemplate
from sluice.common.errors import internal_error
from sluice.common.tokenizer import PromptTokenizer
from sluice.gateway import metrics
from sluice.gateway.catalog import Catalog
from sluice.gateway.chat import (
    SESSION_HEADER,
    chat_job,
    choice_sampling,
    completion_job,
    parse_json,
    session_of,
)
from sluice.gateway.errors import (
    ApiError,
    BodyTimeout,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    from_client_error,
)
from sluice.gateway.keys import PRIORITY_HEADER, KeyTable, Principal
from sluice.gateway.relay import ClientGone, Relay, stream_response
from sluice.gateway.settings import GatewaySettings
from sluice.gateway.shapes import completion

log = logging.getLogger("sluice.gateway")

REQUEST_ID_HEADER = "x-sluice-request-id"
"""The response header naming the Sluice request (also in the body's ``id``)."""
CLIENT_CLOSED = 499
"""The status recorded (in metrics) for a request whose client left before its answer."""
CANCEL_GRACE_S = 5.0
"""How long a stopping gateway waits for the cancels of abandoned requests."""
OPEN_WARNING = (
    "the gateway is OPEN: no API keys are configured, so every request is tenant %r and may "
    "use any band; configure [[gateway.keys]] before exposing it"
)

Endpoint = Callable[[Request], Awaitable[Response]]


class Gateway:
    """What every route shares: the settings, the key table, one client library connection,
    the fleet's catalog, and the cancels running in the background."""

    def __init__(self, settings: GatewaySettings, client: Client | None = None) -> None:
        self.settings = settings
        self.keys = KeyTable.from_settings(settings)
        if client is None:
            tokenizer = None
            if settings.tokenizer is not None:
                tokenizer = PromptTokenizer.from_file(settings.tokenizer)
            template = None
            if settings.chat_template is not None:
                template = ChatTemplate.from_file(settings.chat_template)
            client = Client(
                settings.nats_url,
                tenant=settings.open_tenant,
                band=settings.default_band,
                tokenizer=tokenizer,
                auth=settings.broker_auth(),
                chat_template=template,
            )
        self.client = client
        self.catalog = Catalog(client, settings.models_ttl_s)
        from sluice.gateway.batchapi import BatchApi  # it builds on this module

        self.batches = BatchApi(settings.batch_sweep_every_s, settings.max_file_bytes)
        """The Files and Batches APIs, their submitters and their sweep."""
        self.started_unix_s = int(time.time())
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = False
        self.answering = 0
        """HTTP requests being answered now (the metering middleware counts them)."""
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        """Connect to NATS (``ServiceUnavailable`` if it cannot); warns when it is open."""
        if self._running:
            return
        await self.client.connect()
        await self.batches.start(self)
        self._running = True
        if self.keys.open:
            log.warning(OPEN_WARNING, self.settings.open_tenant)

    async def stop(self) -> None:
        """Let the answers still unwinding (a stopping server cancelled them) and the
        background cancels finish, each for at most ``CANCEL_GRACE_S``, then close the
        connection."""
        await wait_event(self._idle, CANCEL_GRACE_S)
        await finish_tasks(list(self._tasks), CANCEL_GRACE_S)
        await self.batches.stop()
        await self.catalog.close()
        await self.client.close()
        self._running = False

    def answer_started(self) -> None:
        """An HTTP request is being answered (until ``answer_ended``)."""
        self.answering += 1
        self._idle.clear()

    def answer_ended(self) -> None:
        """The answer to an HTTP request has ended (sent, failed or abandoned)."""
        self.answering -= 1
        if self.answering == 0:
            self._idle.set()

    def authenticate(self, request: Request) -> Principal:
        """Who sent ``request`` (``Unauthorized`` for a missing or unknown key)."""
        return self.keys.authenticate(request.headers.get("authorization"))

    def cancel_later(self, handle: RequestHandle, reason: str) -> None:
        """Cancel ``handle``'s request in the background (nobody will read its answer)."""
        task = asyncio.get_running_loop().create_task(
            self._cancel(handle, reason), name=f"cancel-{handle.request_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel(self, handle: RequestHandle, reason: str) -> None:
        try:
            reply = await handle.cancel()
        except SluiceError as exc:
            log.warning("could not cancel %s (%s): %s", handle.request_id, reason, exc)
            return
        log.info("cancelled %s (%s): %s", handle.request_id, reason, reply.status)


def gateway_of(request: Request) -> Gateway:
    """The :class:`Gateway` behind ``request``'s app."""
    gw: Gateway = request.app.state.gateway
    return gw


def guarded(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with the gateway's error answers: its ``ApiError`` as that status in
    OpenAI's shape, a client library error mapped (``errors.from_client_error``), anything
    unexpected a counted, logged 500 that says nothing more."""

    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as exc:
            return exc.response()
        except (ClientGone, ClientDisconnect):  # gone before its answer (or its body) was done
            return Response(status_code=CLIENT_CLOSED)
        except SluiceError as exc:
            return from_client_error(exc, "").response()
        except Exception:
            internal_error(log, "gateway.request", "%s %s failed", request.method, request.url.path)
            return InternalError("the gateway failed to relay the request").response()

    return run


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (``PayloadTooLarge`` beyond), received whole
    within the gateway's ``body_timeout_s`` (``BodyTimeout`` after: uvicorn itself waits for
    a body as long as the client keeps the connection open)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body exceeds {limit} bytes")
    body = bytearray()
    timeout_s = gateway_of(request).settings.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise PayloadTooLarge(f"the body exceeds {limit} bytes")
    except TimeoutError:
        raise BodyTimeout(f"the body was not received within {timeout_s:g} s") from None
    return bytes(body)


class _Completions:
    """``/v1/chat/completions`` and ``/v1/completions``."""

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: str) -> Response:
        gw = gateway_of(request)
        s = gw.settings
        arrived = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + s.request_timeout_s
        principal = gw.authenticate(request)
        body = parse_json(await read_body(request, s.max_body_bytes))
        if kind == "chat":
            job = chat_job(body, s.default_max_tokens, gw.client.chat_prompt, s.max_choices)
        else:
            job = completion_job(body, s.default_max_tokens, s.max_choices)
        asked = request.headers.get(PRIORITY_HEADER)
        band = principal.band(asked)
        if asked is not None:
            await gw.catalog.require_band(band)
        await gw.catalog.require_model(job.model)
        session = session_of(request.headers.get(SESSION_HEADER), job)
        handles: list[RequestHandle] = []
        try:
            for choice in range(job.n):
                handles.append(
                    await gw.client.submit(
                        job.model,
                        job.prompt,
                        max_tokens=job.max_tokens,
                        band=band,
                        tenant=principal.tenant,
                        session_id=session,
                        sampling=choice_sampling(job.sampling, choice),
                    )
                )
        except BaseException as exc:
            # The choices queued already: nobody will read them (a refusal, the server
            # stopping, a failure of the gateway's own).
            reason = (
                "refused"
                if isinstance(exc, SluiceError)
                else "shutdown"
                if isinstance(exc, asyncio.CancelledError)
                else "failed"
            )
            for handle in handles:
                metrics.CANCELLED.labels(reason).inc()
                gw.cancel_later(handle, reason)
            if not isinstance(exc, SluiceError):
                raise
            error = from_client_error(exc, job.model)
            if handles:  # (they were queued, and are cancelled: the answer names them)
                error.headers[REQUEST_ID_HEADER] = ",".join(h.request_id for h in handles)
            raise error from exc
        relay = Relay(
            handles,
            job,
            route=request.url.path,
            arrived=arrived,
            deadline=deadline,
            created=int(time.time()),
            cancel=gw.cancel_later,
        )
        headers = {REQUEST_ID_HEADER: ",".join(h.request_id for h in handles)}
        try:
            first = await relay.first(request.receive)
            if job.stream:
                return stream_response(relay, first, headers)
            results = await relay.result(request.receive)
        except ApiError as exc:  # it was submitted: the answer names it
            exc.headers.update(headers)
            raise
        return JSONResponse(completion(job, results, relay.created), headers=headers)


def _model_card(gw: Gateway, model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": gw.started_unix_s, "owned_by": "sluice"}


async def _models(request: Request) -> Response:
    gw = gateway_of(request)
    gw.authenticate(request)
    fleet = await gw.catalog.fleet()
    return JSONResponse({"object": "list", "data": [_model_card(gw, m) for m in fleet.models]})


async def _model(request: Request) -> Response:
    gw = gateway_of(request)
    gw.authenticate(request)
    model = request.path_params["model"]
    await gw.catalog.require_model(model)
    return JSONResponse(_model_card(gw, model))


async def _health(request: Request) -> Response:
    """200 while the gateway's NATS connection is up, 503 otherwise."""
    client = gateway_of(request).client
    if client.closed or not client.nc.is_connected:
        return JSONResponse({"status": "unavailable", "nats": "disconnected"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _metrics(_: Request) -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{request.method} is not allowed on {request.url.path}"
        response = MethodNotAllowed(message + (f" (use {allowed})" if allowed else "")).response()
        if allowed:
            response.headers["Allow"] = allowed
        return response
    if exc.status_code == 404:
        return NotFound("no such route", code="not_found").response()
    return ApiError(str(exc.detail)).response()


class _Metered:
    """ASGI middleware: every HTTP request counted by route and status, and in flight (also
    for the gateway, whose ``stop`` waits for the answers still unwinding)."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute], gateway: Gateway) -> None:
        self.app = app
        self.routes = list(routes)
        self.gateway = gateway

    def _route(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return str(getattr(route, "path", "other"))
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route(scope)
        status = 500  # an error no handler answered

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics.IN_FLIGHT.labels(route).inc()
        self.gateway.answer_started()
        try:
            await self.app(scope, receive, sent)
        finally:
            self.gateway.answer_ended()
            metrics.IN_FLIGHT.labels(route).dec()
            metrics.REQUESTS.labels(route, str(status)).inc()


def build_app(gateway: Gateway, *, routes: Sequence[BaseRoute] = ()) -> Starlette:
    """The gateway's ASGI app over ``gateway``, with ``routes`` added (after the built-in
    ones). Its lifespan starts ``gateway`` if it is not running and then stops it; a server
    that started the gateway itself runs the app without a lifespan."""
    completions = _Completions()
    all_routes: list[BaseRoute] = [
        Route("/v1/chat/completions", guarded(completions.chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions.completions), methods=["POST"]),
        Route("/v1/models", guarded(_models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(_model), methods=["GET"]),
        Route("/health", guarded(_health), methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        *gateway.batches.routes(),
        *routes,
    ]

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = Starlette(
        routes=all_routes,
        lifespan=lifespan,
        middleware=[Middleware(_Metered, routes=all_routes, gateway=gateway)],
        exception_handlers={HTTPException: _http_error},
    )
    app.state.gateway = gateway
    return app

"""The gateway on uvicorn: :class:`GatewayServer` runs it in the current event loop (the
``sluice gateway`` command, the tests and the benchmark), :func:`serve` until SIGINT/SIGTERM.

The server binds its socket itself (``port = 0``: any free port, then :attr:`GatewayServer.port`
says which), so a port in use is a :class:`~sluice.gateway.errors.BindError`, not uvicorn's
``sys.exit``; it connects the gateway to NATS before it listens, and closes it after the last
connection ended (or ``SHUTDOWN_GRACE_S`` passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Sequence
from types import TracebackType

import uvicorn
from starlette.routing import BaseRoute

from sluice.client import Client
from sluice.common.httpserve import QuietServer, bind_socket
from sluice.gateway.app import Gateway, build_app
from sluice.gateway.errors import BindError
from sluice.gateway.settings import GatewaySettings

SHUTDOWN_GRACE_S = 5.0
"""How long a stopping server lets open answers (streams) finish before it closes them."""


def _bind(host: str, port: int) -> socket.socket:
    try:
        return bind_socket(host, port, backlog=2048)
    except OSError as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc}") from exc


class GatewayServer:
    """``async with GatewayServer(settings) as server:`` serves the gateway on
    ``server.url`` until the block ends. ``routes``: more routes for the app
    (:func:`~sluice.gateway.app.build_app`); ``client``: a client library connection to use
    instead of one made from the settings."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        routes: Sequence[BaseRoute] = (),
        client: Client | None = None,
    ) -> None:
        self.settings = settings
        self.gateway = Gateway(settings, client)
        self._routes = routes
        self._server: QuietServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = settings.port

    @property
    def url(self) -> str:
        host = self.settings.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> GatewayServer:
        """Connect, bind and serve; raises ``ServiceUnavailable`` (NATS) or ``BindError``."""
        await self.gateway.start()
        try:
            sock = _bind(self.settings.host, self.settings.port)
        except BindError:
            await self.gateway.stop()
            raise
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(self.gateway, routes=self._routes),
            lifespan="off",
            http="httptools",  # the C parser, a dependency: h11 cost 0.1-0.5 ms a request
            log_level="warning",
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
        )
        self._server = QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway")
        while not self._server.started:
            if self._task.done():  # it failed to start: say why
                await self._task
                raise BindError(f"the gateway did not start on {self.url}")
            await asyncio.sleep(0.01)
        return self

    async def wait(self) -> None:
        """Until the server stops (``stop``, or a fatal error)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Stop listening, let open answers finish (bounded), then close the gateway."""
        try:
            if self._server is not None and self._task is not None:
                self._server.should_exit = True
                await asyncio.gather(self._task, return_exceptions=True)
        finally:
            await self.gateway.stop()

    async def __aenter__(self) -> GatewayServer:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def serve(
    settings: GatewaySettings,
    *,
    routes: Sequence[BaseRoute] = (),
    on_start: Callable[[GatewayServer], None] | None = None,
) -> None:
    """Serve the gateway until SIGINT or SIGTERM (also while it is still connecting);
    ``on_start`` is called once it listens."""
    server = GatewayServer(settings, routes=routes)
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, signalled.set)
    stop = asyncio.ensure_future(signalled.wait())
    try:
        start = asyncio.ensure_future(server.start())
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # stopped while connecting
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            return
        start.result()  # its error, if it failed
        if on_start is not None:
            on_start(server)
        ended = asyncio.ensure_future(server.wait())
        await asyncio.wait({ended, stop}, return_when=asyncio.FIRST_COMPLETED)
        ended.cancel()
    finally:
        stop.cancel()
        await server.stop()

"""The metrics port of a long-running part (``sluice dispatcher``, ``sluice agent``): Prometheus
metrics and the orchestrator's probes, served in the part's own event loop.

- ``GET /metrics``: the process's Prometheus registry.
- ``GET /healthz`` (liveness): 200 while the event loop answers and the NATS connection is
  connected or reconnecting (nats-py reconnects for ever: a broker outage is not a reason to
  restart every part), 503 once the part is not running or its engine died.
- ``GET /readyz`` (readiness): 200 while the part does its job: the NATS connection is up and
  the part says it is ready (a dispatcher: started, leading or standing by; an agent: started,
  serving, its engine available, not draining); 503 otherwise.

Both answer a small JSON object with the reasons. Served in the part's event loop (not on a
thread, as ``prometheus_client.start_http_server`` would), so a loop that stopped answering
fails the liveness probe too.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from nats.aio.client import Client as NATS
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sluice.common.errors import CommonError
from sluice.common.httpserve import QuietServer, bind_socket

__all__ = [
    "HEALTH_PATH",
    "METRICS_PATH",
    "READY_PATH",
    "Probe",
    "ProbeServer",
    "ProbeServerError",
    "nats_state",
]

METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"


class ProbeServerError(CommonError):
    """The metrics port could not be bound or served."""


@dataclass(frozen=True)
class Probe:
    """What a part says about itself: ``live`` (keep the process), ``ready`` (it does its job)
    and the details both probes answer (``nats``, ``role`` or ``state``, ...)."""

    live: bool
    ready: bool
    detail: dict[str, str] = field(default_factory=dict)


def nats_state(nc: NATS | None) -> str:
    """``connected``, ``reconnecting`` or ``closed`` (also: no connection yet)."""
    if nc is None or nc.is_closed:
        return "closed"
    if nc.is_connected:
        return "connected"
    return "reconnecting"


def _bind(host: str, port: int) -> socket.socket:
    try:
        return bind_socket(host, port, backlog=64)
    except OSError as exc:
        raise ProbeServerError(f"cannot serve metrics on {host}:{port}: {exc}") from exc


class ProbeServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` in the running event
    loop. ``probe`` is asked at every probe; before the part has started it is not asked and
    both probes answer 503 ``starting``."""

    def __init__(self, host: str, port: int, probe: Callable[[], Probe]) -> None:
        self.host = host
        self.port = port
        self._probe = probe
        self._started = False
        self._server: QuietServer | None = None
        self._task: asyncio.Task[None] | None = None

    def part_started(self) -> None:
        """The part is running: from now on ``probe`` answers."""
        self._started = True

    def _current(self) -> Probe:
        if not self._started:
            return Probe(live=False, ready=False, detail={"state": "starting"})
        return self._probe()

    async def _health(self, _: Request) -> Response:
        p = self._current()
        return JSONResponse({"live": p.live, **p.detail}, status_code=200 if p.live else 503)

    async def _ready(self, _: Request) -> Response:
        p = self._current()
        ok = p.live and p.ready
        return JSONResponse({"ready": ok, **p.detail}, status_code=200 if ok else 503)

    async def _metrics(self, _: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def start(self) -> ProbeServer:
        """Bind (``port`` 0: any free port, then :attr:`port` says which) and serve; raises
        :class:`ProbeServerError` when the port cannot be bound."""
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        app = Starlette(
            routes=[
                Route(METRICS_PATH, self._metrics, methods=["GET"]),
                Route(HEALTH_PATH, self._health, methods=["GET"]),
                Route(READY_PATH, self._ready, methods=["GET"]),
            ]
        )
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
        self._server = QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="probes")
        while not self._server.started:
            if self._task.done():
                await self._task
                raise ProbeServerError(f"metrics did not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        """Stop serving (probes fail from now on, as the process is about to end)."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
        self._server, self._task = None, None

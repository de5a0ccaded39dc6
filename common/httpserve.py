"""What the parts that serve HTTP in their own event loop share: a uvicorn server without its
signal handlers, and a listening socket bound before the server starts (so a port in use is
the caller's typed error, not uvicorn's exit)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import uvicorn


class QuietServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: whoever runs it decides when it stops
    (the part's own SIGTERM handling; a test when it is done)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A non-blocking socket listening on ``host:port`` (IPv6 when ``host`` has a colon);
    raises ``OSError`` when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock

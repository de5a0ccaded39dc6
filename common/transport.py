"""Connecting to NATS: one place for connection options shared by every process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from sluice.common.errors import TransportError

__all__ = ["DEFAULT_INBOX_PREFIX", "BrokerAuth", "TransportError", "connect", "servers_of"]

DEFAULT_INBOX_PREFIX = "_INBOX"
"""nats-py's own reply-inbox prefix: what a process uses unless its broker role gives it one."""


@dataclass(frozen=True)
class BrokerAuth:
    """Who a process is on the broker, and how it reaches it: a user and password (or a
    ``.creds`` file), its reply-inbox prefix, and TLS. The default is anonymous, plain TCP,
    nats-py's inbox prefix: what an unsecured development server expects."""

    user: str | None = None
    password: str | None = None
    creds_file: str | None = None
    inbox_prefix: str = DEFAULT_INBOX_PREFIX
    """Replies to this process arrive under ``<prefix>.…``; with broker roles each user has
    its own prefix and may subscribe to nothing else, so no user reads another's replies."""
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS context when a CA or a client certificate is set, else None (plain TCP, or
        the system's trust store if the URL says ``tls://``)."""
        if self.tls_ca_file is None and self.tls_cert_file is None:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca_file)
            if self.tls_cert_file is not None:
                ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"cannot load the TLS files: {exc}") from exc
        return ctx

    def options(self) -> dict[str, Any]:
        """nats-py ``connect`` options for this identity."""
        out: dict[str, Any] = {"inbox_prefix": self.inbox_prefix}
        if self.user is not None:
            out["user"] = self.user
            out["password"] = self.password or ""
        if self.creds_file is not None:
            # nats-py reads it only when a server asks for a signature: say now that it is
            # missing, not at the first server that needs it.
            try:
                with open(self.creds_file, "rb"):
                    pass
            except OSError as exc:
                raise TransportError(f"cannot read the .creds file: {exc}") from exc
            out["user_credentials"] = self.creds_file
        ctx = self.tls_context()
        if ctx is not None:
            out["tls"] = ctx
        return out


def servers_of(url: str) -> list[str]:
    """The server list of a ``nats_url`` setting: one URL, or several separated by commas
    (the nodes of a cluster: ``nats://a:4222,nats://b:4222``). Raises :class:`TransportError`
    when it names none, or one that is no URL of a NATS server (nats-py would fail on it
    deep inside its connect)."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise TransportError(f"no NATS server in {url!r}")
    for server in servers:
        _check_server(server)
    return servers


_SCHEMES = ("nats", "tls", "ws", "wss")


def _parsed(server: str) -> urllib.parse.SplitResult:
    # nats-py takes host:port without a scheme as nats://host:port.
    return urllib.parse.urlsplit(server if "://" in server else f"nats://{server}")


def _check_server(server: str) -> None:
    try:
        parsed = _parsed(server)
        port = parsed.port  # ValueError when it is no number or not within 0-65535
        host = parsed.hostname
    except ValueError as exc:
        raise TransportError(f"not a NATS server URL: {server!r} ({exc})") from None
    if parsed.scheme not in _SCHEMES or not host or port == 0:
        raise TransportError(
            f"not a NATS server URL: {server!r} (expected nats://HOST:PORT, or tls://, ws://, "
            "wss://)"
        )


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    reconnected_cb: Callable[[], Awaitable[None]] | None = None,
    disconnected_cb: Callable[[], Awaitable[None]] | None = None,
    auth: BrokerAuth | None = None,
) -> NATS:
    """Connect with reconnects enabled; raises :class:`TransportError` if the first connect
    fails (no endless retry loop on a wrong URL). ``url`` may list several servers separated
    by commas (:func:`servers_of`): the first that answers is used, and on a disconnect the
    client reconnects to any of them (and to the nodes the cluster announces). ``auth``: the
    process's broker identity and TLS (default: anonymous, plain TCP)."""
    servers = servers_of(url)
    with contextlib.suppress(TimeoutError):  # a slow resolver: the connect's own bound holds
        await asyncio.wait_for(_resolvable(servers, url), timeout=connect_timeout_s)
    nc = NATS()
    # nats-py retries the first connect for ever when reconnects are unlimited: bound it, so
    # that a wrong URL or a broker that is down fails the start instead of hanging it.
    first_connect_s = (connect_timeout_s + _RECONNECT_WAIT_S) * len(servers) + _RECONNECT_WAIT_S
    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "connect_timeout": connect_timeout_s,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": _RECONNECT_WAIT_S,
        "error_cb": _on_error,
        **(auth or BrokerAuth()).options(),
    }
    # nats-py reports the first connect's failures only to error_cb (it retries them): keep
    # the last, so that the error says why no server answered.
    tried: list[Exception] = []

    async def first_errors(exc: Exception) -> None:
        if not nc.is_connected:
            tried[:] = [exc]
        await _on_error(exc)

    options["error_cb"] = first_errors
    if reconnected_cb is not None:
        options["reconnected_cb"] = reconnected_cb
    if disconnected_cb is not None:
        options["disconnected_cb"] = disconnected_cb
    try:
        await asyncio.wait_for(nc.connect(**options), timeout=first_connect_s)
    except (OSError, TimeoutError, ValueError, nats.errors.Error) as exc:
        # (AssertionError: nats-py's close() of a client whose connect failed before it set
        # itself up.)
        with contextlib.suppress(OSError, TimeoutError, AssertionError, nats.errors.Error):
            await nc.close()
        why = str(exc) or f"no server answered within {first_connect_s:g}s"
        if not str(exc) and tried:
            why += f" (the last try: {_described(tried[-1])})"
        raise TransportError(f"cannot connect to NATS at {url}: {why}") from exc
    if (options.get("tls") is not None or any(_parsed(s).scheme == "tls" for s in servers)) and (
        not _on_tls(nc)
    ):
        # nats-py starts TLS only when the server's INFO requires it, and checks nothing
        # after: a server (or a man in the middle) that does not would carry this process's
        # requests and results in plain text. (The connect itself has sent its user and
        # password by now: nats-py offers no hook between the INFO and its CONNECT.)
        with contextlib.suppress(OSError, TimeoutError, AssertionError, nats.errors.Error):
            await nc.close()
        raise TransportError(
            f"cannot connect to NATS at {url}: TLS is configured (a tls:// URL or TLS files) "
            "but the server did not start TLS; refusing a plain-text connection"
        )
    return nc


async def _resolvable(servers: list[str], url: str) -> None:
    """Raise :class:`TransportError` at once when no server's host name exists (DNS says so,
    not a temporary failure): nats-py would retry it until the first connect's bound ran out
    and then say only that no server answered."""
    loop = asyncio.get_running_loop()
    unknown: list[str] = []
    for server in servers:
        host = _parsed(server).hostname or ""
        try:
            await loop.getaddrinfo(host, None)
        except socket.gaierror as exc:
            if exc.errno not in _NO_SUCH_NAME:
                return  # a temporary failure (no DNS server yet): the connect retries
            unknown.append(host)
        else:
            return
    raise TransportError(
        f"cannot connect to NATS at {url}: no such host: {', '.join(map(repr, unknown))}"
    )


_NO_SUCH_NAME = frozenset(
    code
    for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None))
    if code is not None
)
"""getaddrinfo's answers that a name does not exist (rather than that DNS did not answer)."""


def _described(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _on_tls(nc: NATS) -> bool:
    """Whether ``nc``'s connection runs over TLS (nats-py keeps its stream writer private)."""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    get = getattr(writer, "get_extra_info", None)
    return get is not None and get("ssl_object") is not None


_RECONNECT_WAIT_S = 0.5
"""The wait before trying a server again (nats-py's ``reconnect_time_wait``)."""
_PERMISSIONS_VIOLATION = "permissions violation"
"""How nats-py words (lowercased) the server's refusal of a publish or a subscription."""
log = logging.getLogger("sluice.transport")


async def _on_error(exc: Exception) -> None:
    """A refusal by the broker's permissions is a deployment mistake (a role without what its
    process needs, or a process run as the wrong user): say so, since the refused publish or
    subscription fails silently otherwise. Disconnects are expected during failover; nats-py
    reconnects on its own."""
    if _PERMISSIONS_VIOLATION in str(exc).lower():
        log.warning("the broker refused: %s", exc)

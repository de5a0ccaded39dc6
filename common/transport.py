"""Connecting to NATS: one place for connection options shared by every process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from sluice.common.errors import TransportError

__all__ = ["TransportError", "connect", "servers_of"]


def servers_of(url: str) -> list[str]:
    """The server list of a ``nats_url`` setting: one URL, or several separated by commas
    (the nodes of a cluster: ``nats://a:4222,nats://b:4222``). Raises :class:`TransportError`
    when it names none."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise TransportError(f"no NATS server in {url!r}")
    return servers


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    reconnected_cb: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connect with reconnects enabled; raises :class:`TransportError` if the first connect
    fails (no endless retry loop on a wrong URL). ``url`` may list several servers separated
    by commas (:func:`servers_of`): the first that answers is used, and on a disconnect the
    client reconnects to any of them (and to the nodes the cluster announces)."""
    servers = servers_of(url)
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
        "error_cb": _ignore_error,
    }
    if reconnected_cb is not None:
        options["reconnected_cb"] = reconnected_cb
    try:
        await asyncio.wait_for(nc.connect(**options), timeout=first_connect_s)
    except (OSError, TimeoutError, ValueError, nats.errors.Error) as exc:
        with contextlib.suppress(OSError, TimeoutError, nats.errors.Error):
            await nc.close()
        why = str(exc) or f"no server answered within {first_connect_s:g}s"
        raise TransportError(f"cannot connect to NATS at {url}: {why}") from exc
    return nc


_RECONNECT_WAIT_S = 0.5
"""The wait before trying a server again (nats-py's ``reconnect_time_wait``)."""


async def _ignore_error(exc: Exception) -> None:
    # Disconnects are expected during failover; nats-py reconnects on its own.
    return None

"""Connecting to NATS: one place for connection options shared by every process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import nats
import nats.errors
from nats.aio.client import Client as NATS

from sluice.common.errors import TransportError

__all__ = ["TransportError", "connect"]


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    reconnected_cb: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connect with reconnects enabled; raises :class:`TransportError` if the first connect
    fails (no endless retry loop on a wrong URL)."""
    try:
        nc: NATS = await nats.connect(
            servers=[url],
            name=name,
            connect_timeout=connect_timeout_s,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=_ignore_error,
            **({"reconnected_cb": reconnected_cb} if reconnected_cb else {}),
        )
    except (OSError, TimeoutError, ValueError, nats.errors.Error) as exc:
        raise TransportError(f"cannot connect to NATS at {url}: {exc}") from exc
    return nc


async def _ignore_error(exc: Exception) -> None:
    # Disconnects are expected during failover; nats-py reconnects on its own.
    return None

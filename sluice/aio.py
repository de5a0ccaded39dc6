"""asyncio helpers shared by the runtimes.

``asyncio.wait_for`` on Python 3.11 can swallow a cancellation when the awaited thing
completes at the same moment, which makes a loop around it impossible to stop. These helpers
use ``asyncio.timeout`` instead, which does not have that race.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True if it was set."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def wait_at_most(aw: Awaitable[T], timeout_s: float) -> T | None:
    """Await ``aw`` for up to ``timeout_s``; None on timeout (``aw`` is not cancelled if it
    is a shielded future)."""
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            return await aw
    except TimeoutError:
        return None

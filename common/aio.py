"""asyncio helpers shared by the runtimes.

``asyncio.wait_for`` on Python 3.11 can swallow a cancellation when the awaited thing
completes at the same moment, which makes a loop around it impossible to stop. These helpers
use ``asyncio.timeout`` instead, which does not have that race.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

log = logging.getLogger("sluice")

T = TypeVar("T")


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` if this task was asked to stop and the request was swallowed
    on the way: nats-py's publish path catches it (``Client._flush_pending``: ``except
    CancelledError: pass``), so a loop of publishes ran on after Ctrl-C, in one try of two, to
    its end. ``Client.submit`` and its queries call it after nats-py; call it once a round in
    a loop of nats-py's own calls (never in clean-up code: there the task is being cancelled
    on purpose)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


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


async def finish_tasks(tasks: Iterable[asyncio.Task[Any]], grace_s: float) -> None:
    """Give tasks ``grace_s`` to end on their own (their loops watch a flag), then cancel the
    rest. nats-py calls that time out internally do not reliably honour cancellation on
    Python 3.11, so a loop is stopped by its flag first and cancelled only as a last resort;
    a task that ignores even that is abandoned after one more second rather than awaited
    forever. Errors the tasks ended with are logged."""
    tasks = list(tasks)
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=grace_s)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=1.0)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.error("task %s ended with an error", t.get_name(), exc_info=t.exception())

"""The command line's shared parts: one stderr console, one way to fail, one way to run a
coroutine, and one way to get a client from the settings."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from sluice.common.errors import ConfigError

T = TypeVar("T")

# Piped output (CI logs) gets wide lines instead of 80 columns of wrapped cells.
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr (the message as it is: a ``[...]`` in it is no
    markup, which dropped it or raised); raise the result to exit with ``code``."""
    err.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(code)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop (asyncio where it is missing). Ctrl-C, and SIGTERM (which
    the root command turns into one), cancel it as asyncio's runner does (its ``finally``
    blocks stop what it started), then end it with ``KeyboardInterrupt`` (exit code 130)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        return asyncio.run(_sigterm_cancels(coro))
    # (Outside the try: an ImportError the command itself raises is not a missing uvloop.)
    return uvloop.run(_sigterm_cancels(coro))


async def _sigterm_cancels(coro: Coroutine[Any, Any, T]) -> T:
    # Where SIGINT is ignored (a script's background job), asyncio's runner cancels nothing
    # on a signal, and SIGTERM raised the KeyboardInterrupt wherever the loop happened to be:
    # in a transport's callback, uvloop logs it as a fatal transport error and swallows it,
    # and the command ran on (seen: `bench-engine`, its agent busy streaming). There SIGTERM
    # cancels the main task, as the runner does on Ctrl-C elsewhere.
    task = asyncio.current_task()
    assert task is not None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # (SIGTERM is a SIGINT: the runner's own handling.)
        return _not_stopped(task, await coro)
    loop = asyncio.get_running_loop()
    signalled = False

    def stop() -> None:
        nonlocal signalled
        signalled = True
        task.cancel()

    previous = signal.getsignal(signal.SIGTERM)
    try:
        loop.add_signal_handler(signal.SIGTERM, stop)
    except NotImplementedError:  # pragma: no cover - not on Windows's loops
        return await coro
    try:
        return _not_stopped(task, await coro)
    except asyncio.CancelledError:
        if signalled:
            raise KeyboardInterrupt from None
        raise
    finally:
        # Removing it leaves SIGTERM at its default, which kills the process: a command that
        # runs again after this (bench-routers, its engines and routers still up) would die
        # on a SIGTERM between two runs and leave them all behind.
        loop.remove_signal_handler(signal.SIGTERM)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _not_stopped(task: asyncio.Task[Any], result: T) -> T:
    """``result``, unless the task was told to stop and a library swallowed the request (it
    is still counted: ``cancelling()``): then the command was interrupted all the same (it
    ended 0, with every figure, after a Ctrl-C)."""
    if task.cancelling():
        raise KeyboardInterrupt
    return result


def make_client(config: Path | None) -> Any:
    """The client its settings describe; bad settings (a missing tokenizer file, say) stop
    the command with exit code 2."""
    from sluice.client import Client, ClientSettings

    try:
        return Client.from_settings(ClientSettings.load(config))
    except ConfigError as exc:
        raise fail(str(exc)) from exc


def with_client(config: Path | None, call: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``call`` with a connected client; its errors stop the command with exit code 2."""
    from sluice.client import SluiceError

    client = make_client(config)

    async def go() -> T:
        async with client as c:
            return await call(c)

    try:
        return run(go())
    except SluiceError as exc:
        raise fail(str(exc)) from exc

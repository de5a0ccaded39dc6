"""Stopping the processes a test, a benchmark or ``sluice up`` started, by their PIDs, and
having them end with their parent."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any


def _parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a ``preexec_fn`` that has the kernel send the child SIGTERM when its parent
    dies: a parent killed with SIGKILL (by a test runner's timeout, the OOM killer, a CI job's
    end) runs no cleanup, and its engines, routers, dispatchers and brokers ran on. libc is
    looked up here, in the parent: the child, forked from a process that may have threads,
    only calls it (importing or loading there could wait on a lock another thread held)."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def die_with_parent() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)

    return die_with_parent


PYTHON = [sys.executable, "-P"]
"""This interpreter for a child process, without the working directory first on its import
path (``-P``): a ``nats.py`` where a benchmark was started shadowed the library in every
child it started, which died (``python -m`` puts the working directory first)."""
SLUICE = [*PYTHON, "-m", "sluice.cli"]
"""The ``sluice`` command, as a child process."""

DIE_WITH_PARENT = _parent_death_signal()
"""Pass as ``preexec_fn`` to every process a benchmark, a test helper or ``sluice up``
starts (None where the platform has no such signal). The kernel sends the signal when the
thread that started the child ends: start them from the main thread."""


def stop_processes(
    procs: Iterable[subprocess.Popen[Any]],
    sig: signal.Signals = signal.SIGTERM,
    timeout_s: float = 10.0,
) -> None:
    """Send ``sig`` to every process still running (all first, so they stop together), wait
    up to ``timeout_s`` for them all (one deadline: waits one after the other added up, 21 s
    for a fleet), and SIGKILL (then reap) what has not ended by then."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

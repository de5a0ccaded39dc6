"""Stopping the processes a test, a benchmark or ``sluice up`` started, by their PIDs."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any


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

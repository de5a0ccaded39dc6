"""Stopping the processes a test, a benchmark or ``sluice up`` started, by their PIDs."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable
from typing import Any


def stop_processes(
    procs: Iterable[subprocess.Popen[Any]],
    sig: signal.Signals = signal.SIGTERM,
    timeout_s: float = 10.0,
) -> None:
    """Send ``sig`` to every process still running (all first, so they stop together), wait
    up to ``timeout_s`` for each, and SIGKILL (then reap) what has not ended by then."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

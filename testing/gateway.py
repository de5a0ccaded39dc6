"""``sluice gateway`` as a child process on a free loopback port (the benchmark, the tests).

The process picks its own free port (``--port 0``) and says which in its start banner on
stderr, which is read here (so no port is guessed); stderr is drained into :attr:`lines`
by a thread from then on, so that the process never blocks on a full pipe and a test can read
what it logged. The process is stopped by its PID (SIGTERM, then SIGKILL), also when the
context exits on an error.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType

from sluice.testing.errors import GatewayProcessError
from sluice.testing.processes import DIE_WITH_PARENT, SLUICE, stop_processes

_BANNER = re.compile(r"gateway on (http://\S+) ")


class GatewayProcess:
    """``with GatewayProcess(nats_url) as gw:`` serves ``gw.url`` until the block ends.
    ``config``: a TOML file (``--config``); ``env``: more environment variables."""

    def __init__(
        self,
        nats_url: str,
        *,
        config: str | Path | None = None,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        start_timeout_s: float = 20.0,
    ) -> None:
        self.nats_url = nats_url
        self.config = config
        self.env = dict(env or {})
        self.args = list(args or [])
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.lines: list[str] = []
        """Every line the process wrote to stderr so far."""
        self._drain: threading.Thread | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise GatewayProcessError("the gateway process is not running")
        return self.proc.pid

    def start(self) -> GatewayProcess:
        cmd = [*SLUICE, "gateway", "--host", "127.0.0.1", "--port", "0"]
        if self.config is not None:
            cmd += ["--config", str(self.config)]
        env = {**os.environ, "SLUICE_NATS_URL": self.nats_url, **self.env}
        self.proc = subprocess.Popen(
            cmd + self.args,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=DIE_WITH_PARENT,
        )
        try:
            self.url = self._await_banner()
        except BaseException:
            self.stop()
            raise
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()
        return self

    def _await_banner(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        deadline = time.monotonic() + self.start_timeout_s
        # readline blocks: a watchdog stops a process that says nothing in time.
        watchdog = threading.Timer(self.start_timeout_s, self._kill)
        watchdog.start()
        try:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                found = _BANNER.search(line)
                if found:
                    return found.group(1)
                if time.monotonic() > deadline:
                    break
        finally:
            watchdog.cancel()
        code = self.proc.wait(timeout=10)
        said = "\n".join(self.lines)
        raise GatewayProcessError(f"sluice gateway did not start (exit code {code}):\n{said}")

    def _read_rest(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Stop the process (SIGTERM, then SIGKILL after ``timeout_s``); its exit code."""
        if self.proc is None:
            return None
        stop_processes([self.proc], timeout_s=timeout_s)
        if self._drain is not None:
            self._drain.join(timeout=2)
        return self.proc.returncode

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

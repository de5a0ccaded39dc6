"""A fleet of ``sluice engine`` processes for local runs: one per worker, each on a Unix socket
in a temporary directory with its KV events on an IPC socket beside it, stopped by PID (also
when starting one of them fails)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from sluice.testing.engineserver import EngineProcess
from sluice.testing.natsserver import _free_ports
from sluice.testing.processes import stop_processes


class HttpEngineFleet:
    """``with HttpEngineFleet(4, model="m") as fleet:`` starts ``worker-0`` … ``worker-3``'s
    engines; ``fleet.agent_for`` gives each agent its ``openai-http`` settings."""

    def __init__(
        self,
        workers: int,
        *,
        model: str,
        speed: float = 1.0,
        tokenizer: str | None = None,
        on_start: Callable[[str, EngineProcess], None] | None = None,
        tcp: bool = False,
        profile: str = "reference",
        start_timeout_s: float = 60.0,
        kv_page_tokens: int | None = None,
    ) -> None:
        self.workers, self.model, self.speed, self.tokenizer = workers, model, speed, tokenizer
        self.on_start = on_start
        self.tcp = tcp
        """Serve on free ports of 127.0.0.1 (what routers that speak only TCP need) rather
        than on Unix sockets; the KV events stay on IPC sockets."""
        self.profile = profile
        self.start_timeout_s = start_timeout_s
        """For all of them together: they start at once (16 importing on 2 busy cores take a
        while)."""
        self.kv_page_tokens = kv_page_tokens
        """Their KV events as SGLang's, a page of this many tokens an event (None: vLLM's)."""
        self.engines: dict[str, EngineProcess] = {}
        self._dir: str | None = None

    def start(self) -> HttpEngineFleet:
        """Start every engine at once, then wait for each (all stopped if one fails)."""
        self._dir = tempfile.mkdtemp(prefix="sluice-engines-")
        ports: list[int | None] = list(_free_ports(self.workers)) if self.tcp else []
        try:
            for i in range(self.workers):
                worker_id = f"worker-{i}"
                engine = EngineProcess(
                    os.path.join(self._dir, f"{worker_id}.sock"),
                    model=self.model,
                    speed=self.speed,
                    profile=self.profile,
                    kv_events=True,
                    tokenizer=self.tokenizer,
                    port=ports[i] if ports else None,
                    kv_page_tokens=self.kv_page_tokens,
                )
                self.engines[worker_id] = engine
                engine.launch()
            deadline = time.monotonic() + self.start_timeout_s
            for worker_id, engine in self.engines.items():
                engine.wait_ready(max(1.0, deadline - time.monotonic()))
                if self.on_start is not None:
                    self.on_start(worker_id, engine)
        except BaseException:
            self.stop()
            raise
        return self

    def agent_for(self, worker_id: str) -> dict[str, Any]:
        """The agent settings that drive ``worker_id``'s engine."""
        e = self.engines[worker_id]
        return {
            "engine": "openai-http",
            "engine_url": e.url,
            "engine_kv_events": e.kv_events,  # the agent's digest is the engine's cache
            "speed": 1.0,
        }

    def stop(self) -> None:
        """Stop every engine by its PID, all at once (one deadline, then SIGKILL)."""
        stop_processes(e.proc for e in self.engines.values() if e.proc is not None)
        for e in self.engines.values():
            e.close()
        self.engines.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> HttpEngineFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The metrics port's probes (``/healthz``, ``/readyz``, ``/metrics``) of real ``sluice
dispatcher`` and ``sluice agent`` processes on a real nats-server: what the Kubernetes and
compose manifests under deploy/ point their liveness and readiness probes at. Every process is
stopped by its PID.

Mutations that make these tests fail (tried by hand): ``Agent.probe`` ignoring the state
(``ready = live and nats == "connected"``) fails the drain test (a draining agent stays
ready); ignoring ``engine.available`` fails the engine test; ``Dispatcher.probe`` answering
``ready=True`` while reconnecting fails the broker test."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from sluice.common.probes import HEALTH_PATH, METRICS_PATH, READY_PATH
from sluice.testing.natsserver import EmbeddedNats

from .conftest import SLUICE, Procs

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(port: int, path: str) -> tuple[int, dict[str, Any] | str]:
    """(status, JSON body or text); (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            body = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read().decode(), exc.code
    except OSError as exc:
        return 0, str(exc)
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


def _until(check: Any, what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout_s}s (last: {last!r})")


def _env(nats_url: str) -> dict[str, str]:
    return {
        "SLUICE_NATS_URL": nats_url,
        "SLUICE_DISPATCHER_LEARN_S": "0.2",
        "SLUICE_AGENT_HEARTBEAT_S": "0.2",
        "SLUICE_AGENT_SPEED": "20",
    }


def test_dispatcher_probes_leader_and_standby(nats_url: str, procs: Procs) -> None:
    ports = [_free_port(), _free_port()]
    for i, port in enumerate(ports):
        env = {
            **_env(nats_url),
            "SLUICE_DISPATCHER_DISPATCHER_ID": f"d{i}",
            "SLUICE_DISPATCHER_METRICS_PORT": str(port),
        }
        procs.start(["dispatcher"], env)
    roles = set()
    for port in ports:
        _until(lambda p=port: _get(p, HEALTH_PATH)[0] == 200, "dispatcher live")
        _, body = _until(
            lambda p=port: (r := _get(p, READY_PATH))[0] == 200 and r, "dispatcher ready"
        )
        assert isinstance(body, dict) and body["nats"] == "connected", body
        roles.add(body["role"])
        status, text = _get(port, METRICS_PATH)
        assert status == 200 and "sluice_dispatcher_leader" in str(text)
    assert roles == {"leader", "standby"}  # both ready: the leader and a standby


def test_agent_not_ready_while_draining_but_live(nats_url: str, procs: Procs) -> None:
    port = _free_port()
    env = {**_env(nats_url), "SLUICE_AGENT_METRICS_PORT": str(port)}
    agent = procs.start(["agent", "--worker-id", "probe-w", "--capacity", "2"], env)
    _until(lambda: _get(port, READY_PATH)[0] == 200, "agent ready")
    assert _get(port, READY_PATH)[1] == {
        "ready": True,
        "worker": "probe-w",
        "nats": "connected",
        "state": "serving",
        "engine": "available",
    }
    drain = subprocess.run(
        [*SLUICE, "drain", "probe-w"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert drain.returncode == 0, drain.stderr
    status, body = _get(port, READY_PATH)
    assert status == 503 and isinstance(body, dict) and body["state"] == "drained", body
    assert _get(port, HEALTH_PATH)[0] == 200  # draining is not a reason to restart it
    # SIGTERM: the probes answer until the process is done, then the port closes.
    os.kill(agent.pid, signal.SIGTERM)
    agent.wait(15)
    assert agent.returncode == 0, agent.stderr.read() if agent.stderr else ""
    assert _get(port, HEALTH_PATH)[0] == 0


def test_agent_with_its_engine_down_is_live_but_not_ready(nats_url: str, procs: Procs) -> None:
    port, engine_port = _free_port(), _free_port()  # nothing listens on engine_port
    env = {**_env(nats_url), "SLUICE_AGENT_METRICS_PORT": str(port), "SLUICE_AGENT_SPEED": "1"}
    args = ["agent", "--worker-id", "probe-e", "--engine", "openai-http"]
    agent = procs.start([*args, "--engine-url", f"http://127.0.0.1:{engine_port}"], env)
    _until(lambda: _get(port, HEALTH_PATH)[0] == 200 or agent.poll() is not None, "agent live")
    assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
    status, body = _get(port, READY_PATH)
    assert status == 503 and isinstance(body, dict), body
    assert body["engine"] == "unavailable" and body["state"] == "serving", body


def test_probes_fail_when_the_broker_is_gone(procs: Procs) -> None:
    """A broker that went away: not ready at once (reconnecting), still live (nats-py
    reconnects for ever; restarting would not help)."""
    server = EmbeddedNats()
    server.start()
    try:
        port = _free_port()
        env = {**_env(server.url), "SLUICE_DISPATCHER_METRICS_PORT": str(port)}
        procs.start(["dispatcher"], env)
        _until(lambda: _get(port, READY_PATH)[0] == 200, "dispatcher ready")
    finally:
        server.stop()
    _, body = _until(
        lambda: (r := _get(port, READY_PATH))[0] == 503 and r, "not ready without a broker"
    )
    assert isinstance(body, dict) and body["nats"] == "reconnecting", body
    assert _get(port, HEALTH_PATH)[0] == 200

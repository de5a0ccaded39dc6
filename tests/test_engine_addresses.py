"""Where an agent finds its engine's parts: the KV event replay socket beside its publisher,
metrics served apart from the engine (a real ``sluice engine`` on a Unix socket, its metrics
read over TCP from a second one), and settings that refuse an address they cannot use."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sluice.agent.engine import EngineError
from sluice.agent.errors import KVEventError
from sluice.agent.kvevents import replay_endpoint
from sluice.agent.runtime import AgentSettings
from sluice.agent.runtime.httpengine import HttpEngine, HttpEngineConfig
from sluice.common.errors import ConfigError
from sluice.testing.engineserver import EngineProcess

from .test_engine_server import _free_port, _start, _stop, _wait_healthy


def test_the_replay_socket_is_beside_the_publisher() -> None:
    assert replay_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    assert replay_endpoint("ipc:///run/e0.kv") == "ipc:///run/e0.kv.replay"
    for bad in ("udp://h:1", "tcp://h", "tcp://h:65535", "ipc://", "127.0.0.1:5557"):
        with pytest.raises(KVEventError):
            replay_endpoint(bad)


def test_agent_settings_refuse_addresses_they_cannot_use() -> None:
    http = {"engine": "openai-http", "engine_url": "unix:///run/e.sock"}
    AgentSettings(**http, engine_kv_events="ipc:///run/e.kv", engine_metrics_url="http://h:9/m")
    with pytest.raises(ValueError, match="tcp://host:port or ipc:///path"):
        AgentSettings(**http, engine_kv_events="localhost:5557")
    with pytest.raises(ValueError, match="engine_metrics_url"):
        AgentSettings(**http, engine_metrics_url="unix:///run/m.sock")
    # The agent binds only what vLLM and SGLang connect to: an ipc:// bind took the engine's
    # path over without an error, and neither heard the other.
    AgentSettings(**http, engine_kv_events="tcp://127.0.0.1:5557", engine_kv_bind=True)
    for theirs in ("ipc:///run/e.kv", "tcp://*:5557", "tcp://[::1]:5557"):
        with pytest.raises(ValueError, match="the engine binds"):
            AgentSettings(**http, engine_kv_events=theirs, engine_kv_bind=True)


async def test_metrics_are_read_where_the_metrics_url_says(tmp_path: Path) -> None:
    """The engine on a Unix socket, its metrics from another server: the scraped load is
    that server's (it runs a request; the engine the agent talks to runs none)."""
    engine = EngineProcess(str(tmp_path / "e.sock"), model="sim").start()
    port = _free_port()
    other = _start(["--port", str(port), "--speed", "1"])
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=30) as c:
            _wait_healthy(c, other)
        async with httpx.AsyncClient(base_url=base, timeout=30) as busy:
            body = {"prompt": list(range(512)), "max_tokens": 2000, "stream": True}
            async with busy.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()  # held: a dropped iterator closes the stream
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # its first token: running there now
                config = HttpEngineConfig(
                    url=engine.url, model="sim", metrics_url=f"{base}/metrics"
                )
                http = HttpEngine(config)
                await http.open()
                try:
                    assert http.scraped is not None and http.scraped.running == 1
                    assert http.scrape_errors == 0 and http.available
                finally:
                    await http.close()
    finally:
        _stop(other)
        engine.stop()
    with pytest.raises(EngineError, match="metrics URL"):
        HttpEngine(HttpEngineConfig(url="http://h:1", model="sim", metrics_url="ftp://h/m"))


def test_the_engine_refuses_a_kv_endpoint_it_cannot_bind(tmp_path: Path) -> None:
    from sluice.sim.profiles import get_profile
    from sluice.testing.engineserver import serve

    with pytest.raises(ConfigError, match="cannot publish KV events"):
        serve(get_profile("reference"), model="sim", uds=str(tmp_path / "s"), kv_events="x://")


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("host", "base"),
    [
        pytest.param(
            "::1",
            "http://[::1]",
            marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
        ("", "http://127.0.0.1"),  # every address, as uvicorn read it (getaddrinfo refuses "")
    ],
)
def test_the_engine_serves_on_an_ipv6_host_and_on_every_address(host: str, base: str) -> None:
    """It binds its sockets itself (so that a busy port is one line, not uvicorn's exit 3):
    bound as IPv4 whatever the host, ``--host ::1`` failed ("address family not supported"),
    and ``--host ""`` failed once it went to getaddrinfo as it is."""
    port = _free_port()
    proc = _start(["--host", host, "--port", str(port)])
    try:
        with httpx.Client(base_url=f"{base}:{port}", timeout=5) as client:
            _wait_healthy(client, proc)
    finally:
        _stop(proc)


def test_an_engine_that_fails_after_binding_lets_its_port_go() -> None:
    """Its sockets are bound before the rest is set up: a later failure (a KV endpoint it
    cannot use) closed none of them (seen as a ResourceWarning, the port held meanwhile)."""
    import socket

    from sluice.sim.profiles import REFERENCE
    from sluice.testing.engineserver import serve

    port = _free_port()
    with pytest.raises(ConfigError, match="cannot publish KV events") as failed:
        serve(REFERENCE, model="sim", port=port, kv_events="x://nowhere")
    assert failed.tb is not None  # (its frames, and what they hold, stay alive meanwhile)
    with socket.socket() as again:  # (no SO_REUSEADDR: a socket still bound there refuses it)
        again.bind(("127.0.0.1", port))


def test_a_kv_publisher_that_cannot_bind_leaves_nothing_open() -> None:
    """Its contexts and sockets were left to the garbage collector, whose destructor of a
    context with a socket in it hung another test's teardown (seen in CI)."""
    import gc
    import warnings

    import zmq

    from sluice.testing.engineserver import KVEventPublisher

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher("x://nowhere")
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], seen

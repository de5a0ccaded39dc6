"""The parts as separate processes, configured by environment and config file, and the demo
as a user runs it. Every process is stopped by its PID, also when an assertion fails."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice.agent.runtime import AgentSettings
from sluice.common.settings import ConfigError
from sluice.dispatcher.runtime import DispatcherSettings
from sluice.testing.natsserver import EmbeddedNats

from .conftest import SLUICE, Procs

pytestmark = pytest.mark.e2e


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def test_separate_processes_serve_a_cli_submission(nats_url: str, procs: Procs) -> None:
    env = {
        "SLUICE_NATS_URL": nats_url,
        "SLUICE_DISPATCHER_LEARN_S": "0.2",
        "SLUICE_DISPATCHER_MODELS": '["sim"]',
        "SLUICE_AGENT_SPEED": "20",
        "SLUICE_AGENT_HEARTBEAT_S": "0.2",
    }
    dispatcher = procs.start(["dispatcher"], env)
    agent = procs.start(["agent", "--worker-id", "proc-worker", "--capacity", "4"], env)
    out = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # The first submissions may come before the dispatcher created its streams.
        out = subprocess.run(
            [*SLUICE, "submit", "--model", "sim", "--prompt", "hello " * 40, "--max-tokens",
             "12", "--band", "interactive", "--json", "--timeout-s", "20"],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if out.returncode == 0:
            break
        time.sleep(0.3)
    assert out is not None and out.returncode == 0, out.stderr if out else "no attempt"
    result = json.loads(out.stdout)
    assert result["ok"] and result["worker_id"] == "proc-worker"
    assert len(result["output_tokens"]) == 12
    assert "logprobs" not in result  # (not asked for: not in the result)

    # --logprobs: a table of each token's (the simulated engine's pseudo ones).
    scored = subprocess.run(
        [*SLUICE, "submit", "--model", "sim", "--prompt", "hello " * 40, "--max-tokens", "3",
         "--logprobs", "2", "--timeout-s", "20"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr
    assert "most likely" in scored.stderr and scored.stderr.count("-") >= 3, scored.stderr

    # Unknown model through the CLI: a typed rejection and a distinct exit code. The model's
    # name is printed as it is (read as markup, "[/x]" was a MarkupError traceback).
    bad = subprocess.run(
        [*SLUICE, "submit", "--model", "no[/x]pe", "--tokens", "1,2,3", "--timeout-s", "20"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 4 and "unknown_model" in bad.stderr, bad.stderr
    assert "no[/x]pe" in bad.stderr, bad.stderr

    procs.stop_all()
    assert dispatcher.returncode == 0, dispatcher.stderr
    assert agent.returncode == 0, agent.stderr


def test_bad_settings_fail_with_a_clear_message() -> None:
    env = {**os.environ, "SLUICE_DISPATCHER_GLOBAL_LIMIT": "zero"}
    out = subprocess.run(
        [*SLUICE, "dispatcher"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "global_limit" in out.stderr
    out = subprocess.run(
        [*SLUICE, "submit", "--model", "m"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "exactly one of" in out.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SLUICE_DISPATCHER_LEASE_S", "inf"),  # a lease that never expires
        ("SLUICE_DISPATCHER_ACK_WAIT_S", "inf"),  # an OverflowError at start
        ("SLUICE_DISPATCHER_BAND_DELAY_S", '{"interactive": "nan"}'),
        ("SLUICE_AGENT_HEARTBEAT_S", "inf"),
    ],
)
def test_infinite_or_nan_settings_are_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: SluiceSettings without allow_inf_nan=False (each was taken)."""
    from sluice.agent.runtime.settings import AgentSettings
    from sluice.common.settings import ConfigError
    from sluice.dispatcher.runtime.settings import DispatcherSettings

    monkeypatch.setenv(name, value)
    field = name.removeprefix("SLUICE_DISPATCHER_").removeprefix("SLUICE_AGENT_").lower()
    with pytest.raises(ConfigError, match=field):
        if name.startswith("SLUICE_AGENT_"):
            AgentSettings.load(worker_id="w", engine="sim")
        else:
            DispatcherSettings.load()


def test_settings_from_file_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "sluice.toml"
    cfg.write_text(
        'nats_url = "nats://127.0.0.1:4999"\n'
        "[dispatcher]\nglobal_limit = 7\nband_limits = { batch = 3 }\n"
        '[agent]\nworker_id = "gpu-3"\nmodels = ["a", "b"]\n'
    )
    monkeypatch.setenv("SLUICE_DISPATCHER_LEASE_S", "2.5")
    d = DispatcherSettings.load(cfg)
    assert (d.nats_url, d.global_limit, d.band_limits, d.lease_s) == (
        "nats://127.0.0.1:4999",
        7,
        {"batch": 3},
        2.5,
    )
    monkeypatch.setenv("SLUICE_DISPATCHER_GLOBAL_LIMIT", "9")  # environment beats the file
    assert DispatcherSettings.load(cfg).global_limit == 9
    a = AgentSettings.load(cfg, capacity=3)  # explicit arguments beat both
    assert (a.worker_id, a.models, a.capacity) == ("gpu-3", ["a", "b"], 3)

    cfg.write_text("[dispatcher]\nband_limits = { nope = 1 }\n")
    with pytest.raises(ConfigError, match="unknown bands"):
        DispatcherSettings.load(cfg)
    cfg.write_text("This is [not toml\n")  # its syntax error names the file
    with pytest.raises(ConfigError, match=f"from {re.escape(str(cfg))}: Expected"):
        DispatcherSettings.load(cfg)
    # A misspelled table would be every part's to ignore: an error (mutation: the check
    # removed from _Section; the dispatcher then started on its defaults).
    cfg.write_text("[dispatchr]\nglobal_limit = 7\n")
    for part in (DispatcherSettings, AgentSettings):
        with pytest.raises(ConfigError, match=r"unknown table \[dispatchr\]"):
            part.load(cfg)
    cfg.write_text("[dispatcher]\nrouting_policy_extra = { a = 1 }\n")  # a map inside a table
    with pytest.raises(ConfigError, match="routing_policy_extra"):
        DispatcherSettings.load(cfg)
    with pytest.raises(ConfigError, match="not found"):
        DispatcherSettings.load(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="worker_id"):
        AgentSettings.load(None, worker_id="a.b")
    # A variable that names no setting (a typo, a renamed setting) is an error, not ignored.
    monkeypatch.setenv("SLUICE_AGENT_DIGEST_STRIDE_BLOCKS", "8")
    with pytest.raises(ConfigError, match="SLUICE_AGENT_DIGEST_STRIDE_BLOCKS"):
        AgentSettings.load(None)


def test_example_config_in_deploy_loads() -> None:
    example = Path(__file__).parent.parent / "deploy" / "sluice.example.toml"
    assert DispatcherSettings.load(example).global_limit > 0
    assert AgentSettings.load(example).models


def test_embedded_nats_stops_its_process() -> None:
    server = EmbeddedNats().start()
    pid = server.pid
    assert pid is not None and _pid_alive(pid)
    store = Path(server.store_dir)
    server.stop()
    assert not _pid_alive(pid)
    assert not store.exists()


def _demo(args: list[str], *, session: bool = False) -> subprocess.Popen[str]:
    """The demo as a user starts it: on its own embedded server (``session``: in a process
    group of its own, as a terminal's foreground job is)."""
    return subprocess.Popen(
        [*SLUICE, "demo", *args],
        env={k: v for k, v in os.environ.items() if k != "SLUICE_NATS_URL"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=session,
    )


def _nats_pid(output: str) -> int:
    m = re.search(r"embedded nats-server pid (\d+)", output)
    assert m, output
    return int(m.group(1))


def test_demo_runs_and_leaves_no_process_behind() -> None:
    p = _demo(["--duration", "3", "--speed", "4", "--sessions", "8"])
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    for title in ("Summary", "By band", "Per worker", "worker-3"):
        assert title in out
    assert not _pid_alive(_nats_pid(out))


@pytest.mark.parametrize("to_group", [False, True], ids=["to-the-demo", "to-its-group"])
def test_demo_ctrl_c_prints_summary_and_cleans_up(to_group: bool) -> None:
    """Ctrl-C in a terminal signals the whole foreground process group: the embedded broker
    must not stop under the demo winding down on it. Mutation: the broker spawned in the
    demo's process group (the demo did not end within 60 s of the group's SIGINT)."""
    p = _demo(["--duration", "60", "--speed", "4", "--sessions", "8"], session=to_group)
    try:
        head = _read_until(p, "Sluice demo")
        time.sleep(2)
        if to_group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    out = head + rest
    assert p.returncode == 0, out
    assert "interrupted" in out and "Summary" in out and "Traceback" not in out
    assert not _pid_alive(_nats_pid(out))


def test_embedded_nats_dies_with_a_killed_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    # The store is under tmp_path: a SIGKILLed parent cannot remove its own.
    script.write_text(
        "import time\n"
        "from sluice.testing.natsserver import EmbeddedNats\n"
        f"s = EmbeddedNats(store_dir={str(tmp_path / 'store')!r}).start()\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _pid_alive(child)
    finally:
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait(10)
    deadline = time.monotonic() + 10
    while _pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(child)


_PARENT_OF_ALL = """
import sys, time
from pathlib import Path
from sluice.cli.benchfailover import _start
from sluice.cli.benchlive import _spawn
from sluice.cli.benchrouters import Proc
from sluice.testing.engineserver import EngineProcess
from sluice.testing.gateway import GatewayProcess
from sluice.testing.natsserver import EmbeddedNats

tmp = Path(sys.argv[1])
nats = EmbeddedNats(store_dir=str(tmp / "store")).start()
engine = EngineProcess(str(tmp / "e.sock"), model="sim")
engine.launch()
children = [
    nats.pid,
    engine.proc.pid,
    GatewayProcess(nats.url).start().pid,
    _spawn(["dispatcher"], {"SLUICE_NATS_URL": nats.url}, tmp / "live.log").pid,
    _start(nats.url, "failover-0", tmp).pid,
    Proc("router", [sys.executable, "-c", "import time; time.sleep(60)"], str(tmp)).proc.pid,
]
print(*children, flush=True)
time.sleep(60)
"""


def test_every_process_a_benchmark_starts_dies_with_a_killed_parent(tmp_path: Path) -> None:
    """A parent killed with SIGKILL (a CI job's timeout, the OOM killer) runs no cleanup: the
    kernel stops its children (PR_SET_PDEATHSIG). Only the broker had that: engines, the
    gateway, the live benchmark's and the failover benchmark's dispatchers and bench-routers'
    routers ran on."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT_OF_ALL, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    children: list[int] = []
    try:
        assert parent.stdout is not None
        children = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(children) == 6 and all(_pid_alive(c) for c in children), children
    finally:
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait(10)
    deadline = time.monotonic() + 15
    while any(_pid_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [c for c in children if _pid_alive(c)]
    for c in left:  # (not to leave them to the next test)
        with contextlib.suppress(ProcessLookupError):
            os.kill(c, signal.SIGKILL)
    assert not left, f"still running after their parent was killed: {left} of {children}"


def test_sluice_nats_serves_in_the_foreground_and_stops_on_sigterm(procs: Procs) -> None:
    import socket

    p = procs.start(["nats", "--port", "-1"], {})
    assert p.stdout is not None
    line = p.stdout.readline()
    m = re.search(r"pid (\d+)\) listening on nats://127\.0\.0\.1:(\d+)", line)
    if not m:
        p.kill()
        rest, err = p.communicate(timeout=10)
        raise AssertionError(f"no listening line: {line!r} {rest!r} stderr={err!r}")
    server_pid, port = int(m.group(1)), int(m.group(2))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert s.recv(4096).startswith(b"INFO ")  # a real NATS server greets every client
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0
    assert "nats-server stopped" in out
    assert not _pid_alive(server_pid)


def _read_until(p: subprocess.Popen[str], text: str) -> str:
    """A process's output, line by line, up to the first line holding ``text``."""
    assert p.stdout is not None
    head = ""
    while text not in head:
        line = p.stdout.readline()
        assert line, head  # it ended first
        head += line
    return head


def _session_members(sid: int) -> list[str]:
    """The processes of session ``sid`` still alive (their command lines)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        fields = text.rsplit(")", 1)[1].split()  # after the command's name, which may hold ")"
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint", "sigint-ignored"])
def test_sigterm_stops_a_command_and_every_process_it_started(sigint_ignored: bool) -> None:
    """SIGTERM to a command (a service manager's stop, ``timeout``) winds it down as Ctrl-C
    does. Mutation: without the CLI's SIGTERM handler, ``bench-engine`` died at once and left
    its ``sluice engine`` process running (seen). A background job of a shell script starts
    with SIGINT ignored: SIGTERM turned into a SIGINT was ignored with it and the command ran
    on (seen); then SIGTERM's default killed it at once, leaving its engine (a reviewer's
    find)."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    p = subprocess.Popen(
        [*SLUICE, "bench-engine", "--requests", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own session: what it leaves behind can be found
        preexec_fn=ignore,
    )
    try:
        head = _read_until(p, "leads")  # its dispatcher runs: the engine process has started
        assert any("sluice.cli engine" in c for c in _session_members(p.pid)), head
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=60)
        if not sigint_ignored:
            assert p.returncode == 130, head + rest
            assert "Traceback" not in rest, rest
        assert p.returncode != 0
        deadline = time.monotonic() + 10
        while _session_members(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session_members(p.pid) == []  # its engine stopped with it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)

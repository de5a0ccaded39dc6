"""Every example of docs/producers.md runs as written against ``sluice up``: a real ``sluice up``
process (embedded nats-server, dispatcher, workers, gateway), each ``<!-- example: NAME -->``
block run as its own process (Python with this interpreter, bash with the venv's ``sluice`` and
``python`` first on PATH). The one change: the guide's default addresses (NATS on port 4222,
the gateway on 8080) become the free ports this ``sluice up`` took."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice.testing.processes import stop_processes

pytestmark = pytest.mark.e2e

GUIDE = Path(__file__).parent.parent / "docs" / "producers.md"
_EXAMPLE = re.compile(r"<!-- example: (\w+) -->\n```(python|bash)\n(.*?)```", re.S)


def examples() -> list[tuple[str, str, str]]:
    return [(m.group(1), m.group(2), m.group(3)) for m in _EXAMPLE.finditer(GUIDE.read_text())]


def test_the_guide_has_its_examples() -> None:
    names = [name for name, _, _ in examples()]
    assert names == [
        "client_stream",
        "openai_chat",
        "openai_session",
        "openai_batch",
        "sluice_batch",
        "subscription",
    ]


@pytest.fixture(scope="module")
def stack() -> object:
    cmd = [sys.executable, "-m", "sluice.cli", "up", "--nats-port", "-1", "--port", "0"]
    cmd += ["--workers", "2", "--speed", "20"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    urls: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while time.monotonic() < deadline and len(urls) < 2:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"sluice up exited with {proc.wait()}")
            m = re.match(r"\s+(NATS|gateway)\s+(\S+)", line)
            if m:
                urls[m.group(1)] = m.group(2).removesuffix("/v1")
        assert len(urls) == 2, urls
        yield urls
    finally:
        # Ctrl-C: it stops everything it started
        stop_processes([proc], signal.SIGINT, timeout_s=30)


@pytest.mark.parametrize("name", [name for name, _, _ in examples()])
def test_an_example_runs_as_written(name: str, stack: dict[str, str], tmp_path: Path) -> None:
    _, lang, code = next(e for e in examples() if e[0] == name)
    code = code.replace("nats://127.0.0.1:4222", stack["NATS"])
    code = code.replace("http://127.0.0.1:8080", stack["gateway"])
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "SLUICE_NATS_URL": stack["NATS"],
    }
    argv = (
        [sys.executable, "-c", code]
        if lang == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{name} printed nothing"
    if name == "sluice_batch":
        assert re.search(r"\b50 answers\.jsonl", done.stdout) and re.search(
            r"\b1 errors\.jsonl", done.stdout
        )


def test_sluice_up_stops_everything_it_started_on_ctrl_c() -> None:
    cmd = [sys.executable, "-m", "sluice.cli", "up", "--nats-port", "-1", "--port", "0"]
    cmd += ["--workers", "2", "--engines", "http", "--speed", "20"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"sluice up exited with {proc.wait()}")
            pids += [int(p) for p in re.findall(r"pid (\d+)", line)]
            if "Sluice is up" in line:
                break
        assert len(pids) == 3  # the nats-server and the two engines
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

"""``sluice gateway`` as a user runs it: its own process, configured by a TOML file, stopped
by its PID (also when an assertion fails)."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI

from sluice.client import Client
from sluice.testing.cluster import LocalCluster
from sluice.testing.gateway import GatewayProcess

from .conftest import cluster_kwargs

pytestmark = pytest.mark.e2e

SECRET = "sk-proc-51d7a0c2-not-for-any-log"
SLUICE = [sys.executable, "-m", "sluice.cli"]


async def test_the_gateway_process_serves_keyed_tenants(nats_url: str, tmp_path: Path) -> None:
    """A key given as its SHA-256 digest in the config file: its requests run as its tenant
    and band; another key is a 401; SIGTERM stops the process with exit code 0, and nothing
    it wrote names the key."""
    config = tmp_path / "sluice.toml"
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    config.write_text(
        f'[[gateway.keys]]\nname = "acme"\nkey_sha256 = "{digest}"\ntenant = "acme"\n'
        'default_band = "standard"\n'
    )
    gw = GatewayProcess(nats_url, config=config)
    async with LocalCluster(nats_url, **cluster_kwargs(workers=1)), Client(nats_url) as c:
        try:
            await asyncio.to_thread(gw.start)  # the cluster's loop keeps running meanwhile
            oa = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0, timeout=20)
            async with oa:
                reply = await oa.chat.completions.create(
                    model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
                with pytest.raises(openai.AuthenticationError):
                    await oa.with_options(api_key="sk-nope").models.list()
            stored = await c.fetch_result(reply.id.split("-", 1)[1], tenant="acme")
        finally:
            code = await asyncio.to_thread(gw.stop)
    assert stored is not None and stored.ok and stored.band == "standard"
    assert code == 0, "\n".join(gw.lines)
    said = "\n".join(gw.lines)
    assert "1 API key" in said and SECRET not in said and digest not in said


def test_an_open_gateway_says_so_when_it_starts(nats_url: str) -> None:
    with GatewayProcess(nats_url) as gw:
        assert any("OPEN" in line for line in gw.lines), gw.lines
    assert gw.proc is not None and gw.proc.returncode == 0


def test_an_open_gateway_refuses_a_network_address(tmp_path: Path) -> None:
    out = subprocess.run(
        [*SLUICE, "gateway", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "allow_open_non_loopback" in out.stderr and "not a loopback" in out.stderr


def test_bad_gateway_settings_exit_with_code_2_and_never_print_a_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(f'[[gateway.keys]]\nkey = "{SECRET}"\ntennant = "acme"\n')
    said = []
    for args in (["--config", str(config)], ["--config", str(tmp_path / "missing.toml")]):
        out = subprocess.run(
            [*SLUICE, "gateway", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 2, out.stderr
        assert "error:" in out.stderr and SECRET not in out.stderr + out.stdout
        said.append(out.stderr)
    assert "keys.0.tenant" in said[0] and "keys.0.tennant" in said[0]  # names what is wrong
    assert "config file not found" in said[1]


async def test_the_gateway_benchmark_measures_both_paths() -> None:
    """Both paths run: the gateway process answered every request of its path (its own
    metrics say so: a gateway path that bypassed the gateway fails), and each first token
    comes no sooner than the simulated prefill of its prompt (timing a path without waiting
    for its tokens fails). Figures are printed as the command prints them."""
    from rich.console import Console

    from sluice.cli.benchgateway import PROMPT_TOKENS, bench_gateway, table, verdict
    from sluice.sim.profiles import get_profile

    speed, requests, burst = 50.0, 3, 12
    r = await bench_gateway(
        requests=requests, burst=burst, concurrency=4, max_tokens=4, speed=speed, workers=2
    )
    assert r.relayed == 8 + requests + 2 * burst  # warm-ups, sequential, two bursts
    prefill_ms = PROMPT_TOKENS / get_profile("reference").prefill_tokens_per_s / speed * 1000
    for path in (r.client, r.gateway):
        assert path.ttft_p50_ms >= prefill_ms and path.rps > 0, r
    console = Console(record=True, width=200)
    console.print(table(r))
    console.print(verdict(r))
    out = console.export_text()
    assert f"{r.gateway.ttft_p50_ms:.2f} ms" in out and f"{r.added_ttft_p50_ms:+.2f} ms" in out

"""``sluice up``: the whole stack in one foreground command, for trying Sluice and for the
examples: an embedded nats-server, a dispatcher, N simulated workers (in process, or one
``sluice engine`` process each behind HTTP), and the gateway. Ctrl-C stops everything it
started, by PID."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass

from pydantic import ValidationError
from rich.console import Console

from sluice.common.errors import ConfigError
from sluice.schemas.codec import summarise
from sluice.testing.cluster import LocalCluster
from sluice.testing.fleet import HttpEngineFleet
from sluice.testing.natsserver import EmbeddedNats

READY = "Sluice is up"
"""The line ``sluice up`` prints once everything serves (scripts and tests wait for it)."""


@dataclass(frozen=True)
class UpConfig:
    workers: int = 4
    engines: str = "inproc"
    """``inproc``: engines in the agents' process; ``http``: one ``sluice engine`` process per
    agent over a Unix socket, its KV events beside it."""
    model: str = "demo-8b"
    speed: float = 1.0
    host: str = "127.0.0.1"
    port: int = 8080
    nats_port: int = 4222
    capacity: int = 32


def snippet(gateway_url: str, nats_url: str, model: str) -> str:
    """What to paste to try it: the openai SDK against the gateway, and the client library."""
    return f'''from openai import OpenAI

client = OpenAI(base_url="{gateway_url}/v1", api_key="none")
reply = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=16
)
print(reply.choices[0].message.content, reply.usage)

# or the client library: async with sluice.client.Client("{nats_url}") as c: ...'''


async def run_up(cfg: UpConfig, console: Console, stop: asyncio.Event | None = None) -> None:
    """Run the stack until ``stop`` is set (or SIGINT/SIGTERM)."""
    from sluice.gateway import GatewayServer, GatewaySettings

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    # Bad gateway settings (a non-loopback host without keys) stop it before anything starts.
    # From the environment only, as before: a config file's broker settings (TLS, creds) are
    # for another broker than the embedded one.
    try:
        settings = GatewaySettings(host=cfg.host, port=cfg.port)
    except ValidationError as exc:
        raise ConfigError(f"invalid gateway settings: {summarise(exc)}") from exc
    nats = EmbeddedNats(port=cfg.nats_port).start()
    fleet: HttpEngineFleet | None = None
    try:
        console.print(f"[dim]nats-server pid {nats.pid} on {nats.url}[/dim]")
        agent_for = None
        if cfg.engines == "http":
            fleet = HttpEngineFleet(cfg.workers, model=cfg.model, speed=cfg.speed).start()
            for worker_id, e in fleet.engines.items():
                pid = e.proc.pid if e.proc else 0
                console.print(f"[dim]sluice engine pid {pid} for {worker_id} on {e.url}[/dim]")
            agent_for = fleet.agent_for
        cluster = LocalCluster(
            nats.url,
            workers=cfg.workers,
            dispatcher={"models": [cfg.model]},
            agent={"models": [cfg.model], "speed": cfg.speed, "capacity": cfg.capacity},
            agent_for=agent_for,
        )
        settings = settings.model_copy(update={"nats_url": nats.url})
        async with cluster, GatewayServer(settings) as gateway:
            console.print(
                f"[bold]{READY}[/bold]: {cfg.workers} workers serving {cfg.model!r} "
                f"({'sluice engine over HTTP' if fleet else 'in process'}, speed x{cfg.speed:g})\n"
                f"  NATS     {nats.url}\n"
                f"  gateway  {gateway.url}/v1  (OpenAI API: chat, completions, files, batches)\n"
                f"  metrics  {gateway.url}/metrics\n"
                "Try it (Ctrl-C stops everything):\n"
            )
            console.print(snippet(gateway.url, nats.url, cfg.model), markup=False, highlight=False)
            await stop.wait()
            console.print("[dim]stopping[/dim]")
    finally:
        if fleet is not None:
            fleet.stop()
        nats.stop()

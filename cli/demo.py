"""``sluice demo``: embedded NATS, a dispatcher, simulated workers and a realistic mixed
workload pushed through the client library, with live progress and a summary table."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from sluice.client import (
    Client,
    NotConnected,
    QueueFull,
    Rejected,
    ServiceUnavailable,
    SluiceError,
)
from sluice.common.aio import wait_event
from sluice.dispatcher.stats import percentile
from sluice.schemas import names
from sluice.schemas.codec import decode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import Heartbeat, Result
from sluice.sim.workload import DemoWorkload
from sluice.testing.cluster import LocalCluster
from sluice.testing.engineserver import EngineProcess
from sluice.testing.fleet import HttpEngineFleet
from sluice.testing.natsserver import EmbeddedNats

MODEL = "demo-8b"


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of the demo run."""

    duration_s: float = 30.0
    workers: int = 4
    sessions: int = 40
    rag_rate: float = 3.0
    batch_rate: float = 5.0
    speed: float = 1.0
    capacity: int = 32
    global_limit: int = 96
    batch_limit: int = 48
    seed: int = 7
    drain_s: float = 30.0
    nats_url: str | None = None
    engines: str = "sim"
    """``sim``: engines in the agents' process; ``http``: one ``sluice engine`` process per
    agent, reached with the ``openai-http`` backend over a Unix socket, its KV events on an
    IPC socket beside it."""


@dataclass
class _Outcome:
    band: str
    result: Result | None = None
    error: str = ""


@dataclass
class DemoReport:
    """Everything the summary shows (also returned to tests)."""

    elapsed_s: float
    outcomes: list[_Outcome] = field(default_factory=list)
    busy_s: dict[str, float] = field(default_factory=dict)
    unfinished: int = 0
    interrupted: bool = False

    @property
    def done(self) -> list[Result]:
        return [o.result for o in self.outcomes if o.result is not None]

    @property
    def rejected(self) -> Counter[str]:
        return Counter(o.error for o in self.outcomes if o.error)

    def hit_rate(self, results: list[Result] | None = None) -> float:
        rs = self.done if results is None else results
        prompt = sum(r.prompt_tokens for r in rs)
        return sum(r.cached_tokens for r in rs) / prompt if prompt else 0.0


class _Run:
    def __init__(self, cfg: DemoConfig, client: Client, cluster: LocalCluster) -> None:
        self.cfg = cfg
        self.client = client
        self.cluster = cluster
        self.work = DemoWorkload(cfg.seed)
        self.rng = random.Random(cfg.seed + 1)
        self.stop = asyncio.Event()
        self.idle = asyncio.Event()
        self.outcomes: list[_Outcome] = []
        self.in_flight = 0
        self.submitted = 0
        self.busy_s: dict[str, float] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def request(self, band: str, prompt: list[int], max_tokens: int) -> Result | None:
        out = _Outcome(band)
        self.outcomes.append(out)
        self.submitted += 1
        self.in_flight += 1
        try:
            handle = await self.client.submit(MODEL, prompt, max_tokens=max_tokens, band=band)
            out.result = await handle.result()
            return out.result
        except QueueFull:
            out.error = "queue_full"
        except Rejected as exc:
            out.error = exc.reason.value
        except (NotConnected, ServiceUnavailable):
            if not self.stop.is_set():
                out.error = "service_unavailable"
            # else: cut off by the demo's own stop: unfinished, not rejected
        except SluiceError as exc:
            out.error = type(exc).__name__
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self.stop.is_set():
                self.idle.set()
        return None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def conversation(self, start_delay_s: float) -> None:
        await _sleep_or_stop(self.stop, start_delay_s)
        conv = self.work.new_conversation()
        while not self.stop.is_set():
            prompt = conv.next_prompt(self.work.rng, self.work.user_tokens())
            result = await self.request("interactive", prompt, self.work.chat_max_tokens())
            if result is not None:
                conv.add_reply(result.output_tokens)
            if conv.turns >= self.work.mix.max_turns or result is None:
                conv = self.work.new_conversation()
            await _sleep_or_stop(self.stop, self.work.think_s())

    async def poisson(self, rate: float, band: str, make: str) -> None:
        while not self.stop.is_set() and rate > 0:
            await _sleep_or_stop(self.stop, self.rng.expovariate(rate))
            if self.stop.is_set():
                break
            prompt, max_tokens = (
                self.work.rag_prompt() if make == "rag" else self.work.batch_prompt()
            )
            self.spawn(self.request(band, prompt, max_tokens))

    async def on_heartbeat(self, msg: object) -> None:
        with contextlib.suppress(DecodeError):
            hb = decode(msg.data, Heartbeat)  # type: ignore[attr-defined]
            self.busy_s[hb.worker_id] = hb.load.busy_s_total


def _live_table(run: _Run, elapsed: float, cfg: DemoConfig) -> Table:
    done = [o.result for o in run.outcomes if o.result is not None]
    rejected = sum(1 for o in run.outcomes if o.error)
    ttfts = [r.timings.ttft_s for r in done if r.timings]
    prompt = sum(r.prompt_tokens for r in done)
    hit = sum(r.cached_tokens for r in done) / prompt if prompt else 0.0
    sched = run.cluster.dispatcher.scheduler
    t = Table(
        title=f"sluice demo  {elapsed:5.1f}/{cfg.duration_s:.0f} s",
        caption="live: awaiting a result · queue/run: in the dispatcher / on workers",
        box=box.SIMPLE_HEAVY,
    )
    # Short headers: the live view must fit an 80-column terminal.
    for col in ("sent", "done", "rej", "live", "queue", "run", "req/s",
                "TTFT p50", "TTFT p99", "hit"):  # fmt: skip
        t.add_column(col, justify="right")
    t.add_row(
        str(run.submitted),
        str(len(done)),
        str(rejected),
        str(run.in_flight),
        str(sched.queued),
        str(sched.running),
        f"{len(done) / max(elapsed, 1e-9):.1f}",
        _fmt_s(percentile(ttfts, 50)),
        _fmt_s(percentile(ttfts, 99)),
        f"{hit:.0%}",
    )
    return t


def _fmt_s(v: float) -> str:
    return "-" if math.isnan(v) else (f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s")


async def _sleep_or_stop(stop: asyncio.Event, delay_s: float) -> None:
    await wait_event(stop, delay_s)


async def run_demo(cfg: DemoConfig, console: Console | None = None) -> DemoReport:
    """Run the demo on its own embedded NATS (or ``cfg.nats_url``) and return its report."""
    console = console or Console()
    server: EmbeddedNats | None = None
    if cfg.nats_url is None:
        server = EmbeddedNats().start()
        console.print(f"[dim]embedded nats-server pid {server.pid} on {server.url}[/dim]")
    url = cfg.nats_url or (server.url if server else "")
    fleet: HttpEngineFleet | None = None
    try:
        agent_for = None
        if cfg.engines == "http":

            def started(worker_id: str, engine: EngineProcess) -> None:
                pid = engine.proc.pid if engine.proc else 0
                where = f"{engine.url}, KV events on {engine.kv_events}"
                console.print(f"[dim]sluice engine pid {pid} on {where}[/dim]")

            fleet = HttpEngineFleet(
                cfg.workers, model=MODEL, speed=cfg.speed, on_start=started
            ).start()
            agent_for = fleet.agent_for
        return await _run(cfg, url, console, agent_for)
    finally:
        if fleet is not None:
            fleet.stop()
        if server is not None:
            server.stop()


async def _run(
    cfg: DemoConfig,
    url: str,
    console: Console,
    agent_for: Callable[[str], dict[str, Any]] | None = None,
) -> DemoReport:
    cluster = LocalCluster(
        url,
        workers=cfg.workers,
        dispatcher={
            "models": [MODEL],
            "global_limit": cfg.global_limit,
            "band_limits": {"batch": cfg.batch_limit},
            "lease_s": 3.0,
            "learn_s": 0.3,
            "tick_s": 0.05,
        },
        agent={"models": [MODEL], "speed": cfg.speed, "capacity": cfg.capacity},
        agent_for=agent_for,
    )
    interrupted = False
    async with cluster, Client(url) as client:
        run = _Run(cfg, client, cluster)
        hb_sub = await client.nc.subscribe(names.HEARTBEAT_SUBJECTS, cb=run.on_heartbeat)
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            nonlocal interrupted
            interrupted = True
            run.stop.set()
            # A second Ctrl-C stops at once (cleanup still runs in the finally blocks).
            loop.remove_signal_handler(signal.SIGINT)

        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGINT, on_signal)
            loop.add_signal_handler(signal.SIGTERM, on_signal)
        console.print(
            f"[bold]Sluice demo[/bold]: {cfg.workers} simulated workers"
            f"{' behind HTTP (sluice engine)' if cfg.engines == 'http' else ''}"
            " (reference profile, "
            f"speed x{cfg.speed:g}), {cfg.sessions} chat sessions, RAG {cfg.rag_rate:g}/s, "
            f"batch {cfg.batch_rate:g}/s, for {cfg.duration_s:g} s"
        )
        t0 = time.monotonic()
        for i in range(cfg.sessions):
            run.spawn(run.conversation(start_delay_s=i * 2.0 / max(cfg.sessions, 1)))
        run.spawn(run.poisson(cfg.rag_rate, "standard", "rag"))
        run.spawn(run.poisson(cfg.batch_rate, "batch", "batch"))
        try:
            await _progress(run, cfg, console, t0)
            run.stop.set()
            if run.in_flight:
                await wait_event(run.idle, cfg.drain_s)
        finally:
            run.stop.set()
            for task in list(run.tasks):
                task.cancel()
            with contextlib.suppress(nats.errors.Error):  # the connection may be gone
                await hb_sub.unsubscribe()
            with contextlib.suppress(NotImplementedError, ValueError):
                loop.remove_signal_handler(signal.SIGINT)
                loop.remove_signal_handler(signal.SIGTERM)
        elapsed = time.monotonic() - t0
        return DemoReport(
            elapsed_s=elapsed,
            outcomes=list(run.outcomes),
            busy_s=dict(run.busy_s),
            unfinished=sum(1 for o in run.outcomes if o.result is None and not o.error),
            interrupted=interrupted,
        )


async def _progress(run: _Run, cfg: DemoConfig, console: Console, t0: float) -> None:
    if console.is_terminal:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while not run.stop.is_set() and time.monotonic() - t0 < cfg.duration_s:
                live.update(Group(_live_table(run, time.monotonic() - t0, cfg)))
                await _sleep_or_stop(run.stop, 0.25)
            live.update(Group(_live_table(run, time.monotonic() - t0, cfg)))
        console.print("[dim]load stopped; waiting for in-flight requests...[/dim]")
        return
    next_print = t0
    while not run.stop.is_set() and time.monotonic() - t0 < cfg.duration_s:
        if time.monotonic() >= next_print:
            elapsed = time.monotonic() - t0
            done = sum(1 for o in run.outcomes if o.result is not None)
            console.print(
                f"[{elapsed:5.1f}s] submitted {run.submitted}  done {done}  "
                f"in flight {run.in_flight}  queued {run.cluster.dispatcher.scheduler.queued}"
            )
            next_print += 5.0
        await _sleep_or_stop(run.stop, 0.25)


def summary_tables(report: DemoReport, workers: list[str]) -> list[Table]:
    """The end-of-run summary: overall, per band, per worker."""
    done = report.done
    el = max(report.elapsed_s, 1e-9)
    overall = Table(title="Summary", show_header=True)
    for col in ("requests", "done", "rejected", "unfinished", "throughput", "output tok/s",
                "TTFT p50", "TTFT p99", "queue p50", "queue p99", "prefix hit rate"):  # fmt: skip
        overall.add_column(col, justify="right")
    overall.add_row(*_row(report, done, el, len(report.outcomes)))

    bands = Table(title="By band", show_header=True)
    for col in ("band", "requests", "done", "rejected", "TTFT p50", "TTFT p99", "queue p50",
                "queue p99", "hit rate"):  # fmt: skip
        bands.add_column(col, justify="right")
    by_band: dict[str, list[_Outcome]] = defaultdict(list)
    for o in report.outcomes:
        by_band[o.band].append(o)
    for band in ("interactive", "standard", "batch"):
        os_ = by_band.get(band, [])
        rs = [o.result for o in os_ if o.result is not None]
        ttft = [r.timings.ttft_s for r in rs if r.timings]
        queue = [r.timings.queued_s for r in rs if r.timings]
        bands.add_row(
            band,
            str(len(os_)),
            str(len(rs)),
            str(sum(1 for o in os_ if o.error)),
            _fmt_s(percentile(ttft, 50)),
            _fmt_s(percentile(ttft, 99)),
            _fmt_s(percentile(queue, 50)),
            _fmt_s(percentile(queue, 99)),
            f"{report.hit_rate(rs):.0%}",
        )

    per_worker = Table(title="Per worker", show_header=True)
    for col in ("worker", "requests", "prompt tokens", "cached tokens", "hit rate", "busy"):
        per_worker.add_column(col, justify="right")
    for w in workers:
        rs = [r for r in done if r.worker_id == w]
        busy = report.busy_s.get(w, 0.0) / el
        per_worker.add_row(
            w,
            str(len(rs)),
            f"{sum(r.prompt_tokens for r in rs):,}",
            f"{sum(r.cached_tokens for r in rs):,}",
            f"{report.hit_rate(rs):.0%}",
            f"{min(busy, 1.0):.0%}",
        )
    return [overall, bands, per_worker]


def _row(report: DemoReport, done: list[Result], el: float, n: int) -> list[str]:
    ttft = [r.timings.ttft_s for r in done if r.timings]
    queue = [r.timings.queued_s for r in done if r.timings]
    rejected = report.rejected
    rej = str(sum(rejected.values()))
    if rejected:
        rej += " (" + ", ".join(f"{k} {v}" for k, v in rejected.most_common()) + ")"
    return [
        str(n),
        str(len(done)),
        rej,
        str(report.unfinished),
        f"{len(done) / el:.1f} req/s",
        f"{sum(len(r.output_tokens) for r in done) / el:,.0f}",
        _fmt_s(percentile(ttft, 50)),
        _fmt_s(percentile(ttft, 99)),
        _fmt_s(percentile(queue, 50)),
        _fmt_s(percentile(queue, 99)),
        f"{report.hit_rate():.1%}",
    ]

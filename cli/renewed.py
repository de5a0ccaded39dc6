"""``sluice renewed``: the requests that have renewed copies, and moving them back to their
bands' queues before a rollback to a release without renewals (docs/operations.md,
"Upgrading")."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sluice.cli.console import err, fail, with_client

app = typer.Typer(
    help="Requests that have renewed copies (SLUICE_RENEWED), and moving them back.",
    no_args_is_help=True,
)
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML config file (else $SLUICE_CONFIG_FILE)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="The figures as one JSON object.")]
T = TypeVar("T")
_NO_STREAM = (
    "this broker has no SLUICE_RENEWED stream: no dispatcher with renewals ran here (is it "
    "the right broker?)"
)


def _run(config: Path | None, call: Callable[[Any, Any], Awaitable[T]]) -> T:
    """``call(nc, progress)`` with a connected client, its progress on a bar on stderr."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("connecting", total=None)

        def progress(what: str, n: int, total: int) -> None:
            bar.update(task, description=what, completed=n, total=total)

        return with_client(config, lambda c: call(c.nc, progress))


@app.command(short_help="Count the requests with renewed copies, by band.")
def show(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Count the requests with renewed copies, by band, from the broker (it works with every
    dispatcher stopped). Exit code 2 if the broker cannot be read."""
    from sluice.client.renewed import renewed_copies

    found = _run(config, renewed_copies)
    figures = {
        "stream_found": found.stream_found,
        "requests": found.requests,
        "copies": found.copies,
        "by_band": dict(sorted(found.by_band.items())),
        "bands_without_stream": found.bands_without_stream,
        "unreadable": found.unreadable,
    }
    if as_json:
        print(json.dumps(figures))
    else:
        print(f"{found.requests} requests have renewed copies ({found.copies} copies stored)")
        for band, n in sorted(found.by_band.items()):
            missing = (
                " (no stream takes this band here)" if band in found.bands_without_stream else ""
            )
            print(f"  {band}: {n}{missing}")
    if not found.stream_found:
        err.print(f"note: {_NO_STREAM}")
    if found.unreadable:
        err.print(f"{len(found.unreadable)} messages are no renewed copy: {found.unreadable[:10]}")


@app.command("return", short_help="Move them back to their bands' queues before a rollback.")
def return_(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Move each request with a renewed copy back to its band's queue before a rollback, with
    every dispatcher stopped (it holds the leader key meanwhile: a dispatcher started during
    the run stands by). Exit code 0 when every request was moved; 1 when some stay (their
    band's queue or tenant's share full, or no stream takes their band): run it again once
    that changed; 2 if a dispatcher leads or the broker fails. After an interruption, run it
    again within the broker's duplicate window (120 s by default)."""
    from sluice.client.renewed import Returned, return_renewed

    done = Returned()
    try:
        _run(config, lambda nc, progress: return_renewed(nc, progress, done))
    except (typer.Exit, KeyboardInterrupt):
        if done.returned or done.ended or done.left or done.copies_deleted:
            _report(done, as_json)
            err.print(
                "[yellow]stopped before the end (what it did is above):[/yellow] run `sluice "
                "renewed return` again within the broker's duplicate window "
                "(duplicate_window_s, 120 s by default), or the one request it was moving "
                "may be queued twice"
            )
        raise
    _report(done, as_json)
    if not done.stream_found:
        err.print(f"note: {_NO_STREAM}")
    if done.left:
        raise fail(
            f"{len(done.left)} requests stay as they are (see why above); run `sluice renewed "
            "return` again once that changed",
            code=1,
        )
    if done.unreadable:
        raise fail(
            f"{len(done.unreadable)} messages that are no renewed copy stay in SLUICE_RENEWED: "
            "look at them (`nats stream view SLUICE_RENEWED`) and delete them before the "
            "rollback",
            code=1,
        )


def _report(done: Any, as_json: bool) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "returned": len(done.returned),
                    "ended": len(done.ended),
                    "left": len(done.left),
                    "copies_deleted": done.copies_deleted,
                    "originals_deleted": done.originals_deleted,
                    "left_requests": [asdict(left) for left in done.left],
                    "unreadable": done.unreadable,
                }
            )
        )
    else:
        print(
            f"{len(done.returned)} requests back in their bands' queues, {len(done.ended)} "
            f"had run, {len(done.left)} left as they are; {done.copies_deleted} copies and "
            f"{done.originals_deleted} original messages deleted"
        )
        for left in done.left[:20]:
            print(f"  left {left.request_id} (tenant {left.tenant}): {left.reason}")
        if len(done.left) > 20:
            print(f"  ... and {len(done.left) - 20} more")
    if done.unreadable:
        err.print(f"{len(done.unreadable)} messages are no renewed copy: {done.unreadable[:10]}")

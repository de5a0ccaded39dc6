"""``sluice renewed``: the requests that live as renewed copies, and moving them back to their
bands' queues before a rollback to a release without renewals (docs/operations.md,
"Upgrading")."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sluice.cli.console import err, fail, with_client

app = typer.Typer(
    help="Requests that live as renewed copies (SLUICE_RENEWED), and moving them back.",
    no_args_is_help=True,
)
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML config file (else $SLUICE_CONFIG_FILE)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="The figures as one JSON object.")]
T = TypeVar("T")


def _read(config: Path | None, what: str, call: Callable[[Any, Any], Awaitable[T]]) -> T:
    """``call(nc, progress)`` with a connected client, its progress on a bar on stderr."""
    with Progress(
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def progress(n: int, total: int) -> None:
            bar.update(task, completed=n, total=total)

        return with_client(config, lambda c: call(c.nc, progress))


@app.command()
def show(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Count the stored renewed copies and the requests that live as them, by band."""
    from sluice.client.renewed import renewed_copies

    found = _read(config, "reading copies", renewed_copies)
    figures = {
        "requests": found.requests,
        "copies": found.copies,
        "by_band": dict(sorted(found.by_band.items())),
        "unreadable": found.unreadable,
    }
    if as_json:
        print(json.dumps(figures))
        return
    print(f"{found.requests} requests live as renewed copies ({found.copies} copies stored)")
    for band, n in sorted(found.by_band.items()):
        print(f"  {band}: {n}")
    if found.unreadable:
        err.print(f"{len(found.unreadable)} messages are no renewed copy: {found.unreadable[:10]}")


@app.command("return")
def return_(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """With every dispatcher stopped, move each request that lives as a renewed copy back to
    its band's queue (before going back to a release without renewals). Exit code 0 when no
    copy is left, 1 when some stay because their band's queue is full (run it again once it
    has room), 2 if a dispatcher leads or the broker fails."""
    from sluice.client.renewed import return_renewed

    done = _read(config, "reading copies", return_renewed)
    figures = {
        "returned": len(done.returned),
        "ended": len(done.ended),
        "left": len(done.left),
        "copies_deleted": done.copies_deleted,
        "left_requests": done.left,
        "unreadable": done.unreadable,
    }
    if as_json:
        print(json.dumps(figures))
    else:
        print(
            f"{len(done.returned)} requests back in their bands' queues, {len(done.ended)} "
            f"had run (their copies deleted), {len(done.left)} left as copies; "
            f"{done.copies_deleted} copies deleted"
        )
    if done.unreadable:
        err.print(f"{len(done.unreadable)} messages are no renewed copy: {done.unreadable[:10]}")
    if done.left:
        raise fail(
            f"{len(done.left)} requests stay as copies: their band's queue is full; run "
            "`sluice renewed return` again once it has room",
            code=1,
        )

"""``sluice batch``: offline batches of OpenAI Batch files (or Sluice's native lines), run in
the ``batch`` band, their status kept in NATS (:mod:`sluice.client.batches`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sluice.cli.console import err, fail, with_client
from sluice.cli.params import output_file, write_output

app = typer.Typer(
    help="Offline batches: submit a JSONL file, follow it, cancel it, get its results.",
    no_args_is_help=True,
)
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (its client table).")
]
TenantOpt = Annotated[str | None, typer.Option(help="Tenant (default: the client's).")]


def _batches(client: Any, tenant: str | None) -> Any:
    from sluice.client import Batches

    return Batches(client, tenant=tenant)


def _table(record: Any) -> Table:
    t = Table(title=f"batch {record.id}", show_header=False)
    c = record.counts
    for k, v in [
        ("status", record.status),
        ("tenant", record.tenant),
        ("endpoint", record.endpoint),
        ("requests", f"{c.completed} completed, {c.failed} failed, of {c.total}"),
        ("invalid lines", str(c.invalid)),
        ("submitted", f"{record.submitted} of {c.total}"),
        ("input file", record.input_file_id),
        ("output file", record.output_file_id or "-"),
        ("error file", record.error_file_id or "-"),
    ]:
        t.add_row(k, v)
    return t


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="The JSONL input file.")],
    window: Annotated[str, typer.Option(help="Completion window: 24h, 90m, 3600s.")] = "24h",
    endpoint: Annotated[
        str, typer.Option(help="The endpoint of the batch (OpenAI's batch field).")
    ] = "/v1/chat/completions",
    batch_id: Annotated[
        str | None, typer.Option(help="Its id (default: one per tenant and file contents).")
    ] = None,
    tenant: TenantOpt = None,
    wait: Annotated[bool, typer.Option(help="Wait for the batch to end.")] = False,
    config: ConfigOpt = None,
) -> None:
    """Submit a batch file in the batch band. Running it again after a crash resumes the
    same batch (same file, same id) and submits nothing twice."""
    from sluice.client.batches import batch_id_for
    from sluice.client.batchfile import parse_window
    from sluice.client.oaiformat import ENDPOINT_KINDS

    if endpoint not in ENDPOINT_KINDS:
        raise fail(f"--endpoint is one of {', '.join(sorted(ENDPOINT_KINDS))}, not {endpoint!r}")
    try:
        window_s = parse_window(window)
        data = file.read_bytes()
    except (ValueError, OSError) as exc:
        raise fail(str(exc)) from exc
    if not data.strip():
        raise fail(f"{file} has no request line")

    async def go(client: Any) -> Any:
        b = _batches(client, tenant)
        bid = batch_id or batch_id_for(b.tenant, data)
        from sluice.client import BatchNotFound

        try:
            record = await b.get(bid)
            err.print(f"batch {bid} exists ({record.status}): resuming it")
        except BatchNotFound:
            stored = await b.upload(data, file.name)
            record = await b.create(stored.id, endpoint=endpoint, window_s=window_s, batch_id=bid)
        total = record.counts.total
        err.print(
            f"batch {bid}: {total} requests, {record.counts.invalid} invalid lines "
            f"(they go to the error file)"
        )
        with Progress(
            TextColumn("submitting"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=False,
        ) as bar:
            task = bar.add_task("submit", total=total, completed=record.submitted)
            record = await b.submit(bid, lambda n, _: bar.update(task, completed=n))
        if wait:

            def show(r: Any) -> None:
                c = r.counts
                err.print(f"{r.status}: {c.completed} completed, {c.failed} failed of {c.total}")

            record = await b.wait(bid, every_s=2.0, progress=show)
        return record

    record = with_client(config, go)
    print(record.id)
    err.print(_table(record))


@app.command()
def status(
    batch_id: str,
    tenant: TenantOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="The record as JSON.")] = False,
    config: ConfigOpt = None,
) -> None:
    """A batch's status and counts (moving it on if its requests are done)."""
    record = with_client(config, lambda c: _batches(c, tenant).refresh(batch_id))
    if as_json:
        print(record.model_dump_json(indent=2))
    else:
        err.print(_table(record))
        print(record.status)


@app.command()
def cancel(batch_id: str, tenant: TenantOpt = None, config: ConfigOpt = None) -> None:
    """Cancel a batch: nothing more runs; it ends cancelled with the results it has."""
    record = with_client(config, lambda c: _batches(c, tenant).cancel(batch_id))
    print(record.status)


@app.command()
def results(
    batch_id: str,
    output: Annotated[Path, typer.Option(help="Where to write the output JSONL.")] = Path(
        "output.jsonl"
    ),
    errors: Annotated[Path, typer.Option(help="Where to write the error JSONL.")] = Path(
        "errors.jsonl"
    ),
    wait: Annotated[bool, typer.Option(help="Wait for the batch to end first.")] = False,
    tenant: TenantOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Write a finished batch's output and error files (OpenAI's format, input order)."""
    if output.resolve() == errors.resolve():
        raise fail(f"--output and --errors are both {output}: one would overwrite the other")
    output_file(output, "--output")
    output_file(errors, "--errors")

    async def go(client: Any) -> tuple[Any, bytes, bytes]:
        b = _batches(client, tenant)
        record = await (b.wait(batch_id) if wait else b.refresh(batch_id))
        if record.output_file_id is None or record.error_file_id is None:
            raise fail(f"batch {batch_id} is {record.status}: no results yet (try --wait)")
        return record, await b.content(record.output_file_id), await b.content(record.error_file_id)

    record, out, errs = with_client(config, go)
    write_output(output, out, "--output")
    write_output(errors, errs, "--errors")
    n_out, n_err = out.count(b"\n"), errs.count(b"\n")
    err.print(f"batch {batch_id} ({record.status}): {n_out} lines to {output}, {n_err} to {errors}")


@app.command("list")
def list_(
    limit: Annotated[int, typer.Option(min=1)] = 20,
    tenant: TenantOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    config: ConfigOpt = None,
) -> None:
    """The tenant's batches, newest first."""
    records = with_client(config, lambda c: _batches(c, tenant).recent(limit))
    if as_json:
        print(json.dumps([r.model_dump() for r in records], indent=2))
        return
    t = Table("batch", "status", "completed", "failed", "total", "invalid")
    for r in records:
        c = r.counts
        t.add_row(r.id, r.status, str(c.completed), str(c.failed), str(c.total), str(c.invalid))
    err.print(t)

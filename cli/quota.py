"""``sluice quota``: change per-model quotas at run time, without restarting a dispatcher."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from sluice.cli.console import err, fail
from sluice.common.errors import ConfigError

app = typer.Typer(
    help="Per-model quotas at run time: dispatchers apply a change within a second.",
    no_args_is_help=True,
)
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="TOML config file (its client table).")
]


def _pairs(values: list[str], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        name, sep, number = v.partition("=")
        if not sep or not name or not number.strip().isdigit():
            raise fail(f"{what} takes NAME=COUNT (a whole number >= 0), not {v!r}")
        out[name] = int(number)
    return out


def _with_nats(config: Path | None, go: Callable[[Any], Awaitable[Any]]) -> Any:
    from sluice.client import ClientSettings, SluiceError
    from sluice.common.transport import TransportError, connect

    try:
        settings = ClientSettings.load(config)
    except ConfigError as exc:
        raise fail(str(exc)) from exc

    async def run() -> Any:
        nc = await connect(settings.nats_url, "sluice-quota", auth=settings.broker_auth())
        try:
            return await go(nc)
        finally:
            await nc.close()

    try:
        return asyncio.run(run())
    except (SluiceError, TransportError) as exc:
        raise fail(str(exc)) from exc


@app.command("set")
def set_quota(
    model: Annotated[str, typer.Argument(help="The model whose quota to set.")],
    limit: Annotated[int | None, typer.Option(min=0, help="The model's total.")] = None,
    band: Annotated[list[str], typer.Option(help="Per band: BAND=COUNT (repeatable).")] = [],  # noqa: B006
    tenant: Annotated[list[str], typer.Option(help="Per tenant: TENANT=COUNT (repeatable).")] = [],  # noqa: B006
    default_tenant: Annotated[
        int | None, typer.Option(min=0, help="Each tenant not named with --tenant.")
    ] = None,
    unit: Annotated[
        str, typer.Option(help="requests, or tokens (prompt + max output).")
    ] = "requests",
    config: ConfigOpt = None,
) -> None:
    """Replace MODEL's quota at run time (levels not given are unlimited)."""
    from sluice.client.admin import set_model_quota
    from sluice.schemas.models import QuotaSpec

    try:
        spec = QuotaSpec.model_validate(
            {
                "limit": limit,
                "band_limits": _pairs(band, "--band"),
                "tenant_limits": _pairs(tenant, "--tenant"),
                "default_tenant_limit": default_tenant,
                "unit": unit,  # the model checks it: requests or tokens
            }
        )
    except ValidationError as exc:
        raise fail(str(exc)) from exc
    _with_nats(config, lambda nc: set_model_quota(nc, model, spec))
    err.print(f"quota of {model} set: {spec.model_dump_json(exclude_defaults=True)}")


@app.command("clear")
def clear_quota(
    model: Annotated[str, typer.Argument(help="The model whose run-time quota to drop.")],
    config: ConfigOpt = None,
) -> None:
    """Drop MODEL's run-time quota: its configured quota applies again."""
    from sluice.client.admin import clear_model_quota

    _with_nats(config, lambda nc: clear_model_quota(nc, model))
    err.print(f"run-time quota of {model} cleared")


@app.command("show")
def show(config: ConfigOpt = None) -> None:
    """Print the run-time configuration (JSON; empty: only the dispatchers' settings apply)."""
    from sluice.client.admin import admission_overrides

    overrides, revision = _with_nats(config, admission_overrides)
    doc = overrides.model_dump(mode="json", exclude_defaults=True)
    print(json.dumps({"revision": revision, "admission": doc}))

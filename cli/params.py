"""The command line's checks of its own arguments, done before any work starts: numbers are
finite, lists of loads are positive numbers, and the files and folders a command writes can
be written (a ten-minute replay does not end in a traceback because ``--json`` named a
folder)."""

from __future__ import annotations

import math
import os
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import typer
import typer.core

from sluice.cli.console import fail


def _finite_check(
    then: Callable[[Any, Any, Any], Any] | None,
) -> Callable[[Any, Any, Any], Any]:
    def check(ctx: Any, param: Any, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise typer.BadParameter(f"{value!r} is not a finite number.", ctx=ctx, param=param)
        return value if then is None else then(ctx, param, value)

    return check


def _is_float(annotation: Any) -> bool:
    return annotation is float or float in typing.get_args(annotation)


def make_finite(command: Any) -> None:
    """Make every float option and argument of ``command`` and its subcommands refuse
    ``inf`` and ``nan``: typer takes them, and no option of this command line means anything
    by them (a deadline of ``inf`` overflowed, ``--slow-factor inf`` made a profile of speed
    zero, ``--loads nan`` emptied a replay)."""
    for param in command.params:
        desc = getattr(param, "type_descriptor", None)
        if desc is not None and _is_float(desc.annotation) and not getattr(param, _MARK, False):
            param.callback = _finite_check(param.callback)
            setattr(param, _MARK, True)
    for sub in getattr(command, "commands", {}).values():
        make_finite(sub)


_MARK = "_sluice_finite"


class FiniteGroup(typer.core.TyperGroup):
    """The root group of the command line: every float it parses is finite."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        make_finite(self)
        return super().main(*args, **kwargs)


MIN_LOAD = 0.01
"""The least offered load a list of loads takes, as ``--load`` (1e-300 stretched a trace over
10^301 s)."""


def parse_loads(text: str, option: str = "--loads", *, zero: bool = False) -> tuple[float, ...]:
    """Comma-separated offered loads: finite numbers of at least :data:`MIN_LOAD` (or zero
    too, if ``zero``), at least one, each once; else the command stops with exit code 2."""
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise fail(f"{option} takes comma-separated numbers, not {text!r}") from exc
    low = "zero or more" if zero else f"of {MIN_LOAD:g} or more"
    if not loads or not all(
        math.isfinite(x) and (x >= MIN_LOAD or (zero and x == 0)) for x in loads
    ):
        raise fail(f"{option} takes finite numbers {low}, not {text!r}")
    no_repeats([f"{x:g}" for x in loads], option)
    return loads


def no_repeats(items: Sequence[str], option: str) -> None:
    """Each item of a list option once (a repeat ran twice, and its results overwrote each
    other); else the command stops with exit code 2."""
    repeated = sorted({x for x in items if items.count(x) > 1})
    if repeated:
        raise fail(f"{option} names {', '.join(repeated)} more than once")


def output_file(path: Path, option: str) -> Path:
    """``path`` if a file can be written there (its folder exists and is writable, and it is
    not a folder itself, nor named like an option: ``--json --no-progress`` wrote a file
    named ``--no-progress``); else the command stops with exit code 2 before doing any work."""
    if path.name.startswith("-"):
        raise fail(f"{option} takes a file name, not {str(path)!r} (an option?)")
    if path.is_dir():
        raise fail(f"{option} {path}: a folder, not a file")
    folder = path.parent
    if not folder.is_dir():
        raise fail(f"{option} {path}: no folder {folder}")
    if path.exists() and not os.access(path, os.W_OK):
        raise fail(f"{option} {path}: not writable")
    if not path.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise fail(f"{option} {path}: cannot write in {folder}")
    return path


def output_folder(path: Path, option: str) -> Path:
    """``path`` as a folder to write into, made if missing; else the command stops with exit
    code 2 before doing any work."""
    if path.name.startswith("-"):
        raise fail(f"{option} takes a folder, not {str(path)!r} (an option?)")
    if path.exists() and not path.is_dir():
        raise fail(f"{option} {path}: a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise fail(f"{option} {path}: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise fail(f"{option} {path}: not writable")
    return path


def write_output(path: Path, data: str | bytes, option: str) -> None:
    """Write ``data`` to ``path``; an error of the file system (a full disk, a folder removed
    since the start) stops the command with exit code 2 and says so."""
    try:
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)
    except OSError as exc:
        raise fail(f"{option} {path}: {exc.strerror or exc}") from exc

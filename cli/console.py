"""The command line's shared error output: one stderr console and one way to fail."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

# Piped output (CI logs) gets wide lines instead of 80 columns of wrapped cells.
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr; raise the result to exit with ``code``."""
    err.print(f"[red]error:[/red] {message}")
    return typer.Exit(code)

"""``python -m sluice.cli``: the same as the ``sluice`` command."""

from sluice.cli.app import app

app()

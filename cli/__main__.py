"""``python -m sluice.cli`` and the ``sluice`` command."""

from __future__ import annotations

import sys


def main() -> None:
    """The ``sluice`` command. A Ctrl-C while it is still importing its parts is an
    interruption like any other (exit code 130), not a traceback of the imports."""
    try:
        from sluice.cli.app import app
    except KeyboardInterrupt:
        sys.exit(130)
    app()


if __name__ == "__main__":
    main()

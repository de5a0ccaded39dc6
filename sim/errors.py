"""Errors raised by the simulator. All derive from :class:`SimError`."""

from __future__ import annotations


class SimError(Exception):
    """Base class of the simulator's errors."""


class TraceError(SimError, ValueError):
    """A trace file that cannot be read, with the file and line it failed at."""


class PlotError(SimError, RuntimeError):
    """matplotlib is missing or a chart could not be written."""


class LoadgenError(SimError, ValueError):
    """A trace or a setting ``sluice loadgen`` cannot replay (its message says which)."""

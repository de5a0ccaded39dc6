"""Errors raised by the dispatcher."""

from __future__ import annotations


class DispatcherError(Exception):
    """Base class of dispatcher errors."""


class StreamSetupError(DispatcherError):
    """A JetStream stream or consumer could not be created or updated."""

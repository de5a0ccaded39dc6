"""Errors raised by the local-running helpers. All derive from :class:`LocalRunError`."""

from __future__ import annotations


class LocalRunError(Exception):
    """Base class of :mod:`sluice.testing`'s errors."""


class NatsServerError(LocalRunError, RuntimeError):
    """The embedded ``nats-server`` is missing, did not start, or is not running."""


class GatewayProcessError(LocalRunError, RuntimeError):
    """A ``sluice gateway`` child process did not start, or is not running."""

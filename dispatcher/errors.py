"""Errors raised by the dispatcher."""

from __future__ import annotations


class DispatcherError(Exception):
    """Base class of dispatcher errors."""


class StreamSetupError(DispatcherError):
    """A JetStream stream or consumer could not be created or updated."""


class DigestMismatch(DispatcherError):
    """A worker's cache digest reports blocks of another size than the dispatcher indexes."""


class BrokerUnreachable(DispatcherError):
    """The dispatcher could not connect to NATS at start."""

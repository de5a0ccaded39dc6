"""Errors raised by the wire contract."""

from __future__ import annotations

from typing import Any


class SchemaError(Exception):
    """Base class of every error raised by ``sluice.schemas``."""


class DecodeError(SchemaError):
    """Bytes that are not a valid message of the expected type.

    ``partial`` is whatever did decode (a dict), so a receiver can still find a request id to
    answer on.
    """

    def __init__(self, message: str, partial: Any = None) -> None:
        super().__init__(message)
        self.partial = partial

"""The msgpack codec: the only place Sluice touches msgpack."""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from sluice.schemas.errors import DecodeError

M = TypeVar("M", bound=BaseModel)


def encode(message: BaseModel) -> bytes:
    """Serialise a wire model to msgpack bytes."""
    data: bytes = msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)
    return data


def decode(data: bytes, model: type[M]) -> M:
    """Parse msgpack bytes into ``model``; raises :class:`DecodeError` on any bad input."""
    try:
        obj: Any = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as exc:
        # msgpack raises these for bad bytes (its ExtraData, FormatError and StackError are
        # ValueErrors; invalid UTF-8 is a UnicodeDecodeError, a ValueError too).
        raise DecodeError(f"not valid msgpack: {exc}") from exc
    if not isinstance(obj, dict):
        raise DecodeError(f"expected a map, got {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise DecodeError(f"invalid {model.__name__}: {_summarise(exc)}", obj) from exc


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")

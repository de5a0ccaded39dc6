"""The msgpack codec: the only place Sluice touches msgpack."""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from sluice.schemas.errors import DecodeError
from sluice.schemas.models import WIRE_CONTEXT

M = TypeVar("M", bound=BaseModel)


def encode(message: BaseModel) -> bytes:
    """Serialise a wire model to msgpack bytes."""
    data: bytes = msgpack.packb(
        message.model_dump(mode="python", context=WIRE_CONTEXT), use_bin_type=True
    )
    return data


def encode_nested(head: BaseModel, name: str, body: bytes) -> bytes:
    """Serialise ``head`` as :func:`encode` does, with one more field, ``name``, whose value
    is ``body``: msgpack bytes already (a message as its producer encoded it, validated by
    :func:`decode` since). The body is not decoded and encoded again, so a holder of a message
    need keep only its bytes, a few per token id, not the decoded ids (some 40 bytes each)."""
    fields = head.model_dump(mode="python", context=WIRE_CONTEXT)
    if name in fields:
        raise ValueError(f"{type(head).__name__} has a field {name!r} already")
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(fields) + 1)]
    for key, value in fields.items():
        parts += (packer.pack(key), packer.pack(value))
    parts += (packer.pack(name), body)
    return b"".join(parts)


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
        raise DecodeError(f"invalid {model.__name__}: {summarise(exc)}", obj) from exc


def summarise(exc: ValidationError) -> str:
    """A validation error on one line: each field (the first three) and what is wrong."""
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")

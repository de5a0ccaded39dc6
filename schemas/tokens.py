"""A prompt's token ids, held packed: the form they travel in and are hashed in.

Token ids are integers in ``[0, 2**32)`` (what engines and Sluice's block hashing take). On
the wire a request carries them as one msgpack ``bin`` of little-endian uint32s, 4 bytes an
id; :class:`TokenIds` keeps them so. Decoding a request then makes no Python int per id (a
list of 8,000 ids cost the dispatcher about 0.2 ms to decode and check, and as much again for
every hop that re-packed it to hash it), the block hashes are computed from those bytes as
they are, and a queued or running prompt takes 4 bytes an id, not a pointer and an int
object each.

A :class:`TokenIds` is an immutable sequence of ints: ``len``, indexing, slicing, iterating,
and ``==`` with another one or with a list or tuple of the same ids. :meth:`TokenIds.tolist`
gives the ids as a list (for a JSON body).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

U32 = next(code for code in "IL" if array(code).itemsize == 4)
"""The array type of 4-byte unsigned items (``I`` on every platform CPython supports)."""
_BIG_ENDIAN = sys.byteorder == "big"


def _ids(values: Iterable[int]) -> array[int]:
    # array checks every id in one C pass (an integer in [0, 2**32), or an error): several
    # times faster than a check per id in Python. As with pydantic's lax int, True and False
    # pass (as 1 and 0: bool is an int).
    if isinstance(values, bytes | bytearray | memoryview):
        values = list(values)  # a sequence of small ints, not packed ids (from_packed is)
    try:
        return array(U32, values)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids are integers in [0, 2**32): {exc}") from None


class TokenIds(Sequence[int]):
    """Token ids, held as packed uint32s (see the module docstring)."""

    __slots__ = ("_ids",)
    _ids: array[int]

    def __init__(self, ids: Iterable[int] = ()) -> None:
        """The ids of ``ids``; a ``ValueError`` if one is not an integer in ``[0, 2**32)``."""
        self._ids = ids._ids if isinstance(ids, TokenIds) else _ids(ids)

    @classmethod
    def from_packed(cls, data: bytes | bytearray | memoryview) -> TokenIds:
        """The ids :attr:`packed` gave: little-endian uint32s; a ``ValueError`` if the
        length is not a multiple of 4."""
        if len(data) % 4:
            raise ValueError(f"packed token ids are 4 bytes each, not {len(data)} bytes in all")
        ids = array(U32)
        ids.frombytes(data)
        if _BIG_ENDIAN:
            ids.byteswap()
        out = cls.__new__(cls)
        out._ids = ids
        return out

    @property
    def packed(self) -> bytes:
        """The ids as little-endian uint32s: what travels, and what block hashing reads."""
        if _BIG_ENDIAN:
            swapped = array(U32, self._ids)
            swapped.byteswap()
            return swapped.tobytes()
        return self._ids.tobytes()

    def tolist(self) -> list[int]:
        """The ids as a list."""
        return self._ids.tolist()

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...
    def __getitem__(self, index: int | slice) -> int | TokenIds:
        if isinstance(index, slice):
            out = TokenIds.__new__(TokenIds)
            out._ids = self._ids[index]
            return out
        return self._ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self._ids == other._ids
        if isinstance(other, list | tuple):
            return len(other) == len(self._ids) and self._ids.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which have none

    def __repr__(self) -> str:
        head = ", ".join(map(str, self._ids[:8]))
        more = f", ... ({len(self._ids)} ids)" if len(self._ids) > 8 else ""
        return f"TokenIds([{head}{more}])"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenIds.from_packed, (self.packed,))


def token_ids(value: object) -> TokenIds:
    """``value`` as :class:`TokenIds`: one already, its packed bytes (the wire's form), or
    a list or tuple of ids; a ``ValueError`` for anything else or an id out of range."""
    if isinstance(value, TokenIds):
        return value
    if isinstance(value, bytes | bytearray):
        return TokenIds.from_packed(value)
    if isinstance(value, list | tuple):
        return TokenIds(value)
    raise ValueError(f"token ids are a list of integers, not {type(value).__name__}")


def token_list(ids: Sequence[int]) -> list[int]:
    """Token ids as a list (of :class:`TokenIds`, without a step per id)."""
    return ids.tolist() if isinstance(ids, TokenIds) else list(ids)

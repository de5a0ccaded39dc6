"""A worker order (pure): (value, worker id) pairs kept in ascending order, as Python orders
the tuples (by value, then by id), with the few operations the pool of free workers needs.

:class:`PureOrder` is the reference. :func:`new_order` makes the native one
(``dispatcher/_orders.c``) where it was compiled: a list of tuples costs three pointer chases
per comparison of a binary search, and a dispatcher moves a worker in four orders at every
booking and completion, so the cost grew with the fleet (docs/BENCHMARKS.md, twenty-third
pass). ``tests/test_orders.py`` drives both with the same random operations.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import sys
from collections.abc import Callable, Iterator
from typing import Protocol

_Pair = tuple[float, str]
_value = operator.itemgetter(0)


class WorkerOrder(Protocol):
    """(value, worker id) pairs in ascending order."""

    def add(self, value: float, worker_id: str, /) -> None:
        """Put the pair in its place (ValueError if it is there already)."""

    def remove(self, value: float, worker_id: str, /) -> None:
        """Take the pair out (ValueError if it is not there)."""

    def move(self, old_value: float, new_value: float, worker_id: str, /) -> None:
        """The worker's pair, from its old value to its new one."""

    def count_below(self, value: float, /) -> int:
        """How many pairs have a value under ``value`` (they come first)."""

    def count_at_most(self, value: float, /) -> int:
        """How many pairs have a value of at most ``value`` (they come first)."""

    def iter_from(self, start: int, /) -> Iterator[_Pair]:
        """The pairs from place ``start`` on (do not change the order while reading)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> _Pair: ...

    def __iter__(self) -> Iterator[_Pair]: ...


class PureOrder:
    """The reference :class:`WorkerOrder`: a sorted list of tuples."""

    __slots__ = ("_pairs",)

    def __init__(self) -> None:
        self._pairs: list[_Pair] = []

    def add(self, value: float, worker_id: str, /) -> None:
        pair = _checked(value, worker_id)
        i = bisect.bisect_left(self._pairs, pair)
        if i < len(self._pairs) and self._pairs[i] == pair:
            raise ValueError(f"{pair!r} is in the order already")
        self._pairs.insert(i, pair)

    def remove(self, value: float, worker_id: str, /) -> None:
        del self._pairs[self._place(_checked(value, worker_id))]

    def move(self, old_value: float, new_value: float, worker_id: str, /) -> None:
        old, new = _checked(old_value, worker_id), _checked(new_value, worker_id)
        i = self._place(old)
        j = bisect.bisect_left(self._pairs, new)
        if j != i and j < len(self._pairs) and self._pairs[j] == new:
            raise ValueError(f"{new!r} is in the order already")
        del self._pairs[i]
        bisect.insort(self._pairs, new)

    def count_below(self, value: float, /) -> int:
        return bisect.bisect_left(self._pairs, _query(value), key=_value)

    def count_at_most(self, value: float, /) -> int:
        return bisect.bisect_right(self._pairs, _query(value), key=_value)

    def iter_from(self, start: int, /) -> Iterator[_Pair]:
        return itertools.islice(self._pairs, min(max(operator.index(start), 0), sys.maxsize), None)

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, i: int, /) -> _Pair:
        return self._pairs[i]

    def __iter__(self) -> Iterator[_Pair]:
        return iter(self._pairs)

    def __repr__(self) -> str:
        return f"<PureOrder of {len(self._pairs)}>"

    def _place(self, pair: _Pair) -> int:
        i = bisect.bisect_left(self._pairs, pair)
        if i == len(self._pairs) or self._pairs[i] != pair:
            raise ValueError(f"{pair!r} is not in the order")
        return i


def _checked(value: float, worker_id: str) -> _Pair:
    if type(worker_id) is not str:
        raise TypeError(f"a worker id must be a str, not {type(worker_id).__name__}")
    v = _number(value)
    if math.isnan(v):
        raise ValueError("an order's value must not be NaN")
    return v, worker_id


def _number(value: float) -> float:
    if not isinstance(value, (int, float)):
        raise TypeError(f"an order's value must be a float or an int, not {type(value).__name__}")
    return float(value)


def _query(value: float) -> float:
    v = _number(value)
    if math.isnan(v):
        raise ValueError("an order is not counted against NaN")
    return v


NATIVE: bool
"""Whether :func:`new_order` makes the native order (else the reference)."""
new_order: Callable[[], WorkerOrder]
try:
    from sluice.dispatcher._orders import Order as _NativeOrder

    new_order = _NativeOrder
    NATIVE = True
except ImportError:  # installed without a C compiler: the reference
    new_order = PureOrder
    NATIVE = False

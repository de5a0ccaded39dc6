"""fast_init: a frozen dataclass made by direct dict writes behaves as the generated one."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import FrozenInstanceError, InitVar, dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.dispatcher import routing, work
from sluice.dispatcher.frozen import fast_init

HOT = [
    work.Request, work.WorkerInfo, work.Dispatch, work.Booking, work.Ended,
    work.EnqueueOutcome, routing.RouteRequest, routing.Choice, routing.Digest, routing.Outcome,
]  # fmt: skip
"""The scheduler's per-decision values: each must keep its fast constructor."""


@dataclass(frozen=True)
class _Plain:
    a: str
    b: int
    c: float = 0.5
    d: tuple[int, ...] = ()
    e: Any = None


@fast_init
@dataclass(frozen=True)
class _Fast:
    a: str
    b: int
    c: float = 0.5
    d: tuple[int, ...] = ()
    e: Any = None


def _as_plain(x: _Fast) -> dict[str, Any]:
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


@given(
    st.text(max_size=5),
    st.integers(),
    st.floats(allow_nan=False),
    st.tuples(st.integers()),
    st.one_of(st.none(), st.integers()),
    st.integers(min_value=2, max_value=5),
    st.booleans(),
)
def test_the_same_values_as_the_generated_constructor(
    a: str, b: int, c: float, d: tuple[int, ...], e: Any, positional: int, keywords: bool
) -> None:
    values = {"a": a, "b": b, "c": c, "d": d, "e": e}
    names = list(values)[:positional]
    args = [values[n] for n in names]
    kwargs = {n: values[n] for n in list(values)[positional:]} if keywords else {}
    fast, plain = _Fast(*args, **kwargs), _Plain(*args, **kwargs)
    assert _as_plain(fast) == dataclasses.asdict(plain)
    assert fast == _Fast(**_as_plain(fast)) and hash(fast) == hash(_Fast(**_as_plain(fast)))
    assert repr(fast).removeprefix("_Fast") == repr(plain).removeprefix("_Plain")
    assert dataclasses.replace(fast, b=b + 1).b == b + 1


def test_the_same_signature_and_errors() -> None:
    assert str(inspect.signature(_Fast)) == str(inspect.signature(_Plain))
    with pytest.raises(TypeError):
        _Fast("x")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Fast("x", 1, f=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Fast("x", 1, a="y")  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        _Fast("x", 1).b = 2  # type: ignore[misc]


def test_refuses_a_constructor_that_does_more_than_store() -> None:
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    @dataclass(frozen=True)
    class Post:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True)
    class Factory:
        a: list[int] = field(default_factory=list)

    @dataclass(frozen=True)
    class Var:
        a: int
        b: InitVar[int]

    @dataclass(frozen=True, kw_only=True)
    class KeywordOnly:
        a: int

    @dataclass(frozen=True)
    class NotInit:
        a: int = field(default=0, init=False)

    for cls in (Mutable, Slotted, Post, Factory, Var, KeywordOnly, NotInit):
        with pytest.raises(TypeError, match="fast_init"):
            fast_init(cls)


@pytest.mark.parametrize("cls", HOT, ids=lambda c: c.__name__)
def test_the_hot_values_keep_it(cls: type) -> None:
    assert getattr(cls.__init__, "__fast_init__", False), f"{cls.__name__} lost fast_init"
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
    # Its string annotations resolve in its module, as the generated constructor's do.
    hints = typing.get_type_hints(cls.__init__)
    assert set(hints) == {f.name for f in dataclasses.fields(cls)} | {"return"}
    assert next(iter(inspect.signature(cls.__init__).parameters)) == "self"

"""Frozen dataclasses constructed as fast as plain ones (pure).

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__``
(its own ``__setattr__`` refuses): a 12-field :class:`~sluice.dispatcher.work.Request` costs
1.3 µs to make, a plain dataclass 0.2 µs. The scheduler makes several such values per
decision (the request priced, its routing view, the choice, the dispatch, the booking), so
:func:`fast_init` gives the hot ones an ``__init__`` that writes the instance's dictionary
directly: the same signature, defaults and result, still frozen afterwards.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TypeVar

_T = TypeVar("_T")

_MISSING = dataclasses.MISSING


def fast_init(cls: type[_T]) -> type[_T]:
    """Replace a frozen dataclass's ``__init__`` by one that stores its fields straight into
    the instance's ``__dict__`` (apply it above ``@dataclass(frozen=True)``).

    Only a dataclass whose ``__init__`` does nothing but store its arguments can take it:
    frozen, without ``__slots__``, ``__post_init__``, ``InitVar``, default factories,
    keyword-only or ``init=False`` fields. Anything else raises :class:`TypeError` at import.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"fast_init: {cls.__name__} is not a frozen dataclass")
    if "__slots__" in cls.__dict__:
        raise TypeError(f"fast_init: {cls.__name__} has __slots__ (no instance dict to fill)")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"fast_init: {cls.__name__} has a __post_init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # checked just above
    all_init = getattr(cls, "__dataclass_fields__", {})
    if len(all_init) != len(fields):  # InitVar and ClassVar pseudo-fields
        raise TypeError(f"fast_init: {cls.__name__} has InitVar or ClassVar fields")
    names: list[str] = []
    signature: list[str] = []
    defaults: dict[str, Any] = {}
    for f in fields:
        if not f.init or f.kw_only or f.default_factory is not _MISSING:
            raise TypeError(
                f"fast_init: {cls.__name__}.{f.name} is init=False, keyword-only or has a "
                "default factory"
            )
        if not f.name.isidentifier() or f.name.startswith("_fi_"):
            raise TypeError(f"fast_init: {cls.__name__}.{f.name}: unsupported field name")
        names.append(f.name)
        if f.default is _MISSING:
            signature.append(f.name)
        else:
            defaults[f"_fi_default_{f.name}"] = f.default
            signature.append(f"{f.name}=_fi_default_{f.name}")
    this = "_fi_self" if "self" in names else "self"
    body = "\n".join(f"    _fi_d[{n!r}] = {n}" for n in names) or "    pass"
    source = f"def __init__({this}, {', '.join(signature)}):\n"
    source += (f"    _fi_d = {this}.__dict__\n" if names else "") + body + "\n"
    namespace: dict[str, Any] = dict(defaults)
    # The module's globals: the copied string annotations resolve there (get_type_hints).
    exec(source, vars(sys.modules[cls.__module__]), namespace)  # names checked above
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(getattr(cls.__init__, "__annotations__", {}))
    init.__fast_init__ = True
    cls.__init__ = init  # type: ignore[method-assign]
    return cls

"""JSON text from outside (an HTTP body, a line of a batch file), parsed strictly.

``json.loads`` takes more than valid JSON text of valid Unicode: an ``\\ud800`` escape (or
its UTF-8 bytes, which it decodes with ``surrogatepass``) gives a string with a lone UTF-16
surrogate, which no UTF-8 encoder (msgpack, the broker's wire) accepts later; and it raises
``RecursionError`` for deep nesting and ``ValueError`` for an integer of more than 4,300
digits. :func:`loads` turns each of these into one :class:`JsonTextError` at the boundary.
"""

from __future__ import annotations

import json
from typing import Any

_BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


class JsonTextError(ValueError):
    """The text is not valid JSON of valid Unicode; the message says why."""


def loads(raw: bytes | str) -> Any:
    """The JSON value of ``raw``, or :class:`JsonTextError`."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JsonTextError("not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        # (Python's advice for the last, sys.set_int_max_str_digits(), is not the sender's.)
        why = str(exc).split("; use sys.set_int_max_str_digits")[0]
        raise JsonTextError(f"not valid JSON: {why}") from exc
    if _may_hold_surrogates(raw):
        _check_strings(value)
    return value


def _may_hold_surrogates(raw: bytes | str) -> bool:
    # Only an escape \uD800-\uDFFF, the bytes ED A0-BF (UTF-8 of a surrogate, which
    # json.loads lets through) or a UTF-16/32 body can make one: the usual body is not walked.
    if isinstance(raw, str):
        return True  # (its own characters may be surrogates: the values are walked)
    return (
        b"\\ud" in raw
        or b"\\uD" in raw
        or b"\xed" in raw
        or raw.startswith(_BOMS)
        or b"\x00" in raw[:4]
    )


def _check_strings(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check(item)
        elif isinstance(item, dict):
            for key, v in item.items():
                _check(key)
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)


def _check(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end].encode("unicode_escape").decode("ascii")
        raise JsonTextError(
            f"not valid Unicode text: a string holds a lone UTF-16 surrogate ({bad})"
        ) from None

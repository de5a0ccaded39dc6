"""Request traces: Mooncake JSONL (with prefix block ids), Azure CSV (lengths only), and our
own JSONL, which is Mooncake's format plus optional fields (pure, no I/O but file reading)."""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sluice.sim.errors import TraceError

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. ``block_ids`` are prefix-chained ids of ``block_tokens``-token
    blocks (two requests share block ``i`` only if they share the whole prefix up to it);
    empty when the trace has no prefix information (every prompt unique)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...] = ()
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    band: str = "interactive"
    tenant: str = "default"
    model: str = "sim"
    session_id: str = ""
    deadline_ms: int | None = None

    def checked(self) -> TraceRequest:
        """This request, or ``ValueError`` naming the field a replay could not run with."""
        if not math.isfinite(self.arrival_s) or not 0 <= self.arrival_s <= MAX_ARRIVAL_S:
            raise ValueError(
                f"timestamp must be a time from 0 to {MAX_ARRIVAL_S:g} s, not {self.arrival_s}"
            )
        if not 1 <= self.input_tokens <= _MAX_TOKENS:
            raise ValueError(
                f"input_length must be within 1..{_MAX_TOKENS}, not {self.input_tokens}"
            )
        if not 0 <= self.output_tokens <= _MAX_TOKENS:
            raise ValueError(
                f"output_length must be within 0..{_MAX_TOKENS}, not {self.output_tokens}"
            )
        if not 1 <= self.block_tokens <= _MAX_TOKENS:
            raise ValueError(
                f"block_tokens must be within 1..{_MAX_TOKENS}, not {self.block_tokens}"
            )
        if any(h < 0 for h in self.block_ids):
            raise ValueError("hash_ids must be >= 0")
        if self.deadline_ms is not None and not 1 <= self.deadline_ms <= _MAX_DEADLINE_MS:
            raise ValueError(
                f"deadline_ms must be within 1..{_MAX_DEADLINE_MS}, not {self.deadline_ms}"
            )
        return self


MAX_ARRIVAL_S = 366 * 24 * 3600.0
"""A year: a later arrival is a mistake in the trace (a load generator would sleep until it)."""
_MAX_TOKENS = 10_000_000
"""More prompt or output tokens than any model's context: a mistake (a load generator built the
whole prompt's text before any check)."""
_MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000
"""A week: a deadline beyond it is a mistake in the trace (and overflows a replay's clock)."""


def trace_file(path: str | Path) -> Path:
    """``path`` if it names a file; else :class:`TraceError` saying what it names instead (a
    command checks this before it makes any output folder)."""
    p = Path(path)
    if p.is_dir():
        raise TraceError(f"{p} is a folder, not a trace file")
    if not p.is_file():
        raise TraceError(f"trace not found: {p}")
    return p


def load_trace(path: str | Path, *, default_band: str = "interactive") -> list[TraceRequest]:
    """Load a ``.jsonl`` (Mooncake or ours) or ``.csv`` (Azure) trace, sorted by arrival. A
    UTF-8 byte order mark is allowed; the suffix's case is not significant."""
    p = trace_file(path)
    reader = _azure if p.suffix.lower() == ".csv" else _jsonl
    try:
        reqs = list(reader(p, default_band))
    except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not text
        raise TraceError(f"cannot read the trace {p}: {exc}") from exc
    if not reqs:
        raise TraceError(f"{p}: no requests")
    return sorted(reqs, key=lambda r: r.arrival_s)


_LINE_ERRORS = (KeyError, ValueError, TypeError, OverflowError, RecursionError)
"""What a bad line or row raises while it is read (a deeply nested JSON line: RecursionError)."""


def _jsonl(p: Path, default_band: str) -> Iterator[TraceRequest]:
    with p.open(encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(f"a line is one JSON object, not {type(obj).__name__}")
                deadline = obj.get("deadline_ms")
                yield TraceRequest(
                    arrival_s=_time_ms(obj["timestamp"]) / 1000.0,
                    input_tokens=_whole(obj["input_length"], "input_length"),
                    output_tokens=max(1, _count(obj["output_length"], "output_length")),
                    block_ids=_ids(obj),
                    block_tokens=_whole(
                        obj.get("block_tokens", MOONCAKE_BLOCK_TOKENS), "block_tokens"
                    ),
                    band=str(obj.get("priority", default_band)),
                    tenant=str(obj.get("tenant", "default")),
                    model=str(obj.get("model", "sim")),
                    session_id=str(obj.get("session_id", "")),
                    deadline_ms=None if deadline is None else _whole(deadline, "deadline_ms"),
                ).checked()
            except _LINE_ERRORS as exc:
                raise TraceError(f"{p}:{n}: {_why(exc)}") from exc


def _azure(p: Path, default_band: str) -> Iterator[TraceRequest]:
    """Azure's CSV. Its rows are timed from the earliest, whatever their order in the file."""
    rows: list[tuple[int, datetime, int, int]] = []
    with p.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        for n, row in enumerate(reader, 2):
            try:
                if None in row or None in row.values():  # more fields than the header, or fewer
                    raise ValueError(
                        f"the row's fields do not match the header's {len(reader.fieldnames or ())}"
                    )
                # 7 fractional digits: Python parses at most 6.
                stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                context = _count(row["ContextTokens"], "ContextTokens")
                generated = _count(row["GeneratedTokens"], "GeneratedTokens")
            except _LINE_ERRORS as exc:
                raise TraceError(f"{p}:{n}: {_why(exc)}") from exc
            rows.append((n, stamp, context, generated))
    if not rows:
        return
    try:
        t0 = min(stamp for _, stamp, _, _ in rows)
    except TypeError as exc:  # some stamps with a time zone, some without
        raise TraceError(f"{p}: {exc}") from exc
    for n, stamp, context, generated in rows:
        try:
            yield TraceRequest(
                arrival_s=(stamp - t0).total_seconds(),
                input_tokens=max(1, context),
                output_tokens=max(1, generated),
                band=default_band,
            ).checked()
        except _LINE_ERRORS as exc:
            raise TraceError(f"{p}:{n}: {_why(exc)}") from exc


def _whole(value: Any, name: str) -> int:
    """A whole number of a trace's field: an int, a float with no fraction, or a string of
    digits (a CSV's); never a bool (JSON's ``true`` is no count)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a whole number, not {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name} must be a whole number, not {value!r}")
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _DIGITS.fullmatch(value.strip()):  # ("1_000": int() takes it)
        return int(value)
    raise ValueError(f"{name} must be a whole number, not {value!r}")


_DIGITS = re.compile(r"[+-]?[0-9]+")


def _time_ms(value: Any) -> float:
    """A JSONL line's ``timestamp`` (ms): a number, never a bool."""
    if isinstance(value, bool):
        raise ValueError(f"timestamp must be a number of milliseconds, not {value!r}")
    return float(value)


def _count(value: Any, name: str) -> int:
    """:func:`_whole`, and not negative."""
    n = _whole(value, name)
    if n < 0:
        raise ValueError(f"{name} must be >= 0, not {n}")
    return n


def _ids(obj: dict[str, Any]) -> tuple[int, ...]:
    """A line's ``hash_ids``: a list of whole numbers (ints, the common case, checked at once)."""
    value = obj.get("hash_ids", [])
    if not isinstance(value, list):
        raise ValueError(f"hash_ids must be a list, not {type(value).__name__}")
    if all(type(h) is int for h in value):
        return tuple(value)
    return tuple(_whole(h, "hash_ids") for h in value)


def _why(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    return str(exc) or type(exc).__name__


def write_jsonl(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write requests in our JSONL (Mooncake fields plus the optional ones)."""
    with Path(path).open("w") as f:
        for r in requests:
            obj: dict[str, Any] = {
                "timestamp": round(r.arrival_s * 1000, 3),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.block_ids),
            }
            if r.block_tokens != MOONCAKE_BLOCK_TOKENS:
                obj["block_tokens"] = r.block_tokens
            if r.band != "interactive":
                obj["priority"] = r.band
            if r.tenant != "default":
                obj["tenant"] = r.tenant
            if r.session_id:
                obj["session_id"] = r.session_id
            if r.deadline_ms is not None:
                obj["deadline_ms"] = r.deadline_ms
            f.write(json.dumps(obj) + "\n")


def upper_bound_hits(requests: Iterable[TraceRequest]) -> list[int]:
    """Per request, the prompt tokens an infinite, perfectly shared cache would hit: the
    longest leading run of its blocks seen in any earlier request."""
    seen: set[int] = set()
    out: list[int] = []
    for r in requests:
        hit = 0
        for b in r.block_ids:
            if b not in seen:
                break
            hit += 1
        out.append(min(hit * r.block_tokens, r.input_tokens))
        seen.update(r.block_ids)
    return out


def earlier_turns(
    before: Sequence[TraceRequest], window: Sequence[TraceRequest], *, min_shared_blocks: int = 2
) -> list[TraceRequest]:
    """The requests of ``before`` that ``window``'s requests continue: for each request of the
    window, the latest request of ``before`` sharing the longest leading run of its blocks, if
    that run is at least ``min_shared_blocks`` long (2: more than a first block every request
    may share, as block 0 of the Mooncake conversation trace). Each at most once, in the order
    of ``before``. Sent before the window, they leave the caches holding the prefixes the window
    reuses, as a fleet that has served the earlier turns holds them."""
    if min_shared_blocks < 1:
        raise TraceError("min_shared_blocks must be >= 1")
    latest: dict[int, int] = {}
    for i, r in enumerate(before):
        for b in r.block_ids:
            latest[b] = i  # prefix-chained: the latest holder of b holds the whole run up to it
    chosen: set[int] = set()
    for r in window:
        depth, holder = 0, -1
        for b in r.block_ids:
            if b not in latest:
                break
            depth, holder = depth + 1, latest[b]
        if depth >= min_shared_blocks:
            chosen.add(holder)
    return [before[i] for i in sorted(chosen)]


def hit_ceiling(window: Sequence[TraceRequest], warmup: Sequence[TraceRequest] = ()) -> float:
    """The share of ``window``'s prompt tokens an infinite, perfectly shared cache would hit
    after serving ``warmup`` (:func:`upper_bound_hits`, counted over the window only)."""
    hits = upper_bound_hits([*warmup, *window])[len(warmup) :]
    total = sum(r.input_tokens for r in window)
    return sum(hits) / total if total else 0.0

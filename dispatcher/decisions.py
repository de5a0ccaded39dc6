"""The decision log: one JSON line per routing decision, bounded in size.

A decision line (``"type": "decision"``) names the request, the chosen worker, the rule that
decided, the hit the policy expected and, when the policy explains itself, every candidate's
score terms. Outcome lines (``"type": "outcome"``, written by the simulator; the live system's
outcomes are its results) carry the same ``request_id``, so the two join. When the file
reaches ``max_bytes`` it is renamed to ``<name>.1`` (replacing the previous one) and a new
file starts: at most twice ``max_bytes`` on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from sluice.dispatcher.scheduler import Dispatch


def decision_record(dispatch: Dispatch, now_s: float) -> dict[str, Any]:
    """The log line of one decision."""
    r = dispatch.request
    c = dispatch.choice
    return {
        "type": "decision",
        "t_s": round(now_s, 6),
        "request_id": r.request_id,
        "model": r.model,
        "band": r.band,
        "attempt": r.attempt,
        "prompt_tokens": r.prompt_tokens,
        "prefix_blocks": len(r.block_hashes),
        "worker": dispatch.worker_id,
        "reason": c.reason if c else "",
        "expected_hit_tokens": c.expected_hit_tokens if c else 0,
        "candidates": list(c.terms) if c else [],
    }


DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class DecisionLog:
    """Appends JSON lines to ``path``, rotating at ``max_bytes``."""

    def __init__(self, path: Path | str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1024:
            raise ValueError("max_bytes must be at least 1024")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        self._size = self.path.stat().st_size
        self.lines = 0

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        if self._size + len(line) > self.max_bytes and self._size > 0:
            self._rotate()
        self._file.write(line)
        self._size += len(line)
        self.lines += 1

    def _rotate(self) -> None:
        self._file.close()
        self.path.replace(self.path.with_name(self.path.name + ".1"))
        self._file = self.path.open("a", encoding="utf-8")
        self._size = 0

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> DecisionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

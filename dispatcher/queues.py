"""Queued requests (pure): one priority-ordered queue per (band, model), and their deadlines.

Each queue is a list sorted by ``(key, seq)``: ``key`` is the request's virtual deadline (see
:mod:`sluice.dispatcher.admission`), ``seq`` the order of insertion, so equal keys stay FIFO.
Deadlines sit in a heap so that ending expired requests costs what it ends, not the queues'
length.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from sluice.dispatcher.work import Request

QueueKey = tuple[str, str]
"""(band, model)"""
Slot = tuple[float, int, str]
"""(priority key, insertion seq, request id): one queue position."""


@dataclass
class _Entry:
    key: float
    seq: int
    request: Request = field(compare=False)


class Queues:
    """The queued requests of one scheduler."""

    def __init__(self) -> None:
        self._seq = 0
        self._queues: dict[QueueKey, list[Slot]] = {}
        self._entries: dict[str, _Entry] = {}
        self._deadlines: list[Slot] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> Request | None:
        entry = self._entries.get(request_id)
        return entry.request if entry else None

    def requests(self) -> Iterator[Request]:
        return (e.request for e in self._entries.values())

    def queues(self) -> Iterator[tuple[QueueKey, list[Slot]]]:
        """Every non-empty queue: ((band, model), its slots in priority order)."""
        return iter(self._queues.items())

    def queue(self, band: str, model: str) -> list[Slot]:
        return self._queues[(band, model)]

    def insert(self, request: Request, key: float) -> None:
        self._seq += 1
        rid = request.request_id
        self._entries[rid] = _Entry(key, self._seq, request)
        if request.deadline_s is not None:
            heapq.heappush(self._deadlines, (request.deadline_s, self._seq, rid))
            if len(self._deadlines) > 2 * len(self._entries) + 1024:
                # Entries of requests that left the queue stay until their deadline; with far
                # deadlines they would pile up: keep only the queued ones.
                self._deadlines = [
                    (e.request.deadline_s, e.seq, r)
                    for r, e in self._entries.items()
                    if e.request.deadline_s is not None
                ]
                heapq.heapify(self._deadlines)
        q = self._queues.setdefault((request.band, request.model), [])
        bisect.insort(q, (key, self._seq, rid))

    def remove(self, request_id: str) -> Request:
        entry = self._entries.pop(request_id)
        r = entry.request
        q = self._queues[(r.band, r.model)]
        del q[bisect.bisect_left(q, (entry.key, entry.seq, request_id))]
        if not q:
            del self._queues[(r.band, r.model)]
        return r

    def expired(self, now_s: float) -> list[Request]:
        """Remove and return the requests whose deadline is ``now_s`` or earlier."""
        out: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, seq, rid = heapq.heappop(self._deadlines)
            entry = self._entries.get(rid)
            if entry is not None and entry.seq == seq:
                out.append(self.remove(rid))
        return out

    def position(self, request_id: str) -> int | None:
        """Its place in its (band, model) queue, 1 for the head; None if it is not queued."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        r = entry.request
        q = self._queues[(r.band, r.model)]
        return bisect.bisect_left(q, (entry.key, entry.seq, request_id)) + 1

    def order(self) -> list[str]:
        """Queued request ids in priority order across all queues."""
        return [rid for _, _, rid in sorted((e.key, e.seq, r) for r, e in self._entries.items())]

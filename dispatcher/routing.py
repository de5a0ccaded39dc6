"""The routing-policy interface and the least-loaded policy (pure).

A policy *selects*; it never books. The scheduler hands it the candidates that can take the
request now (live, not draining, with free capacity) with the load the scheduler has already
planned onto them, and books the choice only after the worker accepted.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    """A worker that could take a request now, as the policy sees it."""

    worker_id: str
    capacity: int
    """How many requests the worker takes at once."""
    booked: int
    """Requests booked (or planned) on it by this dispatcher."""
    booked_tokens: int
    """Prompt plus maximum output tokens of those requests: the work they bring."""
    reported_pending_tokens: int = 0
    """Pending prefill plus active decode tokens in the worker's last heartbeat."""


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[int, ...] = ()


class RoutingPolicy(Protocol):
    """Chooses one of the candidates for a request. Must not mutate anything it is given."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        """Return the ``worker_id`` of one of ``candidates`` (never empty)."""
        ...


def load_of(c: Candidate) -> float:
    """Work on a worker in tokens: what this dispatcher booked, or what it reports, whichever
    is larger (the report lags; the books miss other dispatchers' work)."""
    return float(max(c.booked_tokens, c.reported_pending_tokens))


class LeastLoaded:
    """The worker with the least work in tokens; ties broken at random, not by position."""

    name = "least-loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random(0)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float) -> str:
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        # Least token load, then the relatively emptiest worker, then chance (never position).
        best: tuple[float, float] | None = None
        tied: list[Candidate] = []
        for c in candidates:
            key = (load_of(c), c.booked / max(c.capacity, 1))
            if best is None or key < best:
                best, tied = key, [c]
            elif key == best:
                tied.append(c)
        return tied[0].worker_id if len(tied) == 1 else self._rng.choice(tied).worker_id

"""The routing-policy interface and the least-loaded policy (pure).

A policy *selects*; it never books. The scheduler hands it the candidates that can take the
request now (live, not draining, with free capacity) with the load the scheduler has already
planned onto them, and books the choice only after the worker accepted.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class Candidate(NamedTuple):
    """A worker that could take a request now, as the policy sees it (a named tuple: the
    scheduler builds one per worker for every decision, and tuples are cheap to build)."""

    worker_id: str
    capacity: int
    """How many requests the worker takes at once."""
    booked: int
    """Requests booked (or planned) on it by this dispatcher."""
    booked_tokens: int
    """Prompt plus maximum output tokens of those requests: the work they bring."""
    reported_pending_tokens: int = 0
    """Pending prefill plus active decode tokens in the worker's last heartbeat."""
    reported_prefill_tokens: int = 0
    """Prompt tokens still to prefill on the worker at its last heartbeat."""
    unreported_prefill_tokens: int = 0
    """Prefill expected from requests booked here that the last heartbeat did not list yet
    (prompt minus the hit expected at routing)."""
    report_age_s: float = 0.0
    """How old the last heartbeat is."""
    joined_s: float = float("-inf")
    """When the worker first heartbeated (cold-start exploration)."""


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Choice:
    """A policy's decision, with what it expects and (when asked) why: the decision log."""

    worker_id: str
    expected_hit_tokens: int = 0
    """Prompt tokens the policy expects the worker to find in its KV cache."""
    reason: str = ""
    """Which rule decided (for example ``sticky``, ``spill``, ``explore``)."""
    terms: tuple[dict[str, float | str], ...] = ()
    """Per candidate: its score terms (filled only when the policy explains itself)."""


class RoutingPolicy(Protocol):
    """Chooses one of the candidates for a request. ``choose`` must not change any state
    (a choice may be discarded if the worker refuses): a policy that learns from its
    decisions does it in an optional ``observe(request, worker_id, now_s)``, which the
    scheduler calls once the worker accepted."""

    name: str

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now_s: float
    ) -> str | Choice:
        """Return one of ``candidates`` (never empty), by ``worker_id`` or as a ``Choice``."""
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

"""The engine protocol: what the agent needs of the engine it drives (pure).

The agent steps its engine and paces it in real time: ``step()`` runs one iteration and says
how long it took on the engine's hardware and what happened by its end (first tokens, more
tokens, finished requests). The simulated engine (:class:`sluice.sim.engine.SimEngine`)
implements this protocol; the command line wires it in, so the agent never imports the
simulator. Everything here is plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sluice.agent.errors import EngineError
from sluice.schemas.models import Sampling, TokenLogprob

__all__ = ["Engine", "EngineError", "EngineLoad", "Finished", "Step", "TokensOut"]


@dataclass(frozen=True)
class TokensOut:
    """``count`` new tokens of ``request_id`` at the end of the step (``first`` on the first)."""

    request_id: str
    count: int
    first: bool


@dataclass(frozen=True)
class Finished:
    """A request finished: its prompt, the part of it found cached, its output, and the
    engine time it spent in prefill and in decode (on the engine's own clock)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class Failed:
    """The engine could not finish a request (it died, hung or answered garbage): the agent
    reports a failure and the dispatcher runs it elsewhere as its next attempt."""

    request_id: str
    error: str


@dataclass(frozen=True)
class Step:
    """One engine iteration: how long it took, and what happened by its end."""

    duration_s: float
    events: list[TokensOut | Finished | Failed] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load, as a heartbeat reports it."""

    running: int
    waiting: int
    pending_prefill_tokens: int
    active_decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    busy_s: float
    """Engine time spent working since start (on the engine's own clock)."""
    kv_events: tuple[tuple[str, int], ...] = ()
    """An engine that follows KV events: how many of what since start (by outcome)."""


class Engine(Protocol):
    """A stepped engine running one model."""

    @property
    def block_tokens(self) -> int:
        """Its KV block size in tokens."""
        ...

    @property
    def uses_prompt_hashes(self) -> bool:
        """Whether :meth:`add` reads its ``hashes`` (an engine whose own KV events say what
        it caches does not: the agent then spares itself hashing every prompt)."""
        ...

    @property
    def has_work(self) -> bool:
        """Whether anything is running or waiting."""
        ...

    def add(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        hashes: Sequence[int],
        now_s: float,
        prompt: str | Sequence[int] | None = None,
        sampling: Sampling | None = None,
    ) -> None:
        """Queue a request (``hashes``: its full prompt blocks' chained hashes; ``prompt``: its
        text or token ids, and ``sampling`` how to sample its output, for engines that run real
        prompts). Raises :class:`EngineError` for a request it can never run."""
        ...

    @property
    def available(self) -> bool:
        """Whether it can take new work now (a remote engine failing its health check
        cannot: its agent heartbeats no free capacity)."""
        ...

    async def open(self) -> None:
        """Start what it needs (connections, health checks); before the first ``add``."""
        ...

    async def close(self) -> None:
        """Stop it (every request it still has ends)."""
        ...

    def step(self) -> Step:
        """Run one iteration (a zero duration: nothing could run)."""
        ...

    def cancel(self, request_id: str) -> bool:
        """Stop a request at once (it produces nothing more, and its KV cache blocks are free
        again); False if the engine does not have it."""
        ...

    def load(self) -> EngineLoad: ...

    def in_flight(self) -> list[str]:
        """Ids of the requests on the engine (running or waiting)."""
        ...

    def cache_changes(self) -> tuple[list[int], list[int]]:
        """Reported prompt blocks stored and evicted since the last call (digest deltas)."""
        ...

    def cached_blocks(self) -> list[int]:
        """Every reported prompt block it holds now (a digest snapshot)."""
        ...

    def output_tokens(self, request_id: str, start: int, count: int) -> list[int]:
        """The ids of tokens ``start`` .. ``start + count - 1`` of a request's output."""
        ...

    def output_logprobs(
        self, request_id: str, start: int, count: int, top: int
    ) -> list[TokenLogprob]:
        """The log probabilities of tokens ``start`` .. ``start + count - 1`` of a request's
        output and of the ``top`` most likely tokens at each position (asked for with
        ``Sampling.logprobs`` at :meth:`add`): one per token."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

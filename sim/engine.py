"""A simulated continuous-batching engine with a real cost model (pure: time passed in).

Each ``step()`` admits waiting sequences (FIFO, while the batch and the KV cache have room),
spends up to one prefill chunk on the sequences still prefilling (uncached tokens only), and
advances every decoding sequence by one token. It returns how long that step takes on the
profile's hardware and what happened by its end. The agent sleeps that long (scaled by its
speed factor) in real time; a simulator advances a virtual clock by it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.agent.engine import EngineError, EngineLoad, Failed, Finished, Step, TokensOut
from sluice.schemas.models import Sampling, TokenLogprob
from sluice.sim.kvcache import KVCache, KVListener
from sluice.sim.profiles import EngineProfile
from sluice.sim.tokens import detokenize, logprobs, output_token

__all__ = ["EngineError", "Finished", "SimEngine", "Step", "TokensOut"]


@dataclass
class _Seq:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    hashes: tuple[int, ...]
    reserve_blocks: int
    arrived_s: float
    cached_tokens: int = 0
    prefill_left: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    decode_mark_s: float = 0.0
    """The engine's ``busy_s`` when its first token came: its decode time is busy time since."""


class SimEngine:
    """One simulated GPU engine running a single model (it implements the agent's
    :class:`~sluice.agent.engine.Engine` protocol)."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        every_token: bool = True,
        digest_min_tokens: int | None = None,
        digest_stride: int = 1,
        kv_listener: KVListener | None = None,
    ) -> None:
        """``every_token=False`` reports only first tokens and finishes (the replay needs no
        more, and it saves an event per generated token). ``digest_min_tokens``: journal the
        prompt blocks of sequences with at least that many tokens in full blocks for the cache
        digest (``cache.drain_digest()``), every ``digest_stride``-th block of each (the
        dispatcher's index resolution); None journals nothing."""
        self.profile = profile
        self.every_token = every_token
        self.digest_min_tokens = digest_min_tokens
        if digest_stride < 1:
            raise ValueError("digest_stride must be >= 1")
        self.digest_stride = digest_stride
        self.cache = KVCache(profile.kv_capacity_blocks, kv_listener)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self.busy_s = 0.0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    # ------------------------------------------------------------------ state

    @property
    def block_tokens(self) -> int:
        return self.profile.block_tokens

    @property
    def uses_prompt_hashes(self) -> bool:
        return True

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def in_flight(self) -> list[str]:
        """Ids of the requests on the engine (running or waiting)."""
        return [s.request_id for s in self._running] + [s.request_id for s in self._waiting]

    def pending_prefill_tokens(self) -> int:
        return sum(s.prefill_left for s in self._running) + sum(
            s.prompt_tokens for s in self._waiting
        )

    def remaining_decode_tokens(self) -> int:
        """Output tokens still to generate by the running and waiting sequences."""
        return sum(s.output_tokens - s.generated for s in self._running) + sum(
            s.output_tokens for s in self._waiting
        )

    def active_context_tokens(self) -> int:
        """KV context of every sequence on the engine (running or waiting)."""
        return sum(s.prompt_tokens + s.generated for s in self._running) + sum(
            s.prompt_tokens for s in self._waiting
        )

    def active_decode_tokens(self) -> int:
        return sum(s.prompt_tokens + s.generated for s in self._running if s.prefill_left == 0)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            pending_prefill_tokens=self.pending_prefill_tokens(),
            active_decode_tokens=self.active_decode_tokens(),
            kv_blocks_used=self.cache.used_blocks,
            kv_blocks_total=self.cache.capacity_blocks,
            busy_s=self.busy_s,
        )

    @property
    def available(self) -> bool:
        return True

    async def open(self) -> None:
        """Nothing to start: it runs in the agent's process."""

    async def close(self) -> None:
        """Nothing to stop."""

    def cache_changes(self) -> tuple[list[int], list[int]]:
        return self.cache.drain_digest()

    def cached_blocks(self) -> list[int]:
        return self.cache.reported_blocks()

    def output_tokens(self, request_id: str, start: int, count: int) -> list[int]:
        """Pseudo tokens: the same request always yields the same ones (a retried attempt
        streams what the first one did)."""
        return [output_token(request_id, start + i) for i in range(count)]

    def output_logprobs(
        self, request_id: str, start: int, count: int, top: int
    ) -> list[TokenLogprob]:
        """Pseudo log probabilities of its pseudo tokens (:func:`sluice.sim.tokens.logprobs`)."""
        return logprobs(self.output_tokens(request_id, start, count), top)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return detokenize(tokens)

    # ------------------------------------------------------------------ input

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
        """Queue a request. ``hashes`` are its full prompt blocks' chained hashes (the cost
        model needs only them; ``prompt`` and ``sampling`` are ignored: its pseudo output is
        no sample, and ends at its length: ``sluice engine`` honours stop strings)."""
        bt = self.profile.block_tokens
        if sampling is not None and sampling.response_format is not None:
            raise EngineError(
                "the in-process simulated engine makes no structured output (response_format); "
                "sluice engine behind openai-http does"
            )
        if prompt_tokens < 1 or output_tokens < 1:
            raise EngineError("a request needs at least one prompt and one output token")
        hashes = tuple(hashes[: prompt_tokens // bt])
        tail = prompt_tokens - len(hashes) * bt
        reserve = -(-(tail + output_tokens) // bt)
        if len(hashes) + reserve > self.cache.capacity_blocks:
            raise EngineError(
                f"request needs {(len(hashes) + reserve) * bt} KV tokens; the engine holds "
                f"{self.cache.capacity_blocks * bt}"
            )
        self._waiting.append(_Seq(request_id, prompt_tokens, output_tokens, hashes, reserve, now_s))

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request; a running one's blocks are released (its prompt
        blocks stay cached, as after a finish)."""
        for i, s in enumerate(self._waiting):
            if s.request_id == request_id:
                del self._waiting[i]
                return True
        for i, s in enumerate(self._running):
            if s.request_id == request_id:
                del self._running[i]
                self.cache.release(s.hashes, s.reserve_blocks)
                return True
        return False

    def finish_early(self, request_id: str) -> Finished | None:
        """End a running request now, as a stop string or token ends it in a real engine: its
        blocks are released as at a finish, and its finish (the tokens generated so far) is
        returned; None if it does not run."""
        for i, s in enumerate(self._running):
            if s.request_id == request_id:
                del self._running[i]
                self.cache.release(s.hashes, s.reserve_blocks)
                decode_s = self.busy_s - s.decode_mark_s if s.generated else 0.0
                return Finished(
                    s.request_id, s.prompt_tokens, s.cached_tokens, s.generated, s.prefill_s,
                    decode_s,
                )  # fmt: skip
        return None

    # ------------------------------------------------------------------ time

    def step(self) -> Step:
        """Run one engine iteration; returns its duration and the events at its end."""
        self._admit()
        if not self._running:
            return Step(0.0)
        p = self.profile
        budget = p.prefill_chunk_tokens
        events: list[TokensOut | Finished | Failed] = []
        prefilling: list[tuple[_Seq, int]] = []
        decoding: list[_Seq] = []
        for s in self._running:  # one pass: this is the simulator's innermost loop
            if s.prefill_left == 0:
                decoding.append(s)
            elif budget > 0:
                n = s.prefill_left if s.prefill_left < budget else budget
                budget -= n
                prefilling.append((s, n))
        prefill_time = (p.prefill_chunk_tokens - budget) / p.prefill_tokens_per_s
        decode_time = p.decode_base_s + p.decode_per_seq_s * len(decoding) if decoding else 0.0
        duration = prefill_time + decode_time
        busy = self.busy_s + duration
        done: list[_Seq] = []
        for s, n in prefilling:
            s.prefill_left -= n
            s.prefill_s += duration
            if s.prefill_left == 0:
                s.generated = 1
                s.decode_mark_s = busy
                events.append(TokensOut(s.request_id, 1, True))
                if s.output_tokens <= 1:
                    done.append(s)
        every = self.every_token
        for s in decoding:
            s.generated += 1
            if every:
                events.append(TokensOut(s.request_id, 1, False))
            if s.generated >= s.output_tokens:
                done.append(s)
        self.busy_s = busy
        if done:
            self._finish(done, events)
        return Step(duration, events)

    def decode_run(self) -> tuple[float, int] | None:
        """Admit what fits, as :meth:`step` does first; then, if every running sequence is
        decoding and nothing is journalled per token, ``(duration, steps)``: the next
        ``steps`` iterations all take ``duration`` and only the last one finishes anything
        (if nothing is added meanwhile). A simulator may apply the first ``steps - 1`` at
        once with :meth:`decode_steps` and run the last with :meth:`step`. None: the next
        step prefills, or nothing runs."""
        if self.every_token:
            return None
        self._admit()
        running = self._running
        if not running:
            return None
        steps = None
        for s in running:
            if s.prefill_left:
                return None
            left = s.output_tokens - s.generated
            if steps is None or left < steps:
                steps = left
        assert steps is not None
        p = self.profile
        return p.decode_base_s + p.decode_per_seq_s * len(running), steps

    def decode_steps(self, n: int, duration_s: float) -> None:
        """Apply ``n`` decode iterations of ``duration_s`` that finish nothing (what
        :meth:`decode_run` announced, less its last step): the same state as ``n`` calls of
        :meth:`step`, without their events (there are none)."""
        for s in self._running:
            s.generated += n
        busy = self.busy_s
        for _ in range(n):  # added one at a time: the same sum as n steps
            busy += duration_s
        self.busy_s = busy

    def _finish(self, done: list[_Seq], events: list[TokensOut | Finished | Failed]) -> None:
        for s in done:
            self.cache.release(s.hashes, s.reserve_blocks)
            events.append(
                Finished(
                    s.request_id,
                    s.prompt_tokens,
                    s.cached_tokens,
                    s.generated,
                    s.prefill_s,
                    self.busy_s - s.decode_mark_s,
                )
            )
        finished = {id(s) for s in done}
        self._running = [s for s in self._running if id(s) not in finished]

    def _admit(self) -> None:
        p = self.profile
        while self._waiting and len(self._running) < p.max_running:
            s = self._waiting[0]
            hit = self.cache.match(s.hashes)
            m, k = self.digest_min_tokens, self.digest_stride
            long_enough = m is not None and len(s.hashes) * p.block_tokens >= m
            report = s.hashes[k - 1 :: k] if long_enough else ()
            if not self.cache.admit(s.hashes, s.reserve_blocks, report=report):
                break
            self._waiting.popleft()
            # At least one prompt token is always computed, as real engines do.
            s.cached_tokens = min(hit * p.block_tokens, s.prompt_tokens - 1)
            s.prefill_left = s.prompt_tokens - s.cached_tokens
            self.prompt_tokens_total += s.prompt_tokens
            self.cached_tokens_total += s.cached_tokens
            self._running.append(s)

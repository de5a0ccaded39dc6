"""Engine time (pure): what a request costs a worker, in seconds of that worker's engine.

A request's cost is the prefill of its *uncached* prompt tokens plus the decode of its expected
output, at the engine's nominal *marginal* costs scaled by the worker's learned slowness:

    cost_s = (prompt_tokens - hit_tokens) x prefill_token_s x slow_prefill(w)
           + expected_output x decode_token_s x slow_decode(w)

``prefill_token_s`` and ``decode_token_s`` are what one more token costs an engine that is
batching well (``EngineTimeConfig``; the defaults are the reference engine's: 8,000 prefill
tokens/s, and 0.35 ms per sequence per step plus a 6 ms step shared by 64 sequences). Marginal
costs, not the wall time a request spends: with continuous batching an engine serves many
sequences per step, so the time a request takes says little about the capacity it uses.
``slow(w)`` is the worker's learned speed relative to the fleet's median
(:mod:`sluice.dispatcher.calibration`, with its deadband: 1 unless the worker stands out), so a
request costs more on a slower worker. Each worker supplies one engine-second per second, so a
band's share of the fleet in engine time is ``share x live workers`` engine-seconds per second.

*Expected output* is ``max_tokens`` times the learned ratio of output to ``max_tokens`` for the
request's model and band (producers often ask for far more than they use; until a completion
is seen, the ratio is 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.dispatcher.calibration import Calibration
from sluice.dispatcher.work import Request

DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
DEFAULT_DECODE_TOKEN_S = 0.00035 + 0.006 / 64
"""The marginal decode cost of one output token (the reference engine: 0.35 ms per sequence
plus a 6 ms step shared by 64)."""


@dataclass(frozen=True)
class EngineTimeConfig:
    """The engines' nominal marginal costs, and how fast the output ratio is learned."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    decode_token_s: float = DEFAULT_DECODE_TOKEN_S
    ratio_rate: float = 0.05
    """Weight of each completion in a model and band's output ratio."""

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_token_s <= 0:
            raise ValueError("prior speeds must be > 0")
        if not 0 < self.ratio_rate <= 1:
            raise ValueError("ratio_rate must be within (0, 1]")


class EngineTime:
    """Per-worker engine-time costs, learned from heartbeats and completions."""

    def __init__(self, config: EngineTimeConfig | None = None) -> None:
        self.config = c = config or EngineTimeConfig()
        self._prefill_s = 1.0 / c.prefill_tokens_per_s
        # Only relative speeds are read from it (the priors cancel out).
        self.calibration = Calibration(prefill_tokens_per_s=1.0, decode_step_s=1.0)
        self._ratio: dict[tuple[str, str], float] = {}

    def observe(
        self,
        worker_id: str,
        request: Request,
        *,
        cached_tokens: int,
        prefill_s: float,
        output_tokens: int,
        decode_s: float,
    ) -> None:
        """A completion of ``request`` on ``worker_id``."""
        self.calibration.observe(
            worker_id,
            uncached_tokens=max(0, request.prompt_tokens - cached_tokens),
            prefill_s=prefill_s,
            output_tokens=output_tokens,
            decode_s=decode_s,
        )
        if request.max_tokens > 0:
            key = (request.model, request.band)
            x = min(1.0, output_tokens / request.max_tokens)
            prev = self._ratio.get(key, 1.0)
            self._ratio[key] = prev + self.config.ratio_rate * (x - prev)

    def expected_output(self, request: Request) -> float:
        """Output tokens ``request`` is expected to generate."""
        ratio = self._ratio.get((request.model, request.band), 1.0)
        return max(1.0, request.max_tokens * ratio)

    def cost_s(self, request: Request, worker_id: str | None = None, hit_tokens: int = 0) -> float:
        """Engine seconds ``request`` costs on ``worker_id`` (None: a median worker) when
        ``hit_tokens`` of its prompt are cached there."""
        slow_prefill, slow_decode = self.slowness(worker_id)
        uncached = max(1, request.prompt_tokens - hit_tokens)
        return (
            uncached * self._prefill_s * slow_prefill
            + self.expected_output(request) * self.config.decode_token_s * slow_decode
        )

    def slowness(self, worker_id: str | None) -> tuple[float, float]:
        """How many times slower than the fleet's median ``worker_id`` prefills and decodes."""
        if worker_id is None:
            return 1.0, 1.0
        own, fleet = self.calibration.speeds(worker_id), self.calibration.speeds("")
        return (
            own.prefill_s_per_token / fleet.prefill_s_per_token,
            own.decode_s_per_token / fleet.decode_s_per_token,
        )

    def remove_worker(self, worker_id: str) -> None:
        self.calibration.remove_worker(worker_id)

"""Per-worker speeds learned online from completions (pure).

Every completion reports how long its prefill took (from the engine taking the request to its
first token) for how many uncached prompt tokens, and how long its decode took for how many
tokens. Those ratios are the worker's speed *plus* whatever it was doing meanwhile (other
requests' prefill chunks in the same steps, a big decode batch), and that contention is already
in the policy's queue term. So the estimate is a low quantile of the ratios (``quantile``,
default the 20th percentile), tracked online in log space: it measures the worker's own speed
(a slower GPU, a throttled card), is not dragged up by the heavy tail of busy moments, and
follows a change in a few dozen completions. Until a worker has reported, the prior (the
configured nominal speeds) stands.

Per-worker noise must not become a lasting bias (a worker estimated slow gets less work, so
fewer completions to correct it): a worker's own estimate is used only when it differs from the
fleet's median by more than ``deadband`` (a factor, default 1.25); otherwise every worker gets
the fleet median. A genuinely slower or faster worker stands out; noise does not.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Speeds:
    """A worker's estimated speeds (seconds per uncached prompt token; per output token)."""

    prefill_s_per_token: float
    decode_s_per_token: float
    observations: int


class _Quantile:
    """Online quantile of positive samples, in log space (step ``rate`` per sample)."""

    def __init__(self, start: float, q: float, rate: float) -> None:
        self.log = math.log(start)
        self.q = q
        self.rate = rate

    def add(self, x: float) -> None:
        if math.log(x) < self.log:
            self.log -= self.rate * (1.0 - self.q)
        else:
            self.log += self.rate * self.q

    @property
    def value(self) -> float:
        return math.exp(self.log)


class Calibration:
    """Effective prefill and decode seconds per token, per worker."""

    def __init__(
        self,
        *,
        prefill_tokens_per_s: float,
        decode_step_s: float,
        quantile: float = 0.2,
        rate: float = 0.1,
        min_prefill_tokens: int = 256,
        deadband: float = 1.25,
    ) -> None:
        """``prefill_tokens_per_s`` and ``decode_step_s`` are the prior. Completions with fewer
        than ``min_prefill_tokens`` uncached tokens do not update the prefill estimate (one
        engine step dominates them)."""
        if prefill_tokens_per_s <= 0 or decode_step_s <= 0:
            raise ValueError("prior speeds must be > 0")
        if not 0 < quantile < 1 or rate <= 0 or deadband < 1:
            raise ValueError("quantile must be within (0, 1), rate > 0 and deadband >= 1")
        self._band = math.log(deadband)
        self._median_prefill = math.log(1.0 / prefill_tokens_per_s)
        self._median_decode = math.log(decode_step_s)
        self.prior = Speeds(1.0 / prefill_tokens_per_s, decode_step_s, 0)
        self.quantile = quantile
        self.rate = rate
        self._min_prefill = min_prefill_tokens
        self._prefill: dict[str, _Quantile] = {}
        self._decode: dict[str, _Quantile] = {}
        # Every worker's estimate in log space, sorted: the fleet's median without a sort.
        self._sorted_prefill: list[float] = []
        self._sorted_decode: list[float] = []
        self._count: dict[str, int] = {}
        self._fleet = self.prior
        self._current = _Table(self._compute)
        """Speeds computed since the last change (read for every scored candidate)."""

    def observe(
        self,
        worker_id: str,
        *,
        uncached_tokens: int,
        prefill_s: float,
        output_tokens: int,
        decode_s: float,
    ) -> None:
        """Learn from one completion on ``worker_id`` (O(log workers), plus a list move)."""
        if uncached_tokens >= self._min_prefill and prefill_s > 0:
            _add(
                self._prefill,
                self._sorted_prefill,
                worker_id,
                prefill_s / uncached_tokens,
                lambda: _Quantile(self.prior.prefill_s_per_token, self.quantile, self.rate),
            )
        if output_tokens > 1 and decode_s > 0:
            _add(
                self._decode,
                self._sorted_decode,
                worker_id,
                decode_s / (output_tokens - 1),
                lambda: _Quantile(self.prior.decode_s_per_token, 0.5, self.rate),
            )
        self._count[worker_id] = self._count.get(worker_id, 0) + 1
        self._refresh(worker_id)

    def _refresh(self, worker_id: str) -> None:
        """``worker_id``'s estimate changed: forget the speeds computed with it."""
        medians = self._median_prefill, self._median_decode
        if self._sorted_prefill:
            self._median_prefill = _median(self._sorted_prefill)
        if self._sorted_decode:
            self._median_decode = _median(self._sorted_decode)
        fleet = Speeds(math.exp(self._median_prefill), math.exp(self._median_decode), 0)
        if medians == (self._median_prefill, self._median_decode) and fleet == self._fleet:
            # Every other worker's speeds stand (they read only the medians and their own
            # estimates): a completion must not make the next decision compute them all again.
            self._current.pop(worker_id, None)
            return
        self._fleet = fleet
        self._current = _Table(self._compute)

    def _pick(self, own: _Quantile | None, median: float) -> float:
        if own is None or abs(own.log - median) <= self._band:
            return math.exp(median)
        return own.value

    def speeds(self, worker_id: str) -> Speeds:
        """The worker's current estimate (the prior until it has reported)."""
        return self._current[worker_id]

    def table(self) -> Mapping[str, Speeds]:
        """:meth:`speeds` of every worker, by id (a worker not computed since the last change
        is computed on reading): what the native scoring loop reads without a call per
        candidate. Read it again after a completion (it may be a new table then)."""
        return self._current

    def _compute(self, worker_id: str) -> Speeds:
        n = self._count.get(worker_id)
        if n is None:
            return self._fleet
        return Speeds(
            self._pick(self._prefill.get(worker_id), self._median_prefill),
            self._pick(self._decode.get(worker_id), self._median_decode),
            n,
        )

    def fastest(self) -> tuple[float, float]:
        """The lowest prefill and decode seconds per token of any worker (what no worker's
        :meth:`speeds` go below)."""
        p, d = self._median_prefill, self._median_decode
        if self._sorted_prefill:
            p = min(p, self._sorted_prefill[0])
        if self._sorted_decode:
            d = min(d, self._sorted_decode[0])
        return math.exp(p), math.exp(d)

    def remove_worker(self, worker_id: str) -> None:
        for own, ordered in (
            (self._prefill, self._sorted_prefill),
            (self._decode, self._sorted_decode),
        ):
            q = own.pop(worker_id, None)
            if q is not None:
                del ordered[bisect.bisect_left(ordered, q.log)]
        self._count.pop(worker_id, None)
        self._refresh(worker_id)

    def workers(self) -> list[str]:
        return sorted(self._count)


class _Table(dict[str, Speeds]):
    """Speeds by worker, each computed on its first reading and kept until a change."""

    __slots__ = ("_compute",)

    def __init__(self, compute: Callable[[str], Speeds]) -> None:
        super().__init__()
        self._compute = compute

    def __missing__(self, worker_id: str) -> Speeds:
        speeds = self[worker_id] = self._compute(worker_id)
        return speeds


def _add(
    own: dict[str, _Quantile],
    ordered: list[float],
    worker_id: str,
    sample: float,
    new: Callable[[], _Quantile],
) -> None:
    """Add a sample to the worker's estimate, keeping ``ordered`` (every estimate) sorted."""
    q = own.get(worker_id)
    if q is None:
        q = own[worker_id] = new()
    else:
        del ordered[bisect.bisect_left(ordered, q.log)]
    q.add(sample)
    bisect.insort(ordered, q.log)


def _median(v: list[float]) -> float:
    """The median of sorted values."""
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2

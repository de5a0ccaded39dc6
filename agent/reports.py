"""What the agent reports (pure): heartbeats, cache digests, completions and results, built
in one place for the live agent and for the replay's simulated workers alike."""

from __future__ import annotations

from collections.abc import Sequence

from sluice.agent.engine import Engine, EngineLoad, Finished
from sluice.schemas.models import (
    CacheDigest,
    Completion,
    Heartbeat,
    Rejection,
    RejectReason,
    Result,
    SubmitRequest,
    Timings,
    TokenLogprob,
    WorkerLoad,
    WorkerState,
)

DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_SNAPSHOT_EVERY = 30
DEFAULT_DIGEST_MIN_TOKENS = 256
"""Engines report (journal for digests) the blocks of prompts at least this long."""
DEFAULT_DIGEST_MAX_BLOCKS = 50_000


class DigestBuilder:
    """Numbers a worker's cache digests: a delta of the engine's reported blocks every
    heartbeat, a full snapshot every ``snapshot_every`` heartbeats and whenever a delta would
    exceed ``max_blocks`` (a snapshot is cut to ``max_blocks``). A digest lost in transit
    leaves a gap in ``seq``: dispatchers ignore deltas until the next snapshot."""

    def __init__(
        self,
        index_block_tokens: int,
        *,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        max_blocks: int = DEFAULT_DIGEST_MAX_BLOCKS,
    ) -> None:
        if min(index_block_tokens, snapshot_every, max_blocks) < 1:
            raise ValueError("index_block_tokens, snapshot_every and max_blocks must be >= 1")
        self.index_block_tokens = index_block_tokens
        self.snapshot_every = snapshot_every
        self.max_blocks = max_blocks
        self.seq = -1

    def restart(self) -> None:
        """Start the numbering again: the next digest is a snapshot (a dispatcher that took
        the worker's lease away forgot what it had)."""
        self.seq = -1

    def next(self, engine: Engine) -> CacheDigest:
        self.seq += 1
        stored, evicted = engine.cache_changes()
        bt = self.index_block_tokens
        if self.seq % self.snapshot_every == 0 or len(stored) + len(evicted) > self.max_blocks:
            blocks = engine.cached_blocks()[: self.max_blocks]
            return CacheDigest(seq=self.seq, snapshot=True, block_tokens=bt, stored=blocks)
        return CacheDigest(seq=self.seq, block_tokens=bt, stored=stored, evicted=evicted)


def worker_load(load: EngineLoad, speed: float = 1.0) -> WorkerLoad:
    """A heartbeat's load from the engine's (``speed``: engine seconds per real second)."""
    return WorkerLoad(
        running=load.running,
        waiting=load.waiting,
        pending_prefill_tokens=load.pending_prefill_tokens,
        active_decode_tokens=load.active_decode_tokens,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        busy_s_total=load.busy_s / speed,
    )


def heartbeat(
    *,
    worker_id: str,
    models: Sequence[str],
    seq: int,
    sent_unix_ms: int,
    capacity: int,
    in_flight: Sequence[str],
    load: WorkerLoad,
    draining: bool = False,
    leaving: bool = False,
    cache: CacheDigest | None = None,
    state: WorkerState = "serving",
    registration: int = 0,
) -> Heartbeat:
    """A heartbeat. A leaving worker announces no capacity and no digest."""
    return Heartbeat(
        worker_id=worker_id,
        models=list(models),
        seq=seq,
        sent_unix_ms=sent_unix_ms,
        capacity=0 if leaving else capacity,
        in_flight=list(in_flight),
        load=load,
        draining=draining,
        leaving=leaving,
        cache=None if leaving else cache,
        state=state,
        registration=registration,
    )


def completion(
    worker_id: str, request_id: str, attempt: int, ev: Finished, speed: float = 1.0
) -> Completion:
    """The completion of a finished request (engine times divided by ``speed``: real seconds)."""
    return Completion(
        request_id=request_id,
        worker_id=worker_id,
        attempt=attempt,
        ok=True,
        prompt_tokens=ev.prompt_tokens,
        cached_tokens=ev.cached_tokens,
        output_tokens=ev.output_tokens,
        prefill_s=ev.prefill_s / speed,
        decode_s=ev.decode_s / speed,
    )


def failure(worker_id: str, request_id: str, attempt: int, error: str) -> Completion:
    """The completion of a request the worker could not finish (the dispatcher retries it)."""
    return Completion(
        request_id=request_id,
        worker_id=worker_id,
        attempt=attempt,
        ok=False,
        prompt_tokens=0,
        cached_tokens=0,
        output_tokens=0,
        prefill_s=0.0,
        decode_s=0.0,
        error=error,
    )


def cancelled(
    req: SubmitRequest,
    worker_id: str,
    attempt: int,
    *,
    tokens: list[int],
    text: str,
    logprobs: list[TokenLogprob] | None = None,
) -> Result:
    """The result of a request cancelled while it ran: not ok, ``cancelled``, with the tokens
    produced until the stop."""
    return Result(
        request_id=req.request_id,
        ok=False,
        model=req.model,
        tenant=req.tenant,
        band=req.band,
        worker_id=worker_id,
        attempt=attempt,
        output_tokens=tokens,
        text=text,
        logprobs=logprobs,
        rejection=Rejection(
            reason=RejectReason.CANCELLED,
            message=f"cancelled while running, after {len(tokens)} tokens",
        ),
    )


def result(
    req: SubmitRequest,
    done: Completion,
    *,
    tokens: list[int],
    text: str,
    logprobs: list[TokenLogprob] | None = None,
    accepted_unix_s: float,
    first_token_unix_s: float | None,
    finished_unix_s: float,
) -> Result:
    """The final result of a finished request, with its timings from submission."""
    submitted = req.submitted_unix_ms / 1000
    first = first_token_unix_s if first_token_unix_s is not None else finished_unix_s
    return Result(
        request_id=req.request_id,
        ok=True,
        model=req.model,
        tenant=req.tenant,
        band=req.band,
        worker_id=done.worker_id,
        attempt=done.attempt,
        output_tokens=tokens,
        text=text,
        logprobs=logprobs,
        prompt_tokens=done.prompt_tokens,
        cached_tokens=done.cached_tokens,
        timings=Timings(
            queued_s=max(0.0, accepted_unix_s - submitted),
            ttft_s=max(0.0, first - submitted),
            e2e_s=max(0.0, finished_unix_s - submitted),
            prefill_s=done.prefill_s,
            decode_s=done.decode_s,
        ),
    )

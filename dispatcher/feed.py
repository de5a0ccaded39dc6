"""The one glue between worker reports and the core, used by the live runtime and the replay
alike: a heartbeat becomes the scheduler's worker view and the policy's digest (and adopts
what the worker runs), a completion ends or retries its request and teaches the policy, a lost
worker is forgotten by both. The live runtime calls these with decoded messages; the replay
calls them with the messages the agent's own builders make from its simulated engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.dispatcher.errors import DigestMismatch
from sluice.dispatcher.routing import Digest, Outcome
from sluice.dispatcher.scheduler import Booking, Ended, Request, Scheduler, WorkerInfo
from sluice.schemas.models import CacheDigest, Completion, Heartbeat


def worker_view(hb: Heartbeat, now_s: float) -> WorkerInfo:
    """The scheduler's view of a worker, from its heartbeat received at ``now_s``."""
    load = hb.load
    return WorkerInfo(
        worker_id=hb.worker_id,
        models=frozenset(hb.models),
        capacity=hb.capacity,
        draining=hb.draining,
        reported_pending_tokens=load.pending_prefill_tokens + load.active_decode_tokens,
        reported_in_flight=frozenset(hb.in_flight),
        reported_prefill_tokens=load.pending_prefill_tokens,
        reported_s=now_s,
    )


def digest_of(d: CacheDigest | None, index_block_tokens: int) -> Digest | None:
    """A policy's view of a heartbeat's cache digest. Raises :class:`DigestMismatch` when the
    worker reports blocks of another size than the index keeps (its digest is useless)."""
    if d is None:
        return None
    if d.block_tokens != index_block_tokens:
        raise DigestMismatch(
            f"the digest reports {d.block_tokens}-token index blocks; this dispatcher indexes "
            f"{index_block_tokens} (engine block size x the index stride): set the agents' "
            "digest_index_tokens to the dispatcher's routing_index_tokens"
        )
    return Digest(d.seq, d.snapshot, tuple(d.stored), tuple(d.evicted))


@dataclass
class HeartbeatEffects:
    """What a heartbeat changed."""

    adopted: list[str] = field(default_factory=list)
    """Queued requests the worker reports running, now booked there."""
    digest_ok: bool = True
    """False: the digest was a delta after a gap (ignored until the next snapshot)."""
    mismatch: str = ""
    """Why the digest was ignored, if its block size was wrong."""


def apply_heartbeat(
    scheduler: Scheduler, hb: Heartbeat, now_s: float, *, index_block_tokens: int
) -> HeartbeatEffects:
    """Feed a (not leaving) heartbeat to the scheduler and its policy."""
    effects = HeartbeatEffects()
    scheduler.update_worker(worker_view(hb, now_s))
    policy = scheduler.policy
    if policy.uses_digests:
        try:
            digest = digest_of(hb.cache, index_block_tokens)
        except DigestMismatch as exc:
            digest, effects.mismatch = None, str(exc)
        effects.digest_ok = policy.heartbeat(hb.worker_id, digest, now_s)
    else:
        policy.heartbeat(hb.worker_id, None, now_s)
    for rid in hb.in_flight:
        if scheduler.is_queued(rid) and scheduler.adopt(rid, hb.worker_id, now_s):
            effects.adopted.append(rid)
    return effects


def outcome_of(c: Completion, now_s: float) -> Outcome:
    """What a completion teaches a policy."""
    return Outcome(
        cached_tokens=c.cached_tokens,
        prefill_s=c.prefill_s,
        output_tokens=c.output_tokens,
        decode_s=c.decode_s,
        now_s=now_s,
    )


@dataclass(frozen=True)
class CompletionEffects:
    """What a completion changed: for a success, the request it ended (None if it was not
    known here any more) and the booking it had; for a failure, the retry (a request queued
    again, an :class:`Ended` out of attempts, or None for a stale report)."""

    request: Request | None = None
    booking: Booking | None = None
    retry: Request | Ended | None = None


def apply_completion(scheduler: Scheduler, c: Completion, now_s: float) -> CompletionEffects:
    """Feed a completion to the scheduler and its policy."""
    if not c.ok:
        return CompletionEffects(
            retry=scheduler.fail(c.request_id, c.worker_id, c.attempt, c.error)
        )
    booking = scheduler.booking(c.request_id)
    request = scheduler.complete(c.request_id)
    if request is not None:
        scheduler.policy.completed(c.worker_id, request.route_view(), outcome_of(c, now_s))
        scheduler.engine_time.observe(
            c.worker_id,
            request,
            cached_tokens=c.cached_tokens,
            prefill_s=c.prefill_s,
            output_tokens=c.output_tokens,
            decode_s=c.decode_s,
        )
    return CompletionEffects(request=request, booking=booking)


def remove_worker(scheduler: Scheduler, worker_id: str) -> tuple[list[Request], list[Ended]]:
    """Forget a worker that left or lost its lease: its requests are queued again (or ended
    out of attempts) and the policy drops what it knew of it."""
    out = scheduler.remove_worker(worker_id)
    scheduler.policy.remove_worker(worker_id)
    return out

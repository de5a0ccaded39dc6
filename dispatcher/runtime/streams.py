"""The JetStream layout: one bounded work-queue stream per band, the renewed requests, the
result stream, dead letters, the max-deliveries advisories, and the dispatcher's durable pull
consumers. Created or updated at start (idempotent)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from sluice.dispatcher.errors import StreamSetupError
from sluice.dispatcher.runtime.settings import DispatcherSettings
from sluice.dispatcher.runtime.state import BROKER_ERRORS
from sluice.schemas import names

log = logging.getLogger("sluice.dispatcher")

T = TypeVar("T")


def band_stream(
    s: DispatcherSettings, band: str, queue_bound: int | None = None
) -> api.StreamConfig:
    """A band's queue. Held (un-acked) requests still count against ``max_msgs``, so the bound
    is the queue bound (``queue_bound``, else the band's ``queue_max_msgs``) plus what may run
    at once. A request's subject names its model and tenant, so ``tenant_queue_max_msgs``
    bounds each tenant's requests per model (queued and running) with the broker's per-subject
    limit."""
    per_tenant = s.tenant_queue_max_msgs
    return api.StreamConfig(
        name=names.request_stream(band),
        subjects=[names.request_filter(band)],
        retention=api.RetentionPolicy.WORK_QUEUE,
        discard=api.DiscardPolicy.NEW,
        max_msgs=(s.queue_max_msgs_of(band) if queue_bound is None else queue_bound)
        + s.global_limit,
        max_msgs_per_subject=-1 if per_tenant is None else per_tenant,
        discard_new_per_subject=per_tenant is not None,
        storage=api.StorageType.FILE,
        num_replicas=s.stream_replicas,
        duplicate_window=s.duplicate_window_s,
    )


def result_stream(s: DispatcherSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=names.RESULT_STREAM,
        subjects=[names.RESULT_SUBJECTS],
        retention=api.RetentionPolicy.LIMITS,
        max_age=s.result_ttl_s,
        storage=api.StorageType.FILE,
        num_replicas=s.stream_replicas,
        duplicate_window=s.duplicate_window_s,
        allow_direct=True,
    )


_KEEP_S = 7 * 24 * 3600.0
"""How long dead letters and unserved advisories are kept."""


def dead_letter_stream(s: DispatcherSettings) -> api.StreamConfig:
    """Dead letters, deduplicated by ``Nats-Msg-Id`` (a leader that dies while it moves a
    request there leaves the move to the next one, which must not store it twice)."""
    return api.StreamConfig(
        name=names.DEAD_LETTER_STREAM,
        subjects=[names.DEAD_LETTER_SUBJECTS],
        retention=api.RetentionPolicy.LIMITS,
        max_age=_KEEP_S,
        storage=api.StorageType.FILE,
        num_replicas=s.stream_replicas,
        duplicate_window=s.duplicate_window_s,
    )


def _renewed_bound(s: DispatcherSettings) -> int:
    """At most one copy per request held (and one on its way): twice what a leader may hold
    (every band's buffer, and what runs)."""
    return 2 * (len(s.bands) * s.max_buffered + s.global_limit)


def renewed_stream(s: DispatcherSettings) -> api.StreamConfig:
    """Renewed copies of held requests (:mod:`sluice.dispatcher.runtime.renewals`). Outside
    the bands' bounds, bounded by what the leader may hold (:func:`_renewed_bound`): a copy
    the bound refuses is tried again later."""
    return api.StreamConfig(
        name=names.RENEWED_STREAM,
        subjects=[names.RENEWED_SUBJECTS],
        retention=api.RetentionPolicy.WORK_QUEUE,
        discard=api.DiscardPolicy.NEW,
        max_msgs=_renewed_bound(s),
        storage=api.StorageType.FILE,
        num_replicas=s.stream_replicas,
        duplicate_window=s.duplicate_window_s,
    )


def advisory_stream(s: DispatcherSettings) -> api.StreamConfig:
    """The max-deliveries advisories of every band and of the renewed copies, kept until the
    leader has answered their requests. The broker sends one once, over core NATS, when a
    pull finds a request past its last delivery's ``ack_wait``: a leader that dies or is
    deposed while it serves one, or whose answer the broker refuses, would leave the request
    unanswered for good. Kept here, each waits for a leader that serves it (at most
    ``max_kept_advisories``, oldest dropped first)."""
    return api.StreamConfig(
        name=names.ADVISORY_STREAM,
        subjects=[names.max_deliveries_advisory(b) for b in s.bands]
        + [names.renewed_max_deliveries_advisory()],
        retention=api.RetentionPolicy.WORK_QUEUE,
        discard=api.DiscardPolicy.OLD,
        max_msgs=s.max_kept_advisories,
        max_age=_KEEP_S,
        storage=api.StorageType.FILE,
        num_replicas=s.stream_replicas,
    )


def band_consumer(s: DispatcherSettings, band: str) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        durable_name=names.dispatcher_consumer(band),
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=s.effective_ack_wait_s,
        max_deliver=s.max_deliver,
        max_ack_pending=s.max_buffered + s.global_limit,
        filter_subject=names.request_filter(band),
    )


def renewed_consumer(s: DispatcherSettings) -> api.ConsumerConfig:
    """The leader's consumer of renewed copies: as a band's, over every band's copies."""
    return api.ConsumerConfig(
        durable_name=names.RENEWED_CONSUMER,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=s.effective_ack_wait_s,
        max_deliver=s.max_deliver,
        max_ack_pending=_renewed_bound(s),
    )


def advisory_consumer(s: DispatcherSettings) -> api.ConsumerConfig:
    """The leader's consumer of the advisories: one is acked once its request is answered,
    and comes back after ``ack_wait`` to the next leader if the one serving it died (never
    dropped: serving an advisory again is idempotent)."""
    return api.ConsumerConfig(
        durable_name=names.ADVISORY_CONSUMER,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=s.effective_ack_wait_s,
        max_deliver=-1,
    )


async def ensure_streams(js: JetStreamContext, s: DispatcherSettings) -> None:
    """Create every stream and consumer, or update them to the current settings. What the
    broker cannot do yet (see :func:`setting_up`) is retried for ``stream_setup_timeout_s``."""
    configs = [band_stream(s, b) for b in s.bands] + [
        renewed_stream(s),
        result_stream(s),
        dead_letter_stream(s),
        advisory_stream(s),
    ]
    for cfg in configs:
        await setting_up(f"stream {cfg.name}", functools.partial(_put_stream, js, cfg), s)
    consumers = [(names.request_stream(b), band_consumer(s, b)) for b in s.bands]
    consumers.append((names.RENEWED_STREAM, renewed_consumer(s)))
    consumers.append((names.ADVISORY_STREAM, advisory_consumer(s)))
    for stream, cfg_c in consumers:
        await setting_up(
            f"consumer {cfg_c.durable_name}", functools.partial(js.add_consumer, stream, cfg_c), s
        )


async def _put_stream(js: JetStreamContext, cfg: api.StreamConfig) -> None:
    try:
        await js.add_stream(cfg)
    except BadRequestError as exc:
        if exc.err_code != names.JS_ERR_STREAM_NAME_IN_USE:
            raise
        await js.update_stream(cfg)


async def config_bucket(js: JetStreamContext, s: DispatcherSettings) -> KeyValue:
    """The run-time configuration bucket (created if missing; it keeps 10 revisions)."""
    config = api.KeyValueConfig(
        bucket=names.CONFIG_BUCKET,
        history=10,
        storage=api.StorageType.FILE,
        replicas=s.stream_replicas,
    )
    return await kv_bucket(js, config, s)


async def kv_bucket(
    js: JetStreamContext, config: api.KeyValueConfig, s: DispatcherSettings
) -> KeyValue:
    """The bucket of ``config``: opened, or created if missing (if another dispatcher
    creates it meanwhile, opened), through :func:`setting_up`."""
    bucket = config.bucket or ""

    async def open_or_create() -> KeyValue:
        try:
            return await js.key_value(bucket)
        except BucketNotFoundError:
            try:
                return await js.create_key_value(config)
            except BadRequestError as exc:
                if exc.err_code != names.JS_ERR_STREAM_NAME_IN_USE:
                    raise
                return await js.key_value(bucket)  # another dispatcher made it

    return await setting_up(f"bucket {bucket}", open_or_create, s)


async def setting_up(what: str, op: Callable[[], Awaitable[T]], s: DispatcherSettings) -> T:
    """Run one setup step, retried with a growing pause while the broker answers that it
    cannot yet (:func:`not_ready_yet`), for at most ``stream_setup_timeout_s``: a dispatcher
    started beside a new cluster waits for it rather than failing. Any other failure, or one
    that lasts, raises :class:`StreamSetupError`."""
    deadline = time.monotonic() + s.stream_setup_timeout_s
    pause_s = 0.1
    while True:
        try:
            return await op()
        except BROKER_ERRORS as exc:
            if not not_ready_yet(exc) or time.monotonic() + pause_s > deadline:
                raise StreamSetupError(f"cannot set up {what}: {exc}") from exc
            log.warning("cannot set up %s yet (%s); retrying in %.1f s", what, exc, pause_s)
        await asyncio.sleep(pause_s)
        pause_s = min(2 * pause_s, 2.0)


def not_ready_yet(exc: BaseException) -> bool:
    """Whether a broker's answer to a setup step says "not yet": JetStream unavailable (no
    meta leader yet), a peer to place replicas on offline (a node down, or one a new
    cluster's meta leader has not heard from yet), or no answer in time. Too few peers for
    ``stream_replicas`` at all is a configuration error, not retried."""
    if isinstance(exc, ServiceUnavailableError | nats.errors.NoRespondersError):
        return True
    if isinstance(exc, APIError):
        offline = "offline" in (exc.description or "")
        return exc.err_code == names.JS_ERR_NO_SUITABLE_PEERS and offline
    return isinstance(exc, nats.errors.TimeoutError | TimeoutError)

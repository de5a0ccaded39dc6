"""Operators' tools: draining workers, and the run-time admission configuration that
dispatchers watch.

``sluice drain`` and ``sluice undrain`` use :func:`drain_worker`: a
:class:`~sluice.schemas.models.DrainRequest` straight to the worker's agent, and (waiting)
the worker's own heartbeats until one says ``drained``.

``sluice quota set|clear|show`` use the others. The configuration is one JSON document
(:class:`~sluice.schemas.models.AdmissionOverrides`) under the key ``admission`` of the KV bucket
``SLUICE_CONFIG``; changes are compare-and-set, so two operators never lose each other's edits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from sluice.client.errors import DrainTimeout, InvalidRequest, ServiceUnavailable, UnknownWorker
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import (
    AdmissionOverrides,
    DispatcherStats,
    DrainReply,
    DrainRequest,
    Heartbeat,
    QuotaSpec,
)

DRAIN_ANSWER_TIMEOUT_S = 5.0
"""How long a worker has to answer a drain request."""
BANDS_ANSWER_TIMEOUT_S = 2.0
"""How long a dispatcher has to answer the stats query that tells its bands."""


async def drain_worker(
    nc: NATS,
    worker_id: str,
    *,
    drain: bool = True,
    exit: bool = False,
    wait_s: float | None = None,
) -> DrainReply:
    """Drain ``worker_id`` (``drain`` false: take work again; ``exit``: its agent stops once
    drained). The reply comes once the worker refuses new work. With ``wait_s``, wait up to
    that long for a heartbeat saying it is drained (then the reply's state is ``drained``);
    raises :class:`DrainTimeout` if it is not by then, :class:`UnknownWorker` if no such
    worker answers, :class:`ServiceUnavailable` if NATS fails."""
    if not worker_id:
        raise InvalidRequest("a worker id cannot be empty")
    drained = asyncio.Event()

    async def on_heartbeat(msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            if decode(msg.data, Heartbeat).state == "drained":
                drained.set()

    # Subscribed before asking: a worker with nothing to finish is drained at once.
    sub = await nc.subscribe(names.heartbeat_subject(worker_id), cb=on_heartbeat)
    try:
        reply = await _ask_worker(nc, worker_id, DrainRequest(drain=drain, exit=exit))
        if wait_s is None or not drain or reply.state == "drained":
            return reply
        try:
            await asyncio.wait_for(drained.wait(), wait_s)
        except TimeoutError as exc:
            raise DrainTimeout(worker_id, wait_s, reply.state) from exc
        return reply.model_copy(update={"state": "drained", "in_flight": []})
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


async def _ask_worker(nc: NATS, worker_id: str, request: DrainRequest) -> DrainReply:
    try:
        msg = await nc.request(
            names.drain_subject(worker_id), encode(request), timeout=DRAIN_ANSWER_TIMEOUT_S
        )
    except nats.errors.NoRespondersError as exc:
        raise UnknownWorker(worker_id) from exc
    except nats.errors.TimeoutError as exc:
        raise ServiceUnavailable(f"worker {worker_id!r} did not answer the drain") from exc
    except nats.errors.Error as exc:
        raise ServiceUnavailable(f"the drain of {worker_id!r} failed: {exc}") from exc
    try:
        return decode(msg.data, DrainReply)
    except DecodeError as exc:
        raise ServiceUnavailable(f"bad drain reply from {worker_id!r}: {exc}") from exc


async def admission_overrides(nc: NATS) -> tuple[AdmissionOverrides, int]:
    """The current run-time configuration and its revision (0: none is set)."""
    try:
        kv = await nc.jetstream().key_value(names.CONFIG_BUCKET)
        entry = await kv.get(names.ADMISSION_KEY)
    except (BucketNotFoundError, KeyNotFoundError):
        return AdmissionOverrides(), 0
    if entry.value is None:
        return AdmissionOverrides(), entry.revision or 0
    return AdmissionOverrides.model_validate_json(entry.value), entry.revision or 0


async def change_admission(
    nc: NATS, change: Callable[[AdmissionOverrides], AdmissionOverrides], attempts: int = 5
) -> AdmissionOverrides:
    """Read, change and write the run-time configuration, retrying if another writer got in
    between. Raises ServiceUnavailable if no dispatcher ever created the bucket."""
    try:
        kv = await nc.jetstream().key_value(names.CONFIG_BUCKET)
    except BucketNotFoundError as exc:
        raise ServiceUnavailable("no dispatcher has created the configuration bucket") from exc
    for _ in range(attempts):
        current, revision = await admission_overrides(nc)
        new = change(current)
        data = new.model_dump_json(exclude_defaults=True).encode()
        try:
            if revision == 0:
                await kv.create(names.ADMISSION_KEY, data)
            else:
                await kv.update(names.ADMISSION_KEY, data, last=revision)
            return new
        except KeyWrongLastSequenceError:
            continue
    raise ServiceUnavailable("the configuration kept changing under us; try again")


async def set_model_quota(nc: NATS, model: str, spec: QuotaSpec) -> AdmissionOverrides:
    """Give ``model`` this quota at run time (replacing its run-time quota, if any).

    Raises InvalidRequest if the quota names a band the dispatcher answering a stats query
    does not have: dispatchers would ignore the whole run-time configuration, every model's
    quota in it. With no dispatcher answering, the bands are not checked."""
    bands = await _dispatcher_bands(nc)
    unknown = sorted(set(spec.band_limits) - set(bands or spec.band_limits))
    if unknown:
        raise InvalidRequest(
            f"quota of {model} names bands the dispatchers do not have: {unknown} "
            f"(theirs: {', '.join(bands or ())})"
        )
    return await change_admission(
        nc, lambda o: o.model_copy(update={"quotas": {**o.quotas, model: spec}})
    )


async def _dispatcher_bands(nc: NATS) -> list[str] | None:
    """The bands of the dispatcher answering a stats query; None if none answers."""
    try:
        msg = await nc.request(names.STATS_SUBJECT, b"", timeout=BANDS_ANSWER_TIMEOUT_S)
        return [b.band for b in decode(msg.data, DispatcherStats).bands]
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, DecodeError):
        return None


async def clear_model_quota(nc: NATS, model: str) -> AdmissionOverrides:
    """Drop ``model``'s run-time quota: its configured quota applies again."""
    return await change_admission(
        nc,
        lambda o: o.model_copy(
            update={"quotas": {m: q for m, q in o.quotas.items() if m != model}}
        ),
    )

"""Operators' tools for renewed copies: what ``SLUICE_RENEWED`` holds, and moving it back.

A leader renews a request held through many leader changes by storing a copy of it in
:data:`~sluice.schemas.names.RENEWED_STREAM` (:mod:`sluice.dispatcher.runtime.renewals`); the
copy is then the request's only message. A dispatcher from a release before renewals never
reads that stream, so before going back to one, ``sluice renewed return`` moves every request
that lives as a copy back to its band's queue (:func:`return_renewed`), with every dispatcher
stopped. ``sluice renewed show`` counts the copies (:func:`renewed_copies`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.js.api import RawStreamMsg
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, NotFoundError

from sluice.client.errors import DispatcherLeading, QueueFull, ServiceUnavailable
from sluice.schemas import names
from sluice.schemas.codec import decode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import LeaderLease

_NATS_ERRORS = (nats.errors.Error, OSError)
Progress = Callable[[int, int], None]
"""Called with (copies read so far, copies stored when the pass began)."""


@dataclass(frozen=True)
class _Copy:
    seq: int
    generation: int
    request_id: str
    band: str
    model: str
    tenant: str
    data: bytes


@dataclass
class RenewedCopies:
    """What :data:`~sluice.schemas.names.RENEWED_STREAM` holds: ``requests`` that live as
    copies (their newest), by band, and ``copies`` in all (older ones wait to be acked)."""

    copies: int = 0
    requests: int = 0
    by_band: Counter[str] = field(default_factory=Counter)
    unreadable: list[int] = field(default_factory=list)
    """Sequences of messages that are no renewed copy (left where they are)."""


@dataclass
class Returned:
    """What :func:`return_renewed` did, by request."""

    returned: list[str] = field(default_factory=list)
    """Requests moved back to their band's queue (their copies deleted)."""
    ended: list[str] = field(default_factory=list)
    """Requests whose result is stored: they ran, and their copies were deleted."""
    left: list[str] = field(default_factory=list)
    """Requests whose band's queue (or its tenant's share) is full: their copies stay, for
    a later run."""
    copies_deleted: int = 0
    unreadable: list[int] = field(default_factory=list)
    """Sequences of messages that are no renewed copy (left where they are)."""


async def leading_dispatcher(nc: NATS) -> str | None:
    """The id of the dispatcher that leads now, or None if none does (its key is gone: a
    clean stop deletes it, a crashed leader's expires after a lease)."""
    js = nc.jetstream()
    try:
        kv = await js.key_value(names.LEADER_BUCKET)
        entry = await kv.get(names.LEADER_KEY)
    except (BucketNotFoundError, KeyNotFoundError):
        return None
    except _NATS_ERRORS as exc:
        raise ServiceUnavailable(f"cannot read the leader key: {exc}") from exc
    try:
        return decode(entry.value or b"", LeaderLease).dispatcher_id
    except DecodeError:
        return "(unreadable leader key)"


async def _none_leads(nc: NATS) -> None:
    leader = await leading_dispatcher(nc)
    if leader is not None:
        raise DispatcherLeading(leader)


async def renewed_copies(nc: NATS, progress: Progress | None = None) -> RenewedCopies:
    """Count the stored renewed copies, reading each once (whatever runs meanwhile)."""
    out = RenewedCopies()
    for request_copies in (await _scan(nc.jetstream(), out.unreadable, progress)).values():
        newest = request_copies[-1]
        out.copies += len(request_copies)
        out.requests += 1
        out.by_band[newest.band] += 1
    return out


async def return_renewed(nc: NATS, progress: Progress | None = None) -> Returned:
    """Move every request that lives as a renewed copy back to its band's queue, for a
    rollback to a release without renewals; raises :class:`DispatcherLeading` unless every
    dispatcher is stopped (a leader holds the copies it pulled, and would hold the moved
    request twice).

    For each request, its newest copy is published to its band's subject under the message id
    :func:`~sluice.schemas.names.returned_msg_id` (never its producer's: that may still be in
    the broker's duplicate window, which would drop the message), then all its copies are
    deleted; a request whose result is stored already ran, and its copies are only deleted.
    A request whose band's queue is full stays as a copy (:attr:`Returned.left`): run this
    again once the queue has room. It arrives as a new message, behind the requests queued
    before it. Running this again after an interruption is safe: a message published twice
    under one id is stored once."""
    await _none_leads(nc)
    js = nc.jetstream()
    out = Returned()
    for rid, request_copies in (await _scan(js, out.unreadable, progress)).items():
        # Again before each request: a standby left running takes the lead within a lease,
        # pulls copies and holds them (what is done stays done: a run again is safe).
        await _none_leads(nc)
        newest = request_copies[-1]
        if await _result_stored(js, newest.tenant, rid):
            out.ended.append(rid)
        else:
            try:
                await _publish(js, newest)
            except QueueFull:
                out.left.append(rid)
                continue
            out.returned.append(rid)
        for c in request_copies:
            out.copies_deleted += await _delete(js, c.seq)
    return out


async def _scan(
    js: JetStreamContext, unreadable: list[int], progress: Progress | None
) -> dict[str, list[_Copy]]:
    """Every stored copy, by request id, oldest first by (generation, sequence)."""
    try:
        info = await js.stream_info(names.RENEWED_STREAM)
    except NotFoundError:
        return {}  # no dispatcher with renewals ever ran here
    except _NATS_ERRORS as exc:
        raise ServiceUnavailable(f"cannot read {names.RENEWED_STREAM}: {exc}") from exc
    total, last = int(info.state.messages), int(info.state.last_seq)
    if total == 0:
        return {}
    seq, read = max(1, int(info.state.first_seq)), 0  # (an unused stream's first is 0)
    found: dict[str, list[_Copy]] = {}
    while seq <= last:
        try:
            raw = await js.get_msg(names.RENEWED_STREAM, seq=seq, next=True)
        except NotFoundError:
            break
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot read {names.RENEWED_STREAM}: {exc}") from exc
        assert raw.seq is not None
        seq = raw.seq + 1
        if raw.seq > last:
            break  # stored after the pass began (a dispatcher runs): not this pass's
        read += 1
        copy = _parse(raw)
        if copy is None:
            unreadable.append(raw.seq)
        else:
            found.setdefault(copy.request_id, []).append(copy)
        if progress is not None:
            progress(read, total)
    for request_copies in found.values():
        request_copies.sort(key=lambda c: (c.generation, c.seq))
    return found


def _parse(raw: RawStreamMsg) -> _Copy | None:
    headers = raw.headers or {}
    generation = headers.get(names.RENEWAL_HEADER, "")
    msg_id = headers.get(names.MSG_ID_HEADER, "")
    rid = names.renewed_request_id(msg_id)
    if not (generation.isascii() and generation.isdigit()) or not rid or raw.subject is None:
        return None
    try:
        band, model, tenant = names.parse_renewed_subject(raw.subject)
    except ValueError:
        return None
    assert raw.seq is not None
    return _Copy(raw.seq, int(generation), rid, band, model, tenant, raw.data or b"")


async def _result_stored(js: JetStreamContext, tenant: str, request_id: str) -> bool:
    try:
        await js.get_last_msg(names.RESULT_STREAM, names.result_subject(tenant, request_id))
    except NotFoundError:
        return False
    except _NATS_ERRORS as exc:
        raise ServiceUnavailable(f"cannot look up the result of {request_id}: {exc}") from exc
    return True


async def _publish(js: JetStreamContext, c: _Copy) -> None:
    subject = names.request_subject(c.band, c.model, c.tenant)
    msg_id = names.returned_msg_id(c.request_id, c.generation)
    try:
        await js.publish(subject, c.data, headers={names.MSG_ID_HEADER: msg_id})
    except APIError as exc:
        if exc.err_code == names.JS_ERR_MAX_MSGS:
            raise QueueFull(c.band, c.model, 0.0, exc.description or "") from exc
        raise ServiceUnavailable(f"cannot return {c.request_id} to {subject}: {exc}") from exc
    except _NATS_ERRORS as exc:
        raise ServiceUnavailable(f"cannot return {c.request_id} to {subject}: {exc}") from exc


async def _delete(js: JetStreamContext, seq: int) -> int:
    try:
        return int(await js.delete_msg(names.RENEWED_STREAM, seq))
    except NotFoundError:
        return 0  # acked meanwhile, or deleted by an earlier run
    except _NATS_ERRORS as exc:
        raise ServiceUnavailable(f"cannot delete copy #{seq}: {exc}") from exc

"""Operators' tools for renewed copies: what ``SLUICE_RENEWED`` holds, and moving it back.

A leader renews a request held through many leader changes by storing a copy of it in
:data:`~sluice.schemas.names.RENEWED_STREAM` (:mod:`sluice.dispatcher.runtime.renewals`); once
a leader holds the copy, the message it was made from is acked and the copy is the request's
only message. A dispatcher from a release before renewals never reads that stream, so before
going back to one, ``sluice renewed return`` moves every request that has a copy back to its
band's queue (:func:`return_renewed`), with every dispatcher stopped. ``sluice renewed show``
counts the copies (:func:`renewed_copies`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import RawStreamMsg
from nats.js.client import JetStreamContext
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from sluice.client.client import unavailable_on_broker_errors
from sluice.client.errors import DispatcherLeading
from sluice.common.aio import stop_if_cancelled
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import Heartbeat, LeaderLease, SubmitRequest

_NATS_ERRORS = (nats.errors.Error, OSError)
RUNNING_LISTEN_S = 2.5
"""How long :func:`return_renewed` hears the workers' heartbeats for the requests they run
(two and a half of the agents' default heartbeat: with a longer ``heartbeat_s``, drain the
workers first)."""
RETURN_LEADER = "sluice-renewed-return"
"""Who holds the leader key while :func:`return_renewed` runs (dispatchers stand by)."""
Progress = Callable[[str, int, int], None]
"""Called with what is being done (``"reading copies"``, ``"moving requests"``), how many
so far, and how many in all."""


@dataclass(frozen=True)
class _Copy:
    seq: int
    generation: int
    request_id: str
    band: str
    model: str
    tenant: str
    source: tuple[str, int] | None
    """The message it was made from (stream, sequence), if it says."""


@dataclass
class RenewedCopies:
    """What :data:`~sluice.schemas.names.RENEWED_STREAM` holds: ``requests`` with copies (by
    their newest copy's band), and ``copies`` in all (older ones wait to be acked)."""

    stream_found: bool = False
    """Whether the broker has the stream at all (no: no dispatcher with renewals ran there;
    the wrong broker?)."""
    copies: int = 0
    requests: int = 0
    by_band: Counter[str] = field(default_factory=Counter)
    bands_without_stream: list[str] = field(default_factory=list)
    """Bands of copies that no stream of this broker takes: they cannot be moved back."""
    unreadable: list[int] = field(default_factory=list)
    """Sequences of messages that are no renewed copy (left where they are)."""


@dataclass(frozen=True)
class Left:
    """A request :func:`return_renewed` left as it is, and why."""

    request_id: str
    band: str
    tenant: str
    reason: str


@dataclass
class Returned:
    """What :func:`return_renewed` did, by request (as far as it got, if it failed)."""

    stream_found: bool = False
    returned: list[str] = field(default_factory=list)
    """Requests moved back to their band's queue (their copies deleted)."""
    ended: list[str] = field(default_factory=list)
    """Requests whose result is stored: they ran, and their copies were deleted."""
    left: list[Left] = field(default_factory=list)
    """Requests left as they are: their band's queue (or its tenant's share) is full, or no
    stream takes their band; run this again once that changed."""
    copies_deleted: int = 0
    originals_deleted: int = 0
    """Messages the copies were made from, still stored (their leader held them when it
    renewed them, and no leader held a copy since): deleted with the copies."""
    unreadable: list[int] = field(default_factory=list)
    """Sequences of messages that are no renewed copy (left where they are)."""


async def renewed_copies(nc: NATS, progress: Progress | None = None) -> RenewedCopies:
    """Count the stored renewed copies, reading each once (whatever runs meanwhile)."""
    js = nc.jetstream()
    out = RenewedCopies()
    found, out.stream_found = await _scan(js, out.unreadable, progress)
    for request_copies in found.values():
        out.copies += len(request_copies)
        out.requests += 1
        out.by_band[request_copies[-1].band] += 1
    out.bands_without_stream = sorted(await _bands_without_stream(js, set(out.by_band)))
    return out


async def return_renewed(
    nc: NATS,
    progress: Progress | None = None,
    done: Returned | None = None,
    listen_s: float = RUNNING_LISTEN_S,
) -> Returned:
    """Move every request that has a renewed copy back to its band's queue, for a rollback
    to a release without renewals; raises :class:`DispatcherLeading` unless every dispatcher
    is stopped (a leader holds the copies it pulled). Meanwhile it holds the leader key, so
    that a dispatcher started during the run stands by until it ends. ``done`` (if given) is
    filled as the run goes: what was done before an error. The workers' heartbeats are heard
    for ``listen_s`` first: a request one of them still runs is left (moved, it could run
    again once it finished).

    For each request, its newest copy is published to its band's subject under the message id
    :func:`~sluice.schemas.names.returned_msg_id` (never its producer's: that may still be in
    the broker's duplicate window, which would drop the message); then the messages its copies
    were made from (a band message a leader held and renewed, whose copy no leader held since)
    and all its copies are deleted. A request whose result is stored already ran: only those
    are deleted. A request whose band's queue is full, or whose band no stream takes, stays
    as it is (:attr:`Returned.left`). A returned request arrives as a new message, behind the
    requests queued before it. Requests move one at a time (published, then their copies
    deleted): run again after an interruption within the broker's duplicate window
    (``duplicate_window_s``, 120 s by default), the one request it was moving is stored once;
    later, that one is queued twice."""
    js = nc.jetstream()
    out = Returned() if done is None else done
    async with _HeldLead(nc) as lead:
        running = await _running(nc, listen_s, progress)
        found, out.stream_found = await _scan(js, out.unreadable, progress)
        for i, (rid, request_copies) in enumerate(found.items()):
            if progress is not None:
                progress("moving requests", i, len(found))
            stop_if_cancelled()  # (nats-py swallows a Ctrl-C in its calls)
            await lead.check()
            newest = request_copies[-1]
            if rid in running:
                reason = f"running on worker {running[rid]}: run this again once it finished"
                out.left.append(Left(rid, newest.band, newest.tenant, reason))
                continue
            if await _result_stored(js, newest.tenant, rid):
                out.ended.append(rid)
            else:
                refused = await _publish(js, newest)
                if refused is not None:
                    out.left.append(Left(rid, newest.band, newest.tenant, refused))
                    continue
                out.returned.append(rid)
            for c in request_copies:
                if c.source is not None and c.source[0] != names.RENEWED_STREAM:
                    out.originals_deleted += await _delete_original(js, c.source, rid)
            for c in request_copies:
                out.copies_deleted += await _delete(js, names.RENEWED_STREAM, c.seq)
        if progress is not None:
            progress("moving requests", len(found), len(found))
    return out


async def leading_dispatcher(nc: NATS) -> str | None:
    """The id of the dispatcher that leads now, or None if none does (its key is gone: a
    clean stop deletes it, a crashed leader's expires after a lease)."""
    with unavailable_on_broker_errors("read the leader key"):
        try:
            kv = await nc.jetstream().key_value(names.LEADER_BUCKET)
            entry = await kv.get(names.LEADER_KEY)
        except (BucketNotFoundError, KeyNotFoundError):
            return None
    return _holder(entry.value)


async def _refusal(nc: NATS) -> DispatcherLeading:
    """Who holds the leader key, how long ago it was renewed and when it runs out if its
    holder is gone."""
    holder = await leading_dispatcher(nc) or "(one that let it go just now)"
    ago_s = await _renewed_ago_s(nc)
    renewed = "" if ago_s is None else f" (its key renewed {ago_s:.1f} s ago)"
    if holder.startswith(RETURN_LEADER):
        return DispatcherLeading(
            holder,
            "another `sluice renewed return` holds the leader key: wait for it to end"
            f"{renewed}; the key of a run that was killed is taken over {_STALE_AFTER_S:g} s "
            "after its last renewal",
        )
    ttl_s = 0.0
    with contextlib.suppress(*_NATS_ERRORS):
        info = await nc.jetstream().stream_info(names.kv_stream(names.LEADER_BUCKET))
        ttl_s = float(info.config.max_age or 0.0)
    expiry = f"; a key whose holder crashed runs out {ttl_s:g} s after its last renewal"
    return DispatcherLeading(
        holder,
        f"dispatcher {holder} leads: stop every dispatcher first{renewed}{expiry if ttl_s else ''}",
    )


class _HeldLead:
    """The leader key, held (created, renewed by compare-and-set every
    :data:`_RENEW_EVERY_S`, deleted at the end) while the copies move: a dispatcher started
    meanwhile sees it renewed and stands by, whatever lease it was given. No bucket: no
    dispatcher ran here yet, nothing to hold."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._kv: KeyValue | None = None
        self._revision = 0
        self._renewed_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._lost = False
        me = f"{RETURN_LEADER}-{os.getpid()}-{secrets.token_hex(3)}"
        self._value = encode(LeaderLease(dispatcher_id=me))

    async def __aenter__(self) -> _HeldLead:
        with unavailable_on_broker_errors("take the leader key"):
            try:
                self._kv = kv = await self._nc.jetstream().key_value(names.LEADER_BUCKET)
            except BucketNotFoundError:
                return self
            try:
                self._revision = await kv.create(names.LEADER_KEY, self._value)
            except KeyWrongLastSequenceError:
                self._revision = await self._take_stale(kv)
        self._renewed_s = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._renew_loop())
        return self

    async def _take_stale(self, kv: KeyValue) -> int:
        """Take the key over from a run of this command that stopped renewing it (killed),
        else refuse: a dispatcher leads, or another run moves copies now."""
        entry = await kv.get(names.LEADER_KEY)
        holder = _holder(entry.value)
        ago_s = await _renewed_ago_s(self._nc)
        if holder.startswith(RETURN_LEADER) and ago_s is not None and ago_s > _STALE_AFTER_S:
            try:
                return await kv.update(names.LEADER_KEY, self._value, last=entry.revision)
            except KeyWrongLastSequenceError:
                pass  # another run took it first
        raise await _refusal(self._nc)

    async def _renew(self) -> None:
        assert self._kv is not None
        try:
            self._revision = await self._kv.update(
                names.LEADER_KEY, self._value, last=self._revision
            )
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            # A renewal applied whose answer was lost leaves the key ours at a later
            # revision: look before giving up.
            entry = await self._kv.get(names.LEADER_KEY)
            if entry.value != self._value or entry.revision is None:
                self._lost = True  # it ran out (this process stalled), and another took it
                return
            self._revision = entry.revision
        self._renewed_s = time.monotonic()

    async def _renew_loop(self) -> None:
        while not self._lost:
            await asyncio.sleep(_RENEW_EVERY_S)
            with contextlib.suppress(*_NATS_ERRORS):  # (the broker away: tried again)
                await self._renew()

    async def check(self) -> None:
        """Before each request: the key is still ours, renewed moments ago (renewed now if
        not), else :class:`DispatcherLeading`."""
        if self._kv is not None and time.monotonic() - self._renewed_s > _RENEW_EVERY_S:
            with unavailable_on_broker_errors("renew the leader key"):
                await self._renew()
        if self._lost:
            raise await _refusal(self._nc)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._kv is not None and not self._lost:
            # Deleted, so that a standby takes over at once (as it stands: a renewal cut
            # short may have moved it on). If this fails, a standby waits out its lease.
            with contextlib.suppress(*_NATS_ERRORS):
                entry = await self._kv.get(names.LEADER_KEY)
                if entry.value == self._value:
                    await self._kv.delete(names.LEADER_KEY, last=entry.revision)


_RENEW_EVERY_S = 0.2
"""How often :class:`_HeldLead` renews the key: well within any dispatcher's lease, which is
what a standby waits for an unrenewed key (not the bucket's time to live, which the first
dispatcher set and a later one does not change)."""
_STALE_AFTER_S = 5.0
"""A key of this command unrenewed this long was left by a run that was killed."""


def _holder(value: bytes | None) -> str:
    try:
        return decode(value or b"", LeaderLease).dispatcher_id
    except DecodeError:
        return "(unreadable leader key)"


async def _renewed_ago_s(nc: NATS) -> float | None:
    """How long ago the leader key was last written, if the broker says."""
    js = nc.jetstream()
    with contextlib.suppress(*_NATS_ERRORS):
        raw = await js.get_last_msg(
            names.kv_stream(names.LEADER_BUCKET), f"$KV.{names.LEADER_BUCKET}.{names.LEADER_KEY}"
        )
        if raw.time is not None:
            return max(0.0, time.time() - raw.time.timestamp())
    return None


async def _running(nc: NATS, listen_s: float, progress: Progress | None) -> dict[str, str]:
    """Request id -> the worker that runs it, from the heartbeats heard for ``listen_s``."""
    running: dict[str, str] = {}

    async def heard(msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            beat = decode(msg.data, Heartbeat)
            running.update(dict.fromkeys(beat.in_flight, beat.worker_id))

    if listen_s <= 0:
        return running
    if progress is not None:
        progress("hearing the workers", 0, 1)
    with unavailable_on_broker_errors("hear the workers' heartbeats"):
        sub = await nc.subscribe(names.HEARTBEAT_SUBJECTS, cb=heard)
    try:
        await asyncio.sleep(listen_s)
    finally:
        with contextlib.suppress(*_NATS_ERRORS):
            await sub.unsubscribe()
    return running


async def _scan(
    js: JetStreamContext, unreadable: list[int], progress: Progress | None
) -> tuple[dict[str, list[_Copy]], bool]:
    """Every stored copy, by request id, oldest first by (generation, sequence); and whether
    the stream exists."""
    with unavailable_on_broker_errors(f"read {names.RENEWED_STREAM}"):
        try:
            info = await js.stream_info(names.RENEWED_STREAM)
        except NotFoundError:
            return {}, False  # no dispatcher with renewals ever ran here
    total, last = int(info.state.messages), int(info.state.last_seq)
    found: dict[str, list[_Copy]] = {}
    if total == 0:
        return found, True
    seq, read = max(1, int(info.state.first_seq)), 0  # (an unused stream's first is 0)
    while seq <= last:
        with unavailable_on_broker_errors(f"read {names.RENEWED_STREAM}"):
            try:
                # (With a subject, "next" is the next stored at or after seq: copies are acked
                # out of order, and without one a gap would read as the end.)
                raw = await js.get_msg(
                    names.RENEWED_STREAM, seq=seq, subject=names.RENEWED_SUBJECTS, next=True
                )
            except NotFoundError:
                break
        stop_if_cancelled()
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
            progress("reading copies", read, total)
    for request_copies in found.values():
        request_copies.sort(key=lambda c: (c.generation, c.seq))
    return found, True


def _parse(raw: RawStreamMsg) -> _Copy | None:
    """A stored message as a renewed copy, or None if it is none (its headers, its subject
    and its body must agree: a dispatcher would refuse a body that does not)."""
    headers = raw.headers or {}
    generation = headers.get(names.RENEWAL_HEADER, "")
    rid = names.renewed_request_id(headers.get(names.MSG_ID_HEADER, ""))
    if not (generation.isascii() and generation.isdigit()) or not rid or raw.subject is None:
        return None
    try:
        band, model, tenant = names.parse_renewed_subject(raw.subject)
        body = decode(raw.data or b"", SubmitRequest)
    except (ValueError, DecodeError):
        return None
    if (body.request_id, body.band, body.model, body.tenant) != (rid, band, model, tenant):
        return None
    assert raw.seq is not None
    source = names.parse_message_ref(headers.get(names.RENEWED_FROM_HEADER, ""))
    # (No body kept: a stream at its bound holds thousands; the newest is read again to move.)
    return _Copy(raw.seq, int(generation), rid, band, model, tenant, source)


async def _bands_without_stream(js: JetStreamContext, bands: set[str]) -> set[str]:
    missing = set()
    for band in bands:
        with unavailable_on_broker_errors(f"look up band {band!r}'s stream"):
            try:
                await js.stream_info(names.request_stream(band))
            except NotFoundError:
                missing.add(band)
    return missing


async def _result_stored(js: JetStreamContext, tenant: str, request_id: str) -> bool:
    with unavailable_on_broker_errors(f"look up the result of {request_id}"):
        try:
            await js.get_last_msg(names.RESULT_STREAM, names.result_subject(tenant, request_id))
        except NotFoundError:
            return False
    return True


async def _publish(js: JetStreamContext, c: _Copy) -> str | None:
    """Publish the request (its copy's body) to its band; None once stored (now, or by an
    earlier run: the same copy's id), else why it was not."""
    with unavailable_on_broker_errors(f"read copy #{c.seq}"):
        try:
            raw = await js.get_msg(names.RENEWED_STREAM, seq=c.seq)
        except NotFoundError:
            return "its copy was acked meanwhile (a dispatcher runs?)"
    subject = names.request_subject(c.band, c.model, c.tenant)
    msg_id = names.returned_msg_id(c.request_id, c.seq)
    with unavailable_on_broker_errors(f"return {c.request_id} to {subject}"):
        try:
            await js.publish(subject, raw.data or b"", headers={names.MSG_ID_HEADER: msg_id})
        except APIError as exc:
            if exc.err_code != names.JS_ERR_MAX_MSGS:
                raise
            if "per subject" in (exc.description or ""):
                return f"tenant {c.tenant!r}'s share of band {c.band!r}'s queue is full"
            return f"band {c.band!r}'s queue is full"
        except NoStreamResponseError:
            return f"no stream takes band {c.band!r} on this broker"
    return None


async def _delete_original(js: JetStreamContext, source: tuple[str, int], rid: str) -> int:
    """Delete the message a copy was made from if it is still stored (and is that request's):
    1 if deleted."""
    stream, seq = source
    with unavailable_on_broker_errors(f"read {stream} #{seq}"):
        try:
            raw = await js.get_msg(stream, seq=seq)
        except NotFoundError:
            return 0  # acked once a leader held the copy: the usual case
    try:
        if decode(raw.data or b"", SubmitRequest).request_id != rid:
            return 0
    except DecodeError:
        return 0
    return await _delete(js, stream, seq)


async def _delete(js: JetStreamContext, stream: str, seq: int) -> int:
    with unavailable_on_broker_errors(f"delete {stream} #{seq}"):
        try:
            return int(await js.delete_msg(stream, seq))
        except NotFoundError:
            return 0  # acked meanwhile, or deleted by an earlier run

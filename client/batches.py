"""Offline batches: an input file of requests run in the ``batch`` band, with a status that
survives every process, and output and error files in OpenAI's Batch format.

- **Files** live in a JetStream object store (``names.FILE_STORE``), their records in the batch
  bucket (``names.BATCH_BUCKET``, a JetStream KV bucket), each owned by a tenant: another
  tenant's file or batch is not found.
- **A batch** is a :class:`~sluice.schemas.models.BatchRecord` in that bucket, updated with
  compare-and-set, so several submitters, gateways and command lines can share it.
- **Submitting** (:meth:`Batches.submit`) publishes the input's valid lines in order, in
  chunks, and records after each chunk how far it got. A submitter that dies is run again
  (``sluice batch submit`` the same file, or :meth:`Batches.submit` with the batch id): it
  resumes at the last recorded chunk, and for that chunk skips lines whose result exists; the
  rest are deduplicated by their request ids (the broker's duplicate window, the dispatcher's
  held requests). Nothing is submitted twice, nothing is skipped.
- **Progress** (:meth:`Batches.refresh`, run by every status read) counts the batch's results
  (the last result of each of its request ids), and moves it on: to ``finalizing`` then
  ``completed`` when every line has its result; to ``expired`` when its completion window has
  passed (its unfinished requests are cancelled); from ``cancelling`` to ``cancelled`` once
  every submitted request has answered its cancel (or after ``CANCEL_GRACE_S``). Finalizing
  writes the output and error files (:func:`sluice.client.batchfile.output_lines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from pydantic import ValidationError

from sluice.client.batchfile import BatchLine, LineError, output_lines, parse_lines
from sluice.client.client import Client
from sluice.client.errors import (
    BatchNotFound,
    BatchStateError,
    FileNotFound,
    InvalidRequest,
    QueueFull,
    ServiceUnavailable,
)
from sluice.client.oaiformat import ENDPOINT_KINDS
from sluice.common.chattemplate import ChatRender, ChatTemplate, chat_prompt
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError
from sluice.schemas.models import (
    TERMINAL_BATCH_STATES,
    BatchCounts,
    BatchRecord,
    ChatTemplateSpec,
    FileRecord,
    Rejection,
    RejectReason,
    Result,
)

DEFAULT_WINDOW_S = 24 * 3600.0
CHUNK = 64
"""Lines published at once, and between two progress records."""
FINALIZE_MARGIN_S = 3600.0
"""Results must be kept this much longer than a batch's window (to write its output)."""
CANCEL_GRACE_S = 30.0
"""A cancelled batch waits this long for its running requests' cancelled results."""
DEFAULT_MAX_PAYLOAD = 1 << 20
"""nats-server's default ``max_payload`` (for a connection that does not say)."""
_REFUSAL_CHARS = 120
"""What a refused line's record keeps of its error."""
MAX_REFUSED_LINES = 1_000
"""Lines refused before publishing (too large for the broker) a batch records one by one;
past them it fails as a whole, so that its record stays far below any ``max_payload``."""
MAX_FILE_BYTES = 200 * 1024 * 1024
_CHUNK_BYTES = 128 * 1024
"""A stored file's chunks (nats-py's default), when the broker's ``max_payload`` allows."""
_CHUNK_HEADROOM_BYTES = 1024
"""Left under ``max_payload`` for a chunk's subject and headers."""
_PARSED_KEPT = 16
"""Parsed batch inputs a :class:`Batches` keeps (its most recently used)."""
_NATS_ERRORS = (nats.errors.Error, OSError)
_SUBJECTS_AT_ONCE = 100_000
"""The most subjects the server lists in one stream info (it pages past that)."""

Progress = Callable[[int, int], None]
"""Called with (lines submitted, valid lines) as a submitter goes."""


def _now() -> int:
    return int(time.time())


def _jsonl(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n" if lines else b""


def _advance(submitted: int) -> Callable[[BatchRecord], dict[str, Any] | None]:
    """The change that records ``submitted`` lines (never backwards)."""
    return lambda r: {"submitted": submitted} if r.submitted < submitted else None


def batch_id_for(tenant: str, data: bytes) -> str:
    """The id ``sluice batch submit`` gives a file by default: the same file of the same
    tenant is the same batch, so running the command again resumes it."""
    digest = hashlib.sha256(tenant.encode() + b"\x00" + data).hexdigest()[:24]
    return f"batch_{digest}"


class Batches:
    """Files and batches of one tenant (the client's unless given)."""

    def __init__(
        self, client: Client, *, tenant: str | None = None, replicas: int | None = None
    ) -> None:
        self.client = client
        self.tenant = tenant or client.tenant
        self.replicas = replicas
        """Replicas of the batch stores when this creates them; None (the default): as many
        as the dispatchers' result stream has (their ``stream_replicas``), 1 without one."""
        self._kv: KeyValue | None = None
        self._obj: ObjectStore | None = None
        self._parsed: OrderedDict[tuple[str, str], tuple[list[BatchLine], list[LineError]]] = (
            OrderedDict()
        )

    # ---------------------------------------------------------------------- stores

    async def _stores(self) -> tuple[KeyValue, ObjectStore]:
        if self._kv is None or self._obj is None:
            js = self.client.nc.jetstream()
            try:
                try:
                    self._kv = await js.key_value(names.BATCH_BUCKET)
                except nats.js.errors.BucketNotFoundError:
                    self._kv = await js.create_key_value(
                        api.KeyValueConfig(
                            bucket=names.BATCH_BUCKET, history=1, replicas=await self._replicas()
                        )
                    )
                try:
                    self._obj = await js.object_store(names.FILE_STORE)
                except nats.js.errors.BucketNotFoundError:
                    self._obj = await js.create_object_store(
                        names.FILE_STORE,
                        config=api.ObjectStoreConfig(replicas=await self._replicas()),
                    )
            except _NATS_ERRORS as exc:
                raise ServiceUnavailable(f"cannot open the batch stores: {exc}") from exc
        return self._kv, self._obj

    async def _replicas(self) -> int:
        """The replicas of a batch store this creates: ``replicas``, else the result
        stream's (so one setting, the dispatchers' ``stream_replicas``, decides)."""
        if self.replicas is not None:
            return self.replicas
        try:
            info = await self.client.nc.jetstream().stream_info(names.RESULT_STREAM)
        except nats.js.errors.NotFoundError:
            return 1
        return info.config.num_replicas or 1

    async def _read(self, key: str) -> tuple[bytes, int] | None:
        kv, _ = await self._stores()
        try:
            entry = await kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.InvalidKeyError):
            # An id no record can have (its key escapes a byte with "~", which KV keys do not
            # allow; the ids made here never need it): not found, as any unknown id.
            return None
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot read {key}: {exc}") from exc
        if entry.value is None or entry.revision is None:
            return None
        return entry.value, entry.revision

    # ---------------------------------------------------------------------- files

    async def upload(self, data: bytes, filename: str, purpose: str = "batch") -> FileRecord:
        """Store a file; its record names it by a new id."""
        if len(data) > MAX_FILE_BYTES:
            raise InvalidRequest(f"a file has at most {MAX_FILE_BYTES} bytes, not {len(data)}")
        record = FileRecord(
            id=f"file-{uuid.uuid4().hex[:24]}",
            tenant=self.tenant,
            filename=filename or "file.jsonl",
            purpose=purpose,
            bytes=len(data),
            created_at=_now(),
        )
        kv, obj = await self._stores()
        try:
            await obj.put(record.id, data, meta=self._chunked(record.id))
            await kv.put(names.file_key(record.id), encode(record))
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot store {filename}: {exc}") from exc
        return record

    async def file(self, file_id: str) -> FileRecord:
        """A file's record (``FileNotFound`` if it is not this tenant's)."""
        try:
            found = await self._read(names.file_key(file_id))
        except ValueError as exc:  # not a valid key
            raise FileNotFound(file_id) from exc
        if found is None:
            raise FileNotFound(file_id)
        try:
            record = decode(found[0], FileRecord)
        except DecodeError as exc:
            raise ServiceUnavailable(f"the record of file {file_id} is corrupt: {exc}") from exc
        if record.tenant != self.tenant:
            raise FileNotFound(file_id)
        return record

    async def content(self, file_id: str) -> bytes:
        """A file's bytes."""
        await self.file(file_id)
        _, obj = await self._stores()
        try:
            got = await obj.get(file_id)
        except nats.js.errors.ObjectNotFoundError as exc:
            raise FileNotFound(file_id) from exc
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot read file {file_id}: {exc}") from exc
        return got.data or b""

    def _chunked(self, name: str) -> api.ObjectMeta:
        """The object's meta with chunks the broker takes: nats-py's 128 KiB default is more
        than a smaller ``max_payload`` (every upload failed under one of 64 KiB)."""
        limit = self.client.nc.max_payload or _CHUNK_BYTES
        size = max(1024, min(_CHUNK_BYTES, limit - _CHUNK_HEADROOM_BYTES))
        return api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=size))

    # ---------------------------------------------------------------------- batches

    async def create(
        self,
        input_file_id: str,
        *,
        endpoint: str = "/v1/chat/completions",
        window_s: float = DEFAULT_WINDOW_S,
        batch_id: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> BatchRecord:
        """A new batch of a stored input file (``validating``, counted; nothing submitted
        yet). An existing batch of that id is returned as it is."""
        if endpoint not in ENDPOINT_KINDS:
            raise InvalidRequest(
                f"endpoint must be one of {sorted(ENDPOINT_KINDS)}, not {endpoint!r}"
            )
        await self._check_window(window_s)
        data = await self.content(input_file_id)
        bid = batch_id or f"batch_{uuid.uuid4().hex[:24]}"
        existing = await self._get(bid)
        if existing is not None:
            return existing[0]
        template = self.client.chat_template
        lines, errors = parse_lines(data, bid, self._render(template))
        now = _now()
        try:
            record = BatchRecord(
                id=bid,
                tenant=self.tenant,
                status="validating",
                endpoint=endpoint,
                input_file_id=input_file_id,
                completion_window_s=window_s,
                created_at=now,
                expires_at=now + int(window_s),
                counts=BatchCounts(total=len(lines), invalid=len(errors)),
                chat_template=None if template is None else ChatTemplateSpec(**template.spec()),
                metadata=metadata or {},
            )
        except ValidationError as exc:
            raise InvalidRequest(f"invalid batch: {exc}") from exc
        kv, _ = await self._stores()
        try:
            await kv.create(names.batch_key(bid), encode(record))
        except nats.js.errors.KeyWrongLastSequenceError:
            found = await self._get(bid)  # another process created it first
            if found is None:
                raise
            return found[0]
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot store batch {bid}: {exc}") from exc
        return record

    async def _check_window(self, window_s: float) -> None:
        """Results must outlive the window until the output is written: refuse a window the
        results stream does not keep its results for."""
        try:
            info = await self.client.nc.jetstream().stream_info(names.RESULT_STREAM)
        except nats.js.errors.NotFoundError as exc:
            raise ServiceUnavailable("no dispatcher has created the results stream") from exc
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot read the results stream: {exc}") from exc
        kept_s = info.config.max_age or 0.0
        if kept_s and window_s + FINALIZE_MARGIN_S > kept_s:
            raise InvalidRequest(
                f"a completion window of {window_s:g} s needs results kept "
                f"{window_s + FINALIZE_MARGIN_S:g} s, and they are kept {kept_s:g} s "
                "(the dispatchers' result_ttl_s)"
            )

    async def _lines(self, record: BatchRecord) -> tuple[list[BatchLine], list[LineError]]:
        """A batch's parsed input. Files never change once stored, so the parse of the last
        few batches is kept: a sweep or a poll does not fetch and parse the file again."""
        key = (record.input_file_id, record.id)
        parsed = self._parsed.get(key)
        if parsed is None:
            # Rendered with the batch's own template, whichever process reads it.
            spec = record.chat_template
            template = None if spec is None else ChatTemplate.from_spec(spec.model_dump())
            parsed = parse_lines(
                await self.content(record.input_file_id), record.id, self._render(template)
            )
            self._parsed[key] = parsed
            if len(self._parsed) > _PARSED_KEPT:
                self._parsed.popitem(last=False)
        else:
            self._parsed.move_to_end(key)
        return parsed

    def _render(self, template: ChatTemplate | None) -> ChatRender:
        tokenizer = self.client.tokenizer
        return lambda messages, options: chat_prompt(messages, options, template, tokenizer)

    async def _get(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        try:
            found = await self._read(names.batch_key(batch_id))
        except ValueError as exc:
            raise BatchNotFound(batch_id) from exc
        if found is None:
            return None
        try:
            record = decode(found[0], BatchRecord)
        except DecodeError as exc:
            raise ServiceUnavailable(f"the record of batch {batch_id} is corrupt: {exc}") from exc
        if record.tenant != self.tenant:
            return None
        return record, found[1]

    async def get(self, batch_id: str) -> BatchRecord:
        """A batch's record as stored (see :meth:`refresh` for its progress now)."""
        found = await self._get(batch_id)
        if found is None:
            raise BatchNotFound(batch_id)
        return found[0]

    async def _update(
        self, batch_id: str, change: Callable[[BatchRecord], dict[str, Any] | None]
    ) -> BatchRecord:
        """Apply ``change`` (fields to set, or None for none) with compare-and-set."""
        kv, _ = await self._stores()
        for _ in range(20):
            found = await self._get(batch_id)
            if found is None:
                raise BatchNotFound(batch_id)
            record, revision = found
            fields = change(record)
            if not fields:
                return record
            new = record.model_copy(update=fields)
            try:
                await kv.update(names.batch_key(batch_id), encode(new), last=revision)
                return new
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # someone else moved it: read it again
            except _NATS_ERRORS as exc:
                raise ServiceUnavailable(f"cannot update batch {batch_id}: {exc}") from exc
        raise ServiceUnavailable(f"batch {batch_id} changes too often to update")

    async def recent(self, limit: int = 100) -> list[BatchRecord]:
        """This tenant's batches, newest first."""
        return (await self._records(self.tenant))[:limit]

    async def every_tenant(self) -> list[BatchRecord]:
        """Every tenant's batches, newest first (for the sweeps that move batches on)."""
        return await self._records(None)

    async def _batch_keys(self) -> list[str]:
        """Every batch record's key, from the bucket's stream: the subjects it holds (one
        request). nats-py's ``KeyValue.keys()`` replays the bucket through a watcher that can
        end its replay early (nats-io/nats.py#842) and then lists some keys, or none, of a
        bucket that holds them: a batch just created went missing from ``recent()``. The
        server lists at most 100,000 subjects at once; past that, the watcher's listing."""
        kv, _ = await self._stores()
        bucket = names.BATCH_BUCKET
        info = await self.client.nc.jetstream().stream_info(
            names.kv_stream(bucket),
            subjects_filter=names.kv_key_subject(bucket, f"{names.BATCH_KEY_PREFIX}>"),
        )
        subjects = info.state.subjects or {}
        if len(subjects) < _SUBJECTS_AT_ONCE:
            return [s.removeprefix(names.kv_key_subject(bucket, "")) for s in subjects]
        # nats-py's key filters match substrings, not subjects: filter here.
        return [k for k in await kv.keys() if k.startswith(names.BATCH_KEY_PREFIX)]

    async def _records(self, tenant: str | None) -> list[BatchRecord]:
        try:
            keys = await self._batch_keys()
        except nats.js.errors.NoKeysError:
            return []
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot list batches: {exc}") from exc
        out: list[BatchRecord] = []
        for key in keys:
            found = await self._read(key)
            if found is None:
                continue
            try:
                record = decode(found[0], BatchRecord)
            except DecodeError:
                continue  # a corrupt record is reported when it is read by its id
            if tenant is None or record.tenant == tenant:
                out.append(record)
        out.sort(key=lambda r: r.created_at, reverse=True)
        return out

    # ---------------------------------------------------------------------- submitting

    async def submit(self, batch_id: str, progress: Progress | None = None) -> BatchRecord:
        """Publish the batch's valid lines (resuming where an earlier submitter stopped),
        then refresh it. Stops early if the batch is cancelled or its window passes."""
        record = await self.get(batch_id)
        lines, _ = await self._lines(record)
        if record.status == "validating":
            now = _now()
            record = await self._update(
                batch_id,
                lambda r: (
                    {"status": "in_progress", "in_progress_at": now}
                    if r.status == "validating"
                    else None
                ),
            )
        start = record.submitted
        first = True
        while start < len(lines) and record.status == "in_progress":
            if _now() >= record.expires_at:
                break
            chunk = lines[start : start + CHUNK]
            # The chunk after the last record may be partly published by a submitter that
            # died: skip what has a result (what does not is deduplicated by its id).
            refused = await self._publish(chunk, record.band, skip_done=first and start > 0)
            first = False
            start += len(chunk)
            if refused:
                record = await self._refuse(batch_id, refused)
                if record.status in TERMINAL_BATCH_STATES:
                    return record
            record = await self._update(batch_id, _advance(start))
            if progress is not None:
                progress(start, len(lines))
        if start >= len(lines):
            record = await self._update(
                batch_id, lambda r: None if r.submitter_done else {"submitter_done": True}
            )
        return await self.refresh(batch_id)

    async def _publish(
        self, chunk: list[BatchLine], band: str, *, skip_done: bool
    ) -> dict[str, str]:
        """Publish a chunk's lines; returns the lines the client refused (request id: why)."""

        async def one(line: BatchLine) -> str | None:
            if skip_done and await self.client.fetch_result(line.request_id, tenant=self.tenant):
                return None
            try:
                await self._enqueue(line, band)
            except InvalidRequest as exc:  # too large for the broker: it fails, not the batch
                return f"line {line.line}: {str(exc)[:_REFUSAL_CHARS]}"
            return None

        got = await asyncio.gather(*(one(line) for line in chunk))
        return {line.request_id: why for line, why in zip(chunk, got, strict=True) if why}

    async def _refuse(self, batch_id: str, refused: dict[str, str]) -> BatchRecord:
        """Record lines that could not be published: they fail in the error file. Past
        ``MAX_REFUSED_LINES`` of them, or past a quarter of the broker's ``max_payload`` in
        the record, the batch fails as a whole (its record must stay storable: that broker
        is a small one)."""
        record = await self.get(batch_id)
        new = {**record.refused, **refused}
        room = (self.client.nc.max_payload or DEFAULT_MAX_PAYLOAD) // 4
        grown = record.model_copy(update={"refused": new})
        if len(new) <= MAX_REFUSED_LINES and len(encode(grown)) <= room:
            return await self._update(batch_id, lambda r: {"refused": {**r.refused, **refused}})
        first = next(iter(new.values()))
        lines, errors = await self._lines(record)
        await self._cancel_unfinished(
            lines[: record.submitted + CHUNK], await self.results_of(record)
        )
        results = await self.results_of(record)
        why = f"{len(new)} lines could not be published (the first: {first})"
        return await self._finalize(record, lines, errors, results, "failed", why=why)

    async def _enqueue(self, line: BatchLine, band: str) -> None:
        while True:
            try:
                await self.client.enqueue(
                    line.model,
                    line.prompt,
                    max_tokens=line.max_tokens,
                    band=band,
                    tenant=self.tenant,
                    request_id=line.request_id,
                    sampling=line.sampling,
                )
                return
            except QueueFull as exc:  # the backlog is at its bound: wait as it says
                await asyncio.sleep(max(exc.retry_after_s, 0.5))

    # ---------------------------------------------------------------------- progress

    async def results_of(self, record: BatchRecord) -> dict[str, Result]:
        """The last result of each of the batch's requests, by request id; a line refused
        before it was published (``record.refused``) has a failed one."""
        out = await self._stored_results(record)
        for rid, why in record.refused.items():
            if rid not in out:
                rejection = Rejection(reason=RejectReason.MALFORMED, message=why)
                out[rid] = Result(
                    request_id=rid,
                    ok=False,
                    tenant=record.tenant,
                    band=record.band,
                    rejection=rejection,
                )
        return out

    async def _stored_results(self, record: BatchRecord) -> dict[str, Result]:
        js = self.client.nc.jetstream()
        subject = names.results_filter(record.tenant, record.id)
        try:
            info = await js.stream_info(names.RESULT_STREAM, subjects_filter=subject)
        except nats.js.errors.NotFoundError:
            return {}
        except _NATS_ERRORS as exc:
            raise ServiceUnavailable(f"cannot count the results of {record.id}: {exc}") from exc
        expected = len(info.state.subjects or {})
        out: dict[str, Result] = {}
        if not expected:
            return out
        sub = await js.subscribe(
            subject,
            stream=names.RESULT_STREAM,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        )
        try:
            while len(out) < expected:
                try:
                    msg = await sub.next_msg(timeout=10.0)
                except nats.errors.TimeoutError as exc:
                    raise ServiceUnavailable(f"results of {record.id} stopped coming") from exc
                try:
                    result = decode(msg.data, Result)
                except DecodeError:
                    expected -= 1  # a foreign message: it is no request's result
                    continue
                out[result.request_id] = result
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return out

    async def refresh(self, batch_id: str) -> BatchRecord:
        """Count the batch's results and move it on (see the module docstring)."""
        record = await self.get(batch_id)
        if record.status in TERMINAL_BATCH_STATES:
            return record
        lines, errors = await self._lines(record)
        results = await self.results_of(record)
        ok = sum(1 for r in results.values() if r.ok)
        counts = BatchCounts(
            total=len(lines), completed=ok, failed=len(results) - ok, invalid=len(errors)
        )
        now = _now()
        done = len(results) >= len(lines)
        late = now >= record.expires_at
        if record.status == "cancelling":
            if done or now - (record.cancelling_at or now) >= CANCEL_GRACE_S:
                return await self._finalize(record, lines, errors, results, "cancelled")
        elif not done and record.status in ("validating", "in_progress") and late:
            return await self._expire(record, lines, errors, results)  # the window passed
        if record.status == "in_progress" and record.submitter_done and done:
            final = "completed" if lines else "failed"  # no valid line: nothing could run
            return await self._finalize(record, lines, errors, results, final)
        return await self._update(
            batch_id, lambda r: {"counts": counts} if r.counts != counts else None
        )

    async def _expire(
        self,
        record: BatchRecord,
        lines: list[BatchLine],
        errors: list[LineError],
        results: dict[str, Result],
    ) -> BatchRecord:
        await self._cancel_unfinished(lines[: record.submitted + CHUNK], results)
        results = await self.results_of(record)
        return await self._finalize(record, lines, errors, results, "expired")

    async def _finalize(
        self,
        record: BatchRecord,
        lines: list[BatchLine],
        errors: list[LineError],
        results: dict[str, Result],
        final: str,
        *,
        why: str = "the input file has no valid request line",
    ) -> BatchRecord:
        """Write the output and error files and end the batch as ``final`` (``why``: the
        error of a failed batch)."""
        now = _now()
        if final == "completed":
            record = await self._update(
                record.id,
                lambda r: (
                    {"status": "finalizing", "finalizing_at": now}
                    if r.status == "in_progress"
                    else None
                ),
            )
        unrun = {
            "cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
            "failed": ("batch_failed", f"the batch failed before this request ran: {why}"),
        }.get(
            final, ("batch_expired", "the batch's completion window ended before this request ran")
        )
        out: list[bytes] = []
        err: list[bytes] = []
        for is_output, line in output_lines(lines, errors, results, created=now, unrun=unrun):
            (out if is_output else err).append(json.dumps(line).encode())
        output = await self.upload(_jsonl(out), f"{record.id}_output.jsonl", "batch_output")
        error = await self.upload(_jsonl(err), f"{record.id}_errors.jsonl", "batch_output")
        ok = sum(1 for r in results.values() if r.ok)
        counts = BatchCounts(
            total=len(lines), completed=ok, failed=len(lines) - ok, invalid=len(errors)
        )
        fields: dict[str, Any] = {
            "status": final,
            f"{final}_at": now,
            "counts": counts,
            "output_file_id": output.id,
            "error_file_id": error.id,
        }
        if final == "failed":
            fields["errors"] = [why]

        def end(r: BatchRecord) -> dict[str, Any] | None:
            return None if r.status in TERMINAL_BATCH_STATES else fields

        return await self._update(record.id, end)

    async def cancel(self, batch_id: str) -> BatchRecord:
        """Cancel a batch: nothing more is submitted, its unfinished requests are cancelled,
        and it ends ``cancelled`` with the results it has."""
        now = _now()

        def cancelling(r: BatchRecord) -> dict[str, Any] | None:
            if r.status in TERMINAL_BATCH_STATES:
                raise BatchStateError(f"batch {batch_id} is {r.status}: nothing to cancel")
            if r.status == "cancelling":
                return None
            return {"status": "cancelling", "cancelling_at": now}

        record = await self._update(batch_id, cancelling)
        lines, _ = await self._lines(record)
        results = await self.results_of(record)
        await self._cancel_unfinished(lines[: record.submitted + CHUNK], results)
        return await self.refresh(batch_id)

    async def _cancel_unfinished(self, lines: list[BatchLine], results: dict[str, Result]) -> None:
        todo = [line.request_id for line in lines if line.request_id not in results]

        async def one(rid: str) -> None:
            # No dispatcher now: the request stays queued and runs; it is counted then.
            with contextlib.suppress(ServiceUnavailable):
                await self.client.cancel(rid, tenant=self.tenant)

        for i in range(0, len(todo), CHUNK):
            await asyncio.gather(*(one(rid) for rid in todo[i : i + CHUNK]))

    async def wait(
        self,
        batch_id: str,
        *,
        every_s: float = 1.0,
        timeout_s: float | None = None,
        progress: Callable[[BatchRecord], Awaitable[None] | None] | None = None,
    ) -> BatchRecord:
        """Refresh until the batch ends (or ``timeout_s``); the last record."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            record = await self.refresh(batch_id)
            if progress is not None:
                maybe = progress(record)
                if maybe is not None:
                    await maybe
            if record.status in TERMINAL_BATCH_STATES:
                return record
            if deadline is not None and time.monotonic() >= deadline:
                return record
            await asyncio.sleep(every_s)

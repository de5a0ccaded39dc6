"""OpenAI's Files and Batches APIs on the gateway, over :mod:`sluice.client.batches`.

- ``POST /v1/files`` (multipart: ``file``, ``purpose``), ``GET /v1/files/{id}``,
  ``GET /v1/files/{id}/content``;
- ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``),
  ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``, ``GET /v1/batches``
  (``limit``, ``after``).

Every file and batch belongs to the tenant of the API key that made it: another key's tenant
gets a 404 for it, as for one that does not exist. Creating a batch starts its submitter in the
gateway; a gateway that starts finds the batches left ``in_progress`` with their submitter
unfinished (a gateway that died mid-submit) and resumes them, and it moves every unfinished
batch on every ``sweep_every_s`` (completion, expiry, cancel), so a batch ends even when
nobody polls it. Two gateways resuming the same batch submit nothing twice (request ids are
derived from the batch and each line's ``custom_id``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from sluice.client import Batches, BatchNotFound, BatchStateError, FileNotFound, SluiceError
from sluice.client.batchfile import parse_window
from sluice.client.oaiformat import ENDPOINT_KINDS
from sluice.common.aio import finish_tasks, wait_event
from sluice.common.errors import internal_error
from sluice.gateway.app import Gateway, gateway_of, guarded, read_body
from sluice.gateway.chat import parse_json
from sluice.gateway.errors import ApiError, BadRequest, NotFound, PayloadTooLarge
from sluice.schemas.models import TERMINAL_BATCH_STATES, BatchRecord, FileRecord

log = logging.getLogger("sluice.gateway")

STOP_GRACE_S = 3.0
"""How long a stopping gateway lets its batch sweep finish the batch it is moving on."""


class Conflict(ApiError):
    status, type = 409, "invalid_request_error"


def file_object(f: FileRecord) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
    }


def _window(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds % 3600 == 0 else f"{seconds:g}s"


def batch_object(b: BatchRecord) -> dict[str, Any]:
    """OpenAI's batch object; every input line is counted (invalid lines as failed)."""
    c = b.counts
    errors = None
    if b.errors:
        errors = {
            "object": "list",
            "data": [
                {"code": "batch_failed", "message": m, "param": None, "line": None}
                for m in b.errors
            ],
        }
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": errors,
        "input_file_id": b.input_file_id,
        "completion_window": _window(b.completion_window_s),
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": b.created_at,
        "in_progress_at": b.in_progress_at,
        "expires_at": b.expires_at,
        "finalizing_at": b.finalizing_at,
        "completed_at": b.completed_at,
        "failed_at": b.failed_at,
        "expired_at": b.expired_at,
        "cancelling_at": b.cancelling_at,
        "cancelled_at": b.cancelled_at,
        "request_counts": {
            "total": c.total + c.invalid,
            "completed": c.completed,
            "failed": c.failed + c.invalid,
        },
        "metadata": b.metadata or None,
    }


class BatchApi:
    """The routes, the submitters running in this gateway, and the sweep that moves batches
    on."""

    def __init__(self, sweep_every_s: float, max_file_bytes: int) -> None:
        self.sweep_every_s = sweep_every_s
        self.max_file_bytes = max_file_bytes
        self._submitters: dict[str, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._gateway: Gateway | None = None
        self._stopping = asyncio.Event()
        self._tenants: dict[str, Batches] = {}
        """One :class:`Batches` per tenant, kept: its stores are opened once, and the inputs
        it parsed are not parsed again on every poll and sweep."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/files", guarded(self.upload), methods=["POST"]),
            Route("/v1/files/{file_id}", guarded(self.file), methods=["GET"]),
            Route("/v1/files/{file_id}/content", guarded(self.content), methods=["GET"]),
            Route("/v1/batches", guarded(self.create), methods=["POST"]),
            Route("/v1/batches", guarded(self.list), methods=["GET"]),
            Route("/v1/batches/{batch_id}", guarded(self.get), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", guarded(self.cancel), methods=["POST"]),
        ]

    # ------------------------------------------------------------------ lifecycle

    async def start(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._stopping.clear()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="batch-sweep")

    async def stop(self) -> None:
        """Stop the sweep (it watches a flag) and the submitters (cancelled: a batch's
        submitter resumes in the next gateway, where it stopped)."""
        self._stopping.set()
        await finish_tasks(list(self._submitters.values()), 0.0)
        if self._sweeper is not None:
            await finish_tasks([self._sweeper], STOP_GRACE_S)
        self._submitters.clear()

    async def _sweep(self) -> None:
        assert self._gateway is not None
        gw = self._gateway
        while not self._stopping.is_set():
            try:
                await self._sweep_once(gw)
            except SluiceError as exc:  # NATS away: the next sweep tries again
                log.warning("batch sweep failed: %s", exc)
            except Exception:
                if self._stopping.is_set():
                    return  # the connection closed under it while stopping
                internal_error(log, "gateway.batch-sweep", "the batch sweep failed")
            await wait_event(self._stopping, self.sweep_every_s)

    async def _sweep_once(self, gw: Gateway) -> None:
        for record in await self.batches_of(gw, gw.settings.open_tenant).every_tenant():
            if record.status in TERMINAL_BATCH_STATES:
                continue
            b = self.batches_of(gw, record.tenant)
            if record.status in ("validating", "in_progress") and not record.submitter_done:
                self._submit(b, record.id)  # a submitter that died with its gateway
            elif record.id not in self._submitters:
                await b.refresh(record.id)

    def _submit(self, batches: Batches, batch_id: str) -> None:
        running = self._submitters.get(batch_id)
        if running is not None and not running.done():
            return

        async def go() -> None:
            try:
                await batches.submit(batch_id)
            except SluiceError as exc:
                log.warning("submitting batch %s stopped: %s (the sweep resumes it)", batch_id, exc)
            except Exception:
                internal_error(log, "gateway.batch-submit", "submitting batch %s failed", batch_id)
            finally:
                self._submitters.pop(batch_id, None)

        self._submitters[batch_id] = asyncio.get_running_loop().create_task(
            go(), name=f"submit-{batch_id}"
        )

    # ------------------------------------------------------------------ routes

    def batches_of(self, gw: Gateway, tenant: str) -> Batches:
        b = self._tenants.get(tenant)
        if b is None:
            b = self._tenants[tenant] = Batches(gw.client, tenant=tenant)
        return b

    def _batches(self, request: Request) -> Batches:
        gw = gateway_of(request)
        return self.batches_of(gw, gw.authenticate(request).tenant)

    async def upload(self, request: Request) -> Response:
        b = self._batches(request)
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=self.max_file_bytes)
        except (HTTPException, MultiPartException) as exc:  # Starlette's two answers to a bad form
            detail = exc.detail if isinstance(exc, HTTPException) else exc.message
            raise BadRequest(f"the body is not a multipart form: {detail}") from exc
        try:
            upload = form.get("file")
            purpose = form.get("purpose")
            if upload is None or isinstance(upload, str):
                raise BadRequest("the form needs a file field", param="file")
            if not isinstance(purpose, str) or not purpose:
                raise BadRequest("the form needs a purpose field", param="purpose")
            data = await upload.read()
            if len(data) > self.max_file_bytes:
                raise PayloadTooLarge(f"the file exceeds {self.max_file_bytes} bytes")
            record = await b.upload(data, upload.filename or "file.jsonl", purpose)
        finally:
            await form.close()
        return JSONResponse(file_object(record))

    async def file(self, request: Request) -> Response:
        b = self._batches(request)
        return JSONResponse(file_object(await _found(b.file(request.path_params["file_id"]))))

    async def content(self, request: Request) -> Response:
        b = self._batches(request)
        data = await _found(b.content(request.path_params["file_id"]))
        return Response(data, media_type="application/jsonl")

    async def create(self, request: Request) -> Response:
        b = self._batches(request)
        body = parse_json(await read_body(request, 1 << 20))
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise BadRequest("input_file_id must be a file id", param="input_file_id")
        endpoint = body.get("endpoint", "/v1/chat/completions")
        if not isinstance(endpoint, str) or endpoint not in ENDPOINT_KINDS:
            raise BadRequest(f"endpoint must be one of {sorted(ENDPOINT_KINDS)}", param="endpoint")
        window = body.get("completion_window", "24h")
        if not isinstance(window, str):  # OpenAI's is the string "24h"; a number is no unit
            raise BadRequest(
                'completion_window must be a string such as "24h"', param="completion_window"
            )
        try:
            window_s = parse_window(window)
        except ValueError as exc:
            raise BadRequest(str(exc), param="completion_window") from exc
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise BadRequest("metadata must map strings to strings", param="metadata")
        record = await _found(
            b.create(input_file_id, endpoint=endpoint, window_s=window_s, metadata=metadata)
        )
        self._submit(b, record.id)
        return JSONResponse(batch_object(record))

    async def get(self, request: Request) -> Response:
        b = self._batches(request)
        return JSONResponse(batch_object(await _found(b.refresh(request.path_params["batch_id"]))))

    async def cancel(self, request: Request) -> Response:
        b = self._batches(request)
        try:
            record = await _found(b.cancel(request.path_params["batch_id"]))
        except BatchStateError as exc:
            raise Conflict(str(exc), code="batch_not_cancellable") from exc
        return JSONResponse(batch_object(record))

    async def list(self, request: Request) -> Response:
        b = self._batches(request)
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError as exc:
            raise BadRequest("limit must be an integer", param="limit") from exc
        if not 1 <= limit <= 100:
            raise BadRequest("limit must be between 1 and 100", param="limit")
        after = request.query_params.get("after")
        records = await b.recent(limit=10_000)
        if after is not None:
            ids = [r.id for r in records]
            records = records[ids.index(after) + 1 :] if after in ids else []
        page = records[:limit]
        data = [batch_object(r) for r in page]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
                "has_more": len(records) > limit,
            }
        )


async def _found(aw: Any) -> Any:
    """``aw``'s value; a file or batch that is not the caller's is a 404."""
    try:
        return await aw
    except (FileNotFound, BatchNotFound) as exc:
        raise NotFound(str(exc), code="not_found") from exc

"""Every error the client library raises. All derive from :class:`SluiceError`."""

from __future__ import annotations

from sluice.schemas.models import Rejection, RejectReason, Result


class SluiceError(Exception):
    """Base class of the client's errors."""


class InvalidRequest(SluiceError, ValueError):
    """The request was refused before it was sent (bad arguments). ``param``: the field at
    fault, when one is (an OpenAI body's key)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(SluiceError):
    """The band's queue is at its bound: the publish was refused at once. Retry after
    ``retry_after_s`` seconds (the dispatcher's expected wait when it could tell, else the
    configured default), or submit to another band. ``queued`` is the queue depth the dispatcher
    reported (None if none answered). ``scope`` is ``band`` (the band's queue is full) or
    ``tenant`` (this tenant's share of it, ``tenant_queue_max_msgs``, is)."""

    def __init__(
        self,
        band: str,
        model: str,
        retry_after_s: float,
        detail: str = "",
        queued: int | None = None,
        scope: str = "band",
    ) -> None:
        self.band = band
        self.model = model
        self.retry_after_s = retry_after_s
        self.queued = queued
        self.scope = scope
        depth = "" if queued is None else f", {queued} queued"
        whose = "this tenant's requests in band" if scope == "tenant" else "queue of band"
        super().__init__(
            f"{whose} {band!r} is full (model {model!r}{depth}); "
            f"retry after {retry_after_s:.1f}s" + (f": {detail}" if detail else "")
        )


class ServiceUnavailable(SluiceError):
    """No Sluice dispatcher has set up this band (wrong band name, or none is running), or
    NATS cannot be reached (also: the connection was closed)."""


class UnknownWorker(SluiceError):
    """No worker by that id answered on its drain subject (none runs, or it is of a version
    without drain)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        super().__init__(
            f"no worker {worker_id!r} answered (is it running? `sluice workers` lists them)"
        )


class DispatcherLeading(SluiceError):
    """The leader key is held (by ``dispatcher_id``), and the operation needs every
    dispatcher stopped."""

    def __init__(self, dispatcher_id: str, message: str | None = None) -> None:
        super().__init__(
            message
            or f"dispatcher {dispatcher_id} leads: stop every dispatcher first (a stopped "
            "leader's key is gone at once; a crashed one's after its lease)"
        )
        self.dispatcher_id = dispatcher_id


class DrainTimeout(SluiceError):
    """A drained worker still ran requests (or had reports waiting) when the wait ended."""

    def __init__(self, worker_id: str, timeout_s: float, state: str) -> None:
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.state = state
        super().__init__(f"worker {worker_id!r} was still {state} after {timeout_s:g} s")


class NotConnected(SluiceError):
    """The client was used outside ``async with Client(...)`` (or after ``close()``)."""


class MalformedResult(SluiceError):
    """A message on the request's result subject is not a valid result (a broken or hostile
    publisher): the request's outcome is unknown. ``Client.fetch_result`` may find the real
    one later."""

    def __init__(self, request_id: str, detail: str) -> None:
        self.request_id = request_id
        super().__init__(f"malformed result for {request_id}: {detail}")


class Rejected(SluiceError):
    """The request was not run; ``reason`` says why (see :class:`RejectReason`)."""

    def __init__(self, request_id: str, rejection: Rejection, result: Result | None = None) -> None:
        self.request_id = request_id
        self.rejection = rejection
        self.result = result
        """The stored result (for a request cancelled while it ran: the tokens it produced)."""
        self.reason: RejectReason = rejection.reason
        self.retry_after_s = rejection.retry_after_s
        super().__init__(f"request {request_id} rejected ({rejection.reason}): {rejection.message}")


class DeadlineExceeded(Rejected):
    """The request's deadline passed while it was queued; it was not run."""


class Cancelled(Rejected):
    """The request was cancelled (``RequestHandle.cancel``, ``sluice cancel``). If it was
    running, ``result.output_tokens`` holds what it produced until it stopped."""


class ResultTimeout(SluiceError, TimeoutError):
    """No result arrived within the time the caller was willing to wait. The request may
    still complete: fetch it later with ``Client.fetch_result``."""


def rejection_error(
    request_id: str, rejection: Rejection, result: Result | None = None
) -> Rejected:
    """The most specific error for a rejection."""
    if rejection.reason is RejectReason.DEADLINE_EXCEEDED:
        return DeadlineExceeded(request_id, rejection, result)
    if rejection.reason is RejectReason.CANCELLED:
        return Cancelled(request_id, rejection, result)
    return Rejected(request_id, rejection, result)


class BatchNotFound(SluiceError, KeyError):
    """No batch of that id belongs to this tenant (another tenant's batch is not found
    either)."""

    def __init__(self, batch_id: str) -> None:
        self.batch_id = batch_id
        super().__init__(f"no batch {batch_id!r}")

    def __str__(self) -> str:
        return str(self.args[0])


class FileNotFound(SluiceError, KeyError):
    """No stored file of that id belongs to this tenant."""

    def __init__(self, file_id: str) -> None:
        self.file_id = file_id
        super().__init__(f"no file {file_id!r}")

    def __str__(self) -> str:
        return str(self.args[0])


class BatchStateError(SluiceError):
    """The batch cannot do that in its state (cancelling a completed batch)."""

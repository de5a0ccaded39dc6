"""The gateway's errors, each an HTTP status and an OpenAI-shaped body
``{"error": {"message", "type", "param", "code"}}``, and the one mapping from the client
library's errors (and the dispatcher's rejections) onto them.

- 400 ``invalid_request_error``: malformed JSON, bad or unsupported fields, an unknown band, a
  prompt too long;
- 401 ``authentication_error``: a missing or unknown API key;
- 403 ``permission_error``: ``x-sluice-priority`` names a band the key may not use;
- 404 ``invalid_request_error``: a model the fleet does not serve (``model_not_found``), or a
  path no route serves; 405 a wrong method; 408 a body not received within
  ``body_timeout_s``; 413 a body over ``max_body_bytes``;
- 429 ``rate_limit_error``: the band's (or the tenant's) queue is full, with ``Retry-After``;
- 500 ``server_error``: an unexpected error (counted and logged; the body says nothing more);
- 502 ``server_error``: the workers failed the request ``max_attempts`` times, or its result
  is malformed;
- 503 ``server_error``: no dispatcher answers, NATS is away, or the request was cancelled
  elsewhere (``sluice cancel``);
- 504 ``server_error``: the request did not finish within ``request_timeout_s`` (it is
  cancelled).

No message ever holds an API key: authentication errors say only that the key is missing or
unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from starlette.responses import JSONResponse

from sluice.client import (
    InvalidRequest,
    MalformedResult,
    NotConnected,
    QueueFull,
    Rejected,
    RejectReason,
    ResultTimeout,
    ServiceUnavailable,
    SluiceError,
)
from sluice.client.oaiformat import http_status, rejection_code


class GatewayError(Exception):
    """The root of the gateway's errors."""


class BindError(GatewayError):
    """The gateway cannot listen on its host and port."""


class ApiError(GatewayError):
    """An answer other than success: ``status`` with an OpenAI-shaped body."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BadRequest(ApiError):
    status, type = 400, "invalid_request_error"


class Unauthorized(ApiError):
    status, type, code = 401, "authentication_error", "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ApiError):
    status, type = 403, "permission_error"


class NotFound(ApiError):
    status, type = 404, "invalid_request_error"


class MethodNotAllowed(ApiError):
    status, type = 405, "invalid_request_error"


class PayloadTooLarge(ApiError):
    status, type, code = 413, "invalid_request_error", "body_too_large"


class BodyTimeout(ApiError):
    status, type, code = 408, "invalid_request_error", "body_timeout"


class TooManyRequests(ApiError):
    """A full queue: ``Retry-After`` is its retry-after in whole seconds, rounded up (at least
    1, so that a client never retries at once)."""

    status, type, code = 429, "rate_limit_error", "queue_full"

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        self.retry_after_s = retry_after_s_header(retry_after_s)
        super().__init__(message, headers={"Retry-After": str(self.retry_after_s)})


class InternalError(ApiError):
    status, type, code = 500, "server_error", "internal_error"


class BadGateway(ApiError):
    status, type = 502, "server_error"


class Unavailable(ApiError):
    status, type, code = 503, "server_error", "service_unavailable"


class GatewayTimeout(ApiError):
    status, type, code = 504, "server_error", "timeout"


def retry_after_s_header(retry_after_s: float | None) -> int:
    """A retry-after in seconds as the ``Retry-After`` header's integer: rounded up, >= 1."""
    if retry_after_s is None or not math.isfinite(retry_after_s):
        return 1
    return max(1, math.ceil(retry_after_s))


def model_not_found(model: str) -> NotFound:
    return NotFound(
        f"The model {model!r} does not exist: the fleet does not serve it",
        param="model",
        code="model_not_found",
    )


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    500: InternalError,
    502: BadGateway,
    503: Unavailable,
    504: GatewayTimeout,
}
"""The answer class of each status a rejection maps to (``oaiformat.http_status``, the one
mapping, which a batch's error lines use too)."""


def from_rejection(exc: Rejected, model: str) -> ApiError:
    """The answer for a request the dispatcher did not run (or that ended without running to
    its end)."""
    reason = exc.reason
    if reason is RejectReason.UNKNOWN_MODEL:
        return model_not_found(model)
    if reason is RejectReason.QUEUE_FULL:
        return TooManyRequests(exc.rejection.message, exc.retry_after_s)
    cls = _BY_STATUS.get(http_status(reason), InternalError)
    return cls(exc.rejection.message, code=rejection_code(reason))


def from_client_error(exc: SluiceError, model: str) -> ApiError:
    """The answer for an error of the client library (submit, result)."""
    if isinstance(exc, QueueFull):
        return TooManyRequests(str(exc), exc.retry_after_s)
    if isinstance(exc, Rejected):
        return from_rejection(exc, model)
    if isinstance(exc, InvalidRequest):
        return BadRequest(str(exc))
    if isinstance(exc, ResultTimeout):
        return GatewayTimeout(str(exc))
    if isinstance(exc, MalformedResult):
        return BadGateway(str(exc), code="malformed_result")
    if isinstance(exc, ServiceUnavailable | NotConnected):
        return Unavailable(str(exc))
    return InternalError("the gateway failed to relay the request")

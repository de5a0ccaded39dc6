"""OpenAI's response shapes for Sluice results: completion and chat completion bodies, usage,
error objects and the HTTP status of each rejection. One definition for the gateway's answers
and for the lines of a batch's output and error files."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from sluice.schemas.models import Rejection, RejectReason, Result, TokenLogprob

Kind = Literal["chat", "completion"]

ENDPOINT_KINDS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}

_STATUS: dict[RejectReason, int] = {
    RejectReason.MALFORMED: 400,
    RejectReason.UNKNOWN_BAND: 400,
    RejectReason.PROMPT_TOO_LONG: 400,
    RejectReason.UNKNOWN_MODEL: 404,
    RejectReason.QUEUE_FULL: 429,
    RejectReason.INTERNAL: 500,
    RejectReason.MAX_ATTEMPTS: 502,  # the workers failed it: a bad gateway, not a bad request
    RejectReason.UNDELIVERABLE: 503,
    RejectReason.CANCELLED: 503,  # cancelled elsewhere (sluice cancel): not this caller's doing
    RejectReason.DEADLINE_EXCEEDED: 504,
}
_CODE: dict[RejectReason, str] = {
    RejectReason.PROMPT_TOO_LONG: "context_length_exceeded",
    RejectReason.UNKNOWN_MODEL: "model_not_found",
    RejectReason.INTERNAL: "internal_error",
}
_TYPE = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}


def http_status(reason: RejectReason) -> int:
    """The HTTP status that answers a rejection (the gateway's answers and a batch's error
    lines alike)."""
    return _STATUS.get(reason, 500)


def rejection_code(reason: RejectReason) -> str:
    """The OpenAI error ``code`` of a rejection."""
    return _CODE.get(reason, reason.value)


def error_object(
    message: str, status: int, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def rejection_error(rejection: Rejection) -> dict[str, Any]:
    reason = rejection.reason
    return error_object(rejection.message, http_status(reason), rejection_code(reason))


def usage(result: Result) -> dict[str, Any]:
    completion = len(result.output_tokens)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def finish_reason(result: Result, max_tokens: int) -> str:
    """``length`` when the output reached ``max_tokens``, else ``stop``."""
    return "length" if len(result.output_tokens) >= max_tokens else "stop"


def completion_body(
    kind: Kind, result: Result, *, model: str, created: int, max_tokens: int
) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` object for a finished request."""
    reason = finish_reason(result, max_tokens)
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": choice_logprobs(kind, result.logprobs),
            "finish_reason": reason,
        }
        prefix, obj = "chatcmpl", "chat.completion"
    else:
        logprobs = choice_logprobs(kind, result.logprobs)
        choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": reason}
        prefix, obj = "cmpl", "text_completion"
    return {
        "id": f"{prefix}-{result.request_id}",
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(result),
    }


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (OpenAI's legacy shape: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` as ``{token: logprob}`` with the token itself among
    them, as OpenAI and vLLM give it, ``text_offset``) for tokens whose text starts at
    character ``offset`` of the output."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {**{t.text: t.logprob for t in e.top}, e.text: e.logprob} for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {
        "content": [
            {
                "token": e.text,
                "logprob": e.logprob,
                "bytes": list(e.text.encode()),
                "top_logprobs": [
                    {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                    for t in e.top
                ],
            }
            for e in entries
        ]
    }


def choice_logprobs(kind: Kind, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs`` for ``entries`` in ``kind``'s shape (None: not asked for)."""
    if entries is None:
        return None
    return chat_logprobs(entries) if kind == "chat" else completion_logprobs(entries)

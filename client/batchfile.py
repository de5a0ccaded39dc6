"""Batch input and output files (JSONL), in OpenAI's Batch format and Sluice's native one.

An input line is either OpenAI's ``{"custom_id", "method": "POST", "url", "body"}`` (``url``
``/v1/chat/completions`` with ``body.messages``, or ``/v1/completions`` with ``body.prompt``;
``max_tokens`` or ``max_completion_tokens``; the sampling fields of
:func:`~sluice.client.sampling.openai_sampling`) or Sluice's ``{"custom_id"?, "model", "prompt"
| "tokens", "max_tokens"?, "sampling"?}`` (``custom_id`` defaults to ``line-N``; ``sampling``
an object of :class:`~sluice.schemas.models.Sampling`'s fields). Blank lines are skipped. A
line that is not valid JSON or not a valid request, or repeats a ``custom_id``, is an error
line: it is never submitted and it appears in the error file with its line number.

A line's request id is ``<batch id>:<hash of its custom_id>``: the same on every run of the
same batch, so a resubmission is deduplicated, and grouped under the batch
(:func:`sluice.schemas.names.result_subject`). Every input line ends as exactly one line of
the output file (a result) or of the error file (a rejection, an invalid line, or work the
batch's window or a cancel left unrun), in input order.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from sluice.client import jsontext
from sluice.client.errors import InvalidRequest
from sluice.client.oaiformat import (
    ENDPOINT_KINDS,
    Kind,
    completion_body,
    http_status,
    rejection_error,
)
from sluice.client.sampling import openai_sampling, sampling_of
from sluice.common.chat import ChatError
from sluice.common.chattemplate import ChatOptions, ChatRender, chat_prompt
from sluice.schemas.models import Result, Sampling

DEFAULT_MAX_TOKENS = 256
"""Output tokens of a line that names none."""
MAX_LINE_BYTES = 1_000_000


@dataclass(frozen=True)
class BatchLine:
    """One valid input line."""

    line: int
    """1-based line number in the input file."""
    custom_id: str
    request_id: str
    model: str
    prompt: str | list[int]
    max_tokens: int
    kind: Kind
    sampling: Sampling | None = None
    """An OpenAI line's sampling fields, or a native line's ``sampling`` object."""


@dataclass(frozen=True)
class LineError:
    """One input line that cannot be run."""

    line: int
    custom_id: str | None
    code: str
    message: str


class _Bad(ValueError):
    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


def request_id_of(batch_id: str, custom_id: str) -> str:
    """The request id of a batch's line (deterministic: a rerun submits nothing twice)."""
    return f"{batch_id}:{hashlib.sha256(custom_id.encode()).hexdigest()[:24]}"


_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(text: str) -> float:
    """A completion window such as ``24h``, ``90m``, ``3600s`` or ``3600``, in seconds."""
    m = _WINDOW.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"a completion window is a positive duration like 24h or 30m: {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_lines(
    data: bytes, batch_id: str, render: ChatRender = chat_prompt
) -> tuple[list[BatchLine], list[LineError]]:
    """The valid lines and the error lines of an input file; ``render`` renders a chat line's
    messages (the model's chat template, or Sluice's neutral one)."""
    good: list[BatchLine] = []
    bad: list[LineError] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        custom_id: str | None = None
        try:
            if len(raw) > MAX_LINE_BYTES:
                raise _Bad(f"the line has {len(raw)} bytes, more than {MAX_LINE_BYTES}")
            try:
                obj = jsontext.loads(raw)
            except jsontext.JsonTextError as exc:
                raise _Bad(str(exc), "invalid_json") from exc
            if not isinstance(obj, dict):
                raise _Bad("a line must be a JSON object")
            cid = obj.get("custom_id", f"line-{n}")
            if not isinstance(cid, str) or not cid:
                raise _Bad("custom_id must be a non-empty string")
            custom_id = cid
            if cid in seen:
                raise _Bad(f"custom_id {cid!r} repeats an earlier line", "duplicate_custom_id")
            line = _line(n, cid, obj, batch_id, render)
            seen.add(cid)
            good.append(line)
        except _Bad as exc:
            bad.append(LineError(n, custom_id, exc.code, f"line {n}: {exc}"))
    return good, bad


def _line(n: int, cid: str, obj: Mapping[str, Any], batch_id: str, render: ChatRender) -> BatchLine:
    if "url" in obj or "body" in obj or "method" in obj:
        if obj.get("method", "POST") != "POST":
            raise _Bad("method must be POST")
        url = obj.get("url")
        kind = ENDPOINT_KINDS.get(url) if isinstance(url, str) else None
        if kind is None:
            raise _Bad(f"url must be one of {sorted(ENDPOINT_KINDS)}, not {url!r}")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise _Bad("body must be an object")
        if body.get("n", 1) != 1:
            raise _Bad("only n = 1 is supported")
        endpoint: Kind = kind  # (narrowed for the closure)
        sampling = _sampling(lambda: openai_sampling(body, endpoint))
        if kind == "chat":
            try:
                options = ChatOptions.from_body(body)
                prompt: str | list[int] = render(body.get("messages"), options)
            except ChatError as exc:
                raise _Bad(str(exc)) from exc
        else:
            prompt = _prompt(body.get("prompt"), "body.prompt")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
        model = body.get("model")
    else:
        kind = "completion"
        if ("prompt" in obj) == ("tokens" in obj):
            raise _Bad("a native line has exactly one of prompt and tokens")
        prompt = _prompt(obj.get("prompt", obj.get("tokens")), "prompt")
        max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
        model = obj.get("model")
        given = obj.get("sampling")
        if given is not None and not isinstance(given, dict):
            raise _Bad("sampling must be an object")
        sampling = _sampling(lambda: sampling_of(given))
    if not isinstance(model, str) or not model:
        raise _Bad("model must be a non-empty string")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _Bad("max_tokens must be an integer >= 1")
    rid = request_id_of(batch_id, cid)
    return BatchLine(n, cid, rid, model, prompt, max_tokens, kind, sampling)


def _sampling(read: Callable[[], Sampling | None]) -> Sampling | None:
    try:
        return read()
    except InvalidRequest as exc:
        raise _Bad(str(exc)) from exc


def _prompt(value: Any, name: str) -> str | list[int]:
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value)
    ):
        return list(value)
    raise _Bad(f"{name} must be a non-empty string or list of token ids")


# ---------------------------------------------------------------------------- output


def _line_id(request_id: str) -> str:
    return "batch_req_" + hashlib.sha256(request_id.encode()).hexdigest()[:24]


def output_lines(
    lines: list[BatchLine],
    errors: list[LineError],
    results: Mapping[str, Result],
    *,
    created: int,
    unrun: tuple[str, str] = ("batch_expired", "the batch ended before this request ran"),
) -> Iterator[tuple[bool, dict[str, Any]]]:
    """``(is_output, line)`` for every input line in input order: a result's line for the
    output file, or a line for the error file. ``unrun`` is the code and message of lines
    without a result (the window expired or the batch was cancelled)."""
    by_line: dict[int, BatchLine | LineError] = {b.line: b for b in lines}
    by_line.update({e.line: e for e in errors})
    for n in sorted(by_line):
        item = by_line[n]
        if isinstance(item, LineError):
            yield (
                False,
                {
                    "id": f"batch_req_line_{n}",
                    "custom_id": item.custom_id,
                    "response": None,
                    "error": {"code": item.code, "message": item.message, "line": n},
                },
            )
            continue
        result = results.get(item.request_id)
        if result is None:
            yield (
                False,
                {
                    "id": _line_id(item.request_id),
                    "custom_id": item.custom_id,
                    "response": None,
                    "error": {"code": unrun[0], "message": unrun[1], "line": n},
                },
            )
        elif result.ok:
            body = completion_body(
                item.kind, result, model=item.model, created=created, max_tokens=item.max_tokens
            )
            yield True, _response(item, 200, body)
        else:
            assert result.rejection is not None
            status = http_status(result.rejection.reason)
            yield False, _response(item, status, rejection_error(result.rejection))


def _response(item: BatchLine, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": _line_id(item.request_id),
        "custom_id": item.custom_id,
        "response": {"status_code": status, "request_id": item.request_id, "body": body},
        "error": None,
    }

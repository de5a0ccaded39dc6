"""The OpenAI response shapes the gateway answers with (as ``sluice engine`` answers, see
:mod:`sluice.testing.engineserver`): a whole completion, its streamed chunks as server-sent
events (``data: {...}``, then ``data: [DONE]``), usage with
``prompt_tokens_details.cached_tokens`` (the tokens of the prompt the engine found in its
prefix cache, from the Sluice result).

``finish_reason`` is ``length`` when the output reached ``max_tokens`` and ``stop`` when the
engine ended it sooner (a Sluice result carries no finish reason of its own).
"""

from __future__ import annotations

import json
from typing import Any

from sluice.client import Result, oaiformat
from sluice.gateway.chat import Job

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def head(job: Job, request_id: str, created: int, *, chunk: bool) -> dict[str, Any]:
    """The fields every response (or chunk) of ``job`` starts with; ``id`` carries the Sluice
    request id."""
    if job.kind == "chat":
        ident, obj = (
            f"chatcmpl-{request_id}",
            "chat.completion.chunk" if chunk else "chat.completion",
        )
    else:
        ident, obj = f"cmpl-{request_id}", "text_completion"
    return {"id": ident, "object": obj, "created": created, "model": job.model}


def finish_reason(job: Job, result: Result) -> str:
    return oaiformat.finish_reason(result, job.max_tokens)


def completion(job: Job, result: Result, created: int) -> dict[str, Any]:
    """The whole answer of a request that did not stream."""
    body = oaiformat.completion_body(
        job.kind, result, model=job.model, created=created, max_tokens=job.max_tokens
    )
    return {**body, "system_fingerprint": None}


class Chunks:
    """The chunks of one streamed answer, in order: text chunks, the finish, the usage."""

    def __init__(self, job: Job, request_id: str, created: int) -> None:
        self.job = job
        self.head = head(job, request_id, created, chunk=True)
        if job.include_usage:  # every chunk but the last carries "usage": null
            self.head["usage"] = None
        self._first = True

    def text(self, text: str) -> bytes:
        if self.job.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if self._first:
                delta = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
        self._first = False
        return sse({**self.head, "choices": [choice]})

    def end(self, result: Result) -> bytes:
        """The finish chunk, the usage chunk if asked for, and ``[DONE]``."""
        done: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(self.job, result)}
        if self.job.kind == "chat":
            done["delta"] = {"role": "assistant"} if self._first else {}
        else:
            done["text"] = ""
            done["logprobs"] = None
        out = sse({**self.head, "choices": [done]})
        if self.job.include_usage:
            out += sse({**self.head, "choices": [], "usage": oaiformat.usage(result)})
        return out + DONE

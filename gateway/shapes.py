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
from collections.abc import Sequence
from typing import Any

from sluice.client import Result, TokenLogprob, oaiformat
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


def usage(results: Sequence[Result]) -> dict[str, Any]:
    """The usage of an answer's choices: its prompt once (as OpenAI counts it), the output
    tokens of every choice."""
    out = oaiformat.usage(results[0])
    if len(results) > 1:
        out["completion_tokens"] = sum(len(r.output_tokens) for r in results)
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def completion(job: Job, results: Sequence[Result], created: int) -> dict[str, Any]:
    """The whole answer of a request that did not stream: a choice per result."""
    bodies = [
        oaiformat.completion_body(
            job.kind, r, model=job.model, created=created, max_tokens=job.max_tokens
        )
        for r in results
    ]
    choices = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    return {**bodies[0], "choices": choices, "usage": usage(results), "system_fingerprint": None}


class Chunks:
    """The chunks of one streamed answer, in order: each choice's text chunks and then its
    finish (the choices interleaved as they come), then the usage and ``[DONE]``."""

    def __init__(self, job: Job, request_id: str, created: int) -> None:
        self.job = job
        self.head = head(job, request_id, created, chunk=True)
        if job.include_usage:  # every chunk but the last carries "usage": null
            self.head["usage"] = None
        self._first = [True] * job.n
        self._offset = [0] * job.n  # characters of each choice's text sent

    def text(
        self, text: str, index: int = 0, logprobs: Sequence[TokenLogprob] | None = None
    ) -> bytes:
        """A chunk of choice ``index``'s text (and its tokens' ``logprobs``, if asked for)."""
        if self.job.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if self._first[index]:
                delta = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": None}
            if logprobs is not None:
                choice["logprobs"] = oaiformat.chat_logprobs(logprobs)
        else:
            lps = None
            if logprobs is not None:
                lps = oaiformat.completion_logprobs(logprobs, self._offset[index])
            choice = {"index": index, "text": text, "finish_reason": None, "logprobs": lps}
        self._first[index] = False
        self._offset[index] += len(text)
        return sse({**self.head, "choices": [choice]})

    def finish(self, result: Result, index: int = 0) -> bytes:
        """The finish chunk of choice ``index``."""
        done: dict[str, Any] = {"index": index, "finish_reason": finish_reason(self.job, result)}
        if self.job.kind == "chat":
            done["delta"] = {"role": "assistant"} if self._first[index] else {}
        else:
            done["text"] = ""
            done["logprobs"] = None
        return sse({**self.head, "choices": [done]})

    def close(self, results: Sequence[Result]) -> bytes:
        """The usage chunk if asked for, and ``[DONE]``."""
        out = b""
        if self.job.include_usage:
            out += sse({**self.head, "choices": [], "usage": usage(results)})
        return out + DONE

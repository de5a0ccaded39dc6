"""The OpenAI request bodies the gateway reads: ``/v1/chat/completions`` and
``/v1/completions`` become one :class:`Job` (model, prompt, output bound, streaming).

A chat's messages are rendered by the model's own chat template when the gateway has one
(:mod:`sluice.common.chattemplate`), else by Sluice's neutral template
(:func:`sluice.common.chat.render_chat`, as ``sluice engine`` renders them), so every turn of a
conversation starts with the text of the turn before it. A completion's prompt is a string or
a list of token ids.

Sluice relays a prompt, an output bound and the sampling fields
(:func:`sluice.client.sampling.openai_sampling`: ``temperature``, ``top_p``, ``seed``, the
penalties, ``stop``, ``logprobs``, ``response_format``, ...) to the engine; ``n`` choices run
as ``n`` requests. Fields that would change what the engine returns in ways the caller relies
on and that Sluice does not relay (``tools``, ``echo``, ``suffix``, ``best_of`` > 1,
``logit_bias``, guided decoding by an engine's own fields) are refused with a 400 rather than
ignored; fields the gateway does not know (``store``, ``metadata``, ...) are accepted and have
no effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.client import jsontext
from sluice.client.errors import InvalidRequest
from sluice.client.oaiformat import Kind
from sluice.client.sampling import openai_sampling
from sluice.common.chat import ChatError
from sluice.common.chattemplate import ChatOptions, ChatRender, chat_prompt
from sluice.gateway.errors import BadRequest
from sluice.schemas.models import MAX_OUTPUT_TOKENS, Sampling

SESSION_HEADER = "x-session-id"
"""The request header naming a session (a conversation): its requests stick to the workers
that hold its history. Without it, the body's ``user`` field is the session."""
MAX_CHOICES = 16
"""The most choices (``n``) a request may ask for, unless the gateway's ``max_choices`` says."""
SESSION_MAX_CHARS = 128
"""The longest session id (the wire's limit on names)."""


@dataclass(frozen=True)
class Job:
    """One completion request, as the gateway relays it."""

    kind: Kind
    model: str
    prompt: str | list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    user: str | None
    sampling: Sampling | None = None
    n: int = 1
    """Choices asked for: each runs as a request of its own (a seed, if given, advanced by
    one for each, so that sampled choices differ)."""


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; ``BadRequest`` otherwise."""
    try:
        body = jsontext.loads(raw)
    except jsontext.JsonTextError as exc:
        raise BadRequest(f"the body is {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _positive_int(body: Mapping[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise BadRequest(f"{key} must be an integer from 1 to {MAX_OUTPUT_TOKENS}", param=key)
    return value


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean", param=key)
    return value


def _choices(body: Mapping[str, Any], max_choices: int) -> int:
    """``n``: how many choices (each its own request); 1 if not given."""
    n = body.get("n")
    if n is None:
        return 1
    # (isinstance: True == 1 in Python, and JSON's true is no count.)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_choices:
        raise BadRequest(f"n must be an integer from 1 to {max_choices}", param="n")
    return n


def _common(
    body: Mapping[str, Any], kind: Kind, default_max_tokens: int, max_choices: int
) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model must be a non-empty string", param="model")
    n = _choices(body, max_choices)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user must be a string", param="user")
    try:
        sampling = openai_sampling(body, kind)
    except InvalidRequest as exc:
        raise BadRequest(str(exc), param=exc.param) from exc
    return {
        "kind": kind,
        "model": model,
        "max_tokens": _positive_int(body, key, default_max_tokens),
        "stream": _flag(body, "stream"),
        "include_usage": _flag(options or {}, "include_usage"),
        "user": user or None,
        "sampling": sampling,
        "n": n,
    }


def choice_sampling(sampling: Sampling | None, choice: int) -> Sampling | None:
    """The sampling of choice ``choice`` of an answer: a seed advanced by ``choice`` (so that
    the choices of a seeded request differ, and repeat with it), else as asked."""
    if choice == 0 or sampling is None or sampling.seed is None:
        return sampling
    seed = sampling.seed + choice
    if seed >= 2**63:  # (the wire's int64)
        seed -= 2**64
    return sampling.model_copy(update={"seed": seed})


def chat_job(
    body: Mapping[str, Any],
    default_max_tokens: int,
    render: ChatRender = chat_prompt,
    max_choices: int = MAX_CHOICES,
) -> Job:
    """The job of a ``/v1/chat/completions`` body, its messages (and ``add_generation_prompt``,
    ``continue_final_message``, ``chat_template_kwargs``) rendered by ``render``: the model's
    chat template, or Sluice's neutral one."""
    fields = _common(body, "chat", default_max_tokens, max_choices)
    try:
        prompt = render(body.get("messages"), ChatOptions.from_body(body))
    except ChatError as exc:
        raise BadRequest(str(exc), param=exc.param) from exc
    return Job(prompt=prompt, **fields)


def completion_job(
    body: Mapping[str, Any], default_max_tokens: int, max_choices: int = MAX_CHOICES
) -> Job:
    """The job of a ``/v1/completions`` body: ``prompt`` is a string or token ids (a list of
    one of either is taken as that one)."""
    fields = _common(body, "completion", default_max_tokens, max_choices)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return Job(prompt=prompt, **fields)
    if (
        isinstance(prompt, list)
        and prompt
        and all(type(t) is int for t in prompt)  # not bool, which is an int too
        and min(prompt) >= 0
        and max(prompt) < 2**32
    ):
        return Job(prompt=list(prompt), **fields)
    raise BadRequest(
        "prompt must be a non-empty string or a list of token ids (one prompt per request)",
        param="prompt",
    )


def _utf8(header: str) -> str:
    """A header's text as its sender wrote it: ASGI servers decode header bytes as Latin-1,
    so a UTF-8 session id ("café") read as "cafÃ©", twice as long as sent; bytes that are
    not UTF-8 stay as they were read."""
    try:
        return header.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return header


def session_of(header: str | None, job: Job) -> str | None:
    """The request's session: the ``x-session-id`` header, else the body's ``user``."""
    if header is not None:
        header = _utf8(header)
    session = header.strip() if header is not None and header.strip() else job.user
    if session is not None and len(session) > SESSION_MAX_CHARS:
        param = SESSION_HEADER if header else "user"
        raise BadRequest(f"a session id has at most {SESSION_MAX_CHARS} characters", param=param)
    return session

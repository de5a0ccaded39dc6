"""Sampling parameters (:class:`~sluice.schemas.models.Sampling`) from what a producer gives:
keyword values to :meth:`Client.submit <sluice.client.Client.submit>`, or an OpenAI request
body (the gateway's and a batch file's).

An OpenAI body's ``temperature``, ``top_p``, ``seed``, ``frequency_penalty``,
``presence_penalty`` and ``stop`` (a string or a list of them), and vLLM's and SGLang's
``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``min_tokens`` and
``ignore_eos``, reach the engine, and so do log probabilities: a completion's ``logprobs``
(how many alternatives per token), a chat's ``logprobs: true`` with ``top_logprobs``. What
Sluice cannot honour is refused, never ignored (:data:`UNSUPPORTED`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ValidationError

from sluice.client.errors import InvalidRequest
from sluice.schemas.models import MAX_LOGPROBS, Sampling

__all__ = ["SAMPLING_FIELDS", "UNSUPPORTED", "Sampling", "openai_sampling", "sampling_of"]

SAMPLING_FIELDS: tuple[str, ...] = tuple(k for k in Sampling.model_fields if k != "logprobs")
"""The body keys that become :class:`Sampling` as they are (the same names in OpenAI, vLLM
and SGLang); ``logprobs`` is read by the endpoint's meaning (:func:`openai_sampling`)."""
UNSUPPORTED: tuple[str, ...] = (
    "tools",
    "functions",
    "prompt_logprobs",
    "suffix",
    "echo",
    "logit_bias",
    "include_stop_str_in_output",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "json_schema",
    "ebnf",
    "stop_regex",
    "chat_template",
    "documents",
)
"""Body keys that change what the engine returns in ways a caller relies on, which Sluice
does not relay: refused with a 400 when set (null, false or empty is no request)."""


def _asked(value: Any) -> bool:
    return value is not None and value is not False and value not in ("", 0, [], {})


def sampling_of(value: Sampling | Mapping[str, Any] | None) -> Sampling | None:
    """``value`` as :class:`Sampling` (None, an empty mapping and a :class:`Sampling` with
    nothing set: the engine's defaults); :class:`InvalidRequest` naming the field when it is
    not valid."""
    if value is None:
        return None
    if not isinstance(value, Sampling | Mapping):
        raise InvalidRequest(f"sampling must be a Sampling or a mapping, not {value!r}")
    if isinstance(value, Mapping):
        try:
            value = Sampling.model_validate(dict(value))
        except ValidationError as exc:
            err = exc.errors()[0]
            param = str(err["loc"][0]) if err["loc"] else None
            raise InvalidRequest(f"{param or 'sampling'}: {err['msg']}", param=param) from None
    return value or None


def openai_sampling(
    body: Mapping[str, Any], kind: Literal["chat", "completion"]
) -> Sampling | None:
    """The sampling fields of an OpenAI completions or chat body (``kind``; others are not
    read), and :class:`InvalidRequest` (with ``param``) for a refused or invalid one. ``stop``
    may be one string or a list, as in OpenAI's API; ``null`` means unset."""
    for key in UNSUPPORTED:
        if key in body and _asked(body[key]):
            raise InvalidRequest(f"{key} is not supported by Sluice", param=key)
    best_of = body.get("best_of")  # (1 is no request: one sample per choice)
    if best_of is not None and (best_of != 1 or isinstance(best_of, bool)):
        raise InvalidRequest("best_of is not supported by Sluice", param="best_of")
    fields = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    if kind == "chat":
        top = _chat_logprobs(body)
    elif body.get("top_logprobs") is not None:
        raise InvalidRequest(
            "top_logprobs is a chat field: a completion's logprobs is the count",
            param="top_logprobs",
        )
    else:
        top = body.get("logprobs")
    if top is not None and top is not False:  # (a completion's false: none asked for)
        fields["logprobs"] = top
    return sampling_of(fields)


def _chat_logprobs(body: Mapping[str, Any]) -> Any:
    """A chat's ``logprobs`` (a flag) and ``top_logprobs`` (a count) as the one count
    :attr:`Sampling.logprobs` is, or None; OpenAI's rules: a count needs the flag."""
    flag, top = body.get("logprobs"), body.get("top_logprobs")
    if flag is not None and not isinstance(flag, bool):
        raise InvalidRequest("logprobs must be a boolean", param="logprobs")
    if not flag:
        if top is not None:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    if top is None:
        return 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}", param="top_logprobs"
        )
    return top

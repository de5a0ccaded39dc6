"""Sampling parameters (:class:`~sluice.schemas.models.Sampling`) from what a producer gives:
keyword values to :meth:`Client.submit <sluice.client.Client.submit>`, or an OpenAI request
body (the gateway's and a batch file's).

An OpenAI body's ``temperature``, ``top_p``, ``seed``, ``frequency_penalty``,
``presence_penalty`` and ``stop`` (a string or a list of them), and vLLM's and SGLang's
``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``min_tokens`` and
``ignore_eos``, reach the engine. What Sluice cannot honour is refused, never ignored
(:data:`UNSUPPORTED`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from sluice.client.errors import InvalidRequest
from sluice.schemas.models import Sampling

__all__ = ["SAMPLING_FIELDS", "UNSUPPORTED", "Sampling", "openai_sampling", "sampling_of"]

SAMPLING_FIELDS: tuple[str, ...] = tuple(Sampling.model_fields)
"""The body keys that become :class:`Sampling` (the same names in OpenAI, vLLM and SGLang)."""
UNSUPPORTED: tuple[str, ...] = (
    "tools",
    "functions",
    "logprobs",
    "top_logprobs",
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
does not relay: refused with a 400 when set (null, false or empty is no request; for
``logprobs``, 0 is one: a completion's chosen tokens' own)."""


def _asked(key: str, value: Any) -> bool:
    if value is None or value is False:
        return False
    return key == "logprobs" or value not in ("", 0, [], {})


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


def openai_sampling(body: Mapping[str, Any]) -> Sampling | None:
    """The sampling fields of an OpenAI completions or chat body (others are not read), and
    :class:`InvalidRequest` (with ``param``) for a refused or invalid one. ``stop`` may be one
    string or a list, as in OpenAI's API; ``null`` means unset."""
    for key in UNSUPPORTED:
        if key in body and _asked(key, body[key]):
            raise InvalidRequest(f"{key} is not supported by Sluice", param=key)
    return sampling_of({k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None})

"""Sampling parameters (:class:`~sluice.schemas.models.Sampling`) from what a producer gives:
keyword values to :meth:`Client.submit <sluice.client.Client.submit>`, or an OpenAI request
body (the gateway's and a batch file's).

An OpenAI body's ``temperature``, ``top_p``, ``seed``, ``frequency_penalty``,
``presence_penalty`` and ``stop`` (a string or a list of them), and vLLM's and SGLang's
``top_k``, ``min_p``, ``repetition_penalty`` and ``stop_token_ids``, reach the engine. What
Sluice cannot honour is refused, never ignored (:data:`UNSUPPORTED`).
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
    "suffix",
    "echo",
    "logit_bias",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
"""Body keys that change what the engine returns in ways a caller relies on, which Sluice
does not relay: refused with a 400 when set (a false, null or empty value is no request)."""


def sampling_of(value: Sampling | Mapping[str, Any] | None) -> Sampling | None:
    """``value`` as :class:`Sampling` (None and an empty mapping: the engine's defaults);
    :class:`InvalidRequest` naming the field when it is not valid."""
    if value is None or isinstance(value, Sampling):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"sampling must be a Sampling or a mapping, not {value!r}")
    if not value:
        return None
    try:
        return Sampling.model_validate(dict(value))
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        raise InvalidRequest(f"{param or 'sampling'}: {err['msg']}", param=param) from None


def openai_sampling(body: Mapping[str, Any]) -> Sampling | None:
    """The sampling fields of an OpenAI completions or chat body (others are not read), and
    :class:`InvalidRequest` (with ``param``) for a refused or invalid one. ``stop`` may be one
    string or a list, as in OpenAI's API; ``null`` means unset."""
    for key in UNSUPPORTED:
        if body.get(key):
            raise InvalidRequest(f"{key} is not supported by Sluice", param=key)
    given = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    stop = given.get("stop")
    if isinstance(stop, str):
        given["stop"] = [stop]
    elif stop is not None and not isinstance(stop, list):
        raise InvalidRequest("stop must be a string or a list of strings", param="stop")
    for key, value in given.items():
        # JSON's true is no number (pydantic would take it as 1).
        if isinstance(value, bool):
            raise InvalidRequest(f"{key} must be a number, not {value}", param=key)
    return sampling_of(given)

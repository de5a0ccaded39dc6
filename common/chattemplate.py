"""A model's own chat template: an OpenAI ``messages`` list rendered as the model was trained
to read it (Llama's, Qwen's, Mistral's, ...), instead of Sluice's one neutral template
(:func:`sluice.common.chat.render_chat`).

The template is the Jinja source a Hugging Face tokenizer ships (``chat_template`` in its
``tokenizer_config.json``, or a ``.jinja`` file), rendered as ``transformers`` and vLLM render
it: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the loop controls,
``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII text, with
``messages``, ``add_generation_prompt=True`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables.

The rendered chat then travels as any prompt (text, or token ids with a tokenizer) and reaches
the engine's completions endpoint, which adds the tokenizer's special tokens itself: so a
``bos_token`` the template wrote at the start is taken off first, and the engine sees one, as
its own chat endpoint gives it (which tokenizes the rendered chat without adding any).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice.common.chat import ChatError, message_text
from sluice.common.errors import ConfigError

__all__ = ["ChatTemplate"]

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
"""The tokenizer's special tokens a template may name (transformers passes them all)."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _special(config: Mapping[str, Any], name: str) -> str:
    # tokenizer_config.json gives a special token as its text or as an AddedToken object.
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        """``source``: the Jinja template; ``special_tokens``: ``bos_token`` and the others by
        name (missing ones render empty). Raises :class:`ConfigError` for a template that does
        not compile."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the chat template does not compile: {exc}") from exc
        given = dict(special_tokens or {})
        self.special_tokens = {name: given.get(name, "") for name in _SPECIAL_TOKENS}
        self.bos_token = self.special_tokens["bos_token"]

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTemplate:
        """From a ``tokenizer_config.json`` (its ``chat_template``, the ``default`` one of a
        list of named templates, and its special tokens) or a Jinja file (``.jinja``, any
        other name: the template itself, without special tokens). :class:`ConfigError` if it
        cannot be read or holds no template."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the chat template {p}: {exc}") from exc
        if p.suffix != ".json":
            return cls(text)
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p} is not JSON: {exc}") from exc
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"{p} has no chat_template (a string, or a list with 'default')")
        return cls(source, {name: _special(config, name) for name in _SPECIAL_TOKENS})

    def render(self, messages: Any) -> str:
        """The prompt of a chat, ready to be sent as a completion's prompt (a leading
        ``bos_token`` taken off: the engine adds its own). :class:`ChatError` for messages
        that are not a chat, or that the template refuses (``raise_exception``: roles that do
        not alternate, a system message where the model takes none, ...)."""
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
                raise ChatError(f"messages[{i}] needs a role")
            # Text parts joined, as render_chat joins them: templates read a string.
            chat.append({**m, "content": message_text(i, m.get("content"))})
        try:
            text = self._template.render(
                messages=chat, add_generation_prompt=True, **self.special_tokens
            )
        except jinja2.TemplateError as exc:
            raise ChatError(f"the model's chat template refused the messages: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError) as exc:
            # (the template's own bug, or content it did not expect: a filter on a wrong type)
            raise ChatError(f"the model's chat template failed: {exc!r}") from exc
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if not text:
            raise ChatError("the model's chat template rendered nothing")
        return text

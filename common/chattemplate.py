"""A model's own chat template: an OpenAI ``messages`` list rendered as the model was trained
to read it (Llama's, Qwen's, Mistral's, ...), instead of Sluice's one neutral template
(:func:`sluice.common.chat.render_chat`).

The template is the Jinja source a Hugging Face tokenizer ships (``chat_template.jinja``, or
``chat_template`` in its ``tokenizer_config.json``), rendered as ``transformers`` and vLLM
render it: a sandboxed, immutable environment with ``trim_blocks`` and ``lstrip_blocks``, the
loop controls and the ``{% generation %}`` block, ``raise_exception``, ``strftime_now`` and
``tojson`` as transformers defines them, with ``messages``, ``tools`` and ``documents``
(None), ``add_generation_prompt``, the tokenizer's special tokens and the request's
``chat_template_kwargs`` as variables. A message's content goes in as a string, or, to a
template that loops over content parts, as its list of parts (vLLM's detection).

vLLM's chat endpoint tokenizes the rendered text without adding special tokens (the template
wrote those it wants). :meth:`ChatTemplate.prompt` does the same with the engine's tokenizer
and sends the ids. Without one the text goes to the engine's completions endpoint, which adds
the tokenizer's special tokens itself: a ``bos_token`` the template wrote first is taken off so
that the engine sees one (the same as its chat endpoint whenever the template writes the BOS
the tokenizer adds, as Llama's, Mistral's and Gemma's do).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice.common.chat import ChatError, chat_messages, message_text, render_chat
from sluice.common.errors import ConfigError
from sluice.common.tokenizer import PromptTokenizer

__all__ = ["MAX_RENDERED_CHARS", "ChatOptions", "ChatRender", "ChatTemplate", "chat_prompt"]

MAX_RENDERED_CHARS = 64 * 1024 * 1024
"""The longest rendered chat: a template that runs away is stopped there, not left to fill
the memory (the broker would refuse a prompt near this long anyway)."""
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
"""The tokenizer's special tokens a template may name (transformers passes them all, and
``additional_special_tokens``)."""
_RESERVED = frozenset({"messages", "add_generation_prompt", *_SPECIAL_TOKENS})
"""Variables a request's ``chat_template_kwargs`` may not set: the chat itself, and the
tokenizer's special tokens (a request must not make the template write another BOS)."""
_TEMPLATE_BUGS = (
    ArithmeticError,
    LookupError,
    TypeError,
    ValueError,
    AttributeError,
    RecursionError,
)
"""What a template's own mistakes raise while it compiles or renders (a filter on a wrong
type, a division by zero, a macro that recurses for ever)."""
log = logging.getLogger("sluice.chat")
_SIDE_TEMPLATE = "chat_template.jinja"
"""Where newer Hugging Face repositories keep the template, beside ``tokenizer_config.json``
(transformers 4.47 on): it wins over one inside the config."""


@dataclass(frozen=True)
class ChatOptions:
    """A chat request's own say in its rendering (vLLM's names): ``add_generation_prompt``
    (the cue the reply follows), ``continue_final_message`` (the last message is an answer to
    go on with, cut where it ends), and ``kwargs``, more variables for the template
    (``chat_template_kwargs``: ``enable_thinking`` and the like)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def default(self) -> bool:
        """Whether these are the defaults (what the neutral template can render)."""
        return self == ChatOptions()

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ChatOptions:
        """A chat completions body's ``add_generation_prompt``, ``continue_final_message``
        and ``chat_template_kwargs`` (vLLM's fields); :class:`ChatError` naming a bad one."""
        flags = {}
        for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
            value = body.get(name)
            if value is not None and not isinstance(value, bool):
                raise ChatError(f"{name} must be a boolean", name)
            flags[name] = default if value is None else value
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ChatError("chat_template_kwargs must be an object", "chat_template_kwargs")
        reserved = sorted(set(kwargs or {}) & _RESERVED)
        if reserved:
            raise ChatError(
                f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
            )
        return cls(kwargs=dict(kwargs or {}), **flags)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's tokens for training
    masks in transformers; rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        out: str = caller()
        return out


def _special(config: Mapping[str, Any], name: str) -> str:
    # tokenizer_config.json gives a special token as its text or as an AddedToken object.
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _content_parts(template: nodes.Template) -> bool:
    """Whether the template loops over a message's content (``for p in m['content']``, maybe
    through a filter): then content goes in as OpenAI's list of parts, as vLLM gives it."""
    for loop in template.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter | nodes.Test) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
        named = isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const)
        if named and it.arg.value == "content":  # type: ignore[attr-defined]
            return True
    return False


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the chat template {path}: {exc}") from exc


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(_read(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(
        self, source: str, special_tokens: Mapping[str, Any] | None = None, origin: str = ""
    ) -> None:
        """``source``: the Jinja template; ``special_tokens``: ``bos_token`` and the others by
        name (missing ones render empty; ``additional_special_tokens`` a list). Raises
        :class:`ConfigError` for a template that does not compile."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _Generation],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        where = f" ({origin})" if origin else ""
        try:
            parsed = env.parse(source)  # (once: compiled and read for its content loops)
            self._template = env.from_string(parsed)
            self.content_parts = _content_parts(parsed)
        except (jinja2.TemplateError, *_TEMPLATE_BUGS) as exc:
            # A syntax error, or a constant jinja2 folds and fails on ({{ 10 ** 100000 }}).
            raise ConfigError(f"the chat template{where} does not compile: {exc}") from exc
        given = dict(special_tokens or {})
        self.special_tokens: dict[str, Any] = {n: given.get(n, "") for n in _SPECIAL_TOKENS}
        self.special_tokens["additional_special_tokens"] = list(
            given.get("additional_special_tokens") or []
        )
        self.bos_token: str = self.special_tokens["bos_token"]
        self.origin = origin
        self.source = source

    def spec(self) -> dict[str, Any]:
        """What the template is made of (its source and special tokens): what a batch keeps,
        so that every process renders its lines alike (:meth:`from_spec`)."""
        return {"source": self.source, "special_tokens": dict(self.special_tokens)}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> ChatTemplate:
        """The template of :meth:`spec`."""
        return cls(spec["source"], spec.get("special_tokens") or {}, "a batch's")

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTemplate:
        """From a model's files: its ``tokenizer_config.json`` (the ``chat_template.jinja``
        beside it if there is one, else its ``chat_template``, the ``default`` one of a list
        of named templates), or a Jinja file (its special tokens from the
        ``tokenizer_config.json`` beside it, if there is one). :class:`ConfigError` if it
        cannot be read or holds no template."""
        p = Path(path)
        if p.suffix == ".json":
            config, side = _config(p), p.with_name(_SIDE_TEMPLATE)
            source: Any = _read(side) if side.is_file() else config.get("chat_template")
            if isinstance(source, list):  # named templates: the default one
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
            if not isinstance(source, str) or not source:
                raise ConfigError(
                    f"{p} has no chat_template (a string, or a list with 'default'), and no "
                    f"{_SIDE_TEMPLATE} is beside it"
                )
            origin = str(side if side.is_file() else p)
        else:
            source, origin = _read(p), str(p)
            beside = p.with_name("tokenizer_config.json")
            config = _config(beside) if beside.is_file() else {}
        tokens: dict[str, Any] = {n: _special(config, n) for n in _SPECIAL_TOKENS}
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            tokens["additional_special_tokens"] = [
                t.get("content") if isinstance(t, dict) else t for t in extra
            ]
        return cls(source, tokens, origin)

    def render(self, messages: Any, options: ChatOptions | None = None) -> str:
        """The whole text of a chat as the template renders it (its leading BOS included).
        :class:`ChatError` for messages that are not a chat, or that the template refuses
        (``raise_exception``: roles that do not alternate, a system message where the model
        takes none, ...) or fails on."""
        opts = options or ChatOptions()
        if opts.continue_final_message and opts.add_generation_prompt:
            raise ChatError(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        chat = self._messages(messages)
        variables = {
            **self.special_tokens,
            "tools": None,
            "documents": None,
            **opts.kwargs,
            "messages": chat,
            "add_generation_prompt": opts.add_generation_prompt,
        }
        try:
            text = "".join(_bounded(self._template.generate(**variables)))
        except jinja2.TemplateError as exc:
            raise ChatError(f"the model's chat template refused the messages: {exc}") from exc
        except ChatError:  # (the rendering's bound: a ValueError too, but no bug)
            raise
        except _TEMPLATE_BUGS as exc:
            # The template's own bug, or content it did not expect: the request is answered
            # with it, and the operator told (a template that fails on every chat is theirs).
            log.warning("the chat template %s failed: %r", self.origin or "(inline)", exc)
            raise ChatError(f"the model's chat template failed: {exc!r}") from exc
        if opts.continue_final_message:
            text = _cut_after_final(text, chat[-1].get("content"))
        if not text.strip():
            raise ChatError("the model's chat template rendered nothing")
        return text

    def prompt(
        self,
        messages: Any,
        options: ChatOptions | None = None,
        tokenizer: PromptTokenizer | None = None,
    ) -> str | list[int]:
        """The prompt to send for a chat: with the engine's ``tokenizer``, the rendered text's
        ids without special tokens added (as vLLM's chat endpoint tokenizes it); without, the
        text with a leading ``bos_token`` taken off (the engine's completions endpoint adds
        its own)."""
        text = self.render(messages, options)
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise ChatError("the rendered chat has no tokens for the configured tokenizer")
            return ids
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if not text.strip():
            raise ChatError("the model's chat template rendered nothing but its BOS")
        return text

    def _messages(self, messages: Any) -> list[dict[str, Any]]:
        chat = []
        for i, m in enumerate(chat_messages(messages)):
            content = m.get("content")
            if content is not None:  # (none: an assistant's tool calls, as transformers has it)
                text = message_text(i, content)  # (checks the parts: text only)
                content = [{"type": "text", "text": text}] if self.content_parts else text
                if self.content_parts and isinstance(m.get("content"), list):
                    content = m["content"]
            chat.append({**m, "content": content})
        return chat


def _bounded(pieces: Iterator[str]) -> Iterator[str]:
    total = 0
    for piece in pieces:
        total += len(piece)
        if total > MAX_RENDERED_CHARS:
            raise ChatError(f"the rendered chat is longer than {MAX_RENDERED_CHARS} characters")
        yield piece


def _cut_after_final(text: str, content: Any) -> str:
    """The rendered chat cut right after the final message's text (transformers'
    ``continue_final_message``): what the template closes it with goes."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    final = content if isinstance(content, str) else ""
    for candidate in (final, final.strip()):
        if candidate and candidate in text:
            return text[: text.rindex(candidate) + len(candidate)]
    raise ChatError(
        "continue_final_message: the final message's text is not in the rendered chat",
        "continue_final_message",
    )


ChatRender = Callable[[Any, ChatOptions], "str | list[int]"]
"""Messages and their options to the prompt to send (:func:`chat_prompt` with a template and
a tokenizer bound)."""


def chat_prompt(
    messages: Any,
    options: ChatOptions | None = None,
    template: ChatTemplate | None = None,
    tokenizer: PromptTokenizer | None = None,
) -> str | list[int]:
    """The prompt of a chat: by the model's ``template`` (:meth:`ChatTemplate.prompt`), or
    Sluice's neutral one (text, tokenized later as any text prompt). Options other than the
    defaults need a model's template: :class:`ChatError` without one."""
    if template is not None:
        return template.prompt(messages, options, tokenizer)
    if options is not None and not options.default:
        param = (
            "chat_template_kwargs"
            if options.kwargs
            else "continue_final_message"
            if options.continue_final_message
            else "add_generation_prompt"
        )
        raise ChatError(
            f"{param} needs the model's chat template (the chat_template setting)", param
        )
    return render_chat(messages)

"""Sluice's neutral chat template: an OpenAI ``messages`` list rendered into one prompt, where
no model's own template is configured (:mod:`sluice.common.chattemplate`).

``sluice gateway`` (the producers' OpenAI face) and ``sluice engine`` (the simulated engine's
server) both render chats with :func:`render_chat`, so a chat renders to the same text in
either place, and the same text always: a conversation's next turn starts with the whole text
of the turn before it (its messages, then the ``<|assistant|>`` cue the reply followed), so it
keeps its prefix, and with a tokenizer its token ids, for the prefix caches of the fleet.

The template, per message ``<|ROLE|>\\nCONTENT\\n``, then ``<|assistant|>\\n``. ``content`` is a
string, or a list of text parts (``{"type": "text", "text": ...}``) joined without a separator,
as OpenAI accepts them; anything else (images, audio, tool calls without text) is refused.
"""

from __future__ import annotations

from typing import Any

from sluice.common.errors import CommonError

ASSISTANT_CUE = "<|assistant|>\n"
"""What every rendered chat ends with: the reply follows it."""


class ChatError(CommonError, ValueError):
    """Messages that cannot be rendered (its message says which and why); ``param`` names the
    request field at fault (``messages``)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def message_text(i: int, content: Any) -> str:
    """The text of message ``i``'s ``content``: a string, or its text parts joined;
    :class:`ChatError` for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ChatError(f"messages[{i}].content[{j}] must be a text part")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatError(f"messages[{i}].content must be a string or a list of text parts")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` if they are a chat: a non-empty list of objects, each with a role;
    :class:`ChatError` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise ChatError(f"messages[{i}] needs a role")
    return messages


def render_chat(messages: Any) -> str:
    """The prompt of a chat: one deterministic template (see the module docstring), so a
    conversation keeps its prefix. Raises :class:`ChatError` for messages it cannot render."""
    parts = []
    for i, m in enumerate(chat_messages(messages)):
        parts.append(f"<|{m['role']}|>\n{message_text(i, m.get('content'))}\n")
    return "".join(parts) + ASSISTANT_CUE

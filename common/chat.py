"""The chat template: chat messages rendered into one prompt, the same way everywhere (the
gateway, offline batches, ``sluice engine``), so that a conversation keeps its prefix turn
after turn (and, through a tokenizer, its token ids), and so its worker.

Each message becomes ``<|role|>\\ncontent\\n``; the prompt ends with ``<|assistant|>\\n``. Content
is a string or OpenAI's list of parts, of which the ``text`` parts are joined.
"""

from __future__ import annotations

from typing import Any

from sluice.common.errors import CommonError


class InvalidChat(CommonError, ValueError):
    """Chat messages that cannot be rendered; ``param`` names the field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def _content(value: Any, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidChat(f"messages[{i}].content[{j}] must be a text part")
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidChat(f"messages[{i}].content[{j}].text must be a string")
            texts.append(text)
        return "".join(texts)
    raise InvalidChat(f"messages[{i}].content must be a string or a list of text parts")


def render_chat(messages: Any) -> str:
    """The prompt of a chat (``InvalidChat`` for messages that are not a chat)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidChat("messages must be a non-empty list")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidChat(f"messages[{i}] needs a role")
        parts.append(f"<|{m['role']}|>\n{_content(m.get('content'), i)}\n")
    return "".join(parts) + "<|assistant|>\n"

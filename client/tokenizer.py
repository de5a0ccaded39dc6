"""A prompt tokenizer loaded from a local ``tokenizer.json`` (the ``tokenizers`` package), so
that text prompts become the engine's token ids before they are hashed.

With the engine's own tokenizer configured, the client sends token ids: client, dispatcher and
agent hash the same ids the engine caches, so Sluice's prompt blocks line up with the engine's
(predicted hits are the engine's hits). Without one, text prompts are hashed in 64-byte chunks
(about 16 tokens each at 4 bytes a token): a prefix shared byte for byte still hashes the same,
but block edges fall where the engine's do not, and a hit is known only to within a block.
"""

from __future__ import annotations

from pathlib import Path

from sluice.common.errors import ConfigError


class PromptTokenizer:
    """Text to token ids with a ``tokenizers`` tokenizer (no special tokens added: the ids of
    the text itself, as an engine computes its prompt)."""

    def __init__(self, tokenizer: object, source: str = "") -> None:
        self._tok = tokenizer
        self.source = source

    @classmethod
    def from_file(cls, path: str | Path) -> PromptTokenizer:
        """Load ``tokenizer.json``; a missing or unreadable file is a ``ConfigError``."""
        from tokenizers import Tokenizer

        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"tokenizer file {p} does not exist")
        try:
            return cls(Tokenizer.from_file(str(p)), str(p))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise ConfigError(f"tokenizer file {p} is not a tokenizer.json: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
        return ids

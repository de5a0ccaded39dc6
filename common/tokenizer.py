"""A prompt tokenizer loaded from a local ``tokenizer.json`` (the ``tokenizers`` package), so
that text prompts become the engine's token ids before they are hashed.

With the engine's own tokenizer configured, Sluice hashes the ids the engine caches, so its
prompt blocks line up with the engine's (predicted hits are the engine's hits): the client
sends token ids, and a dispatcher or agent given a text prompt (a producer without a
tokenizer, later the gateway) tokenizes it the same way. An agent that tokenized a prompt sends
the engine the ids, so the engine caches exactly what was hashed. Without one, text prompts
are hashed in 64-byte chunks (about 16 tokens each at 4 bytes a token): a prefix shared byte
for byte still hashes the same, but block edges fall where the engine's do not, a hit is known
only to within a block, and an engine's KV events (token ids) never match those blocks.

Special tokens are added as the engines add them to a text prompt of ``/v1/completions``
(vLLM's ``add_special_tokens`` defaults to true, SGLang's ``/generate`` encodes the same way):
a tokenizer whose post-processor puts a BOS first gives the engine's first block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from sluice.common.errors import ConfigError


class PromptTokenizer:
    """Text to token ids with a ``tokenizers`` tokenizer, as an engine computes its prompt."""

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids, the tokenizer's special tokens added as a completion's prompt
        gets them (``add_special_tokens=False``: as a rendered chat is tokenized); a text that
        is not valid Unicode (a lone surrogate, which a JSON ``\\ud800`` escape gives) raises
        ``UnicodeEncodeError``, as encoding it would (the library raised a ``TypeError``, a
        500 where a 400 was due)."""
        try:
            encoded = self._tok.encode(  # type: ignore[attr-defined]
                text, add_special_tokens=add_special_tokens
            )
            ids: list[int] = encoded.ids
        except TypeError:
            text.encode("utf-8")  # the reason, if it is one
            raise
        return ids


class Tokenizers:
    """The tokenizer of each model: one for every model, and per-model overrides, each file
    loaded once (a bad file is a ``ConfigError`` at start, not at the first request)."""

    def __init__(
        self, default: str | Path | None = None, per_model: Mapping[str, str | Path] | None = None
    ) -> None:
        loaded: dict[str, PromptTokenizer] = {}

        def load(path: str | Path) -> PromptTokenizer:
            key = str(path)
            if key not in loaded:
                loaded[key] = PromptTokenizer.from_file(path)
            return loaded[key]

        self._default = None if default is None else load(default)
        self._models = {m: load(p) for m, p in (per_model or {}).items()}

    def __bool__(self) -> bool:
        return self._default is not None or bool(self._models)

    def for_model(self, model: str) -> PromptTokenizer | None:
        return self._models.get(model, self._default)

    def prompt_ids(
        self, model: str, tokens: Sequence[int] | None, text: str | None
    ) -> Sequence[int] | None:
        """The prompt's token ids: given, or a text prompt through the model's tokenizer;
        None when it is text and the model has no tokenizer (the byte fallback). A text that
        has no tokens for the tokenizer stays text (its size is then estimated, not zero)."""
        if tokens is not None:
            return tokens
        tok = self.for_model(model)
        if tok is None or text is None:
            return None
        return tok.encode(text) or None

"""Prefix block hashing: the one definition that client, dispatcher and agent share.

A prompt is cut into fixed blocks (default 16 tokens, the engines' KV block size). Each full
block's hash is a 64-bit xxhash of the previous block's hash followed by the block's token ids
(little-endian uint32), so a hash identifies the whole prefix up to and including its block:
two prompts share block ``i``'s hash only if they agree on every token up to it. A trailing
partial block is not hashed (engines do not cache it either).

Tokenizer-free fallback: a text prompt is hashed the same way over its UTF-8 bytes in chunks of
``block_tokens * TEXT_BYTES_PER_TOKEN`` bytes (64 bytes by default). It assumes ~4 bytes per
token, which is what :func:`estimate_text_tokens` uses for prompt sizes. Token and text hashes
use different seeds, so they never collide with each other.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence

import xxhash

from sluice.schemas.tokens import U32 as _U32
from sluice.schemas.tokens import TokenIds

DEFAULT_BLOCK_TOKENS = 16
DEFAULT_INDEX_TOKENS = 128
"""The dispatcher's cache index, and the agents' cache digests, keep one block hash per 128
prompt tokens (every 8th of 16-token blocks): a chained hash names its whole prefix, so the
blocks in between only add resolution, and indexing them all would cost eight times the CPU
and memory (see :func:`index_stride`)."""
TEXT_BYTES_PER_TOKEN = 4
_TOKEN_SEED = 0x5A1C_E000
_TEXT_SEED = 0x5A1C_E001
_SESSION_SEED = 0x5A1C_E002
_PREV = struct.Struct("<Q")


def index_stride(block_tokens: int, index_tokens: int = DEFAULT_INDEX_TOKENS) -> int:
    """Index (and report) every this-many-th block hash of a prompt: one per ``index_tokens``,
    at least every block. 8 for 16-token engine blocks; 1 for the 512-token blocks of the
    Mooncake traces. The one definition the dispatcher, the agents and the replay use."""
    if block_tokens < 1 or index_tokens < 1:
        raise ValueError("block_tokens and index_tokens must be >= 1")
    return max(1, index_tokens // block_tokens)


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as the little-endian uint32s that :func:`packed_block_hashes` hashes. A token
    id that is not an integer in ``[0, 2**32)`` is a ``ValueError``."""
    if isinstance(tokens, TokenIds):
        return tokens.packed
    # Not through a TokenIds: a KV event packs its blocks 16 ids at a time, where making one
    # took 0.79 against 0.36 µs a block.
    try:
        packed = array(_U32, tokens)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids are integers in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    """The token ids :func:`pack_tokens` packed."""
    unpacked = array(_U32, data)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked.tolist()


def block_hashes(
    tokens: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS, parent: int = 0
) -> list[int]:
    """Chained hashes of the full ``block_tokens``-sized blocks of ``tokens``; ``parent``: the
    hash of the block before them (0: they start the prompt)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    if isinstance(tokens, TokenIds):  # packed already (a trailing partial block is not hashed)
        return packed_block_hashes(tokens.packed, block_tokens, parent)
    n_full = len(tokens) // block_tokens
    return packed_block_hashes(pack_tokens(tokens[: n_full * block_tokens]), block_tokens, parent)


def packed_block_hashes(
    data: bytes, block_tokens: int = DEFAULT_BLOCK_TOKENS, parent: int = 0
) -> list[int]:
    """:func:`block_hashes` of token ids already packed by :func:`pack_tokens` (a trailing
    partial block is not hashed)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    size = block_tokens * 4
    out: list[int] = []
    prev = parent
    digest, pack = xxhash.xxh64_intdigest, _PREV.pack
    for start in range(0, len(data) - size + 1, size):
        prev = digest(pack(prev) + data[start : start + size], _TOKEN_SEED)
        out.append(prev)
    return out


def text_block_hashes(text: str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[int]:
    """Chained hashes of fixed byte chunks of ``text`` (the tokenizer-free fallback)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    data = text.encode("utf-8")
    size = block_tokens * TEXT_BYTES_PER_TOKEN
    out: list[int] = []
    prev = 0
    for i in range(len(data) // size):
        prev = xxhash.xxh64_intdigest(
            _PREV.pack(prev) + data[i * size : (i + 1) * size], _TEXT_SEED
        )
        out.append(prev)
    return out


def session_key(tenant: str, session_id: str) -> int:
    """The affinity key of a tenant's session (a conversation): requests that carry it stick
    to the same workers, as requests with the same prompt prefix do."""
    return xxhash.xxh64_intdigest(f"{tenant}\x00{session_id}".encode(), _SESSION_SEED)


def estimate_text_tokens(text: str) -> int:
    """Prompt size in tokens for a text prompt, without a tokenizer (at least 1)."""
    return max(1, -(-len(text.encode("utf-8")) // TEXT_BYTES_PER_TOKEN))


def prompt_hashes(
    tokens: Sequence[int] | None, text: str | None, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> list[int]:
    """Block hashes for a prompt given as token ids or (fallback) as text."""
    if tokens is not None:
        return block_hashes(tokens, block_tokens)
    if text is not None:
        return text_block_hashes(text, block_tokens)
    return []


def prompt_length(tokens: Sequence[int] | None, text: str | None) -> int:
    """Prompt size in tokens: exact for token ids, estimated for text."""
    if tokens is not None:
        return len(tokens)
    if text is not None:
        return estimate_text_tokens(text)
    return 0

"""Deterministic pseudo output for the simulated engine: the same request always yields the
same tokens, so a retried attempt streams what the first one did."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

_WORDS = (  # noqa: SIM905 - one readable string, not 60 quoted words
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "up out said who about them some could into more time only new like over also"
).split()
VOCAB = 32_000


def output_token(request_id: str, index: int) -> int:
    """The ``index``-th output token id of ``request_id``."""
    return xxhash.xxh32_intdigest(f"{request_id}:{index}".encode()) % VOCAB


def detokenize(tokens: Sequence[int]) -> str:
    """Readable text for pseudo tokens (one word each)."""
    return "".join(" " + _WORDS[t % len(_WORDS)] for t in tokens)

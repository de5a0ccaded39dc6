"""Deterministic pseudo output for the simulated engine: the same request always yields the
same tokens, so a retried attempt streams what the first one did."""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

from sluice.schemas.models import LOGPROB_FLOOR, TokenLogprob, TopLogprob

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


def logprobs(tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Pseudo log probabilities of ``tokens`` and of the ``top`` most likely tokens at each
    position, a function of each token alone (a retried attempt's are the same): the token's
    probability in [0.05, 1), the rest of the mass over ``top`` other words, halving from one
    to the next. So the listed probabilities sum to at most 1, and the token itself is among
    the most likely only when it is likely enough, as in a real sample."""
    out = []
    for t in tokens:
        p = 0.05 + 0.95 * (xxhash.xxh32_intdigest(t.to_bytes(4, "little")) % 1000) / 1000
        own = " " + _WORDS[t % len(_WORDS)]
        ranked = [(math.log(p), own)]
        rest = 1.0 - p
        for j in range(1, top + 1):
            rest /= 2
            ranked.append((math.log(rest) if rest > 0 else LOGPROB_FLOOR, _other(t, j)))
        ranked.sort(key=lambda x: -x[0])
        lp = max(math.log(p), LOGPROB_FLOOR)
        out.append(
            TokenLogprob(
                text=own,
                logprob=lp,
                top=[TopLogprob(text=w, logprob=max(x, LOGPROB_FLOOR)) for x, w in ranked[:top]],
            )
        )
    return out


def _other(token: int, j: int) -> str:
    """The ``j``-th alternative word at a position of ``token`` (never the token's own: 7 * j
    is no multiple of the 60 words for j <= 20)."""
    return " " + _WORDS[(token + 7 * j) % len(_WORDS)]

"""Token coalescing (pure): streaming one message per token costs too much at fleet scale, so
a request's tokens go out in chunks. Its first token goes out at once (time to first token is
not delayed); later ones when ``flush_tokens`` are buffered or ``flush_ms`` passed since the
last chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.schemas.models import TokenLogprob


@dataclass
class TokenBuffer:
    """The output of one running request and how much of it was streamed."""

    tokens: list[int] = field(default_factory=list)
    sent: int = 0
    last_flush_s: float = 0.0
    first_token_s: float | None = None
    logprobs: list[TokenLogprob] | None = None
    """One per token, for a request that asked for them (else None)."""

    def add(
        self,
        ids: list[int],
        now_s: float,
        *,
        first: bool,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """Buffer ``ids`` (and, for a request that asked for them, their ``logprobs``, one
        per token)."""
        if (logprobs is None) != (self.logprobs is None):
            raise ValueError("logprobs are given for every token of a request or for none")
        if logprobs is not None and self.logprobs is not None:
            if len(logprobs) != len(ids):
                raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} tokens")
            self.logprobs.extend(logprobs)
        self.tokens.extend(ids)
        if first:
            self.first_token_s = now_s

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.sent

    def due(self, now_s: float, flush_ms: float, flush_tokens: int) -> bool:
        """Whether buffered tokens should go out now."""
        n = self.pending
        return n > 0 and (n >= flush_tokens or (now_s - self.last_flush_s) * 1000 >= flush_ms)

    def take(self, now_s: float) -> tuple[int, list[int]] | None:
        """The next chunk (its index in the output and its tokens), or None if nothing waits
        (its logprobs: :meth:`logprobs_of`)."""
        if self.sent >= len(self.tokens):
            return None
        index, chunk = self.sent, self.tokens[self.sent :]
        self.sent = len(self.tokens)
        self.last_flush_s = now_s
        return index, chunk

    def logprobs_of(self, index: int, count: int) -> list[TokenLogprob] | None:
        """The logprobs of ``count`` tokens from ``index`` (None: not asked for)."""
        return None if self.logprobs is None else self.logprobs[index : index + count]

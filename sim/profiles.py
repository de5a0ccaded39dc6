"""Engine profiles: the cost model parameters of a simulated GPU engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineProfile:
    """What a simulated engine costs.

    Prefill runs at ``prefill_tokens_per_s`` over *uncached* prompt tokens, at most
    ``prefill_chunk_tokens`` per step; a decode step takes ``decode_base_s +
    decode_per_seq_s * batch``; at most ``max_running`` sequences run, and the KV cache holds
    ``kv_capacity_tokens`` in blocks of ``block_tokens``.
    """

    name: str
    prefill_tokens_per_s: float
    decode_base_s: float
    decode_per_seq_s: float
    prefill_chunk_tokens: int
    max_running: int
    kv_capacity_tokens: int
    block_tokens: int
    source: str

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_base_s < 0 or self.decode_per_seq_s < 0:
            raise ValueError(f"profile {self.name}: speeds must be positive")
        if min(self.prefill_chunk_tokens, self.max_running, self.block_tokens) < 1:
            raise ValueError(f"profile {self.name}: chunk, batch and block sizes must be >= 1")
        if self.kv_capacity_tokens < self.block_tokens:
            raise ValueError(f"profile {self.name}: KV capacity below one block")

    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_tokens


REFERENCE = EngineProfile(
    name="reference",
    prefill_tokens_per_s=8_000.0,
    decode_base_s=0.006,
    decode_per_seq_s=0.00035,
    prefill_chunk_tokens=2_048,
    max_running=256,
    kv_capacity_tokens=524_288,
    block_tokens=16,
    source="the SGLang gateway's mock worker (DESIGN.md, 'The simulator')",
)

PROFILES: dict[str, EngineProfile] = {REFERENCE.name: REFERENCE}


def get_profile(name: str) -> EngineProfile:
    """The named profile; ``KeyError`` lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown engine profile {name!r}; known: {sorted(PROFILES)}") from None

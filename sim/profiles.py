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


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float
    """Dense BF16 tensor throughput, FLOP/s (datasheet, no sparsity)."""
    hbm_bytes_per_s: float
    memory_bytes: float


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # BF16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, BF16


H100 = Gpu("H100-SXM", bf16_flops=989e12, hbm_bytes_per_s=3.35e12, memory_bytes=80e9)
H200 = Gpu("H200-SXM", bf16_flops=989e12, hbm_bytes_per_s=4.8e12, memory_bytes=141e9)
LLAMA_8B = Model("llama-3.1-8b", params=8.03e9, layers=32, kv_heads=8, head_dim=128)
LLAMA_70B = Model("llama-3.1-70b", params=70.6e9, layers=80, kv_heads=8, head_dim=128)

MFU = 0.5
"""Fraction of peak FLOP/s that prefill achieves (large batched matmuls)."""
MBU = 0.7
"""Fraction of peak memory bandwidth that decode achieves."""
MEMORY_UTILISATION = 0.9
"""Share of GPU memory the engine may use (vLLM's gpu_memory_utilization default)."""
MEAN_CONTEXT_TOKENS = 2048
"""Context length whose KV a decoding sequence reads per step, for the per-sequence cost."""


def derive(gpu: Gpu, model: Model, tp: int) -> EngineProfile:
    """A profile from first principles (docs/profiles.md shows the arithmetic):

    - prefill tokens/s = tp x FLOP/s x MFU / (2 x params)  (2 FLOPs per parameter per token);
    - decode step = base + per_seq x batch, where base reads all weights once,
      weight_bytes / (tp x bandwidth x MBU), and each sequence adds reading its KV
      (MEAN_CONTEXT_TOKENS x KV bytes per token) at that bandwidth plus its 2 x params FLOPs
      at tp x FLOP/s x MFU;
    - KV capacity = (tp x memory x MEMORY_UTILISATION - weights) / KV bytes per token.
    """
    flops = tp * gpu.bf16_flops * MFU
    bandwidth = tp * gpu.hbm_bytes_per_s * MBU
    kv_tokens = (tp * gpu.memory_bytes * MEMORY_UTILISATION - model.weight_bytes) / (
        model.kv_bytes_per_token
    )
    if kv_tokens < 16:
        raise ValueError(f"{model.name} does not fit on {tp} x {gpu.name}")
    per_seq = MEAN_CONTEXT_TOKENS * model.kv_bytes_per_token / bandwidth + 2 * model.params / flops
    short = "8b" if model is LLAMA_8B else "70b"
    return EngineProfile(
        name=f"{short}-{gpu.name.split('-')[0].lower()}" + (f"-tp{tp}" if tp > 1 else ""),
        prefill_tokens_per_s=round(flops / (2 * model.params)),
        decode_base_s=round(model.weight_bytes / bandwidth, 6),
        decode_per_seq_s=round(per_seq, 7),
        prefill_chunk_tokens=2_048,
        max_running=256,
        kv_capacity_tokens=int(kv_tokens) // 16 * 16,
        block_tokens=16,
        source=(
            f"first principles: {model.name} BF16 on {tp} x {gpu.name}, MFU {MFU}, MBU {MBU}, "
            f"memory use {MEMORY_UTILISATION}, mean context {MEAN_CONTEXT_TOKENS}"
        ),
    )


DERIVED = (
    derive(H100, LLAMA_8B, 1),
    derive(H200, LLAMA_8B, 1),
    derive(H100, LLAMA_70B, 4),
    derive(H200, LLAMA_70B, 2),
)

PROFILES: dict[str, EngineProfile] = {p.name: p for p in (REFERENCE, *DERIVED)}


def get_profile(name: str) -> EngineProfile:
    """The named profile; ``KeyError`` lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown engine profile {name!r}; known: {sorted(PROFILES)}") from None

"""Synthetic workload pieces for the demo: shared system prompts, growing conversations,
shared RAG documents and unique batch prompts, as token ids (pure, seeded)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

VOCAB = 32_000


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@dataclass
class Conversation:
    """A multi-turn chat: every turn's prompt is the system prompt, the history so far and a
    new user message, so consecutive turns share an ever longer prefix."""

    system_prompt: list[int]
    history: list[int] = field(default_factory=list)
    turns: int = 0

    def next_prompt(self, rng: random.Random, user_tokens: int) -> list[int]:
        self.history += random_tokens(rng, user_tokens)
        self.turns += 1
        return self.system_prompt + self.history

    def add_reply(self, output_tokens: list[int]) -> None:
        self.history += output_tokens


@dataclass(frozen=True)
class DemoMix:
    """The demo's traffic shape."""

    system_prompt_tokens: tuple[int, ...] = (1_536, 1_024, 640)
    system_prompt_weights: tuple[float, ...] = (0.6, 0.3, 0.1)
    rag_documents: int = 6
    rag_document_tokens: int = 2_048
    user_tokens: tuple[int, int] = (40, 200)
    chat_max_tokens: tuple[int, int] = (48, 200)
    rag_max_tokens: tuple[int, int] = (64, 160)
    batch_prompt_tokens: tuple[int, int] = (300, 1_500)
    batch_max_tokens: tuple[int, int] = (64, 256)
    think_s: tuple[float, float] = (0.5, 3.0)
    max_turns: int = 8


class DemoWorkload:
    """Seeded generator of the demo's prompts."""

    def __init__(self, seed: int = 7, mix: DemoMix | None = None) -> None:
        self.mix = mix or DemoMix()
        self.rng = random.Random(seed)
        self.system_prompts = [random_tokens(self.rng, n) for n in self.mix.system_prompt_tokens]
        self.documents = [
            random_tokens(self.rng, self.mix.rag_document_tokens)
            for _ in range(self.mix.rag_documents)
        ]

    def new_conversation(self) -> Conversation:
        sp = self.rng.choices(self.system_prompts, weights=self.mix.system_prompt_weights)[0]
        return Conversation(system_prompt=list(sp))

    def user_tokens(self) -> int:
        return self.rng.randint(*self.mix.user_tokens)

    def chat_max_tokens(self) -> int:
        return self.rng.randint(*self.mix.chat_max_tokens)

    def think_s(self) -> float:
        return self.rng.uniform(*self.mix.think_s)

    def rag_prompt(self) -> tuple[list[int], int]:
        """A question over a shared document (Zipf-like popularity)."""
        weights = [1 / (i + 1) for i in range(len(self.documents))]
        doc = self.rng.choices(self.documents, weights=weights)[0]
        return doc + random_tokens(self.rng, self.rng.randint(20, 80)), self.rng.randint(
            *self.mix.rag_max_tokens
        )

    def batch_prompt(self) -> tuple[list[int], int]:
        """A unique offline prompt."""
        return random_tokens(self.rng, self.rng.randint(*self.mix.batch_prompt_tokens)), (
            self.rng.randint(*self.mix.batch_max_tokens)
        )

"""Synthetic workloads for the source article's scenarios, as trace requests (pure, seeded).

Prompts are chains of block ids (``block_tokens`` tokens each): a shared prefix is a shared
chain. Arrivals are Poisson at ``rate`` requests per second unless a scenario says otherwise.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from sluice.sim.traces import TraceRequest

BLOCK_TOKENS = 128
MAX_REQUESTS = 1_000_000
"""The most requests a scenario is asked for: it is generated whole, in memory."""
MAX_RATE = 1_000_000.0
"""The highest mean arrival rate (a second): a written trace keeps times to the microsecond,
and above this its arrivals would collapse onto a few instants (at 1e308, all onto 0)."""


@dataclass(frozen=True)
class Shape:
    requests: int = 5_000
    rate: float = 20.0
    seed: int = 0


class _Ids:
    def __init__(self) -> None:
        self._next = itertools.count(1)

    def chain(self, blocks: int) -> tuple[int, ...]:
        return tuple(next(self._next) for _ in range(blocks))


def _zipf_weights(n: int, s: float = 1.1) -> list[float]:
    return [1 / (i + 1) ** s for i in range(n)]


def _req(
    t: float, prefix: tuple[int, ...], own_tokens: int, out: int, ids: _Ids, **kw: object
) -> TraceRequest:
    """A request: ``prefix`` blocks, then ``own_tokens`` of its own (new block ids)."""
    own = ids.chain(-(-own_tokens // BLOCK_TOKENS))
    return TraceRequest(
        arrival_s=t,
        input_tokens=len(prefix) * BLOCK_TOKENS + own_tokens,
        output_tokens=out,
        block_ids=prefix + own,
        block_tokens=BLOCK_TOKENS,
        **kw,  # type: ignore[arg-type]
    )


def hot_prompt(shape: Shape) -> list[TraceRequest]:
    """Few system prompts with Zipf popularity: the top one is in most requests (herding)."""
    rng, ids, t = random.Random(shape.seed), _Ids(), 0.0
    prompts = [ids.chain(rng.randint(8, 24)) for _ in range(8)]
    weights = _zipf_weights(len(prompts), 2.0)
    out = []
    for _ in range(shape.requests):
        t += rng.expovariate(shape.rate)
        sp = rng.choices(prompts, weights)[0]
        out.append(_req(t, sp, rng.randint(50, 400), rng.randint(50, 300), ids))
    return out


def multi_turn(shape: Shape) -> list[TraceRequest]:
    """Conversations whose history (prompts and replies) grows every turn."""
    rng, ids, t = random.Random(shape.seed), _Ids(), 0.0
    systems = [ids.chain(rng.randint(4, 12)) for _ in range(4)]
    live: list[tuple[str, tuple[int, ...], int]] = []  # (session, history, turns left)
    out = []
    sessions = itertools.count()
    for _ in range(shape.requests):
        t += rng.expovariate(shape.rate)
        if not live or rng.random() < 0.25:
            live.append((f"s{next(sessions)}", rng.choice(systems), rng.randint(2, 10)))
        k = rng.randrange(len(live))
        session, history, left = live[k]
        reply = rng.randint(50, 400)
        r = _req(t, history, rng.randint(30, 200), reply, ids, session_id=session)
        out.append(r)
        # The next turn's prefix: this prompt plus the reply (full blocks only).
        grown = r.block_ids + ids.chain(reply // BLOCK_TOKENS)
        if left <= 1:
            live.pop(k)
        else:
            live[k] = (session, grown, left - 1)
    return out


def rag(shape: Shape) -> list[TraceRequest]:
    """A shared system prompt plus one of many retrieved documents (Zipf), plus a question."""
    rng, ids, t = random.Random(shape.seed), _Ids(), 0.0
    system = ids.chain(6)
    docs = [ids.chain(rng.randint(8, 32)) for _ in range(200)]
    weights = _zipf_weights(len(docs))
    out = []
    for _ in range(shape.requests):
        t += rng.expovariate(shape.rate)
        doc = rng.choices(docs, weights)[0]
        out.append(_req(t, system + doc, rng.randint(20, 100), rng.randint(30, 200), ids))
    return out


def long_hogs(shape: Shape) -> list[TraceRequest]:
    """Mostly short chats, with 3 % very long requests that hog a worker."""
    rng, ids, t = random.Random(shape.seed), _Ids(), 0.0
    system = ids.chain(8)
    out = []
    for _ in range(shape.requests):
        t += rng.expovariate(shape.rate)
        if rng.random() < 0.03:
            out.append(_req(t, (), rng.randint(30_000, 60_000), rng.randint(500, 1500), ids))
        else:
            out.append(_req(t, system, rng.randint(50, 300), rng.randint(50, 200), ids))
    return out


def mixed(shape: Shape) -> list[TraceRequest]:
    """Online chat (hot prompts and conversations, interactive band) plus offline batch
    (unique prompts, batch band), with bursts: every 60 s, 5 s at 4x the rate."""
    online = hot_prompt(Shape(shape.requests * 2 // 3, shape.rate * 2 / 3, shape.seed))
    rng, ids, t = random.Random(shape.seed + 1), _Ids(), 0.0
    offset = 10**9  # keep the offline ids apart from the online ones
    offline = []
    for _ in range(shape.requests - len(online)):
        t += rng.expovariate(shape.rate / 3)
        r = _req(t, (), rng.randint(500, 4000), rng.randint(100, 500), ids, band="batch")
        offline.append(
            TraceRequest(**{**r.__dict__, "block_ids": tuple(b + offset for b in r.block_ids)})
        )

    def burst(t: float) -> float:
        # Compress time inside the first 20 s of each minute 4x (a burst), keep order.
        minute, sec = divmod(t, 60.0)
        return minute * 60.0 + (sec / 4 if sec < 20 else 5 + (sec - 20) * 55 / 40)

    reqs = [
        TraceRequest(**{**r.__dict__, "arrival_s": burst(r.arrival_s)}) for r in online + offline
    ]
    return sorted(reqs, key=lambda r: r.arrival_s)


SCENARIOS: dict[str, Callable[[Shape], list[TraceRequest]]] = {
    "hot-prompt": hot_prompt,
    "multi-turn": multi_turn,
    "rag": rag,
    "long-hogs": long_hogs,
    "mixed": mixed,
}

"""Cache-aware routing on the live system: real nats-server, dispatcher and agents."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from sluice.client import Client
from sluice.dispatcher.cacheaware import CacheAware
from sluice.dispatcher.routing import RoutingPolicy
from sluice.schemas.models import Result
from sluice.sim.policies import RoundRobin
from sluice.testing.cluster import LocalCluster
from tests.conftest import cluster_kwargs, eventually

pytestmark = pytest.mark.e2e

WORKERS = 4
PREFIXES = 5  # coprime with WORKERS: round-robin carries each prefix to every worker
ROUNDS = 6
PREFIX_TOKENS = 1024


def _prompt(prefix: int, request: int) -> list[int]:
    shared = [10_000 * (prefix + 1) + i for i in range(PREFIX_TOKENS)]
    own = [900_000 + 64 * request + i for i in range(32)]
    return shared + own


HIT_RATES: dict[str, float | None] = {}
"""Each worker's ``sluice_dispatcher_worker_hit_rate`` at the end of the last ``_run``, read
while it is alive (a worker that left has no series any more)."""


async def _run(nats_url: str, policy: RoutingPolicy | None, **dispatcher: object) -> list[Result]:
    """Rounds of one request per shared prefix; returns every result."""
    kwargs = cluster_kwargs(WORKERS, dispatcher=dict(dispatcher))
    results: list[Result] = []
    async with LocalCluster(nats_url, policy=policy, **kwargs) as cluster, Client(nats_url) as c:

        async def all_workers_known() -> bool:
            return len(cluster.dispatcher.scheduler.workers()) == WORKERS

        await eventually(all_workers_known)
        n = 0
        for _ in range(ROUNDS):
            handles = []
            for p in range(PREFIXES):
                handles.append(await c.submit("sim", _prompt(p, n), max_tokens=8))
                n += 1
            results += await asyncio.gather(*(h.result(timeout_s=30) for h in handles))
        HIT_RATES.clear()
        for a in cluster.agents:
            HIT_RATES[a.worker_id] = REGISTRY.get_sample_value(
                "sluice_dispatcher_worker_hit_rate", {"worker": a.worker_id}
            )
    return results


def _routed() -> float:
    reasons = ("score", "sticky", "expand", "spill", "explore")
    return sum(
        REGISTRY.get_sample_value("sluice_dispatcher_routed_total", {"reason": r}) or 0.0
        for r in reasons
    )


def _hit_rate(results: list[Result]) -> float:
    assert all(r.ok for r in results)
    return sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results)


async def test_repeated_prefixes_raise_the_hit_rate_against_round_robin(
    nats_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "decisions.jsonl"
    routed_before = _routed()
    ours = await _run(nats_url, None, decision_log=str(log))
    # The metrics count every decision by its rule, and each worker's hit rate.
    assert _routed() - routed_before == PREFIXES * ROUNDS
    rates = {r.worker_id: HIT_RATES[r.worker_id] for r in ours}
    assert all(v is not None and 0 <= v <= 1 for v in rates.values())
    assert max(v or 0.0 for v in rates.values()) > 0.5
    workers = [f"worker-{i}" for i in range(WORKERS)]
    theirs = await _run(nats_url, RoundRobin(workers))

    # Round-robin takes each prefix to every worker: 4 misses in 6 uses, about a third cached.
    # The cache-aware default keeps a prefix on one (at most two) workers.
    rr, ca = _hit_rate(theirs), _hit_rate(ours)
    assert rr < 0.45, f"round-robin hit rate {rr:.2f}: the workload is not what this test assumes"
    assert ca > rr + 0.25, f"cache-aware {ca:.2f} vs round-robin {rr:.2f}"

    # The decision log has one decision per request, joinable with its result.
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    decisions = {d["request_id"]: d for d in lines if d["type"] == "decision"}
    assert set(decisions) == {r.request_id for r in ours}
    for r in ours:
        d = decisions[r.request_id]
        assert d["worker"] == r.worker_id
        assert d["reason"] in {"score", "sticky", "expand", "spill", "explore"}
        assert {c["worker"] for c in d["candidates"]} <= set(workers)
        if d["reason"] == "sticky":
            assert d["expected_hit_tokens"] >= PREFIX_TOKENS // 2


async def test_digests_fill_the_index_and_a_lost_worker_leaves_it(nats_url: str) -> None:
    async with (
        LocalCluster(nats_url, **cluster_kwargs(2)) as cluster,
        Client(nats_url) as c,
    ):
        policy = cluster.dispatcher.policy
        assert isinstance(policy, CacheAware), "cache-aware routing is the default"
        result = await (await c.submit("sim", _prompt(0, 0), max_tokens=4)).result(timeout_s=30)
        worker = result.worker_id

        async def reported() -> bool:
            # The agent's digest (not only the dispatcher's guess) says it holds the prefix.
            return policy.index.reported_blocks(worker) > 0

        await eventually(reported)
        agent = next(a for a in cluster.agents if a.worker_id == worker)
        await agent.kill()

        async def forgotten() -> bool:
            return policy.index.blocks_of(worker) == 0

        await eventually(forgotten, timeout_s=10)

"""One tokenizer across the fleet: a producer sends a text prompt, the dispatcher and the agent
tokenize it with the engine's ``tokenizer.json``, the agent sends the engine those ids, and the
engine's KV events (token ids) come back to the dispatcher's index as the same block hashes.
So the hit the dispatcher predicts is the hit the engine finds. Real processes: nats-server,
dispatcher, agents, ``sluice engine`` servers with KV events on IPC sockets."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from sluice.agent.runtime.httpengine import HttpEngine
from sluice.client import Client
from sluice.common.tokenizer import PromptTokenizer
from sluice.schemas.hashing import DEFAULT_INDEX_TOKENS, block_hashes
from sluice.testing.cluster import LocalCluster
from sluice.testing.engineserver import EngineProcess

from .conftest import FAST_AGENT, cluster_kwargs, eventually

pytestmark = pytest.mark.e2e

WORDS = [f"w{i}" for i in range(200)] + ["alpha", "beta"]
PREFIX = " ".join(WORDS[i % 200] for i in range(384))  # 384 tokens: 24 blocks, 3 index points


def _tokenizer(path: Path) -> str:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(path))
    return str(path)


@pytest.fixture
async def fleet(nats_url: str, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    tokenizer = _tokenizer(tmp_path / "tokenizer.json")
    engines = {
        f"worker-{i}": EngineProcess(
            str(tmp_path / f"e{i}.sock"), model="sim", kv_events=True, tokenizer=tokenizer
        )
        for i in range(2)
    }
    log = tmp_path / "decisions.jsonl"
    try:
        for e in engines.values():
            e.start()

        def agent_for(worker_id: str) -> dict[str, Any]:
            e = engines[worker_id]
            return {"engine_url": e.url, "engine_kv_events": e.kv_events}

        fast = {k: v for k, v in FAST_AGENT.items() if k != "speed"}  # the engine has the clock
        agent = {**fast, "engine": "openai-http", "tokenizer": tokenizer}
        kw = cluster_kwargs(
            dispatcher={
                "routing_explore_share": 0.0,  # a repeated prefix must go where it is cached
                "routing_guess_ttl_s": 0.05,  # what it routed is not known long unreported
                "tokenizer": tokenizer,
                "decision_log": str(log),
            },
        )
        kw["agent"] = agent
        cluster = LocalCluster(nats_url, agent_for=agent_for, **kw)
        yield {"cluster": cluster, "log": log, "tokenizer": tokenizer, "engines": engines}
    finally:
        for e in engines.values():
            e.stop()


def _kv_applied(worker_id: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"worker": worker_id, "outcome": "applied"}
    return REGISTRY.get_sample_value("sluice_agent_engine_kv_events_total", labels) or 0.0


async def test_the_dispatchers_predicted_hit_is_the_engines_hit(
    fleet: dict[str, Any], nats_url: str
) -> None:
    cluster: LocalCluster = fleet["cluster"]
    before = {w: _kv_applied(w) for w in fleet["engines"]}  # (other tests' agents counted too)
    ids = PromptTokenizer.from_file(fleet["tokenizer"]).encode(PREFIX + " alpha" * 20)
    assert len(ids) == 404
    async with cluster, Client(nats_url) as c:  # a producer without a tokenizer: text
        a = await (await c.submit("sim", PREFIX + " alpha" * 20, max_tokens=4)).result(20)
        assert a.ok and a.prompt_tokens == 404 and a.cached_tokens == 0  # tokenized, exact
        holder = next(ag for ag in cluster.agents if ag.worker_id == a.worker_id)
        engine = holder.engine
        assert isinstance(engine, HttpEngine) and engine.kv_tracker is not None
        last = block_hashes(ids)[23]  # the prefix's last full block, from the engine's events

        async def stored() -> bool:
            return last in engine.cached_blocks()

        await eventually(stored)
        # Long past the dispatcher's own guess: only the digest (the events) can know now.
        await asyncio.sleep(1.0)
        b = await (await c.submit("sim", PREFIX + " beta" * 20, max_tokens=4)).result(20)
    assert b.ok and b.worker_id == a.worker_id
    assert b.cached_tokens == 384  # the engine's hit: the 24 blocks of the shared prefix
    # Every outcome's series is exposed from the first heartbeat, at 0 where nothing
    # happened: an alert on increase() missed the first incident of a series born at 1.
    from prometheus_client import REGISTRY

    labels = {"worker": a.worker_id, "outcome": "unfilled"}
    assert REGISTRY.get_sample_value("sluice_agent_engine_kv_events_total", labels) is not None
    assert engine.kv_tracker.stats.batches > 0 and engine.kv_dropped == 0
    # The agent exports the events it applied (its heartbeats counted them by then).
    applied = _kv_applied(holder.worker_id) - before[holder.worker_id]
    assert 0 < applied <= engine.kv_tracker.stats.batches
    decisions = {
        d["request_id"]: d
        for d in map(json.loads, fleet["log"].read_text().splitlines())
        if d["type"] == "decision"
    }
    predicted = decisions[b.request_id]["expected_hit_tokens"]
    # Predicted to within the index's resolution (one hash per 128 tokens): here exactly.
    assert b.cached_tokens - DEFAULT_INDEX_TOKENS < predicted <= b.cached_tokens
    assert decisions[a.request_id]["expected_hit_tokens"] == 0


def test_the_engine_server_tokenizes_text_as_a_real_engine(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path / "tokenizer.json")
    proc = EngineProcess(str(tmp_path / "e.sock"), model="sim", speed=50, tokenizer=tokenizer)
    try:
        proc.start()
        transport = httpx.HTTPTransport(uds=proc.uds)
        with httpx.Client(transport=transport, base_url="http://e", timeout=30) as h:
            body = {"prompt": PREFIX, "max_tokens": 2}
            first = h.post("/v1/completions", json=body).json()["usage"]
            again = h.post("/v1/completions", json=body).json()["usage"]
            empty = h.post("/v1/completions", json={"prompt": "   ", "max_tokens": 2})
    finally:
        proc.stop()
    assert first["prompt_tokens"] == 384  # one id per word, not 4 bytes a token
    assert again["prompt_tokens_details"]["cached_tokens"] == 383  # all but the last, as vLLM
    assert empty.status_code == 400 and "no tokens" in empty.json()["error"]["message"]


def test_a_bad_tokenizer_or_kv_endpoint_stops_the_command_line_with_exit_code_2(
    tmp_path: Path,
) -> None:
    missing = str(tmp_path / "missing.json")
    sock = str(tmp_path / "e.sock")
    runs = [
        ["engine", "--uds", sock, "--tokenizer", missing],
        ["engine", "--uds", sock, "--kv-events", "udp://nowhere"],
        ["dispatcher", "--tokenizer", missing],
        ["agent", "--tokenizer", missing],
        ["agent", "--engine", "openai-http", "--engine-url", "unix:///x", "--kv-events", "x"],
    ]
    for args in runs:
        done = subprocess.run(
            [sys.executable, "-m", "sluice.cli", *args], capture_output=True, timeout=60
        )
        assert done.returncode == 2, (args, done.stderr)
        assert b"Traceback" not in done.stderr, (args, done.stderr)

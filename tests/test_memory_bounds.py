"""Memory that is bounded and known: every structure that grows with input stays within the
setting that bounds it, and the dispatcher keeps per request and per worker only what it needs
(docs/operations.md, "Memory"; the figures are ``sluice bench-memory``'s, never asserted here).

Each test names the one-line edit that makes it fail."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import msgpack
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from sluice.agent.kvevents import KVEventTracker, decode_batch
from sluice.agent.runtime import AgentSettings
from sluice.agent.runtime.httpengine import HttpEngine
from sluice.cli.benchmemory import _Dispatcher
from sluice.dispatcher.leases import LeaseTable
from sluice.dispatcher.routing import RouteRequest
from sluice.dispatcher.runtime.settings import DispatcherSettings
from sluice.dispatcher.runtime.state import State
from sluice.dispatcher.runtime.streams import advisory_stream
from sluice.schemas.hashing import block_hashes
from sluice.schemas.models import Completion
from sluice.testing.engines import build_engine

BT = 16


def _reachable(root: object, skip: tuple[type, ...]) -> list[object]:
    """Every object reachable from ``root`` (not through instances of ``skip``)."""
    seen: set[int] = set()
    out: list[object] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        out.append(obj)
        todo.extend(gc.get_referents(obj))
    return out


def test_a_held_request_keeps_its_body_not_its_decoded_prompt() -> None:
    """Fails if ``Held`` keeps the decoded ``SubmitRequest`` (its prompt as a list of Python
    ints: ten times the body's bytes)."""
    from nats.aio.client import Client as NATS

    d = _Dispatcher()
    asyncio.run(d.queue(1, 1_000, seed=0))
    (held,) = d.state.held.values()
    objects = _reachable(held, skip=(NATS, type))
    assert not [o for o in objects if isinstance(o, list | tuple) and len(o) >= 1_000]
    assert len(held.msg.data) < 6 * 1_000  # the body it keeps instead: a few bytes per token
    assert len(held.request.prompt_tokens or ()) == 1_000  # and it decodes whole again


def test_the_last_heartbeat_is_kept_without_its_digest() -> None:
    """Fails if ``WorkerTraffic.on_heartbeat`` stores the heartbeat as it came (a snapshot
    digest of up to digest_max_blocks hashes per worker, besides the index)."""
    d = _Dispatcher()
    asyncio.run(d.heartbeat("w1", stored=list(range(1, 501))))
    assert d.state.policy.stats(time.monotonic()).index_blocks == 500  # the index has them
    assert d.state.heartbeats["w1"].cache is None
    assert d.state.heartbeats["w1"].capacity == 32  # the rest of it is kept


def _series(name: str, worker: str) -> float | None:
    value: float | None = REGISTRY.get_sample_value(name, {"worker": worker})
    return value


def test_a_lost_worker_leaves_no_counter_or_metric_series_behind() -> None:
    """Fails if ``WorkerTraffic.lose_worker`` skips ``_forget_counts`` (workers that come and
    go under new names would pile their counters and series up)."""
    d = _Dispatcher()
    traffic = d.traffic
    done = Completion(
        request_id="r",
        worker_id="gone-1",
        attempt=1,
        ok=True,
        prompt_tokens=100,
        cached_tokens=40,
        output_tokens=5,
        prefill_s=0.1,
        decode_s=0.1,
    )
    asyncio.run(d.heartbeat("gone-1"))
    traffic._count_hits(done, None)
    assert _series("sluice_dispatcher_prompt_tokens_total", "gone-1") == 100
    asyncio.run(traffic.lose_worker("gone-1"))
    assert "gone-1" not in traffic._prompt_tokens and "gone-1" not in traffic._hit_tokens
    for name in (
        "sluice_dispatcher_prompt_tokens_total",
        "sluice_dispatcher_cached_tokens_total",
        "sluice_dispatcher_worker_hit_rate",
    ):
        assert _series(name, "gone-1") is None, name


def test_the_dispatchers_bounds_come_from_its_settings_and_hold_when_filled_past() -> None:
    """Fails if a bound is not wired from its setting (e.g. ``CacheAware`` building its
    ``Affinity`` without ``max_keys``, ``flap_meter`` without ``prefix_max_keys``, ``State``
    building ``Tombstones`` or ``LeaseTable`` without theirs)."""
    s = DispatcherSettings(
        models=["m"],
        routing_prefix_max_keys=3,
        cancelled_max_ids=4,
        lease_max_removed=2,
        max_kept_advisories=5,
    )
    st_ = State(s, None, 0.0)
    for i in range(10):
        hashes = (1000 + i,)
        st_.policy.observe(RouteRequest(f"p{i}", "m", 16, 16, hashes), "w", float(i))
        st_.scheduler.flaps.booked(hashes, "w", float(i))
        st_.cancelled.add(f"c{i}", float(i))
        st_.leases.renew(f"w{i}", float(i), registration=1)
        st_.leases.remove(f"w{i}")
    assert len(st_.policy.affinity) == 3  # type: ignore[attr-defined]
    assert len(st_.scheduler.flaps._served) == 3
    assert [st_.cancelled.has(f"c{i}", 9.0) for i in (5, 6, 9)] == [False, True, True]
    assert [st_.leases.removed(f"w{i}") for i in (7, 8, 9)] == [None, 1, 1]
    assert advisory_stream(s).max_msgs == 5


def test_the_lease_table_remembers_the_newest_removals() -> None:
    """Fails if ``LeaseTable.remove`` does not trim ``_removed`` (a worker that never comes
    back would be remembered forever)."""
    t = LeaseTable(4.0, max_removed=2)
    for w in ("a", "b", "c"):
        t.renew(w, 0.0, registration=7)
        t.remove(w)
    assert (t.removed("a"), t.removed("b"), t.removed("c")) == (None, 7, 7)
    assert t.standing("c", 7) == "stale"


def _store(tracker: KVEventTracker, seq: int, hashes: list[int], parent: int | None) -> None:
    tokens = [h % 50_000 for h in hashes for _ in range(BT)]
    event = ["BlockStored", hashes, parent, tokens, BT, None, "GPU"]
    tracker.apply(seq, decode_batch(msgpack.packb([0.0, [event], 0])))


@given(
    chains=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30),
    max_blocks=st.one_of(st.integers(1, 40), st.integers(100, 300)),
)
def test_the_kv_mirror_never_holds_more_than_its_bound_and_reports_what_it_drops(
    chains: list[int], max_blocks: int
) -> None:
    """Fails if ``KVEventTracker._store`` does not trim to ``max_blocks`` (a mirror whose
    removal events were lost grows forever), or if what it drops is not reported evicted
    (the dispatcher would keep routing to blocks the agent no longer mirrors). At a bound of
    100 or more it drops a hundredth of it at once."""
    tracker = KVEventTracker(BT, max_blocks=max_blocks)
    held: set[int] = set()
    next_hash = 1
    for seq, length in enumerate(chains):
        _store(tracker, seq, list(range(next_hash, next_hash + length)), None)
        next_hash += length
        assert len(tracker) <= max_blocks
        stored, evicted = tracker.cache_changes()
        held |= set(stored)
        held -= set(evicted)
        assert held == set(tracker.cached_blocks())
    total = sum(chains)
    if total <= max_blocks:
        assert len(tracker) == total
    else:
        assert max_blocks - max_blocks // 100 <= len(tracker) <= max_blocks


def _http_settings(**kw: Any) -> AgentSettings:
    return AgentSettings(engine="openai-http", engine_url="http://127.0.0.1:9", **kw)


def test_the_agents_bounds_come_from_its_settings_and_hold_when_filled_past() -> None:
    """Fails if ``build_engine`` does not pass ``engine_record_max_blocks`` and
    ``engine_kv_max_blocks`` to the engine."""
    engine = build_engine(_http_settings(engine_record_max_blocks=5, digest_index_tokens=16))
    assert isinstance(engine, HttpEngine)
    for i in range(4):
        prompt = list(range(i * 1000, i * 1000 + 320))  # 20 blocks of 16 each
        engine._record(len(prompt), block_hashes(prompt, BT))
    assert len(engine.cached_blocks()) == 5
    kv = build_engine(_http_settings(engine_kv_events="tcp://127.0.0.1:9", engine_kv_max_blocks=7))
    assert isinstance(kv, HttpEngine) and kv.kv_tracker is not None
    assert engine.uses_prompt_hashes and not kv.uses_prompt_hashes
    _store(kv.kv_tracker, 0, list(range(1, 21)), None)
    assert len(kv.kv_tracker) == 7

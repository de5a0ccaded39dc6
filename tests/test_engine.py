"""The simulated engine reproduces hand-computed timings."""

from __future__ import annotations

import dataclasses

import pytest

from sluice.sim import REFERENCE, EngineError, Finished, KVCache, SimEngine, TokensOut
from sluice.sim.engine import Step


def _run(engine: SimEngine) -> tuple[float, dict[str, float], dict[str, Finished]]:
    """Run to completion: total time, time of each first token, finish records."""
    t = 0.0
    first: dict[str, float] = {}
    done: dict[str, Finished] = {}
    while engine.has_work:
        step: Step = engine.step()
        assert step.duration_s > 0
        t += step.duration_s
        for ev in step.events:
            if isinstance(ev, TokensOut) and ev.first:
                first[ev.request_id] = t
            if isinstance(ev, Finished):
                done[ev.request_id] = ev
    return t, first, done


def test_one_request_timing() -> None:
    e = SimEngine(REFERENCE)
    # 4000 prompt tokens: chunks 2048 + 1952 at 8000 tok/s; then 9 decode steps of batch 1.
    e.add("a", 4000, 10, list(range(250)), 0.0)
    total, first, done = _run(e)
    prefill = 4000 / 8000
    decode = 9 * (0.006 + 0.00035)
    assert first["a"] == pytest.approx(prefill)
    assert total == pytest.approx(prefill + decode)
    assert done["a"].cached_tokens == 0
    assert done["a"].output_tokens == 10


def test_shared_prefix_is_not_prefilled_twice() -> None:
    e = SimEngine(REFERENCE)
    shared = list(range(100))  # 100 blocks = 1600 tokens
    e.add("a", 1600 + 32, 1, [*shared, 1000, 1001], 0.0)
    _run(e)
    e.add("b", 1600 + 32, 1, [*shared, 2000, 2001], 0.0)
    _, first, done = _run(e)
    assert done["b"].cached_tokens == 1600
    assert first["b"] == pytest.approx(32 / 8000)  # only the uncached 32 tokens
    assert e.cached_tokens_total == 1600


def test_fully_cached_prompt_still_computes_one_token() -> None:
    e = SimEngine(REFERENCE)
    e.add("a", 160, 1, list(range(10)), 0.0)
    _run(e)
    e.add("b", 160, 1, list(range(10)), 0.0)
    _, first, done = _run(e)
    assert done["b"].cached_tokens == 159
    assert first["b"] == pytest.approx(1 / 8000)


def test_batch_decode_step_grows_with_batch() -> None:
    e = SimEngine(REFERENCE)
    for i in range(3):
        e.add(f"r{i}", 16, 5, [i], 0.0)
    total, first, _ = _run(e)
    # One step prefills all three (48 tokens), then 4 decode steps with batch 3.
    assert first == {f"r{i}": pytest.approx(48 / 8000) for i in range(3)}
    assert total == pytest.approx(48 / 8000 + 4 * (0.006 + 3 * 0.00035))


def test_max_running_caps_the_batch() -> None:
    e = SimEngine(dataclasses.replace(REFERENCE, max_running=2))
    for i in range(3):
        e.add(f"r{i}", 16, 3, [i], 0.0)
    e.step()
    assert e.running == 2 and e.waiting == 1


def test_kv_cache_lru_eviction_and_pinning() -> None:
    kv = KVCache(4)
    assert kv.admit([1, 2], 1)  # 3 used
    assert not kv.admit([3, 4], 0)  # 5 > 4 and nothing is evictable
    kv.release([1, 2], 1)  # 1, 2 idle (cached), 2 used
    assert kv.match([1, 2, 9]) == 2
    assert kv.admit([3, 4], 1)  # needs 3 of 4: evicts the least recently used idle block
    assert kv.match([1]) == 0 and kv.match([2]) == 1
    assert kv.used_blocks <= kv.capacity_blocks
    assert kv.evicted_blocks == 1


def test_request_larger_than_the_cache_is_an_error() -> None:
    e = SimEngine(dataclasses.replace(REFERENCE, kv_capacity_tokens=1024))
    with pytest.raises(EngineError, match="KV tokens"):
        e.add("big", 2000, 10, list(range(125)), 0.0)


def test_the_digest_journal_reports_stored_and_evicted_blocks_once() -> None:
    kv = KVCache(4)
    assert kv.admit([1, 2], 0, report=[1, 2])
    assert kv.admit([9], 0)  # not reported (a short prompt)
    assert kv.drain_digest() == ([1, 2], [])
    assert kv.drain_digest() == ([], [])
    kv.release([1, 2], 0)
    kv.release([9], 0)
    assert kv.admit([3, 4, 5], 0, report=[3, 4, 5])  # evicts 1 and 2 (and 9, never reported)
    stored, evicted = kv.drain_digest()
    assert stored == [3, 4, 5] and sorted(evicted) == [1, 2]
    kv.release([3, 4, 5], 0)
    assert kv.admit([6, 7, 8], 0, report=[6, 7, 8])  # evicts 3 and 4 ...
    kv.release([6, 7, 8], 0)
    assert kv.admit([3], 0, report=[3])  # ... then 5; 3 comes back before the next drain
    stored, evicted = kv.drain_digest()
    assert sorted(stored) == [6, 7, 8]  # 3: evicted and stored again, no change to report
    assert sorted(evicted) == [4, 5]
    assert sorted(kv.reported_blocks()) == [3, 6, 7, 8]


def test_the_engine_reports_only_long_enough_prompts() -> None:
    e = SimEngine(REFERENCE, digest_min_tokens=64)
    e.add("short", 40, 2, [1, 2], 0.0)  # 2 full blocks = 32 tokens
    e.add("long", 80, 2, [3, 4, 5, 6, 7], 0.0)  # 5 full blocks = 80 tokens
    e.step()
    stored, _ = e.cache.drain_digest()
    assert sorted(stored) == [3, 4, 5, 6, 7]


def test_the_digest_reports_every_stride_th_block() -> None:
    e = SimEngine(REFERENCE, digest_min_tokens=16, digest_stride=4)
    e.add("a", 160, 2, list(range(10)), 0.0)  # 10 blocks: positions 3 and 7 are reported
    e.step()
    assert sorted(e.cache.drain_digest()[0]) == [3, 7]

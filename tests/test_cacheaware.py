"""The cache-aware policy, its affinity bookkeeping and its calibration (pure; hypothesis)."""

from __future__ import annotations

import collections
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.agent.reports import DigestBuilder
from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.affinity import Affinity, prefix_key
from sluice.dispatcher.cacheaware import CacheAware, CacheAwareConfig, Scored
from sluice.dispatcher.calibration import Calibration
from sluice.dispatcher.decisions import DecisionLog
from sluice.dispatcher.routing import Candidate, Choice, Digest, Outcome, RouteRequest
from sluice.dispatcher.scheduler import Request, Scheduler, WorkerInfo
from sluice.sim.engine import SimEngine
from sluice.sim.profiles import REFERENCE

BT = 16
PREFIX = tuple(range(1000, 1080))  # 80 blocks = 1280 tokens: one prefix key


def _req(i: int, hashes: tuple[int, ...] = PREFIX, prompt: int | None = None) -> RouteRequest:
    return RouteRequest(f"r{i}", "m", prompt or len(hashes) * BT + 8, 32, hashes)


def _cand(
    w: str, booked: int = 0, prefill: int = 0, cap: int = 32, joined: float = -1e9
) -> Candidate:
    return Candidate(
        worker_id=w,
        capacity=cap,
        booked=booked,
        booked_tokens=0,
        reported_prefill_tokens=prefill,
        joined_s=joined,
    )


def _policy(**kw: object) -> CacheAware:
    cfg = CacheAwareConfig(block_tokens=BT, index_tokens=BT, explore_share=0.0, **kw)  # type: ignore[arg-type]
    return CacheAware(cfg)


# ---------------------------------------------------------------------------------- selection

loads = st.lists(st.tuples(st.integers(0, 31), st.integers(0, 200_000)), min_size=1, max_size=8)


@given(loads, st.integers(0, 3), st.booleans())
@settings(max_examples=200, deadline=None)
def test_the_choice_is_always_one_of_the_candidates_and_choose_changes_nothing(
    state: list[tuple[int, int]], held_by: int, explain: bool
) -> None:
    p = _policy(explain=explain)
    cands = [_cand(f"w{i}", b, pre) for i, (b, pre) in enumerate(state)]
    if held_by < len(cands):
        p.heartbeat(cands[held_by].worker_id, Digest(0, True, PREFIX), 0.0)
    before = (len(p.index), len(p.affinity), p.stats(1.0))
    first = p.choose(_req(1), cands, 1.0)
    again = p.choose(_req(1), cands, 1.0)
    assert first == again  # no side effect: the same question gets the same answer
    assert first.worker_id in {c.worker_id for c in cands}
    assert (len(p.index), len(p.affinity), p.stats(1.0)) == before
    assert len(first.terms) == (len(cands) if explain else 0)


def test_the_scheduler_only_offers_workers_with_free_capacity() -> None:
    p = _policy()
    sched = Scheduler(AdmissionConfig(global_limit=100), p, models=["m"])
    sched.update_worker(WorkerInfo("full", frozenset({"m"}), capacity=1))
    sched.update_worker(WorkerInfo("free", frozenset({"m"}), capacity=5))
    p.heartbeat("full", Digest(0, True, PREFIX), 0.0)  # the cache is on the full worker
    sched.enqueue(Request("a", "standard", "m", "t", 1288, 8, 0.0, block_hashes=PREFIX), 0.0)
    sched.enqueue(Request("b", "standard", "m", "t", 1288, 8, 0.0, block_hashes=PREFIX), 0.0)
    first = sched.plan(0.0, max_decisions=1)
    assert first[0].worker_id == "full"
    assert sched.book(first[0], 0.0)
    second = sched.plan(0.0)
    assert [d.worker_id for d in second] == ["free"]  # never pushed onto the full worker


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 31), st.integers(0, 60_000)),
        min_size=4,
        max_size=4,
    ),
    st.floats(0.0, 29.0),
)
@settings(max_examples=200, deadline=None)
def test_stickiness_holds_inside_its_window_unless_the_hard_limit_is_crossed(
    state: list[tuple[int, int, int]], later_s: float
) -> None:
    # A tiny headroom keeps the budget at one replica: the prefix must stay where it is.
    p = _policy(replica_headroom=0.01, sticky_window_s=30.0)
    cands = [_cand(f"w{i}") for i in range(4)]
    home = p.choose(_req(0), cands, 0.0).worker_id
    p.observe(_req(0), home, 0.0)
    busy = [_cand(f"w{i}", booked, pre) for i, (_, booked, pre) in enumerate(state)]
    scored, reps, budget = p.score(_req(1), busy, later_s)
    assert reps == [home] and budget == 1
    choice = p.choose(_req(1), busy, later_s)
    home_terms = next(s for s in scored if s.candidate.worker_id == home)
    if not home_terms.over_hard:
        assert choice.worker_id == home and choice.reason == "sticky"
    else:
        assert choice.reason == "spill"


def test_stickiness_ends_with_its_window_and_on_worker_loss() -> None:
    p = _policy(replica_headroom=0.01, sticky_window_s=10.0, sticky_cached=False)
    cands = [_cand(f"w{i}") for i in range(3)]
    p.observe(_req(0), "w2", 0.0)
    assert p.affinity.replicas(prefix_key(PREFIX, 64), 5.0) == ["w2"]
    assert p.affinity.replicas(prefix_key(PREFIX, 64), 10.0) == []
    p.remove_worker("w2")
    assert p.choose(_req(1), cands, 1.0).reason == "score"


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7), st.floats(0, 1)), max_size=300),
    st.integers(1, 4),
)
@settings(max_examples=100, deadline=None)
def test_a_prefix_never_has_more_replicas_than_its_budget_allows(
    ops: list[tuple[int, int, float]], max_replicas: int
) -> None:
    aff = Affinity(window_s=5.0, max_replicas=max_replicas)
    now = 0.0
    for key, worker, dt in ops:
        now += dt
        before = len(aff.replicas(key, now))
        budget = aff.budget(key, 8, now)
        assert 1 <= budget <= max_replicas
        aff.used(key, f"w{worker}", budget, now)
        after = len(aff.replicas(key, now))
        assert after <= max(budget, before)
        assert after <= max_replicas


def test_the_budget_follows_the_share_of_traffic() -> None:
    aff = Affinity(tau_s=60.0, headroom=1.5)
    for i in range(1000):
        aff.used(1 if i % 10 < 6 else 100 + i, "w", 64, i * 0.01)  # key 1: 60 % of traffic
    assert math.isclose(aff.share(1, 10.0), 0.6, abs_tol=0.02)
    assert aff.budget(1, 16, 10.0) == math.ceil(0.6 * 16 * 1.5)
    assert aff.budget(150, 16, 10.0) == 1  # a cold prefix gets one worker


def test_a_hot_prefix_spreads_over_its_replicas_and_balances_among_them() -> None:
    p = _policy(max_replicas=3)
    workers = [f"w{i}" for i in range(8)]
    for w in workers:
        p.heartbeat(w, None, 0.0)
    booked = dict.fromkeys(workers, 0)
    for i in range(300):
        cands = [_cand(w, booked[w], prefill=0) for w in workers]
        c = p.choose(_req(i), cands, i * 0.01)
        p.observe(_req(i), c.worker_id, i * 0.01)
        booked[c.worker_id] += 1
        if sum(booked.values()) > 30:  # requests finish: about 30 run at once
            busiest = max(booked, key=lambda w: booked[w])
            booked[busiest] -= 1
    key = prefix_key(PREFIX, 64)
    reps = p.affinity.replicas(key, 3.0)
    assert len(reps) == 3  # spread to its budget, no further
    used = [w for w in workers if booked[w] or w in reps]
    assert set(used) == set(reps)
    assert max(booked[w] for w in reps) - min(booked[w] for w in reps) <= 2


def test_the_exploration_share_converges_to_its_setting() -> None:
    p = CacheAware(
        CacheAwareConfig(block_tokens=BT, index_tokens=BT, explore_share=0.1, explore_window_s=60)
    )
    # The old workers hold the prefix and are idle; the new one would never win on score.
    for w in ("a", "b", "c"):
        p.heartbeat(w, Digest(0, True, PREFIX), 0.0)
    cands = [_cand("a"), _cand("b"), _cand("c"), _cand("new", booked=4, joined=100.0)]
    n = 5000
    picks = collections.Counter(p.choose(_req(i), cands, 110.0).worker_id for i in range(n))
    assert abs(picks["new"] / n - 0.1) < 0.015
    # Once the window has passed, the worker is not new any more.
    later = collections.Counter(p.choose(_req(i), cands, 200.0).worker_id for i in range(500))
    assert later["new"] == 0


def test_tie_breaks_are_spread() -> None:
    p = _policy()
    cands = [_cand(f"w{i}") for i in range(8)]
    picks = collections.Counter(
        p.choose(_req(i, hashes=(i,), prompt=64), cands, 0.0).worker_id for i in range(4000)
    )
    assert set(picks) == {c.worker_id for c in cands}
    assert max(picks.values()) - min(picks.values()) < 150  # 500 each, give or take


def test_the_cache_wins_unless_its_worker_is_much_busier() -> None:
    p = _policy()
    p.heartbeat("warm", Digest(0, True, PREFIX), 0.0)
    assert p.choose(_req(1), [_cand("cold"), _cand("warm")], 1.0).worker_id == "warm"
    buried = [_cand("cold"), _cand("warm", prefill=200_000)]  # ~25 s of prefill queued
    assert p.choose(_req(2), buried, 1.0).worker_id == "cold"
    # A hit under min_hit_fraction of the prefix is ignored.
    short = [_cand("cold"), _cand("warm", booked=4)]
    long_req = _req(3, hashes=(*PREFIX[:10], *range(5000, 5100)))
    assert p.choose(long_req, short, 1.0).worker_id == "cold"


def test_completions_correct_the_index_and_teach_speeds() -> None:
    p = _policy(prefill_tokens_per_s=8000.0)
    p.heartbeat("w", None, 0.0)
    for _ in range(200):
        p.completed(
            "w",
            _req(0),
            Outcome(
                cached_tokens=0,
                prefill_s=1288 / 2000.0,  # four times slower than the prior says
                output_tokens=33,
                decode_s=32 * 0.05,
                now_s=1.0,
            ),
        )
    assert p.index.match(PREFIX, 2.0) == {"w": len(PREFIX)}
    sp = p.calibration.speeds("w")
    assert math.isclose(sp.prefill_s_per_token, 1 / 2000.0, rel_tol=0.1)
    assert math.isclose(sp.decode_s_per_token, 0.05, rel_tol=0.1)


# ---------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("seed", range(10))
def test_calibration_finds_the_slow_worker_and_ignores_noise(seed: int) -> None:
    rng = random.Random(seed)
    cal = Calibration(prefill_tokens_per_s=10_000.0, decode_step_s=0.02)
    for _ in range(300):
        for w, speed in (("a", 1e-4), ("b", 1e-4), ("c", 1e-4), ("slow", 3e-4)):
            # Contention only ever slows a request down: samples are speed x a factor >= 1.
            factor = 1.0 + rng.expovariate(2.0)
            cal.observe(w, uncached_tokens=4000, prefill_s=4000 * speed * factor,
                        output_tokens=2, decode_s=0.02)  # fmt: skip
    a, b, slow = (cal.speeds(w).prefill_s_per_token for w in ("a", "b", "slow"))
    assert a == b  # noise between equal workers is not a difference
    assert 2.0 < slow / a < 4.0  # a three times slower worker is seen as such
    assert a < 1.3e-4  # a low quantile: contention does not drag the estimate up


def test_calibration_without_samples_uses_the_fleet_and_then_the_prior() -> None:
    cal = Calibration(prefill_tokens_per_s=8000.0, decode_step_s=0.03)
    assert cal.speeds("x").prefill_s_per_token == 1 / 8000.0
    for _ in range(100):
        cal.observe("y", uncached_tokens=1000, prefill_s=0.25, output_tokens=2, decode_s=0.03)
    # An unseen worker is assumed to be like the rest of the fleet.
    assert math.isclose(cal.speeds("x").prefill_s_per_token, 2.5e-4, rel_tol=0.15)
    cal.remove_worker("y")
    assert cal.workers() == []


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["observe", "remove", "read"]),
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.integers(0, 3000),  # uncached tokens (under 256: no prefill sample)
        st.floats(1e-5, 1e-3),  # seconds per token
        st.integers(0, 40),  # output tokens (under 2: no decode sample)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_calibrations_kept_speeds_are_what_it_would_compute_afresh(ops: list[Any]) -> None:
    """Speeds are computed once per worker and kept until a change: a completion that leaves
    the fleet's medians where they were forgets only its own worker's. Whatever happened, every
    kept answer (and its table, which the native scoring loop reads) is what a calibration
    that saw the same completions computes afresh. Fails if a completion forgets nothing, or
    one that moves the medians forgets only its own worker."""
    cal = Calibration(prefill_tokens_per_s=8000.0, decode_step_s=0.03)
    seen: list[tuple[str, tuple[Any, ...]]] = []
    for op, w, uncached, per_token, out in ops:
        if op == "observe":
            args = (uncached, uncached * per_token, out, max(out - 1, 0) * per_token * 30)
            seen.append((w, args))
            cal.observe(w, uncached_tokens=args[0], prefill_s=args[1], output_tokens=args[2],
                        decode_s=args[3])  # fmt: skip
        elif op == "remove":
            seen.append((w, ()))
            cal.remove_worker(w)
        else:
            cal.speeds(w)  # computed now, kept
        fresh = Calibration(prefill_tokens_per_s=8000.0, decode_step_s=0.03)
        for fw, fargs in seen:
            if fargs:
                fresh.observe(fw, uncached_tokens=fargs[0], prefill_s=fargs[1],
                              output_tokens=fargs[2], decode_s=fargs[3])  # fmt: skip
            else:
                fresh.remove_worker(fw)
        for x in ("a", "b", "c", "d", "e", "never"):
            assert cal.table()[x] == fresh.speeds(x) == cal.speeds(x), (x, op, w)


def test_digests_and_guesses_feed_the_policy() -> None:
    p = _policy(guess_ttl_s=5.0)
    assert p.heartbeat("w", Digest(0, True, PREFIX[:40]), 0.0)
    assert p.index.match(PREFIX, 0.0) == {"w": 40}
    assert p.heartbeat("w", Digest(1, False, PREFIX[40:], ()), 1.0)
    assert p.index.match(PREFIX, 1.0) == {"w": 80}
    assert not p.heartbeat("w", Digest(3, False, (), PREFIX[10:]), 2.0)  # #2 went missing
    assert p.stale_reports == 1
    assert p.index.match(PREFIX, 2.0) == {"w": 80}  # ignored until the next snapshot
    assert p.heartbeat("w", Digest(4, True, PREFIX[:10]), 3.0)
    assert p.index.match(PREFIX, 3.0) == {"w": 10}


def test_the_decision_log_is_bounded(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "d.jsonl", max_bytes=2048)
    for i in range(200):
        log.write({"type": "decision", "request_id": f"r{i}", "pad": "x" * 40})
    log.close()
    current = (tmp_path / "d.jsonl").read_text().splitlines()
    previous = (tmp_path / "d.jsonl.1").read_text().splitlines()
    assert (tmp_path / "d.jsonl").stat().st_size <= 2048
    assert (tmp_path / "d.jsonl.1").stat().st_size <= 2048
    assert json.loads(current[-1])["request_id"] == "r199"  # the newest lines are kept
    assert json.loads(previous[-1])["request_id"] == f"r{199 - len(current)}"
    with pytest.raises(ValueError):
        DecisionLog(tmp_path / "x.jsonl", max_bytes=10)


@pytest.mark.parametrize("weight", ["w_load", "w_cache", "w_stable", "w_busy"])
def test_a_negative_weight_is_refused(weight: str) -> None:
    # The bounds that let a decision leave workers unscored hold for weights >= 0 only.
    with pytest.raises(ValueError, match="weights must be >= 0"):
        CacheAwareConfig(**{weight: -0.5})


def test_the_core_benchmark_runs_both_policies() -> None:
    from sluice.cli.benchcore import bench_core

    for policy in ("cache-aware", "least-loaded"):
        r = bench_core(requests=2000, policy=policy)
        assert r.policy == policy and r.decisions == 2000
        assert r.sluice_us_per_decision > 0 and r.baseline_us_per_decision > 0
    with pytest.raises(ValueError):
        bench_core(requests=10, policy="nope")


def test_the_index_keeps_every_stride_th_block_and_counts_hits_in_tokens() -> None:
    p = CacheAware(CacheAwareConfig(block_tokens=BT, index_tokens=8 * BT, explore_share=0.0))
    assert p.index_block_tokens == 128
    p.observe(_req(0), "w", 0.0)
    assert len(p.index) == len(PREFIX) // 8  # 10 index entries for 80 blocks
    # A request sharing the first 45 blocks: 5 whole index entries = 640 tokens expected.
    other = _req(1, hashes=(*PREFIX[:45], *range(7000, 7035)))
    choice = p.choose(other, [_cand("w"), _cand("v")], 1.0)
    assert choice.expected_hit_tokens == 5 * 128


def test_agent_digests_are_numbered_deltas_with_periodic_bounded_snapshots() -> None:
    e = SimEngine(REFERENCE, digest_min_tokens=16, digest_stride=1)
    digests = DigestBuilder(REFERENCE.block_tokens, snapshot_every=3, max_blocks=4)
    first = digests.next(e)
    assert (first.seq, first.snapshot, first.stored) == (0, True, [])
    e.add("a", 48, 2, [1, 2, 3], 0.0)
    e.step()
    d1 = digests.next(e)
    assert (d1.seq, d1.snapshot, sorted(d1.stored)) == (1, False, [1, 2, 3])
    assert d1.block_tokens == e.profile.block_tokens
    e.add("b", 96, 2, [11, 12, 13, 14, 15, 16], 0.0)
    e.step()
    d2 = digests.next(e)  # 6 new blocks > digest_max_blocks: a bounded snapshot instead
    assert d2.seq == 2 and d2.snapshot and len(d2.stored) == 4
    d3 = digests.next(e)
    assert d3.seq == 3 and d3.snapshot  # every third digest is a snapshot anyway
    d4 = digests.next(e)
    assert d4.seq == 4 and not d4.snapshot and d4.stored == [] and d4.evicted == []


# ------------------------------------------------ the hot path's scoring against the full terms

workers_st = st.lists(
    st.tuples(
        # Few distinct loads, so that scores (and rounded queues) often tie exactly.
        st.sampled_from([0, 3, 28, 31]),  # booked
        st.sampled_from([0, 8000, 60_000]),  # reported prefill
        st.sampled_from([0, 4000]),  # unreported prefill
        st.sampled_from([0.0, 0.2, 3.0]),  # report age
        st.sampled_from([-1e9, 0.5]),  # joined long ago, or just now
        st.integers(0, 3),  # how much of the prefix its digest reports (quarters)
        st.sampled_from([0.0, 1.0, 4.0]),  # how slow its prefill is (0: never measured)
    ),
    min_size=1,
    max_size=12,
)


def _reference(p: CacheAware, request: RouteRequest, cands: list[Candidate], now: float) -> Choice:
    """The rules of the module docstring applied to the full terms of :meth:`CacheAware.score`
    (the explained path), written out plainly: what the one-pass scoring must agree with."""
    scored, reps, budget = p.score(request, cands, now)

    def key(s: Scored) -> tuple[float, float, str, int]:
        return (s.score, s.tie, s.candidate.worker_id, s.hit_tokens)

    if p._explores(request):
        cold = [s for s in scored if now - s.candidate.joined_s < p.config.explore_window_s]
        if cold and len(cold) < len(cands):
            best = min(cold, key=key)
            return Choice(best.candidate.worker_id, best.hit_tokens, "explore")
    sticky = [s for s in scored if s.candidate.worker_id in reps and not s.over_hard]
    if sticky and len(reps) >= budget:
        best = min(sticky, key=key)
        return Choice(best.candidate.worker_id, best.hit_tokens, "sticky")
    if sticky:
        best = min(
            scored,
            key=lambda s: (round(s.queue, 2), s.miss, s.tie, s.candidate.worker_id, s.hit_tokens),
        )
        return Choice(best.candidate.worker_id, best.hit_tokens, "expand")
    best = min(scored, key=key)
    return Choice(best.candidate.worker_id, best.hit_tokens, "spill" if reps else "score")


@given(workers_st, st.integers(0, 6), st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 40))
@settings(max_examples=300, deadline=None)
def test_the_one_pass_scoring_decides_as_the_full_terms_do(
    fleet: list[tuple[int, int, int, float, float, int, float]],
    routed: int,
    explore: float,
    rid: int,
) -> None:
    p = CacheAware(CacheAwareConfig(block_tokens=BT, index_tokens=BT, explore_share=explore))
    now = 1.0
    cands = []
    for i, (booked, pre, unrep, age, joined, quarters, slow) in enumerate(fleet):
        w = f"w{i}"
        cands.append(Candidate(w, 32, booked, 0, 0, pre, unrep, age, joined))
        if quarters:
            p.heartbeat(w, Digest(0, True, PREFIX[: 20 * quarters]), 0.0)
        if slow:
            for _ in range(8):  # enough completions to learn its speed
                p.completed(w, _req(99, ()), Outcome(0, slow * 0.1, 64, 64 * 0.03, 0.0))
    for j in range(routed):  # earlier requests of the prefix: replicas, budget
        p.observe(_req(1000 + j), cands[j % len(cands)].worker_id, 0.5)
    request = _req(rid)
    got = p.choose(request, cands, now)
    assert isinstance(got, Choice)
    assert got == _reference(p, request, cands, now)

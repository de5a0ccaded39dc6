"""Guards of the cache-aware policy's mechanisms (pure, deterministic, no NATS).

Each test here is built so that exactly one mechanism decides its outcome: with that mechanism
removed by hand (a one-line edit in ``dispatcher/cacheaware.py`` or ``dispatcher/affinity.py``)
the test fails. Where a case could also be decided by another term (the prefill a hit saves is
in the load term too; a worker caching a whole prefix is a sticky replica), the test arranges
the numbers so that the other terms point the other way, and asserts that they do.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.dispatcher.affinity import prefix_key
from sluice.dispatcher.cacheaware import CacheAware, CacheAwareConfig
from sluice.dispatcher.routing import Candidate, Choice, Digest, Outcome, RouteRequest

BT = 16
KEY_BLOCKS = 1024 // BT  # the default key_tokens: the first 64 blocks name a prefix
PREFIX = tuple(range(1000, 1080))  # 80 blocks = 1280 tokens
LONG = tuple(range(2000, 2100))  # 100 blocks: hit fractions in whole percent


def _req(rid: str, hashes: tuple[int, ...] = PREFIX) -> RouteRequest:
    return RouteRequest(rid, "m", len(hashes) * BT + 8, 32, hashes)


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
    base: dict[str, object] = {
        "block_tokens": BT,
        "index_tokens": BT,
        "explore_share": 0.0,
        "explain": True,
    }
    return CacheAware(CacheAwareConfig(**{**base, **kw}))  # type: ignore[arg-type]


def _terms(choice: Choice) -> dict[str, dict[str, float | str]]:
    return {str(t["worker"]): t for t in choice.terms}


def _background(p: CacheAware, n: int = 200, workers: int = 4, now_s: float = 0.0) -> None:
    """Route ``n`` one-off prefixes, so that any single prefix is a small share of traffic
    (its replica budget is then 1, as for most prefixes in a real fleet)."""
    for i in range(n):
        hashes = tuple(range(100_000 + i * 100, 100_000 + i * 100 + KEY_BLOCKS))
        p.observe(_req(f"bg{i}", hashes), f"w{i % workers}", now_s)


# ----------------------------------------------------------------------- 1. the cache term


@pytest.mark.parametrize("source", ["digest", "completion"])
def test_the_cache_term_pulls_a_request_to_the_holder_against_the_load_term(source: str) -> None:
    # sticky_cached=False: holding the prefix does not make "warm" a sticky replica, so no
    # stickiness or stability pull; and "warm" has 3000 tokens of prefill queued, so its
    # predicted TTFT (the load term, which already counts the prefill its hit saves) is
    # worse than cold's. Only w_cache x miss can make it win.
    p = _policy(sticky_cached=False)
    if source == "digest":
        p.heartbeat("warm", Digest(0, True, PREFIX), 0.0)
    else:
        outcome = Outcome(
            cached_tokens=0, prefill_s=0.16, output_tokens=33, decode_s=1.0, now_s=0.0
        )
        p.completed("warm", _req("earlier"), outcome)
    choice = p.choose(_req("r1"), [_cand("cold"), _cand("warm", prefill=3000)], 1.0)
    t = _terms(choice)
    assert t["warm"]["load"] > t["cold"]["load"], "the load term must favour the cold worker"
    assert t["warm"]["moved"] == t["cold"]["moved"] == 0.0
    assert choice.reason == "score"
    assert choice.worker_id == "warm", t


def test_a_partial_holder_wins_by_its_cache_term_with_the_default_settings() -> None:
    # Half the prompt (40 of 80 blocks) is cached on "warm": under the 64-block key, so it
    # is not a replica; the 1800 queued tokens outweigh the 640 tokens its hit saves.
    p = _policy()
    p.heartbeat("warm", Digest(0, True, PREFIX[:40]), 0.0)
    choice = p.choose(_req("r1"), [_cand("cold"), _cand("warm", prefill=1800)], 1.0)
    t = _terms(choice)
    assert t["warm"]["load"] > t["cold"]["load"]
    assert t["warm"]["miss"] == 0.5 and t["cold"]["miss"] == 1.0
    assert choice.worker_id == "warm", t


# ----------------------------------------------------------------------- 2. the stability term


def test_the_stability_term_keeps_a_spilled_prefix_on_its_replica_when_the_rest_is_as_busy() -> (
    None
):
    # "home" is the prefix's only replica (its budget is 1) but over the hard limit (30 of
    # 32 booked), so the request spills: every worker competes on its score. The routing
    # guess of the earlier request has expired (guess_ttl_s), so nobody holds the prefix in
    # the index: no cache term either. "other" is a little less loaded (29 booked); only
    # w_stable x moved keeps the prefix home.
    p = _policy(guess_ttl_s=1.0)
    _background(p)
    p.observe(_req("first"), "home", 0.0)
    key = prefix_key(PREFIX, KEY_BLOCKS)
    assert key is not None and p.affinity.replicas(key, 5.0) == ["home"]
    cands = [_cand("home", booked=30), _cand("other", booked=29)]
    choice = p.choose(_req("r1"), cands, 5.0)
    t = _terms(choice)
    assert choice.reason == "spill"
    assert t["home"]["load"] > t["other"]["load"] and t["home"]["miss"] == t["other"]["miss"]
    assert (t["home"]["moved"], t["other"]["moved"]) == (0.0, 1.0)
    assert choice.worker_id == "home", t
    # ...but it is a pull, not a rule: a much less loaded worker still takes the spill.
    relief = p.choose(_req("r2"), [_cand("home", booked=30), _cand("other", booked=10)], 5.0)
    assert relief.worker_id == "other"


# ----------------------------------------------------------------------- 3. the minimum gain


@pytest.mark.parametrize("hit_blocks", [5, 10, 20, 29, 30, 40, 60])
def test_a_hit_under_min_hit_fraction_does_not_pull_to_a_busier_worker(hit_blocks: int) -> None:
    # "warm" holds the first hit_blocks of 100 blocks and has 40 x hit_blocks tokens of
    # prefill queued: more than its hit saves (so the load term favours cold), less than
    # the hit would be worth in the cache term. Under 30 % the hit must count for nothing.
    p = _policy()
    p.heartbeat("warm", Digest(0, True, LONG[:hit_blocks]), 0.0)
    choice = p.choose(_req("r1", LONG), [_cand("cold"), _cand("warm", prefill=40 * hit_blocks)], 1)
    t = _terms(choice)
    assert t["warm"]["load"] > t["cold"]["load"]
    if hit_blocks < 30:
        assert t["warm"]["miss"] == 1.0
        assert choice.worker_id == "cold", t
    else:
        assert t["warm"]["miss"] == pytest.approx(1 - hit_blocks / 100)
        assert choice.worker_id == "warm", t


@given(st.integers(1, 29), st.integers(0, 20_000), st.integers(0, 31))
@settings(max_examples=300, deadline=None)
def test_under_the_threshold_the_load_alone_decides(hit: int, prefill: int, booked: int) -> None:
    p = _policy()
    p.heartbeat("warm", Digest(0, True, LONG[:hit]), 0.0)
    cands = [_cand("cold"), _cand("warm", booked=booked, prefill=prefill)]
    choice = p.choose(_req("r1", LONG), cands, 1.0)
    t = _terms(choice)
    if t["warm"]["load"] > t["cold"]["load"]:
        assert choice.worker_id == "cold", t


# ----------------------------------------------------------------------- 4. the hard limit


@pytest.mark.parametrize(
    ("booked", "prefill", "over"),
    [
        (28, 0, False),  # 28 of 32 < 90 %: sticky, though the other workers are idle
        (29, 0, True),  # 29 of 32 >= 90 % booked
        (0, 23_000, False),  # predicted TTFT ~2.9 s < hard_ttft_s
        (0, 24_000, True),  # predicted TTFT ~3.03 s > hard_ttft_s
    ],
)
def test_a_sticky_replica_over_the_hard_limit_spills_elsewhere(
    booked: int, prefill: int, over: bool
) -> None:
    p = _policy()
    _background(p)
    p.observe(_req("first"), "home", 0.0)
    key = prefix_key(PREFIX, KEY_BLOCKS)
    assert key is not None and p.affinity.budget(key, 4, 1.0) == 1
    cands = [_cand("home", booked=booked, prefill=prefill), _cand("a"), _cand("b"), _cand("c")]
    choice = p.choose(_req("r1"), cands, 1.0)
    assert _terms(choice)["home"]["over_hard"] == float(over)
    if over:
        assert choice.reason == "spill" and choice.worker_id != "home", choice.reason
    else:
        assert choice.reason == "sticky" and choice.worker_id == "home"


# ----------------------------------------------------------------------- 5. exploration


def test_a_new_worker_gets_the_exploration_share_though_it_is_not_better() -> None:
    p = _policy(explore_share=0.05, explore_window_s=60.0)
    # Distinct one-off prompts (no cache, no affinity); the new worker is a little busier,
    # so it never wins on its score.
    cands = [_cand("a"), _cand("b"), _cand("c"), _cand("new", booked=2, joined=100.0)]

    def share(now_s: float, n: int = 4000) -> float:
        picks = collections.Counter(
            p.choose(_req(f"e{i}", (i, i + 1)), cands, now_s).worker_id for i in range(n)
        )
        return picks["new"] / n

    assert share(150.0) == pytest.approx(0.05, abs=0.012)
    assert share(170.0, 500) == 0.0  # the window has passed: not new any more
    reason = collections.Counter(
        p.choose(_req(f"e{i}", (i, i + 1)), cands, 150.0).reason for i in range(1000)
    )
    assert reason["explore"] > 0


# ----------------------------------------------------------------------- 6. the replica budget


class _Fleet:
    """Drives the policy as the scheduler does: candidates with free capacity, ``observe``
    after each choice, requests finishing in the order they started."""

    def __init__(self, p: CacheAware, workers: int, capacity: int, in_flight: int) -> None:
        self.p = p
        self.workers = [f"w{i}" for i in range(workers)]
        self.capacity = capacity
        self.in_flight = in_flight
        self.booked = dict.fromkeys(self.workers, 0)
        self.running: collections.deque[str] = collections.deque()
        self.now = 0.0
        self.reasons: collections.Counter[str] = collections.Counter()
        self.key = prefix_key(PREFIX, KEY_BLOCKS)
        for w in self.workers:
            p.heartbeat(w, None, 0.0)

    def replicas(self) -> list[str]:
        assert self.key is not None
        return self.p.affinity.replicas(self.key, self.now)

    def budget(self) -> int:
        assert self.key is not None
        return self.p.affinity.budget(self.key, len(self.workers), self.now)

    def route(self, i: int, hot: bool) -> Choice:
        self.now += 0.01
        hashes = PREFIX if hot else tuple(range(10_000 + i * 100, 10_000 + i * 100 + 80))
        r = _req(f"q{i}", hashes)
        cands = [
            _cand(w, n, cap=self.capacity) for w, n in self.booked.items() if n < self.capacity
        ]
        before, budget = len(self.replicas()), self.budget()
        choice = self.p.choose(r, cands, self.now)
        self.p.observe(r, choice.worker_id, self.now)
        after = len(self.replicas())
        assert after <= max(before, budget), f"request {i}: {before} -> {after} > budget {budget}"
        if hot:
            self.reasons[choice.reason] += 1
        self.booked[choice.worker_id] += 1
        self.running.append(choice.worker_id)
        if len(self.running) > self.in_flight:
            self.booked[self.running.popleft()] -= 1
        return choice


def test_a_rare_prefix_keeps_one_replica_even_when_it_spills() -> None:
    # 1 request in 20 carries the prefix: its budget is one worker. Its replica is over the
    # (lowered) hard limit now and then, so some requests spill: a spill serves the request
    # elsewhere but must not make that worker a second replica.
    fleet = _Fleet(_policy(hard_load_fraction=0.5), workers=8, capacity=8, in_flight=28)
    for i in range(300):  # background only: the prefix is unknown
        fleet.route(i, hot=False)
    most = 0
    for i in range(300, 1300):
        fleet.route(i, hot=i % 20 == 0)
        if i > 320:
            assert fleet.budget() == 1
            most = max(most, len(fleet.replicas()))
    assert fleet.reasons["sticky"] > 0 and fleet.reasons["spill"] > 0, fleet.reasons
    assert most == 1


def test_a_hot_prefix_gains_replicas_as_its_share_grows_never_beyond_its_budget() -> None:
    # The prefix's share rises from 5 % to 80 % of the traffic of 8 workers: its budget
    # follows (the share is a decayed count, so it lags), and its replica set follows the
    # budget: it expands to new workers while the budget has room, never beyond it.
    fleet = _Fleet(_policy(), workers=8, capacity=32, in_flight=48)
    for i in range(300):
        fleet.route(i, hot=False)
    for i in range(300, 1000):
        fleet.route(i, hot=i % 20 == 0)
    assert fleet.budget() == 1 and len(fleet.replicas()) == 1
    for i in range(1000, 2000):
        fleet.route(i, hot=i % 5 != 0)
        assert len(fleet.replicas()) <= fleet.budget(), f"request {i}"
    budget, replicas = fleet.budget(), fleet.replicas()
    assert budget >= 4, budget
    assert budget - 1 <= len(replicas) <= budget, (replicas, budget, fleet.reasons)

"""A retried request is kept off the workers it failed on (pure core): while its model has
another live worker, a plan never offers it to one that failed it, lost it or was lost with
it, even the worker that caches its prefix; once every live worker has failed it, any may
run it again."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.cacheaware import CacheAware, CacheAwareConfig
from sluice.dispatcher.routing import (
    Candidate,
    Digest,
    ExcludingPool,
    LeastLoaded,
    ListPool,
    RoutingPolicy,
)
from sluice.dispatcher.scheduler import Request, Scheduler, WorkerInfo
from sluice.dispatcher.work import Dispatch, Ended

BT = 16
PREFIX = tuple(range(1000, 1080))  # 80 blocks: a prefix the cache-aware policy sticks to


def _cache_aware() -> CacheAware:
    return CacheAware(CacheAwareConfig(block_tokens=BT, index_tokens=BT, explore_share=0.0))


def _sched(policy: RoutingPolicy | None = None, max_attempts: int = 3) -> Scheduler:
    cfg = AdmissionConfig(global_limit=100, max_attempts=max_attempts)
    return Scheduler(cfg, policy or _cache_aware(), models=["m"])


def _req(rid: str, t: float = 0.0) -> Request:
    return Request(rid, "interactive", "m", "t", len(PREFIX) * BT + 8, 8, t, None, PREFIX)


def _worker(wid: str, capacity: int = 4, draining: bool = False) -> WorkerInfo:
    return WorkerInfo(wid, frozenset({"m"}), capacity, draining=draining)


def _place(s: Scheduler, now: float = 0.0) -> dict[str, str]:
    """Plan and book: request id -> worker."""
    out = {}
    for d in s.plan(now):
        assert s.book(d, now)
        out[d.request.request_id] = d.worker_id
    return out


def _running_on_its_cache() -> Scheduler:
    """Two workers; ``r`` runs on w1, which caches its prefix."""
    s = _sched()
    s.update_worker(_worker("w1"))
    s.update_worker(_worker("w2"))
    _cached_on(s, "w1")
    s.enqueue(_req("r"), 0.0)
    assert _place(s) == {"r": "w1"}
    return s


def _cached_on(s: Scheduler, worker_id: str) -> None:
    assert isinstance(s.policy, CacheAware)
    s.policy.heartbeat(worker_id, Digest(0, True, PREFIX), 0.0)


def test_a_request_that_failed_on_the_worker_caching_its_prefix_is_retried_elsewhere() -> None:
    s = _sched()
    for w in ("w1", "w2", "w3"):
        s.update_worker(_worker(w))
    _cached_on(s, "w1")
    s.enqueue(_req("r"), 0.0)
    assert _place(s) == {"r": "w1"}  # the prefix sticks it there
    again = s.fail("r", "w1", 1, "engine answered 400")
    assert isinstance(again, Request) and again.failed_on == {"w1"}
    placed = _place(s, 1.0)
    assert placed.keys() == {"r"} and placed["r"] != "w1"
    # A request of the same prefix that never failed still goes to the cache.
    s.enqueue(_req("fresh", 1.0), 1.0)
    assert _place(s, 1.0) == {"fresh": "w1"}


def test_a_request_lost_with_its_worker_is_kept_off_it_when_it_comes_back() -> None:
    s = _running_on_its_cache()
    requeued, ended = s.remove_worker("w1")
    assert [r.request_id for r in requeued] == ["r"] and not ended
    s.update_worker(_worker("w1"))  # the same agent, restarted
    _cached_on(s, "w1")
    assert _place(s, 1.0) == {"r": "w2"}


def test_a_request_orphaned_by_reconciliation_is_kept_off_its_worker() -> None:
    s = _running_on_its_cache()
    # w1 reports, long after the booking, that it runs nothing: "r" is an orphan.
    s.update_worker(WorkerInfo("w1", frozenset({"m"}), 4, reported_s=100.0))
    done = s.reconcile(100.0, grace_s=5.0)
    assert [r.request_id for r in done.requeued] == ["r"]
    assert _place(s, 100.0) == {"r": "w2"}


def test_the_only_worker_runs_the_retry_and_the_end_names_every_worker_it_failed_on() -> None:
    s = _sched()
    s.update_worker(_worker("w1"))
    s.enqueue(_req("r"), 0.0)
    assert _place(s) == {"r": "w1"}
    assert isinstance(s.fail("r", "w1", 1, "boom"), Request)
    assert _place(s, 1.0) == {"r": "w1"}  # no other: the worker that failed it runs it again
    s.update_worker(_worker("w2"))
    assert isinstance(s.fail("r", "w1", 2, "boom"), Request)
    assert _place(s, 2.0) == {"r": "w2"}
    ended = s.fail("r", "w2", 3, "boom again")
    assert isinstance(ended, Ended)
    assert ended.rejection.message == (
        "3 attempts failed (on w1, w2); giving up (the last: boom again)"
    )


def test_a_draining_worker_does_not_count_as_another_to_retry_on() -> None:
    s = _running_on_its_cache()
    s.update_worker(_worker("w2", draining=True))
    assert isinstance(s.fail("r", "w1", 1, "boom"), Request)
    assert _place(s, 1.0) == {"r": "w1"}


def test_kept_off_every_worker_with_room_it_waits_and_those_behind_it_go() -> None:
    s = _sched()
    s.update_worker(_worker("w1", capacity=4))
    s.update_worker(_worker("w2", capacity=1))
    _cached_on(s, "w1")
    s.enqueue(_req("r"), 0.0)
    assert _place(s) == {"r": "w1"}
    s.enqueue(Request("fill", "interactive", "m", "t", 100, 8, 0.0), 0.0)
    assert _place(s) == {"fill": "w2"}  # w2 is full now
    assert isinstance(s.fail("r", "w1", 1, "boom"), Request)
    s.enqueue(_req("behind", 0.5), 0.5)
    assert _place(s, 1.0) == {"behind": "w1"}  # r waits for w2; the one behind it goes
    assert s.hold_reason("r", 1.0) == "no-worker-room"
    s.complete("fill")
    assert _place(s, 2.0) == {"r": "w2"}


@given(
    st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=40),
    st.sets(st.integers(0, 39)),
    st.booleans(),
    st.integers(0, 39),
)
@settings(max_examples=300, deadline=None)
def test_a_plan_keeps_a_retry_off_its_failed_workers_while_another_lives(
    fleet: list[tuple[int, bool, bool]],
    failed: set[int],
    cache_aware: bool,
    cached: int,
) -> None:
    """Random fleets (room 0-3, draining or not, caching the prefix or not; past 16 workers
    the cache-aware policy shortlists through the pool's orders), random workers the request
    failed on, either policy: a plan places the request on a worker it failed on
    only when every live worker is one, and places it whenever a worker it may use has
    room."""
    s = _sched(_cache_aware() if cache_aware else LeastLoaded(1), max_attempts=10)
    ids = [f"w{i}" for i in range(len(fleet))]
    for w, (room, draining, holds) in zip(ids, fleet, strict=True):
        s.update_worker(_worker(w, capacity=max(room, 1)))
        if holds and cache_aware:
            _cached_on(s, w)
        if room == 0:  # a worker with no room: full of another request
            other = Request(f"{w}-full", "interactive", "m", "t", 10, 1, 0.0)
            s.enqueue(other, 0.0)
            assert s.book(Dispatch(other, w), 0.0)
        if draining:
            s.update_worker(_worker(w, capacity=max(room, 1), draining=True))
    if cache_aware and cached < len(ids):
        _cached_on(s, ids[cached])
    failed_on = frozenset(ids[i] for i in failed if i < len(ids))
    r = Request("r", "interactive", "m", "t", len(PREFIX) * BT + 8, 8, 0.0, None, PREFIX)
    s.enqueue(Request(**{**r.__dict__, "failed_on": failed_on}), 0.0)
    live = [w for w, (_, draining, _) in zip(ids, fleet, strict=True) if not draining]
    may = [w for w in live if w not in failed_on] or live
    with_room = [w for w in may if fleet[ids.index(w)][0] > len(s.booked_on(w))]
    placed = [d.worker_id for d in s.plan(1.0) if d.request.request_id == "r"]
    if with_room:
        assert len(placed) == 1 and placed[0] in with_room
    else:
        assert placed == []


@given(
    st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 5_000), st.integers(-5, 5)),
        min_size=1,
        max_size=8,
    ),
    st.sets(st.integers(0, 9)),
    st.sets(st.integers(0, 9)),
    st.integers(1, 4),
)
@settings(max_examples=300, deadline=None)
def test_a_pool_without_some_workers_answers_as_a_pool_of_the_others(
    fleet: list[tuple[int, int, int]], off: set[int], skip: set[int], m: int
) -> None:
    """:class:`ExcludingPool` over a pool answers every question as a pool built without
    the excluded workers would (a worker it lets through is one a policy may choose)."""
    cands = [
        Candidate(f"w{i}", 8, booked, 0, reported_prefill_tokens=pre, joined_s=float(joined))
        for i, (booked, pre, joined) in enumerate(fleet)
    ]
    out = frozenset(f"w{i}" for i in off)
    pool = ExcludingPool(ListPool(cands), out)
    rest = ListPool([c for c in cands if c.worker_id not in out])
    ids = [f"w{i}" for i in range(10)]
    blocks = {w: i % 3 for i, w in enumerate(ids)}
    skipped = {f"w{i}" for i in skip}
    assert len(pool) == len(rest) and list(pool) == list(rest)
    assert [pool.get(w) for w in ids] == [rest.get(w) for w in ids]
    assert [pool.load_key(w) for w in ids] == [rest.load_key(w) for w in ids]
    assert pool.keyed_groups(ids, blocks, skipped) == rest.keyed_groups(ids, blocks, skipped)
    assert pool.keyed_groups(ids, blocks) == rest.keyed_groups(ids, blocks)
    assert pool.least_groups(ids, blocks, skipped, m) == rest.least_groups(ids, blocks, skipped, m)
    assert pool.least_groups(ids, blocks, None, m) == rest.least_groups(ids, blocks, None, m)
    assert list(pool.ids_by_load()) == list(rest.ids_by_load())
    assert list(pool.by_load()) == list(rest.by_load())
    assert pool.least_loaded(m) == rest.least_loaded(m)
    assert pool.joined_after(0.0) == rest.joined_after(0.0)
    mine, theirs = pool.under(0.5, 0.6, 2_000.0, 10.0), rest.under(0.5, 0.6, 2_000.0, 10.0)
    assert mine is not None and theirs is not None
    assert (mine[0], sorted(mine[1])) == (theirs[0], sorted(theirs[1]))
    if len(rest):
        assert pool[0] == rest[0] and pool[-1] == rest[-1]


def test_a_worker_that_can_take_no_work_is_no_other_to_wait_for() -> None:
    """Another worker of the model that announces no capacity (its engine is down, its
    outbox full) or refused an offer is none to wait for: the retry goes back to the worker
    that failed it (it waited, unplaced, behind a worker that could never take it)."""
    for how in ("no-capacity", "refused"):
        s = _sched()
        s.update_worker(_worker("w1"))
        s.enqueue(_req("r"), 0.0)
        assert _place(s) == {"r": "w1"}
        if how == "no-capacity":
            s.update_worker(_worker("w2", capacity=0))
        else:
            s.update_worker(_worker("w2"))
            s.enqueue(Request("x", "interactive", "m", "t", 10, 1, 0.0), 0.0)
            (d,) = [d for d in s.plan(0.0) if d.worker_id == "w2"]
            s.refused(d)  # (the offer was refused: kept out of plans until it heartbeats)
            assert s.cancel("x") is not None
        assert isinstance(s.fail("r", "w1", 1, "boom"), Request)
        assert _place(s, 1.0) == {"r": "w1"}, how


def test_a_worker_that_left_the_model_is_not_counted_against_the_retry() -> None:
    """The worker a request failed on now serves another model only, and was booked by this
    plan for it: the retry still goes to the model's other worker, before the request behind
    it (the pool's size counted the other model's worker out of it)."""
    s = Scheduler(AdmissionConfig(global_limit=100), LeastLoaded(1), models=["m", "x"])
    s.update_worker(_worker("A"))
    s.update_worker(_worker("B"))
    s.enqueue(Request("r", "interactive", "m", "t", 10, 1, 0.0), 0.0)
    (d,) = s.plan(0.0)
    assert s.book(d, 0.0)
    failed_on = d.worker_id
    other = "B" if failed_on == "A" else "A"
    assert isinstance(s.fail("r", failed_on, 1, "boom"), Request)
    s.update_worker(WorkerInfo(failed_on, frozenset({"x"}), 4))
    s.enqueue(Request("x1", "interactive", "x", "t", 10, 1, -1.0), 0.5)  # (ahead of r)
    s.enqueue(Request("r2", "interactive", "m", "t", 10, 1, 0.6), 0.6)
    placed = [(d.request.request_id, d.worker_id) for d in s.plan(1.0)]
    assert ("r", other) in placed, placed
    assert next(r for r, _ in placed if r in ("r", "r2")) == "r"


def test_a_plan_looks_past_at_most_scan_limit_kept_off_requests() -> None:
    """A worker that fails every request fast always has room, and its failures queue up kept
    off it while the others are full: a plan looks past at most ``SCAN_LIMIT`` of them in a
    queue (it walked them all: 50,000 took 0.14 s a plan, 0.7 ms with the bound), so one
    behind them waits."""
    from sluice.dispatcher.planner import SCAN_LIMIT

    s = _sched(LeastLoaded(1))
    s.update_worker(_worker("bad", capacity=1))
    s.update_worker(_worker("full", capacity=1))
    blocker = Request("blocker", "interactive", "m", "t", 10, 1, 0.0)
    s.enqueue(blocker, 0.0)
    assert s.book(Dispatch(blocker, "full"), 0.0)
    for i in range(SCAN_LIMIT):
        r = Request(f"f{i}", "interactive", "m", "t", 10, 1, 0.0, failed_on=frozenset({"bad"}))
        s.enqueue(r, 0.0)
    s.enqueue(Request("fresh", "interactive", "m", "t", 10, 1, 1.0), 1.0)
    assert s.plan(2.0) == []
    s.cancel("f0")
    assert [d.request.request_id for d in s.plan(2.0)] == ["fresh"]

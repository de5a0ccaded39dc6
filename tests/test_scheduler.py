"""The pure scheduler core: ordering, aging, limits, worker choice, leases, retries."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.leases import LeaseTable
from sluice.dispatcher.routing import Candidate, LeastLoaded, RouteRequest, load_of
from sluice.dispatcher.scheduler import Request, Scheduler, WorkerInfo
from sluice.schemas.models import RejectReason

BANDS = ("interactive", "standard", "batch")


def _sched(
    global_limit: int = 4, delays: dict[str, float] | None = None, **kw: object
) -> Scheduler:
    cfg = AdmissionConfig(
        global_limit=global_limit,
        band_delay_s=delays or {"interactive": 0.0, "standard": 2.0, "batch": 10.0},
        **kw,  # type: ignore[arg-type]
    )
    return Scheduler(cfg, LeastLoaded(1), models=["m"])


def _req(rid: str, band: str = "interactive", t: float = 0.0, **kw: object) -> Request:
    base: dict[str, object] = {
        "request_id": rid,
        "band": band,
        "model": "m",
        "tenant": "t",
        "prompt_tokens": 100,
        "max_tokens": 10,
        "arrived_s": t,
    }
    base.update(kw)
    return Request(**base)  # type: ignore[arg-type]


def _worker(wid: str, capacity: int = 8, models: tuple[str, ...] = ("m",)) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, models=frozenset(models), capacity=capacity)


def _run_all(s: Scheduler, now: float) -> list[str]:
    """Plan and book everything possible; return the booked request ids in order."""
    out = []
    for d in s.plan(now):
        assert s.book(d, now)
        out.append(d.request.request_id)
    return out


# ----------------------------------------------------------------------------- ordering


def test_higher_band_overtakes_lower_under_contention() -> None:
    s = _sched(global_limit=1, band_floors={})  # aging alone (a floor would go first)
    s.update_worker(_worker("w"))
    s.enqueue(_req("b1", "batch", t=0.0), 0.0)
    s.enqueue(_req("b2", "batch", t=0.1), 0.1)
    s.enqueue(_req("i1", "interactive", t=0.2), 0.2)
    assert s.order() == ["i1", "b1", "b2"]
    assert _run_all(s, 0.3) == ["i1"]


def test_aged_low_band_request_goes_before_newer_urgent_ones() -> None:
    s = _sched(global_limit=1, band_floors={})
    s.update_worker(_worker("w"))
    s.enqueue(_req("old-batch", "batch", t=0.0), 0.0)
    s.enqueue(_req("new-int", "interactive", t=10.5), 10.5)  # arrived after 0 + 10 s delay
    assert _run_all(s, 11.0) == ["old-batch"]


def test_requests_of_a_model_without_workers_do_not_block_others() -> None:
    s = Scheduler(AdmissionConfig(global_limit=4), LeastLoaded(), models=["m", "other"])
    s.update_worker(_worker("w"))
    s.enqueue(_req("x", model="other"), 0.0)
    s.enqueue(_req("y"), 0.0)
    assert _run_all(s, 0.1) == ["y"]
    assert s.is_queued("x")


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from(BANDS), st.floats(0, 0.5), st.integers(0, 2)),
        min_size=1,
        max_size=40,
    ),
    capacity=st.integers(1, 3),
)
def test_starvation_bound(arrivals: list[tuple[str, float, int]], capacity: int) -> None:
    """No request is ever dispatched after a request that arrived later than its virtual
    deadline (arrival + band delay): the starvation bound of admission.py, between bands
    without engine-time floors (with floors, test_engine_shares.py states the bound)."""
    delays = {"interactive": 0.0, "standard": 0.5, "batch": 1.5}
    s = _sched(global_limit=capacity, delays=delays, band_floors={})
    s.update_worker(_worker("w", capacity=capacity))
    t = 0.0
    key: dict[str, float] = {}
    arrived: dict[str, float] = {}
    started: list[str] = []
    for i, (band, gap, finishing) in enumerate(arrivals):
        t += gap
        rid = f"r{i}"
        s.enqueue(_req(rid, band, t=t), t)
        key[rid], arrived[rid] = t + delays[band], t
        # 0-2 running requests finish per arrival (so queues build up), then dispatch
        for _ in range(min(finishing, s.running)):
            s.complete(sorted(s.booked_on("w"))[0])
        started += _run_all(s, t)
    while s.queued or s.running:
        if s.running:
            s.complete(sorted(s.booked_on("w"))[0])
        started += _run_all(s, t)
    assert sorted(started) == sorted(key)
    pos = {rid: i for i, rid in enumerate(started)}
    for r in key:
        for other in key:
            if arrived[other] > key[r]:
                assert pos[r] < pos[other], f"{other} overtook {r} past its bound"


# ----------------------------------------------------------------------------- limits


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["enqueue", "plan", "complete", "lose", "refuse"]),
            st.sampled_from(BANDS),
            st.integers(0, 5),
        ),
        max_size=80,
    ),
    global_limit=st.integers(1, 6),
    band_limit=st.integers(0, 4),
    capacities=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_limits_and_capacity_are_never_exceeded(
    ops: list[tuple[str, str, int]], global_limit: int, band_limit: int, capacities: list[int]
) -> None:
    cfg = AdmissionConfig(global_limit=global_limit, band_limits={"batch": band_limit})
    s = Scheduler(cfg, LeastLoaded(0), models=["m"])
    for i, c in enumerate(capacities):
        s.update_worker(_worker(f"w{i}", capacity=c))
    for step, (op, band, k) in enumerate(ops, start=1):
        now = step * 0.1
        _apply(s, op, band, k, now, f"r{step}")
        assert s.running <= global_limit
        by_band = Counter(b.band for b in s.band_snapshots(now) for _ in range(b.running))
        assert by_band["batch"] <= band_limit
        for w, info in s.workers().items():
            assert len(s.booked_on(w)) <= info.capacity


def _apply(s: Scheduler, op: str, band: str, k: int, now: float, rid: str) -> None:
    """One random operation of the property test above."""
    if op == "enqueue":
        s.enqueue(_req(rid, band, t=now), now)
    elif op == "plan":
        for d in s.plan(now):
            info = s.workers()[d.worker_id]
            assert len(s.booked_on(d.worker_id)) < info.capacity, "chosen worker is full"
            if k % 3 == 0:
                s.refused(d)
            else:
                s.book(d, now)
    elif op == "complete":
        running = sorted(rid for w in s.workers() for rid in s.booked_on(w))
        if running:
            s.complete(running[k % len(running)])
    elif op == "lose" and s.workers():
        wid = sorted(s.workers())[k % len(s.workers())]
        s.remove_worker(wid)
        if k % 2:
            s.update_worker(_worker(wid, capacity=2))  # it comes back
    elif op == "refuse":
        for w in s.workers():
            s.update_worker(s.workers()[w])  # a heartbeat clears refusals


def test_band_limit_holds_while_global_has_room() -> None:
    s = _sched(global_limit=10, band_limits={"batch": 2}, band_floors={})
    s.update_worker(_worker("w", capacity=10))
    for i in range(5):
        s.enqueue(_req(f"b{i}", "batch"), 0.0)
    s.enqueue(_req("i0", "interactive"), 0.0)
    booked = _run_all(s, 0.0)
    assert Counter(r[0] for r in booked) == {"b": 2, "i": 1}


def test_plan_is_side_effect_free() -> None:
    s = _sched()
    s.update_worker(_worker("w"))
    s.enqueue(_req("a"), 0.0)
    first = s.plan(0.0)
    assert s.plan(0.0) == first
    assert s.queued == 1 and s.running == 0


# ----------------------------------------------------------------------------- routing


@given(
    loads=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000)), min_size=1, max_size=8)
)
def test_least_loaded_picks_a_minimum(loads: list[tuple[int, int]]) -> None:
    cands = [
        Candidate(f"w{i}", capacity=8, booked=0, booked_tokens=a, reported_pending_tokens=b)
        for i, (a, b) in enumerate(loads)
    ]
    chosen = LeastLoaded(0).choose(RouteRequest("r", "m", 10, 10), cands, 0.0)
    best = min(load_of(c) for c in cands)
    assert load_of(next(c for c in cands if c.worker_id == chosen)) == best


def test_least_loaded_spreads_ties() -> None:
    cands = [Candidate(f"w{i}", 8, 0, 0) for i in range(4)]
    policy = LeastLoaded(3)
    picks = Counter(policy.choose(RouteRequest(f"r{i}", "m", 1, 1), cands, 0.0) for i in range(400))
    # Side-effect free: the same request gets the same pick every time.
    assert len({policy.choose(RouteRequest("r", "m", 1, 1), cands, 0.0) for _ in range(20)}) == 1
    assert set(picks) == {"w0", "w1", "w2", "w3"}
    assert min(picks.values()) > 60


def test_plan_spreads_load_across_idle_workers() -> None:
    s = _sched(global_limit=8)
    for w in ("a", "b", "c", "d"):
        s.update_worker(_worker(w))
    for i in range(8):
        s.enqueue(_req(f"r{i}"), 0.0)
    per_worker = Counter(d.worker_id for d in s.plan(0.0))
    assert per_worker == {"a": 2, "b": 2, "c": 2, "d": 2}


# ----------------------------------------------------------------------------- lifecycle


def test_duplicates_and_validation() -> None:
    s = _sched(max_prompt_tokens=1000)
    s.update_worker(_worker("w"))
    assert s.enqueue(_req("a"), 0.0).status == "queued"
    assert s.enqueue(_req("a"), 0.0).status == "duplicate"
    out = s.enqueue(_req("big", prompt_tokens=5000), 0.0)
    assert out.rejection is not None and out.rejection.reason is RejectReason.PROMPT_TOO_LONG
    out = s.enqueue(_req("nb", band="nope"), 0.0)
    assert out.rejection is not None and out.rejection.reason is RejectReason.UNKNOWN_BAND
    out = s.enqueue(_req("late", deadline_s=1.0), 2.0)
    assert out.rejection is not None and out.rejection.reason is RejectReason.DEADLINE_EXCEEDED


def test_unknown_model_waits_for_discovery_grace_then_is_rejected() -> None:
    s = Scheduler(AdmissionConfig(), LeastLoaded(), model_grace_s=5.0, started_s=0.0)
    assert s.enqueue(_req("a", model="x"), 1.0).status == "queued"  # workers may be starting
    s.update_worker(_worker("w", models=("y",)))
    assert s.sweep(4.0) == []
    ended = s.sweep(6.0)
    assert [e.request.request_id for e in ended] == ["a"]
    assert ended[0].rejection.reason is RejectReason.UNKNOWN_MODEL
    out = s.enqueue(_req("b", model="x"), 7.0)
    assert out.rejection is not None and out.rejection.reason is RejectReason.UNKNOWN_MODEL
    assert s.enqueue(_req("c", model="y"), 7.0).status == "queued"


def test_with_configured_models_an_unknown_model_is_rejected_at_once() -> None:
    s = Scheduler(AdmissionConfig(), LeastLoaded(), models=["m"], model_grace_s=5.0)
    out = s.enqueue(_req("a", model="x"), 1.0)  # inside the grace: it is for discovery only
    assert out.rejection is not None and out.rejection.reason is RejectReason.UNKNOWN_MODEL
    assert s.enqueue(_req("b", model="m"), 1.0).status == "queued"


def test_deadline_expires_in_queue_and_never_runs() -> None:
    s = _sched(global_limit=1)
    s.update_worker(_worker("w"))
    s.enqueue(_req("a", deadline_s=5.0), 0.0)
    s.enqueue(_req("b", deadline_s=1.0), 0.0)
    assert [d.request.request_id for d in s.plan(0.5)] == ["a"]
    assert s.plan(1.5)[0].request.request_id == "a"  # b is past its deadline: never planned
    ended = s.sweep(1.5)
    assert [e.request.request_id for e in ended] == ["b"]


def test_lost_worker_requeues_with_next_attempt_then_gives_up() -> None:
    s = _sched(global_limit=2, max_attempts=2)
    s.update_worker(_worker("w1"))
    s.enqueue(_req("a", t=0.0), 0.0)
    assert _run_all(s, 0.0) == ["a"]
    requeued, ended = s.remove_worker("w1")
    assert [r.attempt for r in requeued] == [2] and not ended
    assert s.running == 0 and s.queued == 1
    s.update_worker(_worker("w2"))
    assert _run_all(s, 1.0) == ["a"]
    requeued, ended = s.remove_worker("w2")
    assert not requeued and ended[0].rejection.reason is RejectReason.MAX_ATTEMPTS


def test_booking_is_refused_when_stale() -> None:
    s = _sched()
    s.update_worker(_worker("w"))
    s.enqueue(_req("a"), 0.0)
    (d,) = s.plan(0.0)
    assert s.complete("a") is not None  # it finished before the acceptance was processed
    assert not s.book(d, 0.0)
    assert s.running == 0
    s.enqueue(_req("b"), 0.0)
    (d,) = s.plan(0.0)
    s.remove_worker("w")
    assert not s.book(d, 0.0)  # the worker was lost meanwhile
    assert s.is_queued("b")


def test_refused_worker_is_skipped_until_its_next_heartbeat() -> None:
    s = _sched()
    s.update_worker(_worker("w1"))
    s.update_worker(_worker("w2"))
    s.enqueue(_req("a"), 0.0)
    (d,) = s.plan(0.0)
    s.refused(d)
    (d2,) = s.plan(0.0)
    assert d2.worker_id != d.worker_id
    s.refused(d2)
    assert s.plan(0.0) == []  # both refused: nobody is offered the request
    s.update_worker(_worker(d.worker_id))  # its heartbeat brings it back
    assert [x.worker_id for x in s.plan(0.0)] == [d.worker_id]


def test_adopt_books_a_request_a_worker_reports() -> None:
    s = _sched()
    s.update_worker(_worker("w"))
    s.enqueue(_req("a"), 0.0)
    assert s.adopt("a", "w", 0.0)
    assert s.booking("a") is not None and s.running == 1


def test_drift_counts_old_bookings_missing_from_reports() -> None:
    s = _sched()
    s.update_worker(_worker("w"))
    s.enqueue(_req("a"), 0.0)
    _run_all(s, 0.0)
    assert s.drift("w", 1.0, grace_s=2.0) == 0
    assert s.drift("w", 5.0, grace_s=2.0) == 1
    s.update_worker(WorkerInfo("w", frozenset({"m"}), 8, reported_in_flight=frozenset({"a"})))
    assert s.drift("w", 5.0, grace_s=2.0) == 0


def test_leases_expire_oldest_first() -> None:
    leases = LeaseTable(lease_s=3.0)
    assert leases.renew("a", 0.0)
    assert not leases.renew("a", 1.0)
    leases.renew("b", 0.5)
    assert leases.expired(3.6) == ["b"]
    assert leases.expired(10.0) == ["b", "a"]
    leases.drop("a")
    assert "a" not in leases and len(leases) == 1


def test_admission_config_validates() -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(global_limit=0)
    with pytest.raises(ValueError):
        AdmissionConfig(band_limits={"nope": 1})


def test_renew_all_gives_every_worker_a_fresh_lease() -> None:
    leases = LeaseTable(lease_s=1.0)
    leases.renew("a", 0.0)
    leases.renew("b", 5.0)
    leases.renew_all(10.0)
    assert leases.expired(10.5) == []
    assert leases.expired(11.5) == ["a", "b"]


def test_a_removed_registration_is_stale_until_the_worker_registers_afresh() -> None:
    """Fails if ``LeaseTable.remove`` forgets the registration (its heartbeats would be
    ``current``: a worker back from SIGSTOP taken back with what it ran), or if ``standing``
    stops telling a newer registration of a known lease (``replaced``) from the same one."""
    leases = LeaseTable(lease_s=1.0)
    assert leases.standing("a", 100) == "current"
    leases.renew("a", 0.0, registration=100)
    assert leases.standing("a", 100) == "current"
    assert leases.standing("a", 200) == "replaced"  # restarted within its lease
    assert leases.standing("a", 50) == "stale"  # an older incarnation
    assert leases.remove("a") == 100
    assert "a" not in leases and leases.removed("a") == 100
    assert leases.standing("a", 100) == "stale"  # back, but has not seen the notice
    assert leases.standing("a", 101) == "current"  # registered afresh
    assert leases.renew("a", 5.0, registration=101)
    assert leases.removed("a") is None and leases.standing("a", 101) == "current"
    assert leases.age_s("a", 5.5) == 0.5


def test_registration_zero_is_an_agent_that_predates_registrations() -> None:
    leases = LeaseTable(lease_s=1.0)
    leases.renew("old", 0.0)
    assert leases.remove("old") == 0 and leases.removed("old") is None
    assert leases.standing("old", 0) == "current"
    leases.renew("new", 0.0, registration=7)
    leases.drop("new")  # it left: nothing of it is remembered
    assert leases.removed("new") is None and leases.standing("new", 3) == "current"


def test_deadline_bookkeeping_stays_bounded_and_still_ends_the_queued() -> None:
    s = _sched(global_limit=10_000)
    s.update_worker(_worker("w", capacity=10_000))
    for i in range(5000):  # far deadlines, dispatched at once: their entries would linger
        s.enqueue(_req(f"r{i}", t=0.0, deadline_s=3600.0), 0.0)
        _run_all(s, 0.0)
    s.enqueue(_req("late", t=0.0, deadline_s=1.0), 0.0)
    s.update_worker(_worker("w", capacity=0))  # no room: it stays queued
    assert len(s._queues._deadlines) <= 2 * s.queued + 1024
    assert [e.request.request_id for e in s.sweep(2.0)] == ["late"]


# ----------------------------------------------------------------------------- reservations


def _snapshot(s: Scheduler) -> tuple[object, ...]:
    """What a plan reads of the scheduler: the queue in order, the books, the room and the
    quota use."""
    books = sorted((b.request.request_id, b.worker_id) for b in s._books.bookings())
    return (list(s.order()), books, s.counts(), dict(s.usage()), s.running, s.queued)


def test_a_reserved_dispatch_is_not_planned_again_and_counts_on_its_worker() -> None:
    """While an offer is in flight its request is out of the queue and takes its room: the
    next plan neither offers it again nor overfills the worker."""
    s = _sched(global_limit=8)
    s.update_worker(_worker("a", capacity=1))
    s.update_worker(_worker("b", capacity=1))
    for rid in ("r1", "r2", "r3"):
        s.enqueue(_req(rid), 0.0)
    first = s.plan(0.0)[0]
    assert s.reserve(first, 0.0) and s.reserved == 1
    assert not s.is_queued("r1") and s.running == 1
    again = s.plan(0.0)
    assert [d.request.request_id for d in again] == ["r2"]  # r1 is offered, its worker full
    assert again[0].worker_id != first.worker_id
    assert not s.reserve(first, 0.0)  # reserved once only


def test_confirm_books_once_and_withdraw_puts_the_request_back_in_its_place() -> None:
    s = _sched(global_limit=8)
    s.update_worker(_worker("a", capacity=4))
    for i, rid in enumerate(("r1", "r2", "r3")):
        s.enqueue(_req(rid, t=0.1 * i), 0.1 * i)
    before = _snapshot(s)
    d = s.plan(1.0)[0]
    assert d.request.request_id == "r1"
    assert s.reserve(d, 1.0)
    s.withdraw(d)  # refused: back to the head of the queue, the worker out of plans
    assert _snapshot(s) == before and s.reserved == 0
    assert s.plan(1.0) == []  # the refusing worker waits for its next heartbeat
    s.update_worker(_worker("a", capacity=4))
    d = s.plan(1.0)[0]
    assert s.reserve(d, 1.0) and s.confirm(d, 1.0)
    assert not s.confirm(d, 1.0)  # learned once
    assert s.booking("r1") is not None and s.reserved == 0
    s.withdraw(d)  # a late refusal of a confirmed dispatch changes no booking
    assert s.booking("r1") is not None


def test_a_reservation_whose_request_ended_meanwhile_is_not_confirmed() -> None:
    s = _sched(global_limit=8)
    s.update_worker(_worker("a", capacity=4))
    s.enqueue(_req("r1"), 0.0)
    d = s.plan(0.0)[0]
    assert s.reserve(d, 0.0)
    assert s.stop_running("r1") is not None  # cancelled while its offer was in flight
    assert not s.confirm(d, 0.1) and s.reserved == 0 and s.running == 0
    s.enqueue(_req("r2"), 0.0)
    d2 = s.plan(0.2)[0]
    assert s.reserve(d2, 0.2)
    s.remove_worker("a")  # the worker left: its reservation goes with it
    assert not s.confirm(d2, 0.3) and s.reserved == 0


@given(
    n=st.integers(1, 12),
    capacity=st.integers(1, 4),
    answers=st.lists(st.booleans(), min_size=12, max_size=12),
)
@settings(max_examples=80, deadline=None)
def test_reserving_then_answering_ends_as_booking_what_was_accepted(
    n: int, capacity: int, answers: list[bool]
) -> None:
    """A plan reserved whole, then answered (accepted or refused) one by one, leaves the same
    books, queue and quota use as booking at once what was accepted, and never more on a
    worker than its capacity."""
    piped, direct = _sched(global_limit=6), _sched(global_limit=6)
    for s in (piped, direct):
        for w in ("a", "b", "c"):
            s.update_worker(_worker(w, capacity=capacity))
        for i in range(n):
            s.enqueue(_req(f"r{i}", t=0.01 * i), 0.01 * i)
    plan = piped.plan(1.0)
    assert [(d.request.request_id, d.worker_id) for d in direct.plan(1.0)] == [
        (d.request.request_id, d.worker_id) for d in plan
    ]
    for d in plan:
        assert piped.reserve(d, 1.0)
        assert all(len(piped.booked_on(w)) <= capacity for w in ("a", "b", "c"))
    for d, ok in zip(plan, answers, strict=False):
        if ok:
            assert piped.confirm(d, 1.0) and direct.book(d, 1.0)
        else:
            piped.withdraw(d)
            direct.refused(d)
    assert piped.reserved == 0
    assert _snapshot(piped) == _snapshot(direct)


def test_a_confirmed_booking_dates_from_its_acceptance() -> None:
    """Reconciliation's grace counts from the worker's acceptance, not from the offer: an
    offer answered late is not an orphan at once."""
    s = _sched(global_limit=8)
    s.update_worker(_worker("a", capacity=4))
    s.enqueue(_req("r1"), 0.0)
    d = s.plan(0.0)[0]
    assert s.reserve(d, 0.0) and s.confirm(d, 1.5)
    booking = s.booking("r1")
    assert booking is not None and booking.booked_s == 1.5


def test_a_priced_or_retried_request_keeps_every_other_field() -> None:
    """``priced`` and ``next_attempt`` copy by hand (``dataclasses.replace`` cost twice as
    much per request): a field added to ``Request`` and forgotten there would be lost."""
    import dataclasses

    r = Request("r", "batch", "m2", "t2", 7, 3, 1.5, 9.0, (4, 5), 2, 11, 42, frozenset({"w0"}))
    values = {f.name: getattr(r, f.name) for f in dataclasses.fields(Request)}
    assert len(set(map(repr, values.values()))) == len(values)  # every field tells apart
    # A field added later (with a default) fails here until this test sets it, and so checks
    # that the copy keeps it.
    unset = [f.name for f in dataclasses.fields(Request) if getattr(r, f.name) == f.default]
    assert not unset, f"set {unset} in this test"
    priced, again = r.priced(99), r.next_attempt()
    assert dataclasses.asdict(priced) == {**values, "engine_ms": 99}
    assert dataclasses.asdict(again) == {**values, "attempt": 3}
    assert dataclasses.asdict(r.as_attempt(5)) == {**values, "attempt": 5}
    failed = dataclasses.asdict(r.next_attempt("w9"))
    assert failed == {**values, "attempt": 3, "failed_on": frozenset({"w0", "w9"})}


def test_a_failure_of_an_attempt_a_new_term_did_not_dispatch_is_retried_not_ignored() -> None:
    """After a failover the new leader's books hold a request the worker runs as attempt 2
    (the old leader's retry) as an adopted attempt 1: its message came back as any other.
    The worker's failure report of attempt 2 is of that very run: it is retried (as attempt
    3), not ignored as stale, which left the request booked on a worker that no longer ran
    it until the next reconciliation (60 s; seen in CI after a leader lost its lease). A
    report of an older attempt than the booking's is still stale, and so is one of another
    attempt than a booking this scheduler dispatched itself (test_core_parts.py)."""
    s = _sched()
    s.update_worker(_worker("w1"))
    s.enqueue(_req("r"), 0.0)  # (the redelivered message: attempt 1 for this term)
    assert s.adopt("r", "w1", 0.0)  # the worker's heartbeat lists it
    again = s.fail("r", "w1", 2, "its result cannot be stored")
    assert again is not None and again.attempt == 3, again
    s.enqueue(_req("q"), 0.0)
    assert "q" in _run_all(s, 1.0)
    assert s.fail("q", "w1", 1) is not None  # its own failure: queued as attempt 2
    assert "q" in _run_all(s, 2.0)
    booked = s.booking("q")
    assert booked is not None and booked.request.attempt == 2
    assert s.fail("q", "w1", 1) is None  # a late copy of attempt 1's report: stale
    assert s.booking("q") == booked

"""The pure parts of the core, one by one: the flap meter (and that the live scheduler and the
replay measure flaps by the same definition), the agent's acceptance, token coalescing and
outbox, the report glue (:mod:`sluice.dispatcher.feed`) and adoption at arrival."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.agent.acceptance import Verdict, review
from sluice.agent.coalesce import TokenBuffer
from sluice.agent.outbox import Outbox, Report
from sluice.dispatcher import feed
from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.affinity import prefix_key
from sluice.dispatcher.cacheaware import CacheAware, CacheAwareConfig
from sluice.dispatcher.decisions import DecisionLog
from sluice.dispatcher.errors import DigestMismatch
from sluice.dispatcher.flaps import FlapMeter
from sluice.dispatcher.routing import Digest, LeastLoaded, RoutingPolicy
from sluice.dispatcher.scheduler import Dispatch, Ended, Request, Scheduler, WorkerInfo
from sluice.schemas.models import (
    Assignment,
    CacheDigest,
    Completion,
    Heartbeat,
    RejectReason,
    Result,
    SubmitRequest,
    WorkerLoad,
)
from sluice.sim.profiles import REFERENCE
from sluice.sim.replay import ReplayConfig, replay
from sluice.sim.synthetic import SCENARIOS, Shape

# ----------------------------------------------------------------------------- helpers

Booking = tuple[tuple[int, ...], str, float]
"""(block hashes, worker, time): one booked decision."""


def brute_force_flaps(
    bookings: Sequence[Booking], key_blocks: int, window_s: float, max_keys: int = 10**9
) -> list[bool]:
    """The flap definition of :mod:`sluice.dispatcher.flaps`, read literally, over the whole
    history (times must not decrease). A booking flaps when its prefix was booked less than
    ``window_s`` ago and goes to none of the workers it was booked on since. Only the ``max_keys``
    most recently booked prefixes are remembered: a prefix is forgotten once ``max_keys`` other
    prefixes were booked after it, and its history starts again at its next booking."""
    keys = [prefix_key(b, key_blocks) for b, _, _ in bookings]
    previous: list[int | None] = []  # index of the same key's previous booking
    remembered: list[bool] = []  # whether that previous booking's history survived to here
    last: dict[int, int] = {}
    for i, k in enumerate(keys):
        if k is None:
            previous.append(None)
            remembered.append(False)
            continue
        j = last.get(k)
        previous.append(j)
        others = {keys[m] for m in range(j + 1, i) if keys[m] is not None} if j is not None else ()
        remembered.append(j is not None and len(others) < max_keys)
        last[k] = i
    out = []
    for i, (_, worker, t) in enumerate(bookings):
        history: list[int] = []
        at = i
        while remembered[at]:
            j = previous[at]
            assert j is not None
            history.append(j)
            at = j
        recent = {bookings[j][1] for j in history if t - bookings[j][2] < window_s}
        out.append(bool(recent) and worker not in recent)
    return out


def _request(rid: str, hashes: tuple[int, ...] = (), t: float = 0.0, **kw: object) -> Request:
    base: dict[str, object] = {
        "request_id": rid,
        "band": "interactive",
        "model": "m",
        "tenant": "t",
        "prompt_tokens": 16 * max(1, len(hashes)),
        "max_tokens": 4,
        "arrived_s": t,
        "block_hashes": hashes,
    }
    base.update(kw)
    return Request(**base)  # type: ignore[arg-type]


def _worker(wid: str, in_flight: Sequence[str] = (), capacity: int = 8) -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid,
        models=frozenset({"m"}),
        capacity=capacity,
        reported_in_flight=frozenset(in_flight),
    )


def _scheduler(policy: RoutingPolicy | None = None, **kw: object) -> Scheduler:
    return Scheduler(AdmissionConfig(), policy or LeastLoaded(1), models=["m"], **kw)  # type: ignore[arg-type]


def _load(**kw: int) -> WorkerLoad:
    base = {
        "running": 0,
        "waiting": 0,
        "pending_prefill_tokens": 0,
        "active_decode_tokens": 0,
        "kv_blocks_used": 0,
        "kv_blocks_total": 100,
    }
    base.update(kw)
    return WorkerLoad(busy_s_total=0.0, **base)


def _heartbeat(wid: str, in_flight: Sequence[str] = (), **kw: object) -> Heartbeat:
    base: dict[str, object] = {
        "worker_id": wid,
        "models": ["m"],
        "seq": 1,
        "sent_unix_ms": 0,
        "capacity": 8,
        "in_flight": list(in_flight),
        "load": _load(),
    }
    base.update(kw)
    return Heartbeat(**base)  # type: ignore[arg-type]


def _completion(rid: str, wid: str, *, ok: bool = True, attempt: int = 1) -> Completion:
    return Completion(
        request_id=rid,
        worker_id=wid,
        attempt=attempt,
        ok=ok,
        prompt_tokens=64,
        cached_tokens=0,
        output_tokens=4 if ok else 0,
        prefill_s=0.01 if ok else 0.0,
        decode_s=0.02 if ok else 0.0,
        error="" if ok else "engine failed",
    )


# ----------------------------------------------------------------------------- 1. flaps

A = (1, 2, 3)
B = (7, 8, 9)


def test_a_move_within_the_window_flaps_once_per_new_replica() -> None:
    m = FlapMeter(key_blocks=2, window_s=10.0)
    assert [m.booked(A, w, t) for w, t in [("w1", 0), ("w2", 1), ("w3", 2)]] == [
        False,
        True,
        True,
    ]
    # Back on workers it was booked on within the window: no flap.
    assert [m.booked(A, w, t) for w, t in [("w1", 3), ("w2", 4), ("w3", 5)]] == [False] * 3
    assert (m.decisions, m.flaps) == (6, 2) and m.rate == pytest.approx(2 / 6)


def test_after_the_window_moving_is_not_a_flap_and_blockless_requests_never_flap() -> None:
    m = FlapMeter(key_blocks=2, window_s=10.0)
    assert not m.booked(A, "w1", 0.0)
    assert m.booked(A, "w2", 9.5)  # inside the window
    assert not m.booked(A, "w3", 19.5)  # exactly window_s after the last booking: expired,
    # as a sticky replica expires then (Affinity.replicas)
    assert not m.booked(A, "w4", 30.5)  # 10.6 s after the last booking: not a flap
    for i, w in enumerate(["w1", "w2", "w3", "w4"]):
        assert not m.booked((), w, 31.0 + i)  # no full block: never a flap
    assert (m.decisions, m.flaps) == (8, 1)


def test_prefixes_are_named_by_their_leading_key_blocks() -> None:
    m = FlapMeter(key_blocks=2, window_s=10.0)
    m.booked((1, 2, 3), "w1", 0.0)
    assert m.booked((1, 2, 99), "w2", 1.0)  # same two leading blocks: the same prefix
    assert not m.booked((1, 5, 3), "w3", 2.0)  # another prefix
    assert not m.booked((1,), "w3", 3.0)  # a short prompt: its last full block names it


def test_memory_is_bounded_by_max_keys_least_recently_used_first() -> None:
    m = FlapMeter(key_blocks=1, window_s=100.0, max_keys=2)
    m.booked((1,), "w1", 0.0)
    m.booked((2,), "w1", 1.0)
    m.booked((1,), "w1", 2.0)  # prefix 1 is the most recent again
    m.booked((3,), "w1", 3.0)  # prefix 2 is forgotten
    assert len(m._served) == 2
    assert not m.booked((2,), "w2", 4.0)  # forgotten: its move is not a flap
    assert m.booked((3,), "w2", 5.0)  # prefix 3 was remembered (and prefix 1 dropped now)
    assert not m.booked((1,), "w2", 6.0)
    for k in range(100):
        m.booked((1000 + k,), "w1", 7.0)
    assert len(m._served) == 2


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from([(), (1,), (1, 2), (1, 2, 3), (1, 2, 4), (5,), (5, 6), (7, 8, 9)]),
            st.sampled_from(["w1", "w2", "w3"]),
            st.sampled_from([0.0, 0.0, 1.0, 2.0, 3.0, 4.0]),
        ),
        max_size=40,
    ),
    key_blocks=st.integers(1, 3),
    max_keys=st.sampled_from([1, 2, 3, 100_000]),
)
def test_the_meter_follows_its_definition(
    steps: list[tuple[tuple[int, ...], str, float]], key_blocks: int, max_keys: int
) -> None:
    window = 3.0  # whole-second steps: some land exactly on the window's edge
    bookings: list[Booking] = []
    t = 0.0
    for blocks, worker, dt in steps:
        t += dt
        bookings.append((blocks, worker, t))
    meter = FlapMeter(key_blocks, window_s=window, max_keys=max_keys)
    got = [meter.booked(b, w, at) for b, w, at in bookings]
    expected = brute_force_flaps(bookings, key_blocks, window, max_keys)
    assert got == expected
    assert (meter.decisions, meter.flaps) == (len(bookings), sum(expected))
    assert len(meter._served) <= max_keys


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["w1", "w2", "w3", "w4"]),
            st.sampled_from([-2.0, -1.0, 0.0, 0.0, 1.0, 2.0, 3.0]),
        ),
        max_size=40,
    )
)
def test_the_meter_takes_a_clock_that_goes_back_as_it_takes_any_clock(
    steps: list[tuple[str, float]],
) -> None:
    """The meter keeps a prefix's workers least recently booked first, and looks only at those
    that leave the window: a booking dated before the latest one (a clock that went back) must
    still leave every worker booked within the window, and only those, as checking each of
    them does."""
    window = 3.0
    meter = FlapMeter(1, window_s=window)
    booked: dict[str, float] = {}  # worker -> its last booking, as the meter's definition reads
    t = 10.0
    for worker, dt in steps:
        t += dt
        recent = {w for w, at in booked.items() if t - at < window}
        booked = {w: at for w, at in booked.items() if w in recent} | {worker: t}
        assert meter.booked((1,), worker, t) == (bool(recent) and worker not in recent)
        assert dict(meter._served[prefix_key((1,), 1)]) == booked  # type: ignore[index]


def test_the_scheduler_counts_flaps_of_what_it_books() -> None:
    """Bookings of one prefix alternating between two workers, each 0.9 s after the last,
    with a 1 s window: every booking but the first moves the prefix off its only recent
    worker."""
    s = _scheduler(flaps=FlapMeter(key_blocks=1, window_s=1.0))
    s.update_worker(_worker("w1"))
    s.update_worker(_worker("w2"))
    for i in range(6):
        t = 0.9 * i
        r = _request(f"r{i}", A, t)
        assert s.enqueue(r, t).status == "queued"
        assert s.book(Dispatch(r, ("w1", "w2")[i % 2]), t)
        assert s.complete(r.request_id) is not None
    assert (s.flaps.decisions, s.flaps.flaps) == (6, 5)
    # A decision that is not booked (stale) is not counted.
    assert not s.book(Dispatch(_request("gone", A), "w1"), 10.0)
    assert s.flaps.decisions == 6


@pytest.mark.parametrize("scenario", ["rag", "multi-turn"])
@pytest.mark.parametrize("policy", ["round-robin", "sluice"])
def test_the_replay_measures_flaps_by_the_live_definition(
    tmp_path: Path, policy: str, scenario: str
) -> None:
    """The replay's flap_rate is the flap definition applied to the decisions it booked (its
    decision log), prefixes named as the live policy names them. The traces span ~100 s, over
    three 30 s windows, and their prompts share leading blocks beyond the first (a RAG
    document after the system prompt, a conversation's history): for round-robin, another
    window or another prefix length would count other flaps."""
    trace = SCENARIOS[scenario](Shape(requests=200, rate=2.0, seed=3))
    cfg = ReplayConfig(workers=4, profile=REFERENCE)
    path = tmp_path / "decisions.jsonl"
    with DecisionLog(path) as log:
        result = replay(trace, policy, cfg, decisions=log)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    decided = [x for x in lines if x["type"] == "decision"]
    assert sorted(int(x["request_id"]) for x in decided) == list(range(len(trace)))
    routing = CacheAwareConfig(block_tokens=trace[0].block_tokens)
    bookings = [
        (trace[int(x["request_id"])].block_ids, str(x["worker"]), float(x["t_s"])) for x in decided
    ]
    flaps = brute_force_flaps(bookings, routing.key_blocks, routing.sticky_window_s)
    if policy == "round-robin":
        assert sum(flaps) >= 20  # the check has something to compare
    assert result.flap_rate == sum(flaps) / len(bookings)


# ----------------------------------------------------------------------------- 3. acceptance


def _assignment(rid: str = "r1", model: str = "m") -> Assignment:
    req = SubmitRequest(request_id=rid, model=model, prompt_text="hi", submitted_unix_ms=1)
    return Assignment(request=req, attempt=1, dispatcher_id="d", queued_s=0.0)


CALM: dict[str, object] = {
    "running": set(),
    "reported": set(),
    "draining": False,
    "in_flight": 0,
    "capacity": 2,
    "outbox_full": False,
    "models": ["m"],
}
EVERYTHING_WRONG: dict[str, object] = {
    "draining": True,
    "in_flight": 2,
    "outbox_full": True,
    "models": ["other"],
}


@pytest.mark.parametrize(
    ("changes", "action", "reason"),
    [
        ({}, "run", ""),
        ({"in_flight": 1}, "run", ""),
        ({"running": {"r1"}}, "confirm", ""),
        ({"reported": {"r1"}}, "confirm", ""),
        # A repeated hand-off is confirmed whatever the agent's state.
        ({"running": {"r1"}, **EVERYTHING_WRONG}, "confirm", ""),
        ({"reported": {"r1"}, **EVERYTHING_WRONG}, "confirm", ""),
        ({"running": {"other"}, "reported": {"another"}}, "run", ""),
        ({"draining": True}, "refuse", "draining"),
        ({"in_flight": 2}, "refuse", "full"),
        ({"in_flight": 5}, "refuse", "full"),
        ({"outbox_full": True}, "refuse", "outbox"),
        ({"models": ["other"]}, "refuse", "model"),
        ({"models": []}, "refuse", "model"),
    ],
)
def test_review(changes: dict[str, object], action: str, reason: str) -> None:
    verdict = review(_assignment(), **{**CALM, **changes})  # type: ignore[arg-type]
    assert verdict.action == action
    # The agent counts refusals by the reason's first word.
    assert verdict.reason.split(":")[0] == reason
    if action != "refuse":
        assert verdict == Verdict(action)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- 4. coalescing


def test_tokens_are_due_by_count_or_by_time() -> None:
    b = TokenBuffer()
    assert not b.due(100.0, flush_ms=15, flush_tokens=4)  # nothing buffered: never due
    b.add([1], 10.0, first=True)
    assert b.take(10.0) == (0, [1]) and b.first_token_s == 10.0
    assert b.take(10.0) is None  # nothing waits
    b.add([2, 3, 4], 10.001, first=False)
    assert not b.due(10.001, flush_ms=15, flush_tokens=4)  # 3 of 4 tokens, 1 ms of 15
    assert not b.due(10.014, flush_ms=15, flush_tokens=4)
    assert b.due(10.015, flush_ms=15, flush_tokens=4)  # by time
    b.add([5], 10.002, first=False)
    assert b.due(10.002, flush_ms=15, flush_tokens=4)  # by count
    assert b.pending == 4
    assert b.take(10.002) == (1, [2, 3, 4, 5])
    assert b.pending == 0 and b.last_flush_s == 10.002
    b.add([6], 10.003, first=False)
    assert not b.due(10.010, flush_ms=15, flush_tokens=4)  # the time counts from the take
    assert b.due(10.018, flush_ms=15, flush_tokens=4)
    assert b.first_token_s == 10.0


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.one_of(st.integers(0, 5), st.none()), max_size=40),
    flush_tokens=st.integers(1, 6),
)
def test_chunks_cover_every_token_once_in_order(ops: list[int | None], flush_tokens: int) -> None:
    """``ops``: add that many tokens, or (None) take a chunk if one is due by count."""
    b = TokenBuffer()
    produced: list[int] = []
    chunks: list[tuple[int, list[int]]] = []
    now = 0.0
    for n in ops:
        now += 0.001
        if n is not None:
            ids = list(range(len(produced), len(produced) + n))
            b.add(ids, now, first=not produced and bool(ids))
            produced.extend(ids)
            continue
        waiting = len(produced) - sum(len(tokens) for _, tokens in chunks)
        assert b.pending == waiting
        assert b.due(now, flush_ms=1e9, flush_tokens=flush_tokens) == (waiting >= flush_tokens)
        taken = b.take(now)
        assert (taken is None) == (waiting == 0)
        if taken is not None:
            chunks.append(taken)
    final = b.take(now)  # the request finished: whatever waits goes out
    if final is not None:
        chunks.append(final)
    assert b.take(now) is None and b.pending == 0
    position = 0
    for index, tokens in chunks:
        assert index == position and tokens  # consecutive ranges, never empty
        position += len(tokens)
    assert [t for _, tokens in chunks for t in tokens] == produced


# ----------------------------------------------------------------------------- 5. outbox


def _report(rid: str) -> Report:
    return Report(result=None, completion=_completion(rid, "w"))


def test_the_outbox_is_full_at_max_reports_and_drops_nothing() -> None:
    with pytest.raises(ValueError):
        Outbox(0)
    box = Outbox(max_reports=2)
    assert not box.full and len(box) == 0
    box.put(_report("a"))
    box.put(_report("a"))  # the same request again: one report
    assert len(box) == 1 and not box.full
    box.put(_report("b"))
    assert box.full and set(box) == {"a", "b"} and "a" in box
    box.put(_report("c"))  # full only refuses new work; a running request's report is kept
    assert len(box) == 3 and box.full and box.get("c") is not None
    for rid in box:  # delivering while iterating is allowed
        report = box.get(rid)
        assert report is not None
        box.done(report)
    assert len(box) == 0 and not box.full and box.get("a") is None
    box.done(_report("never-there"))


def test_a_delivered_report_does_not_take_a_newer_attempts_report_with_it() -> None:
    """Attempt 1 failed here and its report is on its way when attempt 2 (retried on this
    worker) fails too: delivering attempt 1 must leave attempt 2's report. It removed it by
    request id, and the dispatcher never heard of attempt 2 (seen, by a helper's trace)."""
    box = Outbox()
    first = Report(None, _completion("a", "w", ok=False))
    box.put(first)
    second = Report(None, _completion("a", "w", ok=False, attempt=2))
    box.put(second)
    box.done(first)
    assert box.get("a") is second
    box.done(second)
    assert box.get("a") is None


def test_the_outbox_lists_the_successes_whose_result_is_not_stored() -> None:
    box = Outbox()
    ok = Report(result=Result(request_id="a", ok=True, model="m"), completion=_completion("a", "w"))
    box.put(ok)
    box.put(_report("b"))  # its result stored already
    failed = _completion("c", "w", ok=False)
    box.put(Report(result=Result(request_id="c", ok=False, model="m"), completion=failed))
    assert box.unstored() == ["a"]  # a failure's next attempt may run elsewhere
    ok.result = None  # stored
    assert box.unstored() == []


# ----------------------------------------------------------------------------- 6. feed


def test_worker_view_maps_a_heartbeat() -> None:
    hb = _heartbeat(
        "w1",
        in_flight=["a", "b"],
        capacity=5,
        draining=True,
        models=["m", "n"],
        load=_load(pending_prefill_tokens=300, active_decode_tokens=40),
    )
    assert feed.worker_view(hb, 12.5) == WorkerInfo(
        worker_id="w1",
        models=frozenset({"m", "n"}),
        capacity=5,
        draining=True,
        reported_pending_tokens=340,
        reported_in_flight=frozenset({"a", "b"}),
        reported_prefill_tokens=300,
        reported_s=12.5,
    )


def test_digest_of_checks_the_block_size() -> None:
    assert feed.digest_of(None, 128) is None
    d = CacheDigest(seq=3, snapshot=False, block_tokens=128, stored=[1, 2], evicted=[9])
    assert feed.digest_of(d, 128) == Digest(3, False, (1, 2), (9,))
    with pytest.raises(DigestMismatch, match="128-token"):
        feed.digest_of(d, 16)


def test_a_heartbeat_adopts_a_queued_request_it_lists() -> None:
    s = _scheduler()
    s.update_worker(_worker("w1"))
    s.enqueue(_request("r1"), 0.0)
    s.enqueue(_request("r2"), 0.0)
    effects = feed.apply_heartbeat(
        s, _heartbeat("w1", ["r1", "unknown"]), 1.0, index_block_tokens=16
    )
    assert effects.adopted == ["r1"] and effects.digest_ok and effects.mismatch == ""
    booking = s.booking("r1")
    assert booking is not None and booking.worker_id == "w1"
    assert s.is_queued("r2") and not s.is_queued("r1")
    assert s.workers()["w1"].reported_in_flight == frozenset({"r1", "unknown"})


def test_a_heartbeat_with_a_digest_of_the_wrong_block_size_is_used_without_it() -> None:
    policy = CacheAware(CacheAwareConfig(block_tokens=16, index_tokens=16))
    s = _scheduler(policy)
    digest = CacheDigest(seq=0, snapshot=True, block_tokens=64, stored=[1, 2, 3])
    effects = feed.apply_heartbeat(s, _heartbeat("w1", cache=digest), 1.0, index_block_tokens=16)
    assert "64-token" in effects.mismatch
    assert "w1" in s.workers() and len(policy.index) == 0


def _booked(s: Scheduler, r: Request, worker: str, now: float) -> None:
    assert s.enqueue(r, now).status == "queued"
    assert s.book(Dispatch(r, worker), now)


def test_a_completion_ends_its_request_and_teaches_the_policy() -> None:
    # Guesses (what the dispatcher routed) expire after 1 s: only the completion can tell the
    # index, 5 s later, that the worker holds the prefix.
    policy = CacheAware(CacheAwareConfig(block_tokens=16, index_tokens=16, guess_ttl_s=1.0))
    s = _scheduler(policy)
    s.update_worker(_worker("w1"))
    s.update_worker(_worker("w2"))
    prefix = (11, 12, 13, 14)
    r = _request("r1", prefix)
    _booked(s, r, "w1", 0.0)
    assert policy.index.match(prefix, 5.0) == {}  # the routing guess has expired
    effects = feed.apply_completion(s, _completion("r1", "w1"), 5.0)
    assert effects.request == r and effects.retry is None
    assert effects.booking is not None and effects.booking.worker_id == "w1"
    assert s.running == 0 and s.booking("r1") is None and not s.is_queued("r1")
    assert policy.index.match(prefix, 5.5) == {"w1": 4}
    # A second report of the same completion changes nothing.
    assert feed.apply_completion(s, _completion("r1", "w1"), 6.0).request is None


def test_a_failed_completion_retries_the_request_as_its_next_attempt() -> None:
    s = _scheduler()
    s.update_worker(_worker("w1"))
    s.update_worker(_worker("w2"))
    _booked(s, _request("r1"), "w1", 0.0)
    # A failure from another worker, or of another attempt, is stale: ignored.
    assert feed.apply_completion(s, _completion("r1", "w2", ok=False), 1.0).retry is None
    stale = _completion("r1", "w1", ok=False, attempt=2)
    assert feed.apply_completion(s, stale, 1.0).retry is None
    assert s.booking("r1") is not None
    effects = feed.apply_completion(s, _completion("r1", "w1", ok=False), 1.0)
    assert isinstance(effects.retry, Request) and effects.retry.attempt == 2
    assert effects.request is None and s.booking("r1") is None
    queued = s.queued_request("r1")
    assert queued is not None and queued.attempt == 2
    # Out of attempts (max_attempts 3): the request ends with a typed rejection.
    assert s.book(Dispatch(queued, "w2"), 2.0)
    third = feed.apply_completion(s, _completion("r1", "w2", ok=False, attempt=2), 2.0).retry
    assert isinstance(third, Request) and third.attempt == 3
    assert s.book(Dispatch(third, "w1"), 3.0)
    last = feed.apply_completion(s, _completion("r1", "w1", ok=False, attempt=3), 3.0).retry
    assert isinstance(last, Ended) and last.rejection.reason is RejectReason.MAX_ATTEMPTS
    assert not s.is_queued("r1") and s.booking("r1") is None


# ----------------------------------------------------------------------------- 7. adoption


def test_an_arrival_a_worker_reports_running_is_adopted_there() -> None:
    s = _scheduler()
    s.update_worker(_worker("w1"))
    s.update_worker(_worker("w2", in_flight=["r1"]))
    outcome = s.enqueue(_request("r1"), 1.0)
    assert outcome.status == "adopted"
    booking = s.booking("r1")
    assert booking is not None and booking.worker_id == "w2"
    assert not s.is_queued("r1") and s.plan(1.0) == []
    # Requests nobody reports are queued as usual.
    assert s.enqueue(_request("r2"), 1.0).status == "queued"


def test_only_the_last_heartbeat_counts_for_adoption() -> None:
    s = _scheduler()
    s.update_worker(_worker("w1", in_flight=["r1", "r2"]))
    s.update_worker(_worker("w1", in_flight=["r2"]))  # r1 ended there since
    assert s.enqueue(_request("r1"), 1.0).status == "queued"
    s.update_worker(_worker("w2", in_flight=["r3"]))
    s.remove_worker("w2")  # a worker that is gone adopts nothing
    assert s.enqueue(_request("r3"), 1.0).status == "queued"
    assert s.enqueue(_request("r2"), 1.0).status == "adopted"

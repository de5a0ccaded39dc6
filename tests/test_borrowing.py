"""Borrowing and degradation between bands (pure; hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.routing import LeastLoaded
from sluice.dispatcher.scheduler import Request, Scheduler, WorkerInfo

BANDS = ("interactive", "standard", "batch")


def _sched(global_limit: int, shares: dict[str, int]) -> Scheduler:
    cfg = AdmissionConfig(global_limit=global_limit, band_shares=shares)
    s = Scheduler(cfg, LeastLoaded(0), models=["m"])
    s.update_worker(WorkerInfo("w", frozenset({"m"}), capacity=1000))
    return s


def _req(rid: str, band: str, t: float) -> Request:
    return Request(rid, band, "m", "t", 100, 10, t)


def _book(s: Scheduler, now: float) -> list[Request]:
    out = []
    for d in s.plan(now):
        assert s.book(d, now)
        out.append(d.request)
    return out


def test_an_idle_fleet_lends_its_room_to_the_batch_band() -> None:
    s = _sched(10, {"batch": 3})
    for i in range(10):
        s.enqueue(_req(f"b{i}", "batch", i), 0.0)
    assert len(_book(s, 20.0)) == 10  # nobody else waits: batch borrows beyond its share


def test_offline_gives_way_to_online_then_takes_its_share_back() -> None:
    s = _sched(10, {"batch": 3})
    for i in range(10):
        s.enqueue(_req(f"b{i}", "batch", i), 0.0)
    _book(s, 20.0)  # 10 batch running
    for i in range(8):
        s.enqueue(_req(f"i{i}", "interactive", 30.0), 30.0)
    for i in range(10, 20):
        s.enqueue(_req(f"b{i}", "batch", 5.0), 30.0)  # aged: ahead of interactive by key
    for i in range(7):  # batch requests finish one by one: their room goes to interactive
        s.complete(f"b{i}")
        got = _book(s, 31.0 + i)
        assert [r.band for r in got] == ["interactive"]
    # Batch is down to its share (3 running) and one interactive request still waits.
    s.complete("b7")  # below its share: batch gets its share back despite the pressure
    assert [r.band for r in _book(s, 40.0)] == ["batch"]
    s.complete("i0")  # at its share again: the room goes to the waiting interactive request
    assert [r.band for r in _book(s, 41.0)] == ["interactive"]
    for i in range(1, 8):
        s.complete(f"i{i}")
    got = _book(s, 50.0)  # online no longer waits: batch borrows the idle room again
    assert {r.band for r in got} == {"batch"} and len(got) == 7


events = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from(BANDS), st.floats(0, 30)),
        st.tuples(st.just("finish"), st.integers(0, 10_000)),
    ),
    max_size=120,
)


@given(st.integers(1, 10), st.dictionaries(st.sampled_from(BANDS[1:]), st.integers(0, 6)), events)
@settings(max_examples=300, deadline=None)
def test_a_pressed_band_never_grows_beyond_its_share(
    global_limit: int, shares: dict[str, int], script: list[tuple[object, ...]]
) -> None:
    s = _sched(global_limit, shares)
    running: list[Request] = []
    now = 0.0
    for i, ev in enumerate(script):
        now += 1.0
        if ev[0] == "submit":
            s.enqueue(_req(f"r{i}", str(ev[1]), now - float(ev[2])), now)  # type: ignore[arg-type]
        elif running:
            r = running.pop(int(ev[1]) % len(running))  # type: ignore[call-overload]
            s.complete(r.request_id)
        waiting = {s.queued_request(rid).band for rid in s.order()}  # type: ignore[union-attr]
        before = {b: sum(1 for r in running if r.band == b) for b in BANDS}
        got = _book(s, now)
        running += got
        for b, share in shares.items():
            urgent = BANDS[: BANDS.index(b)]
            if any(u in waiting for u in urgent):
                new = sum(1 for r in got if r.band == b)
                assert new == 0 or before[b] + new <= share, (b, before[b], new, share)
        assert len(running) <= global_limit
        # Never idle room while requests wait that no rule holds back.
        if s.queued and len(running) < global_limit:
            for rid in s.order():
                band = s.queued_request(rid).band  # type: ignore[union-attr]
                urgent = BANDS[: BANDS.index(band)]
                held = (
                    band in shares
                    and any(
                        s.queued_request(x).band in urgent
                        for x in s.order()  # type: ignore[union-attr]
                    )
                    and sum(1 for r in running if r.band == band) >= shares[band]
                )
                assert held, f"{rid} ({band}) waits while room is free"

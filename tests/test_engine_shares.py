"""Engine-time admission (pure; hypothesis): the floor and idle budgets of offline bands
(:mod:`sluice.dispatcher.shares`), what requests cost (:mod:`sluice.dispatcher.enginetime`)
and quotas in every unit (:mod:`sluice.dispatcher.quotas`).

The bounds checked here are the ones the docstring of ``shares.py`` states: a floored band's
next request is dispatched within ``c / (f x C)`` of the band's last dispatch (of cost ``c``)
plus one plan interval, and while online work waits, offline work gets its floor and nothing
more.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.enginetime import (
    DEFAULT_DECODE_TOKEN_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    EngineTime,
)
from sluice.dispatcher.quotas import Level, ModelQuota, Quotas, Unit
from sluice.dispatcher.routing import LeastLoaded
from sluice.dispatcher.scheduler import Dispatch, Request, Scheduler, WorkerInfo

BANDS = ("interactive", "standard", "batch")
TENANTS = ("t0", "t1", "t2")
EPS_S = 1e-6
"""Slack in seconds for float rounding in the buckets (far below any plan interval)."""


def _worker(wid: str, capacity: int = 8, models: tuple[str, ...] = ("m",)) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, models=frozenset(models), capacity=capacity)


def _req(
    rid: str, band: str, t: float, prompt: int = 100, out: int = 10, model: str = "m",
    tenant: str = "t",
) -> Request:  # fmt: skip
    return Request(rid, band, model, tenant, prompt, out, t)


def _book(s: Scheduler, now: float) -> list[Dispatch]:
    """Plan and book everything possible; return the booked dispatches in order."""
    out = []
    for d in s.plan(now):
        assert s.book(d, now)
        out.append(d)
    return out


def _floor_bound(rate: float, depth: float, t: float, max_cost: float) -> float:
    """Engine-seconds a floor refilled at ``rate`` since 0 may have been charged by ``t``."""
    return rate * t + depth + max_cost + 1e-9


# ----------------------------------------------------------------------------- starvation


@dataclass
class _Batch:
    arrived_s: float
    ahead: list[str]
    """Batch requests queued ahead of it when it arrived."""
    prev: str | None
    """The batch request dispatched last before it arrived."""
    at_s: float | None = None
    cost_s: float = 0.0


class _Starve:
    """One worker whose slots never bind, interactive requests waiting at every plan (batch
    is pressed all the time) and batch requests in FIFO order."""

    def __init__(self, floor: float) -> None:
        cfg = AdmissionConfig(global_limit=100_000, band_floors={"batch": floor})
        self.s = Scheduler(cfg, LeastLoaded(0), models=["m"])
        self.s.update_worker(_worker("w", capacity=100_000))
        self.rate = floor * 1.0  # C = 1 live worker
        self.depth = self.rate * cfg.burst_s
        self.batch: dict[str, _Batch] = {}
        self.waiting: list[str] = []
        self.order: list[str] = []
        self.plans: list[float] = []
        self.floor_s = 0.0
        self.max_cost = 0.0
        self.last_at, self.last_cost = -math.inf, 0.0
        self.online = 0

    def arrive(self, rid: str, prompt: int, out: int, t: float) -> None:
        prev = self.order[-1] if self.order else None
        self.batch[rid] = _Batch(t, list(self.waiting), prev)
        self.waiting.append(rid)
        assert self.s.enqueue(_req(rid, "batch", t, prompt, out), t).status == "queued"

    def step(self, t: float, online: int) -> None:
        for _ in range(online):
            self.online += 1
            self.s.enqueue(_req(f"i{self.online}", "interactive", t), t)
        self.plans.append(t)
        for d in _book(self.s, t):
            self._record(d, t)
        assert self.s.queued == len(self.waiting)  # every interactive request ran
        if self.waiting:
            # The band's next goes within c_prev / (f x C) of the band's last dispatch (or of
            # its own arrival, if later), at the first plan from then on.
            rid = self.waiting[0]
            due = max(self.batch[rid].arrived_s, self.last_at) + self.last_cost / self.rate
            assert t < due + EPS_S, f"{rid} waited past its bound {due:.3f} s (now {t:.3f} s)"
        for rid in sorted(self.s.booked_on("w")):
            self.s.complete(rid)

    def _record(self, d: Dispatch, t: float) -> None:
        rid = d.request.request_id
        if d.request.band != "batch":
            assert d.share == ""
            return
        assert d.share == "floor"  # pressed at every plan: never the idle capacity
        assert rid == self.waiting.pop(0)  # the band's next, in order
        b = self.batch[rid]
        b.at_s, b.cost_s = t, d.engine_s
        self.order.append(rid)
        self.last_at, self.last_cost = t, d.engine_s
        self.floor_s += d.engine_s
        self.max_cost = max(self.max_cost, d.engine_s)
        assert self.floor_s <= _floor_bound(self.rate, self.depth, t, self.max_cost)

    def first_plan_from(self, t: float) -> float:
        i = bisect.bisect_left(self.plans, t)
        return self.plans[i] if i < len(self.plans) else math.inf

    def check_bounds(self) -> None:
        # One with requests ahead of it costing E (as dispatched) waits at most
        # (E + c_prev) / (f x C) after its arrival, up to the first plan from then on.
        for rid, b in self.batch.items():
            assert b.at_s is not None
            e = sum(self.batch[x].cost_s for x in b.ahead)
            c = self.batch[b.prev].cost_s if b.prev is not None else 0.0
            due = b.arrived_s + (e + c) / self.rate
            assert b.at_s <= self.first_plan_from(due + EPS_S), (rid, b, due)


@settings(max_examples=80, deadline=None)
@given(
    floor=st.sampled_from([0.03, 0.1, 0.3]),
    steps=st.lists(st.floats(0.05, 0.5), min_size=5, max_size=60),
    batch=st.lists(
        st.tuples(st.integers(0, 59), st.integers(200, 4000), st.integers(20, 500)),
        min_size=1,
        max_size=8,
    ),
    online=st.lists(st.integers(1, 3), min_size=1, max_size=20),
)
def test_starvation_bound_of_a_floored_band(
    floor: float,
    steps: list[float],
    batch: list[tuple[int, int, int]],
    online: list[int],
) -> None:
    """Batch is pressed at every plan, yet each of its requests is dispatched on the floor
    within the bound of shares.py; the floor never pays out more than its rate."""
    run = _Starve(floor)
    arrivals = sorted((i % len(steps), p, o) for i, p, o in batch)
    t, n, k = 0.0, 0, 0
    while k < len(arrivals) or run.waiting:
        t += steps[n % len(steps)]
        while k < len(arrivals) and arrivals[k][0] <= n:
            run.arrive(f"b{k}", arrivals[k][1], arrivals[k][2], t)
            k += 1
        run.step(t, online[n % len(online)])
        n += 1
        assert n < 20_000, "batch starved"
    run.check_bounds()


# ----------------------------------------------------------------------------- online first


class _Mix:
    """Interactive and batch arrivals on workers with few slots; checks every plan."""

    def __init__(self, floor: float, capacities: list[int], online_limit: int | None) -> None:
        limits = {} if online_limit is None else {"interactive": online_limit}
        cfg = AdmissionConfig(band_limits=limits, band_floors={"batch": floor})
        self.s = Scheduler(cfg, LeastLoaded(0), models=["m"])
        self.capacities = {f"w{i}": c for i, c in enumerate(capacities)}
        for wid, c in self.capacities.items():
            self.s.update_worker(_worker(wid, capacity=c))
        self.rate = floor * len(capacities)  # C = live workers
        self.depth = self.rate * cfg.burst_s
        self.floor_s = self.pressed_s = self.max_cost = 0.0
        self.n = 0

    def arrive(self, band: str, k: int, t: float) -> None:
        for _ in range(k):
            self.n += 1
            prompt, out = (100, 20) if band == "interactive" else (500 * k, 100 * k)
            self.s.enqueue(_req(f"r{self.n}", band, t, prompt, out), t)

    def complete(self, k: int) -> None:
        running = sorted(r for w in self.capacities for r in self.s.booked_on(w))
        for rid in running[:k]:
            assert self.s.complete(rid) is not None

    def online_queued(self) -> bool:
        return self.s.counts().get(("m", "interactive"), (0, 0))[0] > 0

    def plan(self, t: float) -> None:
        pressed = self.online_queued()
        got = _book(self.s, t)
        for d in got:
            self._record(d, pressed)
        assert self.floor_s <= _floor_bound(self.rate, self.depth, t, self.max_cost)
        # Offline work takes no more than its floor while online work waits.
        assert self.pressed_s <= _floor_bound(self.rate, self.depth, t, self.max_cost)
        free = any(len(self.s.booked_on(w)) < c for w, c in self.capacities.items())
        if self.online_queued() and free:
            assert not [d for d in got if d.share == "idle"]

    def _record(self, d: Dispatch, pressed: bool) -> None:
        if d.request.band != "batch":
            assert d.share == ""  # online work is never charged to a budget
            return
        assert d.share in ("floor", "idle")
        assert not (pressed and d.share == "idle"), "idle capacity taken while online waits"
        self.max_cost = max(self.max_cost, d.engine_s)
        if d.share == "floor":
            self.floor_s += d.engine_s
        if pressed:
            self.pressed_s += d.engine_s


@settings(max_examples=100, deadline=None)
@given(
    floor=st.sampled_from([0.03, 0.1, 0.3]),
    capacities=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    online_limit=st.integers(1, 3) | st.none(),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["interactive", "interactive", "batch", "complete", "wait"]),
            st.integers(1, 3),
            st.floats(0.01, 1.0),
        ),
        min_size=10,
        max_size=120,
    ),
)
def test_online_never_waits_for_offline_beyond_its_floor(
    floor: float,
    capacities: list[int],
    online_limit: int | None,
    ops: list[tuple[str, int, float]],
) -> None:
    """No idle capacity is dispatched to batch while an interactive request waits, and what
    batch gets meanwhile (its floor) never exceeds the floor's rate."""
    run = _Mix(floor, capacities, online_limit)
    t = 0.0
    for kind, k, dt in ops:
        t += dt
        if kind in ("interactive", "batch"):
            run.arrive(kind, k, t)
        elif kind == "complete":
            run.complete(k)
        run.plan(t)


# ----------------------------------------------------------------------------- quotas


def _limit(quotas: Quotas, level: Level) -> int | None:
    kind, model, *name = level
    q = quotas.of(model)
    if kind == "model":
        return q.limit
    if kind == "model-band":
        return q.band_limits.get(name[0])
    return q.tenant_limit(name[0])


@st.composite
def _model_quota(draw: st.DrawFn, unit: Unit) -> ModelQuota:
    top = {"requests": 6, "tokens": 3000, "engine_ms": 600}[unit]
    lim = st.integers(0, top)
    return ModelQuota(
        limit=draw(st.none() | lim),
        band_limits=draw(st.dictionaries(st.sampled_from(BANDS), lim, max_size=3)),
        tenant_limits=draw(st.dictionaries(st.sampled_from(TENANTS), lim, max_size=2)),
        default_tenant_limit=draw(st.none() | lim),
        unit=unit,
    )


UNITS: tuple[Unit, ...] = ("requests", "tokens", "engine_ms")


@pytest.mark.parametrize("unit", UNITS)
@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    floors=st.sampled_from([None, {}]),
    capacity=st.integers(2, 50),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["enqueue", "enqueue", "plan", "complete"]),
            st.sampled_from(["a", "b"]),
            st.sampled_from(BANDS),
            st.sampled_from(TENANTS),
            st.integers(10, 1000),
            st.integers(1, 500),
        ),
        max_size=60,
    ),
)
def test_no_quota_level_is_ever_exceeded(
    unit: Unit,
    data: st.DataObject,
    floors: dict[str, float] | None,
    capacity: int,
    ops: list[tuple[str, str, str, str, int, int]],
) -> None:
    other: Unit = data.draw(st.sampled_from(UNITS))
    quotas = Quotas(
        models={"a": data.draw(_model_quota(unit))}, default=data.draw(_model_quota(other))
    )
    s = Scheduler(
        AdmissionConfig(quotas=quotas, band_floors=floors), LeastLoaded(0), models=["a", "b"]
    )
    s.update_worker(_worker("w", capacity=capacity, models=("a", "b")))
    running: set[str] = set()
    for i, (op, model, band, tenant, prompt, out) in enumerate(ops):
        now = i * 0.1
        if op == "enqueue":
            s.enqueue(_req(f"r{i}", band, now, prompt, out, model, tenant), now)
        elif op == "plan":
            running |= {d.request.request_id for d in _book(s, now)}
        elif running:
            rid = sorted(running)[prompt % len(running)]
            running.discard(rid)
            assert s.complete(rid) is not None
        expected: dict[Level, int] = {}
        for rid in running:
            booking = s.booking(rid)
            assert booking is not None
            levels, amount = s.quota_levels(booking.request)
            for level in levels:
                expected[level] = expected.get(level, 0) + amount
        usage = s.usage()
        assert usage == {lv: v for lv, v in expected.items() if v > 0}
        for level, used in usage.items():
            limit = _limit(quotas, level)
            assert limit is None or used <= limit, (level, used, limit)


# ----------------------------------------------------------------------------- plain


def test_the_default_floor_is_three_percent_for_batch() -> None:
    cfg = AdmissionConfig()
    assert cfg.band_floors is None
    assert cfg.floors == {"batch": 0.03}
    assert AdmissionConfig(bands=("interactive", "standard"), band_delay_s={}).floors == {}
    s = Scheduler(cfg, LeastLoaded(0), models=["m"])
    s.update_worker(_worker("w1"))
    s.update_worker(_worker("w2"))
    assert s.engine_figures(0.0)["batch"]["floor_s_per_s"] == pytest.approx(0.06)
    assert "floor_s_per_s" not in s.engine_figures(0.0)["interactive"]


@pytest.mark.parametrize(
    ("floors", "shares"),
    [(None, {"floor": 1, "": 1}), ({}, {"": 6})],
)
def test_empty_floors_dispatch_batch_like_any_band(
    floors: dict[str, float] | None, shares: dict[str, int]
) -> None:
    s = Scheduler(AdmissionConfig(band_floors=floors), LeastLoaded(0), models=["m"])
    s.update_worker(_worker("w", capacity=8))
    for i in range(5):
        s.enqueue(_req(f"b{i}", "batch", 0.0), 0.0)
    s.enqueue(_req("i0", "interactive", 0.0), 0.0)  # online waits: batch is pressed
    got = _book(s, 0.0)
    counts: dict[str, int] = {}
    for d in got:
        counts[d.share] = counts.get(d.share, 0) + 1
    assert counts == shares  # with a floor: one on its credit, the rest wait for more


@pytest.mark.parametrize(
    "floors",
    [{"interactive": 0.1}, {"standard": 0.6, "batch": 0.5}, {"batch": 1.5}, {"batch": -0.1}],
)
def test_bad_floors_are_rejected(floors: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(band_floors=floors)


def test_a_pressed_batch_request_without_floor_credit_is_held_by_the_floor() -> None:
    s = Scheduler(AdmissionConfig(), LeastLoaded(0), models=["m"])
    s.update_worker(_worker("w", capacity=8))
    s.enqueue(_req("b0", "batch", 0.0), 0.0)
    [first] = _book(s, 0.0)
    assert first.share == "floor" and first.engine_s > 0
    s.enqueue(_req("b1", "batch", 0.1), 0.1)
    assert s.hold_reason("b1", 0.1) == "queue"  # nobody waits: the idle capacity is there
    s.enqueue(_req("i0", "interactive", 0.1), 0.1)
    assert s.hold_reason("b1", 0.1) == "band-floor"
    assert s.engine_figures(0.1)["batch"]["floor_credit_s"] < 0
    assert [d.request.request_id for d in _book(s, 0.1)] == ["i0"]
    s.enqueue(_req("i1", "interactive", 0.2), 0.2)
    back = first.engine_s / 0.03  # the floor's credit is back to 0 then
    assert s.hold_reason("b1", back - 0.01) == "band-floor"
    assert s.hold_reason("b1", back + 0.01) == "queue"
    got = _book(s, back + 0.01)
    # A floor with credit goes first (it is guaranteed even when online work takes every slot).
    assert [(d.request.request_id, d.share) for d in got] == [("b1", "floor"), ("i1", "")]


def test_the_floor_goes_first_when_online_work_takes_every_slot() -> None:
    """Fresh batch sorts behind fresh interactive by aging (10 s), yet its floor is served
    at the next free slot: the starvation bound does not wait for the aging delay."""
    s = Scheduler(AdmissionConfig(global_limit=1), LeastLoaded(0), models=["m"])
    s.update_worker(_worker("w", capacity=1))
    s.enqueue(_req("b0", "batch", 0.0), 0.0)
    s.enqueue(_req("i0", "interactive", 0.0), 0.0)
    s.enqueue(_req("i1", "interactive", 0.0), 0.0)
    [d] = _book(s, 0.0)
    assert (d.request.request_id, d.share) == ("b0", "floor")
    s.complete("b0")
    assert [x.request.request_id for x in _book(s, 0.0)] == ["i0"]  # no credit: online first


def test_engine_cost_grows_with_uncached_prompt_and_output() -> None:
    et = EngineTime()
    r = Request("r", "batch", "m", "t", 1000, 100, 0.0)
    base = et.cost_s(r)
    assert base == pytest.approx(1000 / DEFAULT_PREFILL_TOKENS_PER_S + 100 * DEFAULT_DECODE_TOKEN_S)
    assert et.cost_s(replace(r, prompt_tokens=2000)) > base
    assert et.cost_s(replace(r, max_tokens=200)) > base
    assert et.cost_s(r, hit_tokens=500) < base
    assert et.cost_s(r, hit_tokens=5000) == et.cost_s(replace(r, prompt_tokens=1))


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.integers(1, 100_000),
    out=st.integers(1, 10_000),
    hit=st.integers(0, 100_000),
    more=st.integers(1, 1000),
)
def test_engine_cost_is_monotone(prompt: int, out: int, hit: int, more: int) -> None:
    et = EngineTime()
    r = Request("r", "batch", "m", "t", prompt, out, 0.0)
    c = et.cost_s(r, hit_tokens=hit)
    assert et.cost_s(replace(r, prompt_tokens=prompt + more), hit_tokens=hit) >= c
    assert et.cost_s(replace(r, max_tokens=out + more), hit_tokens=hit) > c
    assert et.cost_s(r, hit_tokens=hit + more) <= c
    if hit + more < prompt:
        assert et.cost_s(r, hit_tokens=hit + more) < c


def test_expected_output_falls_toward_what_completions_report() -> None:
    et = EngineTime()
    r = Request("r", "batch", "m", "t", 1000, 100, 0.0)
    assert et.expected_output(r) == 100  # until a completion is seen: max_tokens
    before, seen = et.cost_s(r), [et.expected_output(r)]
    for _ in range(100):
        et.observe("w", r, cached_tokens=0, prefill_s=0.125, output_tokens=50, decode_s=0.02)
        seen.append(et.expected_output(r))
    assert all(a > b > 50 for a, b in itertools.pairwise(seen))
    assert seen[-1] == pytest.approx(50, rel=0.02)
    assert et.cost_s(r) < before
    other = replace(r, band="interactive")
    assert et.expected_output(other) == 100  # learned per model and band

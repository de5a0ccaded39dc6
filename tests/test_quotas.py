"""Per-model quotas at every level (pure; hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.quotas import ModelQuota, Quotas, usage_ratios
from sluice.dispatcher.routing import LeastLoaded
from sluice.dispatcher.scheduler import Request, Scheduler, WorkerInfo

BANDS = ("interactive", "standard", "batch")


def _sched(quotas: Quotas, global_limit: int = 100, **kw: object) -> Scheduler:
    cfg = AdmissionConfig(global_limit=global_limit, quotas=quotas, **kw)  # type: ignore[arg-type]
    s = Scheduler(cfg, LeastLoaded(0), models=["a", "b"])
    s.update_worker(WorkerInfo("w", frozenset({"a", "b"}), capacity=1000))
    return s


def _req(rid: str, model: str = "a", tenant: str = "t", band: str = "standard",
         t: float = 0.0, prompt: int = 100, out: int = 10) -> Request:  # fmt: skip
    return Request(rid, band, model, tenant, prompt, out, t)


def _book_all(s: Scheduler, now: float = 0.0) -> list[str]:
    out = []
    for d in s.plan(now):
        assert s.book(d, now)
        out.append(d.request.request_id)
    return out


def test_a_full_tenant_does_not_hold_up_the_others() -> None:
    s = _sched(Quotas(models={"a": ModelQuota(tenant_limits={"greedy": 2})}))
    for i in range(5):
        s.enqueue(_req(f"g{i}", tenant="greedy", t=i), 0.0)
    s.enqueue(_req("x", tenant="other", t=10), 0.0)
    assert _book_all(s, 20.0) == ["g0", "g1", "x"]
    s.complete("g0")
    assert _book_all(s, 21.0) == ["g2"]  # its turn comes back as its own requests end


def test_unknown_tenants_get_the_default_limit_each() -> None:
    s = _sched(Quotas(default=ModelQuota(default_tenant_limit=1, tenant_limits={"vip": 3})))
    for t in ("x", "x", "y", "vip", "vip", "vip", "vip"):
        s.enqueue(_req(f"{t}{s.queued}", tenant=t, t=s.queued), 0.0)
    booked = _book_all(s, 10.0)
    assert Counter(r.rstrip("0123456789") for r in booked) == {"x": 1, "y": 1, "vip": 3}


def test_one_model_at_its_limit_leaves_the_other_alone() -> None:
    s = _sched(Quotas(models={"a": ModelQuota(limit=3), "b": ModelQuota(limit=3)}), 6)
    for i in range(10):
        s.enqueue(_req(f"a{i}", model="a", t=i), 0.0)
    for i in range(2):
        s.enqueue(_req(f"b{i}", model="b", t=100 + i), 0.0)
    booked = _book_all(s, 200.0)
    assert sorted(booked) == ["a0", "a1", "a2", "b0", "b1"]
    s.enqueue(_req("b2", model="b", t=201), 201.0)
    assert _book_all(s, 201.0) == ["b2"]  # model a's backlog takes none of b's room


def test_token_quotas_count_prompt_plus_output_and_keep_order() -> None:
    s = _sched(Quotas(models={"a": ModelQuota(limit=1000, unit="tokens")}))
    s.enqueue(_req("small", prompt=400, out=100, t=0), 0.0)
    s.enqueue(_req("big", prompt=600, out=100, t=1), 0.0)
    s.enqueue(_req("tiny", prompt=50, out=10, t=2), 0.0)
    # 500 used; "big" needs 700 and holds its queue: "tiny" may not starve it by slipping past.
    assert _book_all(s, 5.0) == ["small"]
    assert s.usage()[("model", "a")] == 500
    s.complete("small")
    assert _book_all(s, 6.0) == ["big", "tiny"]
    assert s.usage()[("model", "a")] == 760


def test_quotas_name_only_known_bands() -> None:
    with pytest.raises(ValueError, match="unknown bands"):
        AdmissionConfig(quotas=Quotas(models={"a": ModelQuota(band_limits={"gold": 1})}))
    with pytest.raises(ValueError, match=">= 0"):
        ModelQuota(limit=-1)


limits = st.one_of(st.none(), st.integers(0, 6))
model_quota = st.builds(
    ModelQuota,
    limit=limits,
    band_limits=st.dictionaries(st.sampled_from(BANDS), st.integers(0, 5), max_size=3),
    tenant_limits=st.dictionaries(st.sampled_from(["t1", "t2"]), st.integers(0, 4), max_size=2),
    default_tenant_limit=limits,
    unit=st.sampled_from(["requests", "tokens"]),
)
events = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.sampled_from(["a", "b"]),
            st.sampled_from(BANDS),
            st.sampled_from(["t1", "t2", "t3"]),
            st.integers(1, 4),
        ),
        st.tuples(st.just("finish"), st.integers(0, 1000)),
    ),
    max_size=80,
)


@given(
    st.dictionaries(st.sampled_from(["a", "b"]), model_quota, max_size=2),
    model_quota,
    st.integers(1, 12),
    st.dictionaries(st.sampled_from(BANDS), st.integers(0, 8), max_size=3),
    events,
)
@settings(max_examples=300, deadline=None)
def test_no_level_is_ever_exceeded(
    models: dict[str, ModelQuota],
    default: ModelQuota,
    global_limit: int,
    band_limits: dict[str, int],
    script: list[tuple[object, ...]],
) -> None:
    quotas = Quotas(models=models, default=default)
    s = _sched(quotas, global_limit, band_limits=band_limits)
    running: list[Request] = []
    now = 0.0
    for i, ev in enumerate(script):
        now += 1.0
        if ev[0] == "submit":
            _, model, band, tenant, size = ev
            s.enqueue(_req(f"r{i}", str(model), str(tenant), str(band), now, 100 * int(size),
                           10), now)  # fmt: skip
        elif running:
            done = running.pop(int(ev[1]) % len(running))  # type: ignore[call-overload]
            s.complete(done.request_id)
        for d in s.plan(now):
            assert s.book(d, now)
            running.append(d.request)
        # Recount every level from what runs, independently of the scheduler's books.
        assert len(running) <= global_limit
        by_band = Counter(r.band for r in running)
        assert all(by_band[b] <= lim for b, lim in band_limits.items())
        used: Counter[tuple[str, ...]] = Counter()
        for r in running:
            cost = quotas.of(r.model).cost(r.prompt_tokens, r.max_tokens)
            for level, _ in quotas.levels(r.model, r.band, r.tenant):
                used[level] += cost
        for r in running:
            for level, lim in quotas.levels(r.model, r.band, r.tenant):
                assert lim is None or used[level] <= lim, (level, used[level], lim)
        assert s.usage() == {k: v for k, v in used.items() if v}


def test_quotas_from_a_config_file(tmp_path: object) -> None:
    from pathlib import Path

    from sluice.dispatcher.runtime import DispatcherSettings

    path = Path(str(tmp_path)) / "sluice.toml"
    path.write_text(
        "[dispatcher]\n"
        "global_limit = 200\n"
        "[dispatcher.quotas.llama-70b]\n"
        "limit = 120\n"
        "band_limits = { batch = 80 }\n"
        "tenant_limits = { acme = 40 }\n"
        "default_tenant_limit = 10\n"
        'unit = "tokens"\n'
        "[dispatcher.default_quota]\n"
        "default_tenant_limit = 20\n"
    )
    q = DispatcherSettings.load(path).admission().quotas
    llama = q.of("llama-70b")
    assert (llama.limit, llama.unit, llama.tenant_limit("acme"), llama.tenant_limit("x")) == (
        120, "tokens", 40, 10)  # fmt: skip
    assert q.of("other").tenant_limit("anyone") == 20


def test_usage_ratios_cover_every_level_with_a_limit_and_stay_bounded() -> None:
    """The quota gauges' figures: one key per configured level, tenants without their own
    limit folded into ``MODEL/*`` (the fullest of them). Mutations: the ``MODEL/*`` key taking
    the sum instead of the fullest; a level without a limit reported."""
    quotas = Quotas(
        {
            "m": ModelQuota(
                limit=10,
                band_limits={"batch": 4},
                tenant_limits={"acme": 5},
                default_tenant_limit=2,
            )
        }
    )
    used = {
        ("model", "m"): 5,
        ("model-band", "m", "batch"): 1,
        ("model-band", "m", "interactive"): 4,  # no limit: not reported
        ("model-tenant", "m", "acme"): 3,
        ("model-tenant", "m", "t1"): 1,
        ("model-tenant", "m", "t2"): 2,
    }
    assert usage_ratios(quotas, ["m", "other"], used) == {
        ("model", "m"): 0.5,
        ("model-band", "m/batch"): 0.25,
        ("model-tenant", "m/acme"): 0.6,
        ("model-tenant", "m/*"): 1.0,
    }


def test_the_levels_remembered_per_tenant_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Levels are remembered per (model, band, tenant) for the decisions that ask again; a
    stream of new tenants must not grow that memory without bound, nor change an answer."""
    from sluice.dispatcher import quotas as qmod

    monkeypatch.setattr(qmod, "_KNOWN_MAX", 8)
    q = Quotas(default=ModelQuota(limit=5, tenant_limits={"t3": 2}, default_tenant_limit=1))
    for i in range(50):
        tenant = f"t{i % 20}"
        limits = dict(q.levels("m", "batch", tenant))
        assert limits[("model-tenant", "m", tenant)] == (2 if tenant == "t3" else 1)
        assert limits[("model", "m")] == 5
        assert len(q._known) <= 8

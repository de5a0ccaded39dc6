"""The replay simulator and the baseline policies."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.dispatcher.routing import Candidate, RouteRequest
from sluice.sim.errors import TraceError
from sluice.sim.policies import (
    POLICIES,
    ConsistentHash,
    DynamoCost,
    RoundRobin,
    SglangCacheAware,
)
from sluice.sim.profiles import PROFILES, REFERENCE
from sluice.sim.replay import ReplayConfig, replay, request_cost_s, scale_to_load
from sluice.sim.synthetic import SCENARIOS, Shape
from sluice.sim.traces import TraceRequest, load_trace, upper_bound_hits, write_jsonl

SHARED = Path(__file__).parent.parent.parent / "shared" / "traces"
CFG = ReplayConfig(workers=4, profile=REFERENCE)
needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(), reason="../shared/traces is not beside this checkout"
)


def _trace(blocks: list[tuple[int, ...]], gap_s: float = 0.05, out: int = 20) -> list[TraceRequest]:
    return [TraceRequest(i * gap_s, len(b) * 512, out, b) for i, b in enumerate(blocks)]


@needs_shared
def test_loaders_read_the_shared_traces() -> None:
    mooncake = load_trace(SHARED / "conversation_trace.jsonl")
    assert len(mooncake) == 12_031
    assert all(len(r.block_ids) == -(-r.input_tokens // 512) for r in mooncake[:500])
    hits = upper_bound_hits(mooncake)
    assert sum(hits) / sum(r.input_tokens for r in mooncake) == pytest.approx(0.3736, abs=1e-4)
    azure = load_trace(SHARED / "AzureLLMInferenceTrace_conv.csv")
    assert len(azure) == 19_366 and azure[0].arrival_s == 0.0
    assert azure[1].arrival_s == pytest.approx(4.314579, abs=1e-5)
    assert all(not r.block_ids for r in azure)


def test_bad_trace_lines_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"oops": 1}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2"):
        load_trace(bad)
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: missing field 'timestamp'"):
        load_trace(bad)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ('"timestamp": NaN, "input_length": 5', "timestamp must be a time from 0"),
        ('"timestamp": -1, "input_length": 5', "timestamp must be a time from 0"),
        # A load generator slept until it, or built a prompt of 10 GB before any check:
        ('"timestamp": 1e300, "input_length": 5', "timestamp must be a time from 0"),
        ('"timestamp": 0, "input_length": 1e10', "input_length must be within 1..10000000"),
        ('"timestamp": 0, "input_length": 5, "block_tokens": 1e10', "block_tokens must be within"),
        ('"timestamp": 0, "input_length": 0', "input_length must be within"),
        ('"timestamp": 0, "input_length": 5, "hash_ids": [3, -1]', "hash_ids must be >= 0"),
        ('"timestamp": 0, "input_length": 5, "block_tokens": 0', "block_tokens must be within"),
        ('"timestamp": 0, "input_length": 5, "deadline_ms": -1', "deadline_ms must be within"),
        ('"timestamp": 0, "input_length": 5, "deadline_ms": 1e300', "deadline_ms must be within"),
        # Each was read as another number: clamped to 1, truncated, or true taken as 1.
        ('"timestamp": 0, "input_length": 10.7', "input_length must be a whole number"),
        ('"timestamp": 0, "input_length": true', "input_length must be a whole number"),
        ('"timestamp": 0, "input_length": 5, "hash_ids": [1, 2.5]', "hash_ids must be a whole"),
        ('"timestamp": 0, "input_length": 5, "hash_ids": "12"', "hash_ids must be a list"),
        ('"timestamp": 0, "input_length": "1_000"', "input_length must be a whole number"),
        ('"timestamp": true, "input_length": 5', "timestamp must be a number"),
    ],
)
def test_a_trace_value_no_replay_can_run_is_a_trace_error(
    tmp_path: Path, fields: str, why: str
) -> None:
    """Each was a traceback from deep in a replay (IndexError, EngineError, ValueError, an
    AssertionError that called itself a replay bug). Mutation: TraceRequest.checked() not
    called by the loader."""
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
                   "{" + fields + ', "output_length": 1}\n')  # fmt: skip
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: {why}"):
        load_trace(bad)


def test_odd_trace_files_load_or_say_what_is_wrong(tmp_path: Path) -> None:
    """Each was a traceback, a misleading message or a silent misreading (a helper's probe):
    a deeply nested line (RecursionError); a line that is a JSON array; a folder ("not
    found"); an Azure CSV whose rows are not in time order (timed from its first row, so an
    earlier row was "before 0"); a ``.CSV`` read as JSONL; a byte order mark hiding the first
    column's name; a short row ("int() argument ... NoneType"); a negative count clamped."""
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    for name, text, why in [
        ("deep.jsonl", "[" * 100_000 + "\n", ":1"),
        ("array.jsonl", "[1, 2]\n", ":1: a line is one JSON object, not list"),
        ("minus.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": -5}\n',
         ":1: output_length must be >= 0"),
        ("short.csv", header + "2023-11-16 18:15:50.000,100\n",
         ":2: the row's fields do not match"),
        ("negative.csv", header + "2023-11-16 18:15:50.000,-5,10\n",
         ":2: ContextTokens must be >= 0"),
    ]:  # fmt: skip
        (tmp_path / name).write_text(text)
        with pytest.raises(TraceError, match=re.escape(name + why)):
            load_trace(tmp_path / name)
    with pytest.raises(TraceError, match="is a folder"):
        load_trace(tmp_path)
    rows = "2023-11-16 18:15:50.000,100,10\n2023-11-16 18:15:46.000,200,20\n"
    for name, data in (("unsorted.csv", header + rows),
                       ("upper.CSV", header + rows),
                       ("bom.csv", "\ufeff" + header + rows)):  # fmt: skip
        path = tmp_path / name
        path.write_text(data, encoding="utf-8")
        got = load_trace(path)
        assert [(r.arrival_s, r.input_tokens) for r in got] == [(0.0, 200), (4.0, 100)], name
    bom = tmp_path / "bom.jsonl"
    bom.write_text('\ufeff{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    assert len(load_trace(bom)) == 1


def test_a_trace_that_is_not_text_or_cannot_be_read_is_a_trace_error(tmp_path: Path) -> None:
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TraceError, match="cannot read the trace"):
        load_trace(binary)


def test_jsonl_round_trip_keeps_optional_fields(tmp_path: Path) -> None:
    reqs = SCENARIOS["mixed"](Shape(requests=200, rate=50, seed=1))
    path = tmp_path / "mixed.jsonl"
    write_jsonl(reqs, path)
    again = load_trace(path)
    assert [(r.band, r.block_ids, r.input_tokens) for r in again] == [
        (r.band, r.block_ids, r.input_tokens) for r in reqs
    ]
    assert {r.band for r in again} == {"interactive", "batch"}


def test_no_shared_prefix_gives_hit_rate_zero() -> None:
    trace = _trace([(i * 10 + 1, i * 10 + 2) for i in range(40)])
    for policy in POLICIES:
        assert replay(trace, policy, CFG).hit_rate == 0.0


def test_identical_prompts_approach_the_upper_bound_and_never_exceed_it() -> None:
    trace = _trace([(1, 2, 3, 4)] * 60, gap_s=0.5)
    bound = sum(upper_bound_hits(trace)) / sum(r.input_tokens for r in trace)
    for policy in POLICIES:
        r = replay(trace, policy, CFG)
        assert r.hit_rate <= bound + 1e-9
    assert replay(trace, "sglang-cache-aware", CFG).hit_rate > 0.9 * bound


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_no_policy_exceeds_the_bound_on_synthetic_workloads(scenario: str) -> None:
    trace = SCENARIOS[scenario](Shape(requests=300, rate=40, seed=3))
    bound = sum(upper_bound_hits(trace)) / sum(r.input_tokens for r in trace)
    for policy in POLICIES:
        r = replay(trace, policy, CFG)
        assert 0.0 <= r.hit_rate <= bound + 1e-9
        assert r.rejected == 0 and r.throughput_rps > 0


def test_same_seed_gives_byte_identical_json(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(SCENARIOS["multi-turn"](Shape(requests=300, rate=30, seed=2)), path)
    cmd = [sys.executable, "-m", "sluice.cli", "replay", "--trace", str(path), "--workers", "4",
           "--load", "0.8", "--json", "--seed", "5"]  # fmt: skip
    a = subprocess.run(cmd, capture_output=True, timeout=120, check=True).stdout
    b = subprocess.run(cmd, capture_output=True, timeout=120, check=True).stdout
    assert a == b
    doc = json.loads(a)
    assert set(doc) == {"trace", "requests", "upper_bound_hit_rate", "policies", "floor"}
    assert set(doc["policies"]) == set(POLICIES)
    assert set(doc["floor"]) == {"ttft_p50_s", "ttft_p99_s", "slo_fraction", "goodput_rps"}
    for figures in doc["policies"].values():
        assert set(figures) == {
            "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "queue_p50_s", "queue_p99_s",
            "e2e_p50_s", "throughput_rps", "goodput_rps", "util_std", "flap_rate", "rejected",
            "bands", "engine",
        }  # fmt: skip
    (tmp_path / "r.json").write_bytes(a)
    md = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "replay", "report", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert md.count("\n| `") == len(POLICIES)  # one row per policy
    assert "closes" in md and "of the goodput distance" in md
    bad = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "replay", "report", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "not the output of" in bad.stderr


def test_load_scaling_hits_the_requested_offered_load() -> None:
    trace = SCENARIOS["rag"](Shape(requests=500, rate=10, seed=0))
    scaled = scale_to_load(trace, 0.5, 8, REFERENCE)
    work = sum(request_cost_s(r, REFERENCE) for r in scaled)
    assert work / (scaled[-1].arrival_s - scaled[0].arrival_s) == pytest.approx(0.5 * 8)


def test_floor_is_a_lower_bound_on_ttft() -> None:
    from sluice.sim.replay import floor

    trace = SCENARIOS["hot-prompt"](Shape(requests=300, rate=30, seed=4))
    low = floor(trace, CFG)
    for policy in ("round-robin", "sglang-cache-aware"):
        assert replay(trace, policy, CFG).ttft_p50_s >= low["ttft_p50_s"] - 1e-9


def test_the_floor_of_a_burst_has_no_goodput_and_its_report_says_so(tmp_path: Path) -> None:
    """Requests that all arrive at one instant leave no span to count a goodput over: the floor
    leaves it out (it was 10^9 requests a second and more), and `replay report` shows "-"."""
    from sluice.sim.replay import floor

    burst = _trace([(1, 2), (1, 3), (4,)], gap_s=0.0)
    assert "goodput_rps" not in floor(burst, CFG)
    assert floor(burst, CFG)["slo_fraction"] == 1.0
    spread = _trace([(1, 2), (1, 3), (4,)], gap_s=0.5)
    assert floor(spread, CFG)["goodput_rps"] == 3.0  # three within the SLO over 1 s
    path = tmp_path / "burst.jsonl"
    write_jsonl(burst, path)
    run = [sys.executable, "-m", "sluice.cli", "replay", "--trace", str(path), "--workers", "2",
           "--compare", "round-robin,sluice", "--json"]  # fmt: skip
    done = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(done.stdout)
    assert "goodput_rps" not in doc["floor"]
    (tmp_path / "burst.json").write_text(done.stdout)
    md = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "replay", "report", str(tmp_path / "burst.json")],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "goodput -" in md and "| - |" in md, md


# ----------------------------------------------------------------------------- policies


def _cands(booked: list[int]) -> list[Candidate]:
    return [Candidate(f"w{i}", 512, b, 0) for i, b in enumerate(booked)]


def test_sglang_gate_flips_exactly_at_its_thresholds() -> None:
    p = SglangCacheAware(0)
    assert not p.imbalanced([100, 36])  # max - min = 64: not above the absolute threshold
    assert p.imbalanced([101, 36])  # 65 > 64 and 101 > 1.5 x 36
    assert not p.imbalanced([300, 200])  # 100 > 64 but 300 = 1.5 x 200: not above
    assert p.imbalanced([301, 200])


def test_sglang_follows_its_routing_history_above_the_cache_threshold() -> None:
    p = SglangCacheAware(0)
    req = RouteRequest("r", "m", 4 * 512, 10, (1, 2, 3, 4))
    p.observe(RouteRequest("x", "m", 2 * 512, 10, (1, 2)), "w2", 0.0)
    assert p.choose(req, _cands([0, 0, 5]), 0.0) == "w2"  # 2/4 = 0.5 > 0.3
    small = SglangCacheAware(0)
    small.observe(RouteRequest("x", "m", 512, 10, (1,)), "w2", 0.0)
    assert small.choose(req, _cands([3, 1, 0]), 0.0) == "w2"  # 1/4 < 0.3: least loaded
    assert small.choose(req, _cands([0, 1, 3]), 0.0) == "w0"
    imbalanced = _cands([0, 100, 100])
    assert p.choose(req, imbalanced, 0.0) == "w0"  # the gate overrides the cache


class _View:
    def __init__(
        self, cached: dict[str, int], active: dict[str, int], prefill: dict[str, int]
    ) -> None:
        self.cached, self.active, self.prefill = cached, active, prefill

    def cached_blocks(self, worker_id: str, hashes: object) -> int:
        return self.cached.get(worker_id, 0)

    def pending_prefill_blocks(self, worker_id: str) -> int:
        return self.prefill.get(worker_id, 0)

    def active_blocks(self, worker_id: str) -> int:
        return self.active.get(worker_id, 0)

    def pending_tokens(self, worker_id: str) -> int:
        return 0


def test_dynamo_cost_picks_the_argmin() -> None:
    view = _View(
        cached={"w0": 8, "w1": 2},
        active={"w0": 10, "w1": 1, "w2": 0},
        prefill={"w0": 0, "w1": 3, "w2": 0},
    )
    p = DynamoCost(view, 0, 512)
    req = RouteRequest("r", "m", 10 * 512, 10, tuple(range(10)))
    # cost = (pending prefill + uncached blocks) + active blocks:
    # w0 = (0 + 2) + 10 = 12, w1 = (3 + 8) + 1 = 12, w2 = (0 + 10) + 0 = 10
    assert [p.cost(req, c) for c in _cands([0, 0, 0])] == [12, 12, 10]
    assert p.choose(req, _cands([0, 0, 0]), 0.0) == "w2"


def test_round_robin_cycles_and_skips_full_workers() -> None:
    p = RoundRobin(["w0", "w1", "w2"])
    req = RouteRequest("r", "m", 10, 10)
    assert {p.choose(req, _cands([0, 0, 0]), 0.0) for _ in range(3)} == {"w0"}  # no side effect
    picks = []
    for _ in range(4):
        picks.append(p.choose(req, _cands([0, 0, 0]), 0.0))
        p.observe(req, picks[-1], 0.0)  # the scheduler books the choice
    assert picks == ["w0", "w1", "w2", "w0"]
    only = [c for c in _cands([0, 0, 0]) if c.worker_id != "w1"]
    assert p.choose(req, only, 0.0) == "w2"  # w1 is next but full


def test_consistent_hash_is_sticky_and_bounded() -> None:
    workers = [f"w{i}" for i in range(4)]
    p = ConsistentHash(workers)
    req = RouteRequest("r", "m", 1024, 10, (7, 8, 9))
    first = p.choose(req, _cands([0, 0, 0, 0]), 0.0)
    assert all(p.choose(req, _cands([0, 0, 0, 0]), 0.0) == first for _ in range(5))
    loaded = _cands([0, 0, 0, 0])
    loaded[int(first[1])] = Candidate(first, 512, 50, 0)  # far above 1.25 x the mean
    assert p.choose(req, loaded, 0.0) != first


def test_derived_profiles_follow_their_formula() -> None:
    p = PROFILES["8b-h100"]
    assert p.prefill_tokens_per_s == round(989e12 * 0.5 / (2 * 8.03e9))
    assert p.decode_base_s == pytest.approx(16.06e9 / (3.35e12 * 0.7), rel=1e-4)
    assert p.kv_capacity_tokens == pytest.approx((72e9 - 16.06e9) / 131_072, abs=16)
    assert PROFILES["8b-h200"].kv_capacity_tokens > p.kv_capacity_tokens
    assert dataclasses.replace(p, name="x").source.startswith("first principles")


def test_sweep_and_plots_write_their_charts(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_jsonl(SCENARIOS["hot-prompt"](Shape(requests=200, rate=30, seed=1)), trace)
    base = [sys.executable, "-m", "sluice.cli", "replay"]
    out = subprocess.run(
        [*base, "sweep", "--trace", str(trace), "--workers", "4", "--loads", "0.5,1.0",
         "--compare", "round-robin,sluice", "--plot", str(tmp_path / "sweep"), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["loads"] == [0.5, 1.0] and len(doc["policies"]["sluice"]) == 2
    assert (tmp_path / "sweep" / "sweep_goodput.png").stat().st_size > 0
    out = subprocess.run(
        [*base, "--trace", str(trace), "--workers", "4", "--compare", "round-robin,sluice",
         "--plot", str(tmp_path / "one")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "ratio to round-robin" in out.stdout
    for name in ("ttft_cdf.png", "worker_load.png", "hit_rate.png"):
        assert (tmp_path / "one" / name).stat().st_size > 0


@needs_shared
def test_replay_command_rejects_bad_arguments(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "sluice.cli", "replay"]
    cases = [
        ([*base, "--trace", str(tmp_path / "none.jsonl")], "trace not found"),
        ([*base, "--trace", str(SHARED / "AzureLLMInferenceTrace_conv.csv"), "--compare",
          "best"], "unknown policies"),
        ([*base, "--trace", str(SHARED / "AzureLLMInferenceTrace_conv.csv"), "--profile",
          "nope"], "unknown engine profile"),
    ]  # fmt: skip
    for cmd, message in cases:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, (cmd, out.stderr)


def test_decisions_file_joins_every_decision_with_its_outcome(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(SCENARIOS["hot-prompt"](Shape(requests=200, rate=30, seed=1)), path)
    out = tmp_path / "decisions.jsonl"
    cmd = [sys.executable, "-m", "sluice.cli", "replay", "--trace", str(path), "--workers", "4",
           "--compare", "sluice,round-robin", "--json", "--decisions", str(out)]  # fmt: skip
    subprocess.run(cmd, capture_output=True, timeout=120, check=True)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for policy in ("sluice", "round-robin"):
        mine = [x for x in lines if x["policy"] == policy]
        decided = {x["request_id"]: x for x in mine if x["type"] == "decision"}
        outcomes = {x["request_id"]: x for x in mine if x["type"] == "outcome"}
        assert set(decided) == set(outcomes) == {str(i) for i in range(200)}
        assert all(decided[r]["worker"] == outcomes[r]["worker"] for r in decided)
    ours = [x for x in lines if x["policy"] == "sluice" and x["type"] == "decision"]
    assert all(len(x["candidates"]) == 4 for x in ours)  # the score terms of every candidate
    assert {"worker", "hit_tokens", "ttft_s", "miss", "score"} <= set(ours[-1]["candidates"][0])
    # The index's expectation is mostly right once the prompts are known.
    late = ours[100:]
    got = {x["request_id"]: x["cached_tokens"] for x in lines
           if x["policy"] == "sluice" and x["type"] == "outcome"}  # fmt: skip
    close = sum(1 for x in late if abs(got[x["request_id"]] - x["expected_hit_tokens"]) <= 128)
    assert close >= 0.8 * len(late)


def test_sluice_replay_uses_digests_not_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sluice policy must see the fleet only as the live dispatcher does.
    from sluice.sim import replay as replay_module

    trace = SCENARIOS["multi-turn"](Shape(requests=300, rate=30, seed=3))

    def forbidden(*args: object) -> int:
        raise AssertionError("the sluice policy read the engines directly")

    for name in ("cached_blocks", "pending_prefill_blocks", "active_blocks", "pending_tokens"):
        monkeypatch.setattr(replay_module._Fleet, name, forbidden)
    result = replay(trace, "sluice", CFG)
    assert result.hit_rate > replay(trace, "round-robin", CFG).hit_rate


def test_batch_load_adds_offline_work_and_every_band_adds_up() -> None:
    from sluice.sim.replay import add_batch_load

    trace = SCENARIOS["multi-turn"](Shape(requests=400, rate=20, seed=4))
    both = add_batch_load(trace, 0.5, 4, REFERENCE, seed=1)
    batch = [r for r in both if r.band == "batch"]
    span = trace[-1].arrival_s - trace[0].arrival_s
    work = sum(request_cost_s(r, REFERENCE) for r in batch)
    assert 0.5 * 4 * span <= work < 0.5 * 4 * span + 3.0  # one request past the target at most
    assert all(not r.block_ids and r.tenant == "offline" for r in batch)
    assert add_batch_load(trace, 0.5, 4, REFERENCE, seed=1) == both  # deterministic
    result = replay(both, "sluice", CFG)
    assert set(result.bands) == {"interactive", "batch"}
    for figures in result.bands.values():
        assert figures["submitted"] == figures["completed"] + figures["rejected"]
    assert result.bands["batch"]["submitted"] == len(batch)


@pytest.mark.parametrize(
    ("scenario", "load", "policy"),
    [
        ("mixed", 0.6, "sluice"),
        ("multi-turn", 0.9, "least-pending"),  # reads the engines between steps
        ("hot-prompt", 3.0, "sluice"),  # requests queue: every step end plans again
        ("long-hogs", 1.5, "round-robin"),
        ("rag", 0.4, "batch"),  # offline work waits for engine time while engines decode
    ],
)
def test_decode_runs_change_nothing_but_the_number_of_events(
    scenario: str, load: float, policy: str
) -> None:
    from sluice.sim.replay import _Replay, add_batch_load

    shape = Shape(requests=200, rate=30, seed=2) if policy == "batch" else Shape(250, 30, 4)
    trace = scale_to_load(SCENARIOS[scenario](shape), load, 4, REFERENCE)
    if policy == "batch":
        trace = add_batch_load(trace, 1.0, 4, REFERENCE, seed=2)
    name = "sluice" if policy == "batch" else policy
    runs = _Replay(trace, name, CFG, None)
    steps = _Replay(trace, name, dataclasses.replace(CFG, decode_runs=False), None)
    fast, slow = runs.run(), steps.run()
    assert dataclasses.asdict(fast) == dataclasses.asdict(slow)  # to the last bit
    assert runs.steps == steps.steps
    # Fewer events where nothing waits (while requests wait, every step end is one).
    assert runs.step_events_seen < steps.step_events_seen / (1.2 if policy == "batch" else 3)


def test_measure_from_counts_only_the_requests_after_the_warm_up() -> None:
    """Four first turns (unmeasured), then four second turns continuing them: only the second
    turns are counted, and they hit what the first left. Fails if ``measure_from`` is ignored
    (8 submitted, and the first turns' misses halve the hit rate)."""
    first = [TraceRequest(float(i), 1024, 8, (10 + i, 20 + i)) for i in range(4)]
    second = [TraceRequest(60.0 + i, 1536, 8, (10 + i, 20 + i, 30 + i)) for i in range(4)]
    cfg = ReplayConfig(workers=2, profile=REFERENCE, measure_from=4)
    r = replay([*first, *second], "sluice", cfg)
    assert r.bands["interactive"]["submitted"] == 4
    assert r.hit_rate == pytest.approx(2 / 3)  # 2 of each second turn's 3 blocks
    assert r.last_finish_s > 63.0
    alone = replay(second, "sluice", dataclasses.replace(cfg, measure_from=0))
    assert alone.hit_rate == 0.0
    with pytest.raises(ValueError, match="measure_from"):
        replay(first, "sluice", cfg)

"""``sluice bench-memory``: what the dispatcher and the agent keep resident, per item.

Every figure comes from a fresh Python process (so its resident set holds nothing another
measurement left), which imports what the dispatcher or the agent imports, builds one kind of
state through the real code paths, and reports its resident set size (``/proc/self/statm``)
before and after, and its peak (``getrusage``). The parent divides the growth by the number of
items. One more process imports the same and builds nothing: the empty baseline, measured in
the same run. A second pass of each scenario, at a smaller size, runs under ``tracemalloc`` and
names the source lines that hold the memory (the attribution).

Scenarios (each measured alone, then all the dispatcher's together to check the sum):

- ``queued``: requests pulled into the dispatcher and held there, through
  :meth:`Intake.on_request` with real ``nats`` messages (a JetStream reply subject, a
  ``Nats-Msg-Id`` header, the msgpack body a producer publishes): what the runtime keeps per
  queued request (the message, its decoded request with the prompt's token ids, the
  scheduler's view with its block hashes, the queue slots). Measured at the prompt length asked
  for and at a short one, so the cost splits into a per-request and a per-prompt-token part.
- ``workers``: live workers, each through a heartbeat (:meth:`WorkerTraffic.on_heartbeat`) and
  one completion taught to the routing policy and the engine-time model.
- ``blocks``: block hashes in the cache index, reported by the workers' digest snapshots
  through :meth:`WorkerTraffic.on_heartbeat` (each block held by one worker).
- ``agent-served``: the ``openai-http`` engine's record of the prompts it served (its cache
  digest when the engine sends no KV events), ``HttpEngine`` fed as ``add`` feeds it.
- ``agent-kv``: the agent's mirror of an engine's KV cache from vLLM KV events
  (:class:`KVEventTracker`, fed msgpack event batches as the engine publishes them).

Prompts: token ids below 128,000 (a current vocabulary); 80 % of them start with one of 64
shared 512-token prefixes, as a fleet's system prompts do.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

VOCAB = 128_000
SHARED_PREFIXES = 64
SHARED_TOKENS = 512
SHARED_SHARE = 0.8
SHORT_PROMPT_TOKENS = 64
"""The short prompt of the second ``queued`` measurement (the per-request part)."""
TRACE_MAX_ITEMS = 5_000
"""Items built under tracemalloc at most (it costs several times the memory it traces)."""
DISPATCHER_TARGET_BYTES = 4 * 2**30
"""The budget of a dispatcher at the issue's sizes (100,000 queued requests of 1,024-token
prompts, 1,000 workers, 1,000,000 indexed blocks): a modest pod."""
AGENT_TARGET_BYTES = 256 * 2**20
"""The budget of an agent beside its engine with 10,000 cached prompts."""
CHILD_TIMEOUT_S = 1_800.0


# --------------------------------------------------------------------------------- the child


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trimmed_rss_bytes(default: int) -> int:
    """The resident set once the C allocator has returned the free memory it can to the
    system (glibc's ``malloc_trim``): what the process holds live, less the allocator's
    slack (``default`` where there is no glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return default
    trim(0)
    return _rss_bytes()


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, loaded once (None without glibc)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _prompts(n: int, tokens: int, seed: int) -> Iterator[list[int]]:
    """``n`` prompts of ``tokens`` token ids, most of them behind a shared prefix."""
    rng = random.Random(seed)
    shared = [[rng.randrange(VOCAB) for _ in range(SHARED_TOKENS)] for _ in range(SHARED_PREFIXES)]
    for _ in range(n):
        head: list[int] = []
        if tokens >= 2 * SHARED_TOKENS and rng.random() < SHARED_SHARE:
            head = shared[min(SHARED_PREFIXES - 1, int(rng.expovariate(0.1)))]
        yield head + [rng.randrange(VOCAB) for _ in range(tokens - len(head))]


class _Dispatcher:
    """The dispatcher runtime's state and the rooms that fill it (no broker needed for the
    paths driven here: a queued request, a heartbeat)."""

    def __init__(self) -> None:
        from nats.aio.client import Client as NATS

        from sluice.dispatcher.runtime.answers import Answers
        from sluice.dispatcher.runtime.intake import Intake
        from sluice.dispatcher.runtime.renewals import Renewals
        from sluice.dispatcher.runtime.settings import DispatcherSettings
        from sluice.dispatcher.runtime.state import State
        from sluice.dispatcher.runtime.workers import WorkerTraffic

        settings = DispatcherSettings(dispatcher_id="bench-memory", models=["m"])
        self.state = State(settings, None, time.monotonic())
        renewals = Renewals(self.state)
        answers = Answers(self.state, renewals)
        self.intake = Intake(self.state, answers, renewals)
        self.traffic = WorkerTraffic(self.state, answers, self.intake)
        self.nc = NATS()  # never connected: the driven paths publish nothing
        self.seq = 0

    def message(self, subject: str, data: bytes, reply: str = "", msg_id: str = "") -> Any:
        from nats.aio.msg import Msg

        from sluice.schemas import names

        headers = {names.MSG_ID_HEADER: msg_id} if msg_id else None
        return Msg(self.nc, subject=subject, reply=reply, data=data, headers=headers)

    async def queue(self, n: int, prompt_tokens: int, seed: int) -> None:
        from sluice.schemas import names
        from sluice.schemas.codec import encode
        from sluice.schemas.models import SubmitRequest

        bands = self.state.settings.bands
        stamp_ns = time.time_ns()
        for i, prompt in enumerate(_prompts(n, prompt_tokens, seed)):
            band = bands[i % len(bands)]
            rid = f"req-{seed}-{i:07d}"
            body = encode(
                SubmitRequest(
                    request_id=rid,
                    model="m",
                    tenant=f"tenant-{i % 50}",
                    band=band,
                    prompt_tokens=prompt,
                    max_tokens=256,
                    submitted_unix_ms=stamp_ns // 1_000_000,
                )
            )
            self.seq += 1
            stream = names.request_stream(band)
            reply = f"$JS.ACK.{stream}.sluice-dispatch-{band}.1.{self.seq}.{self.seq}.{stamp_ns}.0"
            subject = names.request_subject(band, "m", f"tenant-{i % 50}")
            await self.intake.on_request(band, self.message(subject, body, reply, rid))
        assert self.state.scheduler.queued == n, "every request must be queued"

    async def heartbeat(self, worker_id: str, stored: list[int] | None = None) -> None:
        from sluice.schemas import names
        from sluice.schemas.codec import encode
        from sluice.schemas.models import CacheDigest, Heartbeat, WorkerLoad

        st = self.state
        cache = None
        if stored is not None:
            cache = CacheDigest(
                seq=0, snapshot=True, block_tokens=st.index_block_tokens, stored=stored
            )
        hb = Heartbeat(
            worker_id=worker_id,
            models=["m"],
            seq=1,
            sent_unix_ms=time.time_ns() // 1_000_000,
            capacity=32,
            in_flight=[],
            load=WorkerLoad(
                running=0,
                waiting=0,
                pending_prefill_tokens=0,
                active_decode_tokens=0,
                kv_blocks_used=0,
                kv_blocks_total=32_768,
                busy_s_total=0.0,
            ),
            cache=cache,
            registration=1,
        )
        await self.traffic.on_heartbeat(
            self.message(names.heartbeat_subject(worker_id), encode(hb))
        )

    async def workers(self, n: int) -> None:
        from sluice.dispatcher.routing import Outcome, RouteRequest
        from sluice.dispatcher.work import Request
        from sluice.schemas.models import Completion

        for i in range(n):
            await self.heartbeat(_worker(i))
        now = time.monotonic()
        for i in range(n):
            w = _worker(i)
            # One completion per worker, as WorkerTraffic.on_completion feeds it: the policy's
            # speeds, the engine-time model and the per-worker hit counters.
            request = Request(f"done-{i}", "standard", "m", "default", 1024, 256, now)
            outcome = Outcome(
                cached_tokens=512, prefill_s=0.1, output_tokens=256, decode_s=2.0, now_s=now
            )
            self.state.policy.completed(w, RouteRequest(f"done-{i}", "m", 1024, 256), outcome)
            self.state.scheduler.engine_time.observe(
                w, request, cached_tokens=512, prefill_s=0.1, output_tokens=256, decode_s=2.0
            )
            done = Completion(
                request_id=f"done-{i}",
                worker_id=w,
                attempt=1,
                ok=True,
                prompt_tokens=1024,
                cached_tokens=512,
                output_tokens=256,
                prefill_s=0.1,
                decode_s=2.0,
            )
            self.traffic._count_hits(done, None)
        assert len(self.state.leases) == n

    async def blocks(self, n: int, workers: int, seed: int) -> None:
        rng = random.Random(seed)
        per = -(-n // workers)
        left = n
        for i in range(workers):
            k = min(per, left)
            left -= k
            await self.heartbeat(_worker(i), [rng.getrandbits(64) for _ in range(k)])
        assert self.state.policy.stats(time.monotonic()).index_blocks == n, "all indexed"

    def prefixes(self, n: int, workers: int, seed: int) -> None:
        from sluice.dispatcher.routing import RouteRequest

        rng = random.Random(seed)
        st = self.state
        now = time.monotonic()
        for i in range(n):
            # What Scheduler.book records per prefix (its index guesses aside: a one-block
            # prompt has no indexed block): the stickiness and traffic share, and the flaps.
            hashes = (rng.getrandbits(64),)
            w = _worker(i % workers)
            st.policy.observe(RouteRequest(f"p{i}", "m", 16, 16, hashes), w, now)
            st.scheduler.flaps.booked(hashes, w, now)


def _worker(i: int) -> str:
    return f"worker-{i:05d}"


class _AgentPrompts:
    """The agent's records of cached prompts, fed as the agent feeds them."""

    def __init__(self) -> None:
        from sluice.schemas.hashing import DEFAULT_BLOCK_TOKENS, DEFAULT_INDEX_TOKENS, index_stride

        self.block_tokens = DEFAULT_BLOCK_TOKENS
        self.stride = index_stride(DEFAULT_BLOCK_TOKENS, DEFAULT_INDEX_TOKENS)

    def engine(self) -> None:
        from sluice.agent.runtime.httpengine import HttpEngine, HttpEngineConfig

        self.http = HttpEngine(
            HttpEngineConfig(
                url="http://127.0.0.1:9",
                model="m",
                block_tokens=self.block_tokens,
                stride=self.stride,
            )
        )

    def served(self, n: int, prompt_tokens: int, seed: int) -> int:
        from sluice.schemas.hashing import block_hashes

        engine = self.http
        for i, prompt in enumerate(_prompts(n, prompt_tokens, seed)):
            # What HttpEngine.add records of every request it starts (add itself also opens
            # the request's HTTP stream, which needs an engine).
            engine._record(len(prompt), block_hashes(prompt, self.block_tokens))
            if i % 100 == 99:
                engine.cache_changes()  # a heartbeat's digest takes them
        engine.cache_changes()
        return len(engine.cached_blocks())

    def kv(self, n: int, prompt_tokens: int, seed: int) -> int:
        import msgpack

        from sluice.agent.kvevents import KVEventTracker, decode_batch

        tracker = KVEventTracker(self.block_tokens, self.stride)
        rng = random.Random(seed + 1)
        engine_hash: dict[tuple[int, ...], int] = {}  # the engine's hash of a shared block
        bt = self.block_tokens
        for i, prompt in enumerate(_prompts(n, prompt_tokens, seed)):
            full = len(prompt) // bt * bt
            parent: int | None = None
            start = 0
            # The engine stores a shared prefix's blocks once; later prompts behind it store
            # only their own blocks, chained to its last one.
            while start < min(full, SHARED_TOKENS):
                key = tuple(prompt[: start + bt])
                if key not in engine_hash:
                    break
                parent = engine_hash[key]
                start += bt
            hashes = [rng.getrandbits(63) for _ in range((full - start) // bt)]
            for j, h in enumerate(hashes):
                end = start + (j + 1) * bt
                if end <= SHARED_TOKENS:
                    engine_hash[tuple(prompt[:end])] = h
            event = ["BlockStored", hashes, parent, prompt[start:full], bt, None, "GPU"]
            payload: bytes = msgpack.packb([time.time(), [event], 0])
            tracker.apply(i, decode_batch(payload))
            if i % 100 == 99:
                tracker.cache_changes()
        tracker.cache_changes()
        self.tracker = tracker
        return len(tracker)


def _build(scenario: str, p: dict[str, int]) -> tuple[Callable[[], Any], Callable[[], int]]:
    """(setup, build) of a scenario: setup is not measured; build returns the items built."""
    if scenario not in _SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(_SCENARIOS)}")
    seed = p.get("seed", 0)
    d = (
        _Dispatcher()
        if scenario in ("queued", "workers", "blocks", "prefixes", "dispatcher")
        else None
    )
    a = _AgentPrompts() if scenario.startswith("agent-") else None

    def setup() -> None:
        if a is not None:
            a.engine()
        if d is not None and scenario in ("blocks", "prefixes"):
            asyncio.run(_each_worker(d, p["workers"]))

    async def everything() -> None:
        assert d is not None
        await d.workers(p["workers"])
        await d.blocks(p["blocks"], p["workers"], seed)
        d.prefixes(p["prefixes"], p["workers"], seed)
        await d.queue(p["queued"], p["prompt_tokens"], seed)

    runs: dict[str, Callable[[], object]] = {"empty": lambda: None}
    if d is not None:
        runs["queued"] = lambda: asyncio.run(d.queue(p["items"], p["prompt_tokens"], seed))
        runs["workers"] = lambda: asyncio.run(d.workers(p["items"]))
        runs["blocks"] = lambda: asyncio.run(d.blocks(p["items"], p["workers"], seed))
        runs["prefixes"] = lambda: d.prefixes(p["items"], p["workers"], seed)
        runs["dispatcher"] = lambda: asyncio.run(everything())
    if a is not None:
        runs["agent-served"] = lambda: a.served(p["items"], p["prompt_tokens"], seed)
        runs["agent-kv"] = lambda: a.kv(p["items"], p["prompt_tokens"], seed)

    def build() -> int:
        runs[scenario]()
        return int(p.get("items", 0))

    return setup, build


_SCENARIOS = (
    "empty",
    "queued",
    "workers",
    "blocks",
    "prefixes",
    "dispatcher",
    "agent-served",
    "agent-kv",
)


async def _each_worker(d: _Dispatcher, n: int) -> None:
    for i in range(n):
        await d.heartbeat(_worker(i))


def _imports() -> None:
    """What every child imports first: the dispatcher's and the agent's modules (so the
    baseline holds the same code as every measurement)."""
    import msgpack  # noqa: F401
    import nats.aio.client  # noqa: F401

    import sluice.agent.kvevents
    import sluice.agent.runtime.httpengine
    import sluice.dispatcher.runtime.intake
    import sluice.dispatcher.runtime.state
    import sluice.dispatcher.runtime.workers  # noqa: F401


def child(scenario: str, params: dict[str, int], trace: bool) -> dict[str, Any]:
    """Run one scenario in this (fresh) process; returns its figures."""
    _imports()
    setup, build = _build(scenario, params)
    setup()
    gc.collect()
    # Trimmed, the base of both the growth and the live growth: the live growth compared an
    # untrimmed before with a trimmed after, and came out negative (-156,058 B a worker at
    # small sizes); trimmed between the before and the build, the growth lost the slack.
    before = _trimmed_rss_bytes(_rss_bytes())
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    built = build()
    seconds = time.perf_counter() - t0
    gc.collect()
    traced_out: dict[str, Any] = {}
    if trace:  # (before the figures below are read: their reading is not the scenario's)
        snap = tracemalloc.take_snapshot()
        traced, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        traced_out = {"traced_bytes": traced, "top": _top(snap, traced)}
    after = _rss_bytes()
    return {
        "scenario": scenario,
        "params": params,
        "items": built,
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "rss_trimmed_bytes": _trimmed_rss_bytes(after),
        "maxrss_bytes": _maxrss_bytes(),
        "seconds": round(seconds, 3),
        **traced_out,
    }


def _top(snap: tracemalloc.Snapshot, traced: int, n: int = 6) -> list[dict[str, Any]]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for stat in snap.statistics("lineno")[:n]:
        frame = stat.traceback[0]
        name = frame.filename
        if "site-packages/" in name:
            name = name.split("site-packages/")[-1]
        elif "/lib/python" in name:  # the standard library
            name = "python" + name.split("/lib/python")[-1]
        elif name.startswith(here):
            name = os.path.relpath(name, here)
        rows.append(
            {
                "site": f"{name}:{frame.lineno}",
                "bytes": stat.size,
                "share": round(stat.size / max(1, traced), 3),
            }
        )
    return rows


# --------------------------------------------------------------------------------- the parent


@dataclass(frozen=True)
class Sizes:
    """What the benchmark builds: the issue's sizes by default."""

    queued: int = 100_000
    workers: int = 1_000
    blocks: int = 1_000_000
    prefixes: int = 200_000
    """Prefix keys booked (the default bound, ``routing_prefix_max_keys``)."""
    prompts: int = 10_000
    prompt_tokens: int = 1_024
    runs: int = 3
    attribution: bool = True


def run_child(scenario: str, params: dict[str, int], trace: bool = False) -> dict[str, Any]:
    """One scenario in a fresh interpreter."""
    # (Here: a child imports only what it measures.)
    from sluice.testing.processes import DIE_WITH_PARENT, PYTHON

    cmd = [*PYTHON, "-m", "sluice.cli.benchmemory", scenario, json.dumps(params)]
    if trace:
        cmd.append("--trace")
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
        preexec_fn=DIE_WITH_PARENT,
    )
    if proc.returncode != 0:  # (its last lines whole: a cut at 2,000 characters began mid-word)
        said = "\n".join(proc.stderr.strip().splitlines()[-12:])
        raise BenchMemoryError(f"{scenario} failed (exit code {proc.returncode}):\n{said}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


class BenchMemoryError(RuntimeError):
    """A measurement process failed."""


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 1),
        "median": round(statistics.median(values), 1),
        "max": round(max(values), 1),
    }


@dataclass
class _Term:
    scenario: str
    params: dict[str, int]
    unit: str
    growth: list[float] = field(default_factory=list)
    per_item: list[float] = field(default_factory=list)
    live_per_item: list[float] = field(default_factory=list)
    """After ``malloc_trim``: without the C allocator's free memory."""
    seconds: list[float] = field(default_factory=list)
    attribution: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scenario": self.scenario,
            "params": self.params,
            "unit": self.unit,
            "growth_bytes": _spread(self.growth),
            "bytes_per_item": _spread(self.per_item),
            "live_bytes_per_item": _spread(self.live_per_item),
            "build_s": _spread(self.seconds),
        }
        if self.attribution is not None:
            out["attribution"] = self.attribution
        return out


def bench_memory(sizes: Sizes, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every scenario ``sizes.runs`` times (each in a fresh process) and return the
    figures: bytes per item (min/median/max over the runs), the empty baseline, the combined
    dispatcher against the sum of its terms, and the budgets."""
    say = progress or (lambda _: None)
    s = sizes
    terms = {
        "queued_request": _Term(
            "queued", {"items": s.queued, "prompt_tokens": s.prompt_tokens}, "queued request"
        ),
        "queued_request_short": _Term(
            "queued", {"items": s.queued, "prompt_tokens": SHORT_PROMPT_TOKENS}, "queued request"
        ),
        "worker": _Term("workers", {"items": s.workers}, "worker"),
        "indexed_block": _Term(
            "blocks", {"items": s.blocks, "workers": s.workers}, "indexed block"
        ),
        "prefix_key": _Term("prefixes", {"items": s.prefixes, "workers": s.workers}, "prefix key"),
        "served_prompt": _Term(
            "agent-served", {"items": s.prompts, "prompt_tokens": s.prompt_tokens}, "cached prompt"
        ),
        "kv_prompt": _Term(
            "agent-kv", {"items": s.prompts, "prompt_tokens": s.prompt_tokens}, "cached prompt"
        ),
    }
    combined_params = {
        "queued": s.queued,
        "workers": s.workers,
        "blocks": s.blocks,
        "prefixes": s.prefixes,
        "prompt_tokens": s.prompt_tokens,
    }
    baseline: list[float] = []
    combined: list[float] = []
    combined_rss: list[float] = []
    for run in range(s.runs):
        params_seed = {"seed": run}
        say(f"run {run + 1}/{s.runs}: empty baseline")
        baseline.append(run_child("empty", params_seed)["rss_after_bytes"])
        for name, term in terms.items():
            say(f"run {run + 1}/{s.runs}: {name}")
            r = run_child(term.scenario, {**term.params, **params_seed})
            growth = r["rss_after_bytes"] - r["rss_before_bytes"]
            term.growth.append(growth)
            term.per_item.append(growth / max(1, r["items"]))
            live = r["rss_trimmed_bytes"] - r["rss_before_bytes"]
            term.live_per_item.append(live / max(1, r["items"]))
            term.seconds.append(r["seconds"])
        say(f"run {run + 1}/{s.runs}: the dispatcher with everything")
        r = run_child("dispatcher", {**combined_params, **params_seed})
        combined.append(r["rss_after_bytes"] - r["rss_before_bytes"])
        combined_rss.append(r["rss_after_bytes"])
    if s.attribution:
        for name, term in terms.items():
            say(f"attribution: {name}")
            params = dict(term.params)
            params["items"] = min(params["items"], TRACE_MAX_ITEMS)
            if term.scenario in ("blocks", "prefixes"):
                # As many items per worker as measured: each worker's digest heartbeat costs
                # something of its own, which would count against fewer blocks.
                scaled = params["workers"] * params["items"] // term.params["items"]
                params["workers"] = max(1, scaled)
            r = run_child(term.scenario, params, trace=True)
            term.attribution = {
                "items": r["items"],
                "traced_bytes_per_item": round(r["traced_bytes"] / max(1, r["items"]), 1),
                "top": r["top"],
            }
    return _report(s, terms, baseline, combined, combined_rss)


def _report(
    s: Sizes,
    terms: dict[str, _Term],
    baseline: list[float],
    combined: list[float],
    combined_rss: list[float],
) -> dict[str, Any]:
    med = {k: statistics.median(t.per_item) for k, t in terms.items()}
    long_q, short_q = med["queued_request"], med["queued_request_short"]
    span = s.prompt_tokens - SHORT_PROMPT_TOKENS
    per_token = (long_q - short_q) / span if span > 0 else 0.0
    fixed = short_q - per_token * SHORT_PROMPT_TOKENS
    predicted = (
        s.queued * long_q
        + s.workers * med["worker"]
        + s.blocks * med["indexed_block"]
        + s.prefixes * med["prefix_key"]
    )
    base = statistics.median(baseline)
    agent = {
        "served": base + s.prompts * med["served_prompt"],
        "kv_events": base + s.prompts * med["kv_prompt"],
    }
    dispatcher_rss = statistics.median(combined_rss)
    return {
        "benchmark": "memory",
        "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0]},
        "sizes": {
            "queued": s.queued,
            "workers": s.workers,
            "blocks": s.blocks,
            "prefixes": s.prefixes,
            "prompts": s.prompts,
            "prompt_tokens": s.prompt_tokens,
            "runs": s.runs,
        },
        "baseline_rss_bytes": _spread(baseline),
        "terms": {k: t.row() for k, t in terms.items()},
        "queued_request_formula": {
            "fixed_bytes": round(fixed, 1),
            "bytes_per_prompt_token": round(per_token, 2),
        },
        "dispatcher": {
            "growth_bytes": _spread(combined),
            "rss_bytes": _spread(combined_rss),
            "predicted_growth_bytes": round(predicted, 1),
            "measured_over_predicted": round(statistics.median(combined) / predicted, 3)
            if predicted
            else None,
            "rss_over_baseline": round(dispatcher_rss / base, 2),
            "target_bytes": DISPATCHER_TARGET_BYTES,
            "rss_over_target": round(dispatcher_rss / DISPATCHER_TARGET_BYTES, 3),
        },
        "agent": {
            "served_rss_bytes": round(agent["served"], 1),
            "kv_events_rss_bytes": round(agent["kv_events"], 1),
            "rss_over_baseline": {k: round(v / base, 2) for k, v in agent.items()},
            "target_bytes": AGENT_TARGET_BYTES,
            "rss_over_target": {k: round(v / AGENT_TARGET_BYTES, 3) for k, v in agent.items()},
        },
    }


def table(result: dict[str, Any]) -> list[str]:
    """The figures as lines of text."""
    mib = 2**20
    lines = []
    b = result["baseline_rss_bytes"]
    lines.append(
        f"empty process (imports only): {b['median'] / mib:.1f} MiB "
        f"(min {b['min'] / mib:.1f}, max {b['max'] / mib:.1f}) over {result['sizes']['runs']} runs"
    )
    for name, t in result["terms"].items():
        p = t["bytes_per_item"]
        live = t["live_bytes_per_item"]["median"]
        g = t["growth_bytes"]
        size = t["params"]["items"]
        extra = (
            f", {t['params']['prompt_tokens']}-token prompts"
            if "prompt_tokens" in t["params"]
            else ""
        )
        lines.append(
            f"{name:<22} {size:>9,} x: {p['median']:>9,.0f} B per {t['unit']} "
            f"(min {p['min']:,.0f}, max {p['max']:,.0f}; {live:,.0f} live); "
            f"{g['median'] / mib:,.1f} MiB in all{extra}"
        )
        a = t.get("attribution")
        if a:
            top = "; ".join(f"{r['site']} {r['share']:.0%}" for r in a["top"][:3])
            lines.append(f"{'':<24}traced {a['traced_bytes_per_item']:,.0f} B per item: {top}")
    f = result["queued_request_formula"]
    lines.append(
        f"queued request ~ {f['fixed_bytes']:,.0f} B "
        f"+ {f['bytes_per_prompt_token']:.1f} B per prompt token"
    )
    d = result["dispatcher"]
    lines.append(
        f"dispatcher with everything: {d['rss_bytes']['median'] / mib:,.1f} MiB resident "
        f"({d['rss_over_baseline']:.1f}x the empty process, {d['rss_over_target']:.2f}x its "
        f"{d['target_bytes'] / mib:,.0f} MiB budget); "
        f"growth {d['growth_bytes']['median'] / mib:,.1f} MiB "
        f"= {d['measured_over_predicted']:.2f}x the sum of the terms"
    )
    a = result["agent"]
    lines.append(
        f"agent with {result['sizes']['prompts']:,} cached prompts: served record "
        f"{a['served_rss_bytes'] / mib:,.1f} MiB ({a['rss_over_target']['served']:.2f}x its "
        f"{a['target_bytes'] / mib:,.0f} MiB budget), KV-event mirror "
        f"{a['kv_events_rss_bytes'] / mib:,.1f} MiB ({a['rss_over_target']['kv_events']:.2f}x)"
    )
    return lines


def _main(argv: list[str]) -> None:
    scenario, params = argv[0], json.loads(argv[1])
    print(json.dumps(child(scenario, params, trace="--trace" in argv[2:])))


if __name__ == "__main__":
    _main(sys.argv[1:])

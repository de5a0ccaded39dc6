"""The hot path: requests queued together are handed off in one planning round (all offers in
flight at once), the gauges are refreshed at most every ``gauges_every_s``, and
``sluice bench --json`` keeps its contract."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import nats
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext
from prometheus_client import REGISTRY

from sluice.cli.benchlive import Verdict
from sluice.client import Client
from sluice.schemas import names
from sluice.testing.cluster import LocalCluster
from tests.conftest import FAST_DISPATCHER, cluster_kwargs, eventually

pytestmark = pytest.mark.e2e

_PROMPT = list(range(64))


async def test_requests_queued_together_are_offered_in_one_round(nats_url: str) -> None:
    """Six requests wait in the queue for a worker; once one joins, the planning round that
    sees it offers all six before any worker's answer arrives (offered one by one, each answer
    would come before the next offer)."""
    seen: list[tuple[str, str]] = []  # ("offer", reply subject) or ("answer", its subject)
    replies: set[str] = set()
    # No worker at first: the six are queued for certain before any plan can place them (a
    # learning period that ends while they arrive, on a slow machine, would split them).
    kw = cluster_kwargs(workers=0, agent={"capacity": 8})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as client:

        async def on_offer(msg: Msg) -> None:
            replies.add(msg.reply)
            seen.append(("offer", msg.reply))

        async def on_inbox(msg: Msg) -> None:
            if msg.subject in replies:
                seen.append(("answer", msg.subject))

        await client.nc.subscribe(names.work_subject("worker-0"), cb=on_offer)
        await client.nc.subscribe("_INBOX.>", cb=on_inbox)
        await client.nc.flush()
        handles = [
            await client.submit("sim", _PROMPT, max_tokens=2, band="interactive") for _ in range(6)
        ]
        queue = cluster.dispatcher.scheduler
        await eventually(lambda: _true(queue.queued == 6), timeout_s=10)
        await cluster.add_agent("worker-0")
        for h in handles:
            assert (await h.result(timeout_s=20)).ok
        await eventually(lambda: _true(len(seen) >= 12))
    kinds = [kind for kind, _ in seen]
    assert kinds[:6] == ["offer"] * 6, f"offers and answers interleaved: {kinds}"


async def test_a_slow_answer_holds_back_no_other_offer(nats_url: str) -> None:
    """The first worker to get an offer answers it 2.5 s late; a request submitted meanwhile
    is offered to the other worker before that answer (a pass that waited for every answer
    would offer it only after)."""
    seen: list[tuple[str, str]] = []  # ("offer", worker) or ("answer", reply subject)
    offers: dict[str, str] = {}  # reply subject -> worker
    late: list[str] = []
    # The first request runs for seconds (engines at real time, 600 tokens), so that its
    # worker is still full when the second is planned, whether or not its answer came.
    kw = cluster_kwargs(
        workers=2, dispatcher={"handoff_timeout_s": 5.0}, agent={"capacity": 1, "speed": 1.0}
    )
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as client:
        for agent in cluster.agents:
            answer = agent._reply

            async def slow_once(msg: Msg, rid: str, accepted: bool, reason: str = "", *,
                                _answer: Any = answer) -> None:  # fmt: skip
                if not late:  # the very first assignment of either worker
                    late.append(rid)
                    await asyncio.sleep(2.5)
                await _answer(msg, rid, accepted, reason)

            agent._reply = slow_once  # type: ignore[method-assign]

            async def on_offer(msg: Msg, _w: str = agent.worker_id) -> None:
                offers[msg.reply] = _w
                seen.append(("offer", _w))

            await client.nc.subscribe(names.work_subject(agent.worker_id), cb=on_offer)

        async def on_inbox(msg: Msg) -> None:
            if msg.subject in offers:
                seen.append(("answer", offers[msg.subject]))

        await client.nc.subscribe("_INBOX.>", cb=on_inbox)
        await client.nc.flush()
        first = await client.submit("sim", _PROMPT, max_tokens=600, band="interactive")
        await eventually(lambda: _true(bool(late)))
        second = await client.submit("sim", list(range(64, 128)), max_tokens=2)
        assert (await second.result(timeout_s=20)).ok
        assert (await first.result(timeout_s=20)).ok
        await eventually(lambda: _true(len(seen) >= 4))
    slow_worker = seen[0][1]
    kinds = [(kind, w == slow_worker) for kind, w in seen]
    assert kinds.index(("offer", False)) < kinds.index(("answer", True)), seen


async def _true(value: bool) -> bool:
    return value


def _workers_gauge() -> float:
    return REGISTRY.get_sample_value("sluice_dispatcher_workers") or 0.0


@pytest.mark.parametrize("every_s", [60.0, 0.05])
async def test_gauges_refresh_at_most_every_gauges_every_s(nats_url: str, every_s: float) -> None:
    """The workers gauge reads 0 at the dispatcher's first pass; two agents join and run
    requests (many passes): within ``gauges_every_s`` it is not refreshed, after it it is."""
    kw = cluster_kwargs(workers=2, dispatcher={"gauges_every_s": every_s})
    cluster = LocalCluster(nats_url, **kw)
    agents, cluster.agents = cluster.agents, []
    async with cluster, Client(nats_url) as client:
        await eventually(lambda: _true(cluster.dispatcher.leading))
        await asyncio.sleep(3 * cluster.dispatcher_settings.tick_s)  # a pass refreshed them
        assert _workers_gauge() == 0.0
        for a in agents:
            cluster.agents.append(await a.start())
        for _ in range(5):
            h = await client.submit("sim", _PROMPT, max_tokens=2, band="interactive")
            assert (await h.result(timeout_s=20)).ok
        if every_s > 1:
            assert _workers_gauge() == 0.0
        else:
            await eventually(lambda: _true(_workers_gauge() == 2.0))


_CONTRACT = (
    "decision_us",
    "baseline_decision_us",
    "dispatch_p50_ms",
    "dispatch_p99_ms",
    "publish_ack_p50_ms",
    "throughput_rps",
    "raw_jetstream_rps",
)


_LIVE_TARGETS = {
    "dispatch p50 / publish ack",
    "dispatch p50 / publish ack between dispatches",
    "dispatch p99 (ms)",
    "throughput / raw JetStream",
}


def _bench_json(*args: str) -> dict[str, Any]:
    """``sluice bench --json`` at a tiny size, as a real process; its one JSON object. Checks
    that nothing it started outlived it."""
    cmd = [sys.executable, "-m", "sluice.cli", "bench", "--json", "--live-requests", "10"]
    if "--live-only" not in args:  # (core sizes with --live-only are refused)
        cmd += ["--requests", "200", "--decision-requests", "50"]
    cmd += ["--throughput-requests", "40", "--submitters", "4", *args]
    # Its own process group: if it hangs, the fleet it started goes down with it.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, errors = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    assert proc.returncode == 0, errors.decode()[-2000:]
    with pytest.raises(ProcessLookupError):  # nothing it started outlived it
        os.killpg(proc.pid, 0)
    figures: dict[str, Any] = json.loads(out)
    return figures


def test_bench_json_prints_the_contract() -> None:
    """``sluice bench --json`` at a tiny size: every contract key, each figure a positive
    number (no timing thresholds)."""
    figures = _bench_json()
    assert set(_CONTRACT) <= set(figures)
    assert set(figures["decision_us"]) == {"16", "256", "1024"}
    numbers = [*figures["decision_us"].values()] + [figures[k] for k in _CONTRACT[1:]]
    assert all(isinstance(v, int | float) and v > 0 for v in numbers), figures
    assert set(figures["targets"]) >= _LIVE_TARGETS
    assert figures["publish_ack_between_p50_ms"] > 0
    growths = ("decision", "shared_prompt", "saturated")
    assert all(figures[f"{g}_growth_1024_vs_16"] > 0 for g in growths)


def test_bench_live_only_prints_the_live_contract_alone() -> None:
    """``sluice bench --live-only --json --prompt-tokens 3000``: the live contract keys and
    targets, positive, none of the pure-core figures (it skipped them), and every live
    request of the prompt's size."""
    figures = _bench_json("--live-only", "--prompt-tokens", "3000")
    assert figures["prompt_tokens"] == 3000
    live = [k for k in _CONTRACT if k not in ("decision_us", "baseline_decision_us")]
    assert set(live) <= set(figures)
    assert all(isinstance(figures[k], int | float) and figures[k] > 0 for k in live), figures
    assert "decision_us" not in figures and "core" not in figures
    assert set(figures["targets"]) == _LIVE_TARGETS


@given(
    value=st.floats(min_value=1e-6, max_value=1e6),
    target=st.floats(min_value=1e-6, max_value=1e6),
    higher=st.booleans(),
)
def test_a_verdict_is_met_exactly_when_it_is_within_its_target(
    value: float, target: float, higher: bool
) -> None:
    v = Verdict("x", value, target, higher)
    assert v.met == (v.off_by <= 1.0) or abs(v.off_by - 1.0) < 1e-9


async def test_a_takeover_looks_up_redelivered_results_at_once(nats_url: str) -> None:
    """A leader hands six held requests back (a clean stop naks them) and their results
    exist already: the next leader gets them redelivered in a batch (or two, on a loaded machine)
    and looks their results up concurrently (a batch's lookups all sent before its first
    answer; one after the other, each answer would come before the next lookup), then acks all
    six without running them."""
    from sluice.dispatcher.runtime import Dispatcher, DispatcherSettings
    from sluice.schemas.codec import encode
    from sluice.schemas.models import Result

    def settings(name: str) -> DispatcherSettings:
        return DispatcherSettings(nats_url=nats_url, dispatcher_id=name, **FAST_DISPATCHER)

    seen: list[str] = []
    lookups: set[str] = set()
    async with Client(nats_url) as client:

        async def on_lookup(msg: Msg) -> None:
            lookups.add(msg.reply)
            seen.append("lookup")

        async def on_inbox(msg: Msg) -> None:
            if msg.subject in lookups:
                seen.append("answer")

        first = await Dispatcher(settings("d-1")).start()
        try:
            ids = [
                await client.enqueue("sim", _PROMPT, max_tokens=2, band="interactive")
                for _ in range(6)
            ]
            await eventually(lambda: _true(first.held == 6))
        finally:
            await first.stop()  # hands the six back
        js = client.nc.jetstream()
        for rid in ids:
            result = Result(request_id=rid, ok=True, model="sim", band="interactive")
            await js.publish(names.result_subject("default", rid), encode(result))
        await client.nc.subscribe(f"$JS.API.DIRECT.GET.{names.RESULT_STREAM}.>", cb=on_lookup)
        await client.nc.subscribe("_INBOX.>", cb=on_inbox)
        await client.nc.flush()
        second = await Dispatcher(settings("d-2")).start()
        try:
            stream = names.request_stream("interactive")
            await eventually(lambda: _stream_empty(js, stream))
            assert second.held == 0  # acked as done, never queued to run
        finally:
            await second.stop()
    # Concurrent within a pulled batch: one after the other, lookups and answers alternate. A
    # loaded machine may hand the six back in two pulls (seen: 3 lookups, answers, 3 lookups).
    runs = "".join("l" if e == "lookup" else "a" for e in seen).split("a")
    assert seen.count("lookup") == 6 and max(map(len, runs)) >= 2, f"one by one: {seen}"


async def _stream_empty(js: JetStreamContext, stream: str) -> bool:
    return (await js.stream_info(stream)).state.messages == 0


async def test_an_idle_band_is_pulled_one_message_at_a_time(nats_url: str) -> None:
    """Sequential requests on an idle fleet: once the term's first pull is answered, every
    pull of the band asks for one message (a pull for a batch would wait, after the request,
    for the server's "no more messages" status: a second wake-up on the hot path). Fails if
    ``pull_batch`` ignores ``backlog`` (every pull then asks for 128)."""
    pulls: list[int] = []
    subject = "$JS.API.CONSUMER.MSG.NEXT.{}.{}".format(
        names.request_stream("interactive"), names.dispatcher_consumer("interactive")
    )
    kw = cluster_kwargs(workers=1)
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as client:

        async def on_pull(msg: Msg) -> None:
            pulls.append(json.loads(msg.data)["batch"])

        await eventually(lambda: _true(cluster.dispatcher.leading))
        await client.nc.subscribe(subject, cb=on_pull)
        await client.nc.flush()
        for _ in range(4):
            h = await client.submit("sim", _PROMPT, max_tokens=2, band="interactive")
            assert (await h.result(timeout_s=20)).ok
        await eventually(lambda: _true(len(pulls) >= 4))  # one (at least) after each request
    assert pulls[-4:] == [1, 1, 1, 1], f"pulls of an idle band asked for {pulls}"


async def test_a_pull_that_ends_on_a_status_does_not_stop_its_band(nats_url: str) -> None:
    """nats-py's fetch of a batch returns no message, rather than time out, when its pull
    ends on a status before any message (an earlier pull's expiry arriving late, a conflict).
    The term's first pull of a band asks for a batch: a 408 sent to its inbox in each of that
    fetch's two rounds makes it return nothing. The band must go on being pulled, with
    nothing counted as an internal error. Fails without the dispatcher's empty-batch check:
    the pull task ended on an IndexError and the request below was never pulled (and with the
    pull loop's guard alone, the error is counted)."""
    subject = "$JS.API.CONSUMER.MSG.NEXT.{}.{}".format(
        names.request_stream("standard"), names.dispatcher_consumer("standard")
    )
    site = {"site": "dispatcher.intake"}
    errors_before = REGISTRY.get_sample_value("sluice_internal_errors_total", site) or 0.0
    spy = await nats.connect(nats_url)
    pulls: list[dict[str, Any]] = []

    async def on_pull(msg: Msg) -> None:
        pulls.append(json.loads(msg.data))
        if len(pulls) <= 2:  # the term's first fetch, both its rounds
            await spy.publish(msg.reply, b"", headers={"Status": "408", "Description": "Timeout"})

    try:
        await spy.subscribe(subject, cb=on_pull)
        await spy.flush()
        async with LocalCluster(nats_url, **cluster_kwargs(workers=1)) as _, Client(nats_url) as c:
            # The fetch that got the statuses has returned once the band is pulled again.
            await eventually(lambda: _true(len(pulls) >= 3), timeout_s=15)
            assert pulls[0]["batch"] > 1 and pulls[0].get("no_wait")
            assert pulls[1]["batch"] > 1 and not pulls[1].get("no_wait")
            h = await c.submit("sim", _PROMPT, max_tokens=2, band="standard")
            assert (await h.result(timeout_s=20)).ok
    finally:
        await spy.close()
    errors = REGISTRY.get_sample_value("sluice_internal_errors_total", site) or 0.0
    assert errors == errors_before


async def test_a_lease_that_runs_out_mid_pull_and_is_renewed_does_not_stop_the_band(
    nats_url: str,
) -> None:
    """The lease can run out locally while its renewal is in flight, and the renewal then
    land: the term goes on. A band's pull that met that moment used to end for good, and the
    band's requests waited unanswered for as long as the dispatcher led (a slow machine's CI
    met it under the hostile-messages test: no pull task for the band was left). Here the
    lease is run out locally between two renewals of a long lease while requests arrive,
    then renewed as the late renewal would: each request must be served. Fails if the pull
    ends when it meets an expired lease."""
    kw = cluster_kwargs(workers=1, dispatcher={"leader_lease_s": 30.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        await eventually(lambda: _true(cluster.dispatcher.leading))
        h = await c.submit("sim", _PROMPT, max_tokens=2, band="standard")
        assert (await h.result(timeout_s=20)).ok
        lead = cluster.dispatcher._state.leadership
        # Right after a renewal: the election sleeps until the next one, seconds away.
        await eventually(lambda: _true(lead.next_s - time.monotonic() > 5), timeout_s=15)
        valid = lead.valid_until_s
        lead.valid_until_s = time.monotonic()  # ran out; the renewal is still in flight
        handles = [await c.submit("sim", _PROMPT, max_tokens=2, band="standard") for _ in range(5)]
        await asyncio.sleep(0.5)  # the band's pull meets them while the lease is out
        lead.valid_until_s = max(valid, time.monotonic() + 20)  # the renewal lands
        results = [await h.result(timeout_s=20) for h in handles]
        assert all(r.ok for r in results)
        assert cluster.dispatcher.leading


async def test_a_lease_that_runs_out_while_an_advisory_arrives_does_not_stop_serving_them(
    nats_url: str,
) -> None:
    """The same moment for the max-deliveries advisories: the loop that serves them used to
    end when it met an expired lease, and every later advisory of the term stayed unserved
    (its request never answered, never dead-lettered). Here an advisory (of a request gone
    from its queue, so serving it is acking it) arrives while the lease is out locally, and
    the lease is then renewed: it must be served. Fails if the loop returns on the lapse, or
    if it goes on fetching (and giving back) while the lease is out."""
    kw = cluster_kwargs(workers=1, dispatcher={"leader_lease_s": 30.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        await eventually(lambda: _true(cluster.dispatcher.leading))
        js = c.nc.jetstream()
        lead = cluster.dispatcher._state.leadership
        await eventually(lambda: _true(lead.next_s - time.monotonic() > 5), timeout_s=15)
        valid = lead.valid_until_s
        lead.valid_until_s = time.monotonic()  # ran out; the renewal is still in flight
        stream = names.request_stream("standard")
        advisory = {"stream": stream, "stream_seq": 10**9, "deliveries": 2}
        await c.nc.publish(names.max_deliveries_advisory("standard"), json.dumps(advisory).encode())
        await asyncio.sleep(1.0)  # the advisory loop's pull meets it while the lease is out
        assert (await js.stream_info(names.ADVISORY_STREAM)).state.messages == 1
        lead.valid_until_s = max(valid, time.monotonic() + 20)  # the renewal lands

        async def served() -> bool:
            return (await js.stream_info(names.ADVISORY_STREAM)).state.messages == 0

        await eventually(served, timeout_s=10)
        assert cluster.dispatcher.leading
        info = await js.consumer_info(names.ADVISORY_STREAM, names.ADVISORY_CONSUMER)
    # Not fetched again and again while the lease was out (each time given back).
    assert info.delivered.consumer_seq <= 3


def _js_msg(num_pending: int, num_delivered: int) -> Msg:
    """A JetStream message as the server delivers it: its ack subject carries the
    consumer's counts ($JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>)."""
    ack = f"$JS.ACK.S.C.{num_delivered}.7.7.1700000000000000000.{num_pending}"
    return Msg(_client=None, subject="sluice.req.interactive.sim.default", reply=ack)  # type: ignore[arg-type]


def test_a_backlog_or_a_redelivery_is_pulled_in_batches() -> None:
    """The next pull asks for a batch (at most the buffer's room) when messages wait behind
    the last one pulled, or when it was a redelivery (those come back together after a
    takeover); for one otherwise. Fails if either condition of ``more_behind`` is dropped."""
    from sluice.dispatcher.runtime.intake import PULL_BATCH, more_behind, pull_batch

    assert more_behind(_js_msg(num_pending=5, num_delivered=1))
    assert more_behind(_js_msg(num_pending=0, num_delivered=2))
    assert not more_behind(_js_msg(num_pending=0, num_delivered=1))
    assert pull_batch(2000, backlog=True) == PULL_BATCH
    assert pull_batch(3, backlog=True) == 3
    assert pull_batch(2000, backlog=False) == 1

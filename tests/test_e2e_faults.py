"""Nothing is lost: a worker or a dispatcher dies mid-request (real nats-server)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import ServiceUnavailableError
from prometheus_client import REGISTRY

from sluice.agent.runtime import Agent
from sluice.client import Client, Rejected, RejectReason
from sluice.dispatcher.runtime import Dispatcher, DispatcherSettings
from sluice.dispatcher.runtime.streams import ensure_streams, result_stream
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.models import (
    Assignment,
    AssignmentReply,
    Heartbeat,
    Rejection,
    Result,
    SubmitRequest,
)
from sluice.testing.cluster import LocalCluster
from sluice.testing.natsserver import EmbeddedNats

from .conftest import cluster_kwargs, eventually, store_result

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

PROMPT = list(range(5000, 5128))
Predicate = Callable[[], Awaitable[bool]]


async def _submit_unwatched(
    js: JetStreamContext, request_id: str, max_tokens: int
) -> SubmitRequest:
    """Publish a request as a producer that does not listen for its result (an offline job
    that fetches results later): only the result stream can hold its answer."""
    request = SubmitRequest(
        request_id=request_id,
        model="sim",
        prompt_tokens=PROMPT,
        max_tokens=max_tokens,
        submitted_unix_ms=int(time.time() * 1000),
    )
    await js.publish(
        names.request_subject("standard", "sim", "default"),
        encode(request),
        headers={names.MSG_ID_HEADER: request_id},
    )
    return request


async def test_worker_death_reruns_request_elsewhere_with_one_result(nats_url: str) -> None:
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=2)) as cluster,
        Client(nats_url) as c,
    ):
        handle = await c.submit("sim", PROMPT, max_tokens=3000, request_id="long-one")
        streamed: list[int] = []
        stream = handle.__aiter__()
        first = await anext(stream)
        streamed += first.tokens
        victim = next(a for a in cluster.agents if a.in_flight)
        await victim.kill()  # no drain, no goodbye: only the lease tells

        async for chunk in stream:
            streamed += chunk.tokens
        result = await handle.result(timeout_s=30)

    assert result.ok
    assert result.attempt == 2
    assert result.worker_id != victim.worker_id
    assert len(result.output_tokens) == 3000
    assert streamed == result.output_tokens  # the client stitched both attempts seamlessly


async def test_a_lost_worker_whose_result_is_stored_is_not_run_again(nats_url: str) -> None:
    """The worker stored its result and died before its completion reached the dispatcher:
    when its lease expires, the dispatcher finds the stored result, takes the request out of
    the queue and acks it rather than run it again on the survivor. Fails when worker loss
    requeues without looking the result up (the survivor then runs it)."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=2)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await _submit_unwatched(js, "stored-then-lost", max_tokens=60_000)

        async def running() -> bool:
            return any(a.in_flight for a in cluster.agents)

        await eventually(running)
        victim = next(a for a in cluster.agents if a.in_flight)
        survivor = next(a for a in cluster.agents if a is not victim)
        ran = Result(
            request_id="stored-then-lost",
            ok=True,
            model="sim",
            worker_id=victim.worker_id,
            attempt=1,
            output_tokens=[1],
        )
        await store_result(js, ran)
        await victim.kill()  # its completion is never sent: only the lease tells

        await eventually(lambda: _queue_empty(js), timeout_s=15)
        await asyncio.sleep(0.5)  # a requeued copy would have been handed out by now
        assert survivor.in_flight == 0 and survivor.completed == 0, "run again"
        assert cluster.dispatcher.scheduler.running == 0
        assert cluster.dispatcher.scheduler.queued == 0
        stored = await c.fetch_result("stored-then-lost")
        assert stored is not None and stored.worker_id == victim.worker_id


async def test_dispatcher_restart_loses_nothing(nats_url: str) -> None:
    kw = cluster_kwargs(workers=2, dispatcher={"global_limit": 4})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        handles = [
            await c.submit("sim", PROMPT, max_tokens=1000, request_id=f"r{i}") for i in range(12)
        ]
        sched = cluster.dispatcher.scheduler

        async def some_run_some_wait() -> bool:
            return sched.running > 0 and sched.queued > 0

        await eventually(some_run_some_wait)
        await cluster.dispatcher.stop()
        successor = Dispatcher(cluster.dispatcher_settings)
        cluster.dispatcher = successor
        await successor.start()
        results = [await h.result(timeout_s=60) for h in handles]
        await asyncio.sleep(0.5)
        runs = sum(a.completed for a in cluster.agents)

    assert all(r.ok for r in results)
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(12))
    assert runs == 12, f"{runs} runs for 12 requests: a running request was started again"


async def test_dispatcher_crash_redelivers_after_ack_wait(nats_url: str) -> None:
    kw = cluster_kwargs(workers=1, dispatcher={"global_limit": 1, "ack_wait_s": 1.5})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        blocker = await c.submit("sim", PROMPT, max_tokens=300, request_id="running")
        waiting = await c.submit("sim", PROMPT, max_tokens=10, request_id="waiting")
        await asyncio.sleep(0.4)
        await cluster.dispatcher.kill()  # held requests are neither acked nor handed back
        successor = Dispatcher(cluster.dispatcher_settings)
        cluster.dispatcher = successor
        await successor.start()
        r1 = await blocker.result(timeout_s=30)
        r2 = await waiting.result(timeout_s=30)
    assert r1.ok and r2.ok


async def test_broker_restart_mid_request_loses_nothing(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    first = EmbeddedNats(store_dir=store).start()
    port = first.port
    try:
        kw = cluster_kwargs(workers=2, dispatcher={"global_limit": 4})
        async with LocalCluster(first.url, **kw), Client(first.url) as c:
            handles = [
                await c.submit("sim", PROMPT, max_tokens=600, request_id=f"b{i}") for i in range(8)
            ]
            await asyncio.sleep(0.3)  # some are running, some queued
            first.kill()  # the broker dies mid-request (SIGKILL, store kept)
            await asyncio.sleep(2.0)  # longer than a lease
            second = EmbeddedNats(store_dir=store, port=port).start()
            try:
                results = [await h.result(timeout_s=60) for h in handles]
            finally:
                restarted = second
        assert sorted(r.request_id for r in results) == [f"b{i}" for i in range(8)]
        assert all(r.ok and len(r.output_tokens) == 600 for r in results)
    finally:
        first.stop()
        with contextlib.suppress(NameError):
            restarted.stop()


async def test_a_result_that_cannot_be_stored_is_retried_not_dropped(nats_url: str) -> None:
    """The completion (which acks the request) must never overtake its result: while the
    result stream is unavailable, the worker holds the completion back. The producer here does
    not listen for the result (an offline job that fetches results later), so only the stream
    can hold it."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await js.delete_stream(names.RESULT_STREAM)
        await _submit_unwatched(js, "unstored", max_tokens=20)
        await asyncio.sleep(4.0)  # the request finished long ago; its result has nowhere to go
        assert cluster.dispatcher.scheduler.running == 1  # ...so it is not acked either
        await ensure_streams(js, cluster.dispatcher_settings)

        async def stored() -> bool:
            return await c.fetch_result("unstored") is not None

        await eventually(stored, timeout_s=20)
        result = await c.fetch_result("unstored")
    assert result is not None and result.ok and len(result.output_tokens) == 20


async def test_a_worker_holds_a_finished_request_until_its_result_is_stored(
    nats_url: str,
) -> None:
    """Its heartbeats list a request that finished there but whose result is not stored yet,
    as one it holds: a dispatcher of a new term, finding no result and the request in no
    report, would run it again (in CI, 111 runs for 109 requests when the result stream's
    node was killed). Fails with heartbeats that list only the running requests."""
    beats: list[Heartbeat] = []
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        agent = cluster.agents[0]

        async def on_beat(msg: Msg) -> None:
            beats.append(decode(msg.data, Heartbeat))

        await c.nc.subscribe(names.heartbeat_subject(agent.worker_id), cb=on_beat)
        js = c.nc.jetstream()
        await js.delete_stream(names.RESULT_STREAM)
        await _submit_unwatched(js, "unstored", max_tokens=20)

        async def finished() -> bool:
            return agent.completed == 1

        async def next_beat_lists_it(listed: bool) -> bool:
            seen = len(beats)
            await eventually(lambda: _more(beats, seen))
            return ("unstored" in beats[-1].in_flight) is listed

        await eventually(finished)
        assert await next_beat_lists_it(True), "a finished, unstored request left the reports"
        await ensure_streams(js, cluster.dispatcher_settings)

        async def stored() -> bool:
            return await c.fetch_result("unstored") is not None

        await eventually(stored, timeout_s=20)
        await eventually(lambda: next_beat_lists_it(False))


async def _more(items: list[Heartbeat], than: int) -> bool:
    return len(items) > than


async def test_request_delivered_max_deliver_times_is_dead_lettered(nats_url: str) -> None:
    # ack_wait_s past a kill's wind-down (a fetch of 0.5 s still pending, its connection closed
    # last): at 0.5 s the redelivery could go to the killed dispatcher's fetch and spend the
    # second delivery there (seen in 2 of 8 runs), as a crashed process's dropped connection
    # would not.
    kw = cluster_kwargs(workers=0, dispatcher={"max_deliver": 2, "ack_wait_s": 2.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        handle = await c.submit("sim", PROMPT, max_tokens=5, request_id="poisoned")
        for _ in range(2):  # two dispatchers in turn take it and crash without acking it

            async def taken() -> bool:  # a dispatcher takes it once it leads
                return cluster.dispatcher.held == 1

            await eventually(taken)
            await cluster.dispatcher.kill()
            cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
            await cluster.dispatcher.start()
        with pytest.raises(Rejected) as info:
            await handle.result(timeout_s=15)
        assert info.value.reason is RejectReason.UNDELIVERABLE
        js = c.nc.jetstream()
        await eventually(lambda: _advisories_served(js))  # the producer is told first
        letters = await js.stream_info(names.DEAD_LETTER_STREAM)
        queue = await js.stream_info(names.request_stream("standard"))
    assert letters.state.messages == 1
    assert queue.state.messages == 0  # removed from the work queue: it no longer takes room


async def _advisories_served(js: JetStreamContext) -> bool:
    """Whether every stored max-deliveries advisory was served (acked once its request was
    answered, dead-lettered and removed from its queue)."""
    info = await js.stream_info(names.ADVISORY_STREAM)
    return info.state.messages == 0


async def _exhaust(cluster: LocalCluster, c: Client, request_id: str) -> Predicate:
    """Submit a request that two dispatchers in turn take and crash with (``max_deliver``
    2), a third one leading afterwards; returns whether the broker's max-deliveries advisory
    went out (it does once the second delivery's ``ack_wait`` ends)."""
    heard: list[bytes] = []

    async def on_advisory(msg: Msg) -> None:
        heard.append(msg.data)

    await c.nc.subscribe(names.max_deliveries_advisory("standard"), cb=on_advisory)
    await _submit_unwatched(c.nc.jetstream(), request_id, max_tokens=5)
    for _ in range(2):

        async def taken() -> bool:
            return cluster.dispatcher.held == 1

        await eventually(taken)
        await cluster.dispatcher.kill()
        cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
        await cluster.dispatcher.start()

    async def advised() -> bool:
        return len(heard) == 1

    return advised


async def test_an_undeliverable_request_stays_queued_until_its_answer_is_stored(
    nats_url: str,
) -> None:
    """The broker sends a max-deliveries advisory once. Here the result stream refuses the
    leader's answer at first (full). Fails if the advisory is not kept until its request was
    answered, or if the request leaves its queue first: then no answer is ever stored and
    nothing would try again."""
    kw = cluster_kwargs(workers=0, dispatcher={"max_deliver": 2, "ack_wait_s": 2.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        advised = await _exhaust(cluster, c, "refused")
        # It fills the result stream before the advisory goes out.
        full = result_stream(cluster.dispatcher_settings)
        full.max_bytes, full.discard = 1, api.DiscardPolicy.NEW
        await js.update_stream(full)
        await eventually(advised)
        await asyncio.sleep(1.0)  # the leader's answer is refused (three attempts)
        assert await c.fetch_result("refused") is None
        await js.update_stream(result_stream(cluster.dispatcher_settings))

        async def answered() -> bool:
            return await c.fetch_result("refused") is not None

        await eventually(answered)
        result = await c.fetch_result("refused")
        assert result is not None and result.rejection is not None
        assert result.rejection.reason is RejectReason.UNDELIVERABLE
        await eventually(lambda: _advisories_served(js))
        letters = await js.stream_info(names.DEAD_LETTER_STREAM)
        queue = await js.stream_info(names.request_stream("standard"))
    assert letters.state.messages == 1
    assert queue.state.messages == 0


_RAN = Result(request_id="ran", ok=True, model="sim", band="standard", output_tokens=[7])
_TOLD = Result(
    request_id="ran",
    ok=False,
    model="sim",
    band="standard",
    rejection=Rejection(reason=RejectReason.UNDELIVERABLE, message="delivered 2 times"),
)


@pytest.mark.parametrize(
    ("stored", "letters_kept"),
    [(_RAN, 0), (_TOLD, 1)],
    ids=["its-worker-finished-it", "a-leader-died-after-answering"],
)
async def test_an_exhausted_request_with_a_stored_result_is_not_answered_twice(
    nats_url: str, stored: Result, letters_kept: int
) -> None:
    """A result was stored while no dispatcher acked the request, then its last delivery
    timed out. Its worker's result must stay (fails if the advisory is served with a
    rejection anyway: stored after the duplicate window, it would replace the result), and
    the request only leaves its queue. A leader's ``undeliverable`` answer, stored before it
    died, must not stop the dead letter (fails if any stored result counts as served)."""
    kw = cluster_kwargs(
        workers=0, dispatcher={"max_deliver": 2, "ack_wait_s": 2.0, "duplicate_window_s": 0.5}
    )
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        advised = await _exhaust(cluster, c, "ran")
        await store_result(js, stored)  # as its worker's agent, or a leader, stores it
        await eventually(advised)
        await eventually(lambda: _advisories_served(js))
        result = await c.fetch_result("ran")
        results = await js.stream_info(names.RESULT_STREAM)
        letters = await js.stream_info(names.DEAD_LETTER_STREAM)
        queue = await js.stream_info(names.request_stream("standard"))
    assert result == stored
    assert results.state.messages == 1  # not answered twice
    assert letters.state.messages == letters_kept
    assert queue.state.messages == 0


async def test_reoffered_request_that_already_finished_is_not_run_again(nats_url: str) -> None:
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await js.delete_stream(names.RESULT_STREAM)  # its report cannot complete yet
        request = await _submit_unwatched(js, "twice", max_tokens=10)
        agent = cluster.agents[0]

        async def finished() -> bool:
            return agent.completed == 1

        await eventually(finished)
        again = Assignment(
            request=request,
            attempt=2,
            dispatcher_id="test",
            queued_s=0.0,
            epoch=cluster.dispatcher.epoch,  # the leader re-offers it
        )
        reply = await c.nc.request(names.work_subject(agent.worker_id), encode(again), timeout=2)
        assert decode(reply.data, AssignmentReply).accepted
        await asyncio.sleep(0.5)
        assert agent.completed == 1 and agent.in_flight == 0  # confirmed, not run again
        await ensure_streams(js, cluster.dispatcher_settings)

        async def stored() -> bool:
            return await c.fetch_result("twice") is not None

        await eventually(stored)
        result = await c.fetch_result("twice")
    assert result is not None and result.ok


def _results_auth(path: Path, *, lookups: bool) -> None:
    """A broker config with two users: ``all`` may do anything; ``disp`` too, except look up
    stored results while ``lookups`` is off (``$JS.API.DIRECT.GET`` on the result stream)."""
    deny = "" if lookups else f', deny: ["$JS.API.DIRECT.GET.{names.RESULT_STREAM}.>"]'
    path.write_text(
        "accounts: { A: { jetstream: enabled, users: [\n"
        "  {user: all, password: all},\n"
        f'  {{user: disp, password: disp, permissions: {{publish: {{allow: [">"]{deny}}}, '
        'subscribe: {allow: [">"]}}}\n'
        "] } }\n"
    )


@contextlib.asynccontextmanager
async def _ran_and_lost_its_ack(
    tmp_path: Path, max_deliver: int
) -> AsyncIterator[tuple[EmbeddedNats, Path, Client, LocalCluster]]:
    """A request that a dispatcher took (delivery 1), ran (its result is stored) and died
    before acking; then a cluster whose dispatcher may not look up stored results (the user
    ``disp`` of :func:`_results_auth`), with ``ack_wait_s`` of 1 s."""
    conf = tmp_path / "auth.conf"
    _results_auth(conf, lookups=False)
    with EmbeddedNats(config_file=conf) as server:
        url = server.url.replace("nats://", "nats://all:all@")
        kw = cluster_kwargs(
            workers=1,
            dispatcher={
                "nats_user": "disp",
                "nats_password": "disp",
                "ack_wait_s": 1.0,
                "max_deliver": max_deliver,
            },
        )
        async with Client(url) as c:
            js = c.nc.jetstream()
            await ensure_streams(js, DispatcherSettings(nats_url=url, **kw["dispatcher"]))
            request = await _submit_unwatched(js, "ran-once", max_tokens=4)
            dead = await js.pull_subscribe_bind(
                durable=names.dispatcher_consumer("standard"),
                stream=names.request_stream("standard"),
            )
            assert len(await dead.fetch(1, timeout=5)) == 1  # taken, run, never acked
            ran = Result(request_id=request.request_id, ok=True, model="sim", output_tokens=[1])
            await store_result(js, ran)
            async with LocalCluster(url, **kw) as cluster:
                yield server, conf, c, cluster


async def _queue_empty(js: JetStreamContext) -> bool:
    try:
        info = await js.stream_info(names.request_stream("standard"))
    except ServiceUnavailableError:
        return False  # JetStream's API answers no one for a moment while the broker reloads
    return info.state.messages == 0


async def test_a_redelivered_request_whose_result_cannot_be_looked_up_is_not_run_again(
    tmp_path: Path,
) -> None:
    """The dispatcher that gets the request redelivered cannot look up its result. It sends
    it back rather than run it again, until the lookup works; then it sees the result and
    acks. Fails when an unsure lookup counts as "no result" (the request then runs again)."""
    async with _ran_and_lost_its_ack(tmp_path, max_deliver=10) as (server, conf, c, cluster):
        agent = cluster.agents[0]
        before = _deferred()

        async def sent_back_or_run() -> bool:
            return _deferred() >= before + 2 or agent.completed > 0

        await eventually(sent_back_or_run, timeout_s=15)
        assert agent.completed == 0, "run again while its result could not be seen"
        _results_auth(conf, lookups=True)
        os.kill(server.pid or 0, signal.SIGHUP)  # the broker reloads: lookups work
        await eventually(lambda: _queue_empty(c.nc.jetstream()), timeout_s=15)
        assert agent.completed == 0


@contextlib.asynccontextmanager
async def _stored_then_lost_unseen(
    tmp_path: Path, max_deliver: int, taken_before: bool = False, stored: bool = True
) -> AsyncIterator[tuple[EmbeddedNats, Path, Client, LocalCluster, Agent]]:
    """A request that ran on a worker which stored its result and died before its completion
    reached the dispatcher, in a cluster of two whose dispatcher may not look up stored
    results (the user ``disp`` of :func:`_results_auth`), with ``ack_wait_s`` of 1 s;
    yields once the victim is killed, with the survivor. ``taken_before``: a dispatcher
    that died before had taken it (its delivery 1), so this one runs its delivery 2.
    ``stored=False``: the victim died before it stored a result."""
    conf = tmp_path / "auth.conf"
    _results_auth(conf, lookups=False)
    with EmbeddedNats(config_file=conf) as server:
        url = server.url.replace("nats://", "nats://all:all@")
        disp = {
            "nats_user": "disp",
            "nats_password": "disp",
            "max_deliver": max_deliver,
            "ack_wait_s": 1.0,
        }
        kw = cluster_kwargs(workers=2, dispatcher=disp)
        async with Client(url) as c:
            js = c.nc.jetstream()
            await ensure_streams(js, DispatcherSettings(nats_url=url, **kw["dispatcher"]))
            await _submit_unwatched(js, "stored-lost-unseen", max_tokens=60_000)
            if taken_before:
                dead = await js.pull_subscribe_bind(
                    durable=names.dispatcher_consumer("standard"),
                    stream=names.request_stream("standard"),
                )
                assert len(await dead.fetch(1, timeout=5)) == 1  # taken, never acked
            async with LocalCluster(url, **kw) as cluster:

                async def running() -> bool:
                    return any(a.in_flight for a in cluster.agents)

                await eventually(running)
                victim = next(a for a in cluster.agents if a.in_flight)
                ran = Result(
                    request_id="stored-lost-unseen",
                    ok=True,
                    model="sim",
                    worker_id=victim.worker_id,
                    attempt=1,
                    output_tokens=[1],
                )
                if stored:
                    await store_result(js, ran)
                await victim.kill()  # its completion is never sent: only the lease tells
                survivor = next(a for a in cluster.agents if a is not victim)
                yield server, conf, c, cluster, survivor


async def test_a_lost_workers_request_whose_result_cannot_be_looked_up_is_not_run_again(
    tmp_path: Path,
) -> None:
    """When the lost worker's lease expires the dispatcher cannot look up the stored result:
    the request is sent back, not run on the survivor, until the lookup works; then it is
    seen done and acked. Fails when worker loss counts an unsure lookup as "no result" (the
    survivor then runs it)."""
    before = _deferred()
    async with _stored_then_lost_unseen(tmp_path, max_deliver=50) as (server, conf, c, cl, w):
        survivor = w

        async def sent_back_or_run() -> bool:
            return _deferred() >= before + 2 or survivor.in_flight + survivor.completed > 0

        await eventually(sent_back_or_run, timeout_s=20)
        assert survivor.in_flight + survivor.completed == 0, "run while unsure"
        _results_auth(conf, lookups=True)
        os.kill(server.pid or 0, signal.SIGHUP)  # the broker reloads: lookups work
        await eventually(lambda: _queue_empty(c.nc.jetstream()), timeout_s=15)
        assert survivor.in_flight + survivor.completed == 0, "run again"
        assert cl.dispatcher.scheduler.queued == 0
        stored = await c.fetch_result("stored-lost-unseen")
        assert stored is not None and stored.worker_id != survivor.worker_id


async def test_a_lost_workers_request_sent_back_unseen_runs_once_the_lookup_says_no_result(
    tmp_path: Path,
) -> None:
    """The victim died before storing a result: sent back while the lookup fails, the request
    is taken in again once it works, and runs on the survivor (sending it back loses
    nothing). Fails when a request sent back is not queued again on its redelivery."""
    before = _deferred()
    async with _stored_then_lost_unseen(tmp_path, max_deliver=50, stored=False) as (
        server,
        conf,
        _c,
        _cl,
        survivor,
    ):

        async def sent_back_twice() -> bool:
            return _deferred() >= before + 2

        await eventually(sent_back_twice, timeout_s=20)
        assert survivor.in_flight + survivor.completed == 0, "run while unsure"
        _results_auth(conf, lookups=True)
        os.kill(server.pid or 0, signal.SIGHUP)  # the broker reloads: lookups work

        async def runs() -> bool:
            return survivor.in_flight + survivor.completed > 0

        await eventually(runs, timeout_s=20)


async def test_a_lost_workers_request_on_its_last_delivery_runs_though_unseen(
    tmp_path: Path,
) -> None:
    """With ``max_deliver=2`` the request ran on its delivery 2, its last: sent back when its
    worker is lost, it would be dead-lettered without an answer, so it runs on the survivor.
    Fails when the last delivery is sent back too."""
    async with _stored_then_lost_unseen(tmp_path, max_deliver=2, taken_before=True) as (
        _,
        _conf,
        c,
        _cl,
        survivor,
    ):

        async def runs() -> bool:
            return survivor.in_flight + survivor.completed > 0

        await eventually(runs, timeout_s=20)
        dlq = await c.nc.jetstream().stream_info(names.DEAD_LETTER_STREAM)
    assert dlq.state.messages == 0


async def test_a_request_whose_result_is_never_seen_runs_on_its_last_delivery(
    tmp_path: Path,
) -> None:
    """Sent back while its result cannot be looked up, but not for ever: on its last
    delivery it runs (a duplicate run is safe; a request never answered is not). Fails when
    the last delivery is sent back too (it is then dead-lettered without running)."""
    async with _ran_and_lost_its_ack(tmp_path, max_deliver=3) as (_, _conf, c, cluster):
        agent = cluster.agents[0]

        async def ran() -> bool:
            return agent.completed == 1

        await eventually(ran, timeout_s=20)
        await eventually(lambda: _queue_empty(c.nc.jetstream()), timeout_s=15)
        dlq = await c.nc.jetstream().stream_info(names.DEAD_LETTER_STREAM)
    assert dlq.state.messages == 0


def _deferred() -> float:
    value = REGISTRY.get_sample_value("sluice_dispatcher_lookups_deferred_total")
    return value or 0.0


async def test_an_agent_whose_engine_crashed_stays_silent_and_takes_no_work(
    nats_url: str,
) -> None:
    """A crashed engine stops the agent's heartbeats, so its lease expires and what it held
    runs elsewhere. A dispatcher's remove notice made it heartbeat again as a fresh worker,
    which then took work that never ran (seen, by a helper's probe)."""
    from sluice.schemas.models import RemoveNotice

    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        agent = cluster.agents[0]

        def broken() -> Any:
            raise RuntimeError("the engine broke")

        agent.engine.step = broken  # type: ignore[method-assign]
        agent._wake.set()

        async def dead() -> bool:
            return not agent._alive

        await eventually(dead)
        beats: list[Msg] = []
        sub = await c.nc.subscribe(names.heartbeat_subject(agent.worker_id), cb=_keep(beats))
        try:
            notice = RemoveNotice(dispatcher_id="d", registration=agent._registration)
            await c.nc.publish(names.remove_subject(agent.worker_id), encode(notice))
            request = SubmitRequest(
                request_id="r1", model="sim", prompt_text="hi", max_tokens=2, submitted_unix_ms=1
            )
            offer = Assignment(
                request=request, attempt=1, dispatcher_id="d", queued_s=0.0, epoch=10**9
            )
            reply = await c.nc.request(
                names.work_subject(agent.worker_id), encode(offer), timeout=2.0
            )
            answer = decode(reply.data, AssignmentReply)
            await asyncio.sleep(0.5)
        finally:
            await sub.unsubscribe()
    assert not answer.accepted and answer.reason.startswith("stopped"), answer
    assert beats == []


def _keep(into: list[Msg]) -> Callable[[Msg], Awaitable[None]]:
    async def cb(msg: Msg) -> None:
        into.append(msg)

    return cb


async def test_a_result_too_large_for_the_broker_fails_its_attempts_instead_of_waiting(
    tmp_path: Path,
) -> None:
    """A broker with a small ``max_payload`` (64 KiB) and a request whose result is larger:
    no retry stores it. The agent retried forever, silently, and the request never ended
    (seen, by a helper's probe); now each attempt fails, and the client gets a rejection."""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 65536\n")
    with EmbeddedNats(config_file=conf) as server:
        # (A leader's lease long enough for a test process that shares two cores with CI.)
        kw = cluster_kwargs(workers=1, dispatcher={"leader_lease_s": 3.0}, agent={"speed": 1000.0})
        async with LocalCluster(server.url, **kw), Client(server.url) as c:
            handle = await c.submit("sim", PROMPT, max_tokens=30_000)
            with pytest.raises(Rejected) as rejected:
                await handle.result(timeout_s=60)
    assert rejected.value.reason == RejectReason.MAX_ATTEMPTS
    assert "cannot be stored" in str(rejected.value), rejected.value


async def test_a_request_failing_on_a_worker_is_retried_on_another(tmp_path: Path) -> None:
    """The result too large for the broker of the test above, on a fleet of two: the retry
    of an attempt that failed on one worker runs on the other (it went back to the same
    worker, whose cache held its prompt), and the rejection names both."""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 65536\n")
    with EmbeddedNats(config_file=conf) as server:
        kw = cluster_kwargs(workers=2, dispatcher={"leader_lease_s": 3.0}, agent={"speed": 1000.0})
        async with LocalCluster(server.url, **kw) as cluster, Client(server.url) as c:
            handle = await c.submit("sim", PROMPT * 20, max_tokens=30_000)
            with pytest.raises(Rejected) as rejected:
                await handle.result(timeout_s=60)
            workers = sorted(a.worker_id for a in cluster.agents)
    assert rejected.value.reason == RejectReason.MAX_ATTEMPTS
    assert f"(on {', '.join(workers)})" in str(rejected.value), rejected.value

"""Errors that never vanish, over a real nats-server: a malformed result ends the producer's
wait at once; a client whose connection was closed raises only its own errors; a request whose
answer cannot be stored is not acked (it comes back and is answered once the broker takes it);
an agent whose outbox is full refuses work and announces no capacity, and drops no report.
Each fails when its mechanism is removed by hand (the ``_end`` in ``RequestHandle._on_result``;
the ``_NATS_ERRORS`` translations in ``Client``; the ``if stored`` before the ack in
``Answers.reject_raw``, ``Answers.end`` and ``Intake.on_request``; ``Outbox.full``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
import uvloop
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import REGISTRY

from sluice.agent.runtime import Agent
from sluice.agent.runtime.settings import AgentSettings
from sluice.client import (
    Client,
    InvalidRequest,
    MalformedResult,
    NotConnected,
    RejectReason,
    ServiceUnavailable,
)
from sluice.dispatcher.runtime import Dispatcher
from sluice.dispatcher.runtime.settings import DispatcherSettings
from sluice.dispatcher.runtime.streams import result_stream
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.models import Assignment, AssignmentReply, Heartbeat, SubmitRequest
from sluice.testing.cluster import LocalCluster
from sluice.testing.engines import simulated_engine
from sluice.testing.natsserver import EmbeddedNats

from .conftest import FAST_DISPATCHER, cluster_kwargs, eventually

pytestmark = pytest.mark.e2e

PROMPT = list(range(1, 65))


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


# ----------------------------------------------------------------------- 1. malformed result


@pytest.mark.parametrize("how", ["core", "jetstream"])
async def test_a_malformed_result_ends_the_wait_at_once(nats_url: str, nc: NATS, how: str) -> None:
    """No worker: no real result comes. Garbage on the request's result subject must end
    ``result()`` with MalformedResult as it arrives, not at the next 2 s poll of the stream
    (nor at the caller's timeout)."""
    async with LocalCluster(nats_url, **cluster_kwargs(workers=0)), Client(nats_url) as c:
        h = await c.submit("sim", PROMPT, max_tokens=5, request_id="victim")
        waiting = asyncio.create_task(h.result(timeout_s=30))
        await asyncio.sleep(0.2)  # result() waits now
        assert not waiting.done()
        subject = names.result_subject("default", "victim")
        started = time.monotonic()
        if how == "core":
            await nc.publish(subject, b"\xc1 not msgpack")
            await nc.flush()
        else:
            await nc.jetstream().publish(subject, b"\xc1 not msgpack")
        with pytest.raises(MalformedResult) as info:
            await asyncio.wait_for(waiting, timeout=10)
        took = time.monotonic() - started
        assert info.value.request_id == "victim"
        assert took < 0.5, f"the malformed result took {took:.2f} s to end the wait"
        assert h.done
        # The stored copy is malformed too: a later lookup says so instead of "no result".
        with pytest.raises(MalformedResult):
            await c.fetch_result("victim")


# ----------------------------------------------------------------------- 2. closed connection


async def test_a_client_whose_connection_was_closed_raises_only_its_own_errors(
    nats_url: str,
) -> None:
    async with LocalCluster(nats_url, **cluster_kwargs(workers=1)):
        c = Client(nats_url)
        await c.connect()
        try:
            # A working client first: what follows fails because of the closed connection.
            assert (await c.stats()).workers in (0, 1)
            await c.estimate_wait("sim")
            await c.nc.close()
            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "submit": lambda: c.submit("sim", PROMPT, max_tokens=5),
                "submit_text": lambda: c.submit("sim", "hello", max_tokens=5),
                "estimate_wait": lambda: c.estimate_wait("sim"),
                "stats": lambda: c.stats(),
                "fetch_result": lambda: c.fetch_result("some-request"),
            }
            for name, call in calls.items():
                try:
                    got = await call()
                except (ServiceUnavailable, NotConnected):
                    continue
                except Exception as exc:  # a nats-py error (or anything else) leaked
                    raise AssertionError(f"{name} raised {type(exc).__module__}.{exc!r}") from exc
                raise AssertionError(f"{name} returned {got!r} on a closed connection")
        finally:
            await c.close()  # closing again is quiet
        with pytest.raises(NotConnected):
            await c.stats()


# ----------------------------------------------------------------------- 3. un-stored answers


def _answer_failures() -> float:
    """Answers or dead letters the dispatcher could not store (a process-wide counter)."""
    return REGISTRY.get_sample_value("sluice_dispatcher_answer_failures_total") or 0.0


async def _publish_request(
    nats_url: str, payload: bytes, request_id: str, model: str = "sim"
) -> None:
    """Publish to a request subject as Client.submit does, but without its subscription to
    the result subject: a listener there would take the dispatcher's publishes to the missing
    result stream (each would wait for its timeout instead of failing at once)."""
    conn = await nats.connect(nats_url)
    try:
        await conn.jetstream().publish(
            names.request_subject("interactive", model, "default"),
            payload,
            headers={names.MSG_ID_HEADER: request_id},
        )
    finally:
        await conn.close()


async def _no_result_stream_then_back(
    nats_url: str, dispatcher: DispatcherSettings, publish: Callable[[], Awaitable[None]]
) -> None:
    """Delete the result stream, ``publish`` (something the dispatcher must answer), wait
    until its answer failed to be stored, then re-create the result stream."""
    conn = await nats.connect(nats_url)
    js = conn.jetstream()
    try:
        await js.delete_stream(names.RESULT_STREAM)
        failures = _answer_failures()
        await publish()

        async def failed() -> bool:
            return _answer_failures() > failures

        await eventually(failed, timeout_s=6.0, every_s=0.02)
        await js.add_stream(result_stream(dispatcher))
    finally:
        await conn.close()


def _submit(rid: str, model: str = "sim", deadline_ms: int | None = None) -> bytes:
    now_ms = int(time.time() * 1000)
    return encode(
        SubmitRequest(
            request_id=rid,
            model=model,
            band="interactive",
            prompt_tokens=PROMPT,
            max_tokens=5,
            submitted_unix_ms=now_ms,
            deadline_unix_ms=None if deadline_ms is None else now_ms + deadline_ms,
        )
    )


@pytest.mark.parametrize(
    ("model", "payload", "reason"),
    [
        ("sim", b"\xc1\x00garbage", RejectReason.MALFORMED),  # Answers.reject_raw
        ("nope", _submit("lost", model="nope"), RejectReason.UNKNOWN_MODEL),  # Intake
    ],
    ids=["malformed", "unknown-model"],
)
async def test_a_request_whose_answer_cannot_be_stored_is_answered_later(
    nats_url: str, model: str, payload: bytes, reason: RejectReason
) -> None:
    """Input rejected at arrival: the answer is not stored, so the request is not acked; it
    comes back after ack_wait and is answered once the result stream exists again. ack_wait
    (4 s) is longer than the dispatcher's publish retries (~3 s): an ack after them would
    still count (with a shorter one the broker delivers it again whatever the dispatcher
    did). No grace for unknown models: the unknown model is refused at arrival (by the
    intake), not held until the grace ends."""
    kw = cluster_kwargs(workers=0, dispatcher={"ack_wait_s": 4.0, "model_grace_s": 0.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:

        async def publish() -> None:
            await _publish_request(nats_url, payload, "lost", model)

        await _no_result_stream_then_back(nats_url, cluster.dispatcher_settings, publish)

        async def answered() -> bool:
            return await c.fetch_result("lost") is not None

        await eventually(answered, timeout_s=7.0)
        result = await c.fetch_result("lost")
    assert result is not None and not result.ok and result.rejection is not None
    assert result.rejection.reason is reason


async def test_a_held_request_whose_rejection_cannot_be_stored_is_answered_later(
    nats_url: str,
) -> None:
    """``end``: a queued request's deadline passes (no worker), its rejection is not stored,
    so its message is not acked; redelivered after ack_wait, it is rejected again, stored this
    time. ack_wait (4 s) is longer than the dispatcher's publish retries (~3 s): the only
    redelivery comes after end() gave up."""
    kw = cluster_kwargs(workers=0, dispatcher={"ack_wait_s": 4.0})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:

        async def publish() -> None:
            await _publish_request(nats_url, _submit("late-lost", deadline_ms=300), "late-lost")

        await _no_result_stream_then_back(nats_url, cluster.dispatcher_settings, publish)

        async def answered() -> bool:
            return await c.fetch_result("late-lost") is not None

        await eventually(answered, timeout_s=7.0)
        result = await c.fetch_result("late-lost")
        held = cluster.dispatcher.held
    assert result is not None and result.rejection is not None
    assert result.rejection.reason is RejectReason.DEADLINE_EXCEEDED
    assert held == 0


# ----------------------------------------------------------------------- 4. the agent's outbox


def _assignment(rid: str, max_tokens: int = 5, epoch: int = 0) -> bytes:
    req = SubmitRequest(
        request_id=rid,
        model="sim",
        prompt_tokens=PROMPT,
        max_tokens=max_tokens,
        submitted_unix_ms=int(time.time() * 1000),
    )
    return encode(
        Assignment(request=req, attempt=1, dispatcher_id="test", queued_s=0.0, epoch=epoch)
    )


async def test_an_agent_with_a_full_outbox_refuses_work_and_announces_no_capacity(
    nats_url: str, nc: NATS
) -> None:
    """No dispatcher and no result stream: a finished request's report cannot be delivered.
    At outbox_max_reports=1 one such report fills the outbox: the agent refuses assignments
    (reason ``outbox``) and heartbeats capacity 0 until the report gets through (a dispatcher
    starts), and the report is delivered then, not dropped."""
    settings = AgentSettings(
        nats_url=nats_url,
        worker_id="lonely",
        capacity=4,
        speed=20.0,
        heartbeat_s=0.1,
        drain_timeout_s=0.5,
        outbox_max_reports=1,
    )
    beats: list[Heartbeat] = []

    async def on_beat(msg: Msg) -> None:
        beats.append(decode(msg.data, Heartbeat))

    await nc.subscribe(names.heartbeat_subject("lonely"), cb=on_beat)
    await nc.flush()
    work = names.work_subject("lonely")
    async with Agent(settings, simulated_engine(settings)) as agent:

        async def offer(rid: str, epoch: int = 0) -> AssignmentReply:
            reply = await nc.request(work, _assignment(rid, epoch=epoch), timeout=2.0)
            return decode(reply.data, AssignmentReply)

        async def beating() -> bool:
            # A heartbeat seen: the agent's subscription to its work subject (sent before it on
            # the same connection) is in place.
            return bool(beats)

        await eventually(beating, timeout_s=3.0)
        assert beats[-1].capacity == 4
        first = await offer("first")
        assert first.accepted, first.reason

        async def finished() -> bool:
            return agent.completed == 1 and agent.in_flight == 0

        await eventually(finished, timeout_s=5.0)

        async def no_capacity() -> bool:
            return bool(beats) and beats[-1].capacity == 0

        await eventually(no_capacity, timeout_s=3.0)
        refused = await offer("second")
        assert not refused.accepted and refused.reason.startswith("outbox"), refused
        assert agent.in_flight == 0
        # The report is still there, retried with every heartbeat; once a dispatcher (and the
        # result stream) exists it gets through and the agent takes work again.
        d = Dispatcher(DispatcherSettings(nats_url=nats_url, **FAST_DISPATCHER))
        async with d:

            async def capacity_back() -> bool:
                return bool(beats) and beats[-1].capacity == 4

            await eventually(capacity_back, timeout_s=5.0)
            async with Client(nats_url) as c:
                stored = await c.fetch_result("first")
            again = await offer("third", epoch=d.epoch)  # as the leader would send it
    assert stored is not None and stored.ok and stored.worker_id == "lonely"
    assert again.accepted, again.reason


async def test_a_prompt_no_encoder_takes_or_over_the_brokers_limit_is_invalid_at_once(
    nats_url: str,
) -> None:
    """Text holding a lone surrogate (msgpack cannot encode it) and a request larger than the
    broker's max_payload are InvalidRequest before anything is published, not a
    UnicodeEncodeError or a ServiceUnavailable retried for publish_retry_s. Mutation:
    Client._publish without its size check (ServiceUnavailable)."""
    async with Client(nats_url) as c:
        with pytest.raises(InvalidRequest, match="not valid Unicode"):
            await c.submit("sim", "a\ud800b", band="interactive")
        with pytest.raises(InvalidRequest, match="max_payload"):
            await c.submit("sim", "x" * c.nc.max_payload, band="interactive")
        with pytest.raises(InvalidRequest, match="max_payload"):
            await c.enqueue("sim", [70_000] * (c.nc.max_payload // 3), band="batch")
        assert not c.nc._subs  # the refused submits left no subscription behind


async def test_an_id_no_request_or_worker_can_have_is_invalid_not_a_traceback(
    nats_url: str,
) -> None:
    """sluice cancel "" and sluice drain "" printed tracebacks (a pydantic ValidationError, a
    ValueError from the subject): InvalidRequest now, which the command line reports."""
    from sluice.client.admin import drain_worker

    async with Client(nats_url) as c:
        for rid in ("", "a*", "a b"):
            with pytest.raises(InvalidRequest, match="cannot cancel"):
                await c.cancel(rid)
        with pytest.raises(InvalidRequest, match="worker id"):
            await drain_worker(c.nc, "")


def test_a_client_closes_quietly_after_its_broker_died(tmp_path: Path) -> None:
    """The ``sluice`` commands run on uvloop, where nats-py's close wrote what it still had
    to send to the transport the loop closed when the broker died: its RuntimeError replaced
    the command's own error with a traceback (a helper's probe: a broker killed during
    ``sluice renewed return``)."""

    async def go() -> None:
        with EmbeddedNats(store_dir=tmp_path) as server:
            client = await Client(server.url).connect()
            assert server.pid is not None
            os.kill(server.pid, signal.SIGKILL)
            await asyncio.sleep(0.3)
            for _ in range(5):  # (queued while it reconnects)
                with contextlib.suppress(nats.errors.Error):
                    await client.nc.publish("anything", b"x" * 100)
            await client.close()

    uvloop.run(go())

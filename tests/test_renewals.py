"""A request waiting through many leader changes is renewed, not dead-lettered (real
nats-server): every leader change spends one of its ``max_deliver`` deliveries."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from nats.js.client import JetStreamContext

from sluice.client import Client, Rejected, RejectReason
from sluice.dispatcher.runtime import Dispatcher
from sluice.dispatcher.runtime.renewals import generation, renew_from
from sluice.schemas import names
from sluice.schemas.codec import encode
from sluice.schemas.models import SubmitRequest
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

PROMPT = list(range(7000, 7064))
_CHANGES = 7
"""Leader changes while the request waits: more than ``max_deliver`` (4) allows."""


def _settings(**more: object) -> dict[str, object]:
    # A keepalive tick every 0.5 s: a term that holds the request for 1.2 s ticks twice.
    return cluster_kwargs(workers=0, dispatcher={"max_deliver": 4, "ack_wait_s": 1.5, **more})


async def _hand_over(cluster: LocalCluster, rid: str) -> None:
    """The leader holds ``rid`` for two keepalive ticks, then hands over cleanly to a new
    dispatcher (a nak: the request's next delivery)."""

    async def held() -> bool:
        return cluster.dispatcher.held == 1 and cluster.dispatcher.scheduler.queued == 1

    await eventually(held, timeout_s=15)
    await _sleep(1.2)
    await cluster.dispatcher.stop()
    cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
    await cluster.dispatcher.start()


async def _sleep(s: float) -> None:
    await asyncio.sleep(s)


async def test_a_request_waits_through_more_leader_changes_than_max_deliver(
    nats_url: str,
) -> None:
    """Seven leader changes with ``max_deliver`` 4: renewed, it keeps its place in the queue
    (its first arrival) and runs once when a worker comes. Without renewals (``max_renewals``
    0) it is dead-lettered: the next test."""
    assert renew_from(4) == 2
    async with LocalCluster(nats_url, **_settings()) as cluster, Client(nats_url) as c:
        submitted_s = time.monotonic()
        handle = await c.submit("sim", PROMPT, max_tokens=5, request_id="long-wait")
        for _ in range(_CHANGES):
            await _hand_over(cluster, "long-wait")

        async def queued_again() -> bool:
            return cluster.dispatcher.scheduler.queued == 1

        await eventually(queued_again, timeout_s=15)
        queued = cluster.dispatcher.scheduler.queued_request("long-wait")
        assert queued is not None
        # It arrived when it was submitted, not when its newest copy was stored (seconds on).
        assert queued.arrived_s < submitted_s + 1.0, queued.arrived_s - submitted_s
        held = cluster.dispatcher._state.held["long-wait"]
        assert generation(held.msg) >= 2, "renewed at most once in seven leader changes"
        agent = await cluster.add_agent("late-worker")
        result = await handle.result(timeout_s=30)
        assert result.ok
        js = c.nc.jetstream()

        async def queue_empty() -> bool:
            return await _queued(js) == 0

        await eventually(queue_empty)  # every copy acked: none left to run again
        await _sleep(0.5)
        assert agent.completed == 1
        letters = await js.stream_info(names.DEAD_LETTER_STREAM)
        assert letters.state.messages == 0


async def test_without_renewals_leader_changes_dead_letter_a_waiting_request(
    nats_url: str,
) -> None:
    """``max_renewals`` 0: as before renewals, ``max_deliver`` leader changes while it waits
    dead-letter it."""
    async with (
        LocalCluster(nats_url, **_settings(max_renewals=0)) as cluster,
        Client(nats_url) as c,
    ):
        handle = await c.submit("sim", PROMPT, max_tokens=5, request_id="long-wait")
        for _ in range(4):
            await _hand_over(cluster, "long-wait")
        with pytest.raises(Rejected) as info:
            await handle.result(timeout_s=30)
        assert info.value.reason is RejectReason.UNDELIVERABLE


async def _queued(js: JetStreamContext) -> int:
    info = await js.stream_info(names.request_stream("standard"))
    return int(info.state.messages)


async def test_a_renewed_copy_is_held_and_its_older_message_acked(nats_url: str) -> None:
    """The producer's message and a renewed copy of it (as a leader that died between
    publishing the copy and seeing it left them): the newer is held, the older acked, and the
    request keeps the older's arrival. A copy alone, whose arrival is not in the renewals
    bucket, arrives when it was stored (a producer's header claims no place in the queue)."""
    async with LocalCluster(nats_url, **_settings()) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        request = SubmitRequest(
            request_id="copied",
            model="sim",
            prompt_tokens=PROMPT,
            max_tokens=5,
            submitted_unix_ms=int(time.time() * 1000),
        )
        subject = names.request_subject("standard", "sim", "default")
        await js.publish(subject, encode(request), headers={names.MSG_ID_HEADER: "copied"})
        await _sleep(1.0)
        copied_s = time.monotonic()
        await js.publish(
            subject,
            encode(request),
            headers={
                names.MSG_ID_HEADER: names.renewal_msg_id("copied", 1),
                names.RENEWAL_HEADER: "1",
            },
        )

        async def copy_held() -> bool:
            held = cluster.dispatcher._state.held.get("copied")
            return held is not None and generation(held.msg) == 1 and await _queued(js) == 1

        await eventually(copy_held)
        queued = cluster.dispatcher.scheduler.queued_request("copied")
        assert queued is not None and queued.arrived_s < copied_s - 0.5
        forged = request.model_copy(update={"request_id": "forged"})
        # An entry of an earlier renewal under the same id names another message.
        entry = {"request_id": "forged", "stream_seq": 1, "arrived_unix_ms": 0}
        bucket = await js.key_value(names.RENEWAL_BUCKET)
        await bucket.put(names.renewal_key("forged"), json.dumps(entry).encode())
        forged_s = time.monotonic()
        await js.publish(
            subject,
            encode(forged),
            headers={
                names.MSG_ID_HEADER: names.renewal_msg_id("forged", 3),
                names.RENEWAL_HEADER: "3",
            },
        )

        async def forged_queued() -> bool:
            return cluster.dispatcher.scheduler.queued_request("forged") is not None

        await eventually(forged_queued)
        queued = cluster.dispatcher.scheduler.queued_request("forged")
        assert queued is not None and queued.arrived_s > forged_s - 0.5
        agent = await cluster.add_agent("late-worker")

        async def answered() -> bool:
            return await c.fetch_result("copied") is not None

        await eventually(answered, timeout_s=30)
        result = await c.fetch_result("copied")
        assert result is not None and result.ok

        async def queue_empty() -> bool:
            return await _queued(js) == 0

        await eventually(queue_empty, timeout_s=30)
        assert agent.completed == 2  # "copied" once, "forged" once


async def test_an_exhausted_older_copy_leaves_its_queue_unanswered(nats_url: str) -> None:
    """A request's older message exhausted its deliveries while its renewed copy lives (held
    here, or, as the renewals bucket says, stored later for a leader to come): the
    max-deliveries advisory only removes the older message; answering ``undeliverable`` would
    end a request that is queued. (A buffer of one keeps the other messages in the stream,
    unpulled.)"""
    kw = _settings(max_buffered=1)
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        subject = names.request_subject("standard", "sim", "default")
        body = SubmitRequest(
            request_id="renewed",
            model="sim",
            prompt_tokens=PROMPT,
            max_tokens=5,
            submitted_unix_ms=int(time.time() * 1000),
        )
        copy = {names.MSG_ID_HEADER: names.renewal_msg_id("renewed", 1), names.RENEWAL_HEADER: "1"}
        await js.publish(subject, encode(body), headers=copy)

        async def held() -> bool:
            return cluster.dispatcher.held == 1

        await eventually(held)
        older = await js.publish(subject, encode(body), headers={names.MSG_ID_HEADER: "renewed"})
        other = body.model_copy(update={"request_id": "elsewhere"})
        elsewhere = await js.publish(subject, encode(other), headers={names.MSG_ID_HEADER: "x"})
        entry = {"request_id": "elsewhere", "stream_seq": elsewhere.seq + 5, "arrived_unix_ms": 0}
        bucket = await js.key_value(names.RENEWAL_BUCKET)
        await bucket.put(names.renewal_key("elsewhere"), json.dumps(entry).encode())
        again = body.model_copy(update={"request_id": "again"})
        stale = {"request_id": "again", "stream_seq": 1, "arrived_unix_ms": 0}
        await bucket.put(names.renewal_key("again"), json.dumps(stale).encode())
        resubmitted = await js.publish(subject, encode(again), headers={names.MSG_ID_HEADER: "a"})
        assert await _queued(js) == 4
        answers = cluster.dispatcher._answers
        stream = names.request_stream("standard")
        for seq in (older.seq, elsewhere.seq, resubmitted.seq):
            assert await answers._dead_letter_undeliverable(stream, seq, 4)
        assert await _queued(js) == 1  # the held copy alone
        assert await c.fetch_result("renewed") is None
        assert await c.fetch_result("elsewhere") is None
        # A request renewed long ago under the same id (its entry names an older message)
        # is no copy of this one: it is answered and dead-lettered.
        answer = await c.fetch_result("again")
        assert answer is not None and answer.rejection is not None
        assert answer.rejection.reason is RejectReason.UNDELIVERABLE
        letters = await js.stream_info(names.DEAD_LETTER_STREAM)
        assert letters.state.messages == 1


async def test_a_copy_pulled_after_its_request_ended_does_not_run_again(nats_url: str) -> None:
    """A renewed copy can wait to be pulled (a full buffer) while its request runs and ends,
    its older message acked, and the leader change: on its first delivery it is looked up, as
    a redelivery is, and acked, not run a second time."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        handle = await c.submit("sim", PROMPT, max_tokens=5, request_id="ended")
        assert (await handle.result(timeout_s=30)).ok

        async def acked() -> bool:  # its completion reached the leader, its message acked
            return cluster.dispatcher.held == 0

        await eventually(acked)
        # Another leader now: this one's scheduler remembers the request ended.
        await cluster.dispatcher.stop()
        cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
        await cluster.dispatcher.start()
        body = SubmitRequest(
            request_id="ended",
            model="sim",
            prompt_tokens=PROMPT,
            max_tokens=5,
            submitted_unix_ms=int(time.time() * 1000),
        )
        copy = {names.MSG_ID_HEADER: names.renewal_msg_id("ended", 1), names.RENEWAL_HEADER: "1"}
        await js.publish(
            names.request_subject("standard", "sim", "default"), encode(body), headers=copy
        )

        async def queue_empty() -> bool:
            return await _queued(js) == 0

        await eventually(queue_empty)
        await _sleep(0.5)
        assert cluster.agents[0].completed == 1

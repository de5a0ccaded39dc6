"""A request waiting through many leader changes is renewed, not dead-lettered (real
nats-server): every leader change spends one of its ``max_deliver`` deliveries."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.client import JetStreamContext
from prometheus_client import REGISTRY

from sluice.client import Client, Rejected, RejectReason, RequestHandle
from sluice.dispatcher.runtime import Dispatcher
from sluice.dispatcher.runtime.intake import Intake
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
    # A keepalive tick every 0.5 s: a term that holds the request for 1.2 s ticks twice. A
    # 3 s leader lease: a test process starved of the CPU (CI runs four at once on 2 cores)
    # must not lose the lead on its own, which spends a delivery more.
    return cluster_kwargs(
        workers=0,
        dispatcher={"max_deliver": 4, "ack_wait_s": 1.5, "leader_lease_s": 3.0, **more},
    )


async def _hand_over(
    cluster: LocalCluster, rid: str, *, crash: bool = False, handle: RequestHandle | None = None
) -> bool:
    """The leader holds ``rid`` for two keepalive ticks, then hands over cleanly to a new
    dispatcher (a nak: the request's next delivery), or dies (``crash``: the request comes
    back to the next leader once its ``ack_wait`` passed). False, with nothing done, if
    ``handle`` ended first (dead-lettered)."""

    async def held() -> bool:
        if handle is not None and handle.done:
            return True
        return cluster.dispatcher.held == 1 and cluster.dispatcher.scheduler.queued == 1

    await eventually(held, timeout_s=15)
    if handle is not None and handle.done:
        return False
    await _sleep(1.2)
    await (cluster.dispatcher.kill() if crash else cluster.dispatcher.stop())
    cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
    await cluster.dispatcher.start()
    return True


async def _sleep(s: float) -> None:
    await asyncio.sleep(s)


async def test_a_request_waits_through_more_leader_changes_than_max_deliver(
    nats_url: str,
) -> None:
    """Seven leader changes with ``max_deliver`` 4, clean hand-overs and crashes in turn:
    renewed, it keeps its place in the queue (its first arrival) and runs once when a worker
    comes. Without renewals (``max_renewals`` 0) it is dead-lettered: the next test."""
    assert renew_from(4) == 2
    async with LocalCluster(nats_url, **_settings()) as cluster, Client(nats_url) as c:
        submitted_s = time.monotonic()
        handle = await c.submit("sim", PROMPT, max_tokens=5, request_id="long-wait")
        for change in range(_CHANGES):
            await _hand_over(cluster, "long-wait", crash=change % 2 == 1)

        async def queued_again() -> bool:
            return cluster.dispatcher.scheduler.queued == 1

        await eventually(queued_again, timeout_s=15)
        queued = cluster.dispatcher.scheduler.queued_request("long-wait")
        assert queued is not None
        # It arrived when it was submitted, not when its newest copy was stored (seconds on).
        assert queued.arrived_s < submitted_s + 1.0, queued.arrived_s - submitted_s
        held = cluster.dispatcher._state.held["long-wait"]
        assert generation(held.msg) >= 2, "renewed at most once in seven leader changes"
        assert cluster.dispatcher._state.copies_held == 1  # counted as held from its copy

        async def gauged() -> bool:
            return REGISTRY.get_sample_value("sluice_dispatcher_renewed_held_requests") == 1

        await eventually(gauged)
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
        assert cluster.dispatcher._state.copies_held == 0


async def test_without_renewals_leader_changes_dead_letter_a_waiting_request(
    nats_url: str,
) -> None:
    """``max_renewals`` 0: as before renewals, ``max_deliver`` leader changes while it waits
    dead-letter it (sooner if the test process, starved, lost the lead on its own)."""
    async with (
        LocalCluster(nats_url, **_settings(max_renewals=0)) as cluster,
        Client(nats_url) as c,
    ):
        handle = await c.submit("sim", PROMPT, max_tokens=5, request_id="long-wait")
        changes = 0
        while changes < _CHANGES and await _hand_over(cluster, "long-wait", handle=handle):
            changes += 1
        with pytest.raises(Rejected) as info:
            await handle.result(timeout_s=30)
        assert info.value.reason is RejectReason.UNDELIVERABLE
        assert changes <= 4


async def _queued(js: JetStreamContext, stream: str = names.request_stream("standard")) -> int:
    info = await js.stream_info(stream)
    return int(info.state.messages)


def _body(request_id: str) -> SubmitRequest:
    return SubmitRequest(
        request_id=request_id,
        model="sim",
        prompt_tokens=PROMPT,
        max_tokens=5,
        submitted_unix_ms=int(time.time() * 1000),
    )


def _copy(request_id: str, generation: int, arrived_unix_ms: int) -> tuple[str, dict[str, str]]:
    """The subject and headers of a renewed copy, as a leader publishes it."""
    return names.renewed_subject("standard", "sim", "default", request_id), {
        names.MSG_ID_HEADER: names.renewal_msg_id(request_id, generation),
        names.RENEWAL_HEADER: str(generation),
        names.ARRIVED_HEADER: str(arrived_unix_ms),
    }


SUBJECT = names.request_subject("standard", "sim", "default")


async def test_a_renewed_copy_is_held_and_its_older_message_acked(nats_url: str) -> None:
    """The producer's message and a renewed copy of it (as a leader that died between
    publishing the copy and seeing it left them): the newer is held, the older acked, and the
    request keeps its arrival. A producer's message with a copy's headers is no copy: it
    claims no place in the queue (only dispatchers publish renewed copies)."""
    async with LocalCluster(nats_url, **_settings()) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        request = _body("copied")
        await js.publish(SUBJECT, encode(request), headers={names.MSG_ID_HEADER: "copied"})
        arrived_ms = int(time.time() * 1000)
        await _sleep(1.0)
        copied_s = time.monotonic()
        subject, headers = _copy("copied", 1, arrived_ms)
        await js.publish(subject, encode(request), headers=headers)

        async def copy_held() -> bool:
            held = cluster.dispatcher._state.held.get("copied")
            return held is not None and generation(held.msg) == 1 and await _queued(js) == 0

        await eventually(copy_held)
        queued = cluster.dispatcher.scheduler.queued_request("copied")
        assert queued is not None and queued.arrived_s < copied_s - 0.5
        st = cluster.dispatcher._state
        assert st.copies_held == 1  # counted when the copy replaced the producer's message
        forged_s = time.monotonic()
        _, headers = _copy("forged", 3, 0)
        await js.publish(SUBJECT, encode(_body("forged")), headers=headers)

        async def forged_queued() -> bool:
            return cluster.dispatcher.scheduler.queued_request("forged") is not None

        await eventually(forged_queued)
        queued = cluster.dispatcher.scheduler.queued_request("forged")
        assert queued is not None and queued.arrived_s > forged_s - 0.5
        held = cluster.dispatcher._state.held["forged"]
        assert generation(held.msg) == 0
        assert st.copies_held == 1  # a forged copy is no copy
        # The same id submitted again under another message id (the duplicate window passed,
        # say): the message held stays, the later one is acked as a duplicate.
        first_seq = held.stream_seq
        await js.publish(SUBJECT, encode(_body("forged")), headers={names.MSG_ID_HEADER: "again"})

        async def duplicate_acked() -> bool:
            return await _queued(js) == 1  # "forged", held

        await eventually(duplicate_acked)
        assert cluster.dispatcher._state.held["forged"].stream_seq == first_seq
        agent = await cluster.add_agent("late-worker")

        async def answered() -> bool:
            return await c.fetch_result("copied") is not None

        await eventually(answered, timeout_s=30)
        result = await c.fetch_result("copied")
        assert result is not None and result.ok

        async def queues_empty() -> bool:
            return await _queued(js) + await _queued(js, names.RENEWED_STREAM) == 0

        await eventually(queues_empty, timeout_s=30)
        assert agent.completed == 2  # "copied" once, "forged" once
        assert st.copies_held == 0


async def test_an_exhausted_older_copy_leaves_its_queue_unanswered(nats_url: str) -> None:
    """A request's older message exhausted its deliveries while its renewed copy lives (held
    here, or stored for a leader to come): the max-deliveries advisory only removes the older
    message; answering ``undeliverable`` would end a request that is queued. A request whose
    copy is gone (it ran, or never was) is answered; a request submitted twice whose other
    message is held is not. (A buffer of one keeps the band's other messages in its stream,
    unpulled.)"""
    async with (
        LocalCluster(nats_url, **_settings(max_buffered=1)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        st = cluster.dispatcher._state
        # A request that fills the band's buffer (the band's pull then waits for room).
        await js.publish(SUBJECT, encode(_body("twice")), headers={names.MSG_ID_HEADER: "t1"})
        now_ms = int(time.time() * 1000)
        subject, headers = _copy("renewed", 1, now_ms)
        await js.publish(subject, encode(_body("renewed")), headers=headers)
        subject, headers = _copy("elsewhere", 1, now_ms)
        await js.publish(subject, encode(_body("elsewhere")), headers=headers)

        async def held() -> bool:
            return len(st.held) == 3

        await eventually(held)
        # "elsewhere": its copy is stored, but this leader has not taken it (yet).
        assert st.release_held("elsewhere") is not None
        older = await js.publish(
            SUBJECT, encode(_body("renewed")), headers={names.MSG_ID_HEADER: "renewed"}
        )
        elsewhere = await js.publish(
            SUBJECT, encode(_body("elsewhere")), headers={names.MSG_ID_HEADER: "elsewhere"}
        )
        gone = await js.publish(SUBJECT, encode(_body("gone")), headers={names.MSG_ID_HEADER: "g"})
        # Submitted twice under two message ids: the one held lives.
        twice = await js.publish(
            SUBJECT, encode(_body("twice")), headers={names.MSG_ID_HEADER: "t2"}
        )
        assert await _queued(js) == 5
        answers = cluster.dispatcher._answers
        stream = names.request_stream("standard")
        for seq in (older.seq, elsewhere.seq, gone.seq, twice.seq):
            assert await answers._dead_letter_undeliverable(stream, seq, 4)
        assert await _queued(js) == 1  # "twice" as it is held
        assert await c.fetch_result("twice") is None
        assert await c.fetch_result("renewed") is None
        assert await c.fetch_result("elsewhere") is None
        answer = await c.fetch_result("gone")
        assert answer is not None and answer.rejection is not None
        assert answer.rejection.reason is RejectReason.UNDELIVERABLE
        letters = await js.stream_info(names.DEAD_LETTER_STREAM)
        assert letters.state.messages == 1


async def test_a_copy_pulled_after_its_request_ended_does_not_run_again(nats_url: str) -> None:
    """A renewed copy can wait to be pulled while its request runs and ends, its older
    message acked, and the leader change: on its first delivery it is looked up, as a
    redelivery is, and acked, not run a second time."""
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
        subject, headers = _copy("ended", 1, int(time.time() * 1000))
        await js.publish(subject, encode(_body("ended")), headers=headers)

        async def copy_acked() -> bool:
            return await _queued(js, names.RENEWED_STREAM) == 0

        await eventually(copy_acked)
        await _sleep(0.5)
        assert cluster.agents[0].completed == 1


async def test_a_leader_takes_renewed_copies_only_while_its_buffers_have_room(
    nats_url: str,
) -> None:
    """Renewed copies count against the bands' buffers (``max_buffered`` each): a leader that
    took every copy it found besides a full buffer of its bands' messages would hold more
    at each leader change. Five copies, three bands of one each: three held, the other two
    wait in the broker until requests end; then all five run, once each."""
    async with (
        LocalCluster(nats_url, **_settings(max_buffered=1)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        st = cluster.dispatcher._state
        now_ms = int(time.time() * 1000)
        for i in range(5):
            subject, headers = _copy(f"copy-{i}", 1, now_ms)
            await js.publish(subject, encode(_body(f"copy-{i}")), headers=headers)

        async def buffers_full() -> bool:
            return len(st.held) == 3

        await eventually(buffers_full)
        await _sleep(1.0)  # (several pulls' time: none takes more)
        assert len(st.held) == 3 and st.copies_held == 3
        agent = await cluster.add_agent("late-worker")

        async def all_ran() -> bool:
            return all([await c.fetch_result(f"copy-{i}") for i in range(5)])

        await eventually(all_ran, timeout_s=30)

        async def copies_acked() -> bool:
            return await _queued(js, names.RENEWED_STREAM) == 0

        await eventually(copies_acked)
        await _sleep(0.5)
        assert agent.completed == 5


async def test_a_copy_looked_up_while_its_original_arrives_is_held_instead(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy's first delivery waits on its result's lookup; its original, pulled by its band
    meanwhile, is held by then. The copy is held instead of it (it carries the renewed
    deliveries), not acked as a duplicate of the original. (The lookup is made to wait, and
    the batch lookup to fail, as when the broker is slow.)"""
    async with LocalCluster(nats_url, **_settings()) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        st = cluster.dispatcher._state
        intake = cluster.dispatcher._intake
        looked_up = intake.answers.result_known

        async def no_batch_lookup(msgs: object) -> dict[tuple[str, str], bool | None]:
            return {}

        async def slow_lookup(tenant: str, request_id: str) -> bool | None:
            if request_id == "raced":
                await js.publish(
                    SUBJECT, encode(_body("raced")), headers={names.MSG_ID_HEADER: "raced"}
                )

                async def original_held() -> bool:
                    held = st.held.get("raced")
                    return held is not None and generation(held.msg) == 0

                await eventually(original_held)
            return await looked_up(tenant, request_id)

        monkeypatch.setattr(intake, "_results_of_redeliveries", no_batch_lookup)
        monkeypatch.setattr(intake.answers, "result_known", slow_lookup)
        subject, headers = _copy("raced", 1, int(time.time() * 1000))
        await js.publish(subject, encode(_body("raced")), headers=headers)

        async def copy_held() -> bool:
            held = st.held.get("raced")
            return held is not None and generation(held.msg) == 1 and await _queued(js) == 0

        await eventually(copy_held)
        assert await _queued(js, names.RENEWED_STREAM) == 1  # the copy, held
        assert st.copies_held == 1


async def test_a_request_in_two_bands_is_renewed_under_its_copys_own_band(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same id submitted to two bands: a leader holds its message of one band, then gets
    the renewed copy made from the other's and holds that instead. Renewed again, the copy
    goes under the band its body says (it went under the held request's first band, and the
    next leader answered it ``malformed``: subject and body disagreed). A helper's review."""
    async with LocalCluster(nats_url, **_settings()) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        _, headers = _copy("dup", 1, int(time.time() * 1000))
        interactive = names.renewed_subject("interactive", "sim", "default", "dup")
        body = _body("dup").model_copy(update={"band": "interactive"})
        await js.publish(interactive, encode(body), headers=headers)

        async def held() -> bool:
            return cluster.dispatcher.held == 1

        await eventually(held)
        await cluster.dispatcher.stop()  # a hand-over: the copy's second delivery next
        await js.publish(SUBJECT, encode(_body("dup")), headers={names.MSG_ID_HEADER: "dup"})
        taken = Intake._copies_room
        first = [True]

        async def band_first(self: Intake) -> int:  # the band's pull wins the race this time
            if first[0]:
                first[0] = False
                await asyncio.sleep(1.5)
            return await taken(self)

        monkeypatch.setattr(Intake, "_copies_room", band_first)
        cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
        await cluster.dispatcher.start()

        async def renewed_again() -> bool:  # its copy held, renewed once more
            h = cluster.dispatcher._state.held.get("dup")
            return h is not None and generation(h.msg) == 2

        await eventually(renewed_again, timeout_s=20)
        await cluster.add_agent("late-worker")

        async def answered() -> bool:
            return await c.fetch_result("dup") is not None

        await eventually(answered, timeout_s=30)
        result = await c.fetch_result("dup")
        assert result is not None and result.ok, result

"""``sluice renewed``: the requests that live as renewed copies, moved back to their bands'
queues before a rollback to a release without renewals (real nats-server, real dispatchers
and agents, the command line as a process)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import pytest
from nats.js.api import PubAck
from nats.js.client import JetStreamContext

from sluice.client import Client, DispatcherLeading, renewed
from sluice.client.renewed import renewed_copies, return_renewed
from sluice.dispatcher.runtime import Dispatcher
from sluice.schemas import names
from sluice.schemas.codec import encode
from sluice.schemas.models import Result, SubmitRequest
from sluice.testing.cluster import LocalCluster

from .conftest import SLUICE, cluster_kwargs, eventually

pytestmark = [pytest.mark.e2e]

PROMPT = list(range(9000, 9032))
_FULL_BAND = "batch"


def _body(request_id: str, band: str = "standard") -> SubmitRequest:
    return SubmitRequest(
        request_id=request_id,
        model="sim",
        band=band,
        prompt_tokens=PROMPT,
        max_tokens=4,
        submitted_unix_ms=int(time.time() * 1000),
    )


async def _copy(
    js: JetStreamContext, request_id: str, generation: int, band: str = "standard"
) -> PubAck:
    """Store a renewed copy of ``request_id`` as a leader does."""
    return await js.publish(
        names.renewed_subject(band, "sim", "default", request_id),
        encode(_body(request_id, band)),
        headers={
            names.MSG_ID_HEADER: names.renewal_msg_id(request_id, generation),
            names.RENEWAL_HEADER: str(generation),
            names.ARRIVED_HEADER: str(int(time.time() * 1000)),
        },
    )


async def _messages(js: JetStreamContext, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


def _cli(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLUICE_NATS_URL": nats_url}
    return subprocess.run(
        [*SLUICE, "renewed", *args], env=env, capture_output=True, text=True, timeout=60
    )


async def test_copies_go_back_to_their_bands_and_run_once(nats_url: str) -> None:
    """With a dispatcher leading, nothing moves (it holds the copies it pulled). With every
    dispatcher stopped: a request's newest copy goes back to its band's queue and all its
    copies are deleted; a request whose result is stored only loses its copies; one whose
    band's queue is full stays a copy (exit code 1) until a later run finds room. A
    dispatcher then runs each returned request once."""
    settings = cluster_kwargs(workers=0, dispatcher={"band_queue_max_msgs": {_FULL_BAND: 1}})
    async with LocalCluster(nats_url, **settings) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        with pytest.raises(DispatcherLeading):
            await return_renewed(c.nc)
        await cluster.dispatcher.stop()  # a clean stop: its leader key is deleted

        # "moved": its producer's message, acked when its first copy came back (moments ago:
        # its id is in the broker's duplicate window), and two copies.
        original = await js.publish(
            names.request_subject("standard", "sim", "default"),
            encode(_body("moved")),
            headers={names.MSG_ID_HEADER: "moved"},
        )
        await js.delete_msg(names.request_stream("standard"), original.seq)
        await _copy(js, "moved", 1)
        # A copy acked (its request ran) between two others: the scan reads past the gap.
        gone = await _copy(js, "acked", 1)
        await js.delete_msg(names.RENEWED_STREAM, gone.seq)
        await _copy(js, "moved", 2)  # (its older copy, not acked: the leader died)
        await _copy(js, "ran", 1)
        await js.publish(
            names.result_subject("default", "ran"),
            encode(Result(request_id="ran", ok=True, model="sim")),
        )
        await _copy(js, "waits", 1, band=_FULL_BAND)
        full = names.request_stream(_FULL_BAND)
        bound = (await js.stream_info(full)).config.max_msgs
        assert bound is not None and bound > 0
        for i in range(bound):
            await js.publish(
                names.request_subject(_FULL_BAND, "sim", "default"),
                encode(_body(f"filler-{i}", _FULL_BAND)),
                headers={names.MSG_ID_HEADER: f"filler-{i}"},
            )

        # A message without a copy's headers (none a dispatcher stores): shown, left alone.
        stray = await js.publish(names.renewed_subject("standard", "sim", "default", "x"), b"?")

        shown = _cli(nats_url, "show", "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout) == {
            "requests": 3,
            "copies": 4,
            "by_band": {_FULL_BAND: 1, "standard": 2},
            "unreadable": [stray.seq],
        }

        done = _cli(nats_url, "return", "--json")
        assert done.returncode == 1, done.stderr  # "waits": its band's queue is full
        assert "run `sluice renewed return` again" in done.stderr
        figures = json.loads(done.stdout)
        assert figures["returned"] == 1 and figures["ended"] == 1 and figures["left"] == 1
        assert figures["copies_deleted"] == 3 and figures["left_requests"] == ["waits"]
        assert figures["unreadable"] == [stray.seq]
        assert await _messages(js, names.RENEWED_STREAM) == 2  # "waits", the stray
        await js.delete_msg(names.RENEWED_STREAM, stray.seq)
        standard = names.request_stream("standard")
        assert await _messages(js, standard) == 1
        moved = await js.get_last_msg(standard, names.request_subject("standard", "sim", "default"))
        assert moved.headers is not None
        assert moved.headers[names.MSG_ID_HEADER] == names.returned_msg_id("moved", 2)
        assert generation_free(moved.headers)

        # Room in the full band (its fillers taken by hand): the next run moves the rest.
        for seq in range(1, bound + 1):
            await js.delete_msg(full, seq)
        again = await return_renewed(c.nc)
        assert (again.returned, again.ended, again.left) == (["waits"], [], [])
        assert await _messages(js, names.RENEWED_STREAM) == 0
        assert (await renewed_copies(c.nc)).requests == 0

        cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
        await cluster.dispatcher.start()
        agent = await cluster.add_agent("after-rollback")

        async def ran() -> bool:
            return all([await c.fetch_result("moved"), await c.fetch_result("waits")])

        await eventually(ran, timeout_s=30)
        for rid in ("moved", "waits"):
            result = await c.fetch_result(rid)
            assert result is not None and result.ok, result
        assert agent.completed == 2  # "ran" did not run again


def generation_free(headers: dict[str, str]) -> bool:
    """A returned request is a producer's message to every dispatcher: no copy's headers."""
    return names.RENEWAL_HEADER not in headers and names.ARRIVED_HEADER not in headers


async def test_a_leading_dispatcher_is_named_and_nothing_moves(nats_url: str) -> None:
    """``sluice renewed return`` with a dispatcher leading: exit code 2, the leader named,
    every copy where it was."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=0)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await _copy(js, "kept", 1)

        async def held() -> bool:
            return cluster.dispatcher.held == 1

        await eventually(held)
        done = _cli(nats_url, "return")
        assert done.returncode == 2
        assert cluster.dispatcher_settings.dispatcher_id in done.stderr
        assert await _messages(js, names.RENEWED_STREAM) == 1
        assert await _messages(js, names.request_stream("standard")) == 0


async def test_a_dispatcher_started_midway_stands_by_until_the_move_ends(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move holds the leader key: a dispatcher started while it runs (a standby left
    running, say) stands by, and takes over only once the move ended; it then runs every
    returned request once. (Had it led, it would have held a copy that the move deleted,
    and acked the returned message as its duplicate: the request gone.)"""
    settings = cluster_kwargs(workers=0)
    async with LocalCluster(nats_url, **settings) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        await cluster.dispatcher.stop()
        for rid in ("a", "b", "c"):
            await _copy(js, rid, 1)
        lease_s = cluster.dispatcher_settings.leader_lease_s
        looked_up = renewed._result_stored
        standby: list[Dispatcher] = []

        async def meanwhile(js: JetStreamContext, tenant: str, request_id: str) -> bool:
            if not standby:
                standby.append(Dispatcher(cluster.dispatcher_settings))
                await standby[0].start()  # it campaigns once: the key is held
                await asyncio.sleep(2.5 * lease_s)  # (a key left unrenewed is taken by now)
                assert not standby[0]._state.leading()
            return await looked_up(js, tenant, request_id)

        monkeypatch.setattr(renewed, "_result_stored", meanwhile)
        done = await return_renewed(c.nc)
        assert sorted(done.returned) == ["a", "b", "c"]
        assert await _messages(js, names.RENEWED_STREAM) == 0
        cluster.dispatcher = standby[0]

        async def leads() -> bool:
            return cluster.dispatcher._state.leading()

        await eventually(leads)
        agent = await cluster.add_agent("after-rollback")

        async def ran() -> bool:
            return all([await c.fetch_result(rid) for rid in ("a", "b", "c")])

        await eventually(ran, timeout_s=30)
        await asyncio.sleep(0.5)
        assert agent.completed == 3


async def test_a_renewed_request_whose_copy_no_leader_held_returns_once(nats_url: str) -> None:
    """Full buffers keep a leader from pulling the copies it made (their originals, held,
    are acked only once a leader holds a copy): both messages are stored when the move
    runs. The original is deleted with the copy, so the request is queued once and runs
    once. (Three bands with a buffer of one, a request in each, one hand-over to spend a
    delivery, then two keepalive ticks.)"""
    settings = cluster_kwargs(
        workers=0,
        dispatcher={"max_deliver": 4, "ack_wait_s": 1.5, "leader_lease_s": 3.0, "max_buffered": 1},
    )
    async with LocalCluster(nats_url, **settings) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        bands = names.DEFAULT_BANDS
        for band in bands:
            await c.submit("sim", PROMPT, max_tokens=4, band=band, request_id=f"in-{band}")

        async def all_held() -> bool:
            return cluster.dispatcher.held == len(bands)

        await eventually(all_held)
        await cluster.dispatcher.stop()  # a hand-over: each request's second delivery next
        cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
        await cluster.dispatcher.start()

        async def renewed_all() -> bool:
            return await _messages(js, names.RENEWED_STREAM) == len(bands)

        await eventually(renewed_all, timeout_s=15)
        await asyncio.sleep(0.5)
        assert cluster.dispatcher._state.copies_held == 0  # no room: none pulled
        await cluster.dispatcher.stop()

        done = await return_renewed(c.nc)
        assert sorted(done.returned) == sorted(f"in-{b}" for b in bands)
        assert done.originals_deleted == len(bands) and done.copies_deleted == len(bands)
        for band in bands:
            assert await _messages(js, names.request_stream(band)) == 1, band

        cluster.dispatcher = Dispatcher(cluster.dispatcher_settings)
        await cluster.dispatcher.start()
        agent = await cluster.add_agent("after-rollback")

        async def ran() -> bool:
            return all([await c.fetch_result(f"in-{b}") for b in bands])

        await eventually(ran, timeout_s=30)
        await asyncio.sleep(0.5)
        assert agent.completed == len(bands)

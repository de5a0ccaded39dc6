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
from nats.js.client import JetStreamContext

from sluice.client import Client, DispatcherLeading
from sluice.client.renewed import renewed_copies, return_renewed
from sluice.dispatcher.runtime import Dispatcher
from sluice.schemas import names
from sluice.schemas.codec import encode
from sluice.schemas.models import LeaderLease, Result, SubmitRequest
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
) -> None:
    """Store a renewed copy of ``request_id`` as a leader does."""
    await js.publish(
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


async def test_a_dispatcher_that_takes_the_lead_midway_stops_the_move(nats_url: str) -> None:
    """A standby left running takes the lead while copies are moved: the move stops before
    the next request (the leader pulls and holds copies), and says who leads."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=0)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await cluster.dispatcher.stop()
        for rid in ("a", "b", "c"):
            await _copy(js, rid, 1)
        kv = await js.key_value(names.LEADER_BUCKET)
        took: list[asyncio.Task[int]] = []

        def scanned(read: int, total: int) -> None:
            if read == total and not took:  # the lead taken as the moves begin
                lease = LeaderLease(dispatcher_id="standby-7", epoch=1)
                took.append(asyncio.create_task(kv.put(names.LEADER_KEY, encode(lease))))

        with pytest.raises(DispatcherLeading) as info:
            await return_renewed(c.nc, scanned)
        assert info.value.dispatcher_id == "standby-7"
        assert await _messages(js, names.RENEWED_STREAM) >= 2  # at most one request moved
        await kv.delete(names.LEADER_KEY)

"""``sluice renewed``: the requests that live as renewed copies, moved back to their bands'
queues before a rollback to a release without renewals (real nats-server, real dispatchers
and agents, the command line as a process)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError

from sluice.client import Client, DispatcherLeading, renewed
from sluice.client.renewed import renewed_copies, return_renewed
from sluice.dispatcher.runtime import Dispatcher
from sluice.schemas import names
from sluice.schemas.codec import encode
from sluice.schemas.models import LeaderLease, Result, SubmitRequest
from sluice.testing.cluster import LocalCluster
from sluice.testing.natsserver import EmbeddedNats

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
    js: JetStreamContext,
    request_id: str,
    generation: int,
    band: str = "standard",
    source: str | None = None,
    msg_id: str | None = None,
) -> PubAck:
    """Store a renewed copy of ``request_id`` as a leader does (``source``: the reference to
    the message it was made from; ``msg_id``: another id than the leader's, as if stored
    after the renewed stream's duplicate window)."""
    headers = {
        names.MSG_ID_HEADER: msg_id or names.renewal_msg_id(request_id, generation),
        names.RENEWAL_HEADER: str(generation),
        names.ARRIVED_HEADER: str(int(time.time() * 1000)),
    }
    if source is not None:
        headers[names.RENEWED_FROM_HEADER] = source
    return await js.publish(
        names.renewed_subject(band, "sim", "default", request_id),
        encode(_body(request_id, band)),
        headers=headers,
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
            await return_renewed(c.nc, listen_s=0.1)
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
        newest = await _copy(js, "moved", 2)  # (its older copy, not acked: the leader died)
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
            "stream_found": True,
            "requests": 3,
            "copies": 4,
            "by_band": {_FULL_BAND: 1, "standard": 2},
            "bands_without_stream": [],
            "unreadable": [stray.seq],
        }

        done = _cli(nats_url, "return", "--json")
        assert done.returncode == 1, done.stderr  # "waits": its band's queue is full
        assert "run `sluice renewed return` again" in done.stderr
        figures = json.loads(done.stdout)
        assert figures["returned"] == 1 and figures["ended"] == 1 and figures["left"] == 1
        assert figures["copies_deleted"] == 3
        (left,) = figures["left_requests"]
        assert left["request_id"] == "waits" and "queue is full" in left["reason"]
        assert "left waits" not in done.stdout  # (the JSON alone on stdout)
        assert figures["unreadable"] == [stray.seq]
        assert await _messages(js, names.RENEWED_STREAM) == 2  # "waits", the stray
        await js.delete_msg(names.RENEWED_STREAM, stray.seq)
        standard = names.request_stream("standard")
        assert await _messages(js, standard) == 1
        moved = await js.get_last_msg(standard, names.request_subject("standard", "sim", "default"))
        assert moved.headers is not None
        assert moved.headers[names.MSG_ID_HEADER] == names.returned_msg_id("moved", newest.seq)
        assert generation_free(moved.headers)

        # Room in the full band (its fillers taken by hand): the next run moves the rest.
        for seq in range(1, bound + 1):
            await js.delete_msg(full, seq)
        again = await return_renewed(c.nc, listen_s=0.1)
        assert (again.returned, again.ended, again.left) == (["waits"], [], [])
        assert again.stream_found
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
    # A 5 s leader lease: the command's process starves this one, whose lead must not run
    # out meanwhile (the command would then move the copy).
    settings = cluster_kwargs(workers=0, dispatcher={"leader_lease_s": 5.0})
    async with LocalCluster(nats_url, **settings) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        await _copy(js, "kept", 1)

        async def held() -> bool:
            return cluster.dispatcher.held == 1

        await eventually(held)
        done = _cli(nats_url, "return")
        assert done.returncode == 2
        said = " ".join(done.stderr.split())  # (rich wraps long lines)
        assert f"dispatcher {cluster.dispatcher_settings.dispatcher_id} leads" in said, said
        assert "stop every dispatcher first" in said and "renewed" in said, said
        assert "runs out" in said, said  # what a crashed leader's key does
        assert await _messages(js, names.RENEWED_STREAM) == 1
        assert await _messages(js, names.request_stream("standard")) == 0

        # The key held by another run of the command (killed, say): named as such.
        await cluster.dispatcher.stop()
        kv = await js.key_value(names.LEADER_BUCKET)
        # (put: a key this starved test process's dispatcher let run out is still there)
        await kv.put(names.LEADER_KEY, encode(LeaderLease(dispatcher_id=renewed.RETURN_LEADER)))
        with pytest.raises(DispatcherLeading) as info:
            await return_renewed(c.nc, listen_s=0.1)
        assert "another `sluice renewed return` holds the leader key" in str(info.value)
        await kv.delete(names.LEADER_KEY)


async def test_odd_copies_are_left_alone_and_the_rest_moved(nats_url: str) -> None:
    """A copy of a band no stream takes is left, with why (the others move; exit code 1); a
    message whose subject, headers and body disagree is no copy (listed, left); a copy whose
    original's reference cannot be read moves, its reference ignored."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=0)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await cluster.dispatcher.stop()
        await _copy(js, "ok-1", 1)
        await _copy(js, "ghost-1", 1, band="ghost")
        await _copy(js, "bad-ref", 1, source="bad.name:5")
        subject, headers = (
            names.renewed_subject("standard", "sim", "default", "mismatch"),
            {
                names.MSG_ID_HEADER: names.renewal_msg_id("mismatch", 1),
                names.RENEWAL_HEADER: "1",
            },
        )
        odd = await js.publish(subject, encode(_body("another-id")), headers=headers)
        await _copy(js, "ok-2", 1)

        shown = json.loads(_cli(nats_url, "show", "--json").stdout)
        assert shown["requests"] == 4 and shown["bands_without_stream"] == ["ghost"]
        assert shown["unreadable"] == [odd.seq]

        done = _cli(nats_url, "return", "--json")
        assert done.returncode == 1, done.stderr
        figures = json.loads(done.stdout)
        assert figures["returned"] == 3 and figures["unreadable"] == [odd.seq]
        (left,) = figures["left_requests"]
        assert left["request_id"] == "ghost-1"
        assert left["reason"] == "no stream takes band 'ghost' on this broker"
        assert await _messages(js, names.RENEWED_STREAM) == 2  # "ghost-1", the odd one
        assert await _messages(js, names.request_stream("standard")) == 3


def test_a_broker_without_renewals_says_so(tmp_path: Path) -> None:
    """A broker where no dispatcher with renewals ran (the wrong one?) has nothing to show
    or move, and says so."""
    with EmbeddedNats(store_dir=tmp_path) as server:
        for command in ("show", "return"):
            done = _cli(server.url, command, "--json")
            assert done.returncode == 0, done.stderr
            assert "no SLUICE_RENEWED stream" in " ".join(done.stderr.split()), done.stderr
        assert json.loads(_cli(server.url, "show", "--json").stdout)["stream_found"] is False


async def test_a_dispatcher_started_midway_stands_by_until_the_move_ends(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move holds the leader key: a dispatcher started while it runs (a standby left
    running, say) stands by, and takes over only once the move ended; it then runs every
    returned request once. (Had it led, it would have held a copy that the move deleted,
    and acked the returned message as its duplicate: the request gone.)"""
    # The first dispatcher made the leader bucket with a 30 s time to live; the standby has a
    # 2 s lease: the key must be renewed well within the standby's lease, not the bucket's.
    settings = cluster_kwargs(workers=0, dispatcher={"leader_lease_s": 30.0})
    async with LocalCluster(nats_url, **settings) as cluster, Client(nats_url) as c:
        js = c.nc.jetstream()
        await cluster.dispatcher.stop()
        for rid in ("a", "b", "c"):
            await _copy(js, rid, 1)
        lease_s = 2.0
        standby_settings = cluster.dispatcher_settings.model_copy(
            update={"leader_lease_s": lease_s}
        )
        looked_up = renewed._result_stored
        standby: list[Dispatcher] = []

        async def meanwhile(js: JetStreamContext, tenant: str, request_id: str) -> bool:
            if not standby:
                standby.append(Dispatcher(standby_settings))
                await standby[0].start()  # it campaigns once: the key is held
                await asyncio.sleep(2.5 * lease_s)  # (a key left unrenewed is taken by now)
                assert not standby[0]._state.leading()
            return await looked_up(js, tenant, request_id)

        monkeypatch.setattr(renewed, "_result_stored", meanwhile)
        done = await return_renewed(c.nc, listen_s=0.1)
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

        done = await return_renewed(c.nc, listen_s=0.1)
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


async def test_a_move_stopped_midway_says_what_it_did_and_a_second_run_finishes_it(
    nats_url: str,
) -> None:
    """SIGTERM while requests move: it stops within a request (nats-py swallowed the
    cancellation, and the whole run went on), prints what it did and how to finish; run
    again at once, every request is queued exactly once."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=0)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await cluster.dispatcher.stop()
        count = 400
        for i in range(count):
            await _copy(js, f"r{i}", 1)
        env = {**os.environ, "SLUICE_NATS_URL": nats_url}
        command = [*SLUICE, "renewed", "return", "--json"]
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:

            async def moving() -> bool:
                return await _messages(js, names.RENEWED_STREAM) < count - 20

            await eventually(moving, timeout_s=30, every_s=0.01)
            proc.send_signal(signal.SIGTERM)
            out, errs = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode not in (0, 1), errs
        figures = json.loads(out)
        assert 0 < figures["returned"] < count, figures  # it stopped midway
        assert "run `sluice renewed return` again within" in " ".join(errs.decode().split())
        again = _cli(nats_url, "return", "--json")
        assert again.returncode == 0, again.stderr
        assert await _messages(js, names.RENEWED_STREAM) == 0
        standard = names.request_stream("standard")
        assert await _messages(js, standard) == count  # each once


async def test_a_request_a_worker_still_runs_is_left(nats_url: str) -> None:
    """The dispatchers stopped, the workers run on: a request one of them runs is left (its
    heartbeats list it), with why, since moved it could run again once it finished."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await c.submit("sim", PROMPT, max_tokens=4000, request_id="long")
        agent = cluster.agents[0]

        async def running() -> bool:
            return agent.in_flight == 1

        await eventually(running)
        await cluster.dispatcher.stop()
        await _copy(js, "long", 1)  # (as if renewed while it ran)
        done = await return_renewed(c.nc, listen_s=2.5)
        (left,) = done.left
        assert left.request_id == "long", done
        assert left.reason.startswith(f"running on worker {agent.worker_id}"), left
        assert done.returned == [] and await _messages(js, names.RENEWED_STREAM) == 1


async def test_a_later_copy_of_a_returned_request_returns_again(nats_url: str) -> None:
    """A request returned, then run by newer dispatchers that renewed it again (the same
    generation, a later copy), returned once more within the duplicate window: the message
    id is the copy's, so the broker takes it; one per generation would have been dropped as
    a duplicate, and the copy deleted: the request gone."""
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=0)) as cluster,
        Client(nats_url) as c,
    ):
        js = c.nc.jetstream()
        await cluster.dispatcher.stop()
        standard = names.request_stream("standard")
        await _copy(js, "twice", 1)
        assert (await return_renewed(c.nc, listen_s=0.1)).returned == ["twice"]
        first = await js.get_last_msg(standard, names.request_subject("standard", "sim", "default"))
        assert first.seq is not None
        await js.delete_msg(standard, first.seq)  # pulled, held and renewed again meanwhile
        # Renewed again to generation 1 (its held message was the returned one, generation
        # 0), stored past the renewed stream's window since the first copy: another id there.
        await _copy(js, "twice", 1, msg_id="twice~r01")
        assert (await return_renewed(c.nc, listen_s=0.1)).returned == ["twice"]
        assert await _messages(js, standard) == 1
        assert await _messages(js, names.RENEWED_STREAM) == 0


async def test_the_held_key_survives_a_lost_renewal_reply_and_a_killed_runs_key_is_taken(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key as this run holds it: a renewal that the broker applied but whose reply was
    lost (the key ours at a later revision) is no loss of the lead, and the run's value is
    its own (a pid and a token), so it is told from another run's. A run that was killed
    left its key (a bucket whose time to live is long): the next run takes it over once it
    went unrenewed for ``_STALE_AFTER_S``."""
    settings = cluster_kwargs(workers=0, dispatcher={"leader_lease_s": 30.0})
    async with LocalCluster(nats_url, **settings) as cluster, Client(nats_url) as c:
        await cluster.dispatcher.stop()
        kv = await c.nc.jetstream().key_value(names.LEADER_BUCKET)
        async with renewed._HeldLead(c.nc) as lead:
            await kv.put(names.LEADER_KEY, lead._value)  # (the lost reply's write)
            await lead._renew()
            await lead.check()  # still ours
        killed = LeaderLease(dispatcher_id=f"{renewed.RETURN_LEADER}-1-dead")
        await kv.put(names.LEADER_KEY, encode(killed))
        with pytest.raises(DispatcherLeading):  # renewed moments ago: a run that lives?
            await return_renewed(c.nc, listen_s=0.1)
        monkeypatch.setattr(renewed, "_STALE_AFTER_S", 0.5)
        await asyncio.sleep(1.0)
        assert (await return_renewed(c.nc, listen_s=0.1)).stream_found
        with pytest.raises(KeyNotFoundError):  # deleted at the end, as its own
            await kv.get(names.LEADER_KEY)

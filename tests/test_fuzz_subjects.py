"""Hostile input on every subject the dispatcher and the agents read, while real load runs:
at least 10,000 malformed and hostile messages (bad msgpack, wrong types, huge fields, unknown
versions, forged worker ids, negative and enormous numbers). Every process keeps serving,
every real request finishes, every message on a request subject is answered with a typed
rejection (it named a request id) or dead-lettered (it did not), and the dispatcher's books
come back to the real fleet (forged workers expire, nothing stays held). Real nats-server,
dispatcher and agents; a seeded generator, so a failure is reproducible."""

from __future__ import annotations

import asyncio
import random
import resource
import time
from typing import Any

import msgpack
import pytest

from sluice.client import Client
from sluice.schemas import names
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs, eventually

pytestmark = pytest.mark.e2e

SEED = 1313
PROMPT = list(range(300, 364))


def _valid_request(rid: str) -> dict[str, Any]:
    return {
        "v": 1,
        "request_id": rid,
        "model": "sim",
        "tenant": "fuzz",
        "band": "standard",
        "prompt_tokens": PROMPT,
        "prompt_text": None,
        "max_tokens": 4,
        "submitted_unix_ms": int(time.time() * 1000),
        "deadline_unix_ms": None,
        "session_id": None,
    }


def _hostile_request(rng: random.Random, rid: str) -> bytes:
    """A request body that must be refused: one field broken in one of many ways."""
    body = _valid_request(rid)
    kind = rng.randrange(12)
    if kind == 0:
        body["v"] = rng.choice([0, 2, 99, -1, "1", None])
    elif kind == 1:
        body["max_tokens"] = rng.choice([-5, 0, 2**63 - 1, 10**7, "many", 3.5, None])
    elif kind == 2:
        body["prompt_tokens"] = rng.choice([[-1, 2], [2**40], [2**32], ["a", "b"], "tokens", {}])
    elif kind == 3:
        body["model"] = "m" * rng.choice([129, 5000, 100_000])  # huge
    elif kind == 4:
        body["tenant"] = "other"  # the body's tenant is not its subject's
    elif kind == 5:
        body["prompt_text"] = "both"  # two prompts
    elif kind == 6:
        body["submitted_unix_ms"] = rng.choice([-1, "now", -(2**62)])
    elif kind == 7:
        body["unknown_field"] = rng.random()
    elif kind == 8:
        body = {"request_id": rid, "nested": [[[[{"deep": 1}]]]] * 50}
    elif kind == 9:
        body["deadline_unix_ms"] = rng.choice([-10, "soon", 1.5])
    elif kind == 10:
        body["session_id"] = "s" * 200
    else:
        body.pop(rng.choice(["model", "request_id", "submitted_unix_ms"]))
    return msgpack.packb(body, use_bin_type=True)


def _garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
    if kind == 1:
        return b"\xc1" * rng.randrange(1, 16)  # never valid msgpack
    if kind == 2:
        return msgpack.packb([1, 2, 3])  # not a map
    if kind == 3:
        return msgpack.packb({"v": 99})
    if kind == 4:
        return b""
    return msgpack.packb({"x": "y" * rng.randrange(1000, 200_000)})  # big and wrong


def _hostile_control(rng: random.Random, subject_kind: str) -> bytes:
    """A message for a heartbeat, completion, work or query subject: garbage, or the right
    shape with forged or impossible values."""
    if rng.random() < 0.5:
        return _garbage(rng)
    now = int(time.time() * 1000)
    if subject_kind == "hb":
        return msgpack.packb(
            {
                "v": rng.choice([1, 1, 7]),
                "worker_id": rng.choice(["worker-0", "forged-1", "x" * 300, ""]),
                "models": rng.choice([["sim"], ["nope"], "sim", []]),
                "seq": rng.choice([0, -1, 2**63 - 1, 5]),
                "sent_unix_ms": now,
                "capacity": rng.choice([0, 10**9, -3, 4]),
                "in_flight": rng.choice([[], ["ghost-1"], ["bad id!"], None]),
                "load": rng.choice([{}, None, {"running": -1}]),
            }
        )
    if subject_kind == "done":
        return msgpack.packb(
            {
                "v": 1,
                "request_id": rng.choice(["ghost", "fz-1", "bad id!"]),
                "worker_id": rng.choice(["worker-0", "forged-2"]),
                "attempt": rng.choice([0, 1, 2**62, -1]),
                "ok": rng.choice([True, False, "yes"]),
                "prompt_tokens": rng.choice([-1, 10**12, 64]),
                "cached_tokens": 0,
                "output_tokens": 4,
                "prefill_s": rng.choice([-1.0, 1e300, 0.1]),
                "decode_s": 0.1,
            }
        )
    if subject_kind == "work":
        return msgpack.packb(
            {
                "v": 1,
                "request": rng.choice([{}, _valid_request("fz-work"), "req"]),
                "attempt": rng.choice([0, 1, -5]),
                "dispatcher_id": rng.choice(["", "forged-dispatcher"]),
                "queued_s": rng.choice([-1.0, 0.0, 1e308]),
            }
        )
    return msgpack.packb({"v": rng.choice([1, 3]), "model": "m" * rng.randrange(1, 300), "band": 5})


async def test_ten_thousand_hostile_messages_while_real_load_runs(nats_url: str) -> None:
    rng = random.Random(SEED)
    kw = cluster_kwargs(workers=2)
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url, tenant="fuzz") as c:
        js = c.nc.jetstream()
        rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        async def real_load() -> list[Any]:
            handles = [await c.submit("sim", PROMPT, max_tokens=8) for _ in range(60)]
            return [await h.result(timeout_s=120) for h in handles]

        load = asyncio.create_task(real_load())
        info = await js.stream_info(names.DEAD_LETTER_STREAM)
        letters_before = info.state.messages
        subject = names.request_subject("standard", "sim", "fuzz")
        with_id = [f"fz-{i}" for i in range(1500)]
        sent = 0
        for rid in with_id:  # named: each gets a typed rejection on its result subject
            await js.publish(
                subject, _hostile_request(rng, rid), headers={names.MSG_ID_HEADER: rid}
            )
            sent += 1
        for _ in range(500):  # nameless: each is dead-lettered
            await js.publish(subject, _garbage(rng))
            sent += 1
        targets = {
            "hb": [names.heartbeat_subject(w) for w in ("worker-0", "forged-1", "forged-2")],
            "done": [names.completion_subject(w) for w in ("worker-0", "worker-1", "forged-1")],
            "work": [names.work_subject(w) for w in ("worker-0", "worker-1")],
            "query": [names.STATS_SUBJECT, names.WAIT_SUBJECT, names.cancel_subject("default")],
            "ctl": [names.control_subject(w) for w in ("worker-0", "worker-1")],
        }
        inbox = c.nc.new_inbox()
        for i in range(8200):
            kind = rng.choice(list(targets))
            body = _hostile_control(rng, kind)
            await c.nc.publish(rng.choice(targets[kind]), body, reply=inbox)
            sent += 1
            if i % 500 == 0:
                await c.nc.flush()
        await c.nc.flush()
        assert sent >= 10_000

        results = await load
        assert len(results) == 60 and all(r.ok for r in results)  # real work went on

        async def answered(rid: str) -> bool:
            r = await c.fetch_result(rid)
            return r is not None and not r.ok and r.rejection is not None

        async def all_answered() -> bool:
            missing = [rid for rid in with_id if not await answered(rid)]
            if missing:
                unanswered[:] = missing
            return not missing

        unanswered: list[str] = []
        try:
            await eventually(all_answered, timeout_s=30, every_s=1.0)
        except AssertionError:
            raise AssertionError(f"{len(unanswered)} unanswered, e.g. {unanswered[:5]}") from None

        async def dead_lettered() -> bool:
            info = await js.stream_info(names.DEAD_LETTER_STREAM)
            return info.state.messages - letters_before >= 500

        await eventually(dead_lettered, timeout_s=30)

        # Still serving, and the books are the real fleet's again once forged leases expire.
        after = [await c.submit("sim", PROMPT, max_tokens=4) for _ in range(10)]
        assert all([(await h.result(timeout_s=60)).ok for h in after])
        stats = await c.stats()
        assert stats.workers >= 2

        async def books_clean() -> bool:
            workers = set(cluster.dispatcher.scheduler.workers())
            return workers == {"worker-0", "worker-1"} and cluster.dispatcher.held == 0

        await eventually(books_clean, timeout_s=30)
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / 1024
        assert grown_mb < 300, f"the processes grew by {grown_mb:.0f} MB"

"""A band's queue bound given as an acceptable wait: bound = admitted rate x wait, within
[queue_min_msgs, queue_max_msgs], recomputed as the rate changes and applied to the band's
stream (so the broker refuses the publish beyond it)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from sluice.client import Client
from sluice.common.errors import ConfigError
from sluice.dispatcher.feedback import wait_bound
from sluice.dispatcher.runtime import DispatcherSettings
from sluice.schemas import names
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs, eventually


def test_the_bound_is_the_rate_times_the_wait_within_its_limits() -> None:
    assert wait_bound(10.0, 0.5, 2, 1000) == 5
    assert wait_bound(10.1, 0.5, 2, 1000) == 6  # rounded up: never shorter than the wait
    assert wait_bound(0.5, 1.0, 2, 1000) == 2  # at least min_msgs
    assert wait_bound(1e6, 1.0, 2, 1000) == 1000  # at most max_msgs
    assert wait_bound(0.0, 1.0, 2, 1000) == 1000  # no rate known yet: the configured bound
    with pytest.raises(ValueError):
        wait_bound(1.0, 0.0, 2, 1000)


def test_wait_bounds_must_name_known_bands() -> None:
    with pytest.raises(ConfigError, match="unknown bands"):
        DispatcherSettings.load(None, queue_max_wait_s={"nope": 1.0})
    with pytest.raises(ConfigError, match="> 0"):
        DispatcherSettings.load(None, queue_max_wait_s={"batch": 0.0})


@pytest.mark.e2e
async def test_the_stream_bound_follows_the_admission_rate(nats_url: str) -> None:
    dispatcher = {
        "queue_max_wait_s": {"standard": 0.5},
        "queue_min_msgs": 2,
        "queue_max_msgs": 1000,
        "band_queue_max_msgs": {},
        "feedback_every_s": 0.2,
        "global_limit": 4,
    }
    kw = cluster_kwargs(workers=1, dispatcher=dispatcher, agent={"capacity": 4})
    async with LocalCluster(nats_url, **kw) as cluster, Client(nats_url) as c:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        stream = names.request_stream("standard")
        try:
            assert (await js.stream_info(stream)).config.max_msgs == 1000 + 4  # no rate yet
            handles = []
            for i in range(30):  # ~10 admissions per second for 3 s
                handles.append(await c.submit("sim", [i] * 32, max_tokens=2))
                await asyncio.sleep(0.1)

            async def resized() -> bool:
                bound = (await js.stream_info(stream)).config.max_msgs
                return bound is not None and bound < 100

            await eventually(resized, timeout_s=5)
            bound = (await js.stream_info(stream)).config.max_msgs
            assert bound is not None
            # ~10 per second x 0.5 s, within a factor 2 for the window's start-up.
            assert 2 + 4 <= bound <= 10 + 4, bound
            assert cluster.dispatcher.settings.queue_max_wait_s == {"standard": 0.5}
            for h in handles:
                assert (await h.result(timeout_s=10)).ok
            # The other bands keep their configured bound.
            assert (await js.stream_info(names.request_stream("batch"))).config.max_msgs == 1004
        finally:
            await nc.close()


@pytest.mark.e2e
async def test_lowering_a_bound_keeps_every_queued_request(nats_url: str) -> None:
    """What the sizing relies on: with discard=new, a band stream whose max_msgs is lowered
    below what it holds keeps every message (it only refuses new ones until it is under)."""
    from sluice.dispatcher.runtime.streams import band_stream
    from sluice.schemas.codec import encode
    from sluice.schemas.models import SubmitRequest

    s = DispatcherSettings(nats_url=nats_url, queue_max_msgs=20, global_limit=2)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await js.add_stream(band_stream(s, "batch"))
        for i in range(8):
            req = SubmitRequest(
                request_id=f"r{i}", model="m", band="batch", prompt_text="x", submitted_unix_ms=0
            )
            await js.publish(names.request_subject("batch", "m", "default"), encode(req))
        await js.update_stream(band_stream(s, "batch", queue_bound=1))  # max_msgs 1 + 2
        info = await js.stream_info(names.request_stream("batch"))
        assert info.config.max_msgs == 3 and info.state.messages == 8
        with pytest.raises(nats.js.errors.APIError) as refused:
            req = SubmitRequest(
                request_id="late", model="m", band="batch", prompt_text="x", submitted_unix_ms=0
            )
            await js.publish(names.request_subject("batch", "m", "default"), encode(req))
        assert refused.value.err_code == names.JS_ERR_MAX_MSGS
    finally:
        await nc.close()


def test_the_offline_backlog_is_its_own_bound() -> None:
    from sluice.dispatcher.runtime.streams import band_stream

    s = DispatcherSettings(queue_max_msgs=50, global_limit=4)
    assert s.queue_max_msgs_of("batch") == 100_000  # offline work stays durable for hours
    assert band_stream(s, "batch").max_msgs == 100_000 + 4
    assert band_stream(s, "interactive").max_msgs == 50 + 4  # online keeps its own bound
    s = DispatcherSettings(band_queue_max_msgs={"batch": 7, "standard": 9})
    assert band_stream(s, "standard").max_msgs == 9 + s.global_limit
    with pytest.raises(ValueError, match="unknown bands"):
        DispatcherSettings(band_queue_max_msgs={"nope": 3})
    with pytest.raises(ValueError, match=">= 1"):
        DispatcherSettings(band_queue_max_msgs={"batch": 0})

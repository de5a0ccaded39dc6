"""A worker that stalled past its lease comes back and finishes a request that was run again
elsewhere meanwhile: the first copy to finish wins, the other is stopped, the quota is
released once, and the producer has exactly one final result. Real nats-server, dispatcher
and agents; the returning worker's two messages (its stored result, then its completion, in
the order an agent sends them) are what a stalled agent sends when it resumes."""

from __future__ import annotations

import pytest

from sluice.client import Client
from sluice.schemas import names
from sluice.schemas.codec import encode
from sluice.schemas.models import Completion, Result
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs, eventually, store_result

pytestmark = pytest.mark.e2e


async def test_a_late_first_copy_wins_and_the_second_is_stopped(nats_url: str) -> None:
    async with (
        LocalCluster(nats_url, **cluster_kwargs(workers=1)) as cluster,
        Client(nats_url) as c,
    ):
        d, agent = cluster.dispatcher, cluster.agents[0]
        # Attempt 2 on worker-0, as after worker "stalled-0" lost its lease while running it.
        h = await c.submit("sim", list(range(2000, 2064)), max_tokens=60_000, request_id="r-1")

        async def running() -> bool:
            return "r-1" in agent._running and d.scheduler.booking("r-1") is not None

        await eventually(running)
        booking = d.scheduler.booking("r-1")
        assert booking is not None and booking.worker_id == "worker-0"
        js = c.nc.jetstream()
        # The stalled worker resumes: it stores its result, then reports its completion.
        first = Result(
            request_id="r-1", ok=True, model="sim", worker_id="stalled-0", attempt=0, text="hi"
        )
        await store_result(js, first)
        late = Completion(
            request_id="r-1",
            worker_id="stalled-0",
            attempt=1,
            ok=True,
            prompt_tokens=64,
            cached_tokens=0,
            output_tokens=2,
            prefill_s=0.01,
            decode_s=0.01,
        )
        await c.nc.request(names.completion_subject("stalled-0"), encode(late), timeout=5)

        result = await h.result(timeout_s=20)
        assert result.ok and result.worker_id == "stalled-0"  # the first to finish

        async def stopped() -> bool:  # the other copy stopped, its quota released once
            return (
                "r-1" not in agent._running
                and d.scheduler.running == 0
                and not any(d.scheduler.usage().values())
            )

        await eventually(stopped, timeout_s=10)
        stored = await c.fetch_result("r-1")
        assert stored is not None and stored.ok and stored.worker_id == "stalled-0"
        info = await js.stream_info(names.RESULT_STREAM, names.results_filter("default"))
        assert (info.state.subjects or {}) == {names.result_subject("default", "r-1"): 1}

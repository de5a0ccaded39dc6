"""Durable result subscriptions (``Client.results``): a group's (a batch's) or a tenant's
results, each delivered once across a producer restart and a broker restart. Real
nats-server, dispatcher and agents; in the broker test, results published into the real
results stream."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from nats.js import api

from sluice.client import Client
from sluice.dispatcher.runtime import DispatcherSettings
from sluice.dispatcher.runtime.streams import result_stream
from sluice.schemas import names
from sluice.schemas.codec import encode
from sluice.schemas.models import Result
from sluice.testing.cluster import LocalCluster
from sluice.testing.natsserver import EmbeddedNats

from .conftest import cluster_kwargs

pytestmark = pytest.mark.e2e

PROMPT = list(range(100, 164))


async def _take(sub: object, n: int) -> list[Result]:
    out: list[Result] = []
    async for r in sub:  # type: ignore[attr-defined]
        out.append(r)
        if len(out) == n:
            break
    return out


async def test_a_group_resumes_after_a_producer_restart_without_gaps_or_repeats(
    nats_url: str,
) -> None:
    ids = [f"g1:{i}" for i in range(30)]
    async with LocalCluster(nats_url, **cluster_kwargs()), Client(nats_url) as producer:
        handles = [await producer.submit("sim", PROMPT, max_tokens=2, request_id=r) for r in ids]
        others = [await producer.submit("sim", PROMPT, max_tokens=2) for _ in range(3)]
        others += [await producer.submit("sim", PROMPT, max_tokens=2, request_id="g2:0")]
        for h in [*handles, *others]:
            await h.result(timeout_s=30)
        # A consumer that stops after 12 (a clean close).
        async with Client(nats_url) as first, first.results(group="g1", ack_wait_s=2.0) as sub:
            taken = await _take(sub, 12)
        async with Client(nats_url) as dying:  # takes one more, then its process "dies"
            sub = dying.results(group="g1", ack_wait_s=2.0)
            lost = await _take(sub, 1)
            await dying.nc.close()  # no close of the subscription: that result is not acked
        async with (
            Client(nats_url) as second,
            second.results(
                group="g1",
                idle_timeout_s=4.0,
                ack_wait_s=2.0,  # past the dead one's ack wait
            ) as sub,
        ):
            rest = [r async for r in sub]
    got = [r.request_id for r in taken + rest]
    assert sorted(got) == sorted(ids) and len(got) == len(set(got))  # no gap, no repeat
    assert lost[0].request_id in {r.request_id for r in rest}  # taken, not acked: comes again
    assert all(r.ok for r in taken + rest)


async def test_a_tenant_subscription_follows_new_results_and_survives_a_broker_restart(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "store")
    broker = EmbeddedNats(store_dir=store).start()
    port = broker.port
    restarted: EmbeddedNats | None = None
    try:
        async with Client(broker.url, tenant="acme") as c:
            js = c.nc.jetstream()
            config = result_stream(DispatcherSettings(nats_url=broker.url))
            await js.add_stream(config)

            async def publish(rid: str, tenant: str = "acme") -> None:
                result = Result(request_id=rid, ok=True, tenant=tenant)
                await js.publish(
                    names.result_subject(tenant, rid),
                    encode(result),
                    headers={names.MSG_ID_HEADER: rid},
                )

            for i in range(5):
                await publish(f"r{i}")
            await publish("x0", tenant="other")  # another tenant's: never seen here
            async with c.results() as sub:
                seen = await _take(sub, 3)
                broker.kill()  # the broker dies (SIGKILL, store kept) while the consumer waits
                await asyncio.sleep(1.0)
                restarted = EmbeddedNats(store_dir=store, port=port).start()
                late = asyncio.create_task(_take(sub, 4))
                await asyncio.sleep(1.5)  # the connection comes back by itself
                for i in range(5, 7):
                    await publish(f"r{i}")
                seen += await asyncio.wait_for(late, 30)
            assert [r.request_id for r in seen] == [f"r{i}" for i in range(7)]
            await c.results().delete()
            info = await js.streams_info()
            assert any(s.config.name == names.RESULT_STREAM for s in info)
            consumers = await js.consumers_info(names.RESULT_STREAM)
            assert not [x for x in consumers if x.config.ack_policy == api.AckPolicy.EXPLICIT]
    finally:
        broker.stop()
        if restarted is not None:
            with contextlib.suppress(Exception):
                restarted.stop()

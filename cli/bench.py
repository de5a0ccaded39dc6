"""``sluice bench``: what the dispatcher itself costs, against baselines measured in the same run.

- ``core``: CPU per scheduling decision of the pure scheduler, in :mod:`sluice.cli.benchcore`.
- ``live``: on an idle cluster over a real nats-server, the dispatch latency a request sees
  (``queued_s``: submission until a worker accepted it) against the broker's own round trips
  measured in the same run: a JetStream publish acknowledgement and a core request/reply.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sluice.dispatcher.stats import percentile


@dataclass(frozen=True)
class LiveResult:
    requests: int
    dispatch_p50_ms: float
    dispatch_p99_ms: float
    js_publish_p50_ms: float
    request_reply_p50_ms: float


async def bench_live(requests: int = 300, nats_url: str | None = None) -> LiveResult:
    """Sequential requests on an idle 2-worker cluster; dispatch latency vs broker RTTs."""
    import nats

    from sluice.client import Client
    from sluice.testing.cluster import LocalCluster
    from sluice.testing.natsserver import EmbeddedNats

    server = None if nats_url else EmbeddedNats().start()
    url = nats_url or (server.url if server else "")
    try:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name="BENCH_RTT", subjects=["bench.rtt"])

        async def echo(msg: object) -> None:
            await msg.respond(b"")  # type: ignore[attr-defined]

        await nc.subscribe("bench.echo", cb=echo)
        pub_ms, rr_ms = [], []
        for _ in range(requests):
            t = time.perf_counter()
            await js.publish("bench.rtt", b"x" * 512)
            pub_ms.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            await nc.request("bench.echo", b"x", timeout=2)
            rr_ms.append((time.perf_counter() - t) * 1000)
        await js.delete_stream("BENCH_RTT")
        await nc.close()

        cluster = LocalCluster(
            url,
            workers=2,
            dispatcher={"models": ["sim"], "learn_s": 0.2, "tick_s": 0.05},
            agent={"speed": 100.0, "heartbeat_s": 0.5},
        )
        dispatch_ms = []
        async with cluster, Client(url) as client:
            await asyncio.sleep(0.5)
            prompt = list(range(256))
            for _ in range(requests):
                h = await client.submit("sim", prompt, max_tokens=1, band="interactive")
                r = await h.result(timeout_s=30)
                assert r.timings is not None
                dispatch_ms.append(r.timings.queued_s * 1000)
        return LiveResult(
            requests=requests,
            dispatch_p50_ms=percentile(dispatch_ms, 50),
            dispatch_p99_ms=percentile(dispatch_ms, 99),
            js_publish_p50_ms=percentile(pub_ms, 50),
            request_reply_p50_ms=percentile(rr_ms, 50),
        )
    finally:
        if server is not None:
            server.stop()

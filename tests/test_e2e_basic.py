"""The request path end to end over a real nats-server."""

from __future__ import annotations

import pytest

from sluice.client import Client
from sluice.testing.cluster import LocalCluster

pytestmark = pytest.mark.e2e


async def test_submit_streams_tokens_then_result(cluster: LocalCluster, client: Client) -> None:
    prompt = list(range(100, 180))
    handle = await client.submit("sim", prompt, max_tokens=40, band="interactive")
    chunks = [c async for c in handle]
    result = await handle.result(timeout_s=20)

    assert result.ok
    assert len(result.output_tokens) == 40
    streamed = [t for c in chunks for t in c.tokens]
    assert streamed == result.output_tokens
    assert len(chunks) >= 2, "tokens should be streamed in several chunks, not only at the end"
    assert result.worker_id in {a.worker_id for a in cluster.agents}
    assert result.prompt_tokens == 80
    t = result.timings
    assert t is not None
    assert 0 <= t.queued_s <= t.ttft_s <= t.e2e_s

"""Structured output (``Sampling.response_format``): what the simulated engine in the agent's
process does with it (``sluice engine`` makes the JSON: ``test_engine_server.py``, and through
the gateway ``test_http_engine.py``; the gateway's checks: ``test_gateway_units.py``)."""

from __future__ import annotations

import pytest

from sluice.client import Client, Rejected
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs

PROMPT = list(range(7000, 7064))


@pytest.mark.e2e
async def test_the_in_process_simulated_engine_refuses_structured_output(nats_url: str) -> None:
    """It cannot make JSON of a schema: each worker refuses the request (kept off the ones it
    failed on) and its rejection says why, rather than an answer that is no JSON."""
    async with LocalCluster(nats_url, **cluster_kwargs(workers=2)), Client(nats_url) as c:
        fmt = {"type": "json_object"}
        handle = await c.submit("sim", PROMPT, max_tokens=8, sampling={"response_format": fmt})
        with pytest.raises(Rejected) as rejected:
            await handle.result(timeout_s=30)
    message = str(rejected.value)
    assert "makes no structured output" in message and "worker-0, worker-1" in message

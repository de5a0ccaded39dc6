"""OpenAI's Files and Batches APIs on the gateway, with the official ``openai`` package
unchanged: a batch round trip (upload, create, poll, download the output and error files),
a tenant that cannot read another's batch or file, cancel, and a batch whose submitter died
with its gateway, resumed by the next one. Real nats-server, dispatcher, agents and gateway."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from sluice.client import Batches, Client
from sluice.gateway import ApiKey, GatewayServer, GatewaySettings
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "sk-batch-tenant-a", "sk-batch-tenant-b"


def _keys() -> list[ApiKey]:
    return [
        ApiKey(key_sha256=hashlib.sha256(KEY_A.encode()).hexdigest(), tenant="a"),
        ApiKey(key_sha256=hashlib.sha256(KEY_B.encode()).hexdigest(), tenant="b"),
    ]


def _jsonl(n: int, bad: tuple[int, ...] = ()) -> bytes:
    out = []
    for i in range(1, n + 1):
        if i in bad:
            out.append("{this is not json")
            continue
        out.append(
            json.dumps(
                {
                    "custom_id": f"q{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "sim",
                        "messages": [{"role": "user", "content": f"question {i}"}],
                        "max_tokens": 3,
                    },
                }
            )
        )
    return ("\n".join(out) + "\n").encode()


def _sdk(gw: GatewayServer, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)


async def _until_done(oa: AsyncOpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    async def poll() -> Any:
        while True:
            b = await oa.batches.retrieve(batch_id)
            if b.status in ("completed", "failed", "expired", "cancelled"):
                return b
            await asyncio.sleep(0.3)

    return await asyncio.wait_for(poll(), timeout_s)


async def test_a_batch_round_trip_through_the_openai_sdk(nats_url: str) -> None:
    settings = GatewaySettings(nats_url=nats_url, port=0, keys=_keys(), batch_sweep_every_s=0.5)
    async with LocalCluster(nats_url, **cluster_kwargs()), GatewayServer(settings) as gw:
        a, b = _sdk(gw, KEY_A), _sdk(gw, KEY_B)
        try:
            f = await a.files.create(
                file=("in.jsonl", io.BytesIO(_jsonl(30, (7, 19)))), purpose="batch"
            )
            assert f.object == "file" and f.purpose == "batch" and f.bytes > 0
            batch = await a.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert batch.object == "batch" and batch.input_file_id == f.id
            done = await _until_done(a, batch.id)
            assert done.status == "completed", done
            assert done.request_counts.total == 30 and done.request_counts.completed == 28
            assert done.request_counts.failed == 2
            out = (await a.files.content(done.output_file_id)).text.splitlines()
            err = (await a.files.content(done.error_file_id)).text.splitlines()
            assert [json.loads(x)["custom_id"] for x in out] == [
                f"q{i}" for i in range(1, 31) if i not in (7, 19)
            ]
            assert sorted(json.loads(x)["error"]["line"] for x in err) == [7, 19]
            first = json.loads(out[0])["response"]
            assert first["status_code"] == 200
            assert first["body"]["choices"][0]["message"]["role"] == "assistant"
            listed = await a.batches.list()
            assert [x.id for x in listed.data] == [batch.id]

            # Another tenant's key sees neither the batch nor its files.
            with pytest.raises(openai.NotFoundError):
                await b.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                await b.files.content(done.output_file_id)
            with pytest.raises(openai.NotFoundError):
                await b.batches.cancel(batch.id)
            assert (await b.batches.list()).data == []
            with pytest.raises(openai.BadRequestError):
                await a.batches.create(
                    input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
                )
            with pytest.raises(openai.APIStatusError) as ended:
                await a.batches.cancel(batch.id)  # it is completed
            assert ended.value.status_code == 409
        finally:
            await a.close()
            await b.close()


async def test_cancel_and_a_submitter_that_died_with_its_gateway(nats_url: str) -> None:
    """No workers: requests wait queued. A batch created through one gateway whose submitter
    never finished (as if that gateway died mid-submit) is resumed by the next gateway's sweep;
    a cancelled batch ends ``cancelled`` with every line in its error file."""
    settings = GatewaySettings(nats_url=nats_url, port=0, keys=_keys(), batch_sweep_every_s=0.3)
    async with LocalCluster(nats_url, **cluster_kwargs(workers=0)):
        async with Client(nats_url, tenant="a") as c:
            mine = Batches(c)
            f = await mine.upload(_jsonl(10), "in.jsonl")
            orphan = await mine.create(f.id)  # created, never submitted: its submitter "died"
        async with GatewayServer(settings) as gw:
            a = _sdk(gw, KEY_A)
            try:

                async def resumed() -> bool:
                    async with Client(nats_url, tenant="a") as c:
                        return (await Batches(c).get(orphan.id)).submitter_done

                for _ in range(100):
                    if await resumed():
                        break
                    await asyncio.sleep(0.1)
                assert await resumed()
                cancelled = await a.batches.cancel(orphan.id)
                assert cancelled.status in ("cancelling", "cancelled")
                done = await _until_done(a, orphan.id)
                assert done.status == "cancelled"
                err = (await a.files.content(done.error_file_id)).text.splitlines()
                assert len(err) == 10
            finally:
                await a.close()


async def test_a_malformed_upload_is_a_400_in_openai_shape(nats_url: str) -> None:
    import httpx

    settings = GatewaySettings(nats_url=nats_url, port=0, keys=_keys())
    async with LocalCluster(nats_url, **cluster_kwargs(workers=0)), GatewayServer(settings) as gw:
        headers = {"authorization": f"Bearer {KEY_A}"}
        async with httpx.AsyncClient(base_url=gw.url, headers=headers, timeout=30) as h:
            broken = await h.post(
                "/v1/files",
                content=b"--xyz\r\nthis is not a part",
                headers={"content-type": "multipart/form-data; boundary=xyz"},
            )
            no_file = await h.post("/v1/files", data={"purpose": "batch"})
    for r in (broken, no_file):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


async def test_odd_ids_are_404s_and_bad_create_fields_400s(nats_url: str) -> None:
    """An id no record can have (its key would escape bytes with "~", which KV keys refuse)
    is a 404 like any unknown id, not a 503; a create whose endpoint or window has the wrong
    type is a 400, not a 500 or a window of 24 seconds. Mutations: Batches._read without
    InvalidKeyError (503s); create() without its type checks (a 500, a 200)."""
    import httpx

    settings = GatewaySettings(nats_url=nats_url, port=0, keys=_keys())
    async with LocalCluster(nats_url, **cluster_kwargs(workers=0)), GatewayServer(settings) as gw:
        headers = {"authorization": f"Bearer {KEY_A}"}
        async with httpx.AsyncClient(base_url=gw.url, headers=headers, timeout=30) as h:
            missing = [
                await h.get("/v1/files/a%20b"),
                await h.get("/v1/files/%E6%97%A5"),
                await h.get("/v1/batches/a.b*>"),
                await h.post("/v1/batches", json={"input_file_id": "a.b"}),
            ]
            up = await h.post(
                "/v1/files",
                files={"file": ("in.jsonl", b'{"model": "sim", "prompt": "hi"}\n')},
                data={"purpose": "batch"},
            )
            fid = up.json()["id"]
            bad = [
                await h.post("/v1/batches", json={"input_file_id": fid, "endpoint": ["x"]}),
                await h.post("/v1/batches", json={"input_file_id": fid, "completion_window": 24}),
            ]
    for r in missing:
        assert r.status_code == 404, (r.status_code, r.text)
    for r, param in zip(bad, ["endpoint", "completion_window"], strict=True):
        assert r.status_code == 400, (r.status_code, r.text)
        assert r.json()["error"]["param"] == param

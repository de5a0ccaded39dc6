"""Broker roles (``sluice auth init``) against a real nats-server started with the config it
writes: each role can do its part of a full flow (a producer submits through a dispatcher and
agents that run as their own users, and reads its result, its token stream, its durable
result subscription), and every forbidden action is refused by the server itself. TLS with a
certificate made here."""

from __future__ import annotations

import asyncio
import datetime
import io
import ipaddress
import json
import shlex
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from openai import AsyncOpenAI
from typer.testing import CliRunner

from sluice.cli.app import app
from sluice.client import Cancelled, Client, ClientSettings, DispatcherLeading, ServiceUnavailable
from sluice.client.renewed import renewed_copies, return_renewed
from sluice.common.brokerroles import ack_subjects, inbox_prefix, js_api
from sluice.common.transport import BrokerAuth, TransportError, connect
from sluice.gateway import ApiKey, GatewayServer, GatewaySettings
from sluice.schemas import names
from sluice.schemas.codec import decode, encode
from sluice.schemas.models import CancelReply, CancelRequest
from sluice.testing.cluster import LocalCluster
from sluice.testing.natsserver import EmbeddedNats

from .conftest import cluster_kwargs

pytestmark = pytest.mark.e2e

TENANTS = ("acme", "beta")
WORKERS = ("worker-0", "worker-1")
BCRYPT_COST = "4"
"""bcrypt's cheapest: the server checks a hash on every connect, the tests connect often."""
REFUSAL_WAIT_S = 0.2
"""The server answers a refused publish or subscription with -ERR before the PONG of the flush
that follows it, so the refusal is in by then: this is only a margin."""


def _auth_init(out: Path, *extra: str, in_process: bool = False) -> None:
    """Run the real command, ``sluice auth init``, as a process (or in this one: faster)."""
    args = ["auth", "init", "--out", str(out), "--bcrypt-cost", BCRYPT_COST]
    for t in TENANTS:
        args += ["--tenant", t]
    for w in WORKERS:
        args += ["--worker", w]
    if in_process:
        ran = CliRunner().invoke(app, [*args, *extra])
        assert ran.exit_code == 0, ran.output
    else:
        cmd = [sys.executable, "-m", "sluice.cli", *args, *extra]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    (out / "server.conf").write_text("include auth.conf\n")


def _env(out: Path, user: str) -> dict[str, str]:
    """The variables of one user's env file, as a shell would read them."""
    env: dict[str, str] = {}
    for line in (out / "users" / f"{user}.env").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = shlex.split(value)[0] if value else ""
    return env


def _settings(env: dict[str, str]) -> dict[str, Any]:
    """The settings a process takes from those variables (as keyword arguments)."""
    fields = {"SLUICE_NATS_USER": "nats_user", "SLUICE_NATS_PASSWORD": "nats_password"}
    fields |= {"SLUICE_NATS_INBOX_PREFIX": "nats_inbox_prefix", "SLUICE_NATS_TLS_CA": "nats_tls_ca"}
    return {fields[k]: v for k, v in env.items() if k in fields}


def _auth(env: dict[str, str]) -> BrokerAuth:
    return ClientSettings(**_settings(env)).broker_auth()


@dataclass
class Layout:
    out: Path
    url: str

    def env(self, user: str) -> dict[str, str]:
        return _env(self.out, user)


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    out = tmp_path_factory.mktemp("roles")
    _auth_init(out)
    with EmbeddedNats(config_file=out / "server.conf") as server:
        yield Layout(out, server.url)


@pytest.fixture
async def fleet(layout: Layout) -> AsyncIterator[LocalCluster]:
    """A dispatcher and two agents, each connected as its own user."""
    kw = cluster_kwargs(dispatcher=_settings(layout.env("dispatcher")))
    kw["agent_for"] = lambda w: _settings(layout.env(f"agent-{w}"))
    async with LocalCluster(layout.url, **kw) as cluster:
        yield cluster


@dataclass
class Probe:
    """A raw connection as one user that records what the server refuses."""

    nc: NATS
    errors: list[str] = field(default_factory=list)

    async def refused(self, subject: str, *, subscribe: bool = False) -> bool:
        """Whether the server said this publish (or subscription) to ``subject`` violates
        the user's permissions."""
        what = "subscription" if subscribe else "publish"
        needle = f'permissions violation for {what} to "{subject}"'.lower()
        await self.nc.flush()
        loop = asyncio.get_running_loop()
        end = loop.time() + REFUSAL_WAIT_S
        while loop.time() < end:
            if any(needle in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False

    async def publish_refused(self, subject: str, data: bytes = b"x") -> bool:
        await self.nc.publish(subject, data)
        return await self.refused(subject)

    async def subscribe_refused(self, subject: str) -> bool:
        await self.nc.subscribe(subject)
        return await self.refused(subject, subscribe=True)


@pytest.fixture
async def probe(layout: Layout) -> AsyncIterator[Any]:
    made: list[NATS] = []

    async def open_as(user: str) -> Probe:
        env = layout.env(user)
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(
            layout.url,
            user=env["SLUICE_NATS_USER"],
            password=env["SLUICE_NATS_PASSWORD"],
            inbox_prefix=env["SLUICE_NATS_INBOX_PREFIX"],
            error_cb=on_error,
            allow_reconnect=False,
        )
        made.append(nc)
        return Probe(nc, errors)

    yield open_as
    for nc in made:
        await nc.close()


def _producer(layout: Layout, tenant: str) -> Client:
    """A producer as ``Client.from_settings`` makes it from its env file."""
    env = layout.env(f"producer-{tenant}")
    settings = ClientSettings(
        nats_url=layout.url,
        tenant=env["SLUICE_CLIENT_TENANT"],
        publish_timeout_s=1.0,
        publish_retry_s=0,
        **_settings(env),
    )
    return Client.from_settings(settings)


async def test_a_producer_submits_and_reads_only_its_own(
    layout: Layout, fleet: LocalCluster, probe: Any, caplog: pytest.LogCaptureFixture
) -> None:
    live: list[str] = []  # its tenant's token stream, as the broker delivers it

    async def on_chunk(msg: Msg) -> None:
        live.append(msg.subject)

    tap: Probe = await probe("producer-acme")
    await tap.nc.subscribe(names.tokens_filter("acme"), cb=on_chunk)
    async with _producer(layout, "acme") as acme:
        handle = await acme.submit("sim", "hello there", max_tokens=5, request_id="acme-1")
        chunks = [c async for c in handle]
        result = await handle.result(timeout_s=20)
        assert result.ok and result.tenant == "acme"
        assert [t for c in chunks for t in c.tokens] == result.output_tokens
        assert len(result.output_tokens) == 5
        assert names.token_subject("acme", "acme-1") in live and not tap.errors
        stored = await acme.fetch_result("acme-1")
        assert stored is not None and stored.request_id == "acme-1"
        async with acme.results(idle_timeout_s=5) as sub:  # its tenant's durable subscription
            assert (await anext(sub)).request_id == "acme-1"
        estimate = await acme.estimate_wait("sim")
        assert estimate.model == "sim"
        assert (await acme.cancel("acme-1")).status in ("finished", "unknown")

        # Submitting as another tenant through the library: refused, the publish is never
        # confirmed, and the library says so.
        with pytest.raises(ServiceUnavailable):
            await acme.submit("sim", "as beta", tenant="beta", max_tokens=2)
    # The server refused that submit's publish and subscriptions, and nothing that the
    # dispatcher, the agents or the producer needed for the rest (each would be logged).
    logged = caplog.get_records("setup") + caplog.records  # the fleet started in the setup
    refused = [r.getMessage() for r in logged if r.name == "sluice.transport"]
    publish = names.request_subject("standard", "sim", "beta")
    beta = (publish, names.tokens_filter("beta")[:-1], names.results_filter("beta")[:-1])
    assert all(any(b in m for b in beta) for m in refused), refused
    assert any(publish in m for m in refused), refused


async def test_a_producer_cannot_act_for_another_tenant_or_a_worker(
    layout: Layout, fleet: LocalCluster, probe: Any
) -> None:
    p: Probe = await probe("producer-acme")
    beta_consumer = names.results_consumer("beta", None)
    rs = names.RESULT_STREAM
    # The request subjects of another tenant, work and control subjects, worker reports.
    assert await p.publish_refused(names.request_subject("standard", "sim", "beta"))
    assert await p.publish_refused(names.work_subject("worker-0"))
    assert await p.publish_refused(names.control_subject("worker-0"))
    assert await p.publish_refused(names.heartbeat_subject("worker-0"))
    assert await p.publish_refused(names.completion_subject("worker-0"))
    assert await p.publish_refused(names.cancel_subject("beta"))
    assert await p.publish_refused(names.STATS_SUBJECT)
    # Acking a request message (only the dispatcher may).
    band = names.request_stream("standard")
    req_ack = f"$JS.ACK.{band}.{names.dispatcher_consumer('standard')}.1.1.1.1.0"
    assert await p.publish_refused(req_ack)
    # Another tenant's results and token streams, and another user's replies.
    assert await p.subscribe_refused(names.results_filter("beta"))
    assert await p.subscribe_refused(names.tokens_filter("beta"))
    assert await p.subscribe_refused(names.RESULT_SUBJECTS)
    assert await p.subscribe_refused(f"{inbox_prefix('producer-beta')}.>")
    assert await p.subscribe_refused(names.work_subject("worker-0"))
    # Another tenant's stored results and durable subscription, the leader and config KV.
    assert await p.publish_refused(js_api("DIRECT", "GET", rs, names.results_filter("beta")))
    assert await p.publish_refused(
        js_api("CONSUMER", "CREATE", rs, beta_consumer, names.results_filter("beta"))
    )
    own = names.results_consumer("acme", None)
    assert await p.publish_refused(
        js_api("CONSUMER", "CREATE", rs, own, names.results_filter("beta"))
    )
    assert await p.publish_refused(js_api("CONSUMER", "MSG", "NEXT", rs, beta_consumer))
    assert await p.publish_refused(ack_subjects(rs, beta_consumer).replace(">", "1.1.1.1.0"))
    leader = names.kv_stream(names.LEADER_BUCKET)
    assert await p.publish_refused(js_api("STREAM", "INFO", leader))
    assert await p.publish_refused(
        js_api("DIRECT", "GET", leader, f"$KV.{names.LEADER_BUCKET}.{names.LEADER_KEY}")
    )
    assert await p.publish_refused(f"$KV.{names.CONFIG_BUCKET}.{names.ADMISSION_KEY}")
    assert await p.publish_refused(js_api("STREAM", "DELETE", rs))
    # What it may do draws no refusal.
    assert not await p.publish_refused(names.WAIT_SUBJECT, b"")


async def test_a_cancel_body_of_another_tenant_is_refused_by_the_dispatcher(
    layout: Layout, fleet: LocalCluster, probe: Any
) -> None:
    async with _producer(layout, "beta") as beta:
        handle = await beta.submit("sim", "a long answer", max_tokens=20_000, request_id="beta-1")
        await anext(aiter(handle))  # it runs
        # acme may publish on its own cancel subject only; a body naming beta's request there
        # is refused by the dispatcher, and beta's request runs on.
        p: Probe = await probe("producer-acme")
        body = encode(CancelRequest(request_id="beta-1", tenant="beta"))
        msg = await p.nc.request(names.cancel_subject("acme"), body, timeout=5)
        reply = decode(msg.data, CancelReply)
        assert reply.status == "unknown" and "own subject" in (reply.message or "")
        assert (await beta.cancel("beta-1")).status == "cancelled"  # its own tenant may
        with pytest.raises(Cancelled):
            await handle.result(timeout_s=10)


async def test_an_agent_acts_only_as_itself(
    layout: Layout, fleet: LocalCluster, probe: Any
) -> None:
    a: Probe = await probe("agent-worker-0")
    other = "worker-1"
    assert await a.publish_refused(names.heartbeat_subject(other))
    assert await a.publish_refused(names.completion_subject(other))
    assert await a.subscribe_refused(names.work_subject(other))
    assert await a.subscribe_refused(names.control_subject(other))
    assert await a.subscribe_refused(names.HEARTBEAT_SUBJECTS)
    assert await a.subscribe_refused(names.RESULT_SUBJECTS)
    assert await a.subscribe_refused(names.tokens_filter("acme"))
    assert await a.publish_refused(names.request_subject("standard", "sim", "acme"))
    band = names.request_stream("standard")
    assert await a.publish_refused(f"$JS.ACK.{band}.{names.dispatcher_consumer('standard')}.1")
    assert await a.publish_refused(js_api("STREAM", "INFO", band))
    assert not await a.publish_refused(names.heartbeat_subject("worker-0"), b"")


async def test_no_one_but_the_dispatcher_acks_a_request(
    layout: Layout, fleet: LocalCluster, probe: Any
) -> None:
    renewed = f"$JS.ACK.{names.RENEWED_STREAM}.{names.RENEWED_CONSUMER}.1.9.9.1.0"
    copy = names.renewed_subject("standard", "sim", "acme", "forged")
    for band in names.DEFAULT_BANDS:
        ack = f"$JS.ACK.{names.request_stream(band)}.{names.dispatcher_consumer(band)}.1.9.9.1.0"
        for user in ("gateway", "operator", "producer-beta", "agent-worker-1"):
            p: Probe = await probe(user)
            assert await p.publish_refused(ack), (user, band)
            assert await p.publish_refused(renewed), user  # (a renewed copy's ack)
            assert await p.publish_refused(copy), user  # only dispatchers renew
        d: Probe = await probe("dispatcher")
        assert not await d.publish_refused(ack)
    # The operator may not pose as a worker or assign work either, nor ack an advisory the
    # leader has yet to answer; it may run its commands.
    op: Probe = await probe("operator")
    advisory_ack = f"$JS.ACK.{names.ADVISORY_STREAM}.{names.ADVISORY_CONSUMER}.1.9.9.1.0"
    assert await op.publish_refused(advisory_ack)
    assert await op.publish_refused(names.heartbeat_subject("worker-0"))
    assert await op.publish_refused(names.work_subject("worker-0"))
    assert await op.publish_refused(names.result_subject("acme", "forged"))
    async with Client(layout.url, auth=_auth(layout.env("operator"))) as ops:
        assert {w.worker_id for w in (await ops.workers()).workers} == set(WORKERS)
        # `sluice renewed`: the renewed stream and the leader key read as the operator.
        assert (await renewed_copies(ops.nc)).copies == 0
        with pytest.raises(DispatcherLeading):
            await return_renewed(ops.nc)


async def test_inbox_prefix_and_credentials_are_required(layout: Layout) -> None:
    env = layout.env("producer-acme")
    with pytest.raises(TransportError):
        await connect(layout.url, "anonymous", connect_timeout_s=0.5)
    wrong = BrokerAuth(user=env["SLUICE_NATS_USER"], password="not-it")
    with pytest.raises(TransportError):
        await connect(layout.url, "wrong", connect_timeout_s=0.5, auth=wrong)
    # Without its own inbox prefix a producer hears no reply: its request times out.
    plain = BrokerAuth(user=env["SLUICE_NATS_USER"], password=env["SLUICE_NATS_PASSWORD"])
    nc = await connect(layout.url, "no-prefix", auth=plain)
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(names.WAIT_SUBJECT, b"", timeout=1)
    finally:
        await nc.close()


async def test_the_gateway_serves_chat_and_batches_as_its_role(
    layout: Layout, fleet: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    key = "sk-roles-acme"
    settings = GatewaySettings(
        nats_url=layout.url,
        port=0,
        keys=[ApiKey(key=key, tenant="acme")],
        batch_sweep_every_s=0.5,
        **_settings(layout.env("gateway")),
    )
    line = {
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    }
    data = "".join(json.dumps({"custom_id": f"q{i}", **line}) + "\n" for i in range(3))
    async with GatewayServer(settings) as gw:
        oa = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)
        try:
            chat = await oa.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hello"}], max_tokens=3
            )
            assert chat.usage is not None and chat.usage.completion_tokens == 3
            streamed = await oa.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
            )
            assert [c async for c in streamed]
            f = await oa.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch")
            batch = await oa.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            for _ in range(200):
                batch = await oa.batches.retrieve(batch.id)
                if batch.status in ("completed", "failed", "expired", "cancelled"):
                    break
                await asyncio.sleep(0.1)
            assert batch.status == "completed" and batch.output_file_id is not None
            out = (await oa.files.content(batch.output_file_id)).text.splitlines()
            assert sorted(json.loads(x)["custom_id"] for x in out) == ["q0", "q1", "q2"]
        finally:
            await oa.close()
    logged = caplog.get_records("setup") + caplog.records
    assert not [r.getMessage() for r in logged if r.name == "sluice.transport"]


def test_auth_init_again_adds_users_and_rotates_only_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "nats"
    _auth_init(out, in_process=True)
    before = {u: _env(out, u)["SLUICE_NATS_PASSWORD"] for u in ("dispatcher", "producer-acme")}
    again = CliRunner().invoke(app, ["auth", "init", "--out", str(out)])
    assert again.exit_code == 2 and "--force" in again.output  # it never overwrites silently
    _auth_init(out, "--tenant", "gamma", "--force", in_process=True)
    assert {u: _env(out, u)["SLUICE_NATS_PASSWORD"] for u in before} == before
    assert _env(out, "producer-gamma")["SLUICE_CLIENT_TENANT"] == "gamma"
    assert '"producer-gamma"' in (out / "auth.conf").read_text()
    _auth_init(out, "--force", "--rotate", in_process=True)
    rotated = {u: _env(out, u)["SLUICE_NATS_PASSWORD"] for u in before}
    assert all(rotated[u] != before[u] for u in before)
    assert all(p.stat().st_mode & 0o077 == 0 for p in [out / "auth.conf", *out.glob("users/*")])


# --- TLS -------------------------------------------------------------------------------------


def _cert_pair(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 signed by it."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sluice test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    ca_path, cert_path, key_path = folder / "ca.pem", folder / "server.pem", folder / "key.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_path, cert_path, key_path


async def test_tls_with_a_certificate_made_here(tmp_path: Path) -> None:
    ca, cert, key = _cert_pair(tmp_path / "tls")
    other_ca, _, _ = _cert_pair(tmp_path / "other")
    out = tmp_path / "nats"
    _auth_init(out, "--tls", "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca))
    assert "tls {" in (out / "auth.conf").read_text()
    env = _env(out, "producer-acme")
    assert env["SLUICE_NATS_TLS_CA"] == str(ca.resolve())
    with EmbeddedNats(config_file=out / "server.conf") as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            info = raw.makefile("rb").readline()  # INFO {...}: what any client is told first
        assert json.loads(info.split(b" ", 1)[1])["tls_required"] is True
        nc = await connect(server.url, "tls", auth=_auth(env))
        try:
            assert nc.connected_server_version.major >= 2
            await nc.publish(names.WAIT_SUBJECT, b"")
            await nc.flush()
        finally:
            await nc.close()
        plain = BrokerAuth(user=env["SLUICE_NATS_USER"], password=env["SLUICE_NATS_PASSWORD"])
        with pytest.raises(TransportError):  # the system's trust store knows no test CA
            await connect(server.url, "plain", connect_timeout_s=0.5, auth=plain)
        forged = BrokerAuth(user=plain.user, password=plain.password, tls_ca_file=str(other_ca))
        with pytest.raises(TransportError):  # a server the CA did not sign is not trusted
            await connect(server.url, "other-ca", connect_timeout_s=0.5, auth=forged)
    # A server that does not start TLS (or a man in the middle posing as one) gets no
    # plain-text connection from a process told to use TLS: nats-py alone would go on in
    # plain text. Mutation: connect() without its check (both connected).
    with EmbeddedNats() as server:
        tls_url = server.url.replace("nats://", "tls://")
        with pytest.raises(TransportError, match="did not start TLS"):
            await connect(tls_url, "downgraded", connect_timeout_s=0.5)
        with pytest.raises(TransportError, match="did not start TLS"):
            await connect(server.url, "downgraded", auth=BrokerAuth(tls_ca_file=str(ca)))


def test_a_creds_file_that_cannot_be_read_is_an_error_at_start(tmp_path: Path) -> None:
    """nats-py reads a .creds file only when a server asks for a signature: a missing one
    passed a plain server silently. Mutation: BrokerAuth.options() without the check."""
    with pytest.raises(TransportError, match=r"cannot read the \.creds file"):
        BrokerAuth(creds_file=str(tmp_path / "missing.creds")).options()
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert BrokerAuth(creds_file=str(creds)).options()["user_credentials"] == str(creds)


def test_nats_py_can_sign_with_a_creds_file() -> None:
    """nats-py signs a server's nonce with nkeys, which it does not install itself: without
    it a .creds file (SLUICE_NATS_CREDS) failed at connect with ModuleNotFoundError."""
    import nkeys  # type: ignore[import-untyped]

    assert callable(nkeys.from_seed)


def test_a_commands_import_error_is_not_taken_for_a_missing_uvloop() -> None:
    """console.run ran the coroutine again on asyncio when it raised ImportError (a missing
    optional module of the command's own): "cannot reuse already awaited coroutine"."""
    from sluice.cli.console import run

    async def needs_a_module() -> None:
        raise ModuleNotFoundError("No module named 'something'")

    with pytest.raises(ModuleNotFoundError, match="something"):
        run(needs_a_module())

"""Broker roles: what each kind of Sluice process may publish and subscribe to on NATS.

Every permission is derived from :mod:`sluice.schemas.names` (and from NATS's own JetStream
subjects, spelled once below), so the lists stay true when a subject changes. One user per
process identity, all in one account (JetStream streams are per account):

- **producer** (one per tenant): publishes requests of its tenant only
  (``sluice.req.*.*.<tenant>``), cancels its tenant's requests, asks for wait estimates, reads
  its tenant's results and token streams only, looks up a stored result of its tenant, and
  follows its tenant's durable result subscription (the default one:
  :func:`~sluice.schemas.names.results_consumer` of the tenant). Named or per-group
  subscriptions, offline batches and files are not a producer's: a consumer name is one
  token that a permission cannot scope by tenant, and the batch stores are shared by every
  tenant (their records carry the tenant, their keys do not). Those go through the gateway.
- **agent** (one per worker): receives its own work and control subjects, answers them,
  heartbeats and reports completions as itself, publishes token chunks and results (of any
  tenant: it serves them all) and hears the leader's announcements.
- **dispatcher**: everything; it owns the streams, consumers and buckets, and it is the only
  role that may ack a request message.
- **gateway**: a producer for every tenant (its API keys map callers to tenants), with the
  batch stores and any consumer on the results stream; it acks no request.
- **operator** (``sluice`` commands: stats, workers, drain, reconcile, quota, cancel, batch):
  everything except what only the dispatcher or a worker may do: it acks no request (nor a
  stored max-deliveries advisory), assigns no work, and heartbeats, completes or publishes
  results as no worker.

Each user also gets its own reply-inbox prefix (:func:`inbox_prefix`) and may subscribe under
no other, so no user reads another's replies (published acks, looked-up results, answers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from sluice.schemas import names
from sluice.schemas.names import kv_key_subject, kv_stream

Role = Literal["producer", "agent", "dispatcher", "gateway", "operator"]

ALL = ">"
"""Every subject."""

# NATS's own subjects (JetStream API, acks, flow control, KV and object stores).
_JS_API = "$JS.API"
_JS_ACK = "$JS.ACK"
_JS_FC = "$JS.FC"


def kv_subjects(bucket: str) -> str:
    """The subjects of a KV bucket's keys."""
    return kv_key_subject(bucket, ">")


def object_stream(bucket: str) -> str:
    """The stream behind a JetStream object store."""
    return f"OBJ_{bucket}"


def object_subjects(bucket: str) -> str:
    """The subjects of an object store's chunks and metadata."""
    return f"$O.{bucket}.>"


def js_api(*tokens: str) -> str:
    """A JetStream API subject: ``$JS.API.<tokens>``."""
    return ".".join((_JS_API, *tokens))


def ack_subjects(stream: str, consumer: str = "*") -> str:
    """Acks (and naks, in-progress, terms) of one consumer's messages, or of every
    consumer's (``*``), on ``stream``."""
    return f"{_JS_ACK}.{stream}.{consumer}.>"


def inbox_prefix(user: str) -> str:
    """The reply-inbox prefix of a user (its name, a subject token): ``_INBOX_<user>``, a
    first token of its own, so no other user's inbox pattern matches it."""
    return f"_INBOX_{user}"


@dataclass(frozen=True)
class Permissions:
    """A NATS user's permissions: subjects it may publish and subscribe to, those it may not
    (a deny wins over an allow), and whether it may answer requests sent to it."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    allow_responses: bool = False


@dataclass(frozen=True)
class BrokerUser:
    """One identity on the broker: its user name, role, inbox prefix, permissions and the
    settings a process running as it needs besides its password (``SLUICE_…`` variables)."""

    name: str
    role: Role
    permissions: Permissions
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.name)


def _own_inbox(user: str) -> str:
    return f"{inbox_prefix(user)}.>"


def _read_only_stream(stream: str) -> tuple[str, ...]:
    """What a client that reads ``stream`` through any consumer of its own needs."""
    return (
        js_api("STREAM", "INFO", stream),
        js_api("DIRECT", "GET", stream),
        js_api("DIRECT", "GET", stream, ALL),
        js_api("STREAM", "MSG", "GET", stream),
        js_api("CONSUMER", "CREATE", stream),
        js_api("CONSUMER", "CREATE", stream, ALL),
        js_api("CONSUMER", "INFO", stream, "*"),
        js_api("CONSUMER", "DELETE", stream, "*"),
        js_api("CONSUMER", "MSG", "NEXT", stream, "*"),
        ack_subjects(stream),
        f"{_JS_FC}.{stream}.>",
    )


def _store(stream: str) -> tuple[str, ...]:
    """What a client that creates, writes and purges a KV bucket or object store needs."""
    return (
        *_read_only_stream(stream),
        js_api("STREAM", "CREATE", stream),
        js_api("STREAM", "UPDATE", stream),
        js_api("STREAM", "PURGE", stream),
        js_api("STREAM", "MSG", "DELETE", stream),
    )


def producer(tenant: str) -> BrokerUser:
    """A producer of one tenant (see the module docstring for what it may do)."""
    user = f"producer-{names.subject_token(tenant)}"
    consumer = names.results_consumer(tenant, None)
    results = names.results_filter(tenant)
    rs = names.RESULT_STREAM
    return BrokerUser(
        name=user,
        role="producer",
        permissions=Permissions(
            publish=(
                names.tenant_requests_filter(tenant),
                names.cancel_subject(tenant),
                names.WAIT_SUBJECT,
                js_api("STREAM", "NAMES"),  # which stream takes a subject (no dispatcher yet?)
                js_api("DIRECT", "GET", rs, results),  # Client.fetch_result
                js_api("CONSUMER", "CREATE", rs, consumer, results),  # Client.results()
                js_api("CONSUMER", "INFO", rs, consumer),
                js_api("CONSUMER", "DELETE", rs, consumer),
                js_api("CONSUMER", "MSG", "NEXT", rs, consumer),
                ack_subjects(rs, consumer),
            ),
            subscribe=(results, names.tokens_filter(tenant), _own_inbox(user)),
        ),
        settings={"SLUICE_CLIENT_TENANT": tenant},
    )


def agent(worker_id: str) -> BrokerUser:
    """The agent of one worker (see the module docstring)."""
    user = f"agent-{names.subject_token(worker_id)}"
    return BrokerUser(
        name=user,
        role="agent",
        permissions=Permissions(
            publish=(
                names.heartbeat_subject(worker_id),
                names.completion_subject(worker_id),
                names.TOKEN_SUBJECTS,
                names.RESULT_SUBJECTS,
            ),
            subscribe=(
                names.work_subject(worker_id),
                names.control_subject(worker_id),
                names.drain_subject(worker_id),
                names.remove_subject(worker_id),
                names.LEADER_SUBJECT,
                _own_inbox(user),
            ),
            allow_responses=True,  # it confirms assignments, stops and drains
        ),
        settings={"SLUICE_AGENT_WORKER_ID": worker_id},
    )


def dispatcher(name: str = "dispatcher") -> BrokerUser:
    """The dispatchers (they may share this user: one leads at a time)."""
    return BrokerUser(
        name=name,
        role="dispatcher",
        permissions=Permissions(publish=(ALL,), subscribe=(ALL,)),
    )


def gateway(name: str = "gateway") -> BrokerUser:
    """The OpenAI-compatible gateway: a producer of every tenant, with offline batches."""
    rs = names.RESULT_STREAM
    return BrokerUser(
        name=name,
        role="gateway",
        permissions=Permissions(
            publish=(
                names.REQUEST_SUBJECTS,
                names.CANCEL_SUBJECTS,
                names.WAIT_SUBJECT,
                names.STATS_SUBJECT,  # the model catalog
                js_api("INFO"),
                js_api("STREAM", "NAMES"),
                *_read_only_stream(rs),
                *_store(kv_stream(names.BATCH_BUCKET)),
                *_store(object_stream(names.FILE_STORE)),
                kv_subjects(names.BATCH_BUCKET),
                object_subjects(names.FILE_STORE),
            ),
            subscribe=(
                names.RESULT_SUBJECTS,
                names.TOKEN_SUBJECTS,
                _own_inbox(name),
            ),
        ),
    )


def operator(bands: Sequence[str] = names.DEFAULT_BANDS, name: str = "operator") -> BrokerUser:
    """The operators' command line: everything but the dispatcher's and the workers' part.
    ``bands``: the dispatchers' bands (whose request messages it may not ack)."""
    return BrokerUser(
        name=name,
        role="operator",
        permissions=Permissions(
            publish=(ALL,),
            subscribe=(ALL,),
            publish_deny=(
                *(ack_subjects(names.request_stream(b)) for b in bands),
                # A renewed copy is its request's only message once held: acked by hand, the
                # request is gone; published by hand, it claims another's place.
                ack_subjects(names.RENEWED_STREAM),
                names.RENEWED_SUBJECTS,
                # An advisory acked by hand would leave its request's producer unanswered.
                ack_subjects(names.ADVISORY_STREAM),
                names.HEARTBEAT_SUBJECTS,
                names.COMPLETION_SUBJECTS,
                names.RESULT_SUBJECTS,
                names.WORK_SUBJECTS,
            ),
        ),
    )


def layout(
    tenants: Iterable[str],
    workers: Iterable[str],
    bands: Sequence[str] = names.DEFAULT_BANDS,
) -> list[BrokerUser]:
    """Every user of a deployment: the dispatcher, the gateway, the operator, a producer per
    tenant and an agent per worker."""
    users = [dispatcher(), gateway(), operator(bands)]
    users += [producer(t) for t in dict.fromkeys(tenants)]
    users += [agent(w) for w in dict.fromkeys(workers)]
    return users

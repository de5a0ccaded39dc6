"""Every subject, stream, consumer, bucket and header name Sluice uses, and the JetStream error
codes it acts on, defined once.

Subject tokens may not contain ``.``, ``*``, ``>`` or whitespace, but model names often do
(``qwen2.5-7b``). :func:`subject_token` encodes any string into a safe, reversible token; the
message body always carries the real name.
"""

from __future__ import annotations

import hashlib
import re

PREFIX = "sluice"

#: The header JetStream deduplicates a publish by (within the stream's duplicate window):
#: Sluice sets it to the request id on submits and on results.
MSG_ID_HEADER = "Nats-Msg-Id"

#: JetStream API error: the stream is at ``max_msgs`` (or the subject at its per-subject limit)
#: with ``discard: new``, so the publish was refused: a full queue.
JS_ERR_MAX_MSGS = 10077
#: JetStream API error: a stream by that name exists already (with another configuration).
JS_ERR_STREAM_NAME_IN_USE = 10058
#: JetStream API error: no peers to place a replicated stream on (a new cluster's meta leader
#: that does not know every peer yet, or a peer offline).
JS_ERR_NO_SUITABLE_PEERS = 10005

#: The default priority bands, most urgent first.
DEFAULT_BANDS: tuple[str, ...] = ("interactive", "standard", "batch")

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_TOKEN = re.compile(r"^[A-Za-z0-9_~-]+$")


def subject_token(value: str) -> str:
    """Encode ``value`` as one NATS subject token: ``[A-Za-z0-9_-]`` kept, other bytes ``~XX``."""
    if not value:
        raise ValueError("a subject token cannot be empty")
    if _ALL_SAFE.fullmatch(value):
        return value  # the usual name or id (every subject of a request has some): kept whole
    out: list[str] = []
    for ch in value:
        if _SAFE.match(ch):
            out.append(ch)
        else:
            out.extend(f"~{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def token_value(token: str) -> str:
    """Decode a token made by :func:`subject_token`; raises ``ValueError`` on a malformed token."""
    if not _TOKEN.match(token):
        raise ValueError(f"not a sluice subject token: {token!r}")
    if "~" not in token:
        return token  # nothing was encoded
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "~":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(token[i].encode())
            i += 1
    return raw.decode("utf-8")


# --- request queues (JetStream work-queue streams, one per band) -----------------------------


def request_subject(band: str, model: str, tenant: str) -> str:
    """Where a producer publishes a request: ``sluice.req.<band>.<model>.<tenant>``."""
    return f"{PREFIX}.req.{subject_token(band)}.{subject_token(model)}.{subject_token(tenant)}"


REQUEST_SUBJECTS = f"{PREFIX}.req.>"
"""Every request subject, of every band."""


def tenant_requests_filter(tenant: str) -> str:
    """The request subjects of one tenant, in every band and for every model: what that
    tenant's producers may publish to."""
    return f"{PREFIX}.req.*.*.{subject_token(tenant)}"


def request_filter(band: str) -> str:
    """The subjects of one band's stream."""
    return f"{PREFIX}.req.{subject_token(band)}.>"


def parse_request_subject(subject: str) -> tuple[str, str, str]:
    """``(band, model, tenant)`` of a request subject; ``ValueError`` if it is not one."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or parts[1] != "req":
        raise ValueError(f"not a request subject: {subject!r}")
    return token_value(parts[2]), token_value(parts[3]), token_value(parts[4])


def request_stream(band: str) -> str:
    """The JetStream stream holding one band's queued and running requests."""
    return f"SLUICE_REQ_{subject_token(band).upper().replace('-', '_').replace('~', '_')}"


def dispatcher_consumer(band: str) -> str:
    """The durable pull consumer the leading dispatcher reads a band with."""
    return f"sluice-dispatch-{subject_token(band).replace('~', '_')}"


def max_deliveries_advisory(band: str) -> str:
    """The JetStream advisory sent when a request of ``band`` reached the consumer's
    ``max_deliver`` without being acked (it will not be delivered again)."""
    return (
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{request_stream(band)}."
        f"{dispatcher_consumer(band)}"
    )


# --- renewed requests (one JetStream work-queue stream, only dispatchers publish to it) -------

RENEWED_STREAM = "SLUICE_RENEWED"
"""Copies of held requests whose deliveries the leader renewed (every leader change spends one
of each held request's ``max_deliver``): outside the bands' bounded queues, so that a full
queue never refuses one, and written by dispatchers only (a producer's permissions cover
``sluice.req`` alone), so that a copy's headers are trusted."""
RENEWED_SUBJECTS = f"{PREFIX}.renewed.>"
RENEWED_CONSUMER = "sluice-dispatch-renewed"
"""The durable pull consumer the leading dispatcher reads :data:`RENEWED_STREAM` with."""
RENEWAL_HEADER = "Sluice-Renewal"
"""A renewed copy's generation (1 for the first renewal of a request)."""
ARRIVED_HEADER = "Sluice-Arrived-Unix-Ms"
"""When a renewed copy's request arrived (its first message was stored): its place in the
queue."""
RENEWED_FROM_HEADER = "Sluice-Renewed-From"
"""The message a renewed copy was made from, ``<stream>:<sequence>`` (:func:`message_ref`): it
is acked once a leader holds the copy, and until then both are stored."""


def message_ref(stream: str, seq: int) -> str:
    """A stored message's reference: ``<stream>:<sequence>``."""
    return f"{stream}:{seq}"


def parse_message_ref(value: str) -> tuple[str, int] | None:
    """``(stream, sequence)`` of a :func:`message_ref`; None if it is not one (a stream's name
    is letters, digits, ``_`` and ``-``, as every stream of Sluice's is)."""
    stream, _, seq = value.rpartition(":")
    if not _STREAM_NAME.fullmatch(stream) or not (seq.isascii() and seq.isdigit()):
        return None
    return stream, int(seq)


_STREAM_NAME = re.compile(r"[A-Za-z0-9_-]+")


def renewed_subject(band: str, model: str, tenant: str, request_id: str) -> str:
    """A request's renewed copies: ``sluice.renewed.<band>.<model>.<tenant>.<request_id>`` (one
    subject per request, so that its newest copy can be looked up)."""
    return (
        f"{PREFIX}.renewed.{subject_token(band)}.{subject_token(model)}."
        f"{subject_token(tenant)}.{subject_token(request_id)}"
    )


def parse_renewed_subject(subject: str) -> tuple[str, str, str]:
    """``(band, model, tenant)`` of a renewed copy's subject; ``ValueError`` if not one."""
    parts = subject.split(".")
    if len(parts) != 6 or parts[0] != PREFIX or parts[1] != "renewed":
        raise ValueError(f"not a renewed request subject: {subject!r}")
    return token_value(parts[2]), token_value(parts[3]), token_value(parts[4])


def renewal_msg_id(request_id: str, generation: int) -> str:
    """The ``Nats-Msg-Id`` of a request's renewed copy."""
    return f"{request_id}{_RENEWAL_MARK}{generation}"


def renewed_request_id(msg_id: str) -> str:
    """The request id of a renewed copy's ``Nats-Msg-Id`` (:func:`renewal_msg_id`)."""
    return msg_id.rpartition(_RENEWAL_MARK)[0]


_RENEWAL_MARK = "~r"


def returned_msg_id(request_id: str, copy_seq: int) -> str:
    """The ``Nats-Msg-Id`` of a request moved back from its renewed copy (at ``copy_seq`` in
    :data:`RENEWED_STREAM`) to its band's queue (``sluice renewed return``): not its
    producer's id, which may still be in the broker's duplicate window (the move would be
    dropped), but one id per copy, so that a second run after an interruption stores it
    once, and a later copy of the same request is never taken for it."""
    return f"{request_id}~u{copy_seq}"


def renewed_max_deliveries_advisory() -> str:
    """The advisory of a renewed copy that reached ``max_deliver`` without being acked."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{RENEWED_STREAM}.{RENEWED_CONSUMER}"


ADVISORY_STREAM = "SLUICE_ADVISORIES"
"""The work-queue stream that keeps max-deliveries advisories until the leader has answered
their requests (the broker sends each once, over core NATS, whoever is listening then)."""
ADVISORY_CONSUMER = "sluice-advisories"
"""The durable pull consumer the leading dispatcher reads :data:`ADVISORY_STREAM` with."""


# --- results (JetStream, kept for pickup) ----------------------------------------------------

RESULT_STREAM = "SLUICE_RESULTS"
RESULT_SUBJECTS = f"{PREFIX}.result.>"


#: The separator of a request id's group: ``GROUP:KEY`` (a batch's requests are
#: ``<batch id>:<key>``); an id without one is in no group.
GROUP_SEPARATOR = ":"
NO_GROUP = "_"


def request_group(request_id: str) -> str | None:
    """The group of a request id (``GROUP:KEY``), None for an ungrouped id."""
    group, sep, key = request_id.partition(GROUP_SEPARATOR)
    return group if sep and group and key else None


def result_subject(tenant: str, request_id: str) -> str:
    """Where the final result (or a typed rejection) of a request is published:
    ``sluice.result.<tenant>.<group>.<request_id>``, so that a tenant's results, and a group's
    (a batch's), can be followed with one subject filter."""
    group = request_group(request_id) or NO_GROUP
    return (
        f"{PREFIX}.result.{subject_token(tenant)}.{subject_token(group)}."
        f"{subject_token(request_id)}"
    )


def results_filter(tenant: str, group: str | None = None) -> str:
    """The result subjects of one tenant, or of one group (a batch) of that tenant."""
    if group is None:
        return f"{PREFIX}.result.{subject_token(tenant)}.>"
    return f"{PREFIX}.result.{subject_token(tenant)}.{subject_token(group)}.*"


def results_consumer(tenant: str, group: str | None) -> str:
    """The durable consumer (on :data:`RESULT_STREAM`) of a tenant's, or a group's, results
    when the subscriber names none: the same for every process, so a restarted producer
    resumes where the last one stopped, and known in advance, so a tenant's broker
    permissions can name it."""
    key = f"{tenant}\x00{group or ''}".encode()
    return f"sluice-results-{hashlib.sha256(key).hexdigest()[:20]}"


# --- offline batches (a JetStream KV bucket and an object store) ------------------------------

BATCH_BUCKET = "SLUICE_BATCHES"
"""Batch records (``batch.<id>``) and file records (``file.<id>``)."""
FILE_STORE = "SLUICE_FILES"
"""The bytes of stored files (batch input, output and error files), by file id."""


BATCH_KEY_PREFIX = "batch."


def kv_stream(bucket: str) -> str:
    """The stream behind a JetStream KV bucket."""
    return f"KV_{bucket}"


def kv_key_subject(bucket: str, key: str) -> str:
    """The subject of a KV bucket's key in its stream (``key`` may end in a wildcard)."""
    return f"$KV.{bucket}.{key}"


def batch_key(batch_id: str) -> str:
    return f"{BATCH_KEY_PREFIX}{subject_token(batch_id)}"


def file_key(file_id: str) -> str:
    return f"file.{subject_token(file_id)}"


# --- dead letters (undecodable input without a request id, poisoned requests) ----------------

DEAD_LETTER_STREAM = "SLUICE_DLQ"
DEAD_LETTER_SUBJECTS = f"{PREFIX}.dlq.>"


def dead_letter_subject(reason: str) -> str:
    """Where input that cannot be answered on a result subject is kept, by reason."""
    return f"{PREFIX}.dlq.{subject_token(reason)}"


# --- live traffic (core NATS) ----------------------------------------------------------------


TOKEN_SUBJECTS = f"{PREFIX}.out.*.*"


def token_subject(tenant: str, request_id: str) -> str:
    """Live token chunks (and the queued notice) of one request, ``sluice.out.<tenant>.<id>``
    (core NATS; the final result is authoritative). The tenant is in the subject so that a
    producer's broker permissions can let it follow its own tenant's streams only."""
    return f"{PREFIX}.out.{subject_token(tenant)}.{subject_token(request_id)}"


def tokens_filter(tenant: str) -> str:
    """The token subjects of one tenant."""
    return f"{PREFIX}.out.{subject_token(tenant)}.>"


WORK_SUBJECTS = f"{PREFIX}.work.*"


def work_subject(worker_id: str) -> str:
    """Assignments for one worker (request/reply: the agent confirms or refuses)."""
    return f"{PREFIX}.work.{subject_token(worker_id)}"


HEARTBEAT_SUBJECTS = f"{PREFIX}.hb.*"


def heartbeat_subject(worker_id: str) -> str:
    """Heartbeats of one worker: load, capacity, in-flight request ids."""
    return f"{PREFIX}.hb.{subject_token(worker_id)}"


COMPLETION_SUBJECTS = f"{PREFIX}.done.*"


def completion_subject(worker_id: str) -> str:
    """Completions from one worker to the dispatcher (request/reply: the dispatcher confirms)."""
    return f"{PREFIX}.done.{subject_token(worker_id)}"


def control_subject(worker_id: str) -> str:
    """Control messages for one worker (request/reply: ``StopWork``)."""
    return f"{PREFIX}.ctl.{subject_token(worker_id)}"


def drain_subject(worker_id: str) -> str:
    """An operator drains or undrains one worker (request/reply: a ``DrainRequest`` answered
    by a ``DrainReply``; ``sluice drain``, ``sluice undrain``)."""
    return f"{PREFIX}.ctl.{subject_token(worker_id)}.drain"


def remove_subject(worker_id: str) -> str:
    """A dispatcher tells one worker that it took its lease away (a ``RemoveNotice``): the
    worker drops what it ran under that registration and registers afresh."""
    return f"{PREFIX}.ctl.{subject_token(worker_id)}.remove"


CANCEL_SUBJECTS = f"{PREFIX}.cancel.*"


def cancel_subject(tenant: str) -> str:
    """Request/reply: a ``CancelRequest`` of ``tenant`` answered by a ``CancelReply``
    (``Client.cancel``). The tenant is in the subject so that broker permissions can let a
    producer cancel its own tenant's requests only; the dispatcher refuses a body that names
    another tenant."""
    return f"{PREFIX}.cancel.{subject_token(tenant)}"


def parse_cancel_subject(subject: str) -> str:
    """The tenant of a cancel subject; ``ValueError`` if it is not one."""
    parts = subject.split(".")
    if len(parts) != 3 or parts[0] != PREFIX or parts[1] != "cancel":
        raise ValueError(f"not a cancel subject: {subject!r}")
    return token_value(parts[2])


STATS_SUBJECT = f"{PREFIX}.stats"
"""Request/reply: the dispatcher answers with its queue depths and in-flight counts."""

WORKERS_SUBJECT = f"{PREFIX}.workers"
"""Request/reply: the dispatcher answers with a ``WorkerList`` (``sluice workers``)."""


# --- run-time configuration (a JetStream KV bucket that dispatchers watch) ----------------------

CONFIG_BUCKET = "SLUICE_CONFIG"
ADMISSION_KEY = "admission"
"""JSON of :class:`~sluice.schemas.models.AdmissionOverrides` (``sluice quota set`` writes it)."""


# --- leadership (a JetStream KV bucket; announcements on core NATS) ----------------------------

LEADER_BUCKET = "SLUICE_LEADER"
"""The dispatchers' election: one key with a TTL (the lease), history 1."""
LEADER_KEY = "leader"
"""JSON of :class:`~sluice.schemas.models.LeaderLease`: who leads, and since which epoch."""
LEADER_SUBJECT = f"{PREFIX}.leader"
"""The leader announces itself (a ``LeaderLease``) on taking over and with every renewal, so
that agents learn the newest epoch before its first assignment reaches them."""


# --- feedback (core NATS) -----------------------------------------------------------------------

WAIT_SUBJECT = f"{PREFIX}.wait"
"""Request/reply: a ``WaitQuery`` answered by a ``WaitEstimate`` (``Client.estimate_wait``)."""
RECONCILE_SUBJECT = f"{PREFIX}.reconcile"
"""Request/reply: reconcile the books with the workers' reports now (a ``ReconcileReport``)."""
SCALE_EVENTS_SUBJECT = f"{PREFIX}.events.scale"
"""``ScaleEvent`` messages for autoscalers: a model and band needs more or fewer workers."""

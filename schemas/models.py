"""The wire contract: versioned, frozen pydantic models for every message.

Every model carries ``v`` (the schema version). A receiver rejects versions it does not know
with a typed error instead of guessing. Times on the wire are Unix epoch milliseconds
(``*_unix_ms``) or durations in seconds (``*_s``).
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    Strict,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from sluice.schemas.tokens import TokenIds, token_ids

SCHEMA_VERSION: Final = 1

MAX_OUTPUT_TOKENS: Final = 1_000_000
"""The most output tokens a request may ask for (``SubmitRequest.max_tokens``)."""

Name = Annotated[str, Field(min_length=1, max_length=128)]
RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
_WIRE = "wire"
WIRE_CONTEXT: Final = {_WIRE: True}
"""The serialisation context of the msgpack codec: token ids go out packed (one ``bin``)."""


def _serialise_ids(ids: TokenIds, info: SerializationInfo) -> list[int] | bytes:
    # Packed on the wire (the codec's context); a list anywhere else, as before the ids
    # were held packed, so that a model_dump() is still plain data.
    if info.context is not None and info.context.get(_WIRE):
        return ids.packed
    return ids.tolist()


TokenIdsField = Annotated[
    TokenIds,
    PlainValidator(token_ids, json_schema_input_type=list[int]),
    PlainSerializer(_serialise_ids, return_type=Any),
    WithJsonSchema(
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}}
    ),
]
"""Token ids (:class:`~sluice.schemas.tokens.TokenIds`): integers in ``[0, 2**32)``, what
engines and Sluice's block hashing (uint32) take. Given as a list or tuple of ids, or as
their packed bytes (how the codec sends them); a list in JSON."""


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    v: Literal[1] = SCHEMA_VERSION


class RejectReason(StrEnum):
    """Why a request was not run. Every rejection carries exactly one."""

    MALFORMED = "malformed"
    """The bytes did not decode into a valid request."""
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_BAND = "unknown_band"
    PROMPT_TOO_LONG = "prompt_too_long"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    QUEUE_FULL = "queue_full"
    MAX_ATTEMPTS = "max_attempts"
    """The request was retried on failing workers until its attempt budget ran out."""
    UNDELIVERABLE = "undeliverable"
    """The broker delivered the request ``max_deliver`` times without it finishing (for
    instance through repeated dispatcher crashes); it was moved to the dead-letter stream."""
    CANCELLED = "cancelled"
    """Its producer (or an operator) cancelled it; a result of a request cancelled while it ran
    carries the tokens produced until then."""
    INTERNAL = "internal"


MAX_STOP_SEQUENCES: Final = 16
"""The most stop strings (and, apart, stop token ids) a request may give."""
MAX_STOP_CHARS: Final = 256
"""The longest stop string."""
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


MAX_SCHEMA_CHARS: Final = 65_536
"""The largest ``response_format`` a request may give, as JSON."""
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def response_format(value: Any) -> dict[str, Any] | None:
    """``value`` as :attr:`Sampling.response_format` (None for none, or for ``text``), or
    :class:`ValueError` saying what is wrong with it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("response_format must be an object")
    kind = value.get("type")
    if kind == "text":
        if set(value) != {"type"}:
            raise ValueError("a text response_format has no field but type")
        return None
    if kind == "json_object":
        if set(value) != {"type"}:
            raise ValueError("a json_object response_format has no field but type")
    elif kind == "json_schema":
        _json_schema(value)
    else:
        raise ValueError("response_format's type must be text, json_object or json_schema")
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"response_format is not JSON: {exc}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(
            f"response_format has {len(text)} characters as JSON; at most {MAX_SCHEMA_CHARS}"
        )
    copy: dict[str, Any] = json.loads(text)  # (its own: the caller's dict may change later)
    return copy


def _json_schema(value: dict[str, Any]) -> None:
    spec = value.get("json_schema")
    if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise ValueError("a json_schema response_format needs json_schema, an object")
    if not set(spec) <= {"name", "schema", "strict", "description"}:
        raise ValueError(f"json_schema takes name, schema, strict, description: {sorted(spec)}")
    if not isinstance(spec.get("name"), str) or not _SCHEMA_NAME.fullmatch(spec["name"]):
        raise ValueError("json_schema.name must be 1-64 letters, digits, _ or -")
    if not isinstance(spec.get("schema"), dict):
        raise ValueError("json_schema.schema must be an object (a JSON Schema)")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError("json_schema.strict must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise ValueError("json_schema.description must be a string")


MAX_LOGPROBS: Final = 20
"""The most alternatives per token a request may ask log probabilities of (vLLM's default
``max_logprobs``; OpenAI's chat API takes as many)."""
LOGPROB_FLOOR: Final = -9999.0
"""The log probability sent for an impossible token (log 0): JSON has no infinity, and vLLM
sends this value instead."""


Number = Annotated[float, Strict()]
"""A number as JSON gives it (an int or a float; not a bool, not a string of digits)."""
WholeNumber = Annotated[int, Strict()]


class Sampling(BaseModel):
    """How the engine samples a request's output (``SubmitRequest.sampling``): the OpenAI
    completions fields and the extensions vLLM's and SGLang's completions endpoints both take,
    by their names there, in ranges both accept. An unset field is not sent, so the engine's
    own default applies. The dispatcher never reads them; the agent passes them to its engine
    as they are (:meth:`engine_fields`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    temperature: Number | None = Field(default=None, ge=0)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: WholeNumber | None = Field(default=None, ge=-1)
    """-1 or 0: every token (sent as -1, which SGLang takes too)."""
    min_p: Number | None = Field(default=None, ge=0, le=1)
    seed: WholeNumber | None = Field(default=None, ge=-(2**63), lt=2**63)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(default=None, gt=0, le=2)
    """SGLang's range (vLLM takes any above 0)."""
    stop: tuple[StopString, ...] = Field(default=(), max_length=MAX_STOP_SEQUENCES)
    """The output ends before the first of these strings (which it does not include). One
    string is taken as a list of one, as OpenAI's API takes it."""
    stop_token_ids: tuple[Annotated[int, Strict(), Field(ge=0, lt=2**32)], ...] = Field(
        default=(), max_length=MAX_STOP_SEQUENCES
    )
    """The output ends at the first of these tokens."""
    min_tokens: WholeNumber | None = Field(default=None, ge=0, le=MAX_OUTPUT_TOKENS)
    """Stop strings, stop tokens and end-of-sequence are not taken before this many tokens."""
    ignore_eos: Annotated[bool, Strict()] | None = None
    """Go on past the end-of-sequence token, to ``max_tokens`` (what load tests ask for)."""
    response_format: dict[str, Any] | None = None
    """Structured output, as OpenAI's API and both engines' completions take it:
    ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"?, "description"?}}`` (JSON valid against ``schema``), which the
    engine enforces while it samples. ``{"type": "text"}`` is no request. Checked here for its
    shape and its size (at most :data:`MAX_SCHEMA_CHARS` as JSON), not for the schema's own
    validity, which the engine judges."""
    logprobs: WholeNumber | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Return each output token's log probability and those of this many most likely
    alternatives (0: the token's own only), as the engines' completions endpoints take it
    (OpenAI's chat API says ``logprobs: true, top_logprobs: n``)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("top_k")
    @classmethod
    def _every_token(cls, value: int | None) -> int | None:
        return -1 if value == 0 else value

    @field_validator("response_format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> dict[str, Any] | None:
        return response_format(value)

    @model_serializer(mode="wrap")
    def _set_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only what was set travels: an engine applies its own defaults to the rest.
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None and v != () and v != []}

    def engine_fields(self) -> dict[str, Any]:
        """The fields an OpenAI-compatible engine takes in a completions body."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.model_dump().items()}

    def __bool__(self) -> bool:
        """Whether any field is set (an empty one asks for the engine's defaults)."""
        return bool(self.model_dump())


class SubmitRequest(_Wire):
    """What a producer publishes on ``sluice.req.<band>.<model>.<tenant>``.

    Exactly one of ``prompt_tokens`` (token ids) and ``prompt_text`` is set.
    ``request_id`` is the idempotency key (it is also the ``Nats-Msg-Id``); an id
    ``GROUP:KEY`` puts its result in a group (a batch's requests:
    :func:`~sluice.schemas.names.result_subject`).
    ``session_id``: an affinity hint: the requests of one session (a conversation) of a tenant
    stick to the workers that served it, as a shared prompt prefix does.
    """

    request_id: RequestId
    model: Name
    tenant: Name = "default"
    band: Name = "standard"
    prompt_tokens: TokenIdsField | None = None
    prompt_text: str | None = None
    max_tokens: int = Field(default=256, ge=1, le=MAX_OUTPUT_TOKENS)
    submitted_unix_ms: int = Field(ge=0)
    deadline_unix_ms: int | None = Field(default=None, ge=0)
    session_id: Name | None = None
    sampling: Sampling | None = Field(default=None, exclude_if=lambda v: not v)
    """How the engine samples the output (None: the engine's defaults). Not sent when None,
    so that a request without it is read by a release that predates it."""

    @model_validator(mode="after")
    def _one_prompt(self) -> SubmitRequest:
        if (self.prompt_tokens is None) == (self.prompt_text is None):
            raise ValueError("exactly one of prompt_tokens and prompt_text must be set")
        return self


class AssignmentHead(_Wire):
    """An :class:`Assignment` without its request: what the dispatcher encodes around the
    request's body as the producer sent it (:func:`~sluice.schemas.codec.encode_nested`)."""

    attempt: int = Field(ge=1)
    dispatcher_id: Name
    queued_s: float = Field(ge=0)
    epoch: int = Field(default=0, ge=0)
    """The leadership epoch of the dispatcher that sent it (0: a dispatcher without
    leadership). An agent refuses an assignment from an epoch older than the newest it has
    seen: a deposed leader that wakes up cannot dispatch."""


class Assignment(AssignmentHead):
    """Dispatcher → agent on ``sluice.work.<worker>``: run this request (attempt N)."""

    request: SubmitRequest


class LeaderLease(_Wire):
    """The leader key's value (``names.LEADER_KEY``) and the leader's announcement on
    ``sluice.leader``. ``epoch`` is the revision of the write that made it leader (strictly
    increasing from one leader to the next); 0 while the first renewal has not written it."""

    dispatcher_id: Name
    epoch: int = Field(default=0, ge=0)


class AssignmentReply(_Wire):
    """Agent → dispatcher: the agent took the assignment, or says why not."""

    request_id: RequestId
    accepted: bool
    reason: str = ""


class TokenChunk(_Wire):
    """Agent → client on ``sluice.out.<tenant>.<request_id>``: coalesced tokens, in order.

    ``index`` is the position of the chunk's first token in the output, so a client can drop
    what it already has when a retried attempt streams the same positions again.
    """

    request_id: RequestId
    attempt: int = Field(ge=1)
    index: int = Field(ge=0)
    tokens: list[int]
    text: str
    logprobs: Logprobs = None
    """One per token of ``tokens``."""

    @field_validator("logprobs")
    @classmethod
    def _one_per_token(
        cls, value: list[TokenLogprob] | None, info: ValidationInfo
    ) -> list[TokenLogprob] | None:
        return _aligned(value, info, "tokens")


class TopLogprob(BaseModel):
    """One of the most likely tokens at an output position, and its log probability."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    text: str
    logprob: Number = Field(ge=LOGPROB_FLOOR, le=0)


class TokenLogprob(BaseModel):
    """An output token's text and log probability, and the most likely tokens at its
    position (as many as ``Sampling.logprobs`` asked for, most likely first)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    text: str
    logprob: Number = Field(ge=LOGPROB_FLOOR, le=0)
    top: list[TopLogprob] = Field(default_factory=list, max_length=MAX_LOGPROBS)


Logprobs = Annotated[list[TokenLogprob] | None, Field(default=None, exclude_if=lambda v: v is None)]
"""Per output token, when the request asked for them (``Sampling.logprobs``); not sent
otherwise, so that a release that predates it reads the message."""


def _aligned(
    logprobs: list[TokenLogprob] | None, info: ValidationInfo, tokens: str
) -> list[TokenLogprob] | None:
    # A field validator, not a model one: it runs only when logprobs are given (a model
    # validator cost every token chunk 0.23 µs more to decode).
    count = len(info.data.get(tokens, ()))
    if logprobs is not None and len(logprobs) != count:
        raise ValueError(f"{len(logprobs)} logprobs for {count} tokens")
    return logprobs


class QueuedNotice(_Wire):
    """Dispatcher → client on ``sluice.out.<tenant>.<request_id>``, once, when a request is
    held in the queue instead of starting: where it stands and how long it may wait, so that a
    caller can wait or degrade. ``held_by`` names the layer that holds it: ``global-limit``,
    ``band-limit``, ``band-share``, ``quota:model``, ``quota:model-band``,
    ``quota:model-tenant``, ``no-worker-room``, ``queue`` (requests ahead of it) or
    ``learning`` (a dispatcher that just started learns what runs before it dispatches)."""

    request_id: RequestId
    position: int = Field(ge=1)
    """Its place in its band's queue for its model (1: next)."""
    expected_wait_s: float | None = Field(default=None, ge=0)
    """The dispatcher's expected wait for its model and band (None: no recent admissions)."""
    held_by: str


class Timings(_Wire):
    """Where a request's time went, as measured by Sluice."""

    queued_s: float
    """From submission to hand-off to the worker that ran it."""
    ttft_s: float
    """From submission to the first output token."""
    e2e_s: float
    """From submission to the last output token."""
    prefill_s: float = 0.0
    decode_s: float = 0.0


class Rejection(_Wire):
    """A typed answer for a request that was not (and will not be) run."""

    reason: RejectReason
    message: str
    retry_after_s: float | None = None


class Result(_Wire):
    """The final answer for a request on ``sluice.result.<tenant>.<group>.<request_id>``
    (:func:`sluice.schemas.names.result_subject`).

    ``ok`` tells whether it ran to its end. If not, ``rejection`` says why, and the output
    fields are empty, except for a request cancelled while it ran: they hold what it produced
    until then.
    """

    request_id: RequestId
    ok: bool
    model: str = ""
    tenant: str = "default"
    band: str = ""
    worker_id: str = ""
    attempt: int = 0
    output_tokens: list[int] = Field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    timings: Timings | None = None
    rejection: Rejection | None = None
    logprobs: Logprobs = None
    """One per output token, when the request asked for them."""

    @field_validator("logprobs")
    @classmethod
    def _one_per_token(
        cls, value: list[TokenLogprob] | None, info: ValidationInfo
    ) -> list[TokenLogprob] | None:
        return _aligned(value, info, "output_tokens")


class Completion(_Wire):
    """Agent → dispatcher on ``sluice.done.<worker>``: the request is finished, release it."""

    request_id: RequestId
    worker_id: Name
    attempt: int = Field(ge=1)
    ok: bool
    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    prefill_s: float = Field(ge=0)
    decode_s: float = Field(ge=0)
    error: str = ""


class WorkerLoad(_Wire):
    """A worker's load as its engine sees it."""

    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    pending_prefill_tokens: int = Field(ge=0)
    active_decode_tokens: int = Field(ge=0)
    kv_blocks_used: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    busy_s_total: float = Field(ge=0)
    """Cumulative engine busy time in real seconds since the agent started (utilisation)."""


BlockHash = Annotated[int, Field(ge=0, lt=2**64)]


class CacheDigest(_Wire):
    """What a worker's KV cache holds, as chained block hashes (``sluice.schemas.hashing``).

    A *delta* (``snapshot`` false) lists blocks stored and evicted since digest ``seq - 1``; a
    *snapshot* lists every reported block and restarts the numbering at ``seq``. A dispatcher
    that misses a delta ignores the worker's deltas until its next snapshot. Workers report only
    prompts of at least their ``digest_min_prefix_tokens``, and at most ``digest_max_blocks``
    blocks per digest (a false negative only costs one cache miss).
    """

    seq: int = Field(ge=0)
    snapshot: bool = False
    block_tokens: int = Field(ge=1)
    stored: list[BlockHash] = Field(default_factory=list)
    evicted: list[BlockHash] = Field(default_factory=list)


WorkerState = Literal["serving", "draining", "drained"]
"""``serving`` takes work; ``draining`` takes none and finishes what it runs; ``drained``
takes none and has nothing left (nothing running, no report waiting)."""


class Heartbeat(_Wire):
    """Agent → dispatchers on ``sluice.hb.<worker>`` about every second.

    ``capacity`` is how many requests the worker takes at once; ``in_flight`` are the ids it
    holds now: running, or finished with the result not stored yet (the dispatcher reconciles
    its books against them, and does not run them again). ``draining`` asks for no new
    work (``state`` says how far the drain got); ``leaving`` says the worker is gone (a clean
    shutdown ends its lease at once). ``registration`` is raised each time the agent registers
    afresh (at start, and after a :class:`RemoveNotice`): a dispatcher ignores heartbeats of a
    registration it removed, and forgets the bookings of an earlier one. 0: an agent that
    predates registrations (taken as it comes).
    """

    worker_id: Name
    models: list[Name]
    seq: int = Field(ge=0)
    sent_unix_ms: int = Field(ge=0)
    capacity: int = Field(ge=0)
    in_flight: list[RequestId]
    load: WorkerLoad
    draining: bool = False
    leaving: bool = False
    cache: CacheDigest | None = None
    state: WorkerState = "serving"
    registration: int = Field(default=0, ge=0)


class QuotaSpec(BaseModel):
    """One model's quota as operators write it (settings, or the run-time config in KV);
    levels left unset are unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    limit: int | None = Field(default=None, ge=0, description="The model's total.")
    band_limits: dict[str, int] = Field(default_factory=dict, description="Per band.")
    tenant_limits: dict[str, int] = Field(default_factory=dict, description="Per tenant.")
    default_tenant_limit: int | None = Field(
        default=None, ge=0, description="Each tenant not in tenant_limits."
    )
    unit: Literal["requests", "tokens", "engine_ms"] = Field(
        default="requests",
        description=(
            "Count running requests, prompt + max output tokens, or estimated engine "
            "milliseconds (the engine time of what runs)."
        ),
    )

    @model_validator(mode="after")
    def _non_negative(self) -> QuotaSpec:
        if any(v < 0 for v in [*self.band_limits.values(), *self.tenant_limits.values()]):
            raise ValueError("quota limits must be >= 0")
        return self


class AdmissionOverrides(BaseModel):
    """Admission settings changed at run time: JSON under the key ``admission`` of the KV
    bucket ``SLUICE_CONFIG``, which dispatchers watch (``sluice quota set``). A field left out
    keeps the dispatcher's own setting; a model left out of ``quotas`` keeps its configured
    quota."""

    model_config = ConfigDict(extra="forbid")

    global_limit: int | None = Field(default=None, ge=1)
    band_limits: dict[str, int] | None = None
    band_shares: dict[str, int] | None = None
    band_floors: dict[str, float] | None = None
    quotas: dict[str, QuotaSpec] = Field(default_factory=dict)
    default_quota: QuotaSpec | None = None


class WaitQuery(_Wire):
    """Client → dispatcher on ``sluice.wait``: how long would a request wait now?"""

    model: Name
    band: Name


class WaitEstimate(_Wire):
    """Dispatcher → client: one model and band, over the dispatcher's feedback window.
    ``expected_wait_s`` is None when requests are queued but none was admitted lately."""

    model: str
    band: str
    queued: int = Field(ge=0)
    running: int = Field(ge=0)
    wait_p50_s: float = Field(ge=0)
    wait_p99_s: float = Field(ge=0)
    admitted_per_s: float = Field(ge=0)
    rejected_per_s: float = Field(ge=0)
    expected_wait_s: float | None = None


class ScaleEvent(_Wire):
    """Dispatcher → autoscalers on ``sluice.events.scale``: add workers (``up``) or remove
    some (``down``) for this model; ``band`` says which traffic asked."""

    dispatcher_id: Name
    model: str
    band: str
    direction: Literal["up", "down"]
    reason: str
    expected_wait_s: float | None = None
    at_unix_ms: int = Field(ge=0)


class CancelRequest(_Wire):
    """Request/reply on ``sluice.cancel``: stop a request (``Client.cancel``, ``sluice cancel``)."""

    request_id: RequestId
    tenant: Name = "default"


class CancelReply(_Wire):
    """The dispatcher's answer to a :class:`CancelRequest`. ``cancelled``: it was queued (it
    never runs) or running (its worker stopped it, or will); ``finished``: it had ended
    already (its result stands); ``unknown``: no such request is queued, running or stored."""

    request_id: RequestId
    status: Literal["cancelled", "finished", "unknown"]
    message: str = ""


class StopWork(_Wire):
    """Request/reply on a worker's control subject: stop running ``request_id`` (whatever
    attempt of it runs there; ``attempt`` is the dispatcher's, for logs). The agent stores the
    request's cancelled result before it answers."""

    request_id: RequestId
    attempt: int = Field(ge=1)


class StopWorkReply(_Wire):
    """The agent's answer: ``stopped`` (its cancelled result is stored, with
    ``output_tokens`` tokens) or not running here (finished, or never received)."""

    request_id: RequestId
    stopped: bool
    output_tokens: int = Field(default=0, ge=0)


class DrainRequest(_Wire):
    """Operator → agent on its drain subject (:func:`~sluice.schemas.names.drain_subject`):
    ``drain`` true stops it taking work (what runs finishes), false takes work again;
    ``exit``: once drained, the agent stops its process."""

    drain: bool = True
    exit: bool = False


class DrainReply(_Wire):
    """The agent's answer to a :class:`DrainRequest`, sent once it refuses new work: its
    state and what it still runs."""

    worker_id: Name
    state: WorkerState
    in_flight: list[RequestId]


class RemoveNotice(_Wire):
    """Dispatcher → agent on its remove subject: its lease of ``registration`` was taken away
    (its heartbeats stopped for longer than the lease) and what it ran is queued again. The
    agent drops what it runs and heartbeats as a fresh registration; a notice of an earlier
    registration than the agent's own is ignored."""

    dispatcher_id: Name
    registration: int = Field(ge=0)


class WorkerRow(_Wire):
    """One worker as a dispatcher sees it (its last heartbeat and its bookings)."""

    worker_id: Name
    state: WorkerState
    models: list[str]
    capacity: int = Field(ge=0)
    in_flight: int = Field(ge=0)
    """Requests the worker reported running."""
    booked: int = Field(ge=0)
    """Requests the dispatcher has booked on it."""
    kv_blocks_used: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    lease_age_s: float = Field(ge=0)
    """Seconds since its last heartbeat renewed its lease."""


class WorkerList(_Wire):
    """The dispatcher's answer on ``sluice.workers``: every worker holding a lease."""

    dispatcher_id: Name
    workers: list[WorkerRow]


class DeadLetter(_Wire):
    """What the dispatcher keeps for input it cannot answer on a result subject."""

    reason: RejectReason
    message: str
    subject: str
    payload: bytes
    received_unix_ms: int


class BandStats(_Wire):
    """One band's queue as the dispatcher sees it."""

    band: Name
    queued: int
    running: int
    limit: int
    oldest_wait_s: float
    engine_demand_s_per_s: float = 0.0
    """Engine-seconds per second dispatched to the band lately."""
    engine_floor_s_per_s: float | None = None
    """An offline band's engine-time floor (None: an online band)."""
    engine_idle_s_per_s: float | None = None
    """The idle capacity an offline band may borrow now."""


class DispatcherStats(_Wire):
    """The dispatcher's answer on ``sluice.stats``."""

    dispatcher_id: Name
    running: int
    global_limit: int
    workers: int
    held: dict[str, int] = Field(default_factory=dict)
    """Queued requests by the layer that holds them (see :class:`QueuedNotice`)."""
    bands: list[BandStats]
    models: list[str] = Field(default_factory=list)
    """The models it serves: its configured ``models``, or (discovering) every model a worker
    announced; a request for another model is rejected ``unknown_model``."""
    leader: bool = True
    """Whether it leads (only the leader answers; standbys keep quiet)."""
    epoch: int = Field(default=0, ge=0)
    """Its leadership epoch."""


class ReconcileReport(_Wire):
    """What one reconciliation found and did (:mod:`sluice.dispatcher.reconcile`)."""

    dispatcher_id: Name
    orphaned: list[str] = Field(default_factory=list)
    """Booked, held by no worker past the grace: released and run again."""
    moved: list[str] = Field(default_factory=list)
    adopted: list[str] = Field(default_factory=list)
    unknown: list[str] = Field(default_factory=list)
    """Run by a worker, unknown here (ended here, or another dispatcher's)."""


# --- offline batches (stored in the batch bucket, names.BATCH_BUCKET) --------------------------

BatchState = Literal[
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
]
TERMINAL_BATCH_STATES: Final = frozenset({"completed", "failed", "expired", "cancelled"})


class BatchCounts(_Wire):
    """A batch's requests: ``total`` valid input lines; ``completed`` and ``failed`` have a
    result; ``invalid`` lines were never submitted (they are in the error file)."""

    total: int = Field(default=0, ge=0)
    completed: int = Field(default=0, ge=0)
    failed: int = Field(default=0, ge=0)
    invalid: int = Field(default=0, ge=0)


class ChatTemplateSpec(BaseModel):
    """A chat template as a batch keeps it (``BatchRecord.chat_template``): its Jinja source
    and the special tokens it is rendered with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(min_length=1, max_length=256 * 1024)
    special_tokens: dict[str, str | list[str]] = Field(default_factory=dict)


class BatchRecord(_Wire):
    """One offline batch: what it runs, where it stands, and where its files are. Times are
    Unix seconds (OpenAI's batch object counts in seconds)."""

    id: Name
    tenant: Name
    status: BatchState
    endpoint: str = "/v1/chat/completions"
    """What a line of the OpenAI Batch format runs (its ``url``), as OpenAI's batch says."""
    input_file_id: Name
    band: Name = "batch"
    completion_window_s: float = Field(gt=0)
    created_at: int = Field(ge=0)
    expires_at: int = Field(ge=0)
    counts: BatchCounts = Field(default_factory=BatchCounts)
    submitted: int = Field(default=0, ge=0)
    """Input lines handled by the submitter so far (a restarted submitter resumes here)."""
    submitter_done: bool = False
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    errors: list[str] = Field(default_factory=list)
    """Why the batch failed as a whole (not per line: those are in the error file)."""
    refused: dict[str, str] = Field(default_factory=dict)
    """Lines the client could not publish (a request larger than the broker's
    ``max_payload``), by request id: their error. They fail in the error file; at most
    ``MAX_REFUSED_LINES`` (``sluice.client.batches``), past which the batch fails."""
    metadata: dict[str, str] = Field(default_factory=dict)
    chat_template: ChatTemplateSpec | None = Field(default=None, exclude_if=lambda v: v is None)
    """The chat template its chat lines are rendered with (None: Sluice's neutral one): the
    creator's, kept here so that any process that reads the batch renders them alike. Not
    sent when None, so that a release before it reads the others."""


class FileRecord(_Wire):
    """A stored file (a batch's input, output or errors): its bytes are in the file store
    (``names.FILE_STORE``) under its ``id``."""

    id: Name
    tenant: Name
    filename: str
    purpose: str
    bytes: int = Field(ge=0)
    created_at: int = Field(ge=0)

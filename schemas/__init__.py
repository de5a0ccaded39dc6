"""The wire contract of Sluice: models, codec, names and prefix hashing (pure, no I/O)."""

from sluice.schemas.codec import decode, encode
from sluice.schemas.errors import DecodeError, SchemaError
from sluice.schemas.models import (
    SCHEMA_VERSION,
    Assignment,
    AssignmentReply,
    BandStats,
    CacheDigest,
    Completion,
    DeadLetter,
    DispatcherStats,
    Heartbeat,
    Rejection,
    RejectReason,
    Result,
    SubmitRequest,
    Timings,
    TokenChunk,
    WorkerLoad,
)

__all__ = [
    "SCHEMA_VERSION",
    "Assignment",
    "AssignmentReply",
    "BandStats",
    "CacheDigest",
    "Completion",
    "DeadLetter",
    "DecodeError",
    "DispatcherStats",
    "Heartbeat",
    "RejectReason",
    "Rejection",
    "Result",
    "SchemaError",
    "SubmitRequest",
    "Timings",
    "TokenChunk",
    "WorkerLoad",
    "decode",
    "encode",
]

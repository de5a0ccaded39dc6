"""The Sluice producer library.

async with Client("nats://127.0.0.1:4222") as client:
    handle = await client.submit("my-model", "Hello", max_tokens=32, band="interactive")
    async for chunk in handle:
        print(chunk.text, end="")
    result = await handle.result()
"""

from sluice.client.batches import Batches
from sluice.client.client import Client, RequestHandle, Retry
from sluice.client.errors import (
    BatchNotFound,
    BatchStateError,
    Cancelled,
    DeadlineExceeded,
    DispatcherLeading,
    DrainTimeout,
    FileNotFound,
    InvalidRequest,
    MalformedResult,
    NotConnected,
    QueueFull,
    Rejected,
    ResultTimeout,
    ServiceUnavailable,
    SluiceError,
    UnknownWorker,
)
from sluice.client.settings import ClientSettings
from sluice.client.subscriptions import ResultSubscription
from sluice.schemas.models import (
    QueuedNotice,
    RejectReason,
    Result,
    Sampling,
    Timings,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "BatchNotFound",
    "BatchStateError",
    "Batches",
    "Cancelled",
    "Client",
    "ClientSettings",
    "DeadlineExceeded",
    "DispatcherLeading",
    "DrainTimeout",
    "FileNotFound",
    "InvalidRequest",
    "MalformedResult",
    "NotConnected",
    "QueueFull",
    "QueuedNotice",
    "RejectReason",
    "Rejected",
    "RequestHandle",
    "Result",
    "ResultSubscription",
    "ResultTimeout",
    "Retry",
    "Sampling",
    "ServiceUnavailable",
    "SluiceError",
    "Timings",
    "TokenChunk",
    "TokenLogprob",
    "TopLogprob",
    "UnknownWorker",
]

"""Operators' tools: the run-time admission configuration that dispatchers watch.

``sluice quota set|clear|show`` use these. The configuration is one JSON document
(:class:`~sluice.schemas.models.AdmissionOverrides`) under the key ``admission`` of the KV bucket
``SLUICE_CONFIG``; changes are compare-and-set, so two operators never lose each other's edits.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from sluice.client.errors import ServiceUnavailable
from sluice.schemas import names
from sluice.schemas.models import AdmissionOverrides, QuotaSpec


async def admission_overrides(nc: NATS) -> tuple[AdmissionOverrides, int]:
    """The current run-time configuration and its revision (0: none is set)."""
    try:
        kv = await nc.jetstream().key_value(names.CONFIG_BUCKET)
        entry = await kv.get(names.ADMISSION_KEY)
    except (BucketNotFoundError, KeyNotFoundError):
        return AdmissionOverrides(), 0
    if entry.value is None:
        return AdmissionOverrides(), entry.revision or 0
    return AdmissionOverrides.model_validate_json(entry.value), entry.revision or 0


async def change_admission(
    nc: NATS, change: Callable[[AdmissionOverrides], AdmissionOverrides], attempts: int = 5
) -> AdmissionOverrides:
    """Read, change and write the run-time configuration, retrying if another writer got in
    between. Raises ServiceUnavailable if no dispatcher ever created the bucket."""
    try:
        kv = await nc.jetstream().key_value(names.CONFIG_BUCKET)
    except BucketNotFoundError as exc:
        raise ServiceUnavailable("no dispatcher has created the configuration bucket") from exc
    for _ in range(attempts):
        current, revision = await admission_overrides(nc)
        new = change(current)
        data = new.model_dump_json(exclude_defaults=True).encode()
        try:
            if revision == 0:
                await kv.create(names.ADMISSION_KEY, data)
            else:
                await kv.update(names.ADMISSION_KEY, data, last=revision)
            return new
        except KeyWrongLastSequenceError:
            continue
    raise ServiceUnavailable("the configuration kept changing under us; try again")


async def set_model_quota(nc: NATS, model: str, spec: QuotaSpec) -> AdmissionOverrides:
    """Give ``model`` this quota at run time (replacing its run-time quota, if any)."""
    return await change_admission(
        nc, lambda o: o.model_copy(update={"quotas": {**o.quotas, model: spec}})
    )


async def clear_model_quota(nc: NATS, model: str) -> AdmissionOverrides:
    """Drop ``model``'s run-time quota: its configured quota applies again."""
    return await change_admission(
        nc,
        lambda o: o.model_copy(
            update={"quotas": {m: q for m, q in o.quotas.items() if m != model}}
        ),
    )

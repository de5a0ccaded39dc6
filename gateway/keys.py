"""API keys: who a request is (its tenant) and which bands it may use.

Keys are kept only as SHA-256 digests (a plain ``key`` in the settings is digested when the
table is built), and a presented key is digested and compared with every entry in constant
time (``hmac.compare_digest``, no early exit), so neither the table nor the time an answer
takes tells anything about a key. No log line and no error message holds a key: a principal is
known in logs by its ``name`` (or its tenant).

With no keys configured the gateway is **open**: every request is the open tenant
(``open_tenant``), may use any band, and gets ``default_band`` unless it asks for another.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.common.errors import ConfigError
from sluice.gateway.errors import BadRequest, Forbidden, Unauthorized
from sluice.gateway.settings import ApiKey, GatewaySettings

PRIORITY_HEADER = "x-sluice-priority"
"""The request header that selects a band within what the key allows."""


def digest(key: str) -> bytes:
    """The SHA-256 digest of a key, as the table keeps it."""
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class Principal:
    """Who a request is: its tenant, the bands it may use (None: any) and its default band."""

    name: str
    tenant: str
    default_band: str
    bands: frozenset[str] | None = None

    def band(self, asked: str | None) -> str:
        """The band of a request that asks for ``asked`` (the priority header; None: the
        default band). Raises ``Forbidden`` (403) for a band this principal may not use."""
        if asked is None:
            return self.default_band
        asked = asked.strip()
        if not asked:
            raise BadRequest(f"the {PRIORITY_HEADER} header is empty", param=PRIORITY_HEADER)
        if self.bands is not None and asked not in self.bands:
            allowed = sorted(self.bands)
            raise Forbidden(
                f"this API key may not use band {asked!r}; its bands are {allowed}",
                param=PRIORITY_HEADER,
                code="band_not_allowed",
            )
        return asked


def _principal(i: int, spec: ApiKey, default_band: str) -> Principal:
    band = spec.default_band or default_band
    return Principal(
        name=spec.name or f"{spec.tenant}#{i}",
        tenant=spec.tenant,
        default_band=band,
        bands=frozenset([*spec.bands, band]),
    )


def _digest_of(spec: ApiKey) -> bytes:
    if spec.key is not None:
        return digest(spec.key.get_secret_value())
    assert spec.key_sha256 is not None  # the entry's validator requires one of the two
    return bytes.fromhex(spec.key_sha256)


class KeyTable:
    """The configured keys as digests, and who each one is."""

    def __init__(
        self, entries: Sequence[tuple[bytes, Principal]], open_principal: Principal | None
    ) -> None:
        self._entries = list(entries)
        self._open = open_principal

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> KeyTable:
        """The table of ``settings.keys``; two entries with the same key are a ``ConfigError``
        (which tenant would it be?)."""
        entries: list[tuple[bytes, Principal]] = []
        for i, spec in enumerate(settings.keys):
            d = _digest_of(spec)
            seen = next((p for e, p in entries if hmac.compare_digest(e, d)), None)
            if seen is not None:
                raise ConfigError(f"keys[{i}] is the same key as {seen.name!r}")
            entries.append((d, _principal(i, spec, settings.default_band)))
        open_principal = None
        if not entries:
            open_principal = Principal("open", settings.open_tenant, settings.default_band)
        return cls(entries, open_principal)

    @property
    def open(self) -> bool:
        """Whether no keys are configured (every request is the open tenant)."""
        return self._open is not None

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, authorization: str | None) -> Principal:
        """Who presents the ``Authorization`` header ``Bearer KEY``. Raises ``Unauthorized``
        (401) for a missing or unknown key; an open table takes anything."""
        if self._open is not None:
            return self._open
        if authorization is None:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("malformed Authorization header: send 'Bearer <key>'")
        presented = digest(key.strip())
        found: Principal | None = None
        for d, principal in self._entries:  # every entry, no early exit
            if hmac.compare_digest(presented, d):
                found = principal
        if found is None:
            raise Unauthorized("invalid API key")
        return found

"""The gateway's settings: ``SLUICE_GATEWAY_…`` variables or the ``[gateway]`` table of the
config file (``SLUICE_NATS_URL`` for the broker). Read once per process.

API keys are a table of entries, each a plain ``key`` or the hex ``key_sha256`` of one
(``printf %s "$KEY" | sha256sum``), so that the config file need not hold the secret::

    [[gateway.keys]]
    name = "acme-prod"                   # a label for logs (never the key)
    key_sha256 = "9f86d081884c7d65..."   # or: key = "sk-..."
    tenant = "acme"
    bands = ["interactive", "standard"]  # what x-sluice-priority may choose
    default_band = "standard"            # without the header (default: default_band below)

Invalid settings never echo the values they were given (:attr:`redact_inputs`), so a mistyped
entry does not print its key.
"""

from __future__ import annotations

import ipaddress
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from sluice.client.batches import MAX_FILE_BYTES
from sluice.common.settings import BrokerSettings
from sluice.gateway.chat import MAX_CHOICES
from sluice.schemas.models import MAX_OUTPUT_TOKENS

DEFAULT_BAND = "interactive"
"""The band of a request that names none, on an open gateway or for a key without its own."""
DEFAULT_MAX_TOKENS = 256
"""Output tokens of a request that names no ``max_tokens`` (Sluice needs a bound)."""


class ApiKey(BaseModel):
    """One API key: who it is (its tenant) and which bands it may use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(
        default=None, min_length=1, max_length=128, description="A label for logs."
    )
    key: SecretStr | None = Field(default=None, description="The key itself.")
    key_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-fA-F]{64}$",
        description="Or the hex SHA-256 digest of the key (the config then holds no secret).",
    )
    tenant: str = Field(min_length=1, max_length=128, description="The key's tenant.")
    bands: list[str] = Field(
        default_factory=list,
        description="Bands x-sluice-priority may choose (besides its default band).",
    )
    default_band: str | None = Field(
        default=None, min_length=1, description="Its band without the header."
    )

    @model_validator(mode="after")
    def _one_key(self) -> ApiKey:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("an API key entry needs exactly one of key and key_sha256")
        if self.key is not None and not self.key.get_secret_value():
            raise ValueError("an API key must not be empty")
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``): reachable only from this
    machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


class GatewaySettings(BrokerSettings):
    """Settings of one gateway (``sluice gateway``)."""

    model_config = SettingsConfigDict(
        env_prefix="SLUICE_GATEWAY_", extra="forbid", populate_by_name=True
    )
    toml_section: ClassVar[str] = "gateway"
    redact_inputs: ClassVar[bool] = True

    host: str = Field(default="127.0.0.1", min_length=1, description="Address to bind.")
    port: int = Field(default=8080, ge=0, le=65535, description="Port to bind (0: any free).")
    keys: list[ApiKey] = Field(
        default_factory=list, description="API keys; empty: the gateway is open."
    )
    allow_open_non_loopback: bool = Field(
        default=False,
        description="Serve without keys on a non-loopback host (refused otherwise).",
    )
    open_tenant: str = Field(
        default="default", min_length=1, max_length=128, description="An open gateway's tenant."
    )
    default_band: str = Field(
        default=DEFAULT_BAND, min_length=1, description="Band of a request that names none."
    )
    tokenizer: str | None = Field(
        default=None,
        description="A local tokenizer.json: prompts are sent as the engine's token ids.",
    )
    chat_template: str | None = Field(
        default=None,
        description="The model's chat template: its tokenizer_config.json, or a .jinja file "
        "(none: Sluice's neutral template).",
    )
    max_choices: int = Field(
        default=MAX_CHOICES,
        ge=1,
        le=128,
        description="The most choices (n) a request may ask for; each runs as a request.",
    )
    default_max_tokens: int = Field(
        default=DEFAULT_MAX_TOKENS,
        ge=1,
        le=MAX_OUTPUT_TOKENS,
        description="Output tokens of a request without max_tokens.",
    )
    models_ttl_s: float = Field(
        default=2.0, gt=0, description="How long the fleet's model list is reused."
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="A request not finished by then is cancelled (504)."
    )
    max_file_bytes: int = Field(
        default=MAX_FILE_BYTES, ge=1024, description="Largest file upload (POST /v1/files)."
    )
    batch_sweep_every_s: float = Field(
        default=5.0,
        gt=0,
        description="How often unfinished batches are moved on (and dead submitters resumed).",
    )
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="Largest request body (413 beyond)."
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A request body not received whole by then is refused (408): a client "
        "that stops sending holds no connection for long.",
    )

    @model_validator(mode="after")
    def _guarded(self) -> GatewaySettings:
        if not self.keys and not is_loopback(self.host) and not self.allow_open_non_loopback:
            raise ValueError(
                f"no API keys are configured and host {self.host} is not a loopback address: "
                "an open gateway would serve anyone who can reach it. Configure keys, bind "
                "127.0.0.1, or set allow_open_non_loopback = true"
            )
        return self

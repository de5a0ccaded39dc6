"""The base of every process's settings: environment variables ``SLUICE_…`` and an optional
TOML config file (``SLUICE_CONFIG_FILE`` or ``--config``), read once per process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import AliasChoices, Field, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from sluice.common.errors import ConfigError
from sluice.common.transport import DEFAULT_INBOX_PREFIX, BrokerAuth

__all__ = ["BrokerSettings", "ConfigError", "SluiceSettings"]

S = TypeVar("S", bound="SluiceSettings")


class SluiceSettings(BaseSettings):
    """Common base. Subclasses set ``toml_section`` (their table in the config file) and their
    own env prefix. Precedence: explicit arguments > environment > config file > defaults."""

    # allow_inf_nan: "inf" or "nan" for a duration or a rate is a mistake, not a setting (an
    # infinite lease never expires; inf seconds overflow where they become a deadline).
    model_config = SettingsConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)
    toml_section: ClassVar[str] = ""
    redact_inputs: ClassVar[bool] = False
    """Leave the given values out of the message of invalid settings (a part whose settings
    hold secrets, such as the gateway's API keys, sets it): the message names each setting
    and what is wrong with it, never its value."""
    _config_file: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = cls._config_file
        if path is not None:
            section = cls.toml_section
            toml = TomlConfigSettingsSource(settings_cls, toml_file=path)
            sources.append(_Section(settings_cls, toml, section))
        return tuple(sources)

    @classmethod
    def load(cls: type[S], config_file: str | Path | None = None, **overrides: Any) -> S:
        """Read the settings once: overrides, then ``SLUICE_…`` variables, then the file."""
        path = config_file or os.environ.get("SLUICE_CONFIG_FILE") or None
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"config file not found: {path}")
        cls._config_file = Path(path) if path else None
        cls._reject_unknown_environment()
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise ConfigError(f"invalid {cls.__name__}:\n{cls._describe(exc)}") from exc
        except ValueError as exc:  # TOML syntax errors and similar
            where = f" from {path}" if path else ""
            raise ConfigError(f"cannot read settings for {cls.__name__}{where}: {exc}") from exc

    @classmethod
    def _describe(cls, exc: ValidationError) -> str:
        if not cls.redact_inputs:
            return str(exc)
        lines = []
        for e in exc.errors(include_input=False, include_url=False, include_context=False):
            loc = ".".join(str(p) for p in e["loc"]) or "(settings)"
            lines.append(f"{loc}\n  {e['msg']}")
        return "\n".join(lines)

    @classmethod
    def _reject_unknown_environment(cls) -> None:
        """A variable with this part's prefix that names no setting is a mistake (a typo, or a
        setting that was renamed): say so instead of ignoring it, as the config file does."""
        prefix = str(cls.model_config.get("env_prefix", "")).upper()
        if not prefix:
            return
        known = {name.upper() for name in cls.model_fields}
        unknown = sorted(
            k
            for k in os.environ
            if k.upper().startswith(prefix) and k[len(prefix) :].upper() not in known
        )
        if unknown:
            raise ConfigError(
                f"unknown {cls.__name__} variables in the environment: {', '.join(unknown)} "
                f"(settings are {prefix}<NAME> for the names in docs/configuration.md)"
            )


SECTIONS = ("dispatcher", "agent", "client", "gateway")
"""The tables of the config file, one per part (each part's ``toml_section``)."""


class _Section(PydanticBaseSettingsSource):
    """One table of the TOML file (``[dispatcher]``, ``[agent]``, …) plus its top-level keys."""

    def __init__(
        self, settings_cls: type[BaseSettings], inner: TomlConfigSettingsSource, section: str
    ) -> None:
        super().__init__(settings_cls)
        self._inner = inner
        self._section = section

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        data = self._inner()
        for key, value in data.items():  # a misspelled table would be ignored by every part
            if isinstance(value, dict) and key not in SECTIONS:
                raise ValueError(
                    f"unknown table [{key}] in the config file: the tables are "
                    + ", ".join(f"[{s}]" for s in SECTIONS)
                )
        fields = set(self.settings_cls.model_fields)
        out = {k: v for k, v in data.items() if k in fields}
        table = data.get(self._section, {}) if self._section else {}
        if not isinstance(table, dict):
            raise ValueError(f"[{self._section}] in the config file must be a table")
        out.update(table)
        return out


def _shared(name: str) -> AliasChoices:
    """A broker setting every process reads from the same variable (``SLUICE_NATS_…``)."""
    return AliasChoices(name, f"SLUICE_{name.upper()}")


class BrokerSettings(SluiceSettings):
    """The settings every process that talks to NATS has: where the broker is and who this
    process is on it (its broker role, ``sluice auth init``). Each is read from
    ``SLUICE_NATS_…``, the same variable for every part, so one env file per role serves
    whichever process runs it."""

    nats_url: str = Field(
        default="nats://127.0.0.1:4222",
        validation_alias=_shared("nats_url"),
        description="The NATS server to connect to, or a cluster's servers separated by commas.",
    )
    nats_user: str | None = Field(
        default=None,
        validation_alias=_shared("nats_user"),
        description="The broker user this process connects as (none: anonymous).",
    )
    nats_password: SecretStr | None = Field(
        default=None,
        validation_alias=_shared("nats_password"),
        description="That user's password.",
    )
    nats_creds: str | None = Field(
        default=None,
        validation_alias=_shared("nats_creds"),
        description="A NATS .creds file (JWT and nkey) instead of a user and password.",
    )
    nats_inbox_prefix: str = Field(
        default=DEFAULT_INBOX_PREFIX,
        min_length=1,
        validation_alias=_shared("nats_inbox_prefix"),
        description="Replies to this process arrive under this prefix (its role's own).",
    )
    nats_tls_ca: str | None = Field(
        default=None,
        validation_alias=_shared("nats_tls_ca"),
        description="A CA file to verify the broker's certificate with (turns TLS on).",
    )
    nats_tls_cert: str | None = Field(
        default=None,
        validation_alias=_shared("nats_tls_cert"),
        description="A client certificate, for a broker that verifies clients.",
    )
    nats_tls_key: str | None = Field(
        default=None,
        validation_alias=_shared("nats_tls_key"),
        description="The client certificate's key.",
    )

    def broker_auth(self) -> BrokerAuth:
        """This process's broker identity and TLS, for :func:`sluice.common.transport.connect`."""
        return BrokerAuth(
            user=self.nats_user,
            password=None if self.nats_password is None else self.nats_password.get_secret_value(),
            creds_file=self.nats_creds,
            inbox_prefix=self.nats_inbox_prefix,
            tls_ca_file=self.nats_tls_ca,
            tls_cert_file=self.nats_tls_cert,
            tls_key_file=self.nats_tls_key,
        )

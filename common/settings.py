"""The base of every process's settings: environment variables ``SLUICE_…`` and an optional
TOML config file (``SLUICE_CONFIG_FILE`` or ``--config``), read once per process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from sluice.common.errors import ConfigError

__all__ = ["ConfigError", "SluiceSettings"]

S = TypeVar("S", bound="SluiceSettings")


class SluiceSettings(BaseSettings):
    """Common base. Subclasses set ``toml_section`` (their table in the config file) and their
    own env prefix. Precedence: explicit arguments > environment > config file > defaults."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True)
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
            raise ConfigError(f"cannot read settings for {cls.__name__}: {exc}") from exc

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
        fields = set(self.settings_cls.model_fields)
        out = {k: v for k, v in data.items() if k in fields}
        table = data.get(self._section, {}) if self._section else {}
        if not isinstance(table, dict):
            raise ValueError(f"[{self._section}] in the config file must be a table")
        out.update(table)
        return out

"""Per-model quotas and their accounting (pure).

Besides the fleet-wide limits of :class:`~sluice.dispatcher.admission.AdmissionConfig` (the
global limit and each band's), every model has its own quota, at three levels at once:

- the model's **total**;
- **per band** within the model;
- **per tenant** within the model, with a default for tenants not listed.

A request runs only when every level has room. A model counts in **requests** (each running
request uses 1), in **tokens** (each uses its prompt plus its maximum output, what it may put
in a worker's KV cache) or in **engine_ms** (each uses its estimated engine time in
milliseconds, :mod:`sluice.dispatcher.enginetime`, priced when it is queued: a limit of 60,000
lets a tenant have a minute of engine work running at once), chosen per model. A level without
a limit is unlimited; a limit of 0 admits nothing at that level. One model's quota is
untouched by another's traffic: isolation between models is quotas that sum to at most the
global limit.

Order: a request whose tenant is full does not hold up other tenants queued behind it (the plan
looks past up to 256 such requests per queue); a request blocked by its model's total or its
model-band limit holds up its queue, also with token quotas, so a large request cannot be
starved by smaller ones slipping past it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

Unit = Literal["requests", "tokens", "engine_ms"]
Level = tuple[str, ...]
"""A quota level: ``("model", m)``, ``("model-band", m, b)`` or ``("model-tenant", m, t)``."""


@dataclass(frozen=True)
class ModelQuota:
    """One model's limits (None: unlimited at that level)."""

    limit: int | None = None
    band_limits: Mapping[str, int] = field(default_factory=dict)
    tenant_limits: Mapping[str, int] = field(default_factory=dict)
    default_tenant_limit: int | None = None
    unit: Unit = "requests"

    def __post_init__(self) -> None:
        values = [self.limit, self.default_tenant_limit]
        values += [*self.band_limits.values(), *self.tenant_limits.values()]
        if any(v is not None and v < 0 for v in values):
            raise ValueError("quota limits must be >= 0")
        if self.unit not in ("requests", "tokens", "engine_ms"):
            raise ValueError(f"unit must be requests, tokens or engine_ms, not {self.unit!r}")

    def tenant_limit(self, tenant: str) -> int | None:
        return self.tenant_limits.get(tenant, self.default_tenant_limit)

    def cost(self, prompt_tokens: int, max_tokens: int, engine_ms: int = 0) -> int:
        """What one request uses of this model's quota."""
        if self.unit == "requests":
            return 1
        return prompt_tokens + max_tokens if self.unit == "tokens" else engine_ms


@dataclass(frozen=True)
class Quotas:
    """Every model's quota; models not listed get ``default``."""

    models: Mapping[str, ModelQuota] = field(default_factory=dict)
    default: ModelQuota = field(default_factory=ModelQuota)
    _known: dict[tuple[str, str, str], _Levels] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """(model, band, tenant) -> its levels: every decision asks three times (plan, booking,
    release), and the answer changes only with the quotas, which are a new object then."""

    def of(self, model: str) -> ModelQuota:
        return self.models.get(model, self.default)

    def _levels(self, model: str, band: str, tenant: str) -> _Levels:
        key = (model, band, tenant)
        known = self._known.get(key)
        if known is None:
            q = self.of(model)
            limits = (
                (("model", model), q.limit),
                (("model-band", model, band), q.band_limits.get(band)),
                (("model-tenant", model, tenant), q.tenant_limit(tenant)),
            )
            if len(self._known) >= _KNOWN_MAX:  # tenants come and go: stay bounded
                self._known.clear()
            known = self._known[key] = _Levels(tuple(lv for lv, _ in limits), limits, q)
        return known

    def levels(self, model: str, band: str, tenant: str) -> Sequence[tuple[Level, int | None]]:
        """The levels a request of ``model``/``band``/``tenant`` uses, with their limits."""
        return self._levels(model, band, tenant).limits

    def use(
        self,
        model: str,
        band: str,
        tenant: str,
        prompt_tokens: int,
        max_tokens: int,
        engine_ms: int = 0,
    ) -> tuple[Sequence[Level], int]:
        """The levels a request uses and how much of each (in its model's unit)."""
        known = self._levels(model, band, tenant)
        return known.levels, known.quota.cost(prompt_tokens, max_tokens, engine_ms)


class _Levels(NamedTuple):
    levels: tuple[Level, ...]
    limits: tuple[tuple[Level, int | None], ...]
    quota: ModelQuota


_KNOWN_MAX = 65_536


class Usage:
    """What is running at every quota level (in each model's unit)."""

    def __init__(self) -> None:
        self._used: Counter[Level] = Counter()

    def used(self, level: Level) -> int:
        return self._used[level]

    def blocked_by(
        self,
        quotas: Quotas,
        model: str,
        band: str,
        tenant: str,
        amount: int,
        planned: Mapping[Level, int] | None = None,
    ) -> Level | None:
        """The first level without room for ``amount`` more (counting ``planned`` on top of
        what runs), or None if every level has room."""
        for level, limit in quotas.levels(model, band, tenant):
            if limit is None:
                continue
            extra = planned.get(level, 0) if planned else 0
            if self._used[level] + extra + amount > limit:
                return level
        return None

    def add(self, levels: Iterable[Level], amount: int) -> None:
        for level in levels:
            self._used[level] += amount

    def remove(self, levels: Iterable[Level], amount: int) -> None:
        for level in levels:
            self._used[level] -= amount
            if self._used[level] <= 0:
                del self._used[level]

    def snapshot(self) -> dict[Level, int]:
        return dict(self._used)


def usage_ratios(
    quotas: Quotas, models: Iterable[str], used: Mapping[Level, int]
) -> dict[tuple[str, str], float]:
    """The used share of every per-model level with a limit, keyed ``(kind, name)`` with
    names ``MODEL``, ``MODEL/BAND`` and ``MODEL/TENANT`` (for metrics). Tenants not named in
    a model's ``tenant_limits`` share one key, ``MODEL/*``: the fullest of them against the
    default tenant limit, so the keys stay bounded by the configuration. A limit of 0 counts
    as full once anything uses it."""
    out: dict[tuple[str, str], float] = {}
    for m in models:
        q = quotas.of(m)
        if q.limit is not None:
            out["model", m] = _ratio(used.get(("model", m), 0), q.limit)
        for b, limit in q.band_limits.items():
            out["model-band", f"{m}/{b}"] = _ratio(used.get(("model-band", m, b), 0), limit)
        for t, limit in q.tenant_limits.items():
            out["model-tenant", f"{m}/{t}"] = _ratio(used.get(("model-tenant", m, t), 0), limit)
        if q.default_tenant_limit is not None:
            others = [
                n
                for lv, n in used.items()
                if lv[0] == "model-tenant" and lv[1] == m and lv[2] not in q.tenant_limits
            ]
            out["model-tenant", f"{m}/*"] = _ratio(max(others, default=0), q.default_tenant_limit)
    return out


def _ratio(used: int, limit: int) -> float:
    if limit <= 0:
        return 1.0 if used > 0 else 0.0
    return used / limit

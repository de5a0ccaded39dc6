"""What the fleet serves: its models and bands, from a dispatcher's stats (``Client.stats``),
reused for ``models_ttl_s`` so that a request costs no query.

A model is known exactly when the dispatcher would accept it (``DispatcherStats.models``: its
configured models, or those its workers announced), so the gateway's 404 is the dispatcher's
``unknown_model``, said before the request is queued. A model missing from a list older than
:data:`MISS_REFRESH_S` is looked up again first (a worker of a new model may just have
joined). No dispatcher answering is a 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluice.client import Client, SluiceError
from sluice.gateway.errors import BadRequest, model_not_found
from sluice.gateway.keys import PRIORITY_HEADER

MISS_REFRESH_S = 0.5
"""A model not in a list at least this old is looked up again before it is refused (a burst of
requests for an unknown model costs one query per this interval)."""
STATS_TIMEOUT_S = 2.0
"""How long a dispatcher has to answer the stats query."""


@dataclass(frozen=True)
class Fleet:
    """The fleet as a dispatcher last described it."""

    models: tuple[str, ...]
    bands: tuple[str, ...]
    at_s: float


class Catalog:
    """The fleet's models and bands, refreshed from a dispatcher at most every ``ttl_s``."""

    def __init__(
        self, client: Client, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._clock = clock
        self._fleet: Fleet | None = None
        self._lock = asyncio.Lock()
        self._refresh: asyncio.Task[None] | None = None

    async def fleet(self, max_age_s: float | None = None) -> Fleet:
        """The fleet, looked up again if older than ``max_age_s`` (default ``ttl_s``); raises
        the client's ``ServiceUnavailable`` (a 503) when no dispatcher answers. Past the TTL
        (no ``max_age_s``) the list it has is answered at once and looked up again in the
        background: a busy dispatcher can take a while to answer the stats query, and every
        request arriving meanwhile waited for it (up to ``STATS_TIMEOUT_S`` on its first
        token). A lookup that fails forgets the list, so the next request waits for an answer
        and gets the 503."""
        limit = self._ttl_s if max_age_s is None else max_age_s
        fleet = self._fleet
        if fleet is not None and self._clock() - fleet.at_s < limit:
            return fleet
        if fleet is not None and max_age_s is None:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.create_task(self._refresh_now(), name="catalog-refresh")
            return fleet
        return await self._lookup(limit)

    async def _refresh_now(self) -> None:
        try:
            await self._lookup(self._ttl_s)
        except SluiceError:  # ServiceUnavailable above all: no dispatcher answered
            self._fleet = None

    async def close(self) -> None:
        """Stop a lookup running in the background."""
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)

    async def _lookup(self, limit: float) -> Fleet:
        async with self._lock:  # concurrent requests share one query
            fleet = self._fleet
            if fleet is not None and self._clock() - fleet.at_s < limit:
                return fleet
            stats = await self._client.stats(timeout_s=STATS_TIMEOUT_S)
            self._fleet = Fleet(
                tuple(stats.models), tuple(b.band for b in stats.bands), self._clock()
            )
            return self._fleet

    async def require_model(self, model: str) -> None:
        """Raise ``NotFound`` (404) unless the fleet serves ``model``."""
        if model in (await self.fleet()).models:
            return
        if model not in (await self.fleet(max_age_s=MISS_REFRESH_S)).models:
            raise model_not_found(model)

    async def require_band(self, band: str) -> None:
        """Raise ``BadRequest`` (400) unless the fleet has ``band``."""
        bands = (await self.fleet()).bands
        if band not in bands:
            raise BadRequest(
                f"unknown band {band!r}; the fleet's bands are {list(bands)}",
                param=PRIORITY_HEADER,
                code="unknown_band",
            )

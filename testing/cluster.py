"""An in-process Sluice cluster: one dispatcher and N simulated agents on one NATS server.

Used by ``sluice demo`` and the tests; production runs each part as its own process
(``sluice dispatcher``, ``sluice agent``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from sluice.agent.runtime import Agent, Observer
from sluice.agent.runtime.settings import AgentSettings
from sluice.common.errors import ConfigError, internal_error
from sluice.dispatcher.routing import RoutingPolicy
from sluice.dispatcher.runtime import Dispatcher
from sluice.dispatcher.runtime.settings import DispatcherSettings
from sluice.testing.engines import build_engine

log = logging.getLogger("sluice.testing")


@contextmanager
def _typed_settings_errors() -> Iterator[None]:
    """Settings that do not validate (an environment variable, say) as a ``ConfigError``: a
    command says it in one line, not a pydantic traceback."""
    try:
        yield
    except ValidationError as exc:
        raise ConfigError(f"invalid settings: {exc}") from exc


class LocalCluster:
    """``async with LocalCluster(url, workers=4) as cluster:`` runs a dispatcher and agents
    ``worker-0`` … ``worker-N-1``; every part is stopped when the block exits. ``policy``
    replaces the dispatcher's routing policy (for comparisons). ``with_dispatcher=False``
    starts only the agents (the dispatchers run elsewhere, for instance as processes)."""

    def __init__(
        self,
        nats_url: str,
        *,
        workers: int = 4,
        dispatcher: dict[str, Any] | None = None,
        agent: dict[str, Any] | None = None,
        observer: Observer | None = None,
        policy: RoutingPolicy | None = None,
        agent_for: Callable[[str], dict[str, Any]] | None = None,
        with_dispatcher: bool = True,
    ) -> None:
        self.nats_url = nats_url
        with _typed_settings_errors():
            self.dispatcher_settings = DispatcherSettings(nats_url=nats_url, **(dispatcher or {}))
        self._agent_overrides = dict(agent or {})
        self._agent_for = agent_for
        self._observer = observer
        self.with_dispatcher = with_dispatcher
        self.dispatcher = Dispatcher(self.dispatcher_settings, policy=policy)
        self.agents: list[Agent] = [self._new_agent(f"worker-{i}") for i in range(workers)]

    def _new_agent(self, worker_id: str) -> Agent:
        own = self._agent_for(worker_id) if self._agent_for is not None else {}
        with _typed_settings_errors():
            settings = AgentSettings(
                nats_url=self.nats_url, worker_id=worker_id, **{**self._agent_overrides, **own}
            )
        return Agent(settings, build_engine(settings), observer=self._observer)

    async def add_agent(self, worker_id: str) -> Agent:
        agent = self._new_agent(worker_id)
        self.agents.append(agent)
        await agent.start()
        return agent

    async def start(self) -> LocalCluster:
        if self.with_dispatcher:
            await self.dispatcher.start()
        for a in self.agents:
            await a.start()
        return self

    async def stop(self, *, drain: bool = True) -> None:
        """Stop every part; one that fails to stop is logged and counted, and the others are
        still stopped. ``drain``: the agents finish what they run first (up to their
        ``drain_timeout_s``)."""
        for a in self.agents:
            try:
                await a.stop(drain=drain)
            except Exception:
                internal_error(log, "testing.cluster", "agent %s did not stop cleanly", a.worker_id)
        try:
            await self.dispatcher.stop()
        except Exception:
            internal_error(log, "testing.cluster", "the dispatcher did not stop cleanly")

    async def __aenter__(self) -> LocalCluster:
        try:
            return await self.start()
        except BaseException:
            await self.stop()
            raise

    async def __aexit__(self, et: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an error or an interrupt, nothing waits for running requests (Ctrl-C of a
        # benchmark waited 30 s for each agent's drain).
        await self.stop(drain=et is None)

"""Running Sluice locally: an embedded ``nats-server``, an in-process cluster (a dispatcher
and simulated agents) and ``sluice gateway`` as a child process. Used by the tests,
``sluice demo``, ``sluice nats`` and the benchmarks.

The names below are imported when first used, not with the package: ``sluice agent`` imports
``sluice.testing.engines``, and must not load the dispatcher (whose metrics would then be
served, all zero, on every agent's ``/metrics``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.testing.cluster import LocalCluster
    from sluice.testing.errors import NatsServerError
    from sluice.testing.natsserver import EmbeddedNats, NatsCluster

__all__ = ["EmbeddedNats", "LocalCluster", "NatsCluster", "NatsServerError"]

_HOMES = {
    "LocalCluster": "sluice.testing.cluster",
    "NatsServerError": "sluice.testing.errors",
    "EmbeddedNats": "sluice.testing.natsserver",
    "NatsCluster": "sluice.testing.natsserver",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'sluice.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)

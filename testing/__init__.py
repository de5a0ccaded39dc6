"""Running Sluice locally: an embedded ``nats-server``, an in-process cluster (a dispatcher
and simulated agents) and ``sluice gateway`` as a child process. Used by the tests,
``sluice demo``, ``sluice nats`` and the benchmarks."""

from sluice.testing.cluster import LocalCluster
from sluice.testing.errors import NatsServerError
from sluice.testing.natsserver import EmbeddedNats, NatsCluster

__all__ = ["EmbeddedNats", "LocalCluster", "NatsCluster", "NatsServerError"]

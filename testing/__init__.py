"""Running Sluice locally: an embedded ``nats-server`` and an in-process cluster (a dispatcher
and simulated agents). Used by the tests, ``sluice demo`` and ``sluice nats``."""

from sluice.testing.cluster import LocalCluster
from sluice.testing.natsserver import EmbeddedNats, NatsServerError

__all__ = ["EmbeddedNats", "LocalCluster", "NatsServerError"]

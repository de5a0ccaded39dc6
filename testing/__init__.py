"""Running Sluice locally: an embedded ``nats-server`` and an in-process cluster (a dispatcher
and simulated agents). Used by the tests, ``sluice demo`` and ``sluice nats``."""

from sluice.testing.cluster import LocalCluster
from sluice.testing.errors import NatsServerError
from sluice.testing.natsserver import EmbeddedNats

__all__ = ["EmbeddedNats", "LocalCluster", "NatsServerError"]

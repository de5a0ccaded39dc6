"""The Sluice dispatcher's pure core: admission, quotas, aging, routing, the cache index and
lease bookkeeping, over plain data with time passed in. The live runtime is
:mod:`sluice.dispatcher.runtime`; the simulator drives this same core."""

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.routing import Candidate, LeastLoaded, RouteRequest, RoutingPolicy
from sluice.dispatcher.scheduler import Dispatch, Request, Scheduler, WorkerInfo

__all__ = [
    "AdmissionConfig",
    "Candidate",
    "Dispatch",
    "LeastLoaded",
    "Request",
    "RouteRequest",
    "RoutingPolicy",
    "Scheduler",
    "WorkerInfo",
]

"""The Sluice dispatcher: global admission and worker selection (pure core + NATS runtime)."""

from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.routing import Candidate, LeastLoaded, RouteRequest, RoutingPolicy
from sluice.dispatcher.runtime import Dispatcher
from sluice.dispatcher.scheduler import Dispatch, Request, Scheduler, WorkerInfo
from sluice.dispatcher.settings import DispatcherSettings

__all__ = [
    "AdmissionConfig",
    "Candidate",
    "Dispatch",
    "Dispatcher",
    "DispatcherSettings",
    "LeastLoaded",
    "Request",
    "RouteRequest",
    "RoutingPolicy",
    "Scheduler",
    "WorkerInfo",
]

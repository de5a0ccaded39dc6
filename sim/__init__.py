"""The simulator (pure): the simulated engine and its profiles, traces, workloads, baseline
policies and the discrete-event replay. Agents drive the simulated engine through their
``Engine`` protocol; the command line wires it in."""

from sluice.sim.engine import EngineError, Finished, SimEngine, Step, TokensOut
from sluice.sim.kvcache import KVCache
from sluice.sim.profiles import PROFILES, REFERENCE, EngineProfile, get_profile

__all__ = [
    "PROFILES",
    "REFERENCE",
    "EngineError",
    "EngineProfile",
    "Finished",
    "KVCache",
    "SimEngine",
    "Step",
    "TokensOut",
    "get_profile",
]

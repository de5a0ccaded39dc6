"""Simulation: engine cost models and profiles (pure; shared by the agent and the replay)."""

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

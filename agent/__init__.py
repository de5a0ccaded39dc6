"""The Sluice agent: runs beside one GPU engine (simulated here) and speaks the protocol."""

from sluice.agent.runtime import Agent
from sluice.agent.settings import AgentSettings

__all__ = ["Agent", "AgentSettings"]

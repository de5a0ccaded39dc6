"""The live agent: drives one engine and speaks the Sluice protocol over NATS."""

from sluice.agent.runtime.app import Agent, Observer
from sluice.agent.runtime.settings import AgentSettings

__all__ = ["Agent", "AgentSettings", "Observer"]

"""Errors raised by the agent."""

from __future__ import annotations


class AgentError(Exception):
    """Base class of agent errors."""


class AgentNotStarted(AgentError):
    """The agent was used before ``start()``."""


class AgentBrokerUnreachable(AgentError):
    """The agent could not connect to NATS at start."""


class EngineError(AgentError):
    """The engine cannot run a request (for example one larger than its whole KV cache)."""


class KVEventError(AgentError):
    """A KV event frame or payload that cannot be decoded (it is counted and dropped)."""

"""Errors raised by the agent."""

from __future__ import annotations


class AgentError(Exception):
    """Base class of agent errors."""


class AgentNotStarted(AgentError):
    """The agent was used before ``start()``."""

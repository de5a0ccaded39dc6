"""Sluice: global admission control and cache-aware routing for LLM inference fleets.

The parts, bottom up: ``sluice.schemas`` (the wire), the pure core of ``sluice.dispatcher``
and ``sluice.agent``, ``sluice.sim`` (the simulator), the runtimes (``sluice.common``,
``sluice.dispatcher.runtime``, ``sluice.agent.runtime``, ``sluice.client``), ``sluice.testing``
(a local cluster), ``sluice.gateway`` (the OpenAI-compatible HTTP face over the client) and
``sluice.cli`` (the command line). docs/architecture.md has the layers.
"""

__version__ = "0.1.0"

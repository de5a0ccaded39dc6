"""Sluice: global admission control and cache-aware routing for LLM inference fleets.

The parts are ``sluice.schemas`` (wire contract), ``sluice.client`` (producers),
``sluice.dispatcher`` (scheduler), ``sluice.agent`` (beside each engine) and ``sluice.sim``.
"""

__version__ = "0.1.0"

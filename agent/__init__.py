"""The Sluice agent's pure parts (what it accepts, how it reports); its live runtime is
:mod:`sluice.agent.runtime`."""

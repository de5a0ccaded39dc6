"""The agent's memory bounds, named once: the engine adapters take their defaults from here,
and the agent's settings theirs from the same names."""

from __future__ import annotations

KV_MAX_BLOCKS = 1_000_000
"""Engine KV blocks the agent mirrors from an engine's KV events at most (a mirror whose
removal events got lost would otherwise keep them forever; the oldest stored go first)."""
RECORD_MAX_BLOCKS = 200_000
"""Prompt block hashes the ``openai-http`` engine's record of served prompts keeps at most
(its cache digest while the engine sends no KV events; least recently served go first)."""

"""The agent's memory bounds and streaming defaults, named once: the engine adapters take
their defaults from here, and the agent's settings theirs from the same names."""

from __future__ import annotations

KV_MAX_BLOCKS = 1_000_000
"""Engine KV blocks the agent mirrors from an engine's KV events at most (a mirror whose
removal events got lost would otherwise keep them forever; the oldest stored go first)."""
KV_SILENCE_S = 10.0
"""How long after a request that stored a whole block has finished an ``openai-http`` agent
following KV events waits for the first one before it warns that none has come (an endpoint
both sides connect to, a wrong topic, an engine that publishes none)."""
RECORD_MAX_BLOCKS = 200_000
"""Prompt block hashes the ``openai-http`` engine's record of served prompts keeps at most
(its cache digest while the engine sends no KV events; least recently served go first)."""
TOKEN_FLUSH_MS = 50.0
"""How long the agent coalesces a request's later tokens before it publishes them (its first
goes out at once). An engine streams a request's tokens every 10-30 ms, so at 15 ms nearly every
chunk carried one token: one publish, one broker delivery and one gateway write per token. At
50 ms (20 chunks a second, smooth to a reader) a chunk carries 2-5, and on the head-to-head
fleet the time to the first token's median fell by about 150 ms (docs/BENCHMARKS.md, "Where live
Sluice lost its first tokens")."""

"""The core's defaults that more than one type uses, named once.

Each setting has one default: the core's config types (``CacheAwareConfig``,
``AdmissionConfig``, ...) take theirs from here or define it themselves, the components they
build take it from the config, and the runtime's settings take theirs from the config types.
"""

from __future__ import annotations

GUESS_TTL_S = 120.0
"""How long a routed prefix counts as cached on its worker without a report."""
MAX_PROMPT_TOKENS = 1_000_000
"""The longest prompt a request may have (``AdmissionConfig.max_prompt_tokens``)."""
INDEX_MAX_BLOCKS = 1_000_000
"""Block hashes the cache index keeps at most."""
INDEX_MEMO_MIN_HOLDERS = 64
"""A chain of index entries that at least this many workers hold (a system prompt every worker
caches) is walked once per change of its holds, not once per decision: the native index's
memo (``CacheIndex.match_split``)."""
STICKY_WINDOW_S = 30.0
"""A prefix sticks to its replicas this long after it was last routed there; flaps are
counted over the same window."""
HOT_TAU_S = 60.0
"""Time constant of a prefix's decayed traffic share."""
REPLICA_HEADROOM = 1.5
MAX_REPLICAS = 64
KEY_TOKENS = 1024
"""Leading prompt tokens that name a prefix (stickiness, replica budgets, flaps)."""
PREFIX_MAX_KEYS = 200_000
"""Prefix keys remembered at most, least recently used forgotten first: by the stickiness
and traffic shares (:mod:`~sluice.dispatcher.affinity`), and by the flap meter."""
CANCELLED_MAX_IDS = 100_000
"""Cancelled request ids a dispatcher remembers at most (within the duplicate window)."""
KEPT_ADVISORIES_MAX = 100_000
"""Max-deliveries advisories kept at most (in the broker) for the leader to serve."""
REMOVED_WORKERS_MAX = 10_000
"""Workers whose lease expired that the lease table remembers at most, so that their late
heartbeats are told apart from a fresh registration (oldest forgotten first)."""
FEEDBACK_WINDOW_S = 60.0
SCALE_UP_WAIT_S = 5.0
SCALE_UP_SUSTAIN_S = 10.0
SCALE_DOWN_IDLE_S = 300.0


def key_blocks(block_tokens: int, key_tokens: int = KEY_TOKENS) -> int:
    """Leading blocks that name a prefix: ``key_tokens`` rounded up to whole blocks."""
    return max(1, -(-key_tokens // block_tokens))


SHORTLIST_WORKERS = 8
"""Least-loaded workers a cache-aware decision scores besides the prefix's holders, its
replicas and the newly joined workers (0: every candidate)."""
SHORTLIST_PER_GROUP = 2
"""Least-loaded holders (or replicas) of each match length a cache-aware decision scores
first; the others of the group are scored only as far as one could still win."""

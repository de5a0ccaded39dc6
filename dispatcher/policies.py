"""Routing-policy construction (pure): the one place a policy is built from its name and the
routing configuration, for the live dispatcher (from its settings) and the replay alike."""

from __future__ import annotations

from sluice.dispatcher.cacheaware import CacheAware, CacheAwareConfig
from sluice.dispatcher.flaps import FlapMeter
from sluice.dispatcher.routing import LeastLoaded, RoutingPolicy

LIVE_POLICIES = ("cache-aware", "least-loaded")
"""The policies the live dispatcher offers (``routing_policy``)."""


def build_policy(name: str, routing: CacheAwareConfig, seed: int = 0) -> RoutingPolicy:
    """The policy called ``name`` (one of :data:`LIVE_POLICIES`) with ``routing``'s settings."""
    if name == "cache-aware":
        return CacheAware(routing)
    if name == "least-loaded":
        return LeastLoaded(seed)
    raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(LIVE_POLICIES)}")


def flap_meter(routing: CacheAwareConfig) -> FlapMeter:
    """The flap meter for a routing configuration: prefixes named as the policy names them,
    over its stickiness window."""
    return FlapMeter(routing.key_blocks, routing.sticky_window_s, routing.prefix_max_keys)

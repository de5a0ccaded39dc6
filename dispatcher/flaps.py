"""Routing flaps (pure): how often a prefix moves to a worker that has not served it lately.

The one definition, used by the live dispatcher (the counters ``sluice_dispatcher_flaps_total``
and ``sluice_dispatcher_flap_decisions_total``) and by the replay (``flap_rate``) alike, for
every policy: a booked decision **flaps** when its prefix (the leading ``key_blocks`` blocks
of its prompt, named as :func:`~sluice.dispatcher.affinity.prefix_key` names it) was booked
less than ``window_s`` ago and the worker it goes to is none of the workers it was booked on
since (the stickiness window's own rule: a replica last used ``window_s`` ago no longer holds
the prefix). A prefix spreading over new replicas therefore counts one flap per new replica; a
request without a full block, or whose prefix nobody served lately, never flaps. The flap rate
is flaps per booked decision. Memory is bounded by ``max_keys`` (least recently used first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from sluice.dispatcher.affinity import prefix_key
from sluice.dispatcher.defaults import PREFIX_MAX_KEYS, STICKY_WINDOW_S


class FlapMeter:
    """Counts decisions and flaps (see the module docstring)."""

    def __init__(
        self, key_blocks: int, window_s: float = STICKY_WINDOW_S, max_keys: int = PREFIX_MAX_KEYS
    ) -> None:
        if key_blocks < 1 or window_s <= 0 or max_keys < 1:
            raise ValueError("key_blocks, window_s and max_keys must be positive")
        self.key_blocks = key_blocks
        self.window_s = window_s
        self.max_keys = max_keys
        self.decisions = 0
        self.flaps = 0
        self._served: OrderedDict[int, OrderedDict[str, float]] = OrderedDict()
        """Per prefix key, the workers it was booked on and when, least recently first (so a
        prefix booked on every worker of a large fleet costs no walk over them)."""

    @property
    def rate(self) -> float:
        return self.flaps / self.decisions if self.decisions else 0.0

    def booked(self, block_hashes: Sequence[int], worker_id: str, now_s: float) -> bool:
        """Count a booked decision; returns whether it flapped."""
        self.decisions += 1
        key = prefix_key(block_hashes, self.key_blocks)
        if key is None:
            return False
        served = self._served.get(key)
        if served is None:
            served = self._served[key] = OrderedDict()
            if len(self._served) > self.max_keys:
                self._served.popitem(last=False)
        else:
            self._served.move_to_end(key)
        window = self.window_s
        while served:  # least recently booked first: only those that leave are looked at
            w, t = next(iter(served.items()))
            if now_s - t < window:
                break
            del served[w]
        flapped = bool(served) and worker_id not in served
        served.pop(worker_id, None)
        latest = served[next(reversed(served))] if served else now_s
        served[worker_id] = now_s
        if now_s < latest:  # a clock that went back: keep the order by time
            by_time = sorted(served.items(), key=lambda wt: wt[1])
            served.clear()
            served.update(by_time)
        if flapped:
            self.flaps += 1
        return flapped

"""Queue bounds sized by an acceptable wait (``queue_max_wait_s``): every feedback tick, a
wait-sized band's bound becomes its admission rate times the wait
(:func:`~sluice.dispatcher.feedback.wait_bound`), and its stream's ``max_msgs`` is updated when
the bound moved by a tenth or more. The broker then refuses the publish that would exceed it,
so the producer gets ``QueueFull`` at once."""

from __future__ import annotations

import logging

from sluice.dispatcher.feedback import wait_bound
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.state import BROKER_ERRORS, State
from sluice.dispatcher.runtime.streams import band_stream

log = logging.getLogger("sluice.dispatcher")


class QueueSizing:
    """Keeps the wait-sized bands' stream bounds current."""

    def __init__(self, state: State) -> None:
        self.state = state
        s = state.settings
        self.bounds = {b: s.queue_max_msgs_of(b) for b in s.queue_max_wait_s}
        """The bound each wait-sized band's stream has now (queued requests, not held ones)."""
        self._busy = False

    def tick(self, now: float) -> None:
        """Start an update in the background (one at a time: a slow broker skips ticks)."""
        if self.bounds and not self._busy:
            self._busy = True
            self.state.spawn(self.update(now), "queue-sizing")

    async def update(self, now: float) -> None:
        try:
            await self._update(now)
        finally:
            self._busy = False

    async def _update(self, now: float) -> None:
        st, s = self.state, self.state.settings
        series = st.feedback.keys()  # (model, band) pairs with admissions or rejections
        for band, wait_s in s.queue_max_wait_s.items():
            rate = sum(
                st.feedback.figures(model, b, 0, 0, now).admitted_per_s
                for model, b in series
                if b == band
            )
            current = self.bounds[band]
            if rate <= 0:
                # Nothing admitted lately (workers gone or saturated): the queue is not
                # draining, so it must not open up; keep the bound it has.
                metrics.QUEUE_BOUND.labels(band).set(current)
                continue
            bound = wait_bound(rate, wait_s, s.queue_min_msgs, s.queue_max_msgs_of(band))
            metrics.QUEUE_BOUND.labels(band).set(bound)
            if abs(bound - current) < max(1, current // 10):
                continue
            try:
                await st.js.update_stream(band_stream(s, band, bound))
            except BROKER_ERRORS:
                log.warning("could not resize the queue of band %s to %d", band, bound)
                continue
            log.info(
                "queue of band %s: bound %d (%.2f admitted/s x %g s)", band, bound, rate, wait_s
            )
            self.bounds[band] = bound

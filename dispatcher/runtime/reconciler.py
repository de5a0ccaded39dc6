"""Reconciliation on a timer and on demand: the books against the workers' reports, corrected
both ways (:mod:`sluice.dispatcher.reconcile`); every correction is counted
(``sluice_dispatcher_reconcile_drift_total{kind}``) and logged with its request ids, and a
large one is a warning. On demand: a request on ``names.RECONCILE_SUBJECT`` (``sluice
reconcile``) runs one now and answers its :class:`~sluice.schemas.models.ReconcileReport`."""

from __future__ import annotations

import logging
import time

from nats.aio.msg import Msg

from sluice.common.aio import wait_event
from sluice.dispatcher.reconcile import Reconciliation
from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.answers import Answers, respond
from sluice.dispatcher.runtime.intake import Intake
from sluice.dispatcher.runtime.state import State
from sluice.schemas.codec import encode
from sluice.schemas.models import ReconcileReport

log = logging.getLogger("sluice.dispatcher")


class Reconciler:
    """Runs reconciliations and answers for their retries."""

    def __init__(self, state: State, answers: Answers, intake: Intake) -> None:
        self.state = state
        self.answers = answers
        self.intake = intake

    @property
    def grace_s(self) -> float:
        s = self.state.settings
        return s.reconcile_grace_s if s.reconcile_grace_s is not None else 2 * s.lease_s

    async def loop(self) -> None:
        st = self.state
        while st.running:
            if await wait_event(st.stopping, st.settings.reconcile_every_s):
                return  # stopping: the loop ends at once, not at its next turn
            await self.run()

    async def run(self) -> ReconcileReport:
        """One reconciliation: correct the books, answer what ended, report. A standby's
        books only follow the leader's: it reconciles nothing."""
        st = self.state
        if not st.leading():
            return ReconcileReport(dispatcher_id=st.settings.dispatcher_id)
        done = st.scheduler.reconcile(time.monotonic(), self.grace_s)
        await self._settle(done)
        d = done.drift
        report = ReconcileReport(
            dispatcher_id=st.settings.dispatcher_id,
            orphaned=list(d.orphaned),
            moved=[rid for rid, _ in d.moved],
            adopted=[rid for rid, _ in d.adopted],
            unknown=[rid for rid, _ in d.unknown],
        )
        for kind in ("orphaned", "moved", "adopted", "unknown"):
            ids = getattr(report, kind)
            if ids:
                metrics.RECONCILE_DRIFT.labels(kind).inc(len(ids))
        if d.size:
            level = logging.WARNING if d.size > st.settings.reconcile_warn_drift else logging.INFO
            log.log(
                level,
                "reconciliation corrected %d: orphaned %s, moved %s, adopted %s, unknown %s",
                d.size,
                report.orphaned,
                report.moved,
                report.adopted,
                report.unknown,
            )
        st.kick.set()
        return report

    async def _settle(self, done: Reconciliation) -> None:
        # The requeued first: they must leave the queue before anything awaits
        # (settle_requeued), or the hand-off loop may hand them out again meanwhile.
        await self.intake.settle_requeued(done.requeued)
        for e in done.ended:
            await self.answers.end(e)

    async def on_request(self, msg: Msg) -> None:
        if not self.state.leading():
            return  # the leader answers
        report = await self.run()
        await respond(msg, encode(report))

"""The outbox (pure): finished requests whose reports are not delivered yet.

A report is the request's result (stored in JetStream first) and its completion (then sent
to the dispatcher, which acks the request on it). Reports wait here while the broker or the
dispatcher is unreachable, and are retried after every heartbeat (in the background, one pass
at a time).

Overflow policy: the outbox never drops a report. At ``max_reports`` it is *full*: the agent
refuses new assignments (reason ``outbox``) until reports get through, so only requests
already running can add to it, and it never holds more than ``max_reports`` plus the agent's
capacity.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass

from sluice.schemas.models import Completion, Result

DEFAULT_MAX_REPORTS = 1024


@dataclass
class Report:
    """A finished request still to be reported: its result (None once stored, or for a
    failure) and its completion."""

    result: Result | None
    completion: Completion


class Outbox:
    """Undelivered reports by request id, bounded as the module docstring says."""

    def __init__(self, max_reports: int = DEFAULT_MAX_REPORTS) -> None:
        if max_reports < 1:
            raise ValueError("max_reports must be >= 1")
        self.max_reports = max_reports
        self._reports: dict[str, Report] = {}

    def __len__(self) -> int:
        return len(self._reports)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reports

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._reports))

    @property
    def full(self) -> bool:
        return len(self._reports) >= self.max_reports

    @property
    def succeeded(self) -> Container[str]:
        """Request ids whose undelivered report is a success (a failure report does not mean
        it ran: its next attempt may run here)."""
        return _Succeeded(self._reports)

    def unstored(self) -> list[str]:
        """Request ids that succeeded here and whose result is not stored yet: the worker
        still holds them (its heartbeat says so), so that a dispatcher that finds no result
        for one, and it in no report, does not run it again."""
        return [rid for rid, r in self._reports.items() if r.completion.ok and r.result is not None]

    def put(self, report: Report) -> None:
        self._reports[report.completion.request_id] = report

    def get(self, request_id: str) -> Report | None:
        return self._reports.get(request_id)

    def done(self, report: Report) -> None:
        """The report was delivered. A newer report of the same request (its next attempt
        here, put while this one was on its way) stays."""
        rid = report.completion.request_id
        if self._reports.get(rid) is report:
            del self._reports[rid]


class _Succeeded:
    def __init__(self, reports: dict[str, Report]) -> None:
        self._reports = reports

    def __contains__(self, request_id: object) -> bool:
        report = self._reports.get(request_id) if isinstance(request_id, str) else None
        return report is not None and report.completion.ok

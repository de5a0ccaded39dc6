"""Two races of a request that failed on its worker (found with engines that die over HTTP):
its next attempt must run, not be taken for the failed one."""

from __future__ import annotations

from dataclasses import replace

from sluice.agent import reports
from sluice.agent.acceptance import review
from sluice.agent.outbox import Outbox, Report
from sluice.dispatcher.admission import AdmissionConfig
from sluice.dispatcher.routing import LeastLoaded
from sluice.dispatcher.scheduler import Scheduler
from sluice.schemas.models import Assignment, SubmitRequest

from .test_scheduler import _req, _worker


def test_a_failure_report_in_the_outbox_does_not_confirm_the_next_attempt() -> None:
    out = Outbox()
    out.put(Report(None, reports.failure("w", "r1", 1, "engine died")))
    request = SubmitRequest(
        request_id="r1", model="m", prompt_text="hi", max_tokens=2, submitted_unix_ms=1
    )
    assignment = Assignment(request=request, attempt=2, dispatcher_id="d", queued_s=0.0)
    kw = {"draining": False, "in_flight": 0, "capacity": 4, "outbox_full": False}
    verdict = review(assignment, running={}, reported=out.succeeded, models=["m"], **kw)
    assert verdict.action == "run"  # the failed attempt did not run it: this one must
    assert "r1" in out and "r1" not in out.succeeded


def test_a_heartbeat_from_before_a_failure_does_not_book_the_retry_there() -> None:
    s = Scheduler(AdmissionConfig(), LeastLoaded(0), models=["m"])
    s.update_worker(replace(_worker("a"), reported_in_flight=frozenset()))
    s.update_worker(_worker("b"))
    s.enqueue(_req("r"), 0.0)
    [d] = [d for d in s.plan(0.0) if d.worker_id == "a"] or [s.plan(0.0)[0]]
    assert s.book(d, 0.0)
    w = d.worker_id
    stale = replace(_worker(w), reported_in_flight=frozenset({"r"}))
    s.update_worker(stale)
    retry = s.fail("r", w, 1)
    assert retry is not None and s.is_queued("r")
    assert not s.adopt("r", w, 0.1)  # its heartbeat predates the failure report
    s.update_worker(stale)  # and again: still listed there, still not booked there
    assert s.is_queued("r")
    s.update_worker(_worker(w))  # a heartbeat without it: adoption works again
    assert s.adopt("r", w, 0.2) and s.booking("r") is not None

"""What the agent accepts (pure): the answer to one assignment, given what it runs.

An assignment from an older leadership epoch than the newest the agent has seen (in an
assignment or a leader's announcement) is refused first: it comes from a deposed leader.
A repeated hand-off of a request it runs (the dispatcher's earlier reply was lost) is
confirmed, and so is one it finished whose report is still on its way (running it again would
only duplicate work). Otherwise it refuses while draining, when full, when its outbox is at
its bound (see :mod:`sluice.agent.outbox`) or for a model it does not serve.
"""

from __future__ import annotations

from collections.abc import Collection, Container
from dataclasses import dataclass
from typing import Literal

from sluice.schemas.models import Assignment


@dataclass(frozen=True)
class Verdict:
    action: Literal["run", "confirm", "refuse"]
    """``run``: start it; ``confirm``: accept, it runs (or ran) here already; ``refuse``."""
    reason: str = ""
    """Why it was refused: ``epoch: …``, ``draining``, ``full: …``, ``outbox: …`` or
    ``model: …``."""


def review(
    assignment: Assignment,
    *,
    running: Container[str],
    reported: Container[str],
    draining: bool,
    in_flight: int,
    capacity: int,
    outbox_full: bool,
    models: Collection[str],
    epoch: int = 0,
) -> Verdict:
    """The agent's answer to ``assignment`` (``reported``: requests that finished here whose
    successful report is still in its outbox; a failed one is run again if assigned;
    ``epoch``: the newest leadership epoch seen)."""
    if assignment.epoch < epoch:
        return Verdict(
            "refuse",
            f"epoch: assignment of epoch {assignment.epoch} from {assignment.dispatcher_id}, "
            f"but the leader is at epoch {epoch} (a deposed dispatcher)",
        )
    rid = assignment.request.request_id
    if rid in running or rid in reported:
        return Verdict("confirm")
    if draining:
        return Verdict("refuse", "draining")
    if in_flight >= capacity:
        return Verdict("refuse", f"full: {in_flight}/{capacity} running")
    if outbox_full:
        return Verdict("refuse", "outbox: reports wait for the broker")
    if assignment.request.model not in models:
        return Verdict("refuse", f"model: {assignment.request.model!r} is not served here")
    return Verdict("run")

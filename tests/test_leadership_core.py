"""The pure election (dispatcher/leadership.py) and the agent's epoch rule: several
dispatchers against a model of the leader key, on one simulated clock, never lead at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.agent.acceptance import review
from sluice.dispatcher.leadership import Leadership
from sluice.schemas.models import Assignment, SubmitRequest

LEASE = 3.0


@dataclass
class FakeKey:
    """The leader key as the broker keeps it: a revision (0: absent), the stream's last
    sequence, and when it was last written (the bucket's TTL is one lease)."""

    revision: int = 0
    seq: int = 0
    written_s: float = -math.inf

    def current(self, now_s: float) -> int:
        return self.revision if now_s - self.written_s < LEASE else 0

    def write(self, last: int, now_s: float) -> int | None:
        """Compare-and-set on ``last`` (0: create); the new revision, or None."""
        if self.current(now_s) != last:
            return None
        self.seq += 1
        self.revision, self.written_s = self.seq, now_s
        return self.revision


def step(lead: Leadership, key: FakeKey, now_s: float, wins: list[int]) -> None:
    """What the runtime's Election.step does, against the model key."""
    lead.expired(now_s)
    action = lead.due(now_s)
    if action == "campaign":
        seen = key.current(now_s)
        if seen and not lead.observed(seen, now_s):
            return
        revision = key.write(seen, now_s)
        if revision is None:
            lead.beaten(now_s)
            return
        lead.won(revision, now_s, now_s)
        wins.append(lead.epoch)
        action = "renew"
    if action == "renew":
        revision = key.write(lead.revision, now_s)
        if revision is None:
            lead.step_down(now_s)
        else:
            lead.renewed(revision, now_s)


def _new(n: int) -> list[Leadership]:
    return [Leadership(lease_s=LEASE, learn_s=1.0, settle_s=1.0, started_s=0.0) for _ in range(n)]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(2, 4),
    moves=st.lists(
        st.tuples(st.integers(0, 3), st.floats(0.0, 2.5 * LEASE, allow_nan=False)),
        min_size=1,
        max_size=200,
    ),
)
def test_never_two_leaders_and_epochs_only_grow(n: int, moves: list[tuple[int, float]]) -> None:
    """Any interleaving, with any pauses (a dispatcher that is not picked for a while is
    paused, or its messages are slow): at no time do two of them count themselves leader, a
    dispatcher only dispatches while it leads, and every new leader's epoch is greater."""
    leads, key, wins = _new(n), FakeKey(), []
    now = 0.0
    for who, dt in moves:
        now += dt
        step(leads[who % n], key, now, wins)
        assert sum(lead.leading(now) for lead in leads) <= 1
        for lead in leads:
            assert not lead.may_dispatch(now) or lead.leading(now)
    assert wins == sorted(set(wins))


def test_a_lone_dispatcher_leads_at_once_and_keeps_leading() -> None:
    (lead,), key, wins = _new(1), FakeKey(), []
    step(lead, key, 0.0, wins)
    assert lead.leading(0.0) and wins == [lead.epoch]
    now = 0.0
    while now < 60:
        now += lead.wake_in(now)
        step(lead, key, now, wins)
        assert lead.leading(now)
    assert len(wins) == 1


def test_a_standby_takes_over_within_a_lease_of_the_last_renewal() -> None:
    a, b = _new(2)
    key, wins = FakeKey(), []
    step(a, key, 0.0, wins)
    now = 0.0
    while now < 10:  # both run; a renews, b stands by
        now = round(now + 0.1, 6)
        step(a, key, now, wins)
        step(b, key, now, wins)
        assert a.leading(now) and not b.leading(now)
    last_renewal = key.written_s
    while not b.leading(now):  # a dies
        now = round(now + 0.1, 6)
        step(b, key, now, wins)
    assert LEASE <= now - last_renewal <= LEASE + b.poll_s + 0.1
    assert b.epoch > a.epoch
    assert not a.leading(now)  # a's own clock says so too: it would not act any more


def test_a_new_leader_learns_before_it_dispatches() -> None:
    lead = Leadership(lease_s=LEASE, learn_s=2.0, settle_s=0.5, started_s=0.0, catch_up_s=6.0)
    lead.won(7, 10.0, 10.0)
    assert not lead.may_dispatch(10.2)  # settling: a last hand-off may still show
    assert not lead.may_dispatch(10.6, unbooked=3)  # what runs is not booked here yet
    assert lead.may_dispatch(10.7, unbooked=0)
    assert lead.may_dispatch(10.8, unbooked=5)  # once open, open for the term
    late = Leadership(lease_s=LEASE, learn_s=2.0, settle_s=0.5, started_s=0.0, catch_up_s=6.0)
    late.won(8, 10.0, 10.0)
    assert not late.may_dispatch(15.9, unbooked=1)
    late.renewed(9, 15.0)
    assert late.may_dispatch(16.0, unbooked=1)  # waited catch_up_s: go on
    fresh = Leadership(lease_s=LEASE, learn_s=2.0, settle_s=0.5, started_s=0.0)
    fresh.won(1, 0.0, 0.0)
    assert not fresh.may_dispatch(1.0)  # followed the heartbeats for less than learn_s


def test_a_renewal_that_finds_another_revision_deposes_at_once() -> None:
    a, b = _new(2)
    key, wins = FakeKey(), []
    step(a, key, 0.0, wins)
    key.write(key.revision, 0.5)  # someone else wrote the key (b took it over)
    step(a, key, a.next_s, wins)
    assert not a.leading(a.next_s) and a.role == "follower"
    assert not b.leading(a.next_s)


def _assignment(epoch: int) -> Assignment:
    request = SubmitRequest(request_id="r1", model="sim", prompt_tokens=[1], submitted_unix_ms=0)
    return Assignment(request=request, attempt=1, dispatcher_id="d-old", queued_s=0.0, epoch=epoch)


def test_an_agent_refuses_an_assignment_of_an_older_epoch() -> None:
    kw: dict[str, object] = {
        "reported": set(),
        "draining": False,
        "in_flight": 0,
        "capacity": 4,
        "outbox_full": False,
        "models": ["sim"],
    }
    old = review(_assignment(3), running=set(), epoch=5, **kw)  # type: ignore[arg-type]
    assert old.action == "refuse" and old.reason.startswith("epoch:")
    # ...even for a request it runs: a deposed leader's repeat is no confirmation
    repeat = review(_assignment(3), running={"r1"}, epoch=5, **kw)  # type: ignore[arg-type]
    assert repeat.action == "refuse"
    assert review(_assignment(5), running=set(), epoch=5, **kw).action == "run"  # type: ignore[arg-type]
    assert review(_assignment(6), running=set(), epoch=5, **kw).action == "run"  # type: ignore[arg-type]

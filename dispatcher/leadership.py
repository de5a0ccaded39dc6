"""Leadership among dispatchers (pure): one of any number of dispatchers leads; the others
follow, warm, and one of them takes over when the leader stops renewing.

The lease is one key in a KV bucket (the runtime's :mod:`~sluice.dispatcher.runtime.election`
does the broker side). This module decides, on plain data with time passed in:

- a **follower** campaigns every ``poll_s``: it creates the key if it is absent, or takes it
  over (compare-and-set on the revision it saw) once that revision has stayed the same for a
  whole lease on its own clock, that is the leader has not renewed for ``lease_s``;
- a **leader** renews the key (compare-and-set on its last revision) every ``renew_every_s``,
  and counts itself leader only until ``valid_s`` after it *sent* its last successful renewal.
  ``valid_s`` is two thirds of the lease, so a leader that stalls (a pause, a slow broker)
  stops acting a third of a lease before any follower can take over; a renewal that finds
  another revision (someone took over) deposes it at once;
- its **epoch** is the revision of the write that made it leader: strictly greater than
  every earlier write, hence than every earlier leader's epoch. Agents refuse assignments of
  an older epoch than the newest they saw, which covers what the timing cannot (a leader
  paused between its last check and its send);
- a new leader dispatches only once it has followed the fleet's heartbeats for ``learn_s``,
  led for ``settle_s`` (at most ``learn_s``: a request its predecessor handed off just before
  it was deposed shows in a heartbeat first), and booked every request the workers report
  running (their messages come back to it from the broker; it adopts them), or waited
  ``catch_up_s`` for that: so nothing runs twice and the fleet-wide limits count what runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["follower", "leader"]
Action = Literal["campaign", "renew", "wait"]

RENEWS_PER_LEASE = 3
"""The leader renews three times per lease: one lost renewal costs nothing."""
VALID_SHARE = 2 / 3
"""The share of the lease a leader acts on after sending a renewal."""
POLLS_PER_LEASE = 10
"""A follower looks at the key ten times per lease."""


@dataclass
class Leadership:
    """One dispatcher's view of the election. ``started_s``: when it began following."""

    lease_s: float
    learn_s: float
    settle_s: float
    started_s: float
    catch_up_s: float = math.inf
    """How long a new leader waits at most for the requests the workers report running to be
    booked here (their messages return within the ack wait)."""
    role: Role = "follower"
    epoch: int = 0
    revision: int = 0
    """A leader's last write (its compare-and-set base)."""
    valid_until_s: float = -math.inf
    leading_since_s: float = math.inf
    following_since_s: float = field(init=False)
    next_s: float = field(init=False)
    learned: bool = False
    """This term's learning is over (it dispatches until the term ends)."""
    seen_revision: int | None = None
    """A follower: the leader key's revision it last saw, and since when (its own clock)."""
    seen_since_s: float = -math.inf

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.following_since_s = self.started_s
        self.next_s = self.started_s

    @property
    def renew_every_s(self) -> float:
        return self.lease_s / RENEWS_PER_LEASE

    @property
    def valid_s(self) -> float:
        return self.lease_s * VALID_SHARE

    @property
    def poll_s(self) -> float:
        return self.lease_s / POLLS_PER_LEASE

    # ------------------------------------------------------------------ questions

    def leading(self, now_s: float) -> bool:
        """Whether it may act as the leader now (its lease has not run out locally)."""
        return self.role == "leader" and now_s < self.valid_until_s

    def may_dispatch(self, now_s: float, unbooked: int = 0) -> bool:
        """Whether it may hand off now: leading, and done learning (for the rest of the term,
        once it was). ``unbooked``: requests the workers report running that are not booked
        here (yet)."""
        if not self.leading(now_s):
            return False
        if self.learned:
            return True  # once open, it stays open for the term
        led_s = now_s - self.leading_since_s
        self.learned = (
            now_s - self.following_since_s >= self.learn_s
            and led_s >= min(self.settle_s, self.learn_s)
            and (unbooked == 0 or led_s >= self.catch_up_s)
        )
        return self.learned

    def due(self, now_s: float) -> Action:
        """What the election should do now."""
        if now_s < self.next_s:
            return "wait"
        return "renew" if self.role == "leader" else "campaign"

    def wake_in(self, now_s: float) -> float:
        """Seconds until something is due: the next attempt, or a leader's local expiry."""
        until = self.next_s
        if self.role == "leader":
            until = min(until, self.valid_until_s)
        return max(0.0, until - now_s)

    # ------------------------------------------------------------------ follower events

    def observed(self, revision: int, now_s: float) -> bool:
        """The key holds ``revision`` (another dispatcher's lease): True if it has not changed
        for a whole lease, so it may be taken over (compare-and-set on ``revision``)."""
        if revision != self.seen_revision:
            self.seen_revision, self.seen_since_s = revision, now_s
        if now_s - self.seen_since_s >= self.lease_s:
            return True
        self.next_s = now_s + self.poll_s
        return False

    def won(self, revision: int, sent_s: float, now_s: float) -> None:
        """Its create or take-over (sent at ``sent_s``) was written at ``revision``: it leads."""
        self.role = "leader"
        self.epoch = self.revision = revision
        self.valid_until_s = sent_s + self.valid_s
        self.leading_since_s = now_s
        self.learned = False
        self.seen_revision = None
        self.next_s = now_s  # renew at once: the renewal writes the epoch into the value

    def beaten(self, now_s: float) -> None:
        """Its campaign failed (another dispatcher was first, or the broker is away)."""
        self.next_s = now_s + self.poll_s

    # ------------------------------------------------------------------ leader events

    def renewed(self, revision: int, sent_s: float) -> None:
        """A renewal sent at ``sent_s`` was written at ``revision``."""
        self.revision = revision
        self.valid_until_s = max(self.valid_until_s, sent_s + self.valid_s)
        self.next_s = sent_s + self.renew_every_s

    def renew_failed(self, now_s: float) -> None:
        """A renewal did not reach the broker: try again soon (it still leads until
        ``valid_until_s``)."""
        self.next_s = now_s + self.poll_s

    def expired(self, now_s: float) -> bool:
        """True (and it becomes a follower) if it led and its lease ran out unrenewed."""
        if self.role == "leader" and now_s >= self.valid_until_s:
            self.step_down(now_s)
            return True
        return False

    def step_down(self, now_s: float) -> None:
        """It no longer leads (deposed, lease run out, or resigned): it follows again and
        must learn again before it may dispatch."""
        self.role = "follower"
        self.valid_until_s = -math.inf
        self.leading_since_s = math.inf
        self.learned = False
        self.following_since_s = now_s
        self.seen_revision = None
        self.next_s = now_s + self.poll_s

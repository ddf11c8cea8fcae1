"""One member's side of error-check rounds (pure): holding at a failed event, answering the
others' rounds, and what to do once a round is decided. The vote itself is
:mod:`cpgbroker.cluster.errorcheck_vote`; docs/architecture.md, "Error-check rounds", tells
the story.

Theory of operation
-------------------
* A member that fails to apply (or record) event ``S`` for a reason the stream does not
  explain *stalls* there (:meth:`Stall.fail`): it counts ``S`` as applied, keeps every event
  delivered after it in order (:meth:`Stall.hold`), vouches only for ``S - 1`` (:meth:`applied`)
  and multicasts its outcome (the :class:`Answer` returned).
* Every ready member that delivers another member's outcome for ``S`` has delivered ``S``
  before it (total order): it answers ``ok`` at once, or, stalled itself at an earlier event,
  once its replay has applied ``S`` (:meth:`Stall.pay_owed`).
* A decided round (:class:`Decided`) is settled (:meth:`Stall.settle`): the members whose
  outcome lost leave (:class:`Leave`); a member that was not asked but has the failed event
  applied resynchronises (:class:`Resync`); the member stalled at that event takes the way
  forward the majority took (:class:`Proceed`) and replays what it kept.

Owns: the stalled event and the events kept behind it, the answers given and owed for open
rounds, the open rounds and the last decided ones (for status), all bounded by the open
rounds plus the window of :data:`~cpgbroker.cluster.errorcheck_vote.ROUNDS_KEPT` decided ones.
Never applies events, writes logs or sends: it returns actions, and the runtime executes
them.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import attrs

from cpgbroker.cluster.codec import OK, ErrorCheck
from cpgbroker.cluster.errorcheck_vote import ErrorRounds, Round

# Decided rounds ``cpgbroker status`` shows (the newest; at most ROUNDS_KEPT are kept).
ROUNDS_SHOWN = 20


@attrs.frozen
class Answer:
    """Multicast ``ErrorCheck(me, seq, outcome)``."""

    seq: int
    outcome: str


@attrs.frozen
class Decided:
    """A round was decided: record it, then act on :meth:`Stall.settle`."""

    round: Round


@attrs.frozen
class Leave:
    """This member's outcome lost: it leaves the cluster."""

    reason: str


@attrs.frozen
class Resync:
    """This member's state has an event the cluster failed applied (it was catching up when
    the round opened): it must not serve that state."""

    reason: str


@attrs.frozen
class Proceed:
    """The majority failed at the event this member is stalled at: take the same way forward
    (``outcome`` says which), then replay what was kept."""

    outcome: str
    event: Any
    sender: int


Action = Answer | Decided | Leave | Resync | Proceed


class Stall:
    def __init__(self, me: int) -> None:
        self.me = me
        # The event this member failed to apply or record, (seq, outcome, event, sender),
        # while the cluster decides.
        self.stalled: tuple[int, str, Any, int] | None = None
        # Events delivered meanwhile, (event, sender), applied in order if it stays.
        self.kept: collections.deque[tuple[Any, int]] = collections.deque()
        self.votes = ErrorRounds()
        # Open rounds this member answered, and rounds it owes an answer once it has applied
        # their event (it was stalled at an earlier one when they opened). Both forget a round
        # once it is decided.
        self._answered: set[int] = set()
        self.owed: list[int] = []

    @property
    def rounds(self) -> list[Round]:
        """The newest decided rounds (at most ROUNDS_SHOWN), oldest first."""
        decided = self.votes.decided
        return list(itertools.islice(decided, max(0, len(decided) - ROUNDS_SHOWN), None))

    def applied(self, event_seq: int) -> int:
        """The last event this member vouches for: while it is stalled at a failed event, the
        one before (the failed one may yet be undone by the round's decision)."""
        return event_seq if self.stalled is None else self.stalled[0] - 1

    def fail(self, seq: int, outcome: str, event: Any, sender: int) -> Answer:
        """This member failed at event ``seq``: stall there; its outcome goes to the vote."""
        self.stalled = (seq, outcome, event, sender)
        self._answered.add(seq)
        if seq in self.owed:
            self.owed.remove(seq)  # our answer is this error, not "ok"
        return Answer(seq, outcome)

    def hold(self, event: Any, sender: int) -> None:
        """An event delivered while stalled: applied (in order) once the round lets us go on."""
        self.kept.append((event, sender))

    def next_kept(self) -> tuple[Any, int] | None:
        """The next event kept while stalled, to apply now; None while stalled or when none
        is left."""
        if self.stalled is not None or not self.kept:
            return None
        return self.kept.popleft()

    def on_error_check(
        self, e: ErrorCheck, ready: list[int], halted: int | None
    ) -> list[Answer | Decided]:
        """Another member's (or our own) outcome for ``e.seq``; ``ready`` are the ready members
        now, ``halted`` the event this member stopped at, if a stop request stopped it."""
        if halted is not None and e.seq > halted:
            return []  # never applied it, and leaving: the round goes on without this member
        if self.votes.is_decided(e.seq):
            return []  # a late outcome (a member not asked): the round is over
        out: list[Answer | Decided] = []
        if e.member in ready and e.seq not in self._answered and self.me in ready:
            # Every member that delivers this has delivered event e.seq before it; it has
            # applied it unless it is itself held at an earlier error.
            self._answered.add(e.seq)
            if self.stalled is None or self.stalled[0] > e.seq:
                out.append(Answer(e.seq, OK))
            else:
                self.owed.append(e.seq)
        r = self.votes.record(e.seq, e.member, e.outcome, ready)
        if r is not None:
            out.append(self._decided(r))
        return out

    def pay_owed(self, seq: int) -> list[Answer]:
        """This member has applied up to ``seq``: the answers it owed for those events."""
        due = [s for s in self.owed if s <= seq]
        for s in due:
            self.owed.remove(s)
        return [Answer(s, OK) for s in due]

    def members_left(self, left: list[int]) -> list[Decided]:
        return [self._decided(r) for r in self.votes.members_left(left)]

    def _decided(self, r: Round) -> Decided:
        self._answered.discard(r.seq)
        if r.seq in self.owed:
            self.owed.remove(r.seq)  # decided without us: no answer is owed any more
        return Decided(r)

    def settle(
        self, r: Round, halted: bool, installed_from: tuple[int, int] | None
    ) -> list[Leave | Resync | Proceed]:
        """What this member does about decided round ``r``. ``installed_from`` is the
        (seq, updater) of the state update it installed, if any."""
        me = self.me
        if me in r.losers:
            mine = dict(r.outcomes)[me]
            return [
                Leave(
                    f"error-check at event {r.seq}: this member's outcome ({mine}) lost to the "
                    f"majority's ({r.decision}); leaving"
                )
            ]
        if r.decision.startswith("apply-error") and me not in dict(r.outcomes) and not halted:
            # Not asked (it became ready after the round opened): its state has the event the
            # cluster decided failed applied, unless it came in a state update from a member
            # that had failed it too.
            src = installed_from
            if src is None or src[0] < r.seq or src[1] in r.losers:
                return [
                    Resync(
                        f"error-check at event {r.seq}: the cluster failed that event, which "
                        "this member has applied (it was catching up)"
                    )
                ]
        stalled = self.stalled
        if stalled is None or stalled[0] != r.seq:
            return []
        self.stalled = None
        _seq, outcome, event, sender = stalled
        return [Proceed(outcome, event, sender)]

    def status(self) -> dict[str, Any]:
        return {
            "held_at": None if self.stalled is None else self.stalled[0],
            "pending": {
                str(seq): {
                    "outcomes": {str(m): o for m, o in sorted(r.got.items())},
                    "waiting_for": self.votes.waiting_for(seq),
                }
                for seq, r in sorted(self.votes.pending.items())
            },
            "decided": [r.as_dict() for r in self.rounds],
        }

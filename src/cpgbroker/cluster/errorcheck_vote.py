"""Error-check rounds (pure): deciding which members keep serving after an error that only
some of them may have seen.

An error the event stream explains (a missing exchange, a failed precondition) happens on
every member alike and needs nothing. An error it does not explain — a local write failing,
an unexpected exception while applying an event — may hit one member and not the others. That
member stops applying events at the failed one (``seq``) and multicasts its outcome; every
other ready member answers with its own outcome for the same ``seq``. Once every *voter* has
answered, the majority outcome wins (a tie goes to the outcome of the lowest member id, the
clock master's rule, as for digest checkpoints) and the members whose outcome lost leave.

The voters of a round are the ready members when its first outcome is delivered, less those
that leave before answering: every member computes the same set from the same stream, and a
member that becomes ready later (it was catching up) is not asked about an event it never
applied itself.

Bookkeeping is bounded: a decided round is kept only among the last :data:`ROUNDS_KEPT`, and
an outcome for a round already decided (an answer of a member that was not a voter, delivered
after the last voter's) is ignored instead of opening a round nobody answers any more. An
outcome for an event at or below the oldest round that fell out of that window is taken as
such a late one too: a round for an earlier event cannot open that late (its voters answer
as they apply events in order, and a voter stalled before it holds every later round open).
"""

from __future__ import annotations

import collections

import attrs

# Decided rounds remembered: for ``cpgbroker status`` and to recognise late outcomes.
ROUNDS_KEPT = 100


def majority(votes: dict[int, bytes]) -> tuple[bytes, tuple[int, ...]]:
    """The winning value of ``votes`` (member -> value) and the members that voted otherwise.
    Most votes wins; a tie goes to the value of the lowest member id."""
    by_value: dict[bytes, list[int]] = {}
    for m in sorted(votes):
        by_value.setdefault(votes[m], []).append(m)
    winner = max(by_value, key=lambda v: (len(by_value[v]), -min(by_value[v])))
    losers = tuple(sorted(m for v, ms in by_value.items() if v != winner for m in ms))
    return winner, losers


@attrs.frozen
class Round:
    seq: int
    # (member, outcome) of every voter that answered, in member-id order.
    outcomes: tuple[tuple[int, str], ...]
    decision: str
    # Members whose outcome lost: they leave the cluster.
    losers: tuple[int, ...]
    # Voters that left before answering.
    gone: tuple[int, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "outcomes": {str(m): o for m, o in self.outcomes},
            "decision": self.decision,
            "leaving": list(self.losers),
            "left_before_answering": list(self.gone),
        }


@attrs.define
class _Open:
    voters: list[int]
    got: dict[int, str] = attrs.Factory(dict)
    gone: list[int] = attrs.Factory(list)


class ErrorRounds:
    def __init__(self) -> None:
        self.pending: dict[int, _Open] = {}
        # The last ROUNDS_KEPT decided rounds, oldest first, and the highest event seq of a
        # round that fell out of them.
        self.decided: collections.deque[Round] = collections.deque(maxlen=ROUNDS_KEPT)
        self._seqs: set[int] = set()
        self._forgotten = 0

    def is_decided(self, seq: int) -> bool:
        """Whether the round for ``seq`` was decided (outcomes for it come too late)."""
        return seq not in self.pending and (seq in self._seqs or seq <= self._forgotten)

    def record(self, seq: int, member: int, outcome: str, ready: list[int]) -> Round | None:
        """``member``'s outcome for ``seq``; ``ready`` are the ready members now (they become
        the voters if this opens the round). The decided round once every voter answered."""
        if self.is_decided(seq):
            return None
        r = self.pending.setdefault(seq, _Open(sorted(ready)))
        if member not in r.voters:
            return None  # it was not ready when the round opened
        r.got.setdefault(member, outcome)
        return self._decide(seq)

    def members_left(self, left: list[int]) -> list[Round]:
        """Voters that left no longer count: rounds that only waited for them are decided."""
        out = []
        for seq in sorted(self.pending):
            r = self.pending[seq]
            for m in left:
                if m in r.voters and m not in r.got:
                    r.voters.remove(m)
                    r.gone.append(m)
            decided = self._decide(seq)
            if decided is not None:
                out.append(decided)
        return out

    def _decide(self, seq: int) -> Round | None:
        r = self.pending[seq]
        if any(m not in r.got for m in r.voters):
            return None
        del self.pending[seq]
        answered = {m: o for m, o in r.got.items() if m in r.voters}
        if not answered:
            return self._keep(Round(seq, (), "", (), tuple(sorted(r.gone))))
        winner, losers = majority({m: o.encode() for m, o in answered.items()})
        return self._keep(
            Round(
                seq,
                tuple(sorted(answered.items())),
                winner.decode(),
                losers,
                tuple(sorted(r.gone)),
            )
        )

    def _keep(self, r: Round) -> Round:
        decided = self.decided
        if len(decided) == decided.maxlen:
            old = decided[0].seq
            self._seqs.discard(old)
            self._forgotten = max(self._forgotten, old)
        decided.append(r)
        self._seqs.add(r.seq)
        return r

    def waiting_for(self, seq: int) -> list[int]:
        r = self.pending[seq]
        return [m for m in r.voters if m not in r.got]

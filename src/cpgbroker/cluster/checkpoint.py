"""Digest checkpoints: every member digests its model after the same event and multicasts the
digest; when every ready member's digest for that event is in, they are compared (pure).

A mismatch means some replica diverged. The majority digest wins; a tie goes to the digest of
the member with the lowest id (the clock master's rule). Members that hold a losing digest must
leave the cluster: their clients then fail over to members whose state the majority vouches for.
"""

from __future__ import annotations

import attrs

from cpgbroker.cluster.errorcheck_vote import majority


@attrs.frozen
class Verdict:
    seq: int
    agreed: bool
    winner: bytes
    # Members whose digest lost, in member-id order.
    losers: tuple[int, ...]
    digests: tuple[tuple[int, bytes], ...]


class Checkpoints:
    def __init__(self) -> None:
        self._pending: dict[int, dict[int, bytes]] = {}
        self.last: Verdict | None = None

    def record(self, seq: int, member: int, digest: bytes, members: list[int]) -> Verdict | None:
        """Record ``member``'s digest at ``seq``; return the verdict once all of ``members``
        (the ready members now) have reported."""
        got = self._pending.setdefault(seq, {})
        got[member] = digest
        return self._decide(seq, members)

    def members_changed(self, members: list[int]) -> list[Verdict]:
        """A member left: checkpoints that only waited for it can be decided now."""
        out = []
        for seq in list(self._pending):
            v = self._decide(seq, members)
            if v is not None:
                out.append(v)
        return out

    def _decide(self, seq: int, members: list[int]) -> Verdict | None:
        got = self._pending.get(seq, {})
        if not members or any(m not in got for m in members):
            return None
        del self._pending[seq]
        # Most votes wins; on a tie, the digest held by the lowest member id.
        winner, losers = majority({m: got[m] for m in members})
        verdict = Verdict(
            seq=seq,
            agreed=not losers,
            winner=winner,
            losers=losers,
            digests=tuple((m, got[m]) for m in sorted(members)),
        )
        self.last = verdict
        # Older undecided checkpoints can never complete consistently now: drop them.
        for old in [s for s in self._pending if s < seq]:
            del self._pending[old]
        return verdict

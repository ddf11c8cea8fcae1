"""Partition merges: which side keeps serving when two sides of a partition meet again (pure).

Theory of operation
-------------------
While a partition lasts, each side may apply events the other never sees; when they merge
(CPG's ``PartitionMerge``), neither side's state includes the other's. One side keeps serving
and the other side's members leave: the side with more members wins, on a tie the side that
holds the lowest member id. Both sides reach the same verdict, because each knows both sides'
members.

The winning side *shuns* the losers until CPG reports them gone: nothing they send is applied,
and they are not counted as members (:meth:`Partitions.view` filters them out of every
configuration change).

A member frozen past the token sees the others leave and come back in one ring change, which
the runtime holds until the new ring's quorum verdict. If it lost the merge, it must not apply
the others' departure first (that would requeue their unacked messages and could hand them to
its own consumers): :meth:`Partitions.lost_in` scans a held ring change for a merge this member
loses, following the members through its configuration changes without applying anything.

Owns: the shunned members. Never touches the membership view or the model: callers pass the
members at the merge and act on the verdict.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cpgbroker.cluster.membership import member_id
from cpgbroker.corosync.events import ConfChg, PartitionMerge, TotemConfChg

# Larger than any member id (nodeid << 22 | pid): the "lowest id" of a side without members.
_NO_MEMBER = 1 << 62


def merge_verdict(ev: PartitionMerge, members: Iterable[int]) -> tuple[bool, list[int]]:
    """Whether this side (``members`` at the merge) wins the merge, and the other side."""
    others = [member_id(m.nodeid, m.pid) for m in (*ev.rejoined, *ev.merged)]
    mine = [m for m in members if m not in others]
    wins = (len(mine), -min(mine, default=_NO_MEMBER)) > (
        len(others),
        -min(others, default=_NO_MEMBER),
    )
    return wins, others


class Partitions:
    def __init__(self) -> None:
        # Members that came back from the other side of a partition: ignored until they leave.
        self.shunned: set[int] = set()

    def view(self, ev: ConfChg) -> tuple[list[int], list[int], list[int]]:
        """The members, joined and left of a configuration change, shunned members left out;
        a shunned member that left is forgotten."""
        shunned = self.shunned
        members = [m for m in (member_id(x.nodeid, x.pid) for x in ev.members) if m not in shunned]
        joined = [m for m in (member_id(x.nodeid, x.pid) for x in ev.joined) if m not in shunned]
        left = [member_id(m.nodeid, m.pid) for m in ev.left]
        shunned.difference_update(left)
        return members, joined, left

    def on_merge(self, ev: PartitionMerge, members: Iterable[int]) -> tuple[bool, list[int]]:
        """Two sides merged: the verdict for this side (``members``); if it wins, the other
        side's members are shunned from here on."""
        wins, others = merge_verdict(ev, members)
        if wins:
            self.shunned.update(others)
        return wins, others

    def lost_in(self, batch: Sequence[object], start: int, members: list[int]) -> list[int] | None:
        """Scan one ring change (``batch[start:]`` up to its TotemConfChg) for a partition
        merge this member loses; the other side's members if so. ``members`` are the members
        before the change; they are followed through its ConfChgs as :meth:`view` would,
        without changing anything."""
        for x in batch[start:]:
            if isinstance(x, TotemConfChg):
                break
            if isinstance(x, ConfChg):
                members = [
                    m
                    for m in (member_id(c.nodeid, c.pid) for c in x.members)
                    if m not in self.shunned
                ]
            elif isinstance(x, PartitionMerge):
                wins, others = merge_verdict(x, members)
                if not wins:
                    return others
        return None

"""Pure CPG event types and the membership hazard tracker.

No compiled module, no I/O: the cluster layer (pure) and tests import these without the
libcpg binding. :mod:`cpgbroker.corosync.cpg` parses corosync's callbacks into them.
"""

from __future__ import annotations

import enum
from typing import TypeAlias

import attrs

# ---------------------------------------------------------------------------- events


class Reason(enum.IntEnum):
    """Why a member joined or left a group (``cpg_reason_t``)."""

    UNDEFINED = 0
    JOIN = 1
    LEAVE = 2
    NODEDOWN = 3
    NODEUP = 4
    PROCDOWN = 5


def _reason(value: int) -> Reason:
    try:
        return Reason(value)
    except ValueError:
        return Reason.UNDEFINED


@attrs.frozen
class Member:
    """A group member: a process on a node. Corosync identifies members by this pair."""

    nodeid: int
    pid: int


@attrs.frozen
class MemberChange:
    """A member that joined or left, with corosync's reason."""

    nodeid: int
    pid: int
    reason: Reason

    @property
    def member(self) -> Member:
        return Member(self.nodeid, self.pid)


@attrs.frozen
class RingId:
    """A totem ring id: the representative node and a sequence number that only grows."""

    nodeid: int
    seq: int


@attrs.frozen
class Deliver:
    """A message multicast to ``group`` by member (``nodeid``, ``pid``)."""

    group: bytes
    nodeid: int
    pid: int
    data: bytes


@attrs.frozen
class ConfChg:
    """The membership of ``group`` changed; ``members`` is the full new list."""

    group: bytes
    members: tuple[Member, ...]
    left: tuple[MemberChange, ...]
    joined: tuple[MemberChange, ...]


@attrs.frozen
class TotemConfChg:
    """The totem ring changed: its id and the node ids in it (not only group members)."""

    ring_id: RingId
    members: tuple[int, ...]


@attrs.frozen
class PartitionMerge:
    """Members came back into ``group`` through a ring merge (reason NODEUP).

    ``rejoined`` were seen leaving with NODEDOWN earlier: they lived on in another partition,
    and neither side received what the other multicast meanwhile. ``merged`` were never seen
    before (for example a process that joined in a partition formed before this node merged);
    their history is just as unknown. Either way the group's state may have diverged; what to
    do about it is the cluster layer's decision.
    """

    group: bytes
    rejoined: tuple[Member, ...]
    merged: tuple[Member, ...]


@attrs.frozen
class RingChangeSameMembers:
    """The totem ring was re-formed with exactly the same nodes (for example after a token
    loss under CPU starvation): no member change is reported, but a reconfiguration happened."""

    ring_id: RingId
    previous: RingId
    members: tuple[int, ...]


HazardEvent: TypeAlias = PartitionMerge | RingChangeSameMembers
CpgEvent: TypeAlias = Deliver | ConfChg | TotemConfChg | PartitionMerge | RingChangeSameMembers


class MembershipTracker:
    """Watches one handle's configuration events and reports the hazards they reveal.

    Pure logic, no I/O: feed it every :class:`ConfChg` and :class:`TotemConfChg` in delivery
    order; it returns the hazard events each one reveals (usually none).
    """

    def __init__(self) -> None:
        # Per group: members that left with NODEDOWN, i.e. may still be alive elsewhere.
        self._departed: dict[bytes, set[Member]] = {}
        self.ring_id: RingId | None = None
        self.ring_members: tuple[int, ...] = ()

    def feed(self, event: ConfChg | TotemConfChg) -> list[HazardEvent]:
        if isinstance(event, TotemConfChg):
            return self._totem(event)
        return self._confchg(event)

    def _totem(self, event: TotemConfChg) -> list[HazardEvent]:
        previous, previous_members = self.ring_id, self.ring_members
        self.ring_id, self.ring_members = event.ring_id, event.members
        if (
            previous is not None
            and event.ring_id != previous
            and sorted(event.members) == sorted(previous_members)
        ):
            return [RingChangeSameMembers(event.ring_id, previous, event.members)]
        return []

    def _confchg(self, event: ConfChg) -> list[HazardEvent]:
        departed = self._departed.setdefault(event.group, set())
        for change in event.left:
            if change.reason == Reason.NODEDOWN:
                departed.add(change.member)
            else:
                # LEAVE and PROCDOWN: the process itself is gone from the group for good.
                departed.discard(change.member)
        rejoined: list[Member] = []
        merged: list[Member] = []
        for change in event.joined:
            member = change.member
            if change.reason == Reason.NODEUP:
                (rejoined if member in departed else merged).append(member)
            # A fresh cpg_join (reason JOIN) starts a new history even for a pid seen before.
            departed.discard(member)
        if rejoined or merged:
            return [PartitionMerge(event.group, tuple(rejoined), tuple(merged))]
        return []

"""Quorum decisions of a member (pure: no I/O, fed by the runtime).

Corosync's votequorum decides whether this node's partition is quorate; lowest-nodeid ties,
expected votes, two-node and wait-for-all rules are all its business. What this module decides
is when the *member* may act on the CPG stream.

Two streams, no order between them
----------------------------------
CPG events and votequorum notifications arrive on different fds, so a member may read that a
new ring formed from either first. Both name the ring by the same totem ring id: CPG's
``TotemConfChg`` and votequorum's nodelist notification; votequorum's quorum notification that
follows a nodelist notification is that ring's verdict (corosync sends the nodelist during the
ring's synchronisation and the quorum state when it completes). Hence:

* :class:`QuorumView` keeps the verdict per ring (:meth:`QuorumView.verdict`). A ring the
  member never got a verdict for while newer rings already have one was superseded: treated as
  inquorate, never as quorate.
* The CPG stream of a ring change is held until the new ring's verdict is known
  (:func:`ring_change`): a ``ConfChg`` caused by the ring change (reason NODEDOWN or NODEUP)
  comes *before* the ``TotemConfChg`` that names the ring, so it is held too. In a quorate
  ring the hold lasts a few milliseconds; in an inquorate one nothing of it is ever applied:
  the member stops serving (:func:`decide`).
* A quorum loss within a ring (an operator changed expected votes) stops the member as soon as
  the notification is read, wherever the CPG stream is.

A member that lost quorum discards its state (it may have applied events the quorate side
never saw, and the quorate side moved on without it); once quorate again it joins the group as
a newcomer and takes a state update from a serving member.
"""

from __future__ import annotations

import attrs

from cpgbroker.corosync.events import ConfChg, Reason

# Verdicts kept: far more ring changes than can be waiting in one member's CPG backlog.
MAX_VERDICTS = 64

# Why a member left or joined when a ring change (not the process) caused it.
_RING_REASONS = (Reason.NODEDOWN, Reason.NODEUP)

RingKey = tuple[int, int]  # (representative nodeid, ring seq) of a totem ring id


@attrs.define
class QuorumView:
    """What votequorum said, in the order it said it."""

    quorate: bool = False
    # The ring of the last nodelist notification, awaiting its quorum verdict.
    ring: RingKey | None = None
    verdicts: dict[RingKey, bool] = attrs.field(factory=dict)
    # Highest ring seq with a verdict: an older ring without one was superseded.
    newest_seq: int = -1
    # Notifications so far (the runtime waits for the count to move).
    changes: int = 0

    def on_nodelist(self, ring: RingKey) -> None:
        self.ring = ring
        self.changes += 1

    def on_quorum(self, quorate: bool) -> None:
        """A quorum notification: the verdict for the current ring (also within a ring)."""
        self.quorate = quorate
        self.changes += 1
        if self.ring is not None:
            self.verdicts[self.ring] = quorate
            self.newest_seq = max(self.newest_seq, self.ring[1])
            while len(self.verdicts) > MAX_VERDICTS:
                del self.verdicts[next(iter(self.verdicts))]

    def verdict(self, ring: RingKey) -> bool | None:
        """Whether ``ring`` is quorate; ``None`` while votequorum has not said yet."""
        v = self.verdicts.get(ring)
        if v is not None:
            return v  # a loss within the ring (expected votes raised) overwrote it
        if ring[1] < self.newest_seq:
            return False  # superseded before its verdict: never confirmed quorate
        return None


def ring_change(ev: ConfChg) -> bool:
    """Whether a CPG ``ConfChg`` comes from a totem ring change (a member left or joined
    because a node went down or came up): then a ``TotemConfChg`` naming the new ring
    follows it."""
    return any(c.reason in _RING_REASONS for c in (*ev.left, *ev.joined))


SERVE = "serve"
HOLD = "hold"
STOP = "stop"


def decide(verdict: bool | None) -> str:
    """What the member does with a held ring change: apply it (``serve``), keep holding
    (``hold``: no verdict yet) or stop serving and resynchronise (``stop``). A member that
    does not serve yet stops too: a newcomer must not take an update inside a minority."""
    if verdict is None:
        return HOLD
    return SERVE if verdict else STOP

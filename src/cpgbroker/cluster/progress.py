"""How far every member has applied the stream, as one member knows it (pure: no I/O, no clock).

Theory of operation
-------------------
Members multicast ``Progress(member, seq)`` reports; this class keeps what they said and
derives the two things the member acts on:

* **lag** (cluster flow control): how many events the slowest ready member is behind this
  one. ``peer`` holds reports and *estimates* (every member becomes ready, or installs a state
  update, at a known event: that is where the others stand until they report more), so a
  member that never reports is seen to fall behind.
* **the stable sequence** (stable confirms, docs/architecture.md): the highest event every
  ready member, this one included, is known to have applied. Only what members reported
  themselves counts (``applied``), never estimates: a confirm promises that its message
  survives the failure of all members but one.

It also paces this member's own reports for confirms (:meth:`want_report`): a report rides on
the member's next client message if it has one; else it goes alone at most once per
``REPORT_INTERVAL``; and when the same delivered batch gave a local client output (a delivery
it will ack), it waits up to ``REPORT_RIDE_WAIT`` for that client's answer to ride on. Times are
the caller's (a monotonic clock in seconds): this module never reads one.

Owns: the reports and estimates, the confirm count last seen, the pacing times. Never touches
the model, the network or the membership (callers pass the ready members).
"""

from __future__ import annotations

# Cluster flow control: each member reports how far it has applied every PROGRESS_EVERY
# events (or fewer when ``max_lag`` is small), and a member stops multicasting new client
# traffic while the slowest member is more than ``[cluster] max_lag`` events behind it.
# Without this, corosync buffers for a slow member without limit (and never gives the memory
# back).
PROGRESS_EVERY = 1_000
# Confirms wait for every ready member's progress report (stable confirms,
# docs/architecture.md). A report rides on the member's next client batch when it has one;
# otherwise it is a message of its own, at most one per this interval: under load that bounds
# the extra CPG messages per member, and it adds at most this much to a confirm's wait.
REPORT_INTERVAL = 0.001
# When the events that asked for a report also gave a local client output (a delivery it will
# ack), the report waits at most this long for the client's answer and rides on it: at a few
# thousand messages per second that saves the consumer's member one CPG message per confirm,
# and every member the work of delivering it. The answer usually comes within a fraction of it.
REPORT_RIDE_WAIT = 0.001


class PeerProgress:
    def __init__(self, me: int, max_lag: int) -> None:
        self.me = me
        self.max_lag = max_lag
        # Report our own progress every this many events (flow control).
        self.every = max(1, min(PROGRESS_EVERY, max_lag // 4))
        # Latest applied sequence of each other member: reports and estimates (flow control).
        self.peer: dict[int, int] = {}
        # The same, but only what members reported themselves: stability counts facts only.
        self.applied: dict[int, int] = {}
        # What each member reported its store holds (durable confirms wait for every one).
        self.durable: dict[int, int] = {}
        # Our own durable reports (members with a store): the durable seq our last report
        # carried; the last event that gave another member's client a confirm waiting for our
        # store; the model's counts of such confirms and of the others when last looked at.
        self.durable_reported = 0
        self.durable_wanted_at = 0
        self.durable_confirms_seen = 0
        self.transient_confirms_seen = 0
        # The model's count of other members' clients' confirms when we last asked to report.
        self.confirms_seen = 0
        # A report is due (confirms wait for it); when the last one left alone; until when a
        # due report waits for a local client's answer to ride on.
        self.report_wanted = False
        self.reported_at = 0.0
        self.ride_until = 0.0

    # -- what members applied
    def on_report(self, member: int, seq: int, durable: int | None = None) -> None:
        """``member`` applied up to ``seq`` and its store holds up to ``durable`` (None: a
        member without a store, whose applied events are all it vouches for)."""
        self.peer[member] = seq
        self.applied[member] = seq
        self.durable[member] = seq if durable is None else durable

    def estimate(self, members: list[int], seq: int) -> None:
        """``members`` stand at ``seq`` (they became ready there, or this member installed the
        state of that point) until they report more."""
        for m in members:
            self.peer[m] = seq

    def newly_ready(self, member: int, seq: int) -> None:
        """A member that just caught up through an update: count its lag from here."""
        self.peer[member] = max(self.peer.get(member, 0), seq)

    def forget(self, left: list[int]) -> None:
        for gone in left:
            self.peer.pop(gone, None)
            self.applied.pop(gone, None)
            self.durable.pop(gone, None)

    def lag(self, seq: int, ready: list[int]) -> int:
        """How many events the slowest ready member is behind ``seq`` (this member's), in
        applying them or in writing them to its store (what it last reported)."""
        peer, durable, me = self.peer, self.durable, self.me
        # A durable 0 is a store being replaced by a state update (it vouches for nothing
        # until its snapshot is written): not a disk that falls behind.
        return max(
            (seq - min(peer.get(m, seq), durable.get(m) or seq) for m in ready if m != me),
            default=0,
        )

    def stable(self, own: int, ready: list[int]) -> int:
        """The highest event every ready member (this one, at ``own``, included) is known to
        have applied. Every, not a majority: a majority survives partitions, but with AGREED
        delivery two crashed members of three may have applied an event the third never
        received, and a confirm promises survival of all members but one."""
        if not ready:
            return 0
        applied, me = self.applied, self.me
        return min(own if m == me else applied.get(m, 0) for m in ready)

    def durable_stable(self, own: int, ready: list[int], quorum: int = 0) -> int:
        """The highest event every ready member's store (this one's at ``own``) is known to
        hold: confirms of persistent messages on durable queues up to it may go out. With a
        ``quorum``, none while fewer members are ready (``[store] recover_with = "majority"``:
        then any majority that restarts holds every such confirmed message)."""
        if not ready or len(ready) < quorum:
            return 0
        durable, me = self.durable, self.me
        return min(own if m == me else durable.get(m, 0) for m in ready)

    # -- when our own reports are due
    def confirms_moved(self, shadow: int, shadow_durable: int, seq: int, durable: int) -> bool:
        """(A member with a store.) At event ``seq`` the model's counts of confirms for other
        members' clients moved (``shadow`` in all, ``shadow_durable`` of them waiting for the
        stores); our store holds up to ``durable``. Whether to report now: confirms that wait
        for the stores are released by our store's report (:meth:`durable_report_due`), so a
        report of what we applied helps only the others, or a store already holding ``seq``."""
        transient = shadow - shadow_durable
        now = transient != self.transient_confirms_seen
        self.transient_confirms_seen = transient
        if shadow_durable != self.durable_confirms_seen:
            self.durable_confirms_seen = shadow_durable
            self.durable_wanted_at = seq
            now = now or durable >= seq
        return now

    def durable_report_due(self, durable: int) -> bool:
        """Our store now holds up to ``durable``: whether to report it."""
        last = self.durable_reported
        return (
            last < self.durable_wanted_at <= durable
            # Keep the others' view of our store fresh (their flow control counts it) when it
            # catches up after falling behind.
            or durable - last >= self.every
            # It vouches for the first time in this incarnation (it was replaced by a state
            # update): confirms the others hold may have waited for just that.
            or (last == 0 and durable > 0)
        )

    # -- pacing of our own reports
    def want_report(self, now: float, answer_expected: bool) -> bool:
        """A report is due. True if it may leave right now (nothing to ride on, and the last
        lone report left at least ``REPORT_INTERVAL`` ago); otherwise it waits for the sender
        (:meth:`report_wait`)."""
        self.report_wanted = True
        if answer_expected:
            self.ride_until = now + REPORT_RIDE_WAIT
            return False
        return now - self.reported_at >= REPORT_INTERVAL

    def report_wait(self, now: float) -> float:
        """How long a due report with nothing to ride on still waits before leaving alone."""
        return max(self.reported_at + REPORT_INTERVAL, self.ride_until) - now

    def report_gone(self, now: float) -> None:
        self.report_wanted = False
        self.reported_at = now

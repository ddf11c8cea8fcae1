"""A member's lease on the ring. A hot-standby primary shipping changes gives its clients up
before the others can have promoted another primary; a member replaying bytes holds its output
once the others may have moved on without it.

Theory of operation
-------------------
A primary shipping changes serves its clients from a broker of its own and ships what it
changed. Two things keep a primary that is cut off (its corosync frozen, its node partitioned
away) from ever contradicting the one promoted after it:

* **Deliveries** (runtime/replication/shipping.py, "Deliveries"): a consumer gets a message only
  once every member that may be promoted knows it may have been delivered (it holds it flagged
  redelivered), or when no member can hold the message without its delivery (both ship in the
  same batch). Whatever a cut-off primary still hands out, a new primary never hands out again
  unflagged, whatever this lease says.
* **The lease** (this module) ends what is left: clients that would otherwise hang on a primary
  that can neither confirm nor deliver (a frozen corosync never reports a membership change to
  its own members). The ring renews it: every message of ours delivered back through CPG proves
  the ring carried it after we sent it (``TrioCpg.last_own_sent_at``, the send time of the
  latest), and the primary multicasts a small message (its progress report) every
  :data:`HEARTBEATS` th of the lease so that an idle primary renews it too. Once no message of
  ours sent in the last :attr:`PrimaryLease.length` came back, the lease has *lapsed*.

**How long.** The others declare a silent member lost no sooner than the token timeout after
the last token it passed, plus the consensus timeout to agree on the new ring (corosync's
``runtime.config.totem`` keys, read at start: :func:`cpgbroker.corosync.cmap.totem_timeouts`);
they promote only then. That *detection time* is measured from no earlier than the send time
of our latest message that came back (for it to come back, the token passed every member after
we sent it). The lease is :data:`LAPSE` of it: a cut-off primary lets its clients go before
anyone else can serve them. A backup's death stalls the ring just as long, and the primary
cannot tell the two apart until the ring re-forms; so a lapse only *holds* the primary (below),
and the membership change that follows says which it was.

**In doubt.** Earlier still, once no message of ours came back for :data:`DOUBT` of the
detection time, the primary writes nothing more to any client (``AmqpServer.pause_output``):
not a delivery, not a confirm, not an answer. What its broker produces meanwhile is kept in
order. As soon as a message of ours comes back through the ring again, the doubt ends and the
kept output goes out; if the lease lapses instead, the kept output is dropped with the clients,
so nothing the old primary produced after the doubt began ever reaches a client. While in doubt
the lease is looked at every :data:`DOUBT_POLL` seconds, else every :data:`HEARTBEATS` th of
it: the doubt is noticed at most that late, the lapse at most :data:`DOUBT_POLL` late, and
both still come before the detection time (``tests/unit/test_lease.py``; the fault tests
measure the margin on real corosync).

**At the lapse** the primary closes its clients with 320 naming the reason
(``runtime/replication/standby.py`` ``LAPSED``),
dropping what it kept and what waited for stability, and its serving broker is told they are
gone (their unacked messages go back to their queues, to be redelivered flagged); a client that
connects meanwhile is turned away the same way. It stays primary for now, and waits for the
ring's verdict:

* a membership change that keeps this member primary (it passed the quorum gate and was no lost
  merge, ``ClusterNode.deliver_loop``; a backup left) renews the lease: the ring works again
  and no one else can have been promoted, since they promote only by a membership change that
  removes us. It takes clients again (``hot-standby lease renewed``), about as soon as a member
  of an active-active cluster would serve again after the same stall;
* a ring change that leaves it inquorate, or a merge lost, stops it as a lost quorum does;
* a ring re-formed with the same members and no membership change (a corosync that stalled
  past the token but not past the others' consensus): nobody moved on without it, and the
  lease is renewed as above (a member cut off sees the others leave and come back in that
  same ring change, and loses the merge before);
* nothing decisive within :data:`VERDICT` of the detection time after the ring stopped (its
  corosync frozen): it stops
  serving for this incarnation (``ClusterNode.lease_lapsed``, ``ClusterNode.suspend``), leaves
  the group and joins again as a newcomer once its corosync answers. It so comes back a backup,
  after a state update, whatever happened meanwhile: never again primary on the strength of its
  own messages coming back, which a corosync resumed after a freeze delivers before it reports
  that the others moved on without it.

**Replaying bytes** (active-active, and hot standby with ``replication = "bytes"``). Every
member applies the one stream, so a member cut off applies nothing, and writes nothing new,
while the ring stands still. What it must not write is what it applies once its corosync
resumes after a freeze: its own messages from before the freeze, which the others never
received (they moved on without it), come back first, and a consumer of its own may be handed,
as a first delivery, a message the others already gave to one of theirs. So every serving
member holds a lease too (with the same heartbeats and length), and at the lapse it writes
nothing more to any client (``AmqpServer.pause_output``; its clients stay connected): a
membership change that keeps it in the cluster renews the lease and the kept output goes out;
a merge it lost or an inquorate ring stops it, dropping what it kept; and no verdict within
:data:`VERDICT` makes it stop as above. A member whose ring stalls because another one died
lapses just the same and resumes at that membership change, having had nothing new to write
meanwhile.

Owns: the lease's length, its last grant and whether it lapsed. Never closes a client itself:
the replication mode does at the lapse (``ShippingChanges``), the member when it gives up
(``ClusterNode.lease_lapsed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from cpgbroker.corosync import cmap

log = logging.getLogger("cpgbroker.standby")

# Heartbeats per lease: an idle primary multicasts one every length / HEARTBEATS seconds, and
# the lease is looked at as often.
HEARTBEATS = 8
# The lease is this much of the others' detection time (token + consensus; module docstring,
# "How long").
LAPSE = 0.8
# After a lapse, a membership verdict is awaited until this much of the detection time after
# the ring stopped (module docstring, "At the lapse"): a backup's death is decided within about
# one detection time.
VERDICT = 2.0
# A primary's output pauses once no message of ours came back for this much of the others'
# detection time (module docstring, "In doubt"); while in doubt, the lease is looked at every
# DOUBT_POLL seconds, so that output resumes promptly once the ring carries our messages again.
DOUBT = 0.6
DOUBT_POLL = 0.05
# Until corosync's timeouts are read: its default token (3000 ms) and consensus (3600 ms).
DEFAULT_TIMEOUTS = cmap.TotemTimeouts(cmap.DEFAULT_TOKEN_MS, cmap.DEFAULT_TOKEN_MS * 6 // 5)


def detection_time(timeouts: cmap.TotemTimeouts) -> float:
    """Seconds the others take at least to declare a silent member lost (module docstring)."""
    return (timeouts.token_ms + timeouts.consensus_ms) / 1000


def lease_length(timeouts: cmap.TotemTimeouts) -> float:
    """Seconds a primary keeps its clients without hearing the ring (module docstring)."""
    return detection_time(timeouts) * LAPSE


def doubt_length(timeouts: cmap.TotemTimeouts) -> float:
    """Seconds without hearing the ring after which a primary's output pauses."""
    return detection_time(timeouts) * DOUBT


def verdict_wait(timeouts: cmap.TotemTimeouts) -> float:
    """Seconds after a lapse that a lapsed primary waits for the membership's verdict."""
    return detection_time(timeouts) * (VERDICT - LAPSE)


class PrimaryLease:
    def __init__(self, last_own_sent: Callable[[], float | None]) -> None:
        # When the latest of our CPG messages delivered back was sent (time.monotonic()).
        self._last_own_sent = last_own_sent
        self.length = lease_length(DEFAULT_TIMEOUTS)
        self.doubt_length = doubt_length(DEFAULT_TIMEOUTS)
        self.verdict_wait = verdict_wait(DEFAULT_TIMEOUTS)
        # Whether output is paused for doubt now, and how often it was.
        self.doubting = False
        self.doubts = 0
        # The ring was seen working then: a promotion (a membership change just delivered).
        self._granted_at = -float("inf")
        # When the lease lapsed (time.monotonic()), while it stays lapsed.
        self.lapsed_at: float | None = None
        self.lapses = 0

    @property
    def lapsed(self) -> bool:
        return self.lapsed_at is not None

    def configure(self, timeouts: cmap.TotemTimeouts) -> None:
        self.length = lease_length(timeouts)
        self.doubt_length = doubt_length(timeouts)
        self.verdict_wait = verdict_wait(timeouts)
        log.info(
            "hot-standby lease %.2f s, output paused after %.2f s in doubt, a membership "
            "verdict awaited %.2f s after a lapse (corosync token %d ms, consensus %d ms)",
            self.length,
            self.doubt_length,
            self.verdict_wait,
            timeouts.token_ms,
            timeouts.consensus_ms,
        )

    def grant(self, now: float) -> None:
        """The ring works as of ``now``: this member was just promoted by a membership change
        it delivered, or one kept it primary (which ends a lapse)."""
        self._granted_at = now
        self.lapsed_at = None

    def _renewed_at(self) -> float:
        sent = self._last_own_sent()
        return max(self._granted_at, -float("inf") if sent is None else sent)

    def expires_at(self) -> float:
        return self._renewed_at() + self.length

    def in_doubt(self, now: float) -> bool:
        """Whether the others might be about to promote another primary (module docstring,
        "In doubt")."""
        return now >= self._renewed_at() + self.doubt_length

    def check(self, now: float) -> bool:
        """Whether the lease lapses now (it was valid until now)."""
        if self.lapsed_at is None and now >= self.expires_at():
            self.lapsed_at = now
            self.lapses += 1
            return True
        return False

    async def run(
        self,
        holding: Callable[[], bool],
        heartbeat: Callable[[], None],
        on_lapse: Callable[[], None],
        netns: str | None,
        on_doubt: Callable[[bool], None] = lambda doubting: None,
        on_no_verdict: Callable[[], None] = lambda: None,
    ) -> None:
        """For ever: while this member holds the lease (``holding``: it serves as primary),
        send heartbeats; call ``on_doubt(True)`` when the lease comes in doubt and
        ``on_doubt(False)`` when the ring carries our messages again, and ``on_lapse`` when it
        lapses. After a lapse, wait for a membership change to :meth:`grant` it again (then
        go on) or for :attr:`verdict_wait` to pass: then ``on_no_verdict`` and the task ends."""
        try:
            self.configure(await trio.to_thread.run_sync(cmap.totem_timeouts, netns))
        except Exception as e:  # a corosync without the keys: its defaults, said once
            log.warning("corosync timeouts unreadable (%s): lease of %.2f s", e, self.length)
        last = next_beat = time.monotonic()
        held = False
        while True:
            every = self.length / HEARTBEATS
            await trio.sleep(DOUBT_POLL if self.doubting or self.lapsed else every)
            now = time.monotonic()
            # This process did not run for a while (a long promotion, a stalled host): what
            # corosync delivered meanwhile is not read yet. Look again after the delivery loop
            # had its turn rather than call a doubt or a lapse the ring did not cause.
            stalled = now - last > 2 * every
            last = now
            if not holding():
                held = False
                if self.doubting:  # no longer primary: the member closed its clients
                    self.doubting = False
                    on_doubt(False)
                continue
            if not held:
                # Just started to hold it (ready, promoted): the ring works as of now.
                held = True
                if self.lapsed_at is None:
                    self._granted_at = max(self._granted_at, now)
            lapsed_at = self.lapsed_at
            if lapsed_at is not None:
                if now >= lapsed_at + self.verdict_wait:
                    on_no_verdict()
                    return
                continue
            if now >= next_beat:
                heartbeat()
                next_beat = now + every
            if stalled:
                continue
            doubting = self.in_doubt(now)
            if doubting != self.doubting:
                self.doubting = doubting
                self.doubts += doubting
                on_doubt(doubting)
            if self.check(now):
                on_lapse()

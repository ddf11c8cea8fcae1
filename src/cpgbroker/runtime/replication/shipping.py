"""Hot standby with state shipping (``[cluster] replication = "changes"``): the primary's side.

Theory of operation
-------------------
With ``replication = "bytes"`` a hot-standby primary multicasts its clients' bytes and every
member applies them. With ``"changes"`` the primary's clients are served by a broker of the
primary alone, the *serving broker*, which applies their events the moment they are read (as
a standalone broker does) and records what it changed (``model/changes.py``). After each event
:class:`Shipping` encodes the records as a change batch (``model/shipping.py``) and multicasts
it as a :class:`~cpgbroker.model.events.Changes` event. Every member, the primary too, applies
the ordered batches to its stream broker, a broker without connections
(``model/standby/replica.py``): that is what backups hold, what state updates, checkpoints and the
management API of a backup read, and what a backup promotes when it becomes primary.

* **Confirms** (and tx.commit-ok, and operators' answers) wait until the batch that carries
  their change is stable: delivered back here and applied by every ready member, as the
  progress reports say (the member's confirm gate and admin desk count batches, not events:
  :meth:`batch_number`, :meth:`stable_batch`). So an acknowledged message survives the loss of
  every member but one, as in active-active.
* **Deliveries** of a message that joined its queue in an earlier batch than the one
  recording the delivery (basic.deliver, basic.get-ok: ``Send.delivery_waits``, decided by
  ``ChangeLog.delivery_waits``) wait at the same gate for that batch, and what the connection
  is sent after them waits behind them. A backup keeps a message out with the primary's
  consumers in place, flagged redelivered (``model/standby/replica.py``), so once the batch is
  stable every member that may be promoted redelivers the message flagged, a quorum queue's delivery
  count one higher. Delivered at once instead, a message whose delivery was in flight when
  the primary was cut off (its corosync frozen, its node partitioned away) would reach a
  consumer again from the new primary as a first delivery: an unflagged duplicate. A message
  delivered in the batch that enqueues it goes out at once (``model/changes.py``,
  "Deliveries"): that is the hot path of a consumer keeping up, whose messages are still
  elided when acked before the cut; so does one *reserved* (flagged on the backups while
  still queued) in the batch that enqueued it, or in a batch now stable
  (``model/changes.py``, "Reservations"; :meth:`stable_batch` tells the change log which). A
  cut-off primary's batches never become stable, so whatever it still hands out the backups
  hold flagged or never held, and nothing it takes in is confirmed; its lease
  (``runtime/member/lease.py``) then closes its clients once another member may have been promoted.
* **Batches** are cut by :meth:`run` one scheduling round after an event was applied, so under
  load one batch carries the events of many clients, and only while fewer than
  :data:`BATCHES_IN_FLIGHT` of ours are multicast and not yet delivered back (Nagle's rule
  again: at a low rate nothing is in flight and the batch leaves at once). Under load the
  next batch so gathers for a CPG round trip, time enough for most consumers to ack what they
  were sent: a message that joined a queue and left it before its batch was cut never crosses
  the ring (``model/changes.py``, "Elision"). A batch nobody waits for (no confirm,
  tx.commit-ok or operator's answer is held for it, no definition changed) lingers up to
  :data:`LINGER` even then: traffic without confirms (RPC requests, most often) then costs
  the primary one batch per ``LINGER``, not one or two per message, and what was consumed
  meanwhile never ships; what was published without a confirm reaches the backups that much
  later, which AMQP never promised otherwise. A batch is cut anyway once it holds
  :data:`CUT_BYTES` of bodies. **Flow control**: a reader whose batches pile up in the
  multicast queue waits (:data:`QUEUE_LIMIT`); the multicaster holds the queue while a backup
  lags.
* **Time**: the serving broker ticks on this member's clock (:meth:`run`); the stream
  carries no ticks in this mode, and a replica never expires anything itself: the primary's
  batches say what expired.
* **Promotion** (:meth:`promote`): when the stream makes this member primary (the eldest
  ready member: ``runtime/replication/standby.py``), it copies its replica through a snapshot's
  parts (copies of its entries, sharing the messages, which never change: ``snapshot.parts``,
  ``share``) and turns the
  copy into the serving broker (``model.shipping.promote``), recording from before the first
  step so that what promotion changes (dead-lettering past a delivery limit, queues of the
  dead primary's clients deleted) ships too. The copy costs time in proportion to the number
  of messages (0.05 s per 200,000: ``bench/shipping_bench.py``); clients of the new primary
  wait that long.

* **The stream** (:meth:`takes`, :meth:`applied`): the stream broker takes the primary's
  batches only (and a restart's ``Recovered``); a batch from any other member is dropped,
  alike on every member.

Owns: the serving broker (while primary), the batch counters.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from typing import Any

import trio

from cpgbroker.cluster.membership import Membership
from cpgbroker.model import Broker, ChangeLog, Shipper, promote, snapshot
from cpgbroker.model.events import Changes, ClusterMembers, Event, Recovered, Tick
from cpgbroker.runtime.admin.admindesk import AdminDesk
from cpgbroker.runtime.amqp.confirms import ConfirmGate
from cpgbroker.runtime.amqp.server import AmqpServer
from cpgbroker.runtime.replication.standby import primary_of
from cpgbroker.runtime.update.giving import Updater

log = logging.getLogger("cpgbroker.shipping")

# Bytes of batches waiting to be multicast beyond which the primary's readers wait.
QUEUE_LIMIT = 8 * 2**20
# How often a waiting reader looks at the queue again.
QUEUE_RECHECK = 0.005
# Our batches multicast and not yet delivered back at which the next one waits to be cut.
# With 1, a 3-member cluster on one 2-core machine (1 KiB confirms, one consumer keeping up)
# elides about half the messages and serves 44,300-46,600 msg/s; cutting a batch every
# scheduling round elides a third and serves 39,400-42,200 (bench/broker_bench.py,
# docs/performance.md). With 4 consumers both elide half.
BATCHES_IN_FLIGHT = 1
# Body bytes at which the next batch is cut even so: it stays well below what libcpg
# multicasts in one piece (larger messages are sent in fragments, a round trip each).
CUT_BYTES = 512 * 1024
# Seconds a batch nobody waits for may gather before it is cut (module docstring).
LINGER = 0.01


class Shipping:
    # Events take effect when submitted (no reads in flight to count).
    deferred = False

    def __init__(
        self,
        member: int,
        replicate: str,
        tick_ms: int,
        send: Callable[[Event], None],
        queued_bytes: Callable[[], int],
    ) -> None:
        self.member = member
        self.replicate = replicate
        self._tick = tick_ms / 1000
        self._send = send
        # Set when something was applied since the last batch was cut.
        self._due = trio.Event()
        self._queued_bytes = queued_bytes
        # The clients' side whose effects the serving broker's are (:meth:`attach`).
        self.io: AmqpServer | None = None
        # The serving broker, while this member is primary.
        self.broker: Broker | None = None
        self._shipper = Shipper()
        # Batches multicast, and of our own delivered back: their numbers and event seqs,
        # until stable.
        self.shipped = 0
        self.delivered = 0
        self._unstable: collections.deque[tuple[int, int]] = collections.deque()
        self.stable = 0
        # Our batches not yet applied by every ready member, with the serving broker's change
        # log's take each carries (what its reservations wait for).
        self._takes: collections.deque[tuple[int, int]] = collections.deque()
        # Set when the next batch may be cut although one is in flight (one came back, the
        # next grew to CUT_BYTES, the role changed), or although it lingers (someone waits
        # for it now).
        self._room = trio.Event()
        # The next batch lingers (nobody waits for it): a submit looks whether that changed.
        self._lingering = False
        # The number of our first batch that failed on every member (:meth:`failed`), if any.
        self._lost: int | None = None
        # Called after each batch is cut (the federation links' push queues may have grown).
        self._on_cut: Callable[[], None] = lambda: None
        # The member's held output and operators' answers (:meth:`attach`), read when a
        # batch is cut, and whether it has a store.
        self._confirms: ConfirmGate | None = None
        self._desk: AdminDesk | None = None
        self._stored = False

    def attach(
        self,
        io: AmqpServer,
        confirms: ConfirmGate | None = None,
        desk: AdminDesk | None = None,
        *,
        stored: bool = False,
        on_cut: Callable[[], None] | None = None,
    ) -> None:
        """The parts built after this one, since they are built on it (the clients' side
        submits to it, the gate and the desk count its batches): the clients' side its
        serving broker's effects go to; where output and operators' answers wait for batches
        (``stored``: the member has a store, and a persistent message's confirm waits for
        every member's); what to call after each batch is cut."""
        self.io = io
        self._confirms, self._desk, self._stored = confirms, desk, stored
        if on_cut is not None:
            self._on_cut = on_cut

    def holding(self) -> tuple[bool, bool, bool]:
        """Whether output or an operator's answer waits for the batch being cut (it asks the
        backups to report it at once), whether any of it waits for every member's store
        (they report it once stored), and whether, that being so, some also waits for every
        member to have applied it only (a delivery, a transient message's confirm: they
        report that at once as well)."""
        confirms, desk = self._confirms, self._desk
        if confirms is None or desk is None:
            return False, False, False
        holding = bool(confirms.holding or desk.unsettled)
        if not holding or not self._stored:
            return holding, False, False
        durable = bool(desk.unsettled)
        applied = False
        for lc in confirms.holding.values():
            for seq, _d, _r, on_disk in lc.held:
                if on_disk:
                    durable = True
                elif seq:
                    applied = True
            if durable and applied:
                break
        return holding, durable, applied

    @property
    def unsettled_takes(self) -> bool:
        """Batches of ours whose reservations are not known stable yet."""
        return bool(self._takes)

    @property
    def active(self) -> bool:
        return self.broker is not None

    # ------------------------------------------------------------------ the node's sequencer

    async def submit(self, ev: Event) -> None:
        """An event of this member's clients (or operators): applied now, shipped with the
        next batch (:meth:`run` cuts it once the events ready now are applied)."""
        self.apply_now(ev)
        while self._queued_bytes() > QUEUE_LIMIT and self.broker is not None:
            await trio.sleep(QUEUE_RECHECK)

    def apply_now(self, ev: Event) -> None:
        """:meth:`submit` without waiting for the multicast queue to have room (the lease's
        lapse tells the serving broker its clients are gone while the ring stands still)."""
        b = self.broker
        if b is None:
            return  # not primary (any more): its clients are being closed
        assert self.io is not None
        self.io.execute(b.apply(ev))
        self._due.set()
        changes = b.changes
        if changes is not None and (
            changes.bytes >= CUT_BYTES or (self._lingering and self._awaited(changes))
        ):
            self._room.set()

    async def run(self) -> None:
        """For ever: cut and multicast batches, and tick the serving broker."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ticker)
            while True:
                await self._due.wait()
                self._due = trio.Event()
                # One scheduling round first: the reads of other clients that are ready now
                # are applied into this batch too. Under load a batch then carries many
                # clients' events, and a backup pays its per-event costs once for them.
                await trio.lowlevel.checkpoint()
                await self._wait_for_room()
                self.ship()

    async def _wait_for_room(self) -> None:
        """Until the next batch may be cut (module docstring, "Batches")."""
        linger_until = trio.current_time() + LINGER
        while True:
            b = self.broker
            changes = None if b is None else b.changes
            if changes is None or changes.bytes >= CUT_BYTES:
                return
            if self.shipped - self.delivered >= BATCHES_IN_FLIGHT:
                until = math.inf
            elif (
                not changes.records  # nothing to gather for (:meth:`ship` cuts what is awaited)
                or self._awaited(changes)
                or trio.current_time() >= linger_until
            ):
                return
            else:
                until = linger_until
                self._lingering = True
            self._room = trio.Event()
            with trio.move_on_at(until):
                await self._room.wait()
            self._lingering = False

    def _awaited(self, changes: ChangeLog) -> bool:
        """Whether someone waits for the next batch: held output or an operator's answer
        (any: a cheap look), or definitions that changed."""
        confirms, desk = self._confirms, self._desk
        return (
            changes.structural
            or confirms is None
            or desk is None
            or bool(confirms.holding or desk.unsettled)
        )

    def ship(self) -> None:
        """Multicast what the serving broker changed since the last batch, if anything, or
        an empty batch when output waits for one."""
        b = self.broker
        if b is None or self._lost is not None:
            return
        log_ = b.changes
        assert log_ is not None
        holding, durable, applied = self.holding()
        if not (log_.structural or holding or any(r is not None for r in log_.records)):
            # Nothing happened, or all of it was elided: no batch at all.
            log_.take()
            return
        batch = self._shipper.batch(b, confirms=holding, durable=durable, applied=applied)
        self.shipped += 1
        # Once this batch is stable, the reservations it carries are (model/changes.py).
        self._takes.append((self.shipped, log_.takes))
        self._send(Changes(batch))
        self._on_cut()

    @property
    def elided(self) -> int:
        """Messages the serving broker never shipped (``model/changes.py``, "Elision")."""
        b = self.broker
        return 0 if b is None or b.changes is None else b.changes.elided

    def batch_number(self) -> int:
        """The batch that will carry what is being applied now (what held output waits for)."""
        return self.shipped + 1

    # ------------------------------------------------------------------ the stream

    def takes(self, ev: Any, sender: int, membership: Membership) -> bool:
        """Whether the stream broker applies ``ev`` of ``sender``: nothing but the primary's
        batches and what a restart from the stores drops. The membership's events go to the
        serving broker, if any (:meth:`on_stream`); every member decides so alike."""
        t = type(ev)
        if t is Changes:
            primary = primary_of(membership)
            if primary is None or sender != primary.member:
                log.warning("a change batch from member %s, which is not primary: dropped", sender)
                return False
            return True
        if t is not Recovered:
            self.on_stream(ev)
            return False
        return True

    def applied(self, replica: Broker, sender: int, updater: Updater) -> None:
        """The stream broker applied an event of ``sender``."""
        if sender == self.member:
            self.delivered_back(replica.event_seq)
        released = replica.replication.released
        if released is not None:
            # A state update from the back of the queues is being sent: tell it what
            # consumers took (runtime/update/transfer.py).
            if released:
                updater.feed(released)
                released.clear()
            if not updater.feeding:
                replica.replication.track_released(False)

    def delivered_back(self, seq: int) -> None:
        """One of our batches was applied here as stream event ``seq``."""
        self.delivered += 1
        self._unstable.append((self.delivered, seq))
        self._room.set()

    def failed(self, ev: Any, sender: int) -> bool:
        """The stream failed ``ev`` of ``sender`` on every member alike: whether it was a batch
        of ours, which this member must leave for. Its serving broker holds what no replica
        does, so nothing that batch or a later one carries is confirmed, and no batch is cut
        any more (the next member serves what every member holds)."""
        if self.broker is None or sender != self.member or type(ev) is not Changes:
            return False
        self.delivered += 1
        if self._lost is None:
            self._lost = self.delivered
        self._room.set()
        return True

    def stable_batch(self, stable_seq: int, durable_seq: int | None = None) -> tuple[int, int]:
        """The last of our batches applied by every ready member, given the stable event, and
        the last one every member's store holds (``durable_seq``; None: no store)."""
        unstable = self._unstable
        low = stable_seq if durable_seq is None else min(stable_seq, durable_seq)
        while unstable and unstable[0][1] <= low:
            self.stable = unstable.popleft()[0]
        applied = self.stable
        for batch, seq in unstable:
            if seq > stable_seq:
                break
            applied = batch
        takes = self._takes
        if takes and takes[0][0] <= applied:
            take = 0
            while takes and takes[0][0] <= applied:
                take = takes.popleft()[1]
            b = self.broker
            if b is not None and b.changes is not None and self._lost is None:
                b.changes.stable_to(take)
        if self._lost is not None:
            return min(applied, self._lost - 1), min(self.stable, self._lost - 1)
        return applied, self.stable

    # ------------------------------------------------------------------ role

    def promote(self, replica: Broker, now_ms: int) -> None:
        """Become primary: serve a copy of ``replica`` (module docstring)."""
        b = snapshot.restore(snapshot.parts(replica, share=True), replica.config)
        b.set_local_member(self.member)
        b.record_changes(ChangeLog(self.replicate))
        promote(b, self.replicate)
        self._shipper = Shipper()
        # The batches numbered from here on are this primary's; none is in flight.
        self.shipped = self.delivered = self.stable = 0
        self._lost = None
        self._unstable.clear()
        self._takes.clear()
        self._room.set()
        self.broker = b
        assert self.io is not None
        self.io.execute(b.apply(Tick(max(now_ms, b.now_ms))))
        self._due.set()
        log.warning(
            "promoted to hot-standby primary: %d queues, %d messages",
            sum(len(vh.queues) for vh in b.vhosts.values()),
            sum(len(q.messages) for vh in b.vhosts.values() for q in vh.queues.values()),
        )

    def demote(self) -> None:
        """No longer primary: the serving broker goes (its clients are closed by the member)."""
        if self.broker is not None:
            log.warning("no longer the hot-standby primary: dropping the serving broker")
        self.broker = None
        self._room.set()

    async def _ticker(self) -> None:
        """Cluster time for the serving broker: this member's clock, while it is primary."""
        while True:
            await trio.sleep(self._tick)
            if self.broker is not None and self.io is not None:
                await self.submit(Tick(self.io.now_ms()))

    def on_stream(self, ev: Any) -> None:
        """A model event of the stream other than a change batch (membership's): a replica
        takes nothing but batches; the serving broker takes the member list."""
        if self.broker is not None and type(ev) is ClusterMembers:
            assert self.io is not None
            self.io.execute(self.broker.apply(ev))

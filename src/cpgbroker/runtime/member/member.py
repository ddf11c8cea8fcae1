"""A cluster member: the broker model driven by the CPG total order.

Every event a local client causes (connect, bytes, disconnect, do-output grant) is multicast
instead of applied; the member acts on it only when CPG delivers it back, in the same order
every other member delivers it. Events of other members' clients are applied to *shadow*
connections whose output is dropped. Membership (joins, leaves, readiness), cluster time and
digest checkpoints come from the same stream (``cpgbroker.cluster``), so every member takes
every decision at the same point of the order.

Theory of operation
-------------------
:class:`ClusterNode` is a coordinator. It owns the deliver loop: it takes CPG deliveries in
total order, routes each item to the component whose job it is and executes what they return.
It builds only its own components; the process wing builds the rest and hands them in as one
:class:`~cpgbroker.runtime.member.parts.Parts` (``runtime/process/assembly.py``). Each
component owns its state and never imports this module:

* ``runtime/member/stream.py``: the broker the stream is applied to (swapped on a state
  update's install and on resuming a kept state), how far every member stands (applied,
  stable, durable, lag, the progress report), and whether this member serves;
* ``runtime/amqp/server.py`` :class:`~cpgbroker.runtime.amqp.server.AmqpServer`: client I/O; it is
  given the replication mode's sequencer and the confirm gate;
* ``runtime/replication/modes.py``: the replication mode (replaying client bytes, or shipping
  state changes), called wherever the modes differ without asking which one it is;
* ``runtime/member/roster.py``: hellos, joins and leaves, partition merges, and the state kept
  since quorum was lost until it is resumed or given up;
* ``runtime/member/applying.py``: applying an event routed to the model, then recording,
  reporting and digesting it;
* ``runtime/ring/multicast.py``: submit, direct sends, batching, the sender task, the lag wait;
* ``cluster/progress.py`` (pure): peer progress, the stable sequence, report pacing;
  ``runtime/amqp/confirms.py``: local output held until its confirm is stable;
* ``runtime/update/taking.py`` and ``runtime/update/giving.py``: the two sides of a state update;
* ``runtime/member/checkpoints.py``: digest checkpoints over ``cluster/checkpoint.py``;
* ``runtime/member/eventlog.py``: the event log and injected faults;
* ``runtime/member/errorcheck_rounds.py``: this member's side of error-check rounds, over
  ``cluster/errorcheck_stall.py`` (pure);
* ``cluster/quorum.py`` (pure, through ``runtime/ring/ringgate.py``): ring gating;
* ``runtime/member/stops.py``: stop requests;
* ``store/`` (through ``runtime/member/storelink.py``): the member's durable store, which journals
  every applied event (``runtime/member/applying.py``) and whose fsyncs come back as ``on_durable``.

What stays here is the order of things: which component sees an event, in which state of the
member, and what a decision means for the others (suspending, resynchronising, leaving).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from cpgbroker.cluster import codec
from cpgbroker.cluster.codec import (
    STATUS_READY,
    Checkpoint,
    ErrorCheck,
    Hello,
    Progress,
    StopRequest,
    UpdateRequest,
)
from cpgbroker.cluster.membership import (
    READY,
    SendHello,
    member_id,
)
from cpgbroker.corosync.events import (
    ConfChg,
    CpgEvent,
    Deliver,
    PartitionMerge,
    RingChangeSameMembers,
    TotemConfChg,
)
from cpgbroker.errors import ClusterError
from cpgbroker.model import RAISE_MODEL_VERSION, Broker
from cpgbroker.model.events import (
    AdminCommand,
    ClientData,
    Tick,
)
from cpgbroker.runtime.amqp.server import ClientStream
from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.runtime.member.applying import Applier
from cpgbroker.runtime.member.checkpoints import Checkpointer
from cpgbroker.runtime.member.errorcheck_rounds import ErrorChecks
from cpgbroker.runtime.member.parts import Parts
from cpgbroker.runtime.member.roster import Roster
from cpgbroker.runtime.member.stops import STOP_SETTLE
from cpgbroker.runtime.member.stream import admin_settled, version_verdict
from cpgbroker.runtime.member.watchdog import ApplyMark
from cpgbroker.runtime.replication.standby import LAPSED
from cpgbroker.runtime.ring.quorum_trio import TrioQuorum
from cpgbroker.runtime.ring.ringgate import VERDICT_TIMEOUT, RingGate
from cpgbroker.runtime.update.giving import DeferredUpdate
from cpgbroker.store.store import Store

log = logging.getLogger("cpgbroker.member")

# After quorum loss, how long clients get to read connection.close before being cut.
SUSPEND_GRACE = 2.0
NOT_QUORATE_TEXT = (
    "member is not in a quorate partition; it serves again once its partition regains quorum "
    "and it has resynchronised: use another member"
)
# A member that is quorate but does not serve: joining, taking a state update, or dropping
# its state after it merged back on the smaller side of a partition.
RESYNC_TEXT = "member is resynchronising with the cluster; it serves again soon: use another member"


@attrs.frozen
class Inherited:
    """What an incarnation takes over from the process and the incarnations before it."""

    # Connection ids handed out so far: the next ones go on from there.
    conn_counter: int = 0
    # A model kept since quorum was lost, or recovered from the store, with its history epoch.
    kept: tuple[Broker, int] | None = None
    # Which incarnation of this process it is (1: the first).
    incarnation: int = 1
    # Updater children of every incarnation, reaped by the process (runtime/update/giving.py).
    updates: dict[int, dict[str, Any]] | None = None
    # The event being applied, shared with the watchdog's feeder thread.
    applying: ApplyMark | None = None
    # The durable store (None: memory only), shared by every incarnation.
    store: Store | None = None
    # ``kept`` was recovered from the store after the process (re)started.
    restarted: bool = False
    # ``--force-boot``: serve without waiting for the other members' stores.
    forced: bool = False


class ClusterNode:
    """One incarnation of a cluster member: one CPG membership and its model."""

    def __init__(
        self,
        config: ServerConfig,
        parts: Parts,
        *,
        quorum: TrioQuorum | None = None,
        inherited: Inherited | None = None,
    ) -> None:
        """``parts`` are what the process wing built for this incarnation
        (``runtime/process/assembly.py``): the member builds only its own components."""
        cluster = config.cluster
        assert cluster is not None
        inherited = Inherited() if inherited is None else inherited
        self.config = config
        stream = self.stream = parts.stream
        self.member = stream.me
        # Without a quorum handle (unit tests on an in-memory bus) nothing is gated.
        self.quorum = quorum
        self.service = parts.service
        self.scope: trio.CancelScope | None = None
        # Holds ring changes until votequorum's verdict on the new ring.
        self.gate = None if quorum is None else RingGate(quorum)
        # Its state must not be offered again when it rejoins (it holds what the serving
        # members do not): merged back on the smaller side, or applied an event the cluster
        # failed while it was catching up.
        self.discard_state = False
        # The stream's, bound here for the hot path (never swapped).
        self.membership = stream.membership
        self.multicast = parts.multicast
        self.standby = parts.standby
        self.replication = parts.replication
        self.confirms = parts.confirms
        self.io = parts.io
        self.desk = parts.desk
        self.federation = parts.federation
        self.eventlog = parts.eventlog
        self.newcomer = parts.newcomer
        self.updater = parts.updater
        self.stops = parts.stops
        # Read on the hot path (one attribute load): is this member held by a round?
        self.stall = stream.stall
        self._build_own(cluster.checkpoint_every, inherited)

    def _build_own(self, checkpoint_every: int, inherited: Inherited) -> None:
        """The member's own components, each on the ones before; the error-check rounds
        call back into the member (a failed event, a kept item, a resync)."""
        member, stream, send = self.member, self.stream, self.multicast.send_control
        self.checkpoints = Checkpointer(
            member, checkpoint_every, send, self.eventlog, self._vouches
        )
        self.errorchecks = ErrorChecks(
            member,
            self.membership,
            send,
            self.eventlog,
            self.stops,
            self.newcomer,
            self.stall,
            fail_event=self._fail_event,
            recorded=self._recorded,
            replay=self._replay_kept,
            resync=self._resync,
        )
        # Applies what the stream routes to the model (runtime/member/applying.py).
        self.applier = Applier(
            stream,
            self.service,
            replication=self.replication,
            io=self.io,
            eventlog=self.eventlog,
            updater=self.updater,
            multicast=self.multicast,
            checkpoints=self.checkpoints,
            errorchecks=self.errorchecks,
            # Shared with the watchdog's feeder thread (runtime/member/watchdog.py).
            mark=ApplyMark() if inherited.applying is None else inherited.applying,
        )
        # Hellos, joins and leaves, partition merges, the kept state (runtime/member/roster.py).
        self.roster = Roster(
            stream,
            self.service,
            multicast=self.multicast,
            replication=self.replication,
            newcomer=self.newcomer,
            checkpoints=self.checkpoints,
            errorchecks=self.errorchecks,
            stops=self.stops,
            eventlog=self.eventlog,
            now_ms=self.io.now_ms,
            kept=inherited.kept,
            restarted=inherited.restarted,
            forced=inherited.forced,
            apply=self.applier.apply,
            resync=self._resync,
        )

    @property
    def broker(self) -> Broker:
        """The broker the stream is applied to now (swapped on install and resume)."""
        return self.stream.broker

    @property
    def kept(self) -> tuple[Broker, int] | None:
        """The state kept since quorum was lost (or recovered), until resumed or given up."""
        return self.roster.kept

    @property
    def ready(self) -> trio.Event:
        return self.service.ready

    @property
    def suspended(self) -> str | None:
        return self.service.suspended

    @property
    def failure(self) -> str | None:
        return self.service.failure

    # ------------------------------------------------------------------ for the process

    async def submit(self, ev: Any) -> None:
        """Take ``ev`` as this member's clients' events are taken: multicast, or (shipping
        changes) applied by the serving broker."""
        await self.io.submit(ev)

    def guarded_tasks(self) -> list[Any]:
        """The incarnation's tasks whose ``ClusterError`` means this member must leave."""
        return [
            self.multicast.sender,
            self.deliver_loop,
            self.catch_up,
            self.checkpoints.collect_digests,
            *self.replication.guarded_tasks(),
        ]

    def tasks(self) -> list[Any]:
        """The incarnation's other tasks."""
        tasks: list[Any] = [self.cluster_ticker, self.federation.run]
        standby = self.standby
        if standby is not None:
            tasks.append(functools.partial(standby.watch, self.io.close_all))
        return [*tasks, *self.replication.tasks()]

    def lease_doubt(self, doubting: bool, length: float) -> None:
        """The primary's lease came in doubt (no message of ours came back through the ring
        for ``length``: the others may be about to promote another primary), or no longer
        is. While in doubt, nothing is written to any client (runtime/member/lease.py, "In
        doubt")."""
        if doubting:
            log.warning(
                "hot-standby lease in doubt: no message of ours came back through the ring "
                "for %.2f s; writing nothing to clients until one does",
                length,
            )
            self.io.pause_output()
        else:
            log.info("hot-standby lease renewed: the ring carries our messages again")
            self.io.resume_output()

    def lease_lapsed(self, length: float) -> None:
        """The lease lapsed and no membership change kept this member serving within
        ``length`` of the ring stopping: the others may have moved on without it (another
        member may be primary by now). Stop serving and rejoin through a state update: a
        hot-standby primary comes back a backup (runtime/member/lease.py, "At the lapse")."""
        log.error(
            "ring lease lapsed and no membership change kept this member serving within "
            "%.2f s: leaving the cluster to rejoin through a state update",
            length,
        )
        text = LAPSED if self.standby is not None else RESYNC_TEXT
        self.suspend(f"ring lease lapsed {length:.2f} s ago", text)

    @property
    def serving(self) -> bool:
        return self.service.serving

    @property
    def halted(self) -> int | None:
        """The event a stop request stopped this member at."""
        return self.stops.halted

    @property
    def stop_requested(self) -> trio.Event:
        return self.stops.requested

    def fail(self, reason: str) -> None:
        """This member must leave the cluster (the process ends the incarnation)."""
        self.service.failure = reason
        self.multicast.silenced = True

    def state_to_keep(self) -> tuple[Broker, int] | None:
        """After suspension: the model to offer when rejoining (used only if nobody kept
        serving meanwhile), with the seq of its last quorate ring."""
        if self.discard_state:
            return None  # the serving members' state replaces ours
        ring = None if self.gate is None else self.gate.ring
        if self.ready.is_set() and ring is not None:
            return self.stream.broker, self.epoch()
        # Suspended before serving: still what it was offered with, unless a serving member
        # was seen meanwhile (then that member's state replaces it, and offering the old one
        # again could resume stale state).
        return self.kept

    def epoch(self) -> int:
        """The history epoch of this member's state (see cluster/membership.py)."""
        return self.stream.epoch()

    def inject_fault(self, kind: str, at_seq: int, seconds: float = 0.0) -> dict[str, Any]:
        """Make this member fail (or be slow) at event ``at_seq`` (tests; ``[cluster]
        fault_injection``)."""
        return self.eventlog.inject(kind, at_seq, self.stream.broker.event_seq + 1, seconds)

    async def request_stop(self, target: int, timeout: float = 10.0) -> int:
        """Ask ``target`` (0: every member) to stop; the event seq where the request took
        effect, once it is delivered back here."""
        return await self.stops.request(target, self.membership.ready_members, timeout)

    def on_quorum_loss(self, reason: str) -> None:
        self.suspend(reason)

    def close(self) -> None:
        self.updater.end()
        self.checkpoints.close()  # digest children of an ended incarnation
        self.eventlog.close()

    # ------------------------------------------------------------------ clients, for the process

    def update_handler(self, address: str) -> Callable[[trio.SocketStream], Awaitable[None]]:
        """Take state updates at ``address`` (announced in our requests): the handler of its
        listener."""
        self.newcomer.address = address
        return self.newcomer.handler

    async def serve_client(self, stream: ClientStream) -> None:
        await self.io.handle(stream)

    async def admin_request(
        self, user: str, op: str, args: dict[str, Any], timeout: float
    ) -> tuple[int, Any]:
        """An operator's change, answered once as safe as a durable confirm."""
        return await self.desk.request(user, op, args, timeout)

    async def shutdown_clients(self, grace: float) -> None:
        """Signalled: tell the clients to go, give them ``grace`` seconds."""
        await self.io.shutdown_clients(grace)

    async def let_clients_go(self, grace: float) -> None:
        """Told to go already: the clients get up to ``grace`` seconds to read their
        connection.close and leave; the rest are cut."""
        await self.io.let_clients_go(grace)

    async def drop_clients(self, text: str) -> None:
        """Leaving the cluster: our clients must fail over; tell them why, then drop them. The
        other members see us leave through CPG and close our clients' shadows at that point."""
        await self.io.drop_clients(text)

    # ------------------------------------------------------------------ progress

    def _vouches(self) -> bool:
        return self.suspended is None and self.stops.halted is None

    def _stable_marks(self) -> tuple[int, int | None]:
        return self.stream.stable_marks(self.replication.stable)

    def _admin_settled(self) -> int:
        return admin_settled(self.stream, self.replication.stable)

    def _release_stable(self) -> None:
        applied, stored = self._stable_marks()
        self.confirms.release(applied, self.io, stored)
        if self.desk.unsettled:
            self.desk.settle(self._admin_settled())

    def on_durable(self, seq: int) -> None:
        """The store has written (fsynced) events up to ``seq``: our durable confirms may go
        out, and the others' wait for our report if they had any since the last one."""
        if self.suspended is not None or self.failure is not None:
            return
        if self.confirms.holding or self.desk.unsettled:
            self._release_stable()
        if self.membership.state == READY and self.stream.progress.durable_report_due(seq):
            self.multicast.report_soon(False)
        self.multicast.progress_changed()

    # ------------------------------------------------------------------ delivery

    async def deliver_loop(self) -> None:
        cpg = self.multicast.cpg
        # Bound once: the set is updated in place.
        shunned = self.roster.partitions.shunned
        on_event = self._on_event
        gate = self.gate
        # Stream items of a ring change, held until the new ring's quorum verdict (see
        # cluster/quorum.py): nothing delivered in an inquorate ring is ever applied.
        held: list[CpgEvent] = []
        batch: list[CpgEvent]
        while True:
            if held:
                with trio.move_on_after(VERDICT_TIMEOUT):
                    held += await cpg.receive_batch()
                    batch, held = held, []
                if held:
                    self.suspend("the CPG ring changed but the new ring was never reported")
                    return
            else:
                batch = await cpg.receive_batch()
            for i, ev in enumerate(batch):
                t = type(ev)
                if t is Deliver:
                    sender = member_id(ev.nodeid, ev.pid)  # type: ignore[union-attr]
                    if sender in shunned:
                        continue  # diverged in a partition; it is leaving
                    for e in codec.decode_batch(ev.data, sender):  # type: ignore[union-attr]
                        on_event(e, sender)
                elif t is RingChangeSameMembers:
                    log.info("ring re-formed with the same members ring=%s", ev.ring_id)  # type: ignore[union-attr]
                    self.roster.on_ring_reformed()
                else:
                    if gate is not None and gate.holds(ev):
                        # A ConfChg caused by a ring change precedes the TotemConfChg that
                        # names the ring: hold everything from here until it has arrived.
                        ring = next((x.ring_id for x in batch[i:] if type(x) is TotemConfChg), None)
                        if ring is None:
                            held = batch[i:]
                            break
                        if ring != gate.ring:
                            # All of the ring change is in hand. A member frozen past the
                            # token sees the others leave and come back in one change: if it
                            # lost the merge, it must not apply their departure (requeue their
                            # messages, hand them to its own consumers) first.
                            others = self.roster.partitions.lost_in(
                                batch, i, list(self.membership.members)
                            )
                            if others is not None:
                                self.roster.lose_merge(others)
                                return
                            why = await gate.verdict(ring)
                            if why is not None:
                                self.suspend(why)
                                return
                    on_event(ev, None)
                if self.suspended is not None:
                    return
            # Once per delivered batch, not per event: a confirm for another member's client
            # waits for every member's report, so report now rather than PROGRESS_EVERY
            # events later (our own clients' confirms need no report from us); and release
            # what the reports received made stable.
            if self.stream.broker.shadow_confirms != self.stream.progress.confirms_seen:
                self._report_for_confirms()
            self.io.answer_expected = False
            if self.confirms.holding or self.desk.unsettled:
                self._release_stable()
            elif self.replication.unsettled:
                # Nothing waits, but reservations the next deliveries may use do.
                self._stable_marks()
            self.federation.applied()

    def _report_for_confirms(self) -> None:
        broker = self.stream.broker
        progress = self.stream.progress
        progress.confirms_seen = broker.shadow_confirms
        if self.stream.store is not None and not progress.confirms_moved(
            broker.shadow_confirms,
            broker.shadow_durable_confirms,
            broker.event_seq,
            self.stream.durable_seq(),
        ):
            return  # our store's report releases them (on_durable)
        if self.suspended is not None or self.membership.state != READY:
            return
        self.multicast.report_soon(self.io.answer_expected)

    def suspend(self, reason: str, client_text: str = NOT_QUORATE_TEXT) -> None:
        """Stop serving at once (quorum lost, or merged back on the smaller side).

        Synchronous, so it takes effect before anything else runs: every local client gets
        connection.close 320 after the output already queued for it (whole frames), no event
        is applied any more, and this incarnation ends. Its model is discarded: it may hold
        events the quorate side never saw. The member joins again as a newcomer once quorate.
        """
        if self.suspended is not None or self.failure is not None:
            return
        self.service.suspended = reason
        self.multicast.silenced = True
        log.error("stopping client service: %s", reason)
        self.eventlog.write(
            {"type": "suspend", "seq": self.stream.broker.event_seq, "reason": reason}
        )
        # Output waiting to be stable never goes out: its events may be missing on the quorate
        # side, so its confirms are not owed (the publisher treats those messages as unknown).
        self.confirms.drop()
        self.io.force_close(client_text, reason)
        if self.scope is not None:
            self.scope.cancel()

    def _resync(self, rejoin: str, leave: str) -> None:
        """This member's state cannot be trusted: with quorum it takes a fresh state update in
        this process (``rejoin`` says why); without a quorum reader it leaves (``leave``)."""
        if self.quorum is not None:
            self.discard_state = True
            self.suspend(rejoin, RESYNC_TEXT)
            return
        raise ClusterError(leave)

    def _on_event(self, e: Any, sender: int | None) -> None:
        """Every item of the stream passes here. A newcomer keeps what arrives after its
        update point, to replay once the state of that point is installed."""
        buf = self.newcomer.buffer
        if buf is not None:
            buf.append((e, sender))
            if self.newcomer.installed:
                return
            # Until the state is installed, membership still follows the stream live (the
            # newcomer must know who can update it if its updater fails); the model does not.
        if sender is None:
            self._on_cpg_item(e)
        else:
            self._process_event(e, sender)

    def _replay(self, e: Any, sender: int | None) -> None:
        """One buffered stream item, replayed after a state update."""
        if sender is None:
            self._on_cpg_item(e)
        else:
            self._process_event(e, sender)

    def _on_cpg_item(self, ev: Any) -> None:
        if type(ev) is ConfChg:
            self.roster.on_confchg(ev)
        elif type(ev) is PartitionMerge:
            self.roster.on_partition_merge(ev)

    def _process_event(self, e: Any, sender: int) -> None:
        t = type(e)
        membership = self.membership
        if t is Hello:
            self.roster.on_hello(e, sender)
            return
        if t is UpdateRequest:
            self._on_update_request(e)
            return
        if t is Progress:
            self.stream.progress.on_report(e.member, e.seq, e.durable)
            self.multicast.progress_changed()
            return
        if t is Checkpoint:
            if membership.state == READY:
                self.checkpoints.on_checkpoint(e, membership.ready_members)
            return
        if t is ErrorCheck:
            if membership.state == READY:
                self.errorchecks.on_error_check(e)
            return
        if t is StopRequest:
            if membership.state == READY:
                if self.stall.stalled is not None:
                    self.stall.hold(e, sender)  # it takes effect at its point
                else:
                    self._on_stop_request(e)
            return
        if membership.state != READY:
            return  # not serving yet: the members that serve started from the state we lack
        if t is Tick and sender != membership.clock_master:
            return  # a late tick from a former clock master: every member drops it alike
        if t is ClientData and sender == self.member:
            self.io.read_done(e.conn)
        if self.stops.halted is not None:
            return  # stopped at a point of the stream: nothing after it is applied
        if t is AdminCommand and e.op == RAISE_MODEL_VERSION:
            # Decided here, at its point of the stream, even if an error-check round holds
            # it: the membership goes on changing meanwhile.
            e = version_verdict(self.membership, e)
        stall = self.stall
        if stall.stalled is not None:
            stall.hold(e, sender)
            return
        self.applier.apply(e, sender)

    # ------------------------------------------------------------------ state update

    def _on_update_request(self, e: UpdateRequest) -> None:
        if e.member == self.member:
            self.newcomer.on_request(e)
            return
        membership = self.membership
        if not self.updater.gives(
            e, membership, self.stream.broker.version.current, self.stops.halted is not None
        ):
            return
        members = membership.export()
        if self.stall.stalled is not None:
            # Our model is behind the stream until the round is decided: take the snapshot
            # when the replay reaches this request, with the membership of the request's
            # point (if we leave instead, the newcomer asks another member).
            self.stall.hold(DeferredUpdate(e, members), e.member)
            return
        self._fork_update(e, members)

    def _fork_update(self, e: UpdateRequest, members: list[list[Any]]) -> None:
        """Send our state to the newcomer ``e`` names (as the replication mode sends it)."""
        self.replication.fork_update(self.updater, e, members, self.stream.broker)

    async def catch_up(self) -> None:
        """Replay what was delivered after the update point, then say we serve."""
        await self.newcomer.catch_up(self._replay)
        self.stream.broker.replication.catch_up(False)
        self.roster.act([SendHello(STATUS_READY)])

    # ------------------------------------------------------------------ error-check rounds

    def _fail_event(self, e: Any, sender: int) -> None:
        """The cluster failed event ``e`` alike: close its connection, as every member that
        failed it does, and go on as after an applied event."""
        self.io.execute(
            self.stream.broker.fail_event(e, "internal error while processing this connection")
        )
        self.applier.after_apply(e, sender, failed=True)
        if self.replication.failed(e, sender):
            log.error("a change batch of this primary failed on every member: leaving")
            self.fail("a change batch of this primary failed to apply on every member")

    def _recorded(self) -> None:
        """The event log was given up on an event: go on as after it was recorded."""
        self.applier.report_and_digest()

    def _replay_kept(self, e: Any, sender: int) -> None:
        """One item kept while this member was held by an error-check round."""
        t = type(e)
        if t is DeferredUpdate:
            self._fork_update(e.request, e.members)
        elif t is StopRequest:
            self._on_stop_request(e)
        else:
            self.applier.apply(e, sender)

    # ------------------------------------------------------------------ stop requests

    def _on_stop_request(self, e: StopRequest) -> None:
        self.stops.on_request(e, self.stream.broker, self.stream.report)

    async def finish_stop(self) -> None:
        """After a stop request: let confirms up to the stop point out (every ready member
        reports it has applied them), then tell the clients to go."""
        halted = self.stops.halted
        assert halted is not None
        with trio.move_on_after(STOP_SETTLE if self.confirms.holding else 0):
            while self.stream.stable_seq() < halted or (
                self.stream.store is not None and self.stream.durable_stable_seq() < halted
            ):
                await self.multicast.wait_progress()
        self._release_stable()
        self.io.force_close(self.stops.close_text(), self.stops.client_text())

    # ------------------------------------------------------------------ time and status

    async def cluster_ticker(self) -> None:
        interval = self.config.tick_ms / 1000
        membership = self.membership
        events = self.eventlog
        while True:
            await trio.sleep(interval)
            # Written in 64 KiB chunks otherwise: a kill -9 would lose far more than a tick.
            events.flush()
            if (
                membership.state == READY
                and membership.clock_master == self.member
                # Shipping changes, the serving broker keeps its own time
                # (runtime/replication/shipping.py).
                and self.replication.stream_ticks
            ):
                await self.multicast.submit(Tick(self.io.now_ms()))

    @property
    def view(self) -> Broker:
        """The broker the management API and /metrics read: the serving broker of a primary
        shipping changes (its clients, consumers and unacked messages), else the stream's."""
        return self.replication.view(self.stream.broker)

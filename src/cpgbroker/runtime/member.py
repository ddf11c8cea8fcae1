"""A cluster member: the broker model driven by the CPG total order.

Every event a local client causes (connect, bytes, disconnect, do-output grant) is multicast
instead of applied; the member acts on it only when CPG delivers it back, in the same order
every other member delivers it. Events of other members' clients are applied to *shadow*
connections whose output is dropped. Membership (joins, leaves, readiness), cluster time and
digest checkpoints come from the same stream (``cpgbroker.cluster``), so every member takes
every decision at the same point of the order.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from typing import IO, Any

import attrs
import trio

from cpgbroker import MODEL_VERSION, __version__
from cpgbroker.cluster import codec
from cpgbroker.cluster.checkpoint import Checkpoints, Verdict
from cpgbroker.cluster.codec import (
    OK,
    STATUS_NAMES,
    STATUS_READY,
    Checkpoint,
    ErrorCheck,
    Hello,
    Progress,
    StopRequest,
    UpdateRequest,
)
from cpgbroker.cluster.errorcheck import ErrorRounds, Round
from cpgbroker.cluster.membership import (
    NEEDS_UPDATE,
    READY,
    ApplyToModel,
    BecomeReady,
    Fatal,
    Membership,
    NeedUpdate,
    ResumeState,
    SendHello,
)
from cpgbroker.cluster.quorum import SERVE, STOP, decide, ring_change
from cpgbroker.corosync.cpg import MAX_IOVEC
from cpgbroker.corosync.events import (
    ConfChg,
    CpgEvent,
    Deliver,
    PartitionMerge,
    Reason,
    RingChangeSameMembers,
    RingId,
    TotemConfChg,
)
from cpgbroker.errors import ClusterError
from cpgbroker.model import snapshot
from cpgbroker.model.broker import Broker
from cpgbroker.model.events import ClientConnected, ClientData, Event, MemberLeft, Send, Tick
from cpgbroker.runtime import update
from cpgbroker.runtime.cpg_trio import TrioCpg
from cpgbroker.runtime.quorum_trio import TrioQuorum
from cpgbroker.runtime.server import (
    LocalConn,
    Node,
    forced_close_frame,
)
from cpgbroker.runtime.settings import ServerConfig

log = logging.getLogger("cpgbroker.member")

# Largest CPG message we build from queued events (below the 1 MiB atomic size, so libcpg
# never fragments; large enough to amortise the per-message cost over many frames).
MAX_BATCH_BYTES = 512 * 1024
# Cluster flow control: each member reports how far it has applied every PROGRESS_EVERY
# events (or fewer when ``max_lag`` is small), and a member stops multicasting new client
# traffic while the slowest member is more than ``[cluster] max_lag`` events behind it.
# Without this, corosync buffers for a slow member without limit (and never gives the memory
# back).
PROGRESS_EVERY = 1_000
# Confirms wait for every ready member's progress report (stable confirms,
# docs/architecture.md). A
# report rides on the member's next client batch when it has one; otherwise it is a message of
# its own, at most one per this interval: under load that bounds the extra CPG messages per
# member, and it adds at most this much to a confirm's wait.
REPORT_INTERVAL = 0.001
# When the events that asked for a report also gave a local client output (a delivery it will
# ack), the report waits at most this long for the client's answer and rides on it: at a few
# thousand messages per second that saves the consumer's member one CPG message per confirm,
# and every member the work of delivering it. The answer usually comes within a fraction of it.
REPORT_RIDE_WAIT = 0.001
# How long a held ring change may wait for its TotemConfChg and for votequorum's verdict on the
# new ring. Both come from the same corosync synchronisation and arrive within milliseconds;
# past this something is wrong, and the member stops serving rather than guess.
VERDICT_TIMEOUT = 10.0
# After quorum loss, how long clients get to read connection.close before being cut.
SUSPEND_GRACE = 2.0
NOT_QUORATE_TEXT = (
    "member is not in a quorate partition; it serves again once its partition regains quorum "
    "and it has resynchronised: use another member"
)
# A member that is quorate but does not serve: joining, taking a state update, or dropping
# its state after it merged back on the smaller side of a partition.
RESYNC_TEXT = "member is resynchronising with the cluster; it serves again soon: use another member"
# How long a stopping member waits for the others' last progress reports, so that confirms
# for events before the stop point still reach its clients.
STOP_SETTLE = 3.0
# From this many queued and unacked messages on, checkpoint digests are computed in a forked
# child (a fork costs a few ms; a digest about 10 us per message).
DIGEST_FORK_MESSAGES = 2_000
# Error-check rounds kept for ``cpgbroker status``.
ROUNDS_SHOWN = 20
# The kinds of fault a test can inject (``[cluster] fault_injection``): fail while applying
# event N, or find the disk full when recording event N and after.
FAULT_KINDS = ("apply-error", "disk-full")


class InjectedFault(Exception):
    """A failure a test asked for (``POST /faults``): stands for an unexpected exception."""


@attrs.frozen
class _DeferredUpdate:
    """An update request a held member serves when its replay reaches the request's point,
    with the membership as it was at that point."""

    request: UpdateRequest
    members: list[list[Any]]


_TYPE_NAMES = {
    "ClientData": "data",
    "ClientConnected": "connect",
    "ClientDisconnected": "disconnect",
    "DoOutput": "do-output",
    "CloseClient": "close-client",
    "Tick": "tick",
    "MemberLeft": "member-left",
    "ClusterMembers": "members",
}


def member_id(nodeid: int, pid: int) -> int:
    """Unique among live members: corosync identifies a group member by (nodeid, pid)."""
    return (nodeid << 22) | (pid & 0x3FFFFF)


def config_digest(config: ServerConfig) -> bytes:
    """What must be equal on all members for their models to stay equal."""
    b = config.broker
    assert config.cluster is not None
    relevant = attrs.asdict(b, filter=lambda a, _v: a.name not in ("member_urls",))
    relevant["group"] = config.cluster.group
    # Checkpoints are voted on at the same events everywhere, or not at all.
    relevant["checkpoint_every"] = config.cluster.checkpoint_every
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).digest()


class ClusterNode(Node):
    # A confirm (or tx.commit-ok) reaches the client only once its event is stable: applied by
    # every ready member. An event can be delivered on this member's side of a partition only
    # (the old ring's transitional configuration), before the split is reported, and under
    # AGREED ordering a member crashing may take with it an event the others never received:
    # once every member applied it, the message the confirm vouches for survives a partition
    # and the failure of all members but one. See docs/architecture.md, "Stable confirms".
    gate_confirms = True

    def __init__(
        self,
        config: ServerConfig,
        cpg: TrioCpg,
        member: int,
        *,
        quorum: TrioQuorum | None = None,
        conn_counter: int = 0,
        kept: tuple[Broker, int] | None = None,
        incarnation: int = 1,
        updates: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(config, member)
        assert config.cluster is not None
        self.cpg = cpg
        # Without a quorum handle (unit tests on an in-memory bus) nothing is gated.
        self.quorum = quorum
        # Connection ids stay unique when the same process rejoins with the same member id.
        self._conn_counter = conn_counter
        # Set when this member stopped serving for good in this incarnation (quorum lost,
        # or merged back on the smaller side): why, for logs, clients and status.
        self.suspended: str | None = None
        self.scope: trio.CancelScope | None = None
        # The last ring whose quorum verdict let the stream through.
        self._ring: RingId | None = None
        self.client_scopes: dict[int, trio.CancelScope] = {}
        # The model a previous incarnation held when quorum was lost, with the seq of its last
        # quorate ring: offered in our hellos, resumed only if the whole cluster lost quorum.
        self.kept = kept
        # Every incarnation of this process has the same member id and appends to the same
        # event log, its sequence numbers starting again at its update point: the event log
        # tells them apart by this number (the audit checks each incarnation's own stream).
        self.incarnation = incarnation
        # Its state must not be offered again when it rejoins (it holds what the serving
        # members do not): merged back on the smaller side, or applied an event the cluster
        # failed while it was catching up.
        self.discard_state = False
        self.cluster_cfg = config.cluster
        self.membership = Membership(
            member,
            config.cluster.size,
            MODEL_VERSION,
            config_digest(config),
            config.cluster.url,
        )
        self.checkpoints = Checkpoints()
        # Forked checkpoint digests in progress: (seq, read end of the pipe, child pid).
        self._digesting: collections.deque[tuple[int, int, int]] = collections.deque()
        self._digest_wake = trio.Event()
        self.digest_fork_messages = DIGEST_FORK_MESSAGES
        self.forked_digests = 0
        self.checkpoint_every = config.cluster.checkpoint_every
        self.ready = trio.Event()
        self.failed = trio.Event()
        self.failure: str | None = None
        self._out: list[bytes] = []
        self._out_bytes = 0
        # Cluster control messages (progress, checkpoints, hellos, update requests): never held
        # back by cluster flow control, which itself waits for other members' progress reports
        # — held back behind client traffic, those reports would never come (a deadlock).
        self._ctl: list[bytes] = []
        self._send_wake = trio.Event()
        # The sender task is between taking a batch and handing it to CPG: nothing may
        # overtake it on the direct path (``_send_direct``).
        self._sending = False
        self._event_log: IO[str] | None = None
        if config.cluster.event_log:
            self._event_log = open(config.cluster.event_log, "a", buffering=1 << 16)  # noqa: SIM115
        self.delivered_events = 0
        # Latest applied sequence each other member reported (cluster flow control).
        self.peer_progress: dict[int, int] = {}
        # The same, but only what members reported themselves (``peer_progress`` also holds
        # estimates, e.g. at readiness): stability counts facts only.
        self._applied: dict[int, int] = {}
        # Local connections with output held until its event is stable.
        self._holding: dict[int, LocalConn] = {}
        # The model's count of other members' clients' confirms when we last asked to report.
        self._confirms_seen = 0
        # A progress report is due (confirms wait for it); when the last one went out alone.
        self._report_wanted = False
        self._reported_at = 0.0
        self._ride_until = 0.0
        self._progress_changed = trio.Event()
        self.lag_waits = 0
        # Members that came back from the other side of a partition: ignored until they leave.
        self.shunned: set[int] = set()
        self.max_lag = config.cluster.max_lag
        self.progress_every = max(1, min(PROGRESS_EVERY, self.max_lag // 4))
        # -- state update, newcomer side (see runtime/update.py and docs/architecture.md)
        self.update_address = ""
        self._attempt: UpdateRequest | None = None  # our outstanding request
        self._request_delivered = trio.Event()
        # Stream items delivered after our request: (event, sender), or (CPG item, None).
        self._buffer: collections.deque[tuple[Any, int | None]] | None = None
        self._installed = False
        # (seq, updater) of the state installed, for error-check rounds that cross it.
        self._installed_from: tuple[int, int] | None = None
        self._installed_evt = trio.Event()
        self._excluded: dict[int, None] = {}  # updaters that failed us (order kept)
        self._receive_scope: trio.CancelScope | None = None
        self.update_progress: update.UpdateProgress | None = None
        self.update_attempts = 0
        self.replayed = 0
        # -- state update, updater side: forked children streaming a snapshot (pid -> info).
        # Shared across incarnations by the member process, which reaps them: a child can
        # outlive the incarnation that forked it.
        self.updates: dict[int, dict[str, Any]] = {} if updates is None else updates
        # -- error-check rounds (cluster/errorcheck.py): the event this member failed to apply
        # or record, (seq, outcome, event, sender), while the cluster decides; the events
        # delivered meanwhile, (event, sender), applied if it stays.
        self.stalled: tuple[int, str, Any, int] | None = None
        self._stall_buf: collections.deque[tuple[Any, int]] = collections.deque()
        self.error_rounds = ErrorRounds()
        # Rounds this member answered, and rounds it owes an answer once it has applied
        # their event (it was stalled at an earlier one when they opened).
        self._answered: set[int] = set()
        self._owed: list[int] = []
        self.rounds: collections.deque[Round] = collections.deque(maxlen=ROUNDS_SHOWN)
        # A local write failed (the event log today): why. Checked after every event.
        self._write_failed: OSError | None = None
        # Injected faults, kind -> the event seq they fire at (tests only).
        self.faults: dict[str, int] = {}
        # -- stop requests: the event seq this member stopped at, and who asked.
        self.halted: int | None = None
        self.halt_scope = ""
        self.stop_requested = trio.Event()
        self.stop_points: dict[tuple[int, int], int] = {}
        self._stop_seen = trio.Event()

    # ------------------------------------------------------------------ sequencer

    async def submit(self, ev: Event) -> None:
        """Multicast instead of apply: the event takes effect when CPG delivers it."""
        if self.halted is not None:
            # Stopped at a point of the stream: nothing of this member's clients may follow it
            # (their publishes would be applied by the members serving on, unconfirmed).
            return
        if type(ev) is ClientData:
            lc = self.local.get(ev.conn)
            if lc is not None:
                lc.inflight += 1
            data = codec.encode_data(ev.conn, ev.data)
        else:
            data = codec.encode(ev)
        # Nagle's rule: with nothing of ours in flight (a low rate) the event goes out now,
        # from this task; while our messages are in flight (load) it waits in the queue and
        # the sender batches it with whatever else arrives meanwhile.
        if not (self.cpg.idle and self._send_direct(data, client=True)):
            self._queue(data)

    def _send_direct(self, data: bytes | None, client: bool) -> bool:
        """Multicast ``data`` in this scheduling turn, if nothing queued or being sent would
        be overtaken and it needs no waiting; a wanted progress report rides along (``data``
        None: the report alone).

        At low rates a CPG message costs mostly scheduling: waking the sender task is one
        more round of trio's run loop (an epoll call and the loop's own work) per message.
        """
        if self._out or self._ctl or self._sending or self.suspended or self.failure:
            return False
        if client and self.lag() > self.max_lag:
            return False  # the sender holds client traffic back until the slowest catches up
        bufs = [] if data is None else [data]
        report = self._report_wanted
        if report:
            bufs.append(self._report())
        if not bufs or not self.cpg.send_nowait(codec.HEADER, *bufs):
            return False
        if report:
            self._report_gone()
        return True

    def _queue_control(self, data: bytes) -> None:
        self._ctl.append(data)
        self._send_wake.set()

    async def _flush_control(self) -> None:
        while self._ctl:
            take, size = 0, 2
            for data in self._ctl:
                if take and size + len(data) > MAX_BATCH_BYTES:
                    break
                size += len(data)
                take += 1
            batch = self._ctl[:take]
            del self._ctl[:take]
            was, self._sending = self._sending, True
            try:
                await self.cpg.send(codec.HEADER + b"".join(batch))
            finally:
                self._sending = was

    def _queue(self, data: bytes) -> None:
        self._out.append(data)
        self._out_bytes += len(data)
        self._send_wake.set()

    async def sender(self) -> None:
        while True:
            if self._ctl:
                await self._flush_control()
            if not self._out:
                if self._report_wanted:
                    # No client batch to ride on: a message of its own, at most one per
                    # REPORT_INTERVAL (a newer report replaces a waiting one).
                    wait = (
                        max(self._reported_at + REPORT_INTERVAL, self._ride_until)
                        - time.monotonic()
                    )
                    if wait > 0:
                        self._send_wake = trio.Event()
                        with trio.move_on_after(wait):
                            await self._send_wake.wait()
                        continue
                    self._ctl.append(self._take_report())
                    continue
                if not self._ctl:
                    self._send_wake = trio.Event()
                    await self._send_wake.wait()
                continue
            # Take queued events up to the batch size, in order.
            out = self._out
            take = 0
            size = 2
            for data in out:
                if take and size + len(data) > MAX_BATCH_BYTES:
                    break
                size += len(data)
                take += 1
            self._sending = True
            try:
                await self._wait_for_slow_members()
                batch = out[:take]
                del out[:take]
                self._out_bytes -= size - 2
                if self._report_wanted:
                    batch.append(self._take_report())  # rides along: no message of its own
                if len(batch) < MAX_IOVEC:  # the binding gathers up to MAX_IOVEC buffers
                    await self.cpg.send(codec.HEADER, *batch)  # gathered by the kernel, no copy
                else:
                    await self.cpg.send(codec.HEADER + b"".join(batch))
            finally:
                self._sending = False

    def lag(self) -> int:
        """How many events the slowest ready member is behind this one."""
        seq = self.broker.event_seq
        behind = [
            seq - self.peer_progress.get(m, seq)
            for m in self.membership.ready_members
            if m != self.member
        ]
        return max(behind, default=0)

    async def _wait_for_slow_members(self) -> None:
        if self.lag() <= self.max_lag:
            return
        self.lag_waits += 1
        log.warning("holding back client traffic: a member is %d events behind", self.lag())
        while self.lag() > self.max_lag:
            if self._report_wanted:
                self._ctl.append(self._take_report())
            await self._flush_control()  # our own reports must get out, or nobody moves
            self._progress_changed = trio.Event()
            with trio.move_on_after(0.05):
                await self._progress_changed.wait()

    # ------------------------------------------------------------------ delivery

    async def deliver_loop(self) -> None:
        cpg = self.cpg
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
                    if sender in self.shunned:
                        continue  # diverged in a partition; it is leaving
                    for e in codec.decode_batch(ev.data, sender):  # type: ignore[union-attr]
                        self._on_event(e, sender)
                elif t is RingChangeSameMembers:
                    log.info("ring re-formed with the same members ring=%s", ev.ring_id)  # type: ignore[union-attr]
                else:
                    if self.quorum is not None and (
                        t is TotemConfChg
                        or (
                            t is ConfChg
                            and ring_change(
                                [c.reason for c in (*ev.left, *ev.joined)],  # type: ignore[union-attr]
                                Reason.NODEDOWN,
                                Reason.NODEUP,
                            )
                        )
                    ):
                        # A ConfChg caused by a ring change precedes the TotemConfChg that
                        # names the ring: hold everything from here until it has arrived.
                        ring = next((x.ring_id for x in batch[i:] if type(x) is TotemConfChg), None)
                        if ring is None:
                            held = batch[i:]
                            break
                        if ring != self._ring:
                            # All of the ring change is in hand. A member frozen past the
                            # token sees the others leave and come back in one change: if it
                            # lost the merge, it must not apply their departure (requeue their
                            # messages, hand them to its own consumers) first.
                            others = self._merge_lost(batch, i)
                            if others is not None:
                                self._lose_merge(others)
                                return
                            if not await self._await_verdict(ring):
                                return
                    self._on_event(ev, None)
                if self.suspended is not None:
                    return
            # Once per delivered batch, not per event: a confirm for another member's client
            # waits for every member's report, so report now rather than PROGRESS_EVERY
            # events later (our own clients' confirms need no report from us); and release
            # what the reports received made stable.
            if self.broker.shadow_confirms != self._confirms_seen:
                self._report_for_confirms()
            self.answer_expected = False
            if self._holding:
                self._release_stable()

    # ------------------------------------------------------------------ stable confirms

    def hold(self, lc: LocalConn, eff: Send) -> None:
        """Output that must wait: a confirm until its event is stable, anything else (for the
        same connection) until the output before it is out."""
        lc.held.append((self.broker.event_seq if eff.confirm else 0, eff.data, ""))
        self._holding[lc.id] = lc

    def stable_seq(self) -> int:
        """The highest event sequence every ready member (this one included) is known to
        have applied. Every, not a majority: a majority survives partitions, but with AGREED
        delivery two crashed members of three may have applied an event the third never
        received, and a confirm promises survival of all members but one."""
        ready = self.membership.ready_members
        if not ready:
            return 0
        seq = self.applied_seq()
        return min(seq if m == self.member else self._applied.get(m, 0) for m in ready)

    def _report_for_confirms(self) -> None:
        self._confirms_seen = self.broker.shadow_confirms
        if self.suspended is not None or self.membership.state != READY:
            return
        if self._report_wanted:
            return  # the waiting report is taken when it leaves: it covers these events too
        self._report_wanted = True
        now = time.monotonic()
        if self.answer_expected:
            self._ride_until = now + REPORT_RIDE_WAIT
        elif now - self._reported_at >= REPORT_INTERVAL and self._send_direct(None, False):
            # Straight from the delivery loop when nothing is queued: the report leaves in the
            # turn that applied the events it vouches for.
            return
        self._send_wake.set()

    def _report(self) -> bytes:
        """Our progress as of now (at least the events that asked for it)."""
        return codec.encode(Progress(self.member, self.applied_seq()))

    def _report_gone(self) -> None:
        self._report_wanted = False
        self._reported_at = time.monotonic()

    def _take_report(self) -> bytes:
        """The report, for a message the sender is about to multicast."""
        self._report_gone()
        return self._report()

    def applied_seq(self) -> int:
        """The last event this member vouches for: while it is held at a failed event, the
        one before (the failed one may yet be undone by the round's decision)."""
        return self.broker.event_seq if self.stalled is None else self.stalled[0] - 1

    def _release_stable(self) -> None:
        stable = self.stable_seq()
        for cid, lc in list(self._holding.items()):
            if self.local.get(cid) is not lc:
                del self._holding[cid]  # the client is gone (its fd may be reused: no write)
                continue
            held = lc.held
            n = 0
            for seq, _data, _reason in held:
                if seq > stable:
                    break
                n += 1
            if not n:
                continue
            ready = held[:n]
            del held[:n]
            for _seq, data, reason in ready:
                if data is not None:
                    self.write(lc, data)
                else:
                    lc.closing = True
                    lc.close_reason = reason
                    lc.wake.set()
            if not held:
                del self._holding[cid]
                lc.wake.set()  # a do-output grant waits for held output to be written

    async def _await_verdict(self, ring: RingId) -> bool:
        """Wait for votequorum's verdict on ``ring``; True if quorate, else stop serving."""
        assert self.quorum is not None
        key = (ring.nodeid, ring.seq)
        with trio.move_on_after(VERDICT_TIMEOUT):
            while True:
                d = decide(self.quorum.view.verdict(key))
                if d == SERVE:
                    self._ring = ring
                    return True
                if d == STOP:
                    self.suspend(f"ring {ring.nodeid}.{ring.seq} is not quorate")
                    return False
                await self.quorum.wait_change()
        self.suspend(f"votequorum gave no verdict on ring {ring.nodeid}.{ring.seq}")
        return False

    def apply(self, ev: Event) -> None:
        # A suspended member's model is about to be discarded: nothing more reaches clients.
        if self.suspended is None:
            self.execute(self.broker.apply(ev))

    @property
    def serving(self) -> bool:
        return self.ready.is_set() and self.suspended is None

    def suspend(self, reason: str, client_text: str = NOT_QUORATE_TEXT) -> None:
        """Stop serving at once (quorum lost, or merged back on the smaller side).

        Synchronous, so it takes effect before anything else runs: every local client gets
        connection.close 320 after the output already queued for it (whole frames), no event
        is applied any more, and this incarnation ends. Its model is discarded: it may hold
        events the quorate side never saw. The member joins again as a newcomer once quorate.
        """
        if self.suspended is not None or self.failure is not None:
            return
        self.suspended = reason
        log.error("stopping client service: %s", reason)
        self._write_log({"type": "suspend", "seq": self.broker.event_seq, "reason": reason})
        # Output waiting to be stable never goes out: its events may be missing on the quorate
        # side, so its confirms are not owed (the publisher treats those messages as unknown).
        self._holding.clear()
        self._force_close_locals(client_text, reason)
        if self.scope is not None:
            self.scope.cancel()

    def _force_close_locals(self, client_text: str, reason: str) -> None:
        """connection.close 320 to every local client after the output already queued for it
        (whole frames), without the model: this member no longer applies events."""
        frame = forced_close_frame(client_text)
        for lc in self.local.values():
            lc.held.clear()
            if not lc.closing:
                lc.out += frame
            lc.closing = True
            lc.model_closed = True
            lc.close_reason = lc.close_reason or reason
            lc.wake.set()

    def on_quorum_loss(self, reason: str) -> None:
        self.suspend(reason)

    def _on_event(self, e: Any, sender: int | None) -> None:
        """Every item of the stream passes here. A newcomer keeps what arrives after its
        update point, to replay once the state of that point is installed."""
        buf = self._buffer
        if buf is not None:
            buf.append((e, sender))
            if self._installed:
                return
            # Until the state is installed, membership still follows the stream live (the
            # newcomer must know who can update it if its updater fails); the model does not.
        if sender is None:
            self._on_cpg_item(e)
        else:
            self._process_event(e, sender)

    def _on_cpg_item(self, ev: Any) -> None:
        if type(ev) is ConfChg:
            self._on_confchg(ev)
        elif type(ev) is PartitionMerge:
            self._on_partition_merge(ev)

    def _process_event(self, e: Any, sender: int) -> None:
        t = type(e)
        if t is Hello:
            was = self.membership.members.get(e.member)
            newly_ready = e.status == STATUS_READY and (was is None or was.status != STATUS_READY)
            self._act(self.membership.on_hello(e))
            if newly_ready:
                # A member that just caught up through an update: count its lag from here.
                self.peer_progress[e.member] = max(
                    self.peer_progress.get(e.member, 0), self.broker.event_seq
                )
            self._log_event("hello", sender, None, 0, status=STATUS_NAMES.get(e.status, "?"))
            if self.membership.state == NEEDS_UPDATE and self._attempt is None:
                self._request_update()
            return
        if t is UpdateRequest:
            self._on_update_request(e)
            return
        if t is Progress:
            self.peer_progress[e.member] = e.seq
            self._applied[e.member] = e.seq
            self._progress_changed.set()
            return
        if t is Checkpoint:
            if self.membership.state == READY:
                verdict = self.checkpoints.record(
                    e.seq, e.member, e.digest, self.membership.ready_members
                )
                if verdict is not None:
                    self._on_verdict(verdict)
            return
        if t is ErrorCheck:
            if self.membership.state == READY:
                self._on_error_check(e)
            return
        if t is StopRequest:
            if self.membership.state == READY:
                if self.stalled is not None:
                    self._stall_buf.append((e, sender))  # it takes effect at its point
                else:
                    self._on_stop_request(e)
            return
        if self.membership.state != READY:
            return  # not serving yet: the members that serve started from the state we lack
        if t is Tick and sender != self.membership.clock_master:
            return  # a late tick from a former clock master: every member drops it alike
        if t is ClientData and sender == self.member:
            lc = self.local.get(e.conn)
            if lc is not None:
                lc.inflight -= 1
                lc.credit_back.set()
        if self.halted is not None:
            return  # stopped at a point of the stream: nothing after it is applied
        if self.stalled is not None:
            self._stall_buf.append((e, sender))
            return
        self._apply_stream(e, sender)

    def _apply_stream(self, e: Any, sender: int) -> None:
        """Apply one event of the stream. An exception here is an error the stream does not
        explain (the same event applies cleanly elsewhere, or everywhere fails alike): the
        cluster decides in an error-check round."""
        seq = self.broker.event_seq + 1
        try:
            if self.faults and self._fault_due("apply-error", seq):
                del self.faults["apply-error"]
                raise InjectedFault("injected failure")
            self.apply(e)
        except Exception as exc:
            # Counted as applied either way: the members that continue agree on the count.
            self.broker.event_seq = seq
            self._local_error(seq, f"apply-error: {type(exc).__name__}", str(exc), e, sender)
            return
        if type(e) is ClientConnected and e.member != self.member:
            self.broker.set_emit(e.conn, False)
        self._after_apply(e, sender)

    def _after_apply(self, e: Any, sender: int) -> None:
        if self.suspended is not None:
            # Not applied (see apply): nothing to log, report or digest.
            return
        self.delivered_events += 1
        if self._event_log is not None:
            if self.faults and self._fault_due("disk-full", self.broker.event_seq):
                self._write_failed = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            else:
                self._log_event(
                    _TYPE_NAMES.get(type(e).__name__, type(e).__name__),
                    sender,
                    getattr(e, "conn", None),
                    len(e.data) if type(e) is ClientData else 0,
                )
            if self._write_failed is not None:
                # This member could not record the event: the others may have. Whether it
                # may go on is the cluster's call.
                err = self._write_failed
                name = errno.errorcode.get(err.errno or 0, "EIO")
                self._local_error(
                    self.broker.event_seq, f"store-write: {name}", str(err), e, sender
                )
                return
        self._report_and_digest()

    def _fault_due(self, kind: str, seq: int) -> bool:
        """Whether an injected fault of ``kind`` fires at event ``seq`` (tests only; the
        callers test ``self.faults`` first, so the hot path pays one truth test)."""
        at = self.faults.get(kind)
        return at is not None and seq >= at

    def _report_and_digest(self) -> None:
        seq = self.broker.event_seq
        if self._owed:
            self._pay_owed()
        if seq % self.progress_every == 0:
            self._queue_control(codec.encode(Progress(self.member, seq)))
        if seq % self.checkpoint_every == 0:
            self._checkpoint(seq)

    def _checkpoint(self, seq: int) -> None:
        """Digest the model as it is after event ``seq`` and vote on it. A large state is
        digested in a forked child (copy on write: the state of exactly this point) while this
        member goes on applying events: digesting a million messages takes seconds, and done
        inline it would stall the member, and through flow control and confirms the cluster."""
        if self._messages() >= self.digest_fork_messages:
            r, w = os.pipe()
            try:
                broker = self.broker
                pid = update.fork_child(
                    lambda: _write_all(w, snapshot.digest_bytes(broker)),
                    f"checkpoint digest at event {seq}",
                    keep=w,
                )
            except OSError as e:  # no memory or processes left for a child: digest here
                log.warning("cannot fork for the checkpoint digest (%s): digesting inline", e)
                os.close(r)
            else:
                self.forked_digests += 1
                self._digesting.append((seq, r, pid))
                self._digest_wake.set()
                return
            finally:
                os.close(w)
        self._checkpoint_done(seq, snapshot.digest_bytes(self.broker))

    def _checkpoint_done(self, seq: int, digest: bytes) -> None:
        if self.suspended is not None or self.halted is not None:
            return
        self._queue_control(codec.encode(Checkpoint(self.member, seq, digest)))
        if self._event_log is not None:
            self._write_log({"type": "checkpoint", "seq": seq, "digest": digest.hex()})

    def _messages(self) -> int:
        return sum(
            len(q.messages) + q.unacked
            for vh in self.broker.vhosts.values()
            for q in vh.queues.values()
        )

    async def collect_digests(self) -> None:
        """Take the digests of forked checkpoint children, in checkpoint order."""
        while True:
            while not self._digesting:
                self._digest_wake = trio.Event()
                await self._digest_wake.wait()
            seq, r, pid = self._digesting[0]
            data = b""
            try:
                while len(data) < 32:
                    await trio.lowlevel.wait_readable(r)
                    chunk = os.read(r, 32 - len(data))
                    if not chunk:
                        break
                    data += chunk
            finally:
                os.close(r)
                self._digesting.popleft()
            while os.waitpid(pid, os.WNOHANG)[0] == 0:
                await trio.sleep(0.001)  # it exits right after writing
            if len(data) != 32:
                # The child failed (its log says why): this member cannot vouch for its state.
                raise ClusterError(f"the checkpoint digest at event {seq} could not be computed")
            self._checkpoint_done(seq, data)

    @staticmethod
    def _merge_verdict(ev: PartitionMerge, members: Iterable[int]) -> tuple[bool, list[int]]:
        """Whether this side (``members`` at the merge) wins the merge, and the other side."""
        others = [member_id(m.nodeid, m.pid) for m in (*ev.rejoined, *ev.merged)]
        mine = [m for m in members if m not in others]
        wins = (len(mine), -min(mine, default=1 << 62)) > (
            len(others),
            -min(others, default=1 << 62),
        )
        return wins, others

    def _merge_lost(self, batch: list[CpgEvent], start: int) -> list[int] | None:
        """Scan one ring change (``batch[start:]`` up to its TotemConfChg) for a partition
        merge this member loses; the other side's members if so. Members are followed through
        the change's ConfChgs as ``_on_confchg`` would, without applying anything."""
        members = list(self.membership.members)
        for x in batch[start:]:
            t = type(x)
            if t is TotemConfChg:
                break
            if t is ConfChg:
                members = [
                    m
                    for m in (member_id(c.nodeid, c.pid) for c in x.members)  # type: ignore[union-attr]
                    if m not in self.shunned
                ]
            elif t is PartitionMerge:
                wins, others = self._merge_verdict(x, members)  # type: ignore[arg-type]
                if not wins:
                    return others
        return None

    def _on_partition_merge(self, ev: PartitionMerge) -> None:
        """Two sides of a partition merged: neither saw what the other applied meanwhile.
        The side with more members keeps serving (on a tie, the side holding the lowest member
        id); the other side's members leave, and until they are gone nothing they send is
        applied. Both sides reach the same verdict: each knows both sides' members."""
        wins, others = self._merge_verdict(ev, self.membership.members)
        if wins:
            log.error(
                "partition healed: members %s come back from another partition with diverged "
                "state; ignoring them until they leave",
                others,
            )
            self.shunned.update(others)
            for m in others:
                self.membership.members.pop(m, None)
            return
        self._lose_merge(others)

    def _lose_merge(self, others: list[int]) -> None:
        reason = (
            "this member was partitioned from the cluster and merged back on the smaller side: "
            "it missed events the others applied, so its state cannot be trusted"
        )
        if self.quorum is not None:
            # With quorum it has not served since the split; it resynchronises instead.
            self.discard_state = True
            self.suspend(
                f"{reason}; rejoining through a state update (other side: {others})", RESYNC_TEXT
            )
            return
        raise ClusterError(f"{reason}; leaving (other side: {others})")

    def _on_confchg(self, ev: ConfChg) -> None:
        members = [
            m for m in (member_id(x.nodeid, x.pid) for x in ev.members) if m not in self.shunned
        ]
        joined = [
            m for m in (member_id(x.nodeid, x.pid) for x in ev.joined) if m not in self.shunned
        ]
        left = [member_id(m.nodeid, m.pid) for m in ev.left]
        self.shunned.difference_update(left)
        for gone in left:
            self.peer_progress.pop(gone, None)
            self._applied.pop(gone, None)
        for m in ev.left:
            log.warning(
                "member left member=%s node=%s pid=%s reason=%s",
                member_id(m.nodeid, m.pid),
                m.nodeid,
                m.pid,
                m.reason.name,
            )
        for m in ev.joined:
            log.info("member joined node=%s pid=%s", m.nodeid, m.pid)
        self._act(self.membership.on_confchg(members, joined, left))
        a = self._attempt
        if a is not None and not self._installed and a.updater in left:
            self._retry_update(f"updater {a.updater} left the cluster", exclude=a.updater)
        if left and self.membership.state == READY:
            for verdict in self.checkpoints.members_changed(self.membership.ready_members):
                self._on_verdict(verdict)
            for r in self.error_rounds.members_left(left):
                self._on_round(r)

    def _act(self, actions: list[Any]) -> None:
        for a in actions:
            t = type(a)
            if t is SendHello:
                self._queue_control(
                    codec.encode(
                        Hello(
                            self.member,
                            a.status,
                            MODEL_VERSION,
                            self.membership.config_digest,
                            self.cluster_cfg.url,
                            f"cpgbroker {__version__}",
                            self.now_ms(),
                            0 if self.kept is None else self.kept[1],
                            0 if self.kept is None else self.kept[0].event_seq,
                        )
                    )
                )
            elif t is BecomeReady:
                # Every member becomes ready at this same event: that is where each of them
                # stands until it reports more (a member that never reports is then seen to lag).
                for m in self.membership.ready_members:
                    self.peer_progress[m] = self.broker.event_seq
                log.info(
                    "cluster ready members=%d clock_master=%s",
                    len(self.membership.members),
                    self.membership.clock_master,
                )
                self.ready.set()
            elif t is ApplyToModel:
                if self.halted is not None:
                    continue
                if self.stalled is not None:
                    self._stall_buf.append((a.event, 0))
                    continue
                self._apply_stream(a.event, 0)
            elif t is NeedUpdate:
                log.info("%s", a.reason)
                self.kept = None
                self._request_update()
            elif t is ResumeState:
                self._resume(a.start_ms)
            elif t is Fatal:
                raise ClusterError(a.reason)

    def _resume(self, start_ms: int) -> None:
        """Serve again with the state kept when the whole cluster lost quorum.

        Its connections are all from before the split (no client event precedes this point),
        so each of their members is treated as gone: connections closed, unacked messages
        requeued. Nobody else has a model yet: they take updates after this point.
        """
        assert self.kept is not None
        broker, ring = self.kept
        self.kept = None
        self.broker = broker
        stale = sorted({codec.split_conn(c)[0] for c in broker.connections})
        log.warning(
            "resuming the state kept since quorum was lost: ring %s, event %s, closing the "
            "connections of %d former members",
            ring,
            broker.event_seq,
            len(stale),
        )
        self._act([ApplyToModel(MemberLeft(m)) for m in stale])
        self._act([ApplyToModel(Tick(max(start_ms, broker.now_ms)))])

    # ------------------------------------------------------------------ state update

    def _request_update(self) -> None:
        """Ask a serving member for the state at the point where this request is delivered.
        The highest-id serving member is asked (the lowest is the clock master); members that
        failed an earlier attempt only when nobody else is left."""
        ready = [m for m in self.membership.ready_members if m != self.member]
        candidates = [m for m in ready if m not in self._excluded] or ready
        self._buffer = None
        self._request_delivered = trio.Event()
        if not candidates:
            self._attempt = None
            log.warning("no serving member to take a state update from yet; waiting")
            return
        self.update_attempts += 1
        self._attempt = UpdateRequest(
            self.member, candidates[-1], self.update_address, os.urandom(update.TOKEN_BYTES)
        )
        log.info(
            "requesting a state update from member=%s (attempt %d)",
            candidates[-1],
            self.update_attempts,
        )
        self._queue_control(codec.encode(self._attempt))

    def _retry_update(self, reason: str, exclude: int | None) -> None:
        log.warning("state update failed: %s; asking another member", reason)
        if exclude is not None:
            self._excluded[exclude] = None
        if self._receive_scope is not None:
            self._receive_scope.cancel()
        self.update_progress = None
        self._request_update()

    def _on_update_request(self, e: UpdateRequest) -> None:
        if e.member == self.member:
            a = self._attempt
            if a is None or e.token != a.token or self._installed:
                return  # a superseded attempt
            if e.updater not in self.membership.members:
                self._retry_update(f"member {e.updater} left before the request", None)
                return
            # The update point: from here on, the stream is kept for replay.
            self._buffer = collections.deque()
            self._request_delivered.set()
            return
        me = self.membership.members.get(self.member)
        if (
            e.updater != self.member
            or self.membership.state != READY
            or me is None
            or me.status != STATUS_READY
            or e.member not in self.membership.members
            # A stopping member's model ends before the request's point: the newcomer asks
            # another member once this one has left.
            or self.halted is not None
        ):
            return
        members = self.membership.export()
        if self.stalled is not None:
            # Our model is behind the stream until the round is decided: take the snapshot
            # when the replay reaches this request, with the membership of the request's
            # point (if we leave instead, the newcomer asks another member).
            self._stall_buf.append((_DeferredUpdate(e, members), e.member))
            return
        self._fork_updater(e, members)

    def _fork_updater(self, e: UpdateRequest, members: list[list[Any]]) -> None:
        pid = update.fork_updater(
            e.address,
            e.token,
            self.broker,
            members,
            self.member,
            e.member,
            self.cluster_cfg.update_rate_limit,
        )
        self.updates[pid] = {
            "incarnation": self.incarnation,
            "newcomer": e.member,
            "pid": pid,
            "seq": self.broker.event_seq,
            "started": time.monotonic(),
        }
        log.info(
            "sending a state update to member=%s seq=%s (child pid %s)",
            e.member,
            self.broker.event_seq,
            pid,
        )

    def end_updates(self) -> None:
        """This incarnation is over: its transfers are useless (each newcomer asks another
        member once we have left), so end them; the member process reaps them."""
        for pid in self.updates:
            if self.updates[pid].get("incarnation") == self.incarnation:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def update_handler(self, stream: trio.SocketStream) -> None:
        """An updater connects: check the token, restore while the stream keeps flowing into
        the buffer, then install and catch up."""
        async with stream:
            try:
                reader, token = await update.read_token(stream)
            except (ClusterError, trio.TooSlowError, trio.BrokenResourceError, OSError) as e:
                log.warning("rejected a state transfer connection: %s", e)
                return
            a = self._attempt
            if a is None or token != a.token or self._installed:
                log.warning("rejected a state transfer connection with an unknown token")
                return
            progress = self.update_progress = update.UpdateProgress(a.updater)
            restorer = snapshot.Restorer(self.config.broker)
            with trio.CancelScope() as scope:
                self._receive_scope = scope
                try:
                    broker, members = await update.receive_update(reader, restorer, progress)
                    # The state is the one at our request's delivery; install once that
                    # point has been delivered here too (the buffer starts there).
                    await self._request_delivered.wait()
                # Whatever breaks a transfer (connection, corrupt data, decode errors), the
                # remedy is the same: ask again, elsewhere.
                except Exception as e:
                    if self._attempt is a:
                        self._retry_update(f"transfer from member {a.updater}: {e}", a.updater)
                    return
                finally:
                    self._receive_scope = None
            if scope.cancelled_caught or self._attempt is not a:
                return
            self._install(broker, members, progress)

    def _install(self, broker: Broker, members: list[list[Any]], p: update.UpdateProgress) -> None:
        self._installed_from = (broker.event_seq, p.updater)
        self.broker = broker
        self.membership.adopt(members)
        self._installed = True
        self._attempt = None
        for m in self.membership.ready_members:
            self.peer_progress[m] = broker.event_seq
        log.info(
            "state update installed seq=%s messages=%d parts=%d %.1f MiB in %.1f s; "
            "replaying %d events delivered since",
            broker.event_seq,
            p.messages,
            p.parts,
            p.bytes / 2**20,
            time.monotonic() - p.started,
            len(self._buffer or ()),
        )
        self._installed_evt.set()

    async def catch_up(self) -> None:
        """Replay what was delivered after the update point, then say we serve."""
        await self._installed_evt.wait()
        buf = self._buffer
        assert buf is not None
        n = 0
        while buf:
            e, sender = buf.popleft()
            if sender is None:
                self._on_cpg_item(e)
            else:
                self._process_event(e, sender)
            n += 1
            if n % 256 == 0:
                await trio.lowlevel.checkpoint()  # the CPG reader appends meanwhile
        # No checkpoint between the empty test and this: nothing can slip in between.
        self._buffer = None
        self.replayed = n
        log.info("caught up after replaying %d events; announcing ready", n)
        self._act([SendHello(STATUS_READY)])

    def update_activity(self) -> int:
        """Grows while an update makes progress (the ready timeout does not cut it short)."""
        p = self.update_progress
        return (p.bytes if p is not None else 0) + self.replayed + len(self._buffer or ())

    def _on_verdict(self, v: Verdict) -> None:
        if self._event_log is not None:
            self._write_log(
                {
                    "type": "verdict",
                    "seq": v.seq,
                    "agreed": v.agreed,
                    "losers": list(v.losers),
                    "digests": {str(m): d.hex() for m, d in v.digests},
                }
            )
        if v.agreed:
            log.debug("checkpoint agreed seq=%s digest=%s", v.seq, v.winner.hex()[:16])
            return
        log.error(
            "REPLICAS DIVERGED seq=%s digests=%s losers=%s",
            v.seq,
            {m: d.hex()[:16] for m, d in v.digests},
            list(v.losers),
        )
        if self.member in v.losers:
            raise ClusterError(
                f"this member's state differs from the majority at event {v.seq}: leaving"
            )

    # ------------------------------------------------------------------ error-check rounds

    def _local_error(self, seq: int, outcome: str, detail: str, e: Any, sender: int) -> None:
        """This member failed to apply (or record) event ``seq`` and the stream does not say
        why: stop applying here and let the cluster decide (cluster/errorcheck.py).

        ``outcome`` is what members vote on: the kind and the exception class or errno name,
        never the message (which may hold addresses or paths that differ between members
        failing alike); ``detail`` goes to the logs."""
        if self.member not in self.membership.ready_members:
            # Not serving yet (catching up after an update): nobody relies on this member.
            raise ClusterError(f"failed at event {seq} while catching up: {outcome}: {detail}")
        log.error(
            "error at event %s: %s (%s); holding until the error-check round decides",
            seq,
            outcome,
            detail,
        )
        self.stalled = (seq, outcome, e, sender)
        self._answered.add(seq)
        if seq in self._owed:
            self._owed.remove(seq)  # our answer is this error, not "ok"
        self._write_log({"type": "error", "seq": seq, "outcome": outcome, "detail": detail[:500]})
        self._queue_control(codec.encode(ErrorCheck(self.member, seq, outcome)))

    def _on_error_check(self, e: ErrorCheck) -> None:
        ready = self.membership.ready_members
        if self.halted is not None and e.seq > self.halted:
            return  # never applied it, and leaving: the round goes on without this member
        if e.member in ready and e.seq not in self._answered and self.member in ready:
            # Every member that delivers this has delivered event e.seq before it; it has
            # applied it unless it is itself held at an earlier error.
            self._answered.add(e.seq)
            if self.stalled is None or self.stalled[0] > e.seq:
                self._queue_control(codec.encode(ErrorCheck(self.member, e.seq, OK)))
            else:
                self._owed.append(e.seq)
        r = self.error_rounds.record(e.seq, e.member, e.outcome, ready)
        if r is not None:
            self._on_round(r)

    def _pay_owed(self) -> None:
        seq = self.broker.event_seq
        for s in [s for s in self._owed if s <= seq]:
            self._owed.remove(s)
            self._queue_control(codec.encode(ErrorCheck(self.member, s, OK)))

    def _on_round(self, r: Round) -> None:
        self.rounds.append(r)
        self._write_log({"type": "error-check", **r.as_dict()})
        (log.info if not r.losers else log.error)(
            "error-check round decided seq=%s decision=%r outcomes=%s leaving=%s",
            r.seq,
            r.decision,
            dict(r.outcomes),
            list(r.losers),
        )
        if self.member in r.losers:
            mine = dict(r.outcomes)[self.member]
            raise ClusterError(
                f"error-check at event {r.seq}: this member's outcome ({mine}) lost to the "
                f"majority's ({r.decision}); leaving"
            )
        stalled = self.stalled
        if (
            r.decision.startswith("apply-error")
            and self.member not in dict(r.outcomes)
            and self.halted is None
        ):
            # Not asked (it became ready after the round opened): its state has the event the
            # cluster decided failed applied, unless it came in a state update from a member
            # that had failed it too.
            src = self._installed_from
            if src is None or src[0] < r.seq or src[1] in r.losers:
                reason = (
                    f"error-check at event {r.seq}: the cluster failed that event, which this "
                    "member has applied (it was catching up)"
                )
                if self.quorum is not None:
                    # Nothing else is wrong with it: it takes a fresh state update in this
                    # process, as a member merged back on the smaller side does.
                    self.discard_state = True
                    self.suspend(f"{reason}; rejoining through a state update", RESYNC_TEXT)
                    return
                raise ClusterError(f"{reason}; leaving: start it again to take a fresh update")
        if stalled is None or stalled[0] != r.seq:
            return
        _seq, outcome, e, sender = stalled
        self.stalled = None
        # The majority failed here alike: take the same way forward as all of them.
        if outcome.startswith("apply-error"):
            self.execute(
                self.broker.fail_event(e, "internal error while processing this connection")
            )
            self._after_apply(e, sender)
        else:
            log.error("event log disabled after a failed write: %s", outcome)
            self._close_event_log()
            self.faults.pop("disk-full", None)
            self._write_failed = None
            self._report_and_digest()
        self._replay_stalled()

    def _replay_stalled(self) -> None:
        """Apply what was delivered while this member waited for a round, in order, until it
        is held again or the buffer is empty."""
        buf = self._stall_buf
        while buf and self.stalled is None and self.halted is None:
            e, sender = buf.popleft()
            t = type(e)
            if t is _DeferredUpdate:
                self._fork_updater(e.request, e.members)
            elif t is StopRequest:
                self._on_stop_request(e)
            else:
                self._apply_stream(e, sender)

    def inject_fault(self, kind: str, at_seq: int) -> dict[str, Any]:
        """Make this member fail at event ``at_seq`` (tests; ``[cluster] fault_injection``)."""
        if kind not in FAULT_KINDS:
            raise ClusterError(f"unknown fault kind {kind!r} (known: {', '.join(FAULT_KINDS)})")
        if kind == "disk-full" and self._event_log is None:
            raise ClusterError("this member records nothing per event (no [cluster] event_log)")
        at_seq = max(at_seq, self.broker.event_seq + 1)
        self.faults[kind] = at_seq
        log.warning("fault injected kind=%s at_seq=%s", kind, at_seq)
        return {"kind": kind, "at_seq": at_seq}

    # ------------------------------------------------------------------ stop requests

    async def request_stop(self, target: int, timeout: float = 10.0) -> int:
        """Ask ``target`` (0: every member) to stop; the event seq where the request took
        effect, once it is delivered back here."""
        if target and target not in self.membership.ready_members:
            raise ClusterError(f"no serving member {target} in the cluster")
        key = (self.member, target)
        self.stop_points.pop(key, None)
        self._queue_control(codec.encode(StopRequest(self.member, target)))
        with trio.fail_after(timeout):
            while key not in self.stop_points:
                await self._stop_seen.wait()
        return self.stop_points[key]

    def _on_stop_request(self, e: StopRequest) -> None:
        # Where each request took effect, for the member that asked (its operator's answer).
        self.stop_points[(e.member, e.target)] = self.broker.event_seq
        self._stop_seen.set()
        self._stop_seen = trio.Event()
        if e.target not in (0, self.member):
            log.info("member %s asked member %s to stop", e.member, e.target)
            return
        if self.halted is not None:
            return
        self.halted = self.broker.event_seq
        self.halt_scope = "cluster" if e.target == 0 else "member"
        # Client events queued but not yet multicast would follow the stop point.
        self._out.clear()
        self._out_bytes = 0
        digest = snapshot.digest_bytes(self.broker).hex()
        log.warning(
            "stop requested by member %s: %s stop at event %s digest=%s",
            e.member,
            self.halt_scope,
            self.halted,
            digest[:16],
        )
        self._write_log(
            {
                "type": "stop",
                "seq": self.halted,
                "scope": self.halt_scope,
                "by": e.member,
                "digest": digest,
            }
        )
        # Our last report: confirms up to the stop point become stable on the others.
        self._queue_control(codec.encode(Progress(self.member, self.applied_seq())))
        self.stop_requested.set()

    async def finish_stop(self) -> None:
        """After a stop request: let confirms up to the stop point out (every ready member
        reports it has applied them), then tell the clients to go."""
        assert self.halted is not None
        with trio.move_on_after(STOP_SETTLE if self._holding else 0):
            while self.stable_seq() < self.halted:
                self._progress_changed = trio.Event()
                await self._progress_changed.wait()
        self._release_stable()
        text = (
            "cluster shutdown" if self.halt_scope == "cluster" else "member stopped by an operator"
        )
        self._force_close_locals(f"{text}: use another member", text)

    # ------------------------------------------------------------------ time and logs

    async def cluster_ticker(self) -> None:
        interval = self.config.tick_ms / 1000
        while True:
            await trio.sleep(interval)
            if self.membership.state == READY and self.membership.clock_master == self.member:
                await self.submit(Tick(self.now_ms()))

    def _log_event(self, kind: str, sender: int, conn: int | None, size: int, **extra: Any) -> None:
        if self._event_log is None:
            return
        rec: dict[str, Any] = {
            "seq": self.broker.event_seq,
            "t_ns": time.time_ns(),
            "member": self.member,
            "sender": sender,
            "type": kind,
        }
        if conn is not None:
            rec["conn"] = conn
        if size:
            rec["size"] = size
        rec.update(extra)
        self._write_log(rec)

    def _write_log(self, rec: dict[str, Any]) -> None:
        if self._event_log is not None and self._write_failed is None:
            rec.setdefault("member", self.member)
            rec.setdefault("incarnation", self.incarnation)
            rec.setdefault("t_ns", time.time_ns())
            try:
                self._event_log.write(json.dumps(rec, separators=(",", ":")) + "\n")
            except OSError as e:
                # Acted on after the event being applied (an error-check round): the others
                # may have recorded it.
                self._write_failed = e

    def status(self, with_digest: bool = False) -> dict[str, Any]:
        b = self.broker
        local = sum(1 for c in b.connections if c in self.local)
        last = self.checkpoints.last
        out = super().status(with_digest)
        out.update(
            {
                "member": self.member,
                "url": self.cluster_cfg.url,
                "state": self._state_name(),
                "clock_master": self.membership.clock_master,
                "members": [
                    {
                        "member": m,
                        "url": i.url,
                        "status": STATUS_NAMES.get(i.status, "unknown")
                        if i.status is not None
                        else "unknown",
                    }
                    for m, i in self.membership.members.items()
                ],
                "connections": {"local": local, "shadow": len(b.connections) - local},
                "checkpoint": None
                if last is None
                else {"seq": last.seq, "digest": last.winner.hex(), "agreed": last.agreed},
                "cpg": {
                    "in_flight": self.cpg.in_flight,
                    "sent": self.cpg.stats.sent,
                    "delivered": self.cpg.stats.delivered,
                    "wakeups": self.cpg.stats.wakeups,
                },
                "lag": {"events_behind": self.lag(), "held_back": self.lag_waits},
                "update": None
                if self.update_progress is None
                else {
                    **self.update_progress.as_dict(),
                    "attempts": self.update_attempts,
                    "installed": self._installed,
                    "buffered_events": len(self._buffer or ()),
                },
                "updating": [
                    {"newcomer": u["newcomer"], "seq": u["seq"], "pid": u["pid"]}
                    for u in self.updates.values()
                ],
                "quorum": None if self.quorum is None else self.quorum.status(),
            }
        )
        if self.suspended is not None:
            out["suspended"] = self.suspended
        out["error_checks"] = {
            "held_at": None if self.stalled is None else self.stalled[0],
            "pending": {
                str(seq): {
                    "outcomes": {str(m): o for m, o in sorted(r.got.items())},
                    "waiting_for": self.error_rounds.waiting_for(seq),
                }
                for seq, r in sorted(self.error_rounds.pending.items())
            },
            "decided": [r.as_dict() for r in self.rounds],
        }
        if self.faults:
            out["injected_faults"] = dict(self.faults)
        if self.halted is not None:
            out["stopping"] = {"scope": self.halt_scope, "seq": self.halted}
        return out

    def _state_name(self) -> str:
        if self.suspended is not None:
            return "suspended"
        if self.halted is not None:
            return "stopping"
        if self.stalled is not None:
            return "error-check"
        if self.membership.state == NEEDS_UPDATE:
            return "updating" if self.update_progress is not None else "needs-update"
        if self._installed and not self.ready.is_set():
            return "catching-up"
        return self.membership.state

    def close(self) -> None:
        while self._digesting:  # checkpoint children of an ended incarnation
            _seq, r, pid = self._digesting.popleft()
            os.close(r)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        self._close_event_log()

    def _close_event_log(self) -> None:
        f, self._event_log = self._event_log, None
        if f is not None:
            with contextlib.suppress(OSError):  # a full disk: what it could not flush is lost
                f.close()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]

"""The replication mode behind one seam: how this member's clients' changes reach the others.

Theory of operation
-------------------
The member (``runtime/member/member.py``) holds one :class:`Replication` and calls it wherever
the two modes differ, without asking which one it holds:

* :class:`ReplayingBytes` (active-active, and hot standby with ``replication = "bytes"``): the
  clients' events are multicast and every member applies every event of the stream. Confirms
  and operators' answers wait for stream events; the stream ticks; nothing else happens.
* :class:`ShippingChanges` (hot standby with ``replication = "changes"``): the primary's own
  serving broker applies its clients' events and ships what changed
  (``runtime/replication/shipping.py``); confirms and answers wait for batches; the stream
  broker takes batches only; the primary holds a lease while it serves.

Each is built before the clients' side, the confirm gate and the admin desk, which are built on
it (its sequencer, its numbering, its submit for operators' changes); :meth:`attach` hands it
those once they exist: the one cycle that construction cannot break.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cpgbroker.cluster.membership import Membership
from cpgbroker.model import RAISE_MODEL_VERSION, Broker
from cpgbroker.model.events import AdminCommand, ClientDisconnected, Event
from cpgbroker.runtime.admin.admindesk import AdminDesk
from cpgbroker.runtime.amqp.confirms import ConfirmGate
from cpgbroker.runtime.amqp.server import AmqpServer, Sequencer
from cpgbroker.runtime.replication.shipping import Shipping
from cpgbroker.runtime.replication.standby import LAPSED, HotStandby
from cpgbroker.runtime.update.giving import Updater

log = logging.getLogger("cpgbroker.standby")

Task = Callable[[], Awaitable[None]]


class Lease(Protocol):
    """A primary's lease (``runtime/member/lease.py``): it may serve while the ring works."""

    length: float
    doubt_length: float
    verdict_wait: float

    @property
    def lapsed(self) -> bool: ...

    def grant(self, now: float) -> None: ...

    async def run(
        self,
        holding: Callable[[], bool],
        heartbeat: Callable[[], None],
        on_lapse: Callable[[], None],
        netns: str | None,
        on_doubt: Callable[[bool], None] = ...,
        on_no_verdict: Callable[[], None] = ...,
    ) -> None: ...


class Replication(Protocol):
    """What the member asks of its replication mode (module docstring)."""

    @property
    def sequencer(self) -> Sequencer:
        """Where the clients' side submits its clients' events."""
        ...

    def number(self) -> int:
        """What held output and operators' answers wait for: the number of the event or batch
        that carries what is being applied now."""
        ...

    def submit_admin(self, ev: Event) -> Awaitable[None]:
        """Where operators' changes go (the admin desk's submit)."""
        ...

    @property
    def stream_ticks(self) -> bool:
        """Whether the clock master multicasts ticks (else the serving broker keeps its own
        time)."""
        ...

    def attach(
        self,
        io: AmqpServer,
        confirms: ConfirmGate,
        desk: AdminDesk,
        *,
        stored: bool,
        on_cut: Callable[[], None],
        heartbeat: Callable[[], None],
        lapsed: Callable[[float], None],
        doubt: Callable[[bool, float], None],
        serving: Callable[[], bool] = ...,
    ) -> None: ...

    def tasks(self) -> list[Task]: ...

    def guarded_tasks(self) -> list[Task]: ...

    @property
    def active(self) -> bool: ...

    def link_members(self, membership: Membership) -> list[int]: ...

    def view(self, stream: Broker) -> Broker: ...

    def refusal(self) -> str | None: ...

    def takes(self, ev: Any, sender: int, membership: Membership) -> bool: ...

    def applied(self, stream: Broker, sender: int, updater: Updater) -> None: ...

    def failed(self, ev: Any, sender: int) -> bool: ...

    def stable(self, stable_seq: int, durable_seq: int | None) -> tuple[int, int | None]: ...

    @property
    def unsettled(self) -> bool: ...

    def check_role(self, mine: Callable[[], bool], stream: Broker) -> None: ...

    def membership_changed(self, mine: Callable[[], bool]) -> None: ...

    def hold_clients_after(self) -> float | None: ...

    def fork_update(
        self, updater: Updater, request: Any, members: list[list[Any]], stream: Broker
    ) -> None: ...

    def installed(self, stream: Broker) -> None: ...

    def status(self) -> dict[str, Any]: ...


class ReplayingBytes:
    """Every member applies every client event of the stream (module docstring)."""

    stream_ticks = True

    def __init__(
        self,
        multicast: Sequencer,
        event_seq: Callable[[], int],
        lease: Lease | None = None,
        netns: str | None = None,
    ) -> None:
        self.sequencer = multicast
        self.number = event_seq
        self.submit_admin = multicast.submit
        self._lease = lease
        self._netns = netns
        self._io: AmqpServer | None = None
        self._serving: Callable[[], bool] = lambda: False
        self._heartbeat: Callable[[], None] = lambda: None
        self._lapsed: Callable[[float], None] = lambda length: None

    def attach(
        self,
        io: AmqpServer,
        confirms: ConfirmGate,
        desk: AdminDesk,
        *,
        stored: bool,
        on_cut: Callable[[], None],
        heartbeat: Callable[[], None],
        lapsed: Callable[[float], None],
        doubt: Callable[[bool, float], None],
        serving: Callable[[], bool] = lambda: False,
    ) -> None:
        """Nothing to keep: the stream carries the clients' events themselves. The lease
        (when given) holds this member's output once the ring may have moved on without it."""
        self._io = io
        self._serving, self._heartbeat, self._lapsed = serving, heartbeat, lapsed

    def tasks(self) -> list[Task]:
        return []

    def guarded_tasks(self) -> list[Task]:
        return [] if self._lease is None else [self._hold_lease]

    async def _hold_lease(self) -> None:
        """While this member serves: heartbeats, and its output held once no message of ours
        came back for the lease's length (runtime/member/lease.py, "Replaying bytes")."""
        lease = self._lease
        assert lease is not None
        await lease.run(
            self._serving,
            self._heartbeat,
            self._hold_output,
            self._netns,
            lambda doubting: None,
            lambda: self._lapsed(lease.length + lease.verdict_wait),
        )

    def _hold_output(self) -> None:
        """The lease lapsed: the others may have moved on without this member, and what it
        applies from now on may be its own messages a corosync resumed after a freeze delivers
        before it reports that: write nothing more to any client until a membership change
        keeps it in the cluster (runtime/member/lease.py, "Replaying bytes")."""
        io, lease = self._io, self._lease
        assert io is not None and lease is not None
        log.error(
            "ring lease lapsed: no message of ours came back through the ring for %.2f s, the "
            "others may have moved on without this member: holding all client output until a "
            "membership change keeps it in the cluster",
            lease.length,
        )
        io.pause_output()

    @property
    def active(self) -> bool:
        """Every member's stream broker serves its clients."""
        return True

    def link_members(self, membership: Membership) -> list[int]:
        """The federation links are spread over the ready members."""
        return membership.ready_members

    def view(self, stream: Broker) -> Broker:
        return stream

    def refusal(self) -> str | None:
        return None

    def takes(self, ev: Any, sender: int, membership: Membership) -> bool:
        return True

    def applied(self, stream: Broker, sender: int, updater: Updater) -> None:
        pass

    def failed(self, ev: Any, sender: int) -> bool:
        return False

    def stable(self, stable_seq: int, durable_seq: int | None) -> tuple[int, int | None]:
        """Output waits for stream events."""
        return stable_seq, durable_seq

    @property
    def unsettled(self) -> bool:
        return False

    def check_role(self, mine: Callable[[], bool], stream: Broker) -> None:
        """Who takes clients changes nothing of how they are served."""

    def membership_changed(self, mine: Callable[[], bool]) -> None:
        """A membership change was applied (it passed the quorum gate and was no merge lost):
        this member is still in the cluster, and what it held may go out."""
        lease, io = self._lease, self._io
        if lease is None or io is None or not lease.lapsed:
            return
        lease.grant(time.monotonic())
        log.warning(
            "ring lease renewed by a membership change that keeps this member in the cluster: "
            "writing the output it held"
        )
        io.resume_output()

    def hold_clients_after(self) -> float | None:
        """A turned-away client is turned away at once."""
        return None

    def fork_update(
        self, updater: Updater, request: Any, members: list[list[Any]], stream: Broker
    ) -> None:
        updater.fork(request, members, stream, False)

    def installed(self, stream: Broker) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}


class ShippingChanges:
    """The primary ships change batches; every member applies them (module docstring)."""

    stream_ticks = False

    def __init__(
        self,
        shipping: Shipping,
        standby: HotStandby,
        lease: Lease,
        verdict: Callable[[AdminCommand], AdminCommand],
        netns: str | None,
    ) -> None:
        self.shipping = shipping
        self.sequencer = shipping
        self.number = shipping.batch_number
        self._standby = standby
        self._lease = lease
        # The membership's verdict on an operator's ``upgrade-finish`` (the member's).
        self._verdict = verdict
        self._netns = netns
        self._io: AmqpServer | None = None
        self._confirms: ConfirmGate | None = None
        self._heartbeat: Callable[[], None] = lambda: None
        self._lapsed: Callable[[float], None] = lambda length: None
        self._doubt: Callable[[bool, float], None] = lambda doubting, length: None

    def attach(
        self,
        io: AmqpServer,
        confirms: ConfirmGate,
        desk: AdminDesk,
        *,
        stored: bool,
        on_cut: Callable[[], None],
        heartbeat: Callable[[], None],
        lapsed: Callable[[float], None],
        doubt: Callable[[bool, float], None],
        serving: Callable[[], bool] = lambda: False,
    ) -> None:
        """``io``, ``confirms`` and ``desk`` are built on this seam; ``heartbeat`` renews the
        lease (a progress report of ours through the ring), ``doubt`` is told when the lease
        comes in doubt and when it no longer is, ``lapsed`` its length when it lapses."""
        self._io, self._confirms = io, confirms
        self._heartbeat, self._lapsed, self._doubt = heartbeat, lapsed, doubt
        # What held output and answers wait for, so that a batch asks to be reported; a push
        # queue grows as the serving broker applies its clients' publishes.
        self.shipping.attach(io, confirms, desk, stored=stored, on_cut=on_cut)

    def tasks(self) -> list[Task]:
        return [self.shipping.run]

    def guarded_tasks(self) -> list[Task]:
        return [self._hold_lease]

    async def _hold_lease(self) -> None:
        """The primary keeps its clients while the ring carries its messages."""
        lease = self._lease
        await lease.run(
            lambda: self.shipping.active,
            self._heartbeat,
            self._let_clients_go,
            self._netns,
            lambda doubting: self._doubt(doubting, lease.doubt_length),
            lambda: self._lapsed(lease.length + lease.verdict_wait),
        )

    def _let_clients_go(self) -> None:
        """The lease lapsed: before anyone else can be promoted, close every client (320),
        dropping what was kept for them, tell the serving broker they are gone (their unacked
        messages go back to their queues) and turn new ones away until the membership decides
        (runtime/member/lease.py, "At the lapse")."""
        io, confirms = self._io, self._confirms
        assert io is not None and confirms is not None
        log.error(
            "hot-standby lease lapsed: no message of ours came back through the ring for "
            "%.2f s, the others may promote another member soon: closing this member's "
            "clients until a membership change keeps it primary",
            self._lease.length,
        )
        self._standby.held = LAPSED
        confirms.drop()
        reason = "hot-standby lease lapsed"
        for conn in io.force_close(LAPSED, reason):
            self.shipping.apply_now(ClientDisconnected(conn, reason))

    def membership_changed(self, mine: Callable[[], bool]) -> None:
        """A membership change was applied (it passed the quorum gate and was no merge lost):
        if it keeps a lapsed primary primary, the ring works and nobody else was promoted, so
        it takes clients again (runtime/member/lease.py, "At the lapse")."""
        if not (self._lease.lapsed and self.shipping.active and mine()):
            return
        self._lease.grant(time.monotonic())
        self._standby.held = None
        log.warning(
            "hot-standby lease renewed by a membership change that keeps this member primary: "
            "taking clients again"
        )

    async def submit_admin(self, ev: Event) -> None:
        """An operator's change on the primary: applied by its serving broker, which alone
        decides (its batches carry the version it runs)."""
        if type(ev) is AdminCommand and ev.op == RAISE_MODEL_VERSION:
            ev = self._verdict(ev)
        await self.shipping.submit(ev)

    @property
    def active(self) -> bool:
        """This member is primary: its serving broker applies its clients' changes."""
        return self.shipping.active

    def link_members(self, membership: Membership) -> list[int]:
        """The primary runs every link, against its serving broker (its operators' changes and
        the messages links bring in are applied there)."""
        return [self.shipping.member]

    def view(self, stream: Broker) -> Broker:
        """A primary's serving broker (its clients, consumers and unacked messages)."""
        b = self.shipping.broker
        return stream if b is None else b

    def refusal(self) -> str | None:
        """Only the primary's broker applies operators' changes."""
        if self.shipping.active:
            return None
        return self._standby.refusal() or "this member is a hot-standby backup"

    def takes(self, ev: Any, sender: int, membership: Membership) -> bool:
        return self.shipping.takes(ev, sender, membership)

    def applied(self, stream: Broker, sender: int, updater: Updater) -> None:
        self.shipping.applied(stream, sender, updater)

    def failed(self, ev: Any, sender: int) -> bool:
        return self.shipping.failed(ev, sender)

    def stable(self, stable_seq: int, durable_seq: int | None) -> tuple[int, int | None]:
        """Output waits for batches: our last batch every ready member applied, and stored
        (None: no store)."""
        applied, stored = self.shipping.stable_batch(stable_seq, durable_seq)
        return applied, None if durable_seq is None else stored

    @property
    def unsettled(self) -> bool:
        """Reservations the next deliveries may use wait for batches to be stable."""
        return self.shipping.unsettled_takes

    def check_role(self, mine: Callable[[], bool], stream: Broker) -> None:
        """Become primary (serve a copy of the stream broker) when the stream says so, at the
        same point on every member; or stop serving when it no longer does."""
        shipping = self.shipping
        primary = mine()
        io = self._io
        assert io is not None and self._confirms is not None
        if primary and not shipping.active:
            self._lease.grant(time.monotonic())
            self._standby.held = None
            shipping.promote(stream, io.now_ms())
        elif not primary and shipping.active:
            self._standby.held = None
            shipping.demote()
            self._confirms.drop()
            why = self._standby.refusal() or "this member is no longer the hot-standby primary"
            io.force_close(why, "no longer primary")

    def hold_clients_after(self) -> float | None:
        """A backup holds a client it would turn away once the ring stood still this long (the
        primary's heartbeats stopped as long as the primary's own doubt takes): this member
        may be promoted in a moment (runtime/replication/standby.py, "Holding clients")."""
        return None if self.shipping.active else self._lease.doubt_length

    def fork_update(
        self, updater: Updater, request: Any, members: list[list[Any]], stream: Broker
    ) -> None:
        """A replica sends each queue from its back and leaves out what consumers take
        meanwhile (runtime/update/transfer.py)."""
        updater.fork(request, members, stream, True)
        stream.replication.track_released(True)

    def installed(self, stream: Broker) -> None:
        """The update left out what was consumed while it was sent: the replay finds records
        for messages it does not have (model/standby/replica.py)."""
        stream.replication.catch_up(True)

    def status(self) -> dict[str, Any]:
        shipping = self.shipping
        return {
            "replication": "changes",
            "replicate": shipping.replicate,
            "batches": {
                "shipped": shipping.shipped,
                "stable": shipping.stable,
                # Messages acked before their batch was cut: never shipped.
                "elided": shipping.elided,
            },
        }

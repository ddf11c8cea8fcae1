"""The deterministic broker: ``Broker.apply(event) -> list[Effect]``.

Theory of operation
-------------------
The broker is a pure state machine over an ordered stream of events (see ``events.py``). It
owns no socket, reads no clock and draws no random number: the same events in the same order
give the same state and the same effects on every replica, which is what lets a cluster of
members replay one CPG stream into identical brokers.

* Client bytes arrive as :class:`ClientData`. The connection's :class:`FrameReader` cuts them
  into frames; each frame is handled in order. A client protocol violation raises an
  :class:`AMQPError` inside a handler and is converted to channel.close / connection.close at
  exactly one place (``ConnectionProtocol.on_data``); it never escapes ``apply``.
* Deliveries to consumers need do-output credit: :class:`DoOutput` grants it, each delivery
  spends one. When credit runs out while messages wait, the model emits :class:`WantOutput` so
  the member owning the connection can grant more once its socket drains. This is the seed
  design's do-output: allocation depends only on ordered events, never on socket writability.
* Time is :class:`Tick` events. Heartbeats, message TTL, queue x-expires and consumer timeouts
  act on ticks only; ``now_ms`` is the last tick's time.
* Output is collected per connection during one ``apply`` and returned as one :class:`Send`
  per connection, followed by any close. Shadow connections (``emit`` false) skip encoding.

Components
----------
The broker is a composition of components, each owning its state (h11's split of
``_connection`` / ``_state`` / ``_events``); none subclasses another or reaches into another's
attributes. They hold references to the collaborators they need, given here:

================  =====================  ==================================================
component         module                 owns
================  =====================  ==================================================
``clock``         ``output.py``          cluster time (written here, on ticks)
``out``           ``output.py``          one event's effects; shadow-confirm count
``mark``          ``memory.py``          queued body bytes, whether publishers are blocked
``permissions``   ``permissions.py``     users' compiled permissions, cached results
``users``         ``users.py``           users (seeded by the configuration)
``policies``      ``policies.py``        policies, by vhost
``federation``    ``federation.py``      federation upstreams; what link runners reported
``topology``      ``topology.py``        vhosts, exchanges, queues, bindings, member list,
                                         the queue timer indexes
``confirms``      ``confirms.py``        publisher-confirm bookkeeping
``delivery``      ``delivery.py``        the message counter; publish, route, enqueue,
                                         dispatch, TTL, dead letters
``consumers``     ``consumers.py``       consumers; ack / nack / reject / requeue
``timeouts``      ``consumertimeout.py`` consumer timeouts: the channels a tick may close
``transactions``  ``transactions.py``    tx.select / commit / rollback
``channels``      ``channel.py``         the method table; channels opening and closing
``protocol``      ``connection.py``      ``connections``; handshake, frames, closes
``admin``         ``admin.py``           nothing: applies operators' changes (AdminCommand)
``replication``   ``replica.py``         a hot-standby backup's index of messages; applies
                                         the primary's change batches (Changes)
``version``       ``versions.py``        the effective model version gating behaviour
================  =====================  ==================================================

The broker itself keeps the event counter (``event_seq``) and ``apply``, the single entry
point that routes each event to the components.
"""

from __future__ import annotations

from cpgbroker.errors import ConnectionError_, InvariantError, ReplyCode
from cpgbroker.model import entities as E
from cpgbroker.model.access.permissions import Permissions
from cpgbroker.model.access.users import Users
from cpgbroker.model.changes import ChangeLog, Recording
from cpgbroker.model.clients.channel import Channels
from cpgbroker.model.clients.connection import ConnectionProtocol
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.entities import Connection, Queue
from cpgbroker.model.events import (
    AdminCommand,
    Changes,
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    ClusterMembers,
    DiskAlarm,
    DoOutput,
    Effect,
    Event,
    Forward,
    MemberLeft,
    Recovered,
    Tick,
)
from cpgbroker.model.federation import Federation
from cpgbroker.model.messages.confirms import Confirms
from cpgbroker.model.messages.consumers import Consumers
from cpgbroker.model.messages.consumertimeout import ConsumerTimeouts
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.messages.transactions import Transactions
from cpgbroker.model.operators.admin import Admin
from cpgbroker.model.output import Clock, Output
from cpgbroker.model.resources.memory import MemoryMark
from cpgbroker.model.resources.queueflow import QueueFlow
from cpgbroker.model.routing.exchange import Exchange
from cpgbroker.model.routing.policies import Policies
from cpgbroker.model.routing.topology import Topology, VHost
from cpgbroker.model.standby.replica import Replication
from cpgbroker.model.versions import CONSUMER_TIMEOUTS, NEWEST, ModelVersion

__all__ = ["Broker", "VHost"]


class Broker:
    """The whole replicated broker state and its transition function."""

    def __init__(self, config: BrokerConfig | None = None, *, version: int = NEWEST) -> None:
        self.config = config or BrokerConfig()
        cfg = self.config
        # The effective model version (model/versions.py): a fresh broker runs the newest;
        # a state restored, recovered or joined runs the version it was written at.
        self.version = ModelVersion(version)
        # Events applied so far (failed ones included, see count_failed_event).
        self.event_seq = 0
        # Created here, so that the components reading it can be given it before the one
        # that writes it (ConnectionProtocol) exists.
        self.connections: dict[int, Connection] = {}
        self.clock = Clock()
        self.out = Output(self.clock)
        # Where a hot-standby primary's change log is (model/changes.py): shared by the
        # components that tell it what changed; see record_changes.
        self._changes = Recording()
        self.mark = MemoryMark(cfg, self.connections, self.out, self._changes)
        self.permissions = Permissions()
        self.users = Users(cfg.users, self.permissions)
        self.policies = Policies(cfg.policies)
        self.federation = Federation(cfg.upstreams)
        self.topology = Topology(
            cfg.vhosts,
            cfg.member_urls,
            self.clock,
            self.out,
            self.mark,
            self.connections,
            self.permissions,
            self.policies,
            peer_exchange=bool(cfg.server_id),
            replicated=cfg.replicated,
            version=self.version,
            changes=self._changes,
        )
        self.confirms = Confirms(self.out)
        self.flow = QueueFlow(cfg.queue_flow_messages, self.out, self.mark)
        self.delivery = Delivery(
            cfg,
            self.clock,
            self.out,
            self.mark,
            self.confirms,
            self.topology.vhosts,
            self.topology.ttl_queues,
            self.connections,
            self.flow,
            self.permissions,
            self.version,
            self._changes,
        )
        self.topology.on_failover_bind = self.delivery.publish_members
        self.delivery.push_to = self._push_queues
        self.timeouts = ConsumerTimeouts(
            cfg.consumer_timeout, self.clock, self.connections, self.version
        )
        self.delivery.on_unacked = self.timeouts.delivered
        self.consumers = Consumers(
            self.clock, self.out, self.mark, self.topology, self.delivery, self.permissions
        )
        self.transactions = Transactions(
            self.out, self.mark, self.topology.vhosts, self.delivery, self.consumers
        )
        self.channels = Channels(
            self.out,
            self.topology,
            self.delivery,
            self.consumers,
            self.confirms,
            self.transactions,
            self._changes,
        )
        self.timeouts.close_channel = self.channels.channel_error
        self.protocol = ConnectionProtocol(
            cfg,
            self.connections,
            self.clock,
            self.out,
            self.mark,
            self.topology,
            self.delivery,
            self.consumers,
            self.confirms,
            self.channels,
            self.flow,
            self.users.by_name,
            self.version,
        )
        self.admin = Admin(
            self.users,
            self.permissions,
            self.policies,
            self.topology,
            self.protocol,
            self.delivery,
            self.consumers,
            self.out,
            self.federation,
            self.version,
        )
        # A hot-standby backup applies the primary's change batches (model/standby/replica.py).
        self.replication = Replication(
            self.topology,
            self.delivery,
            self.mark,
            self.clock,
            self.out,
            self.users,
            self.policies,
            self.federation,
            self.version,
        )
        # Bound once: apply routes every event through these.
        self._on_data = self.protocol.on_data
        self._on_do_output = self.delivery.on_do_output
        self._flush = self.out.flush

    def _push_queues(self, vh: VHost, ex: Exchange) -> list[Queue]:
        """Where a local publish to ``ex`` also goes: its pushing links' queues."""
        return self.federation.push_queues(vh, ex, self.policies.definition_of(ex))

    # ------------------------------------------------------------------ entry point

    def apply(self, event: Event) -> list[Effect]:
        """Apply one event; return the effects (sends, closes) it causes, in order."""
        self.event_seq += 1
        # ``type(event) is``: exact classes, and mypy narrows the union by them. Client data,
        # do-output and ticks first (nearly every event), and only they never change
        # definitions by themselves: ticks only delete queues (which say so) and close
        # connections and channels (model/changes.py).
        if type(event) is ClientData:
            self._on_data(event.conn, event.data)
            return self._flush()
        if type(event) is DoOutput:
            self._on_do_output(event.conn, event.limit)
            return self._flush()
        if type(event) is Tick:
            self._on_tick(event.now_ms)
            return self._flush()
        if type(event) is ClientConnected:
            self.protocol.on_connected(event)
        elif type(event) is ClientDisconnected:
            self.protocol.disconnected(event.conn, event.reason)
        elif type(event) is CloseClient:
            self.protocol.close(event.conn, event.code, event.text)
        elif type(event) is ClusterMembers:
            delivery = self.delivery
            topology = self.topology
            for q in topology.set_members(event.urls):
                delivery.publish_members(q, topology.member_urls)
        elif type(event) is MemberLeft:
            self.protocol.member_left(event.member)
            self.federation.member_left(event.member)
            if event.member in self.mark.disk_alarms:
                self.mark.set_disk_alarm(event.member, False)
        elif type(event) is DiskAlarm:
            self.mark.set_disk_alarm(event.member, event.low)
        elif type(event) is Recovered:
            # A replica's queue fronts first: what is dropped is dropped from whole queues.
            self.replication.fold_all()
            self.topology.drop_transient()
        elif type(event) is AdminCommand:
            before = self.version.current
            self.admin.apply(event)
            if before < CONSUMER_TIMEOUTS <= self.version.current:
                # The cluster moved to consumer timeouts at this event (upgrade-finish).
                self.timeouts.restart()
        elif type(event) is Forward:
            self.admin.forward(event)
        elif type(event) is Changes:
            self.replication.apply(event.data)
        else:
            raise InvariantError(f"unknown event {event!r}")
        # Every other kind of event may change definitions (model/changes.py).
        self._changes.definitions_may_change()
        return self._flush()

    def fail_event(self, event: Event, text: str) -> list[Effect]:
        """The cluster decided that applying ``event`` failed (an error-check round whose
        majority hit the same error there): the event counts as applied, and the connection
        it came from, if any, is closed with 541 internal-error rather than left in whatever
        state the failure left it. Every member that continues takes this same step."""
        conns = self.protocol
        conn = self.connections.get(getattr(event, "conn", -1))
        if conn is not None:
            if conn.state == E.OPEN:
                conns.connection_error(conn, ConnectionError_(ReplyCode.INTERNAL_ERROR, text[:200]))
            else:
                conns.drop(conn, text, notify=True)
        return self._flush()

    def count_failed_event(self, seq: int) -> None:
        """The event numbered ``seq`` counts as applied although applying it failed (an
        exception inside ``apply``, which had counted it already) or never started (a fault
        raised before ``apply``): every member that continues past it counts it the same."""
        if seq not in (self.event_seq, self.event_seq + 1):
            raise InvariantError(
                f"event {seq} cannot count as applied after event {self.event_seq}"
            )
        self.event_seq = seq

    def mirror_access(self, other: Broker) -> None:
        """Log clients in as ``other`` does: take its users, their permissions and its vhosts.

        For a member-local broker (runtime/amqp/localbroker.py), which is not replicated and so
        sees none of the operators' changes: its member calls this between events, before each
        new client and every second. Vhosts are only added here: one deleted in ``other`` is
        no longer open to anyone (its users' permissions went with it), and the member deletes
        it with an admin command, which closes its connections as the cluster does.
        """
        if self.users.by_name != other.users.by_name:
            self.users.restore(other.users.by_name.values())
        for name in other.vhosts:
            if name not in self.vhosts:
                self.topology.add_vhost(name)

    def record_changes(self, log: ChangeLog | None) -> None:
        """Tell ``log`` what this broker changes from now on (None: stop). A hot-standby
        primary ships its records to the backups instead of its clients' bytes."""
        self._changes.log = log

    @property
    def changes(self) -> ChangeLog | None:
        return self._changes.log

    def set_local_member(self, member: int) -> None:
        """This replica is member ``member``'s: it answers that member's operators' changes
        (model/operators/admin.py). Not replicated: each member sets its own."""
        self.admin.local_member = member

    def set_emit(self, conn_id: int, emit: bool) -> None:
        """Mark a connection as this replica's own (emit output) or a shadow (discard)."""
        conn = self.connections.get(conn_id)
        if conn is not None:
            conn.emit = emit

    # ------------------------------------------------------------------ time

    def _on_tick(self, now_ms: int) -> None:
        # Another member may take over the clock with a clock slightly behind: cluster time
        # never goes back (every replica clamps the same way, so this stays deterministic).
        self.clock.set(max(now_ms, self.clock.now_ms))
        self.protocol.on_tick()
        self.timeouts.on_tick()
        self.delivery.expire_ttl()
        self.topology.expire_unused()
        if self.flow.queues:
            self.flow.on_tick()

    # ------------------------------------------------------------------ public state

    @property
    def now_ms(self) -> int:
        """Cluster time: the last tick's."""
        return self.clock.now_ms

    @property
    def vhosts(self) -> dict[str, VHost]:
        return self.topology.vhosts

    @property
    def member_urls(self) -> tuple[str, ...]:
        return self.topology.member_urls

    @property
    def msg_seq(self) -> int:
        return self.delivery.msg_seq

    @property
    def queued_bytes(self) -> int:
        return self.mark.queued_bytes

    @property
    def blocked(self) -> bool:
        return self.mark.blocked

    @property
    def shadow_confirms(self) -> int:
        """Publisher confirms and tx.commit-oks produced so far for shadow connections (their
        bytes are not even encoded): a member thereby knows, without being told, that an
        event gave another member's client a confirm that waits for this member's progress
        report (runtime/member/member.py). Not replicated: only its changes matter."""
        return self.out.shadow_confirms

    @property
    def shadow_durable_confirms(self) -> int:
        """Of ``shadow_confirms``, those that wait for every member's store (persistent
        messages on durable queues): a report of what this member applied alone does not
        release them, its store's does."""
        return self.out.shadow_durable_confirms

    def restore_counters(
        self,
        *,
        now_ms: int,
        event_seq: int,
        msg_seq: int,
        queued_bytes: int,
        blocked: bool,
        memory_blocked: bool,
        disk_alarms: list[int],
    ) -> None:
        """Install the counters of a snapshot (``snapshot.Restorer``)."""
        self.clock.set(now_ms)
        self.event_seq = event_seq
        self.delivery.set_msg_seq(msg_seq)
        self.mark.restore(queued_bytes, blocked, memory_blocked, disk_alarms)

"""Topology: vhosts, exchanges, queues and bindings, and the rules for declaring them.

Theory of operation
-------------------
:class:`Topology` owns every vhost (``vhosts``) with its exchanges and queues, the cluster's
member list that the ``amq.failover`` exchange publishes (``member_urls``), and two indexes of
queues keyed by (vhost, name) that ticks walk: queues whose head may expire (``ttl_queues``,
filled by delivery as messages with a TTL arrive) and queues with x-expires (``expiring``).
It handles the exchange and queue classes of AMQP (declare, delete, bind, unbind, purge),
validates declare arguments, checks their equivalence on redeclare, and deletes queues
(which cancels their consumers and drops their messages).

Names are the broker's business, not the codec's: a queue or exchange name is any UTF-8
shortstr (so at most 255 bytes, which the wire format itself enforces), as in RabbitMQ.
The rules are RabbitMQ's, with its reply codes: ``amq.`` is reserved for exchanges and
queues the broker declares (403 ACCESS_REFUSED), the default exchange cannot be declared,
deleted or bound (403), and a missing name is 404 NOT_FOUND. pamqp's stricter name pattern
is not applied (``channel.decode_method``). Before a handler looks anything up it asks
``permissions.py`` whether the connection's user may configure, write or read the names it
was given (403 ACCESS_REFUSED), as RabbitMQ does.

It never delivers: publishing the member list to a queue bound to ``amq.failover`` goes
through ``on_failover_bind``, which the broker connects to delivery.

Ordering: every collection is an insertion-ordered dict or a list; a set only where it is
iterated ``sorted``.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
from collections.abc import Callable
from typing import Any

from pamqp import commands

from cpgbroker.errors import ChannelError, ConnectionError_, InvariantError, ReplyCode
from cpgbroker.model.access.permissions import CONFIGURE, READ, WRITE, Permissions
from cpgbroker.model.changes import Recording
from cpgbroker.model.entities import (
    Channel,
    Connection,
    Queue,
    QueueBinding,
    detach_unacked,
)
from cpgbroker.model.output import Clock, Output, queue_declare_ok
from cpgbroker.model.resources.limits import (
    Limits,
    check_new_binding,
    check_new_exchange,
    check_new_queue,
)
from cpgbroker.model.resources.memory import MemoryMark
from cpgbroker.model.routing.exchange import EXCHANGE_TYPES, Binding, Exchange
from cpgbroker.model.routing.policies import Policies
from cpgbroker.model.routing.queueargs import QUEUE_ARGS, apply_queue_args, fmt
from cpgbroker.model.routing.ttlindex import QueueKey, TtlQueues
from cpgbroker.model.versions import EXACT_FIELD_TABLES, ModelVersion
from cpgbroker.wire.fastpath import DIRECT_REPLY as _DIRECT_REPLY_BYTES
from cpgbroker.wire.fieldtable import Table, decode_table

R = ReplyCode

# Fanout exchange carrying the cluster's member list (cluster mode): a queue bound to it gets
# the current list at once and again on every membership change.
FAILOVER_EXCHANGE = "amq.failover"
# Fanout exchange over which federation peers announce themselves (the seed design's
# status exchange; runtime/federation/links.py publishes to an upstream's): made in every vhost
# of a cluster that has a federation server id.
PEER_EXCHANGE = "amq.peer"
# RabbitMQ's direct reply-to: a channel consumes this pseudo-queue (no-ack), and a publish on
# that channel whose reply-to names it gets the name of a queue of the channel's own,
# ``amq.rabbitmq.reply-to.<suffix>``, to which whoever answers publishes (default exchange).
# Here that queue is real (replicated like any other, so an answer from a client of any member
# arrives), but no client can see it except by a passive declare, and it goes with its
# consumer (auto-delete).
DIRECT_REPLY = _DIRECT_REPLY_BYTES.decode()
REPLY_PREFIX = DIRECT_REPLY + "."

PREDECLARED = (
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
)


class VHost:
    __slots__ = ("binding_count", "exchanges", "name", "queues")

    def __init__(self, name: str) -> None:
        self.name = name
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        # Bindings of all its exchanges (derived; vhost_max_bindings), recounted on restore.
        self.binding_count = 0

    def client_exchanges(self) -> int:
        """Exchanges clients declared: all but the default one and the amq.* ones."""
        n = len(self.exchanges) - 1 - len(PREDECLARED)
        n -= FAILOVER_EXCHANGE in self.exchanges
        return n - (PEER_EXCHANGE in self.exchanges)


def _unwired(q: Queue, urls: tuple[str, ...]) -> None:
    raise InvariantError("topology used before the broker connected on_failover_bind")


class Topology:
    __slots__ = (
        "_changes",
        "_clock",
        "_connections",
        "_expiry_heap",
        "_expiry_seq",
        "_mark",
        "_out",
        "_permissions",
        "_version",
        "expiring",
        "limits",
        "member_urls",
        "on_failover_bind",
        "peer_exchange",
        "policies",
        "replicated",
        "ttl_queues",
        "vhosts",
    )

    def __init__(
        self,
        vhost_names: tuple[str, ...],
        member_urls: tuple[str, ...],
        clock: Clock,
        out: Output,
        mark: MemoryMark,
        connections: dict[int, Connection],
        permissions: Permissions,
        policies: Policies,
        peer_exchange: bool = False,
        replicated: bool = False,
        version: ModelVersion | None = None,
        changes: Recording | None = None,
    ) -> None:
        self.vhosts: dict[str, VHost] = {}
        # The cluster's model version (read at every use: it moves up at an event).
        self._version = ModelVersion() if version is None else version
        # A cluster's replica (x-replicate must not say false) or not (it must not say true).
        self.replicated = replicated
        # Whether vhosts have amq.peer (a federation server id is configured).
        self.peer_exchange = peer_exchange
        # Applied to each queue and exchange declared in a vhost that has any.
        self.policies = policies
        # Client URLs of the cluster's members (empty standalone), in the cluster's order.
        self.member_urls = member_urls
        # Queues with an entry that can expire / with x-expires, checked on ticks.
        self.ttl_queues = TtlQueues()
        self.expiring: dict[QueueKey, Queue] = {}
        self._clock = clock
        self._out = out
        self._mark = mark
        # Where a hot-standby primary's change log is (model/changes.py): told of queues
        # declared and deleted.
        self._changes = Recording() if changes is None else changes
        # Read only: exclusive queues are struck from their owner's list when deleted.
        self._connections = connections
        # Asked before anything is looked up (a refused client learns nothing of what exists).
        self._permissions = permissions
        # Publishes the member list to a queue just bound to amq.failover (delivery does).
        self.on_failover_bind: Callable[[Queue, tuple[str, ...]], None] = _unwired
        # Configured by the connections component (which is given the broker's config).
        self.limits = Limits()
        # Derived index of ``expiring``: (deadline no later than the real one, tiebreak,
        # queue), so that a tick looks only at queues whose x-expires may be due.
        self._expiry_heap: list[tuple[int, int, Queue]] = []
        self._expiry_seq = 0
        for name in vhost_names:
            self.add_vhost(name)

    # ------------------------------------------------------------------ vhosts and members

    def add_vhost(self, name: str) -> VHost:
        vh = VHost(name)
        vh.exchanges[""] = Exchange("", name, "direct", True, False, False, {})
        for ex_name, ex_type in PREDECLARED:
            vh.exchanges[ex_name] = Exchange(ex_name, name, ex_type, True, False, False, {})
        if self.peer_exchange:
            vh.exchanges[PEER_EXCHANGE] = Exchange(
                PEER_EXCHANGE, name, "fanout", True, False, False, {}
            )
        self.vhosts[name] = vh
        return vh

    def set_expiry(self, q: Queue) -> None:
        """``q``'s x-expires may have changed (a policy): ticks look at it from its last use
        on, or no longer."""
        key = (q.vhost, q.name)
        if q.expires is None:
            self.expiring.pop(key, None)
        else:
            self.expiring[key] = q
            self._push_expiry(q, q.last_used_ms + q.expires)

    def set_members(self, urls: tuple[str, ...]) -> list[Queue]:
        """The cluster's member list changed: returns the queues bound to amq.failover (in
        vhost and binding order), which must get the new list."""
        self.member_urls = tuple(urls)
        targets: list[Queue] = []
        for vh in self.vhosts.values():
            ex = vh.exchanges.get(FAILOVER_EXCHANGE)
            if ex is None:
                ex = Exchange(FAILOVER_EXCHANGE, vh.name, "fanout", True, False, False, {})
                vh.exchanges[FAILOVER_EXCHANGE] = ex
            for b in ex.bindings:
                if isinstance(b.dest, Queue):
                    targets.append(b.dest)
        return targets

    # ------------------------------------------------------------------ restore

    def restore(
        self,
        vhosts: list[VHost],
        member_urls: tuple[str, ...],
        ttl_queues: list[Queue],
        expiring: list[Queue],
    ) -> None:
        """Install restored state (``snapshot.Restorer``) in place of the configured vhosts."""
        self.vhosts.clear()
        for vh in vhosts:
            self.vhosts[vh.name] = vh
        self.member_urls = member_urls
        self.ttl_queues.clear()
        self.ttl_queues.update(((q.vhost, q.name), q) for q in ttl_queues)
        self.ttl_queues.rebuild()
        self.expiring.clear()
        self.expiring.update(((q.vhost, q.name), q) for q in expiring)
        # Derived indexes: binding counts, the x-expires heap.
        for vh in self.vhosts.values():
            vh.binding_count = sum(len(ex.bindings) for ex in vh.exchanges.values())
        self._expiry_heap.clear()
        self._expiry_seq = 0
        for q in self.expiring.values():
            self._push_expiry(q, q.last_used_ms + (q.expires or 0))

    def _push_expiry(self, q: Queue, deadline: int) -> None:
        self._expiry_seq += 1
        heapq.heappush(self._expiry_heap, (deadline, self._expiry_seq, q))

    # ------------------------------------------------------------------ names and checks

    def vhost(self, conn: Connection) -> VHost:
        return self.vhosts[conn.vhost]

    def queue_name(self, conn: Connection, ch: Channel, name: str) -> str:
        """Spec: an empty queue name means the last queue declared on the channel."""
        if name == "":
            if not ch.last_queue:
                raise ChannelError(
                    R.NOT_FOUND, f"no previously declared queue in vhost '{conn.vhost}'"
                )
            return ch.last_queue
        return name

    def queue(self, conn: Connection, ch: Channel, name: str, *, reply_ok: bool = False) -> Queue:
        """The queue ``name`` of ``conn``'s vhost, for a client's operation on it. A direct
        reply-to queue is not there for anything but a passive declare (``reply_ok``), as in
        RabbitMQ, where it is no queue at all: nobody consumes another channel's answers."""
        vh = self.vhosts[conn.vhost]
        name = self.queue_name(conn, ch, name)
        q = vh.queues.get(name)
        if q is None or (not reply_ok and name.startswith(REPLY_PREFIX)):
            raise ChannelError(R.NOT_FOUND, f"no queue '{name}' in vhost '{vh.name}'")
        check_exclusive(conn, q)
        return q

    def reply_queue(self, conn: Connection) -> Queue:
        """A new direct reply-to queue for a channel of ``conn`` (module constants): auto-delete,
        so it goes when its one consumer is cancelled or its channel or connection closes."""
        vh = self.vhosts[conn.vhost]
        name = generated_name(conn, REPLY_PREFIX)
        q = Queue(
            name=name,
            vhost=vh.name,
            durable=False,
            exclusive_owner=None,
            auto_delete=True,
            arguments={},
            last_used_ms=self._clock.now_ms,
        )
        vh.queues[name] = q
        return q

    def exchange(self, conn: Connection, name: str) -> Exchange:
        vh = self.vhosts[conn.vhost]
        ex = vh.exchanges.get(name)
        if ex is None:
            raise ChannelError(R.NOT_FOUND, f"no exchange '{name}' in vhost '{vh.name}'")
        return ex

    # ------------------------------------------------------------------ exchange class

    def ex_declare(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self.vhosts[conn.vhost]
        name = m.exchange
        ex = vh.exchanges.get(name)
        if name == "":
            raise ChannelError(R.ACCESS_REFUSED, "operation not permitted on the default exchange")
        if m.passive:
            self._permissions.check_any(conn, "exchange", name)
            if ex is None:
                raise ChannelError(R.NOT_FOUND, f"no exchange '{name}' in vhost '{vh.name}'")
        else:
            self._permissions.check(conn, CONFIGURE, "exchange", name)
            if name.startswith("amq.") and ex is None:
                raise ChannelError(
                    R.ACCESS_REFUSED, f"exchange name '{name}' contains reserved prefix 'amq.*'"
                )
            if m.exchange_type not in EXCHANGE_TYPES:
                raise ConnectionError_(
                    R.COMMAND_INVALID, f"unknown exchange type '{m.exchange_type}'"
                )
            args = dict(m.arguments or {})
            if ex is None:
                ae = args.get("alternate-exchange")
                if isinstance(ae, str):
                    # RabbitMQ: whoever names an alternate exchange may read this one and
                    # write that one (routing to it later is not checked).
                    self._permissions.check(conn, READ, "exchange", name)
                    self._permissions.check(conn, WRITE, "exchange", ae)
                check_new_exchange(self.limits, vh.name, vh.client_exchanges(), name)
                ex = Exchange(
                    name, vh.name, m.exchange_type, m.durable, m.auto_delete, m.internal, args
                )
                if vh.name in self.policies.by_vhost:
                    self.policies.apply_to_exchange(ex)
                vh.exchanges[name] = ex
            else:
                for field, new, old in (
                    ("type", m.exchange_type, ex.type),
                    ("durable", m.durable, ex.durable),
                    ("auto_delete", m.auto_delete, ex.auto_delete),
                    ("internal", m.internal, ex.internal),
                ):
                    if new != old:
                        raise ChannelError(
                            R.PRECONDITION_FAILED,
                            f"inequivalent arg '{field}' for exchange '{name}' in vhost "
                            f"'{vh.name}': received {fmt(new)} but current is {fmt(old)}",
                        )
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Exchange.DeclareOk())

    def ex_delete(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self.vhosts[conn.vhost]
        name = m.exchange
        if name == "" or name.startswith("amq."):
            raise ChannelError(R.ACCESS_REFUSED, f"operation not permitted on exchange '{name}'")
        self._permissions.check(conn, CONFIGURE, "exchange", name)
        ex = vh.exchanges.get(name)
        if ex is not None:
            if m.if_unused and (ex.bindings or ex.sources):
                raise ChannelError(
                    R.PRECONDITION_FAILED, f"exchange '{name}' in vhost '{vh.name}' in use"
                )
            self._delete_exchange(vh, ex)
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Exchange.DeleteOk())

    def _delete_exchange(self, vh: VHost, ex: Exchange) -> None:
        """Cost: the exchange's bindings and those to it (``Exchange.sources``), not every
        exchange of the vhost."""
        ex.deleted = True
        del vh.exchanges[ex.name]
        # Bindings from this exchange go; so do bindings to it from other exchanges.
        gone = ex.clear_bindings()
        vh.binding_count -= len(gone)
        for b in gone:
            if isinstance(b.dest, Queue):
                _drop_queue_binding(b)
        # (Their order does not change the outcome: each source loses its bindings to ``ex``
        # and goes if auto-delete left it with none.)
        for other in list(ex.sources):
            removed = other.unbind_dest(ex)
            if removed:
                vh.binding_count -= len(removed)
                self._maybe_auto_delete_exchange(vh, other)

    def _maybe_auto_delete_exchange(self, vh: VHost, ex: Exchange) -> None:
        if ex.auto_delete and not ex.bindings and not ex.deleted:
            self._delete_exchange(vh, ex)

    def _check_exchange_binding(self, conn: Connection, m: Any) -> None:
        """RabbitMQ: write on the destination, read on the source (unless either is the
        default exchange, which the binding is refused for anyway)."""
        self._permissions.check(conn, WRITE, "exchange", m.destination)
        if m.source != "" and m.destination != "":
            self._permissions.check(conn, READ, "exchange", m.source)

    def ex_bind(self, conn: Connection, ch: Channel, m: Any) -> None:
        self._check_exchange_binding(conn, m)
        dest = self.exchange(conn, m.destination)
        src = self.exchange(conn, m.source)
        if src.name == "" or dest.name == "":
            raise ChannelError(R.ACCESS_REFUSED, "operation not permitted on the default exchange")
        args = dict(m.arguments or {})
        if not src.has_binding(dest, m.routing_key, args):
            vh = self.vhosts[conn.vhost]
            check_new_binding(self.limits, vh.name, vh.binding_count, src.name)
            src.bind(dest, m.routing_key, args, self._arguments_table(m))
            vh.binding_count += 1
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Exchange.BindOk())

    def _arguments_table(self, m: Any) -> Table | None:
        """A client's binding arguments as our codec reads them (model version 8: what a
        headers exchange matches with, model/routing/exchange.py); None before, or for a binding no
        client sent."""
        raw = getattr(m, "raw_arguments", None)
        if raw is None or not self._version.at_least(EXACT_FIELD_TABLES):
            return None
        return decode_table(raw)[0]

    def ex_unbind(self, conn: Connection, ch: Channel, m: Any) -> None:
        self._check_exchange_binding(conn, m)
        vh = self.vhosts[conn.vhost]
        dest = vh.exchanges.get(m.destination)
        src = vh.exchanges.get(m.source)
        if (
            src is not None
            and dest is not None
            and src.unbind(dest, m.routing_key, dict(m.arguments or {})) is not None
        ):
            vh.binding_count -= 1
            self._maybe_auto_delete_exchange(vh, src)
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Exchange.UnbindOk())

    # ------------------------------------------------------------------ queue class

    def q_declare(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self.vhosts[conn.vhost]
        name = m.queue
        if m.passive:
            if name == "":
                raise ChannelError(
                    R.NOT_FOUND, f"no previously declared queue in vhost '{vh.name}'"
                )
            self._permissions.check_any(conn, "queue", name)
            q = self.queue(conn, ch, name, reply_ok=True)
        else:
            if name.startswith("amq.") and name not in vh.queues:
                raise ChannelError(
                    R.ACCESS_REFUSED, f"queue name '{name}' contains reserved prefix 'amq.*'"
                )
            if name == "":
                name = generated_name(conn, "amq.gen-")
            self._permissions.check(conn, CONFIGURE, "queue", name)
            existing = vh.queues.get(name)
            args = dict(m.arguments or {})
            now = self._clock.now_ms
            if existing is None:
                dlx = args.get("x-dead-letter-exchange")
                if isinstance(dlx, str):
                    # RabbitMQ: whoever names a dead-letter exchange may read this queue and
                    # write that exchange (dead-lettering later is not checked).
                    self._permissions.check(conn, READ, "queue", name)
                    self._permissions.check(conn, WRITE, "exchange", dlx)
                check_new_queue(self.limits, vh.name, len(vh.queues), name)
                q = Queue(
                    name=name,
                    vhost=vh.name,
                    durable=m.durable,
                    exclusive_owner=conn.id if m.exclusive else None,
                    auto_delete=m.auto_delete,
                    arguments=args,
                    last_used_ms=now,
                )
                apply_queue_args(q, args, self.replicated)
                if vh.name in self.policies.by_vhost:
                    self.policies.apply_to_queue(q)
                vh.queues[name] = q
                log = self._changes.log
                if log is not None:
                    log.created(q)
                if m.exclusive:
                    conn.exclusive_queues[name] = None
                if q.expires is not None:
                    self.expiring[(vh.name, name)] = q
                    self._push_expiry(q, now + q.expires)
                # Every queue is bound to the default exchange by its name (implicitly).
            else:
                q = existing
                check_exclusive(conn, q, bool(m.exclusive))
                for field, new, old in (
                    ("durable", m.durable, q.durable),
                    ("auto_delete", m.auto_delete, q.auto_delete),
                ):
                    if new != old:
                        raise ChannelError(
                            R.PRECONDITION_FAILED,
                            f"inequivalent arg '{field}' for queue '{name}' in vhost "
                            f"'{vh.name}': received {fmt(new)} but current is {fmt(old)}",
                        )
                for key in sorted({**args, **q.arguments}):
                    new, cur = args.get(key), q.arguments.get(key)
                    # Typed: true is not 1 (RabbitMQ compares the field-table types too).
                    if (
                        key.startswith("x-")
                        and key in QUEUE_ARGS
                        and (new != cur or type(new) is not type(cur))
                    ):
                        # RabbitMQ names the type of a value compared with an absent one.
                        typed = new is None or cur is None
                        raise ChannelError(
                            R.PRECONDITION_FAILED,
                            f"inequivalent arg '{key}' for queue '{name}' in vhost '{vh.name}': "
                            f"received {fmt(new, typed)} but current is {fmt(cur, typed)}",
                        )
                q.last_used_ms = now
        ch.last_queue = q.name
        if not m.nowait:
            # Encoded here, not by pamqp, which refuses names RabbitMQ accepts (output.py).
            conn.last_tx_ms = self._clock.now_ms
            if conn.emit:
                self._out.emit(
                    conn, queue_declare_ok(ch.id, q.name, len(q.messages), len(q.consumers))
                )

    def _check_queue_binding(self, conn: Connection, ch: Channel, m: Any) -> str:
        """RabbitMQ: write on the queue, read on the exchange (unless it is the default
        exchange, which the binding is refused for anyway). The queue's name."""
        name = self.queue_name(conn, ch, m.queue)
        self._permissions.check(conn, WRITE, "queue", name)
        if m.exchange != "":
            self._permissions.check(conn, READ, "exchange", m.exchange)
        return name

    def q_bind(self, conn: Connection, ch: Channel, m: Any) -> None:
        q = self.queue(conn, ch, self._check_queue_binding(conn, ch, m))
        ex = self.exchange(conn, m.exchange)
        if ex.name == "":
            raise ChannelError(R.ACCESS_REFUSED, "operation not permitted on the default exchange")
        args = dict(m.arguments or {})
        if not ex.has_binding(q, m.routing_key, args):
            vh = self.vhosts[conn.vhost]
            check_new_binding(self.limits, vh.name, vh.binding_count, ex.name)
            b = ex.bind(q, m.routing_key, args, self._arguments_table(m))
            if b is None:
                raise InvariantError("binding appeared between check and bind")
            b.qb = QueueBinding(ex.name, m.routing_key, args)
            q.bindings.append(b.qb)
            vh.binding_count += 1
            if ex.name == FAILOVER_EXCHANGE:
                self.on_failover_bind(q, self.member_urls)
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Queue.BindOk())

    def q_unbind(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self.vhosts[conn.vhost]
        q = vh.queues.get(self._check_queue_binding(conn, ch, m))
        ex = vh.exchanges.get(m.exchange)
        if m.exchange == "":
            raise ChannelError(R.ACCESS_REFUSED, "operation not permitted on the default exchange")
        if q is not None:
            check_exclusive(conn, q)
        if q is not None and ex is not None:
            args = dict(m.arguments or {})
            b = ex.unbind(q, m.routing_key, args)
            if b is not None:
                _drop_queue_binding(b)
                vh.binding_count -= 1
                self._maybe_auto_delete_exchange(vh, ex)
        self._out.send_method(conn, ch.id, commands.Queue.UnbindOk())

    def q_purge(self, conn: Connection, ch: Channel, m: Any) -> None:
        name = self.queue_name(conn, ch, m.queue)
        self._permissions.check(conn, READ, "queue", name)
        q = self.queue(conn, ch, name)
        count = len(q.messages)
        release = self._mark.release
        for e in q.messages:
            release(q, e)
        q.messages.clear()
        self.ttl_queues.note(q)
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Queue.PurgeOk(message_count=count))

    def q_delete(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self.vhosts[conn.vhost]
        name = self.queue_name(conn, ch, m.queue)
        self._permissions.check(conn, CONFIGURE, "queue", name)
        q = vh.queues.get(name)
        count = 0
        if q is not None:
            check_exclusive(conn, q)
            if m.if_unused and q.consumers:
                raise ChannelError(
                    R.PRECONDITION_FAILED, f"queue '{q.name}' in vhost '{vh.name}' in use"
                )
            if m.if_empty and q.messages:
                raise ChannelError(
                    R.PRECONDITION_FAILED, f"queue '{q.name}' in vhost '{vh.name}' is not empty"
                )
            count = len(q.messages)
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Queue.DeleteOk(message_count=count))
        if q is not None:
            # After delete-ok, as RabbitMQ: consumers' basic.cancel must not arrive while the
            # deleting client waits for delete-ok (py-amqp raises ConsumerCancelled then).
            self.delete_queue(q)

    def add_queue(self, q: Queue) -> None:
        """Hold ``q`` (new, as the primary declared it: a backup applying a change batch,
        model/standby/replica.py), in its vhost, added if missing."""
        vh = self.vhosts.get(q.vhost) or self.add_vhost(q.vhost)
        if q.name in vh.queues:
            raise InvariantError(f"queue {q.name!r} declared but already there")
        vh.queues[q.name] = q

    def delete_queue(self, q: Queue) -> None:
        """Delete ``q``: its bindings go, its consumers are cancelled (basic.cancel to clients
        that asked for it), its ready messages are dropped (unacked ones stay on their
        channels and are dropped when settled)."""
        vh = self.vhosts[q.vhost]
        q.deleted = True
        log = self._changes.log
        if log is not None:
            log.deleted(q)
        vh.queues.pop(q.name, None)
        key = (q.vhost, q.name)
        self.ttl_queues.leave(q)
        self.expiring.pop(key, None)
        for bd in q.bindings:
            ex = vh.exchanges.get(bd.exchange)
            if ex is not None:
                removed = ex.unbind_dest(q)
                if removed:
                    vh.binding_count -= len(removed)
                    self._maybe_auto_delete_exchange(vh, ex)
        q.bindings.clear()
        for c in list(q.consumers):
            ch = c.channel
            ch.consumers.pop(c.tag, None)
            detach_unacked(c)
            conn = ch.conn
            if conn.capabilities.get("consumer_cancel_notify") and not ch.closing:
                # nowait, as RabbitMQ sends it: clients (pika, the Java client) do not answer
                # a broker's cancel, and one that did would get a cancel-ok back unexpected.
                self._out.send_method(
                    conn, ch.id, commands.Basic.Cancel(consumer_tag=c.tag, nowait=True)
                )
        q.consumers.clear()
        q.ranked_consumers = 0
        release = self._mark.release
        for e in q.messages:
            release(q, e)
        q.messages.clear()
        if q.exclusive_owner is not None:
            owner = self._connections.get(q.exclusive_owner)
            if owner is not None:
                owner.exclusive_queues.pop(q.name, None)

    def drop_transient(self) -> None:
        """After a restart from a store: what AMQP keeps across a broker restart stays
        (durable exchanges and queues, their bindings, persistent messages on durable queues),
        everything else goes. Walks vhosts, queues and exchanges in their dict (declaration)
        order, so every replica drops the same things in the same order."""
        release = self._mark.release
        for vh in list(self.vhosts.values()):
            for q in list(vh.queues.values()):
                if not q.durable:
                    self.delete_queue(q)
                    continue
                kept = [e for e in q.messages if e.msg.delivery_mode == 2]
                if len(kept) == len(q.messages):
                    continue
                for e in q.messages:
                    if e.msg.delivery_mode != 2:
                        release(q, e)
                q.messages.clear()
                for e in kept:
                    q.messages.append(e)
                self.ttl_queues.note(q)
            for ex in list(vh.exchanges.values()):
                if not ex.durable and not ex.deleted:
                    self._delete_exchange(vh, ex)

    def delete_exclusive(self, conn: Connection) -> None:
        """``conn`` closes: the queues it declared exclusive go with it (spec)."""
        vh = self.vhosts.get(conn.vhost)
        for qname in list(conn.exclusive_queues):
            q = vh.queues.get(qname) if vh else None
            if q is not None and not q.deleted:
                self.delete_queue(q)
        conn.exclusive_queues.clear()

    def expire_unused(self) -> None:
        """On a tick: delete queues unused for longer than their x-expires. Cost: the queues
        whose deadline (as last pushed) has come, not every queue with x-expires: a queue
        used since is pushed again at its new deadline, one with consumers is looked at again
        one x-expires later (its last consumer's cancel moves ``last_used_ms`` on)."""
        heap = self._expiry_heap
        if not heap:
            return
        now_ms = self._clock.now_ms
        due: dict[QueueKey, Queue] = {}
        while heap and heap[0][0] <= now_ms:
            _, _, q = heapq.heappop(heap)
            key = (q.vhost, q.name)
            if q.deleted or q.expires is None or self.expiring.get(key) is not q:
                continue  # gone (a stale entry)
            deadline = q.last_used_ms + q.expires
            if q.consumers:
                self._push_expiry(q, max(deadline, now_ms + q.expires))
            elif deadline > now_ms:
                self._push_expiry(q, deadline)
            else:
                due[key] = q
        # In name order: the heap's tiebreaks differ after a restore. (The order does not
        # change the outcome: a queue without consumers goes with its bindings and messages.)
        for key in sorted(due):
            q = due[key]
            if not q.deleted:
                self.delete_queue(q)


def check_exclusive(conn: Connection, q: Queue, exclusive: bool | None = None) -> None:
    """405 unless ``conn`` may use ``q``; on a redeclare (``exclusive`` given) the flag must
    also match, as RabbitMQ's check_exclusivity."""
    if (q.exclusive_owner is not None and q.exclusive_owner != conn.id) or (
        exclusive is not None and exclusive != (q.exclusive_owner is not None)
    ):
        raise ChannelError(
            R.RESOURCE_LOCKED,
            f"cannot obtain exclusive access to locked queue '{q.name}' in vhost "
            f"'{q.vhost}'. It could be originally declared on another connection or the "
            "exclusive property value does not match that of the original declaration.",
        )


def reply_queue_of(ch: Channel) -> Queue | None:
    """The direct reply-to queue ``ch`` consumes, if any (a channel has at most one)."""
    for c in ch.consumers.values():
        if c.queue.name.startswith(REPLY_PREFIX):
            return c.queue
    return None


def generated_name(conn: Connection, prefix: str) -> str:
    """A server-chosen name (queue, consumer tag): deterministic, unique per (connection,
    counter), and as opaque as RabbitMQ's names."""
    conn.counter += 1
    digest = hashlib.sha256(f"{conn.id}:{conn.counter}".encode()).digest()
    return prefix + base64.urlsafe_b64encode(digest[:16]).decode().rstrip("=")


def _drop_queue_binding(b: Binding) -> None:
    """Strike a removed binding from its queue's record of its bindings."""
    q = b.dest
    if isinstance(q, Queue) and b.qb is not None:
        q.bindings.discard(b.qb)

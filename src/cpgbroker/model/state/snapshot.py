"""Snapshot and digest of the whole broker model (restoring one: ``model/state/restore.py``).

A snapshot is a tree of plain values (None, bool, int, float, str, bytes, list, dict with str
keys, and the datetime/Decimal values that AMQP tables may carry), built in a fixed order from
the model's insertion-ordered collections. :func:`encode` turns it into canonical bytes (no
pickle: a snapshot crosses the network to new members and must never execute code), and the
digest is the SHA-256 of those bytes, so two replicas have equal digests exactly when their
replicated state is equal.

What is *not* in a snapshot: whether a connection is this replica's own (``emit``), output not
yet flushed (always empty between events), caches derived from other state (topic routes), and
the broker's ``shadow_confirms`` count (a replica-local statistic: only its changes matter).
Every other field is: the Qpid cluster's bug history is mostly "this field was not transferred",
so ``tests/unit/test_snapshot.py`` checks that every attribute of every entity (and of the
broker's components) is either snapshotted or listed here as derived.

Snapshot and restore go through the model's public surface only: the broker's public
counters and components (``Broker.topology.ttl_queues``, ``Broker.restore_counters``,
``Topology.restore``, ``ConnectionProtocol.restore``) and the entities, never a private attribute,
so the model's components can change inside without this module following them. The
encoding is format 2 byte for byte (``tests/unit/test_replay_fixture.py`` replays a recorded
log against digests taken before the model was split into components).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

from cpgbroker.model.broker import Broker
from cpgbroker.model.canonical import SNAPSHOT_FORMAT, decode, encode, queue_from_meta
from cpgbroker.model.changes import ships_queue
from cpgbroker.model.config import User
from cpgbroker.model.entities import (
    Channel,
    Connection,
    Entry,
    Message,
    Queue,
    TxAck,
    TxOp,
    TxPublish,
)
from cpgbroker.model.routing.exchange import Binding, Exchange
from cpgbroker.model.state.restore import Restorer, restore
from cpgbroker.model.versions import CONSUMER_TIMEOUTS, OLDEST

# Snapshots are encoded with the canonical encoding of model/canonical.py: its two functions are
# this module's too, as are restoring (model/state/restore.py) and the format both follow.
__all__ = [
    "CHUNK",
    "NOT_REPLICATED",
    "SNAPSHOT_FORMAT",
    "Restorer",
    "decode",
    "definitions",
    "digest",
    "digest_bytes",
    "encode",
    "parts",
    "queue_from_meta",
    "queue_meta",
    "restore",
    "snapshot",
]

# Attributes deliberately left out of snapshots (see module docstring).
NOT_REPLICATED = {
    "Connection": {
        "emit",
        "outbuf",
        "confirm_dirty",
        "confirm_out",
        "delivery_waits",
        "flow_pauses",
    },
    # Derived indexes, rebuilt by ``Exchange.bind`` / ``Topology.restore`` on restore.
    "Exchange": {
        "cache",
        "by_key",
        "by_dest",
        "by_dest_key",
        "key_bindings",
        "topic_root",
        "header_buckets",
        "header_always",
        "header_named",
        "header_exact_always",
        "sources",
        "bind_seq",
        # The policy that applies (model/routing/policies.py): a function of the policies and the
        # name, marked again on restore.
        "policy",
        "policy_alternate",
    },
    "Binding": {"seq", "exact"},
    # The policy that applies (model/routing/policies.py): a function of the policies and the name.
    # (And where a hot-standby primary's change log is, model/changes.py: not state.)
    "Topology": {"_expiry_heap", "_expiry_seq", "_changes"},
    # Derived from ``ttl_queues`` (``TtlQueues.rebuild`` on restore).
    "Queue": {"ttl_order", "ttl_due", "policy", "published_total", "delivered_total"},
    "ConnectionProtocol": {"deadlines"},
    "QueueFlow": {"queues"},
    "Consumer": {"qseq"},
    # Derived (model/messages/consumertimeout.py): the consumer-timeout heap and what leads a
    # channel there, rebuilt on restore from the unacked deliveries and their times.
    "Channel": {"ack_due", "ack_floor", "ack_q"},
    "ConsumerTimeouts": {"heap", "_pushes", "_compact_at"},
    # Cached permission results: a function of the configuration and the name.
    "Permissions": {"_known", "published"},
    "Delivery": {"_published", "_changes"},
    # Where a hot-standby primary's change log is (model/changes.py): where records go, not
    # state.
    "MemoryMark": {"_changes"},
    "Channels": {"_changes"},
    # The replica's own member id (which answers are another member's).
    "Admin": {"local_member"},
    "ResourceOps": {"answering"},
    # Derived (model/standby/replica.py): a backup's index of messages by id, rebuilt when missing.
    # (Its queue fronts are not left out: ``parts`` puts them in their queues' messages.)
    # (Its refs are those of the batch being applied: empty between events.)
    "Replication": {"_index", "_front", "_refs", "catching_up", "released"},
    # A hot-standby primary's change log (model/changes.py): where records go, not state.
    "Broker": {"_changes"},
}


# ---------------------------------------------------------------------- snapshot

# Ready messages per "entries" part: keeps every part small (a few MiB at most for typical
# bodies) so a state transfer streams in bounded memory and the receiver can interleave
# restoring with other work.
CHUNK = 1000


def parts(
    b: Broker,
    chunk: int = CHUNK,
    gone: Callable[[Queue], Container[int]] | None = None,
    share: bool = False,
) -> Iterator[Any]:
    """The snapshot as a sequence of small plain-value parts, in a fixed order:

    ``{"format", ...head}``, then per queue ``["queue", index, meta]`` followed by its ready
    messages as ``["entries", index, new_messages, entries]`` chunks, then ``["vhost", ...]``
    per vhost, ``["conn", new_messages, conn]`` per connection and ``["tail", ...]``.

    Queues are numbered once up front (also deleted queues that unacked deliveries or
    consumers still reference); a message shared by several queues travels once, with the
    first part that references it. It walks the live state: consume it to the end before the
    broker applies another event (the updater's forked child and the digest do).

    ``gone`` (a hot-standby replica's state update, runtime/update/transfer.py): each queue's
    messages go from its back, as ``["entries_back", index, new_messages, entries]`` chunks that the
    receiver puts in front of those it has, leaving out the ids ``gone(queue)`` names as it is
    about to send each chunk: messages consumed since the snapshot's point, which the receiver
    drops as it replays the stream from that point anyway. So the transfer shrinks while
    consumers eat the front of a queue, instead of chasing them.

    ``share``: for a copy in this process only (a hot-standby promotion,
    runtime/replication/shipping.py), a queue's entries as copies of themselves and messages as the
    objects instead of rows: nothing changes a message once made, so the copy shares them rather
    than parse every header again (:meth:`Restorer.feed` takes either).
    """
    queues: list[Queue] = []
    qindex: dict[int, int] = {}

    def qref(q: Queue) -> int:
        i = qindex.get(id(q))
        if i is None:
            i = qindex[id(q)] = len(queues)
            queues.append(q)
        return i

    for vh in b.vhosts.values():
        for ex in vh.exchanges.values():
            for bd in ex.bindings:
                if isinstance(bd.dest, Queue):
                    qref(bd.dest)
        for q in vh.queues.values():
            qref(q)
    for c in b.connections.values():
        for ch in c.channels.values():
            for q, _e, _c, _at in ch.unacked.values():
                qref(q)
            for k in ch.consumers.values():
                qref(k.queue)
    topology = b.topology
    for q in topology.ttl_queues.values():
        qref(q)
    for q in topology.expiring.values():
        qref(q)

    sent: dict[int, None] = {}  # ids of messages already in an earlier part

    def entry(e: Entry, new: list[Any]) -> list[Any]:
        m = e.msg
        if m.id not in sent:
            sent[m.id] = None
            new.append(m if share else _message(m))
        if e.delivery_count:
            return [m.id, e.redelivered, e.expires_at, e.delivery_count]
        return [m.id, e.redelivered, e.expires_at]

    head = _head(b, queues)
    if gone is not None:
        head["from_back"] = True  # (the receiver recounts bytes: ``Restorer.from_back``)
    yield head
    replication = b.replication
    for i, q in enumerate(queues):
        # A backup's queue front (model/standby/replica.py) is part of its messages: as a restored
        # broker holds them, so that both digest alike.
        held = replication.held(q)
        yield ["queue", i, _queue(q, held)]
        if gone is not None:
            yield from _from_the_back(replication.from_back(q), q, i, chunk, gone, entry)
            continue
        # One pass over the queue (every consumer of these parts runs to the end without
        # applying events in between): slicing again from the start for every chunk walked
        # a priority queue's generator, or a deque, quadratically.
        it = iter(replication.in_order(q))
        for _ in range(0, len(q.messages) + held, chunk):
            if share:
                # Copies of the entries themselves, sharing their messages (docstring).
                copies = [
                    Entry(e.msg, e.redelivered, e.expires_at, e.delivery_count)
                    for e in itertools.islice(it, chunk)
                ]
                yield ["entries", i, [], copies]
                continue
            new: list[Any] = []
            entries = [entry(e, new) for e in itertools.islice(it, chunk)]
            yield ["entries", i, new, entries]
    for vh in b.vhosts.values():
        yield [
            "vhost",
            {
                "name": vh.name,
                "exchanges": [_exchange(ex, qref) for ex in vh.exchanges.values()],
                "queues": [qref(q) for q in vh.queues.values()],
            },
        ]
    # From model version 8 an unacked delivery's time is state (consumer timeouts).
    timed = b.version.at_least(CONSUMER_TIMEOUTS)
    for c in b.connections.values():
        new = []
        conn = _connection(c, qref, lambda e, new=new: entry(e, new), timed)
        yield ["conn", new, conn]
    yield [
        "tail",
        {
            "ttl_queues": [qref(q) for q in topology.ttl_queues.values()],
            "expiring": [qref(q) for q in topology.expiring.values()],
            "queue_consumers": [
                [[c.channel.conn.id, c.channel.id, c.tag] for c in q.consumers] for q in queues
            ],
        },
    ]


# What ``definitions`` leaves out of the head and of each queue: counters and values that
# change with traffic, not with definitions (a promoted backup computes its own).
_VOLATILE_HEAD = (
    "now_ms",
    "event_seq",
    "msg_seq",
    "queued_bytes",
    "blocked",
    "messages",
    "connections",
    "disk_alarms",
    "memory_blocked",
)
_VOLATILE_QUEUE = {"rr": 0, "unacked": 0, "ready_bytes": 0, "last_used_ms": 0}


def definitions(b: Broker) -> list[Any]:
    """The definitions a hot-standby primary ships (model/standby/replica.py): the snapshot's head,
    queue and vhost parts without connections, messages or traffic counters, so that two
    calls give equal parts exactly when the definitions are equal. Queues are those of the
    vhosts a backup keeps (``changes.ships_queue``: not exclusive or reply-to queues, which
    die with the primary, nor their bindings), numbered in vhost and declaration order."""
    queues: list[Queue] = [
        q for vh in b.vhosts.values() for q in vh.queues.values() if ships_queue(q)
    ]
    qindex = {id(q): i for i, q in enumerate(queues)}
    head = _head(b, queues)
    for key in _VOLATILE_HEAD:
        head.pop(key, None)
    out: list[Any] = [head]
    for i, q in enumerate(queues):
        out.append(["queue", i, queue_meta(q)])
    for vh in b.vhosts.values():
        out.append(
            [
                "vhost",
                {
                    "name": vh.name,
                    "exchanges": [_shipped_bindings(ex, qindex) for ex in vh.exchanges.values()],
                    "queues": [qindex[id(q)] for q in vh.queues.values() if id(q) in qindex],
                },
            ]
        )
    return out


def _shipped_bindings(ex: Exchange, qindex: dict[int, int]) -> dict[str, Any]:
    d = _exchange(ex, lambda q: qindex.get(id(q), -1))
    d["bindings"] = [bd for bd in d["bindings"] if bd[1] != -1]
    return d


def queue_meta(q: Queue) -> dict[str, Any]:
    """A queue's snapshot metadata without what changes with traffic (``definitions``)."""
    meta = _queue(q)
    meta.update(_VOLATILE_QUEUE)
    meta.pop("flow_paused", None)
    return meta


def _from_the_back(
    back: Iterable[Entry],
    q: Queue,
    i: int,
    chunk: int,
    gone: Callable[[Queue], Container[int]],
    entry: Callable[[Entry, list[Any]], list[Any]],
) -> Iterator[Any]:
    """``q``'s messages, ``back`` (from its back), as ``entries_back`` parts (``parts``,
    ``gone``)."""
    back = iter(back)
    while True:
        taken = list(itertools.islice(back, chunk))
        if not taken:
            return
        skip = gone(q)
        new: list[Any] = []
        entries = [entry(e, new) for e in reversed(taken) if e.msg.id not in skip]
        if entries:
            yield ["entries_back", i, new, entries]


def _head(b: Broker, queues: list[Queue]) -> dict[str, Any]:
    h: dict[str, Any] = {
        "format": SNAPSHOT_FORMAT,
        "now_ms": b.now_ms,
        "event_seq": b.event_seq,
        "msg_seq": b.msg_seq,
        "queued_bytes": b.queued_bytes,
        "blocked": b.blocked,
        "member_urls": list(b.member_urls),
        "queues": len(queues),
        "messages": sum(len(q.messages) + q.unacked for q in queues),
        "connections": len(b.connections),
    }
    # Only past the oldest model version: a state at the version of release 0.1.0 snapshots
    # (and digests) byte for byte as that release wrote it, so the release can read it back
    # (a rolled-back member) and replicas of both releases compare equal.
    if b.version.current != OLDEST:
        h["model_version"] = b.version.current
    mark = b.mark
    # Only when they say more than "blocked" does: a state without a disk alarm snapshots
    # (and digests) exactly as before disk alarms existed.
    if mark.disk_alarms:
        h["disk_alarms"] = list(mark.disk_alarms)
        h["memory_blocked"] = mark.memory_blocked
    # Users and policies only once an operator changed them (model/operators/admin.py): until then
    # they are the configuration's, on every member alike, and a state snapshots (and
    # digests) as before they became replicated state.
    users = b.users
    if tuple(users.by_name.values()) != users.seeded:
        h["users"] = [_user(u) for u in users.by_name.values()]
    fed = b.federation
    if fed.upstreams or fed.status or fed.recent:
        h["federation"] = {
            "upstreams": [
                [
                    u.vhost,
                    u.name,
                    list(u.uris),
                    u.exchange,
                    u.max_hops,
                    u.ack_mode,
                    u.prefetch_count,
                    u.reconnect_delay_s,
                    u.expires,
                    u.message_ttl,
                    *([True] if u.push else []),
                ]
                for u in fed.all()
            ],
            "status": [[*key, state] for key, state in fed.status.items()],
            "recent": [[*key, list(seen.digests)] for key, seen in fed.recent.items()],
        }
    policies = b.policies.all()
    if policies:
        h["policies"] = [
            [p.vhost, p.name, p.pattern, p.apply_to, p.definition, p.priority] for p in policies
        ]
    return h


def _user(u: User) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": u.name,
        "password_hash": u.password_hash,
        "hashing_algorithm": u.hashing_algorithm,
        "tags": list(u.tags),
        "loopback_only": u.loopback_only,
        "permissions": [[p.vhost, p.configure, p.write, p.read] for p in u.grants()],
    }
    if u.max_connections is not None:
        d["max_connections"] = u.max_connections
    if u.max_channels is not None:
        d["max_channels"] = u.max_channels
    return d


def snapshot(b: Broker) -> list[Any]:
    """The whole snapshot as one value (the list of :func:`parts`): for tests and small
    states; a state transfer streams the parts instead."""
    return list(parts(b))


def _message(m: Message) -> list[Any]:
    return [
        m.id,
        m.exchange,
        m.routing_key,
        m.header,
        m.body,
        m.delivery_mode,
        m.expiration_ms,
    ]


def _exchange(ex: Exchange, qref: Any) -> dict[str, Any]:
    return {
        "name": ex.name,
        "type": ex.type,
        "durable": ex.durable,
        "auto_delete": ex.auto_delete,
        "internal": ex.internal,
        "arguments": ex.arguments,
        "deleted": ex.deleted,
        "bindings": [_binding(bd, qref) for bd in ex.bindings],
    }


def _binding(bd: Binding, qref: Any) -> list[Any]:
    row = (
        ["q", qref(bd.dest), bd.key, bd.args]
        if isinstance(bd.dest, Queue)
        else ["e", bd.dest.name, bd.key, bd.args]
    )
    if bd.table is not None:
        # Model version 8: the client's arguments as sent (model/routing/exchange.py).
        row.append(bd.table.encode())
    return row


def _queue(q: Queue, held: int = 0) -> dict[str, Any]:
    d = {
        "name": q.name,
        "vhost": q.vhost,
        "durable": q.durable,
        "exclusive_owner": q.exclusive_owner,
        "auto_delete": q.auto_delete,
        "arguments": q.arguments,
        "ttl": q.ttl,
        "expires": q.expires,
        "max_length": q.max_length,
        "max_length_bytes": q.max_length_bytes,
        "overflow": q.overflow,
        "dlx": q.dlx,
        "dlrk": q.dlrk,
        "single_active": q.single_active,
        "quorum": q.quorum,
        "delivery_limit": q.delivery_limit,
        "rr": q.rr,
        "unacked": q.unacked - held,
        "ready_bytes": q.ready_bytes,
        "had_consumers": q.had_consumers,
        "last_used_ms": q.last_used_ms,
        "deleted": q.deleted,
        "bindings": [[bd.exchange, bd.routing_key, bd.arguments] for bd in q.bindings],
    }
    if q.flow_paused:
        # Only when set: states without queue flow snapshot (and digest) as before it existed.
        d["flow_paused"] = list(q.flow_paused)
    return d


def _connection(c: Connection, qref: Any, entry: Any, timed: bool) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": c.id,
        "member": c.member,
        "peer": c.peer,
        "loopback": c.loopback,
        "state": c.state,
        "header_buf": c.header_buf,
        "reader_pending": c.reader.pending,
        "reader_frame_max": c.reader.frame_max,
        "user": c.user,
        "vhost": c.vhost,
        "channel_max": c.channel_max,
        "frame_max": c.frame_max,
        "heartbeat": c.heartbeat,
        "capabilities": c.capabilities,
        "client_properties": c.client_properties,
        "credit": c.credit,
        "want_output": c.want_output,
        "granted": c.granted,
        "last_rx_ms": c.last_rx_ms,
        "last_tx_ms": c.last_tx_ms,
        "close_deadline": c.close_deadline,
        "exclusive_queues": list(c.exclusive_queues),
        "counter": c.counter,
        "published": c.published,
        "blocked_sent": c.blocked_sent,
        "channels": [_channel(ch, qref, entry, timed) for ch in c.channels.values()],
    }
    if c.tls:
        # Only for TLS clients: states without them snapshot (and digest) as before TLS.
        d["tls"] = True
        d["cert_user"] = c.cert_user
    return d


def _channel(ch: Channel, qref: Any, entry: Any, timed: bool) -> dict[str, Any]:
    pending = None
    p = ch.pending
    if p is not None:
        pending = [
            p.exchange,
            p.routing_key,
            p.mandatory,
            p.header,
            p.remaining,
            [] if p.parts is None else list(p.parts),
        ]
    tx_ops = [_tx_op(op) for op in ch.tx_ops]
    return {
        "id": ch.id,
        "closing": ch.closing,
        "flow_active": ch.flow_active,
        "prefetch_count": ch.prefetch_count,
        "global_prefetch": ch.global_prefetch,
        "next_tag": ch.next_tag,
        # From model version 8 each with the cluster time it was delivered at (what its
        # consumer timeout counts from); at 7 as release 0.1.0 wrote them.
        "unacked": [
            [tag, qref(q), entry(e), None if c is None else c.tag, at]
            for tag, (q, e, c, at) in ch.unacked.items()
        ]
        if timed
        else [
            [tag, qref(q), entry(e), None if c is None else c.tag]
            for tag, (q, e, c, _at) in ch.unacked.items()
        ],
        "consumers": [
            {
                "tag": c.tag,
                "queue": qref(c.queue),
                "no_ack": c.no_ack,
                "exclusive": c.exclusive,
                "prefetch": c.prefetch,
                "unacked": c.unacked,
                "args": c.args,
            }
            for c in ch.consumers.values()
        ],
        "confirm": ch.confirm,
        "publish_seq": ch.publish_seq,
        "confirm_pending": ch.confirm_pending,
        "confirm_sent": ch.confirm_sent,
        "tx": ch.tx,
        "tx_ops": tx_ops,
        "last_queue": ch.last_queue,
        "pending": pending,
    }


def _tx_op(op: TxOp) -> list[Any]:
    # The tags of format 2, written before tx operations were typed records.
    if isinstance(op, TxPublish):
        return ["publish", _message(op.msg), op.mandatory]
    if isinstance(op, TxAck):
        return ["ack", op.tag, op.multiple]
    return ["nack", op.tag, op.multiple, op.requeue]


def digest_bytes(b: Broker) -> bytes:
    """SHA-256 over the encoded parts: equal on replicas exactly when state is equal. Streams
    part by part, so it never holds an encoding of the whole state."""
    h = hashlib.sha256()
    for part in parts(b):
        h.update(encode(part))
    return h.digest()


def digest(b: Broker) -> str:
    return digest_bytes(b).hex()

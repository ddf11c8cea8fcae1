"""A hot-standby backup's copy of the primary: change batches in, a broker out on promotion.

Theory of operation
-------------------
The primary's broker records what it changed (``model/changes.py``); once per batch of applied
events its runtime turns the records into one *change batch* (:class:`Shipper`,
:func:`encode_batch`) and multicasts it. Every backup applies the batches, in the cluster's
order, to a :class:`Replica`: a broker without connections, so every backup holds the same
broker and the same snapshot digest, and everything that reads a broker (a state update, the
management API, a snapshot) reads it as it reads any other.

* **Definitions** (vhosts, exchanges, bindings, users, policies, federation) are shipped whole
  when they changed (``snapshot.definitions``; rarely: declares, deletes, binds, a first
  consumer, operators' changes) and installed at the end of the batch, the queues keeping
  their messages. Queues declared and deleted in the batch are records of their own, at
  their place, so that the records between them find the right queue.
* **Messages**: enqueued at the back; removed when settled; and a message out with a consumer
  is *kept in place* with what a client would see of it were it delivered again after the
  primary died: ``redelivered``, and a quorum queue's delivery count one higher. That is what
  closing the consumer's channel does to it (``Consumers.requeue_all``), done ahead; a requeue
  on the primary then sets the values the primary computed.

A backup does per message what appending to a deque and removing from it do, plus decoding
the record: no frame parsing, no routing, no consumer or channel bookkeeping. That is the point
of the mode: a backup spends a fraction of a member's CPU per message
(``bench/shipping_bench.py``).

**Promotion** (:meth:`Replica.promote`) turns the replica into the broker the new primary
serves, in place, by the steps the dead primary's connections closing would have taken:
messages past a quorum queue's delivery limit are dead-lettered, exclusive and reply-to
queues (never shipped) and auto-delete queues that had consumers are gone, with ``replicate =
"durable"`` whatever a restart drops is dropped, and the timer indexes are rebuilt. The
result equals the primary's broker with all its clients gone, as far as definitions and
messages go, but for the order in which messages past their delivery limit are dead-lettered
(``tests/unit/test_replica.py`` checks that after random workloads).

The batch encoding is this module's own, fixed-layout and versioned by its first byte: a batch
crosses the network to members that may run another build, so no pickle or marshal.

Owns: the replica broker, an index of its messages by id (derived, rebuilt when missing).
"""

from __future__ import annotations

import struct
from typing import Any

from cpgbroker.errors import InvariantError
from cpgbroker.model import snapshot
from cpgbroker.model.broker import Broker
from cpgbroker.model.changes import (
    CREATED,
    DELETED,
    DELIVERED,
    ENQUEUED,
    RELEASED,
    REQUEUED,
    ships_queue,
)
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.entities import Entry, Message, PriorityMessages, Queue, ready_messages

BATCH_FORMAT = 1

# Names a queue for the records after it (a queue the batch did not declare).
_NAME = 0
_HEAD = struct.Struct(">BQQB")  # format, msg_seq, now_ms, has definitions
_LEN = struct.Struct(">I")
_NAMED = struct.Struct(">BIHH")  # kind, ref, vhost length, name length
_CREATED = struct.Struct(">BII")  # kind, ref, metadata length (then snapshot.encode of it)
_REF = struct.Struct(">BI")  # kind, ref (deleted)
_REF_ID = struct.Struct(">BIQ")  # kind, ref, message id (delivered, released)
_REQUEUED = struct.Struct(">BIQBI")  # + redelivered, delivery count
# kind, ref, message id, expires_at (-1: none), whether the message follows: when it is new
# in this batch, its delivery mode, expiration (-1: none), where its header table is in the
# header (start and end, 0 and 0: none; not parsed again on every backup), the lengths of
# exchange, routing key, header and body, then those bytes.
_ENQUEUED = struct.Struct(">BIQqB")
_MESSAGE = struct.Struct(">BqIIBBII")


def encode_batch(
    records: list[tuple[Any, ...]], msg_seq: int, now_ms: int, definitions: bytes | None
) -> bytes:
    """One change batch: the primary's counters, its definitions if they changed (already
    encoded with ``snapshot.encode``), and the records of ``ChangeLog.take``."""
    out = [_HEAD.pack(BATCH_FORMAT, msg_seq, now_ms, definitions is not None)]
    if definitions is not None:
        out.append(_LEN.pack(len(definitions)))
        out.append(definitions)
    append = out.append
    # id(queue) -> its number in this batch (the records hold the queues: no id is reused).
    refs: dict[int, int] = {}
    sent: dict[int, None] = {}
    ref_id = _REF_ID.pack
    for r in records:
        kind = r[0]
        q: Queue = r[1]
        if kind == CREATED:
            ref = refs[id(q)] = len(refs) + 1
            meta = snapshot.encode(snapshot.queue_meta(q))
            append(_CREATED.pack(CREATED, ref, len(meta)))
            append(meta)
            continue
        ref = refs.get(id(q), 0)
        if not ref:
            ref = refs[id(q)] = len(refs) + 1
            vh, name = q.vhost.encode(), q.name.encode()
            append(_NAMED.pack(_NAME, ref, len(vh), len(name)))
            append(vh)
            append(name)
        if kind == ENQUEUED:
            msg: Message = r[2]
            exp = -1 if r[3] is None else r[3]
            if msg.id in sent:
                append(_ENQUEUED.pack(ENQUEUED, ref, msg.id, exp, 0))
                continue
            sent[msg.id] = None
            append(_ENQUEUED.pack(ENQUEUED, ref, msg.id, exp, 1))
            ex, rk = msg.ex_b, msg.rk_b
            span = msg.headers_span or (0, 0)
            append(
                _MESSAGE.pack(
                    msg.delivery_mode,
                    -1 if msg.expiration_ms is None else msg.expiration_ms,
                    span[0],
                    span[1],
                    len(ex),
                    len(rk),
                    len(msg.header),
                    len(msg.body),
                )
            )
            append(ex)
            append(rk)
            append(msg.header)
            append(msg.body)
        elif kind in (RELEASED, DELIVERED):
            append(ref_id(kind, ref, r[2]))
        elif kind == REQUEUED:
            append(_REQUEUED.pack(REQUEUED, ref, r[2], r[3], r[4]))
        elif kind == DELETED:
            append(_REF.pack(DELETED, ref))
        else:
            raise InvariantError(f"unknown change record {kind}")
    return b"".join(out)


class Shipper:
    """A primary's side: turns what its broker recorded since the last batch into the next
    change batch, with the definitions only when they differ from those last shipped."""

    def __init__(self) -> None:
        self.shipped = b""

    def batch(self, b: Broker) -> bytes:
        log = b.changes
        if log is None:
            raise InvariantError("the broker records no changes")
        records, structural = log.take()
        defs: bytes | None = None
        if structural:
            defs = snapshot.encode(snapshot.definitions(b))
            if defs == self.shipped:
                defs = None
            else:
                self.shipped = defs
        return encode_batch(records, b.msg_seq, b.now_ms, defs)


class Replica:
    """A backup's broker, kept by the primary's change batches."""

    def __init__(self, broker: Broker | None = None, config: BrokerConfig | None = None) -> None:
        self.broker = broker if broker is not None else Broker(config)
        self.config = self.broker.config
        # (vhost, queue) -> message id -> entry; derived: built from the queue when missing.
        self._index: dict[tuple[str, str], dict[int, Entry]] = {}
        self.batches = 0

    def _entries(self, q: Queue) -> dict[int, Entry]:
        key = (q.vhost, q.name)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = {e.msg.id: e for e in q.messages}
        return index

    # ------------------------------------------------------------------ applying

    def apply(self, batch: bytes) -> None:
        """Apply one change batch (in the cluster's order)."""
        try:
            self._apply(batch)
        except (KeyError, IndexError, ValueError, UnicodeDecodeError, struct.error) as e:
            raise InvariantError(f"change batch does not apply: {e!r}") from e
        self.batches += 1

    def _apply(self, batch: bytes) -> None:
        fmt, msg_seq, now_ms, has_defs = _HEAD.unpack_from(batch)
        if fmt != BATCH_FORMAT:
            raise InvariantError(f"change batch format {fmt} is not {BATCH_FORMAT}")
        p = _HEAD.size
        defs: bytes | None = None
        if has_defs:
            (n,) = _LEN.unpack_from(batch, p)
            p += _LEN.size
            defs = batch[p : p + n]
            p += n
        b = self.broker
        vhosts = b.vhosts
        mark = b.mark
        release = mark.release
        # ref -> the queue and its index of messages by id.
        refs: dict[int, tuple[Queue, dict[int, Entry]]] = {}
        new: dict[int, Message] = {}
        ref_id = _REF_ID.unpack_from
        end = len(batch)
        while p < end:
            kind = batch[p]
            if kind == RELEASED:
                _, ref, mid = ref_id(batch, p)
                p += 13
                q, index = refs[ref]
                e = index.pop(mid)
                msgs = q.messages
                if msgs[0] is e:
                    msgs.popleft()
                else:
                    msgs.remove(e)
                release(q, e)
            elif kind == ENQUEUED:
                _, ref, mid, exp, has_msg = _ENQUEUED.unpack_from(batch, p)
                p += _ENQUEUED.size
                if has_msg:
                    mode, expiration, h0, h1, nx, nr, nh, nb = _MESSAGE.unpack_from(batch, p)
                    p += _MESSAGE.size
                    ex = batch[p : p + nx].decode()
                    p += nx
                    rk = batch[p : p + nr].decode()
                    p += nr
                    header = batch[p : p + nh]
                    p += nh
                    body = batch[p : p + nb]
                    p += nb
                    if p > end:
                        raise InvariantError("change batch: a message overruns the batch")
                    msg = new[mid] = Message(
                        mid,
                        ex,
                        rk,
                        header,
                        body,
                        mode,
                        None if expiration < 0 else expiration,
                        (h0, h1) if h1 else None,
                    )
                else:
                    msg = new[mid]
                q, index = refs[ref]
                if mid in index:
                    raise InvariantError(f"message {mid} joins queue {q.name!r} twice")
                e = index[mid] = Entry(msg, False, None if exp < 0 else exp)
                q.messages.append(e)
                size = len(msg.body)
                q.ready_bytes += size
                mark.queued_bytes += size
            elif kind == DELIVERED:
                _, ref, mid = ref_id(batch, p)
                p += 13
                q, index = refs[ref]
                e = index[mid]
                # What closing the consumer's channel would do (module docstring).
                e.redelivered = True
                if q.quorum:
                    e.delivery_count += 1
            elif kind == REQUEUED:
                _, ref, mid, redelivered, count = _REQUEUED.unpack_from(batch, p)
                p += _REQUEUED.size
                e = refs[ref][1][mid]
                e.redelivered = bool(redelivered)
                e.delivery_count = count
            elif kind == _NAME:
                _, ref, nv, nn = _NAMED.unpack_from(batch, p)
                p += _NAMED.size
                vhost = batch[p : p + nv].decode()
                p += nv
                name = batch[p : p + nn].decode()
                p += nn
                q = vhosts[vhost].queues[name]
                refs[ref] = (q, self._entries(q))
            elif kind == CREATED:
                _, ref, n = _CREATED.unpack_from(batch, p)
                p += _CREATED.size
                q = snapshot.queue_from_meta(snapshot.decode(batch[p : p + n]))
                p += n
                vh = vhosts.get(q.vhost) or b.topology.add_vhost(q.vhost)
                if q.name in vh.queues:
                    raise InvariantError(f"queue {q.name!r} declared but already there")
                vh.queues[q.name] = q
                refs[ref] = (q, self._index.setdefault((q.vhost, q.name), {}))
            elif kind == DELETED:
                _, ref = _REF.unpack_from(batch, p)
                p += _REF.size
                q, _ = refs.pop(ref)
                self._index.pop((q.vhost, q.name), None)
                b.topology.delete_queue(q)
            else:
                raise InvariantError(f"unknown change record kind {kind} at byte {p}")
        if p != end:
            raise InvariantError(f"change batch overruns its {end} bytes")
        b.delivery.msg_seq = msg_seq
        b.clock.now_ms = now_ms
        if defs is not None:
            self._install(snapshot.decode(defs))
        # Nothing here is anyone's output (a release may unblock publishers: there are none).
        b.out.flush()

    def _install(self, defs: list[Any]) -> None:
        """The primary's definitions replace the replica's; queues keep their messages."""
        old = self.broker
        head = dict(defs[0])
        queue_parts = [p for p in defs[1:] if p[0] == "queue"]
        head.update(
            now_ms=old.now_ms,
            event_seq=old.event_seq,
            msg_seq=old.msg_seq,
            queued_bytes=0,
            blocked=False,
            messages=0,
            connections=0,
        )
        restorer = snapshot.Restorer(self.config)
        restorer.feed(head)
        for part in defs[1:]:
            restorer.feed(part)
        restorer.feed(
            [
                "tail",
                {
                    "ttl_queues": [],
                    "expiring": [],
                    "queue_consumers": [[] for _ in queue_parts],
                },
            ]
        )
        fresh = restorer.finish()
        index: dict[tuple[str, str], dict[int, Entry]] = {}
        queued = 0
        for vh in fresh.vhosts.values():
            for q in vh.queues.values():
                ovh = old.vhosts.get(vh.name)
                oq = ovh.queues.get(q.name) if ovh is not None else None
                if oq is None:
                    continue
                q.messages = oq.messages
                q.ready_bytes = oq.ready_bytes
                queued += q.ready_bytes
                key = (vh.name, q.name)
                if key in self._index:
                    index[key] = self._index[key]
        fresh.mark.queued_bytes = queued
        self._index = index
        self.broker = fresh

    # ------------------------------------------------------------------ reading

    @property
    def messages(self) -> int:
        return sum(
            len(q.messages) for vh in self.broker.vhosts.values() for q in vh.queues.values()
        )

    def digest(self) -> str:
        return snapshot.digest(self.broker)

    # ------------------------------------------------------------------ promotion

    def promote(self, replicate: str = "all") -> Broker:
        """The broker a backup serves once it is primary (module docstring). The replica is
        used up: it is that broker from now on."""
        b = self.broker
        topology = b.topology
        delivery = b.delivery
        now = b.now_ms
        queues = [q for vh in b.vhosts.values() for q in vh.queues.values()]
        over: list[tuple[Queue, Entry]] = []
        for q in queues:
            q.last_used_ms = now
            _in_publish_order(q)
            if q.quorum and q.delivery_limit is not None:
                limit = q.delivery_limit
                over.extend((q, e) for e in q.messages if e.delivery_count > limit)
        topology.restore(
            list(b.vhosts.values()),
            b.member_urls,
            [q for q in queues if any(e.expires_at is not None for e in q.messages)],
            [q for q in queues if q.expires is not None],
        )
        # Past their delivery limit as their channels closed: dead-lettered, oldest first.
        over.sort(key=lambda qe: qe[1].msg.id)
        for q, e in over:
            q.messages.remove(e)
            delivery.settle_dropped(q, e, "delivery_limit")
        # Their owners and consumers were the primary's clients.
        for q in queues:
            gone = not ships_queue(q) or (q.auto_delete and q.had_consumers)
            if gone and not q.deleted:
                topology.delete_queue(q)
        if replicate == "durable":
            topology.drop_transient()
        b.out.flush()
        self._index.clear()
        return b


def _in_publish_order(q: Queue) -> None:
    """Messages in id (publish) order, per priority: the primary's order, but for messages
    that joined at a transaction's commit behind newer ones, which a requeue would have put
    back by age too. Mostly in order already: checked in one pass, sorted only if not."""
    msgs = q.messages
    bands = msgs.bands if isinstance(msgs, PriorityMessages) else [msgs]
    if all(_sorted(band) for band in bands):
        return
    entries = sorted(msgs, key=_msg_id)
    fresh = ready_messages(q.arguments)
    fresh.extend(entries)
    q.messages = fresh


def _sorted(band: Any) -> bool:
    last = -1
    for e in band:
        if e.msg.id < last:
            return False
        last = e.msg.id
    return True


def _msg_id(e: Entry) -> int:
    return e.msg.id

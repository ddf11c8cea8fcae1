"""A hot-standby primary's side of state shipping: change batches out, promotion of a replica.

:class:`Shipper` turns what the primary's broker recorded (``model/changes.py``) into the next
change batch (:func:`encode_batch`; the layout is ``model/replica.py``'s, which applies it),
with the definitions only when they differ from those last shipped (``snapshot.definitions``).

:func:`promote` turns a replica into the broker a new primary serves, in place, by the steps
the dead primary's connections closing would have taken: messages past a quorum queue's
delivery limit are dead-lettered, exclusive and reply-to queues (never shipped) and auto-delete
queues that had consumers are gone, with ``replicate = "durable"`` whatever a restart drops is
dropped, and the timer indexes are rebuilt. The result equals the primary's broker with all
its clients gone, as far as definitions and messages go, but for the order in which messages
past their delivery limit are dead-lettered (``tests/unit/test_replica.py`` checks that after
random workloads).
"""

from __future__ import annotations

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
from cpgbroker.model.entities import Entry, Message, PriorityMessages, Queue, ready_messages
from cpgbroker.model.replica import (
    BATCH_FORMAT,
    CREATED_S,
    ENQUEUED_S,
    F_APPLIED,
    F_CONFIRMS,
    F_DEFINITIONS,
    F_DURABLE,
    HEAD_S,
    LEN_S,
    MESSAGE_S,
    NAME_KIND,
    NAMED_S,
    REF_ID_S,
    REF_S,
    REQUEUED_S,
)


def encode_batch(
    records: list[tuple[Any, ...] | None],
    msg_seq: int,
    now_ms: int,
    definitions: bytes | None,
    confirms: bool = False,
    durable: bool = False,
    applied: bool = False,
) -> bytes:
    """One change batch: the primary's counters, its definitions if they changed (already
    encoded with ``snapshot.encode``), and the records of ``ChangeLog.take``; ``confirms``:
    a client of the primary waits for a confirm (or a delivery) that this batch makes good
    (``durable``: one that waits for every member's store; ``applied``: one that waits for
    every member to have applied it only, while another waits for the stores)."""
    flags = (
        (F_DEFINITIONS if definitions is not None else 0)
        | (F_CONFIRMS if confirms else 0)
        | (F_DURABLE if durable else 0)
        | (F_APPLIED if applied and durable else 0)
    )
    out = [HEAD_S.pack(BATCH_FORMAT, msg_seq, now_ms, flags)]
    if definitions is not None:
        out.append(LEN_S.pack(len(definitions)))
        out.append(definitions)
    append = out.append
    # id(queue) -> its number in this batch (the records hold the queues: no id is reused).
    refs: dict[int, int] = {}
    sent: dict[int, None] = {}
    ref_id = REF_ID_S.pack
    for r in records:
        if r is None:
            continue
        kind = r[0]
        q: Queue = r[1]
        if kind == CREATED:
            ref = refs[id(q)] = len(refs) + 1
            meta = snapshot.encode(snapshot.queue_meta(q))
            append(CREATED_S.pack(CREATED, ref, len(meta)))
            append(meta)
            continue
        ref = refs.get(id(q), 0)
        if not ref:
            ref = refs[id(q)] = len(refs) + 1
            vh, name = q.vhost.encode(), q.name.encode()
            append(NAMED_S.pack(NAME_KIND, ref, len(vh), len(name)))
            append(vh)
            append(name)
        if kind == ENQUEUED:
            msg: Message = r[2]
            exp = -1 if r[3] is None else r[3]
            if msg.id in sent:
                append(ENQUEUED_S.pack(ENQUEUED, ref, msg.id, exp, 0))
                continue
            sent[msg.id] = None
            append(ENQUEUED_S.pack(ENQUEUED, ref, msg.id, exp, 1))
            ex, rk = msg.ex_b, msg.rk_b
            span = msg.headers_span or (0, 0)
            append(
                MESSAGE_S.pack(
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
            append(REQUEUED_S.pack(REQUEUED, ref, r[2], r[3], r[4]))
        elif kind == DELETED:
            append(REF_S.pack(DELETED, ref))
        else:
            raise InvariantError(f"unknown change record {kind}")
    return b"".join(out)


class Shipper:
    """A primary's side: turns what its broker recorded since the last batch into the next
    change batch, with the definitions only when they differ from those last shipped."""

    def __init__(self) -> None:
        self.shipped = b""

    def batch(
        self, b: Broker, confirms: bool = False, durable: bool = False, applied: bool = False
    ) -> bytes:
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
        return encode_batch(records, b.msg_seq, b.now_ms, defs, confirms, durable, applied)


def messages(b: Broker) -> int:
    """Messages held by ``b``'s queues (a replica: those out with a consumer too)."""
    return sum(
        len(q.messages) + b.replication.held(q)
        for vh in b.vhosts.values()
        for q in vh.queues.values()
    )


def promote(b: Broker, replicate: str = "all") -> None:
    """Turn a replica into the broker a new primary serves, in place (module docstring)."""
    topology = b.topology
    delivery = b.delivery
    now = b.now_ms
    queues = [q for vh in b.vhosts.values() for q in vh.queues.values()]
    over: list[tuple[Queue, Entry]] = []
    for q in queues:
        b.replication.fold(q)
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

"""A hot-standby primary's side of state shipping: change batches out, promotion of a replica.

:class:`Shipper` turns what the primary's broker recorded (``model/changes.py``) into the next
change batch (``changebatch.encode``: the layout is ``model/standby/changebatch.py``'s, and
``model/standby/replica.py`` applies it), with the definitions only when they differ from those last
shipped (``snapshot.definitions``).

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
from cpgbroker.model.broker import Broker
from cpgbroker.model.changes import ships_queue
from cpgbroker.model.entities import Entry, PriorityMessages, Queue, ready_messages
from cpgbroker.model.standby import changebatch
from cpgbroker.model.state import snapshot


def _queue_meta(q: Queue) -> bytes:
    """A declared queue's metadata in a change batch (``changebatch.encode``)."""
    return snapshot.encode(snapshot.queue_meta(q))


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
        return changebatch.encode(
            records, b.msg_seq, b.now_ms, defs, _queue_meta, confirms, durable, applied
        )


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

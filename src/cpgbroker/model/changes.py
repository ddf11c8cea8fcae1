"""What a hot-standby primary's model changed, as records a backup applies instead of client bytes.

Theory of operation
-------------------
In active-active every member replays every client's bytes. In hot standby with state shipping
(``[cluster] replication = "changes"``) only the primary applies its clients' bytes; what its
backups need is what would survive the primary's death: the definitions (vhosts, exchanges,
queues, bindings, users, policies, federation) and the messages in the queues. ConnectionProtocol,
channels, consumers and confirms die with the primary, so they are never shipped.

A :class:`ChangeLog` attached to a broker (:meth:`Broker.record_changes`) is told, by the few
places of the model where a message's place in a queue changes, what happened to it; those
components find it in the broker's one :class:`Recording`:

=============  ==========================================================================
record         when
=============  ==========================================================================
``created``    a queue was declared (``Topology.q_declare``)
``enqueued``   a message joined a queue (``Delivery.enqueue``)
``delivered``  it went to a consumer or basic.get that must acknowledge it
               (``Delivery.record_delivery``)
``requeued``   it came back (nack/reject with requeue, recover, a closed channel):
               ``Delivery.requeue``
``released``   it left the queue for good (acked, no-ack delivery, dropped, expired,
               dead-lettered, purged): ``MemoryMark.release``
``deleted``    a queue was deleted, whatever the cause (``Topology.delete_queue``)
=============  ==========================================================================

Records name the queue object itself; the encoder turns it into a name valid at that point
of the batch (a queue deleted and declared again in one batch is two queues). The rest of the
definitions is not recorded change by change: the model marks the log ``structural`` when an
event may have changed them (a method of the exchange class, a queue bound or unbound, a first
consume, a queue that ships declared, any queue deleted, any event but client data, do-output
and ticks), and the runtime then ships the definitions whole if they differ from the last
shipped (``model/shipping.py``). Definitions change rarely; messages change with every publish.

What is shipped is chosen here, by :attr:`replicate`:

* ``"all"``: every message of every queue but exclusive ones and direct reply-to's (such a
  queue dies with its connection, which dies with the primary: RPC replies never cross the
  cluster);
* ``"durable"``: only persistent messages on durable queues, what survives a RabbitMQ restart;
  a promoted backup drops the rest of the definitions as a restart does;
* ``"definitions"``: no message at all, only the definitions.

The log holds records as tuples until the runtime takes them (:meth:`take`), once per batch;
encoding them is ``model/standby/changebatch.py``'s. Determinism: the log reads nothing but what the
model hands it, and the records are in the order the model made the changes.

**Elision.** A message that joins a queue and leaves it again between two takes (a consumer
got it and acked it before its batch was cut) is never shipped: its ``released`` record
replaces its ``enqueued``, ``delivered`` and ``requeued`` records by ``None``. A backup that
never held it ends where one that held it and dropped it would, and the message's publisher
still gets its confirm only once the batch is stable (the confirm waits for the batch being
cut when it was published). Were the primary to die first, the consumer that acked it got it,
and its publisher never got a confirm. Under load most messages live shorter than a batch
(the runtime cuts the next batch only once the last came back: ``runtime/replication/shipping.py``),
so they cross the ring as a few bytes of nothing instead of their bodies. A message in two queues
is elided from each on its own; the first record left of it carries its body.

**Deliveries.** A backup keeps a delivered message in place, flagged redelivered
(``model/standby/replica.py``), so a member promoted after the primary redelivers it flagged: as
long as it holds the batch recording the delivery. A delivery recorded in the batch that also
records the message's enqueue is safe whenever it reaches its client: a member either holds
that batch, and knows of the delivery, or lacks it, and never held the message (whose confirm
waited for that batch). A delivery of a message that joined its queue in an earlier batch is
not: the member may hold the enqueue but not the delivery, and would deliver the message again
as a first delivery. :meth:`delivery_waits` tells the model which case it is, and the runtime
writes such a delivery only once its batch is stable (``Send.delivery_waits``,
``runtime/replication/shipping.py``, "Deliveries"). A consumer keeping up gets what is published in
the batch it joins (at once).

**Reservations.** A queue that backs up would hold every delivery a batch round trip, and the
consumers that fall behind so stay behind. So the log *reserves* messages ahead of their
delivery: a ``requeued`` record with the redelivered flag set, which a backup applies to the
message still in its queue. At each cut, what joined a queue in the batch and is still queued
is reserved in that batch, and may be delivered at once from then on: a member either holds
that batch, and the message flagged, or lacks it, and never held the message (a batch crosses
CPG whole, and a member that lacks one lacks every later one of the same sender). When a
delivery of a plain queue (not a priority queue) waits all the same (its message joined in an
earlier batch), the messages at the head behind it are reserved, and those may be delivered at
once once the batch carrying the reservation is stable (:attr:`stable_take`, told by the
runtime): every member that may be promoted then holds them flagged. Each time
:data:`RESERVE_MORE` of a queue's reservations were delivered, the next ones at its head are
reserved, up to :data:`RESERVE` ahead. The price: after a failover, up to :data:`RESERVE`
messages per queue that the old primary never delivered come flagged redelivered, which AMQP
allows ("may have been delivered"); never one it delivered comes unflagged. A quorum queue's
messages are never reserved: its delivery count would be off by one either way, so their
deliveries wait instead.

Owns: the records since the last :meth:`take`, where the records of each message that joined
a queue since then are, and the bytes of message bodies they hold; the reservations not yet
delivered, and the last take known stable.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from cpgbroker.errors import InvariantError
from cpgbroker.model.entities import Entry, Queue

# Messages reserved ahead per queue (module docstring, "Reservations"): at most this many come
# flagged redelivered after a failover without having been delivered. Under load a batch round
# trip to stability takes a few milliseconds, in which a consumer of a backed-up queue takes a
# few hundred messages; reserving this many keeps it from ever waiting for one.
RESERVE = 2048
# Reserved again each time this many of a queue's reservations were delivered: small steps, so
# that the next reservations are stable long before the last ones are used up.
RESERVE_MORE = 256

REPLICATE = ("all", "durable", "definitions")
# Direct reply-to pseudo-queues (model/routing/topology.py's REPLY_PREFIX): one consumer's, on the
# primary, like an exclusive queue.
_REPLY_PREFIX = "amq.rabbitmq.reply-to."

# Record kinds (the first element of each record tuple; the second is the queue).
CREATED = 1  # (CREATED, queue)
ENQUEUED = 2  # (ENQUEUED, queue, message, expires_at)
DELIVERED = 3  # (DELIVERED, queue, message id)
REQUEUED = 4  # (REQUEUED, queue, message id, redelivered, delivery count)
RELEASED = 5  # (RELEASED, queue, message id)
DELETED = 6  # (DELETED, queue)


def ships_queue(q: Queue) -> bool:
    """Whether a backup keeps ``q`` at all: not an exclusive queue or a reply-to queue,
    which die with their connection, and so with the primary."""
    return q.exclusive_owner is None and not q.name.startswith(_REPLY_PREFIX)


class ChangeLog:
    __slots__ = (
        "_ahead",
        "_open",
        "_reserved",
        "bytes",
        "elided",
        "records",
        "replicate",
        "stable_take",
        "structural",
        "takes",
    )

    def __init__(self, replicate: str = "all") -> None:
        if replicate not in REPLICATE:
            raise InvariantError(f"replicate must be one of {', '.join(REPLICATE)}")
        self.replicate = replicate
        # None: a record of a message that left its queue before the take (elided).
        self.records: list[tuple[Any, ...] | None] = []
        # (queue, message id) -> where its records are, for a message that joined the queue
        # since the last take and is still in it.
        self._open: dict[tuple[Queue, int], list[int]] = {}
        # Body bytes of the messages enqueued since the last take and not elided (what the
        # next batch carries, roughly: a message in two queues counts twice).
        self.bytes = 0
        # Messages that joined a queue and left it between two takes: never shipped.
        self.elided = 0
        # The definitions may have changed since the last take (module docstring).
        self.structural = True
        # Takes so far, and the last one whose batch every ready member applied (told by the
        # runtime): a reservation made before it may be delivered at once.
        self.takes = 0
        self.stable_take = 0
        # (queue, message id) -> the take that carries its reservation; per queue, how many
        # of its reservations are not delivered yet (module docstring, "Reservations").
        self._reserved: dict[tuple[Queue, int], int] = {}
        self._ahead: dict[Queue, int] = {}

    def take(self) -> tuple[list[tuple[Any, ...] | None], bool]:
        """The records since the last take, and whether the definitions may have changed."""
        if self._open:
            self._reserve_queued()
        records, structural = self.records, self.structural
        self.records = []
        self._open = {}
        self.bytes = 0
        self.structural = False
        self.takes += 1
        return records, structural

    def _ships(self, q: Queue, e: Entry) -> bool:
        if q.deleted or not ships_queue(q):
            return False
        mode = self.replicate
        if mode == "all":
            return True
        if mode == "durable":
            return q.durable and e.msg.delivery_mode == 2
        return False

    # ------------------------------------------------------------------ told by the model

    def created(self, q: Queue) -> None:
        # (A queue that never ships is not in the definitions either: an RPC client's reply
        # queue costs no look at them.)
        if ships_queue(q):
            self.structural = True
            if self.replicate != "definitions":
                self.records.append((CREATED, q))

    def enqueued(self, q: Queue, e: Entry) -> None:
        if self._ships(q, e):
            records = self.records
            self._open[(q, e.msg.id)] = [len(records)]
            records.append((ENQUEUED, q, e.msg, e.expires_at))
            self.bytes += len(e.msg.body)

    def delivery_waits(self, q: Queue, e: Entry) -> bool:
        """Whether a delivery of ``e`` (just taken from ``q``, about to be recorded) must reach
        its client only once the batch recording it is stable: ``e`` ships, joined ``q`` in an
        earlier batch, and no stable reservation covers it (module docstring, "Deliveries",
        "Reservations"). Reserves ahead as it goes."""
        key = (q, e.msg.id)
        if key in self._open or not self._ships(q, e):
            return False
        taken = self._reserved.pop(key, None)
        if taken is None:
            self._reserve(q)
            return True
        left = self._ahead[q] - 1
        self._ahead[q] = left
        if left <= RESERVE - RESERVE_MORE:
            self._reserve(q)
        return taken > self.stable_take

    def stable_to(self, take: int) -> None:
        """Every ready member applied the batch of take ``take`` (the runtime's word): what
        was reserved up to it may be delivered at once."""
        self.stable_take = take

    def _reserve_queued(self) -> None:
        """At the cut: reserve what joined a queue in this batch and is still queued (module
        docstring, "Reservations"), up to :data:`RESERVE` per queue. Usable at once (take 0):
        the reservation travels in the batch that enqueues the message."""
        reserved, ahead, records = self._reserved, self._ahead, self.records
        for key, at in self._open.items():
            q = key[0]
            if len(at) != 1 or q.quorum or q.deleted:
                continue  # delivered (or requeued) in this batch: its records say so
            n = ahead.get(q, 0)
            if n >= RESERVE:
                continue
            reserved[key] = 0
            ahead[q] = n + 1
            records.append((REQUEUED, q, key[1], True, 0))

    def _reserve(self, q: Queue) -> None:
        """Reserve messages at ``q``'s head up to :data:`RESERVE` (plain queues only)."""
        msgs = q.messages
        if q.quorum or type(msgs) is not collections.deque:
            return
        ahead = self._ahead.get(q, 0)
        if ahead >= RESERVE:
            return
        take = self.takes + 1
        reserved, opened, records = self._reserved, self._open, self.records
        ships = self._ships
        # The reserved ones are (about) the first ``ahead`` of the queue: look behind them.
        for e in itertools.islice(msgs, ahead, ahead + 2 * (RESERVE - ahead)):
            key = (q, e.msg.id)
            if key in reserved or key in opened or not ships(q, e):
                continue  # (one that joined in this batch needs none: "Deliveries")
            reserved[key] = take
            records.append((REQUEUED, q, e.msg.id, True, e.delivery_count))
            ahead += 1
            if ahead >= RESERVE:
                break
        self._ahead[q] = ahead

    def delivered(self, q: Queue, e: Entry) -> None:
        if self._ships(q, e):
            records = self.records
            at = self._open.get((q, e.msg.id))
            if at is not None:
                at.append(len(records))
            records.append((DELIVERED, q, e.msg.id))

    def requeued(self, q: Queue, e: Entry) -> None:
        if self._ships(q, e):
            records = self.records
            at = self._open.get((q, e.msg.id))
            if at is not None:
                at.append(len(records))
            records.append((REQUEUED, q, e.msg.id, e.redelivered, e.delivery_count))

    def reserved(self) -> list[tuple[Queue, int]]:
        """The messages reserved and not delivered (queue, message id): a promoted backup has
        them flagged redelivered (module docstring, "Reservations")."""
        return list(self._reserved)

    def unreserve(self, q: Queue, e: Entry) -> None:
        """``e`` left ``q`` without a delivery (expired, dropped, purged) or was settled."""
        if self._reserved.pop((q, e.msg.id), None) is not None:
            self._ahead[q] -= 1

    def released(self, q: Queue, e: Entry) -> None:
        if self._reserved:
            # (Looked at only while reservations are pending: this runs for every ack.)
            self.unreserve(q, e)
        if self._ships(q, e):
            at = self._open.pop((q, e.msg.id), None)
            if at is not None:
                # It joined since the last take: a backup never needs to hear of it.
                records = self.records
                for i in at:
                    records[i] = None
                self.elided += 1
                self.bytes -= len(e.msg.body)
                return
            self.records.append((RELEASED, q, e.msg.id))

    def deleted(self, q: Queue) -> None:
        """``q`` is deleted (already marked: nothing of it is recorded from now on, and its
        unacked messages, released when settled, are not either: a backup drops them with
        the queue)."""
        self.structural = True
        if self._ahead.pop(q, None):
            self._reserved = {k: t for k, t in self._reserved.items() if k[0] is not q}
        if ships_queue(q) and self.replicate != "definitions":
            self.records.append((DELETED, q))


class Recording:
    """Where the components that change queues and definitions (``Topology``, ``Delivery``,
    ``MemoryMark``, ``Channels``) find the change log their broker records into: one per
    broker, given to each of them when it is built, so that attaching a log
    (``Broker.record_changes``) is one assignment and no component reaches into another for
    it. ``log`` is None while nothing records (every broker but a hot-standby primary's)."""

    __slots__ = ("log",)

    def __init__(self) -> None:
        self.log: ChangeLog | None = None

    def definitions_may_change(self) -> None:
        """What is being applied may change the definitions (module docstring): the next
        batch compares them with those last shipped."""
        if self.log is not None:
            self.log.structural = True

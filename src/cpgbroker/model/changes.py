"""What a hot-standby primary's model changed, as records a backup applies instead of client bytes.

Theory of operation
-------------------
In active-active every member replays every client's bytes. In hot standby with state shipping
(``[cluster] replication = "changes"``) only the primary applies its clients' bytes; what its
backups need is what would survive the primary's death: the definitions (vhosts, exchanges,
queues, bindings, users, policies, federation) and the messages in the queues. Connections,
channels, consumers and confirms die with the primary, so they are never shipped.

A :class:`ChangeLog` attached to a broker (:meth:`Broker.record_changes`) is told, by the few
places of the model where a message's place in a queue changes, what happened to it:

=============  ==========================================================================
record         when
=============  ==========================================================================
``created``    a queue was declared (``Topology.q_declare``)
``enqueued``   a message joined a queue (``Delivery.enqueue``)
``delivered``  it went to a consumer or basic.get that must acknowledge it
``requeued``   it came back (nack/reject with requeue, recover, a closed channel)
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
encoding them is ``model/shipping.py``'s. Determinism: the log reads nothing but what the model
hands it, and the records are in the order the model made the changes.

**Elision.** A message that joins a queue and leaves it again between two takes (a consumer
got it and acked it before its batch was cut) is never shipped: its ``released`` record
replaces its ``enqueued``, ``delivered`` and ``requeued`` records by ``None``. A backup that
never held it ends where one that held it and dropped it would, and the message's publisher
still gets its confirm only once the batch is stable (the confirm waits for the batch being
cut when it was published). Were the primary to die first, the consumer that acked it got it,
and its publisher never got a confirm. Under load most messages live shorter than a batch
(the runtime cuts the next batch only once the last came back: ``runtime/shipping.py``), so
they cross the ring as a few bytes of nothing instead of their bodies. A message in two queues
is elided from each on its own; the first record left of it carries its body.

Owns: the records since the last :meth:`take`, where the records of each message that joined
a queue since then are, and the bytes of message bodies they hold.
"""

from __future__ import annotations

from typing import Any

from cpgbroker.errors import InvariantError
from cpgbroker.model.entities import Entry, Queue

REPLICATE = ("all", "durable", "definitions")
# Direct reply-to pseudo-queues (model/topology.py's REPLY_PREFIX): one consumer's, on the
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
    __slots__ = ("_open", "bytes", "elided", "records", "replicate", "structural")

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

    def take(self) -> tuple[list[tuple[Any, ...] | None], bool]:
        """The records since the last take, and whether the definitions may have changed."""
        records, structural = self.records, self.structural
        self.records = []
        self._open = {}
        self.bytes = 0
        self.structural = False
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

    def released(self, q: Queue, e: Entry) -> None:
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
        if ships_queue(q) and self.replicate != "definitions":
            self.records.append((DELETED, q))

"""Queue flow: publishers slow down to what a queue's consumers take (RabbitMQ's credit flow).

Theory of operation
-------------------
Without it a publisher faster than a queue's consumers fills the queue until the memory mark
(hundreds of MiB): every message then waits behind all the others and latency is the queue's
length divided by the consumers' rate. RabbitMQ's credit flow blocks a publisher's reader
while the queue process has not processed what it sent; a cluster member cannot wait for a
process, so the rule is written in replicated state instead, and every replica throttles the
same publishers at the same event:

* A publish that leaves a queue **with consumers** holding more than ``high`` ready messages
  (``[limits] queue_flow_messages``) pauses the publishing connection (a :class:`Throttle`
  effect: its owner stops reading its socket, so TCP pushes back on the client; no
  ``channel.flow``, which clients rarely honour) and the queue remembers it.
* Once the queue is down to ``high // 2`` ready messages (checked when it dispatches, and on
  every tick for every queue holding publishers back, also when it lost its consumers or was
  deleted), every publisher it held back resumes (unless the memory mark or a disk alarm
  still blocks them).

A queue without consumers is a buffer, as in RabbitMQ: filling it is bounded by the memory
mark and ``x-max-length``, not by this.

Owns: which queues hold publishers back (``queues``, derived: rebuilt on restore from
``Queue.flow_paused``). ``Queue.flow_paused`` (replicated: snapshots carry it) and
``Connection.flow_pauses`` (how many queues hold a connection back; derived) are the
entities' fields this component alone changes.
"""

from __future__ import annotations

from cpgbroker.model.entities import Connection, Queue
from cpgbroker.model.events import Throttle
from cpgbroker.model.output import Output
from cpgbroker.model.resources.memory import MemoryMark


class QueueFlow:
    __slots__ = ("_mark", "_out", "high", "low", "queues")

    def __init__(self, high: int, out: Output, mark: MemoryMark) -> None:
        # 0: off.
        self.high = high
        self.low = high // 2
        self._out = out
        self._mark = mark
        # Queues holding publishers back, in the order they started to (id(queue) -> queue;
        # iterated only in insertion order).
        self.queues: dict[int, Queue] = {}

    def published(self, conn: Connection, q: Queue) -> None:
        """``conn`` just published to ``q``, which now holds more than ``high`` ready
        messages and has consumers: hold ``conn`` back until ``q`` drains."""
        if conn.id in q.flow_paused:
            return
        q.flow_paused[conn.id] = conn
        self.queues[id(q)] = q
        conn.flow_pauses += 1
        if conn.flow_pauses == 1 and not self._mark.blocked:
            self._out.effect(Throttle(conn.id, True))

    def check(self, q: Queue) -> None:
        """``q`` may have drained (it dispatched, or lost consumers): release its publishers
        if it did."""
        if q.deleted or not q.consumers or len(q.messages) <= self.low:
            self._release(q)

    def on_tick(self) -> None:
        for q in list(self.queues.values()):
            self.check(q)

    def _release(self, q: Queue) -> None:
        self.queues.pop(id(q), None)
        paused, q.flow_paused = q.flow_paused, {}
        blocked = self._mark.blocked
        for conn in paused.values():
            conn.flow_pauses -= 1
            if conn.flow_pauses == 0 and not blocked:
                self._out.effect(Throttle(conn.id, False))

    def forget(self, conn: Connection) -> None:
        """``conn`` is gone: no queue holds it back any more (cost: the queues holding
        publishers back)."""
        for q in list(self.queues.values()):
            if q.flow_paused.pop(conn.id, None) is not None:
                conn.flow_pauses -= 1
                if not q.flow_paused:
                    del self.queues[id(q)]

    def restore(self, queues: list[Queue]) -> None:
        """After a snapshot restore: the queues whose ``flow_paused`` is not empty, and the
        connections' counts, rebuilt from them."""
        self.queues.clear()
        for q in queues:
            if q.flow_paused:
                self.queues[id(q)] = q
                for conn in q.flow_paused.values():
                    conn.flow_pauses += 1

"""The index of queues whose head message may expire (``Topology.ttl_queues``) and its derived
due-heap, so that a tick visits only the queues with something to do. Owned by the topology,
fed by delivery and consumers wherever a queue's head changes (``note``)."""

from __future__ import annotations

import heapq

from cpgbroker.model.entities import (
    Queue,
)

QueueKey = tuple[str, str]

# The due time of a queue with no ready messages: it leaves ``ttl_queues`` on the next tick.
EMPTY_DUE = -(1 << 63)


class TtlQueues(dict[QueueKey, Queue]):
    """``Topology.ttl_queues``: the queues whose head may expire, in the order they joined
    (the order a tick expires them in; snapshots carry it), plus a derived due-heap so that a
    tick visits only the queues with something to do.

    A queue is *due* when its head has expired (``expires_at <= now``) or it is empty (a tick
    drops it from the index); visiting any other queue is a no-op. ``Queue.ttl_order`` is the
    join number (increasing, so sorting by it is the dict's order; -1 when not in the index);
    ``heap`` holds ``(due time, ttl_order, push number, queue)``, validated lazily when popped
    (``Queue.ttl_due`` names the one live entry of a queue). Whoever changes a queue's head
    calls ``note``: a due time only ever gets earlier through a ``note``."""

    __slots__ = ("heap", "next_order", "pushes")

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[tuple[int, int, int, Queue]] = []
        self.next_order = 0
        self.pushes = 0

    def join(self, q: Queue) -> None:
        """``q`` holds a message that can expire: into the index (at the end if new)."""
        key = (q.vhost, q.name)
        old = self.get(key)
        if old is q:
            return
        self[key] = q
        if old is None:
            q.ttl_order = self.next_order
            self.next_order += 1
        else:  # never expected: the key keeps its place, as a dict's does
            q.ttl_order = old.ttl_order
            old.ttl_order = -1
            old.ttl_due = None

    def leave(self, q: Queue) -> None:
        if self.get((q.vhost, q.name)) is q:
            del self[(q.vhost, q.name)]
            q.ttl_order = -1
            q.ttl_due = None

    def note(self, q: Queue) -> None:
        """``q``'s head may have changed: schedule it if it may now be due sooner."""
        if q.ttl_order < 0:
            return
        msgs = q.messages
        if msgs:
            t = msgs[0].expires_at
            if t is None:
                return
        else:
            t = EMPTY_DUE
        due = q.ttl_due
        if due is None or t < due:
            q.ttl_due = t
            self.pushes += 1
            heapq.heappush(self.heap, (t, q.ttl_order, self.pushes, q))

    def rebuild(self) -> None:
        """Recompute the derived state from the index (restore; a heap grown stale)."""
        self.heap.clear()
        self.pushes = 0
        self.next_order = 0
        for q in self.values():
            q.ttl_order = self.next_order
            self.next_order += 1
            q.ttl_due = None
            self.note(q)

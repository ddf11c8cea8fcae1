"""Which connections a clock tick must visit (derived state of ``ConnectionProtocol``).

A tick sends heartbeats, drops silent clients and ends handshake and close timeouts. Walking
every connection for that cost O(all connections) per tick; :class:`Deadlines` keeps a
lazily checked heap of when each connection next has something to do, so a tick costs the
connections that are due (as ``ttlindex.py`` does for message TTL). It is never replicated:
snapshots leave it out and ``ConnectionProtocol.restore`` rebuilds it.
"""

from __future__ import annotations

import heapq

from cpgbroker.model.entities import CLOSING, OPEN, Connection


def next_due(conn: Connection) -> int | None:
    """The cluster time from which a tick has something to do for ``conn`` (drop it after a
    timeout or a heartbeat missed, or send it a heartbeat), from its state and its last
    receive and send; None if no tick ever will until one of those changes. Each condition
    of :meth:`ConnectionProtocol.on_tick` is ``now >= threshold``, so this is the smallest threshold
    that applies."""
    state = conn.state
    due = None
    if state != OPEN:
        due = conn.close_deadline
        if state == CLOSING:
            return due
    hb = conn.heartbeat * 1000
    if hb <= 0:
        return due
    # Silent for more than two intervals (spec 4.2.7), or half an interval since we sent.
    t = min(conn.last_rx_ms + 2 * hb + 1, conn.last_tx_ms + hb // 2)
    return t if due is None or t < due else due


class Deadlines:
    """Which connections a tick must visit: derived state of :class:`ConnectionProtocol`,
    never replicated (snapshots leave it out, a restore rebuilds it through
    ``ConnectionProtocol.restore``).

    ``order`` numbers each connection in the order it joined ``connections`` (increasing, so
    sorting by it is the dict's order, the order in which the full sweep of every connection
    acted; a reconnect under the same id gets a new number, as it goes to the dict's end).
    ``heap`` holds ``(due, order, connection id)`` entries validated lazily when popped:
    ``due`` maps a connection to the one live entry it has. The rule that keeps this exact:
    a live entry is never later than the connection's :func:`next_due`. Receiving and sending
    only ever move a connection's thresholds later, so they need not touch the heap (the entry
    pops early, and is pushed again at the real time); the few changes that can make one
    earlier (a new connection, tune-ok setting heartbeats, a connection error setting the close
    timeout) call :meth:`schedule`."""

    __slots__ = ("due", "heap", "next_order", "order")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, int]] = []
        self.order: dict[int, int] = {}
        self.due: dict[int, int] = {}
        self.next_order = 0

    def add(self, conn: Connection) -> None:
        self.order[conn.id] = self.next_order
        self.next_order += 1
        self.schedule(conn)

    def remove(self, conn_id: int) -> None:
        del self.order[conn_id]
        self.due.pop(conn_id, None)
        # Entries of gone connections stay until they pop: compact when they dominate.
        if len(self.heap) > 2 * len(self.order) + 64:
            self.compact()

    def schedule(self, conn: Connection) -> None:
        """``conn``'s deadline may have become earlier: give it an entry no later than it."""
        t = next_due(conn)
        if t is None:
            return
        cid = conn.id
        live = self.due.get(cid)
        if live is None or t < live:
            self.due[cid] = t
            heapq.heappush(self.heap, (t, self.order[cid], cid))

    def pop_due(self, now_ms: int, connections: dict[int, Connection]) -> list[Connection]:
        """The connections with something to do at ``now_ms``, in ``connections`` order; each
        loses its entry (the caller schedules it again after acting). Entries that popped
        early are pushed again at the connection's real time."""
        heap, due, order = self.heap, self.due, self.order
        found: list[tuple[int, Connection]] = []
        while heap and heap[0][0] <= now_ms:
            t, o, cid = heapq.heappop(heap)
            if due.get(cid) != t or order.get(cid) != o:
                continue  # stale: superseded by an earlier entry, or its connection gone
            del due[cid]
            conn = connections[cid]
            real = next_due(conn)
            if real is None:
                continue
            if real > now_ms:
                due[cid] = real
                heapq.heappush(heap, (real, o, cid))
                continue
            found.append((o, conn))
        if len(found) > 1:
            found.sort()  # order numbers are unique: connections are never compared
        return [conn for _o, conn in found]

    def compact(self) -> None:
        """Drop the stale entries (a heap grown with connections that went)."""
        order = self.order
        self.heap = [(t, order[cid], cid) for cid, t in self.due.items()]
        heapq.heapify(self.heap)

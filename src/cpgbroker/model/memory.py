"""The memory mark: how many body bytes the queues hold, and whether publishers are blocked.

Theory of operation
-------------------
:class:`MemoryMark` owns two numbers: ``queued_bytes`` (the bodies of every ready and unacked
message, counted once per queue holding them) and ``blocked``. Above the high mark, clients
that support it get connection.blocked and every connection that ever published is paused
(a :class:`~.events.Throttle` effect: the owner stops reading its socket, so TCP pushes
back); below ``low_watermark_ratio`` of the mark they all resume. The mark is computed from
replicated state only, so every replica blocks and unblocks at the same event.

Delivery adds to ``queued_bytes`` when it enqueues (inline: it is the per-message path);
everything that removes a message from a queue calls :meth:`release`. The mark never looks
at queues or channels beyond the message it is told about.
"""

from __future__ import annotations

from pamqp import commands

from cpgbroker.model import entities as E
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.entities import Connection, Entry, Queue
from cpgbroker.model.events import Throttle
from cpgbroker.model.output import Output


class MemoryMark:
    __slots__ = ("_connections", "_out", "blocked", "high", "low", "queued_bytes")

    def __init__(
        self, config: BrokerConfig, connections: dict[int, Connection], out: Output
    ) -> None:
        self.queued_bytes = 0
        self.blocked = False
        self.high = config.high_watermark_bytes
        # The same float every time the old code computed it, so the comparison is unchanged.
        self.low = config.high_watermark_bytes * config.low_watermark_ratio
        self._connections = connections
        self._out = out

    def release(self, q: Queue, e: Entry) -> None:
        """``e`` left ``q`` for good (acked, dropped, purged, dead-lettered elsewhere)."""
        size = len(e.msg.body)
        q.ready_bytes -= size
        self.queued_bytes -= size
        if self.blocked and self.queued_bytes < self.low:
            self.set_blocked(False)

    def check(self) -> None:
        """After publishing: block publishers if the queues went above the mark."""
        if self.queued_bytes > self.high and not self.blocked:
            self.set_blocked(True)

    def set_blocked(self, blocked: bool) -> None:
        """Block (or unblock) publishers: connection.blocked to clients that understand it, and
        stop reading from connections that publish, so memory stays bounded."""
        self.blocked = blocked
        out = self._out
        for conn in self._connections.values():
            if conn.state != E.OPEN:
                continue
            if conn.capabilities.get("connection.blocked"):
                if blocked and not conn.blocked_sent:
                    out.send_method(conn, 0, commands.Connection.Blocked(reason="low on memory"))
                    conn.blocked_sent = True
                elif not blocked and conn.blocked_sent:
                    out.send_method(conn, 0, commands.Connection.Unblocked())
                    conn.blocked_sent = False
            if conn.published:
                out.effect(Throttle(conn.id, blocked))

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

The disk works the same way (RabbitMQ's ``disk_free_limit``): a member whose store's disk has
less free space than ``[store] free_disk_limit_mib`` multicasts a ``DiskAlarm``; while any
member is in alarm, publishers are blocked ("low on disk"), at the same event on every replica
because the alarm is part of the stream. ``blocked`` is the effect of both causes.
"""

from __future__ import annotations

from pamqp import commands

from cpgbroker.model import entities as E
from cpgbroker.model.changes import Recording
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.entities import Connection, Entry, Queue
from cpgbroker.model.events import Throttle
from cpgbroker.model.output import Output


class MemoryMark:
    __slots__ = (
        "_changes",
        "_connections",
        "_out",
        "blocked",
        "disk_alarms",
        "high",
        "low",
        "memory_blocked",
        "queued_bytes",
    )

    def __init__(
        self,
        config: BrokerConfig,
        connections: dict[int, Connection],
        out: Output,
        changes: Recording,
    ) -> None:
        self.queued_bytes = 0
        # Publishers are blocked (either cause); above the memory mark (until below ``low``).
        self.blocked = False
        self.memory_blocked = False
        # Members whose store's disk is low on free space (dict: insertion order, no sets).
        self.disk_alarms: dict[int, bool] = {}
        self.high = config.high_watermark_bytes
        # The same float every time the old code computed it, so the comparison is unchanged.
        self.low = config.high_watermark_bytes * config.low_watermark_ratio
        self._connections = connections
        self._out = out
        # Where a hot-standby primary's change log is (model/changes.py), told of every
        # release.
        self._changes = changes

    def release(self, q: Queue, e: Entry) -> None:
        """``e`` left ``q`` for good (acked, dropped, purged, dead-lettered elsewhere)."""
        size = len(e.msg.body)
        q.ready_bytes -= size
        self.queued_bytes -= size
        log = self._changes.log
        if log is not None:
            log.released(q, e)
        if self.memory_blocked and self.queued_bytes < self.low:
            self.set_blocked(False)

    def add(self, size: int) -> None:
        """``size`` body bytes joined a queue without a publish (a backup applying a change
        batch: model/standby/replica.py); publishers are blocked by the primary's mark, not here."""
        self.queued_bytes += size

    def recount(self, queued_bytes: int) -> None:
        """The queues hold ``queued_bytes`` in all (a backup installing the primary's
        definitions: model/standby/replica.py; a replica restored from the back:
        model/state/restore.py)."""
        self.queued_bytes = queued_bytes

    def restore(
        self, queued_bytes: int, blocked: bool, memory_blocked: bool, disk_alarms: list[int]
    ) -> None:
        """Install a snapshot's counters (``Broker.restore_counters``)."""
        self.queued_bytes = queued_bytes
        self.blocked = blocked
        self.memory_blocked = memory_blocked
        self.disk_alarms = dict.fromkeys(disk_alarms, True)

    def check(self) -> None:
        """After publishing: block publishers if the queues went above the mark."""
        if self.queued_bytes > self.high and not self.memory_blocked:
            self.set_blocked(True)

    def set_disk_alarm(self, member: int, low: bool) -> None:
        """``member``'s disk is low on free space (or no longer is, or the member left)."""
        if low:
            self.disk_alarms[member] = True
        else:
            self.disk_alarms.pop(member, None)
        self._apply(self.memory_blocked or bool(self.disk_alarms))

    @property
    def reason(self) -> str:
        """connection.blocked's reason, as RabbitMQ words it."""
        return "low on memory" if self.memory_blocked else "low on disk"

    def set_blocked(self, blocked: bool) -> None:
        """The memory mark was crossed (up: ``blocked``)."""
        self.memory_blocked = blocked
        self._apply(blocked or bool(self.disk_alarms))

    def _apply(self, blocked: bool) -> None:
        """Block (or unblock) publishers: connection.blocked to clients that understand it, and
        stop reading from connections that publish, so memory (and disk) stays bounded."""
        if blocked == self.blocked:
            return
        self.blocked = blocked
        out = self._out
        for conn in self._connections.values():
            if conn.state != E.OPEN:
                continue
            if conn.capabilities.get("connection.blocked"):
                if blocked and not conn.blocked_sent:
                    out.send_method(conn, 0, commands.Connection.Blocked(reason=self.reason))
                    conn.blocked_sent = True
                elif not blocked and conn.blocked_sent:
                    out.send_method(conn, 0, commands.Connection.Unblocked())
                    conn.blocked_sent = False
            # A connection a queue holds back (model/resources/queueflow.py) stays paused.
            if conn.published and (blocked or not conn.flow_pauses):
                out.effect(Throttle(conn.id, blocked))

"""Cluster time and the output of one event: the plumbing every component of the model shares.

Theory of operation
-------------------
:class:`Clock` holds the cluster time, ``now_ms``: the last :class:`~.events.Tick`'s time,
written by the broker only (on ticks) and read by every component, so that no component
reads a wall clock and every replica sees the same time at the same event.

:class:`Output` owns what one ``apply`` produces: the bytes waiting per connection
(``Connection.outbuf``), the connections that have some (``dirty``) and the other effects in
order. ``flush`` turns them into one :class:`~.events.Send` per connection, so a client gets
one write per event however many frames the event produced. Shadow connections (``emit``
false: another member's clients) are never encoded at all; only their last transmission
time, which heartbeats depend on, is kept, because it is replicated state.

It also counts the confirms produced for shadow connections (``shadow_confirms``), a
replica-local statistic the runtime reads to learn that an event gave another member's
client a confirm (``runtime/member/member.py``); only its changes matter, so it is not replicated.

The few server methods that carry client-chosen queue or exchange names (queue.declare-ok,
basic.return) are encoded here by hand: pamqp refuses, on encoding, names that RabbitMQ
accepts (``=``, non-ASCII, more than 127 characters), and names are the broker's business
(``topology.py``), not the codec's.
"""

from __future__ import annotations

import struct
from typing import Any

from pamqp import frame as pframe

from cpgbroker.errors import InvariantError
from cpgbroker.model.entities import Connection
from cpgbroker.model.events import CONFIRM, CONFIRM_DURABLE, CloseConnection, Effect, Send

_FRAME_HEAD = struct.Struct(">BHI")
_U32 = struct.Struct(">I")
_DECLARE_OK_COUNTS = struct.Struct(">II")
_U16 = struct.Struct(">H")
_FRAME_END = b"\xce"
_FRAME_METHOD = 1

QUEUE_DECLARE_OK = 0x0032000B
BASIC_RETURN = 0x003C0032


class Clock:
    """Cluster time in ms: the broker writes it on ticks, every component reads it."""

    __slots__ = ("now_ms",)

    def __init__(self) -> None:
        self.now_ms = 0

    def set(self, now_ms: int) -> None:
        """Cluster time is ``now_ms``: a tick's (clamped by the broker: it never goes back),
        a snapshot's, or the primary's from each change batch (model/standby/replica.py)."""
        self.now_ms = now_ms


def shortstr(value: str) -> bytes:
    """An AMQP shortstr: at most 255 bytes of UTF-8 (what the wire allows is what we hold)."""
    raw = value.encode()
    if len(raw) > 255:
        raise InvariantError(f"shortstr of {len(raw)} bytes")
    return bytes((len(raw),)) + raw


def method_frame(channel: int, index: int, arguments: bytes) -> bytes:
    payload = _U32.pack(index) + arguments
    return _FRAME_HEAD.pack(_FRAME_METHOD, channel, len(payload)) + payload + _FRAME_END


def queue_declare_ok(channel: int, queue: str, message_count: int, consumer_count: int) -> bytes:
    return method_frame(
        channel,
        QUEUE_DECLARE_OK,
        shortstr(queue) + _DECLARE_OK_COUNTS.pack(message_count, consumer_count),
    )


def basic_return(channel: int, code: int, text: str, exchange: str, routing_key: str) -> bytes:
    return method_frame(
        channel,
        BASIC_RETURN,
        _U16.pack(code) + shortstr(text) + shortstr(exchange) + shortstr(routing_key),
    )


class Output:
    """Owns the effects of the event being applied and the connections with bytes waiting.

    Hot paths that encode a delivery append to ``Connection.outbuf`` and ``dirty``
    themselves (a method call per delivery is what they save); everything else goes
    through :meth:`emit` and :meth:`send_method`."""

    __slots__ = (
        "_clock",
        "_durable",
        "_effects",
        "dirty",
        "shadow_confirms",
        "shadow_durable_confirms",
    )

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._effects: list[Effect] = []
        # Connections whose ``outbuf`` is not empty, in the order they got output.
        self.dirty: list[Connection] = []
        # Confirms and tx.commit-oks produced for shadow connections (see module docstring).
        self.shadow_confirms = 0
        # Of those, the ones that wait for the stores (see persisted).
        self.shadow_durable_confirms = 0
        # Connections that published a persistent message to a durable queue in this event:
        # their confirms wait for the stores too (membership tests only; cleared per event).
        self._durable: dict[int, bool] = {}

    def emit(self, conn: Connection, data: bytes) -> None:
        conn.last_tx_ms = self._clock.now_ms
        if not conn.emit:
            return
        if not conn.outbuf:
            self.dirty.append(conn)
        conn.outbuf.append(data)

    def send_method(self, conn: Connection, channel: int, method: Any) -> None:
        conn.last_tx_ms = self._clock.now_ms
        if conn.emit:
            self.emit(conn, pframe.marshal(method, channel))

    def effect(self, effect: Effect) -> None:
        """An effect other than output bytes (throttle, want-output), in order."""
        self._effects.append(effect)

    def confirmed(self, conn: Connection) -> None:
        """A confirm or tx.commit-ok was just emitted for ``conn``."""
        if conn.emit:
            conn.confirm_out = True
        else:
            self.shadow_confirms += 1
            if conn.id in self._durable:
                self.shadow_durable_confirms += 1

    def shadow_confirmed(self, durable: bool) -> None:
        """Another member's client waits for a confirm this member reports once it applied the
        event (``durable``: once its store holds it too): a backup's change batch that says so
        (model/standby/replica.py)."""
        self.shadow_confirms += 1
        if durable:
            self.shadow_durable_confirms += 1

    def admin_answered(self, shadow: bool) -> None:
        """An admin command was answered (model/operators/admin.py); ``shadow``: another member's
        operator asked. Its answer waits, as a confirm of a persistent message does, until
        every member applied the change and its store holds it: counted as such a confirm so
        that this member reports soon."""
        if shadow:
            self.shadow_confirms += 1
            self.shadow_durable_confirms += 1

    def persisted(self, conn: Connection) -> None:
        """``conn`` published a persistent message that a durable queue took, in this event:
        a confirm or commit-ok it is given now waits for every member's store."""
        self._durable[conn.id] = True

    def flush_conn(self, conn: Connection) -> None:
        if conn.outbuf:
            data = conn.outbuf[0] if len(conn.outbuf) == 1 else b"".join(conn.outbuf)
            conn.outbuf.clear()
            level = 0
            if conn.confirm_out:
                level = CONFIRM_DURABLE if conn.id in self._durable else CONFIRM
            self._effects.append(Send(conn.id, data, level, conn.delivery_waits))
            conn.confirm_out = conn.delivery_waits = False

    def close_socket(self, conn: Connection, reason: str) -> None:
        """Whatever ``conn`` has waiting, then close it."""
        self.flush_conn(conn)
        self._effects.append(CloseConnection(conn.id, reason))

    def flush(self) -> list[Effect]:
        """The effects of the event just applied: one Send per connection, in order."""
        for conn in self.dirty:
            self.flush_conn(conn)
        self.dirty.clear()
        if self._durable:
            self._durable.clear()
        effects = self._effects
        self._effects = []
        return effects

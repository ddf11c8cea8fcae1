"""Publisher confirms: telling a client which of its publishes took effect.

Theory of operation
-------------------
:class:`Confirms` owns the confirm bookkeeping of channels in confirm mode: every routed
publish counts (``Channel.publish_seq``); a publish that some queue refused (x-overflow
reject-publish) is nacked at once, after confirming everything before it; the others are
confirmed once per event and channel with one ``basic.ack(multiple)`` (``flush``, which the
connection protocol calls after each event's frames), so a burst of publishes costs one
confirm frame, not one each. The channels with a confirm due are ``Connection.confirm_dirty``.

A channel is in confirm mode or in tx mode (``transactions.py``), never both (406
PRECONDITION_FAILED, as RabbitMQ).
"""

from __future__ import annotations

from typing import Any

from pamqp import commands

from cpgbroker.errors import ChannelError, ReplyCode
from cpgbroker.model.entities import Channel, Connection
from cpgbroker.model.output import Output
from cpgbroker.wire import fastpath as fp

R = ReplyCode


class Confirms:
    __slots__ = ("_confirmed", "_emit", "_out")

    def __init__(self, out: Output) -> None:
        self._out = out
        self._emit = out.emit
        self._confirmed = out.confirmed

    def confirm_select(self, conn: Connection, ch: Channel, m: Any) -> None:
        if ch.tx:
            raise ChannelError(R.PRECONDITION_FAILED, "cannot switch from tx to confirm mode")
        ch.confirm = True
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Confirm.SelectOk())

    def published(self, conn: Connection, ch: Channel, refused: bool) -> None:
        """A publish on confirm channel ``ch`` was routed; ``refused`` if a queue refused it."""
        ch.publish_seq += 1
        if refused:
            self.flush_channel(ch, upto=ch.publish_seq - 1)
            self._emit(conn, fp.encode_nack(ch.id, ch.publish_seq, False))
            self._confirmed(conn)
            ch.confirm_sent = ch.publish_seq
        else:
            ch.confirm_pending = ch.publish_seq
            if ch not in conn.confirm_dirty:
                conn.confirm_dirty.append(ch)

    def flush(self, conn: Connection) -> None:
        """The confirms due on ``conn``'s channels, one frame per channel."""
        for ch in conn.confirm_dirty:
            self.flush_channel(ch)
        conn.confirm_dirty.clear()

    def flush_channel(self, ch: Channel, upto: int | None = None) -> None:
        """Confirm every publish settled since the last confirm with one (multiple) ack."""
        target = ch.confirm_pending if upto is None else min(upto, ch.confirm_pending)
        if target <= ch.confirm_sent:
            return
        multiple = target - ch.confirm_sent > 1
        self._emit(ch.conn, fp.encode_ack(ch.id, target, multiple))
        self._confirmed(ch.conn)
        ch.confirm_sent = target

    def release(self, ch: Channel) -> None:
        """``ch`` closes: the confirms it is owed leave before its close."""
        conn = ch.conn
        if ch in conn.confirm_dirty:
            self.flush_channel(ch)
            conn.confirm_dirty.remove(ch)

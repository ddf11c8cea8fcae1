"""Transactions: tx.select / tx.commit / tx.rollback.

Theory of operation
-------------------
:class:`Transactions` owns the transaction methods. A transactional channel holds its
publishes and settlements as typed records in ``Channel.tx_ops``
(:class:`~.entities.TxPublish`, :class:`~.entities.TxAck`, :class:`~.entities.TxNack`: delivery
and consumers append them instead of acting) and commit replays them in order through
delivery (routing) and consumers (settling), then answers commit-ok, which counts as a
confirm for the runtime (``Output.confirmed``). Rollback drops them.

A channel is in tx mode or in confirm mode (``confirms.py``), never both (406
PRECONDITION_FAILED, as RabbitMQ).
"""

from __future__ import annotations

from typing import Any

from pamqp import commands

from cpgbroker.errors import ChannelError, ReplyCode
from cpgbroker.model.entities import Channel, Connection, TxAck, TxPublish
from cpgbroker.model.messages.consumers import Consumers
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.output import Output
from cpgbroker.model.resources.memory import MemoryMark
from cpgbroker.model.routing.topology import VHost

R = ReplyCode


class Transactions:
    __slots__ = ("_consumers", "_delivery", "_mark", "_out", "_vhosts")

    def __init__(
        self,
        out: Output,
        mark: MemoryMark,
        vhosts: dict[str, VHost],
        delivery: Delivery,
        consumers: Consumers,
    ) -> None:
        self._out = out
        self._mark = mark
        self._vhosts = vhosts
        self._delivery = delivery
        self._consumers = consumers

    def tx_select(self, conn: Connection, ch: Channel, m: Any) -> None:
        if ch.confirm:
            raise ChannelError(R.PRECONDITION_FAILED, "cannot switch from confirm to tx mode")
        ch.tx = True
        self._out.send_method(conn, ch.id, commands.Tx.SelectOk())

    def tx_commit(self, conn: Connection, ch: Channel, m: Any) -> None:
        if not ch.tx:
            raise ChannelError(R.PRECONDITION_FAILED, "channel is not transactional")
        ops = ch.tx_ops
        ch.tx_ops = []
        vh = self._vhosts[conn.vhost]
        settle = self._consumers.settle
        settled = False
        for op in ops:
            if isinstance(op, TxPublish):
                msg = op.msg
                ex = vh.exchanges.get(msg.exchange)
                if ex is None:
                    raise ChannelError(
                        R.NOT_FOUND, f"no exchange '{msg.exchange}' in vhost '{vh.name}'"
                    )
                self._delivery.route_and_enqueue(conn, ch, vh, ex, msg, op.mandatory)
            elif isinstance(op, TxAck):
                settle(ch, op.tag, op.multiple, None, 80)
                settled = True
            else:
                settle(ch, op.tag, op.multiple, op.requeue, 120)
                settled = True
        if settled:
            # Committed acks are a promise too: a message they settled must not come back
            # after every member restarts, so the commit-ok waits for the stores.
            self._out.persisted(conn)
        self._out.send_method(conn, ch.id, commands.Tx.CommitOk())
        self._out.confirmed(conn)
        self._mark.check()

    def tx_rollback(self, conn: Connection, ch: Channel, m: Any) -> None:
        if not ch.tx:
            raise ChannelError(R.PRECONDITION_FAILED, "channel is not transactional")
        ch.tx_ops = []
        self._out.send_method(conn, ch.id, commands.Tx.RollbackOk())

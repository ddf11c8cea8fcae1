"""The channel protocol: decoding a channel's methods and handing each to its owner.

Theory of operation
-------------------
:class:`Channels` owns the method table (which component handles which AMQP method, as
bound methods built once) and the life of channels: channel.open / close / close-ok / flow,
a channel exception (``channel_error``: channel.close with the spec's reply code; the
connection stays open) and giving back what a closing channel holds (``release_channel``).

Every method but the fast ones (publish, ack, nack, reject: struct-decoded by their
handlers) is decoded by pamqp and checked with its ``validate()`` in :func:`decode_method`.
Its arguments are walked by ``wire/tables.py`` first, because pamqp takes a short string cut
short for a shorter one, ignores bytes after the last argument and recurses into tables:
arguments that do not decode (cut short, followed by stray bytes, holding a malformed table)
are 501 FRAME_ERROR ``cannot decode <<...>>``, as in RabbitMQ 3.10.8 (``wire/fastpath.py``);
a well-formed table over our depth or size limits stays 502 SYNTAX_ERROR (RabbitMQ would take
it: a limit of ours, not a decoding failure). ``validate()`` has two exceptions: the 0-8
fields that 0-9-1 reserved are reset to their defaults first (real clients still fill them),
and queue and exchange names are not held to pamqp's name pattern (letters, digits,
``-_.:@#,/+`` and space, 127 characters at most). RabbitMQ takes any UTF-8 shortstr as a
name, up to 255 bytes, and so do we; the rules for names are the broker's, with RabbitMQ's
reply codes (``topology.py``).

A handler reports a client's error by raising :class:`~cpgbroker.errors.AMQPError`; the
connection protocol turns it into a close at exactly one place (``connection.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from pamqp import commands
from pamqp.exceptions import PAMQPException

from cpgbroker.errors import AMQPError, ChannelError, ConnectionError_, ReplyCode
from cpgbroker.model import entities as E
from cpgbroker.model.changes import Recording
from cpgbroker.model.entities import Channel, Connection
from cpgbroker.model.messages.confirms import Confirms
from cpgbroker.model.messages.consumers import Consumers
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.messages.transactions import Transactions
from cpgbroker.model.output import Output
from cpgbroker.model.resources.limits import check_channel_open
from cpgbroker.model.routing.topology import Topology
from cpgbroker.wire.fastpath import cannot_decode, malformed_utf8
from cpgbroker.wire.tables import TableError, TableLimitError, check_fields

R = ReplyCode

CONNECTION_CLASS = 10

Handler = Callable[[Connection, Channel, Any], None]

_RESERVED_FIELDS = (
    ("ticket", 0),
    ("insist", False),
    ("capabilities", ""),
    ("known_hosts", ""),
    ("out_of_band", "0"),
    ("channel_id", "0"),
)

# Arguments that name a queue or an exchange. pamqp's validate() holds them to a pattern
# stricter than RabbitMQ (no '=', no non-ASCII, at most 127 characters); the broker does not.
NAME_FIELDS = ("exchange", "queue", "destination", "source")
_names_by_class: dict[type, tuple[str, ...]] = {}


def method_name(index: int) -> str:
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        return f"method {index >> 16}.{index & 0xFFFF}"
    return str(getattr(cls, "name", cls.__name__)).lower()


def _name_fields(cls: type) -> tuple[str, ...]:
    names = _names_by_class.get(cls)
    if names is None:
        slots = getattr(cls, "__slots__", ())
        names = _names_by_class[cls] = tuple(f for f in NAME_FIELDS if f in slots)
    return names


# What pamqp raises on bytes it cannot decode.
_DECODE_ERRORS = (
    PAMQPException,
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    OverflowError,
    struct.error,
)


def decode_method(payload: bytes, index: int, unchecked: tuple[str, ...] = ()) -> Any:
    """A method frame's payload decoded by pamqp and validated (see module docstring):
    arguments that do not decode are 501 FRAME_ERROR, tables over our limits 502 SYNTAX_ERROR,
    an unknown method 540 NOT_IMPLEMENTED. ``unchecked`` names more arguments than the queue
    and exchange names that pamqp's ``validate()`` does not see (connection.open's
    virtual host from model version 8: model/clients/connection.py)."""
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        raise ConnectionError_(
            R.NOT_IMPLEMENTED,
            f"unknown method class {index >> 16} method {index & 0xFFFF}",
            class_id=index >> 16,
            method_id=index & 0xFFFF,
        )
    try:
        # pamqp decodes tables recursively and trusts lengths: walk the arguments first.
        end = check_fields(_arg_types(cls), payload, 4)
    except TableLimitError as e:
        raise _syntax_error(index, e) from None
    except TableError:
        raise cannot_decode(payload) from None
    if end != len(payload):
        raise cannot_decode(payload)
    method = cls()
    try:
        method.unmarshal(payload[4:])
    except UnicodeDecodeError:
        raise malformed_utf8(payload) from None
    except _DECODE_ERRORS:
        # Not expected once the walk above accepted the arguments (a timestamp pamqp cannot
        # turn into a datetime would be one): still bytes that do not decode.
        raise cannot_decode(payload) from None
    try:
        # 0-9-1 turned these 0-8 fields into reserved ones the server must ignore, and
        # real clients still fill them (pika sends insist=True); pamqp's validate()
        # insists on the defaults, so reset them before validating the rest.
        for name, default in _RESERVED_FIELDS:
            if hasattr(method, name):
                setattr(method, name, default)
        names = _name_fields(cls) + unchecked
        if names:
            # Validate everything but the names (an empty name passes pamqp's pattern), then
            # put the client's names back.
            given = [getattr(method, f) for f in names]
            for f in names:
                setattr(method, f, "")
            method.validate()
            for f, v in zip(names, given, strict=True):
                setattr(method, f, v)
        else:
            method.validate()
    except (PAMQPException, ValueError, TypeError) as e:
        # Decoded, but outside what pamqp allows (a virtual host of more than 127 characters).
        raise _syntax_error(index, e) from None
    if index in _BINDS:
        # The arguments' bytes (the last field), for the headers exchange from model version 8
        # (model/routing/exchange.py reads them with our codec, as RabbitMQ does).
        p = 6  # class, method, reserved short
        for _ in range(3):  # queue or destination, exchange or source, routing key
            p += 1 + payload[p]
        method.raw_arguments = payload[p + 1 :]
    if index in _BINDS and isinstance(method.arguments.get("x-match"), bytes):
        # A long string that is not UTF-8 (pamqp gives bytes): the headers exchange could not
        # read it when routing. RabbitMQ refuses x-match values it does not know with 406.
        raise ChannelError(
            R.PRECONDITION_FAILED,
            "invalid x-match field value",
            class_id=index >> 16,
            method_id=index & 0xFFFF,
        )
    return method


def _syntax_error(index: int, e: Exception) -> ConnectionError_:
    return ConnectionError_(
        R.SYNTAX_ERROR,
        f"malformed {method_name(index)} arguments: {e}",
        class_id=index >> 16,
        method_id=index & 0xFFFF,
    )


def _arg_types(cls: type) -> tuple[str, ...]:
    """The AMQP types of ``cls``'s arguments, in order (pamqp's names)."""
    try:
        return _arg_types_by_class[cls]
    except KeyError:
        pass
    slots = getattr(cls, "__slots__", ())
    types = _arg_types_by_class[cls] = tuple(str(getattr(cls, "_" + name)) for name in slots)
    return types


_arg_types_by_class: dict[type, tuple[str, ...]] = {}
_BINDS = frozenset({commands.Queue.Bind.index, commands.Exchange.Bind.index})


class Channels:
    __slots__ = (
        "_changes",
        "_confirms",
        "_consumers",
        "_delivery",
        "_handlers",
        "_limits",
        "_out",
    )

    def __init__(
        self,
        out: Output,
        topology: Topology,
        delivery: Delivery,
        consumers: Consumers,
        confirms: Confirms,
        transactions: Transactions,
        changes: Recording,
    ) -> None:
        self._out = out
        # Where a hot-standby primary's change log is (model/changes.py): told of methods
        # that may change the definitions (``_STRUCTURAL``).
        self._changes = changes
        self._delivery = delivery
        self._consumers = consumers
        self._confirms = confirms
        self._limits = topology.limits
        C = commands
        # Methods a client may send on a channel, by index, and who handles them.
        self._handlers: dict[int, Handler] = {
            C.Channel.Open.index: self._ch_open,
            C.Channel.Close.index: self._ch_close,
            C.Channel.CloseOk.index: self._ch_close_ok,
            C.Channel.Flow.index: self._ch_flow,
            C.Channel.FlowOk.index: self._ch_flow_ok,
            C.Exchange.Declare.index: topology.ex_declare,
            C.Exchange.Delete.index: topology.ex_delete,
            C.Exchange.Bind.index: topology.ex_bind,
            C.Exchange.Unbind.index: topology.ex_unbind,
            C.Queue.Declare.index: topology.q_declare,
            C.Queue.Bind.index: topology.q_bind,
            C.Queue.Unbind.index: topology.q_unbind,
            C.Queue.Purge.index: topology.q_purge,
            C.Queue.Delete.index: topology.q_delete,
            C.Basic.Qos.index: consumers.b_qos,
            C.Basic.Consume.index: consumers.b_consume,
            C.Basic.Cancel.index: consumers.b_cancel,
            C.Basic.Publish.index: delivery.basic_publish,
            C.Basic.Get.index: consumers.b_get,
            C.Basic.Ack.index: consumers.b_ack_method,
            C.Basic.Reject.index: consumers.b_reject,
            C.Basic.Nack.index: consumers.b_nack,
            C.Basic.RecoverAsync.index: consumers.b_recover,
            C.Basic.Recover.index: consumers.b_recover,
            C.Tx.Select.index: transactions.tx_select,
            C.Tx.Commit.index: transactions.tx_commit,
            C.Tx.Rollback.index: transactions.tx_rollback,
            C.Confirm.Select.index: confirms.confirm_select,
        }

    def channel_method(self, conn: Connection, ch: int, index: int, payload: bytes) -> None:
        """A method on channel ``ch`` (not 0) of an open connection."""
        channel = conn.channels.get(ch)
        cls_id = index >> 16
        # The checks come in RabbitMQ's order: an unopened channel first (504 even for a
        # connection-class method), then a closing one, then content expected (505).
        if channel is None:
            if index != commands.Channel.Open.index:
                raise ConnectionError_(
                    R.CHANNEL_ERROR,
                    f"expected 'channel.open' on channel {ch}, got {method_name(index)}",
                    class_id=cls_id,
                    method_id=index & 0xFFFF,
                )
            if len(conn.channels) >= conn.channel_max:
                raise ConnectionError_(
                    R.NOT_ALLOWED,
                    f"number of channels opened ({len(conn.channels)}) has reached the "
                    f"negotiated channel_max ({conn.channel_max})",
                    class_id=cls_id,
                    method_id=index & 0xFFFF,
                )
            check_channel_open(self._limits, conn, cls_id, index & 0xFFFF)
            decode_method(payload, index)
            channel = Channel(ch, conn, prefetch_count=0)
            conn.channels[ch] = channel
            self._limits.channels_opened(conn)
            self._out.send_method(conn, ch, commands.Channel.OpenOk())
            return
        if channel.closing:
            if index == commands.Channel.CloseOk.index:
                del conn.channels[ch]
                self._limits.channels_closed(conn)
            elif index == commands.Channel.Close.index:
                self._out.send_method(conn, ch, commands.Channel.CloseOk())
                del conn.channels[ch]
                self._limits.channels_closed(conn)
            return
        if channel.pending is not None:
            raise ConnectionError_(
                R.UNEXPECTED_FRAME,
                f"expected content header for basic.publish on channel {ch}, "
                f"got {method_name(index)}",
                class_id=cls_id,
                method_id=index & 0xFFFF,
            )
        if cls_id == CONNECTION_CLASS:
            raise ConnectionError_(
                R.COMMAND_INVALID,
                f"{method_name(index)} is only allowed on channel 0",
                class_id=cls_id,
                method_id=index & 0xFFFF,
            )
        handler = self._handlers.get(index)
        if handler is None:
            if index in commands.INDEX_MAPPING:
                raise ConnectionError_(
                    R.COMMAND_INVALID if index not in _NOT_IMPLEMENTED else R.NOT_IMPLEMENTED,
                    f"{method_name(index)} is not allowed from a client"
                    if index not in _NOT_IMPLEMENTED
                    else f"{method_name(index)} is not implemented",
                    class_id=cls_id,
                    method_id=index & 0xFFFF,
                )
            decode_method(payload, index)  # raises 540 for unknown methods
            return
        if index in _FAST:
            handler(conn, channel, payload)
            return
        m = decode_method(payload, index)
        if index in _STRUCTURAL:
            self._changes.definitions_may_change()
        try:
            handler(conn, channel, m)
        except AMQPError as e:
            if not e.class_id:
                e.class_id = cls_id
                e.method_id = index & 0xFFFF
            raise

    def channel_error(self, conn: Connection, ch: int, e: AMQPError) -> None:
        """A channel exception: channel.close with its reply code; the channel keeps only
        reading close / close-ok."""
        channel = conn.channels.get(ch)
        if channel is None or channel.closing or conn.state != E.OPEN:
            return
        self.release_channel(channel)
        channel.closing = True
        self._out.send_method(
            conn,
            ch,
            commands.Channel.Close(
                reply_code=int(e.code),
                reply_text=e.reply_text,
                class_id=e.class_id,
                method_id=e.method_id,
            ),
        )

    def release_channel(self, ch: Channel) -> None:
        """Give back what ``ch`` holds: consumers cancelled, its publish in progress and
        transaction dropped, confirms it is owed sent, unacked deliveries requeued."""
        consumers = self._consumers
        # As in RabbitMQ, the consumer that takes over a single-active-consumer queue gets the
        # requeued messages before the rest: requeue first, then hand over.
        handover = consumers.remove_consumers(list(ch.consumers.values()))
        ch.consumers.clear()
        ch.pending = None
        ch.tx_ops.clear()
        self._confirms.release(ch)
        consumers.requeue_all(ch)
        for q in handover:
            if not q.deleted:
                self._delivery.dispatch(q)

    def _ch_open(self, conn: Connection, ch: Channel, m: Any) -> None:
        raise ConnectionError_(R.CHANNEL_ERROR, f"second 'channel.open' seen on channel {ch.id}")

    def _ch_close(self, conn: Connection, ch: Channel, m: Any) -> None:
        self.release_channel(ch)
        del conn.channels[ch.id]
        self._limits.channels_closed(conn)
        self._out.send_method(conn, ch.id, commands.Channel.CloseOk())

    def _ch_close_ok(self, conn: Connection, ch: Channel, m: Any) -> None:
        # close-ok for a close we never sent: ignore (harmless).
        return

    def _ch_flow(self, conn: Connection, ch: Channel, m: Any) -> None:
        ch.flow_active = bool(m.active)
        self._out.send_method(conn, ch.id, commands.Channel.FlowOk(active=ch.flow_active))
        # On: its consumers take messages again. Off: lower-priority consumers may no longer
        # have to wait for its consumers.
        self._delivery.dispatch_channel(ch)

    def _ch_flow_ok(self, conn: Connection, ch: Channel, m: Any) -> None:
        return


# Handlers that take the raw payload (struct-decoded fast paths) instead of a pamqp method.
_FAST = frozenset(
    {
        commands.Basic.Publish.index,
        commands.Basic.Ack.index,
        commands.Basic.Reject.index,
        commands.Basic.Nack.index,
    }
)
_NOT_IMPLEMENTED: frozenset[int] = frozenset()

# Methods that may change the definitions a hot-standby primary ships (model/changes.py);
# declaring a queue that ships and deleting any queue, whatever the cause, say so themselves
# (``ChangeLog.created``, ``ChangeLog.deleted``).
_STRUCTURAL = frozenset(
    {
        commands.Exchange.Declare.index,
        commands.Exchange.Delete.index,
        commands.Exchange.Bind.index,
        commands.Exchange.Unbind.index,
        commands.Queue.Bind.index,
        commands.Queue.Unbind.index,
        # A queue's first consumer marks it (``had_consumers``: auto-delete from then on).
        commands.Basic.Consume.index,
    }
)

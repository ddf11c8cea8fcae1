"""An AMQP 0-9-1 client on trio: how a member reaches another cluster's members (federation).

Theory of operation. Two parts, split as h11 splits them:

* :class:`ClientProtocol` is one connection's state without I/O. Fed the bytes that arrived
  (:meth:`~ClientProtocol.receive_data`), it cuts frames with the broker's own framer (which
  checks the negotiated frame_max before it buffers a payload), decodes them with pamqp,
  answers what needs no decision (the handshake, close-ok, flow-ok) and returns events: a
  delivery reassembled from its method, header and body frames, a publisher confirm expanded
  to the publish sequence numbers it covers, a channel or the connection closed by the broker.
  What the caller sends (methods; publishes cut at frame_max) is appended to one output buffer
  that :meth:`~ClientProtocol.data_to_send` empties. Any input either yields events or raises
  :class:`ProtocolError` (a :class:`ConnectionClosed`); nothing else escapes.
* :class:`AmqpClient` owns the socket and three tasks. The reader feeds the protocol and routes
  events to :class:`Channel` objects. The writer empties the output buffer: one ``send_all``
  for everything queued since its last write, so a burst of publishes leaves in a few system
  calls and a caller's cancellation never leaves half a frame on the wire. The heartbeat task
  sends a heartbeat after half an interval of our silence and declares the broker dead after
  two intervals of its silence.

Failures are reported through the calls, never into the caller's nursery: a connection closed
by the broker, a broken socket or missed heartbeats end every pending and later call (RPCs,
consumers' iterators, confirmations) with :class:`ConnectionClosed`, and
:meth:`AmqpClient.wait_closed` returns why. A federation link reconnects by catching that and
connecting again: :meth:`AmqpClient.connect` takes the remote cluster's URLs and tries them in
turn. The client itself keeps no topology to restore: the link declares again after a
reconnect, as it must anyway (the remote member it reaches next may be another one).
"""

from __future__ import annotations

import contextlib
import enum
import math
import ssl
import struct
import sys
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import attrs
import trio
from pamqp import base, commands
from pamqp import frame as pframe
from pamqp.exceptions import PAMQPException
from pamqp.header import ContentHeader

from cpgbroker.errors import ConfigError, CpgBrokerError, FrameError, ReplyCode
from cpgbroker.wire.framer import (
    FRAME_BODY,
    FRAME_END_BYTE,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    FRAME_MIN_SIZE,
    FRAME_OVERHEAD,
    HEARTBEAT_FRAME,
    PROTOCOL_HEADER,
    FrameReader,
)

# Our proposals in connection.tune-ok; a lower non-zero value from the broker wins. RabbitMQ's
# defaults, which are cpgbroker's too.
CHANNEL_MAX = 2047
FRAME_MAX = 131072
# One read: a full frame_max frame plus change, so a large delivery takes a couple of reads.
RECV_SIZE = 256 * 1024
# Output queued beyond this makes publishers (and every other sender) wait for the writer: when
# the broker reads slower than we publish, TCP backpressure reaches the caller instead of
# growing our buffer.
OUTPUT_HIGH_WATER = 512 * 1024
# How long close() waits for close-ok, and a closing connection for its last bytes to leave.
CLOSE_TIMEOUT = 3.0

# Decoding errors pamqp lets through on malformed input (struct and index errors on short
# input, UnicodeDecodeError, OverflowError/OSError from a timestamp datetime cannot hold): all
# become one ProtocolError at the decode boundary.
_DECODE_ERRORS = (
    PAMQPException,
    struct.error,
    ValueError,
    IndexError,
    KeyError,
    TypeError,
    OverflowError,
    OSError,
)
# A caller's values pamqp cannot encode (a table value of an unsupported type, a number out of
# range): reported as AmqpClientError before anything is queued.
_ENCODE_ERRORS = (PAMQPException, struct.error, ValueError, TypeError, OverflowError)
_BODY_HEAD = struct.Struct(">BHI")
_EMPTY_PROPERTIES = commands.Basic.Properties()

# What we tell the broker we understand (RabbitMQ's capability names). Without
# authentication_failure_close a refused login is a bare socket close, not a 403.
CLIENT_CAPABILITIES = {
    "publisher_confirms": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "basic.nack": True,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
}


# ---------------------------------------------------------------------------------- errors


class AmqpClientError(CpgBrokerError):
    """Root of the client's errors (a caller's misuse, or the broker's answer)."""


class ConnectionClosed(AmqpClientError):
    """The connection is gone: closed by the broker (its reply code and text), by us, or the
    socket broke or went silent (reply code 0)."""

    def __init__(self, reply_code: int, reply_text: str) -> None:
        super().__init__(reply_code, reply_text)
        self.reply_code = reply_code
        self.reply_text = reply_text

    def __str__(self) -> str:
        return f"{self.reply_code} {self.reply_text}"


class ProtocolError(ConnectionClosed):
    """The broker broke the protocol; we closed the connection with this reply code."""


class ChannelClosed(AmqpClientError):
    """The broker closed the channel (its reply code and text); the connection stays open."""

    def __init__(self, reply_code: int, reply_text: str, class_id: int = 0, method_id: int = 0):
        super().__init__(reply_code, reply_text, class_id, method_id)
        self.reply_code = reply_code
        self.reply_text = reply_text
        self.class_id = class_id
        self.method_id = method_id

    def __str__(self) -> str:
        return f"{self.reply_code} {self.reply_text}"


class ConsumerCancelled(AmqpClientError):
    """The broker cancelled the consumer (its queue was deleted, or the member it lived on
    went away): basic.cancel from the server."""

    def __init__(self, consumer_tag: str) -> None:
        super().__init__(consumer_tag)
        self.consumer_tag = consumer_tag


class UrlError(AmqpClientError, ConfigError):
    """An AMQP URL that does not parse: a client error to a link's retry loop, a
    configuration error to whoever validates configuration."""


def _fresh(e: AmqpClientError) -> AmqpClientError:
    """A new instance to raise: one stored reason is raised in many tasks, and raising one
    object again and again would chain all their tracebacks onto it."""
    return type(e)(*e.args)


# ---------------------------------------------------------------------------------- URLs


@attrs.frozen
class AmqpUrl:
    """``amqp[s]://user:password@host:port/vhost``, decoded (RabbitMQ's URI spec: user,
    password and vhost are percent-encoded; a vhost "/" is ``%2F``; no path means "/")."""

    host: str
    port: int
    username: str
    password: str = attrs.field(repr=False)
    vhost: str
    tls: bool

    @classmethod
    def parse(cls, url: str) -> AmqpUrl:
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise UrlError(f"bad AMQP URL: {e}") from None
        if parts.scheme not in ("amqp", "amqps"):
            raise UrlError(f"an AMQP URL starts amqp:// or amqps://, not {parts.scheme!r}://")
        path = parts.path[1:]
        if "/" in path:
            raise UrlError("an AMQP URL's vhost is one path segment (write '/' as %2F)")
        tls = parts.scheme == "amqps"
        unquote = urllib.parse.unquote
        return cls(
            host=parts.hostname or "localhost",
            port=port or (5671 if tls else 5672),
            username="guest" if parts.username is None else unquote(parts.username),
            password="guest" if parts.password is None else unquote(parts.password),
            vhost=unquote(path) if path else "/",
            tls=tls,
        )

    def __str__(self) -> str:
        # Never the password: this goes into logs and error messages.
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = urllib.parse.quote(self.username, safe="")
        vhost = urllib.parse.quote(self.vhost, safe="")
        return f"amqp{'s' if self.tls else ''}://{user}@{host}:{self.port}/{vhost}"


# ---------------------------------------------------------------------------------- events


@attrs.frozen
class ConnectionOpened:
    server_properties: dict[str, Any]
    channel_max: int
    frame_max: int
    heartbeat: int


@attrs.frozen
class ConnectionCloseReceived:
    """The broker closed the connection; close-ok is queued."""

    reply_code: int
    reply_text: str
    class_id: int
    method_id: int


@attrs.frozen
class ConnectionCloseOk:
    """The answer to our connection.close."""


@attrs.frozen
class ConnectionBlocked:
    reason: str


@attrs.frozen
class ConnectionUnblocked:
    pass


@attrs.frozen
class ChannelCloseReceived:
    """The broker closed a channel; close-ok is queued."""

    channel: int
    reply_code: int
    reply_text: str
    class_id: int
    method_id: int


@attrs.frozen
class CancelReceived:
    """The broker cancelled a consumer (basic.cancel from the server)."""

    channel: int
    consumer_tag: str


@attrs.define(eq=False)
class MethodReceived:
    """A method that answers one of ours (declare-ok, consume-ok, close-ok, ...)."""

    channel: int
    method: base.Frame


@attrs.define(eq=False)
class Delivery:
    """One message from a consumer (basic.deliver with its header and body reassembled)."""

    channel: int
    consumer_tag: str
    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str
    properties: commands.Basic.Properties
    body: bytes


@attrs.define(eq=False)
class Returned:
    """A mandatory publish that no queue took (basic.return with its content)."""

    channel: int
    reply_code: int
    reply_text: str
    exchange: str
    routing_key: str
    properties: commands.Basic.Properties
    body: bytes


@attrs.define(eq=False)
class Confirmed:
    """Publisher confirms: ``sequences`` are the publishes (numbered from 1 per channel after
    confirm.select) that ``ack`` (True) or nack (False) covers, ``multiple`` expanded."""

    channel: int
    sequences: list[int]
    ack: bool


Event = (
    ConnectionOpened
    | ConnectionCloseReceived
    | ConnectionCloseOk
    | ConnectionBlocked
    | ConnectionUnblocked
    | ChannelCloseReceived
    | CancelReceived
    | MethodReceived
    | Delivery
    | Returned
    | Confirmed
)


# ---------------------------------------------------------------------------------- protocol


class State(enum.IntEnum):
    AWAIT_START = 0
    AWAIT_TUNE = 1
    AWAIT_OPEN_OK = 2
    OPEN = 3
    CLOSING = 4  # we sent connection.close
    CLOSED = 5


class PublishSequence:
    """Publisher-confirm bookkeeping of one channel: which publishes await their confirm.

    Sequence numbers are dense from 1, so the unconfirmed ones are ``[low, next)`` minus the
    few confirmed out of order (``early``); a ``multiple`` confirm moves ``low`` in one step.
    """

    __slots__ = ("early", "low", "next")

    def __init__(self) -> None:
        self.next = 1
        self.low = 1
        self.early: set[int] = set()

    @property
    def outstanding(self) -> int:
        return self.next - self.low - len(self.early)

    def publish(self) -> int:
        seq = self.next
        self.next = seq + 1
        return seq

    def confirm(self, tag: int, multiple: bool) -> list[int]:
        """The sequences a confirm of ``tag`` covers (none for a tag confirmed already)."""
        low = self.low
        if tag < low or tag >= self.next:
            return []
        early = self.early
        if multiple:
            self.low = tag + 1
            if not early:
                return list(range(low, tag + 1))
            done = [s for s in range(low, tag + 1) if s not in early]
            self.early = {s for s in early if s > tag}
            return done
        if tag in early:
            return []
        if tag == low:
            low += 1
            while low in early:
                early.discard(low)
                low += 1
            self.low = low
        else:
            early.add(tag)
        return [tag]


class _ChannelState:
    """What the protocol keeps per channel: closing, confirms, the content being reassembled."""

    __slots__ = ("body", "closing", "confirms", "content", "properties", "received", "size")

    def __init__(self) -> None:
        self.closing = False
        self.confirms: PublishSequence | None = None
        # The basic.deliver/basic.return whose content is arriving, its header, and its body.
        self.content: commands.Basic.Deliver | commands.Basic.Return | None = None
        self.properties: commands.Basic.Properties | None = None
        self.size = 0
        self.received = 0
        self.body: list[bytes] = []


def _protocol_error(code: ReplyCode, text: str) -> ProtocolError:
    return ProtocolError(int(code), f"{code.name} - {text}")


def _negotiate(ours: int, theirs: int) -> int:
    # The spec's rule (and RabbitMQ's clients'): 0 means "no limit", else the lower wins.
    return max(ours, theirs) if ours == 0 or theirs == 0 else min(ours, theirs)


class ClientProtocol:
    """The client side of one AMQP 0-9-1 connection, without I/O (module docstring).

    Owns the handshake's progress, the negotiated limits, the channel numbers in use, each
    channel's confirm sequence and partial content, and the output not yet written. Never
    touches a socket or a clock: heartbeats are sent when the caller says so.
    """

    def __init__(
        self,
        *,
        username: str,
        password: str,
        virtual_host: str = "/",
        heartbeat: int = 60,
        client_properties: dict[str, Any] | None = None,
        channel_max: int = CHANNEL_MAX,
        frame_max: int = FRAME_MAX,
    ) -> None:
        self.state = State.AWAIT_START
        self.server_properties: dict[str, Any] = {}
        self.channel_max = channel_max
        self.frame_max = frame_max
        self.heartbeat = heartbeat
        self._username = username
        self._password = password
        self._vhost = virtual_host
        self._client_properties = client_properties or {}
        self._out = bytearray()
        # Until tune, frames up to our own proposal are accepted (connection.start carries the
        # broker's properties, which may pass the spec's 4096-byte floor).
        self._reader = FrameReader(frame_max)
        self._channels: dict[int, _ChannelState] = {}

    # -- output

    def initiate(self) -> None:
        self._out += PROTOCOL_HEADER

    def data_to_send(self) -> bytearray:
        """Everything queued since the last call (handed over, not copied)."""
        out = self._out
        self._out = bytearray()
        return out

    @property
    def pending_output(self) -> int:
        return len(self._out)

    def send_heartbeat(self) -> None:
        self._out += HEARTBEAT_FRAME

    def open_channel(self) -> int:
        """Allocate the lowest free channel number and queue channel.open on it."""
        self._require_open()
        for number in range(1, self.channel_max + 1):
            if number not in self._channels:
                self._channels[number] = _ChannelState()
                self._emit(number, commands.Channel.Open())
                return number
        raise AmqpClientError(f"all {self.channel_max} channels are in use")

    def send_method(self, channel: int, method: base.Frame) -> None:
        """Queue a method on an open channel (channel.close marks it closing, confirm.select
        starts its publish sequence)."""
        self._require_open()
        st = self._channels.get(channel)
        if st is None or st.closing:
            raise AmqpClientError(f"channel {channel} is not open")
        if isinstance(method, commands.Channel.Close):
            st.closing = True
            st.content = st.properties = None  # what is left of it will be discarded
            st.body = []
        elif isinstance(method, commands.Confirm.Select) and st.confirms is None:
            st.confirms = PublishSequence()
        self._emit(channel, method)

    def send_publish(
        self,
        channel: int,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: commands.Basic.Properties | None = None,
        mandatory: bool = False,
    ) -> int:
        """Queue basic.publish with its content, the body cut at frame_max. Returns the
        publish's confirm sequence number, 0 when the channel is not in confirm mode."""
        self._require_open()
        st = self._channels.get(channel)
        if st is None or st.closing:
            raise AmqpClientError(f"channel {channel} is not open")
        try:
            # Both encoded before anything is queued: a bad name or header value must not
            # leave half a publish in the output.
            head = pframe.marshal(
                commands.Basic.Publish(
                    exchange=exchange, routing_key=routing_key, mandatory=mandatory
                ),
                channel,
            ) + pframe.marshal(
                ContentHeader(0, len(body), properties or _EMPTY_PROPERTIES), channel
            )
        except _ENCODE_ERRORS as e:
            raise AmqpClientError(f"cannot encode the publish: {e}") from None
        out = self._out
        out += head
        step = self.frame_max - FRAME_OVERHEAD
        size = len(body)
        for start in range(0, size, step):
            chunk = body[start : start + step]
            out += _BODY_HEAD.pack(FRAME_BODY, channel, len(chunk))
            out += chunk
            out += FRAME_END_BYTE
        return 0 if st.confirms is None else st.confirms.publish()

    def close(self, reply_code: int = 200, reply_text: str = "") -> None:
        """Queue connection.close (once open; before that there is nothing to close)."""
        if self.state == State.OPEN:
            self._emit(0, commands.Connection.Close(reply_code, reply_text, 0, 0))
            self.state = State.CLOSING
        elif self.state < State.OPEN:
            self.state = State.CLOSED

    def confirm_window(self, channel: int) -> tuple[int, int]:
        """``(low, next)``: publishes below ``low`` are all confirmed, ``next`` is the number
        the next publish gets. ``(1, 1)`` for a channel not in confirm mode."""
        st = self._channels.get(channel)
        if st is None or st.confirms is None:
            return 1, 1
        return st.confirms.low, st.confirms.next

    def _emit(self, channel: int, method: base.Frame) -> None:
        try:
            frame = pframe.marshal(method, channel)
        except _ENCODE_ERRORS as e:
            raise AmqpClientError(f"cannot encode {method.name}: {e}") from None
        self._out += frame

    def _require_open(self) -> None:
        if self.state != State.OPEN:
            raise AmqpClientError(f"the connection is not open ({self.state.name})")

    # -- input

    def receive_data(self, data: bytes | bytearray) -> list[Event]:
        """Feed bytes from the broker; returns the events they complete (none once closed).
        Raises :class:`ProtocolError` (having queued connection.close) if the broker broke
        the protocol; the connection is then done."""
        events: list[Event] = []
        if self.closed:
            return events
        reader = self._reader
        reader.feed(data if isinstance(data, bytes) else bytes(data))
        try:
            while not self.closed:
                frame = reader.next_frame()
                if frame is None:
                    break
                frame_type, channel, payload = frame
                if channel == 0:
                    self._connection_frame(frame_type, payload, events)
                else:
                    self._channel_frame(frame_type, channel, payload, events)
        except FrameError as e:
            error = _protocol_error(e.code, e.text)
            self.abort(error)
            raise error from None
        except ProtocolError as e:
            self.abort(e)
            raise
        return events

    @property
    def closed(self) -> bool:
        """Done: closed by either side, or aborted. Input is ignored from now on."""
        return self.state == State.CLOSED

    def abort(self, e: ProtocolError) -> None:
        """The broker broke the protocol: queue connection.close with ``e``'s reply code (no
        close-ok is awaited; the caller closes the socket once this is out)."""
        if self.state < State.CLOSING:
            text = e.reply_text.encode()[:255].decode(errors="ignore")
            self._emit(0, commands.Connection.Close(e.reply_code, text, 0, 0))
        self.state = State.CLOSED

    def _decode(self, payload: bytes) -> base.Frame:
        if len(payload) < 4:
            raise _protocol_error(ReplyCode.FRAME_ERROR, "method frame shorter than its ids")
        index = int.from_bytes(payload[:4], "big")
        cls = commands.INDEX_MAPPING.get(index)
        if cls is None:
            raise _protocol_error(ReplyCode.COMMAND_INVALID, f"unknown method {index:#010x}")
        method: base.Frame = cls()
        try:
            method.unmarshal(payload[4:])
        except _DECODE_ERRORS as e:
            raise _protocol_error(ReplyCode.FRAME_ERROR, f"cannot decode {method.name}: {e}") from e
        return method

    def _connection_frame(self, frame_type: int, payload: bytes, events: list[Event]) -> None:
        if frame_type == FRAME_HEARTBEAT:  # its arrival is all it says (the caller times reads)
            return
        if frame_type != FRAME_METHOD:
            raise _protocol_error(ReplyCode.UNEXPECTED_FRAME, "content frame on channel 0")
        m = self._decode(payload)
        state = self.state
        if isinstance(m, commands.Connection.Close):
            self._emit(0, commands.Connection.CloseOk())
            self.state = State.CLOSED
            events.append(
                ConnectionCloseReceived(
                    m.reply_code or 0, m.reply_text, m.class_id or 0, m.method_id or 0
                )
            )
        elif state == State.CLOSING:
            # Spec: after connection.close, everything but close(-ok) is discarded.
            if isinstance(m, commands.Connection.CloseOk):
                self.state = State.CLOSED
                events.append(ConnectionCloseOk())
        elif state == State.AWAIT_START and isinstance(m, commands.Connection.Start):
            self._start(m)
        elif state == State.AWAIT_TUNE and isinstance(m, commands.Connection.Tune):
            self._tune(m)
        elif state == State.AWAIT_OPEN_OK and isinstance(m, commands.Connection.OpenOk):
            self.state = State.OPEN
            events.append(
                ConnectionOpened(
                    self.server_properties, self.channel_max, self.frame_max, self.heartbeat
                )
            )
        elif state == State.OPEN and isinstance(m, commands.Connection.Blocked):
            events.append(ConnectionBlocked(m.reason))
        elif state == State.OPEN and isinstance(m, commands.Connection.Unblocked):
            events.append(ConnectionUnblocked())
        else:
            raise _protocol_error(
                ReplyCode.COMMAND_INVALID, f"unexpected {m.name} in state {state.name}"
            )

    def _start(self, m: commands.Connection.Start) -> None:
        if (m.version_major, m.version_minor) != (0, 9):
            raise _protocol_error(
                ReplyCode.NOT_IMPLEMENTED,
                f"broker speaks AMQP {m.version_major}-{m.version_minor}, not 0-9-1",
            )
        mechanisms = str(m.mechanisms).split()
        if "PLAIN" not in mechanisms:
            raise _protocol_error(
                ReplyCode.NOT_IMPLEMENTED, f"broker offers no PLAIN login ({mechanisms})"
            )
        self.server_properties = dict(m.server_properties or {})
        self._emit(
            0,
            commands.Connection.StartOk(
                client_properties=self._client_properties,
                mechanism="PLAIN",
                response=f"\0{self._username}\0{self._password}",
                locale="en_US",
            ),
        )
        self.state = State.AWAIT_TUNE

    def _tune(self, m: commands.Connection.Tune) -> None:
        self.channel_max = _negotiate(self.channel_max, m.channel_max) or 65535
        self.frame_max = max(_negotiate(self.frame_max, m.frame_max), FRAME_MIN_SIZE)
        self.heartbeat = _negotiate(self.heartbeat, m.heartbeat)
        self._reader.frame_max = self.frame_max
        self._emit(
            0,
            commands.Connection.TuneOk(
                channel_max=self.channel_max, frame_max=self.frame_max, heartbeat=self.heartbeat
            ),
        )
        self._emit(0, commands.Connection.Open(virtual_host=self._vhost))
        self.state = State.AWAIT_OPEN_OK

    def _channel_frame(
        self, frame_type: int, channel: int, payload: bytes, events: list[Event]
    ) -> None:
        if self.state != State.OPEN:
            if self.state == State.CLOSING:
                return  # discarded after connection.close (spec)
            raise _protocol_error(
                ReplyCode.CHANNEL_ERROR, f"frame on channel {channel} before open"
            )
        st = self._channels.get(channel)
        if st is None:
            raise _protocol_error(ReplyCode.CHANNEL_ERROR, f"frame on unopened channel {channel}")
        if st.closing:
            # Spec: a closing channel discards everything but close and close-ok (content
            # frames of a delivery sent before our close included).
            if frame_type == FRAME_METHOD:
                self._closing_method(channel, self._decode(payload), events)
        elif frame_type == FRAME_METHOD:
            if st.content is not None:
                raise _protocol_error(
                    ReplyCode.UNEXPECTED_FRAME, f"method frame inside content on channel {channel}"
                )
            self._channel_method(channel, st, self._decode(payload), events)
        elif frame_type == FRAME_HEADER:
            self._content_header(channel, st, payload, events)
        elif frame_type == FRAME_BODY:
            if st.content is None or st.properties is None:
                raise _protocol_error(
                    ReplyCode.UNEXPECTED_FRAME, f"body frame without a header on channel {channel}"
                )
            st.body.append(payload)
            st.received += len(payload)
            if st.received >= st.size:
                self._content_done(channel, st, events)
        else:
            raise _protocol_error(ReplyCode.FRAME_ERROR, f"heartbeat on channel {channel}")

    def _channel_method(
        self, channel: int, st: _ChannelState, m: base.Frame, events: list[Event]
    ) -> None:
        if isinstance(m, (commands.Basic.Deliver, commands.Basic.Return)):
            st.content = m
        elif isinstance(m, (commands.Basic.Ack, commands.Basic.Nack)):
            if st.confirms is None:
                raise _protocol_error(
                    ReplyCode.COMMAND_INVALID, f"{m.name} on channel {channel} not in confirm mode"
                )
            covered = st.confirms.confirm(m.delivery_tag, m.multiple)
            if covered:
                events.append(Confirmed(channel, covered, isinstance(m, commands.Basic.Ack)))
        elif isinstance(m, commands.Channel.Close):
            self._emit(channel, commands.Channel.CloseOk())
            del self._channels[channel]
            events.append(_channel_close(channel, m))
        elif isinstance(m, commands.Basic.Cancel):
            # Never answered, whatever its nowait says: RabbitMQ sets nowait, cpgbroker does
            # not, and both refuse a cancel-ok from a client (503), as the Java client and
            # pika know.
            events.append(CancelReceived(channel, str(m.consumer_tag)))
        elif isinstance(m, commands.Channel.Flow):
            # RabbitMQ no longer sends it; answered so that a broker that does is not left
            # waiting (we never stop publishing for it: connection.blocked is what we obey).
            self._emit(channel, commands.Channel.FlowOk(active=bool(m.active)))
        else:
            events.append(MethodReceived(channel, m))

    def _closing_method(self, channel: int, m: base.Frame, events: list[Event]) -> None:
        if isinstance(m, commands.Channel.CloseOk):
            del self._channels[channel]
            events.append(MethodReceived(channel, m))
        elif isinstance(m, commands.Channel.Close):
            # Both sides closed at once: answer, and keep the number until our close-ok
            # comes, so that it cannot be taken for the answer to a new channel.open.
            self._emit(channel, commands.Channel.CloseOk())
            events.append(_channel_close(channel, m))

    def _content_header(
        self, channel: int, st: _ChannelState, payload: bytes, events: list[Event]
    ) -> None:
        if st.content is None or st.properties is not None:
            raise _protocol_error(
                ReplyCode.UNEXPECTED_FRAME, f"unexpected content header on channel {channel}"
            )
        header = ContentHeader()
        try:
            header.unmarshal(payload)
        except _DECODE_ERRORS as e:
            raise _protocol_error(
                ReplyCode.FRAME_ERROR, f"cannot decode content header: {e}"
            ) from e
        st.properties = header.properties
        st.size = header.body_size
        st.received = 0
        if st.size == 0:
            self._content_done(channel, st, events)

    def _content_done(self, channel: int, st: _ChannelState, events: list[Event]) -> None:
        if st.received > st.size:
            raise _protocol_error(
                ReplyCode.FRAME_ERROR,
                f"body of {st.received} bytes on channel {channel}, header said {st.size}",
            )
        parts = st.body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        m = st.content
        props = st.properties
        assert props is not None
        st.content = st.properties = None
        st.body = []
        if isinstance(m, commands.Basic.Deliver):
            events.append(
                Delivery(
                    channel,
                    m.consumer_tag or "",
                    m.delivery_tag or 0,
                    m.redelivered,
                    m.exchange,
                    m.routing_key or "",
                    props,
                    body,
                )
            )
        elif isinstance(m, commands.Basic.Return):
            events.append(
                Returned(
                    channel,
                    m.reply_code or 0,
                    m.reply_text,
                    m.exchange,
                    m.routing_key or "",
                    props,
                    body,
                )
            )


def _channel_close(channel: int, m: commands.Channel.Close) -> ChannelCloseReceived:
    return ChannelCloseReceived(
        channel, m.reply_code or 0, m.reply_text, m.class_id or 0, m.method_id or 0
    )


# ---------------------------------------------------------------------------------- trio


class Confirmation:
    """The broker's verdict on one publish in confirm mode: :meth:`wait` returns True (ack)
    or False (nack), or raises if the channel or connection went first (the publish may or may
    not have been taken: publish it again)."""

    __slots__ = ("_error", "_event", "acked", "sequence")

    def __init__(self, sequence: int) -> None:
        self.sequence = sequence
        self.acked: bool | None = None
        self._error: AmqpClientError | None = None
        # Made only when someone waits: most publishes are waited for in bulk.
        self._event: trio.Event | None = None

    @property
    def done(self) -> bool:
        return self.acked is not None or self._error is not None

    async def wait(self) -> bool:
        if self.done:
            # A cancellation point, but no yield: a publisher keeping a window of confirms
            # yields (and lets the writer send its batch) only when it really waits.
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        if self._error is not None:
            raise _fresh(self._error)
        assert self.acked is not None
        return self.acked

    def _resolve(self, acked: bool) -> None:
        self.acked = acked
        if self._event is not None:
            self._event.set()

    def _fail(self, error: AmqpClientError) -> None:
        self._error = error
        if self._event is not None:
            self._event.set()


class Consumer:
    """One consumer's deliveries, in order: ``async for delivery in consumer`` or
    :meth:`receive`. The iteration ends after our own :meth:`Channel.cancel`; it raises
    :class:`ConsumerCancelled` when the broker cancels the consumer, and
    :class:`ChannelClosed`/:class:`ConnectionClosed` when its channel or connection goes.

    The buffer is unbounded so that one slow consumer never stops the reader (and with it the
    other channels and the heartbeat check); the channel's :meth:`Channel.basic_qos`
    prefetch is what bounds it, so consume with acks and a prefetch.
    """

    def __init__(self, channel: Channel, consumer_tag: str) -> None:
        self.channel = channel
        self.consumer_tag = consumer_tag
        self._send, self._recv = trio.open_memory_channel[Delivery | AmqpClientError](math.inf)
        self._error: AmqpClientError | None = None
        self._ended = False

    async def receive(self) -> Delivery:
        """The next delivery; :class:`trio.EndOfChannel` once cancelled by us."""
        if self._error is not None:
            raise _fresh(self._error)
        # What the reader queued is taken without yielding (a cancellation point still):
        # the consumer yields, and its acks go out in one write, once per batch read rather
        # than once per message.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            item = self._recv.receive_nowait()
        except trio.WouldBlock:
            item = await self._recv.receive()
        if isinstance(item, Delivery):
            return item
        self._error = item
        raise _fresh(item)

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Delivery:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def _put(self, delivery: Delivery) -> None:
        if not self._ended:
            self._send.send_nowait(delivery)

    def _end(self, error: AmqpClientError | None) -> None:
        if self._ended:
            return
        self._ended = True
        if error is not None:
            self._send.send_nowait(error)
        self._send.close()


class _Rpc:
    """One synchronous method awaiting its answer. The broker answers a channel's methods in
    the order they were sent, so a FIFO per channel matches answers to callers; a caller
    cancelled while waiting leaves its entry, which still absorbs its answer."""

    __slots__ = ("done", "error", "on_reply", "reply", "result")

    def __init__(
        self,
        reply: type[base.Frame] | tuple[type[base.Frame], ...],
        on_reply: Callable[[Any], None] | None,
    ) -> None:
        self.reply = reply
        self.on_reply = on_reply
        self.done = trio.Event()
        self.result: Any = None
        self.error: AmqpClientError | None = None


_F = TypeVar("_F", bound=base.Frame)


def _method(cls: type[_F], **fields: Any) -> _F:
    # pamqp validates on construction (name patterns, lengths): a caller's bad argument.
    try:
        return cls(**fields)
    except ValueError as e:
        raise AmqpClientError(f"{cls.name}: {e}") from None


class Channel:
    """One channel of an :class:`AmqpClient` (from :meth:`AmqpClient.channel`).

    Owns its pending synchronous calls, its consumers and its unconfirmed publishes; ends them
    all, with the reason, when the channel or the connection closes.
    """

    def __init__(self, client: AmqpClient, number: int) -> None:
        self.number = number
        # Mandatory publishes the broker returned (basic.return): counted, not delivered.
        self.returned = 0
        self._client = client
        self._rpcs: deque[_Rpc] = deque()
        self._consumers: dict[str, Consumer] = {}
        self._confirms: dict[int, Confirmation] = {}
        self._confirm_wakeup: trio.Event | None = None
        self._nacked = False
        self._error: AmqpClientError | None = None

    @property
    def is_open(self) -> bool:
        return self._error is None

    # -- synchronous methods

    async def exchange_declare(
        self,
        name: str,
        exchange_type: str = "direct",
        *,
        durable: bool = True,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
        passive: bool = False,
    ) -> None:
        method = _method(
            commands.Exchange.Declare,
            exchange=name,
            exchange_type=exchange_type,
            passive=passive,
            durable=durable,
            auto_delete=auto_delete,
            internal=internal,
            arguments=arguments,
        )
        await self._call(method, commands.Exchange.DeclareOk)

    async def queue_declare(
        self,
        name: str = "",
        *,
        durable: bool = True,
        exclusive: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        passive: bool = False,
    ) -> tuple[str, int, int]:
        """Returns the queue's name (the broker's choice for ``""``), its message count and
        its consumer count."""
        method = _method(
            commands.Queue.Declare,
            queue=name,
            passive=passive,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            arguments=arguments,
        )
        ok = await self._call(method, commands.Queue.DeclareOk)
        return str(ok.queue), int(ok.message_count or 0), int(ok.consumer_count or 0)

    async def queue_bind(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
    ) -> None:
        method = _method(
            commands.Queue.Bind,
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            arguments=arguments,
        )
        await self._call(method, commands.Queue.BindOk)

    async def queue_unbind(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
    ) -> None:
        method = _method(
            commands.Queue.Unbind,
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            arguments=arguments,
        )
        await self._call(method, commands.Queue.UnbindOk)

    async def queue_delete(
        self, queue: str, *, if_unused: bool = False, if_empty: bool = False
    ) -> int:
        """Returns how many messages the queue held."""
        method = _method(commands.Queue.Delete, queue=queue, if_unused=if_unused, if_empty=if_empty)
        ok = await self._call(method, commands.Queue.DeleteOk)
        return int(ok.message_count or 0)

    async def basic_qos(self, prefetch_count: int, *, global_: bool = False) -> None:
        method = _method(commands.Basic.Qos, prefetch_count=prefetch_count, global_=global_)
        await self._call(method, commands.Basic.QosOk)

    async def confirm_select(self) -> None:
        """Confirm mode: from now on :meth:`publish` returns a :class:`Confirmation`."""
        await self._call(commands.Confirm.Select(), commands.Confirm.SelectOk)

    async def consume(
        self,
        queue: str,
        *,
        no_ack: bool = False,
        consumer_tag: str = "",
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> Consumer:
        consumer = Consumer(self, consumer_tag)

        def registered(ok: commands.Basic.ConsumeOk) -> None:
            # Runs in the reader, before any delivery read after consume-ok is routed.
            consumer.consumer_tag = str(ok.consumer_tag)
            self._consumers[consumer.consumer_tag] = consumer

        method = _method(
            commands.Basic.Consume,
            queue=queue,
            consumer_tag=consumer_tag,
            no_ack=no_ack,
            exclusive=exclusive,
            arguments=arguments,
        )
        await self._call(method, commands.Basic.ConsumeOk, registered)
        return consumer

    async def cancel(self, consumer_tag: str) -> None:
        """Cancel a consumer: its iteration ends after the deliveries sent before cancel-ok."""

        def cancelled(_: commands.Basic.CancelOk) -> None:
            consumer = self._consumers.pop(consumer_tag, None)
            if consumer is not None:
                consumer._end(None)

        method = _method(commands.Basic.Cancel, consumer_tag=consumer_tag)
        await self._call(method, commands.Basic.CancelOk, cancelled)

    async def close(self) -> None:
        """Close the channel (a no-op when it is closed already): consumers' iterations end,
        unconfirmed publishes fail with :class:`ChannelClosed`."""
        if self._error is not None:
            return
        try:
            await self._call(commands.Channel.Close(200, "", 0, 0), commands.Channel.CloseOk)
        except AmqpClientError:
            return  # closed by the broker meanwhile, or the connection went: closed either way
        self._finish(ChannelClosed(200, "channel closed by the client"), quiet=True)

    # -- asynchronous methods

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: commands.Basic.Properties | None = None,
        *,
        mandatory: bool = False,
    ) -> Confirmation | None:
        """Publish a message (waiting while the broker blocks publishers, or our output is
        full). In confirm mode returns its :class:`Confirmation`; else None."""
        client = self._client
        await client._wait_to_publish()
        self._raise_if_closed()
        seq = client._proto.send_publish(
            self.number, exchange, routing_key, body, properties, mandatory
        )
        client._wake_writer()
        if seq == 0:
            return None
        confirmation = Confirmation(seq)
        self._confirms[seq] = confirmation
        return confirmation

    async def wait_for_confirms(self) -> bool:
        """Wait until every publish made so far on this channel is confirmed. False if any
        publish was nacked since the previous call (as the Java client's waitForConfirms)."""
        proto = self._client._proto
        target = proto.confirm_window(self.number)[1]
        waited = False
        while True:
            self._raise_if_closed()
            if proto.confirm_window(self.number)[0] >= target:
                break
            if self._confirm_wakeup is None:
                self._confirm_wakeup = trio.Event()
            await self._confirm_wakeup.wait()
            waited = True
        if not waited:
            await trio.lowlevel.checkpoint_if_cancelled()
        nacked, self._nacked = self._nacked, False
        return not nacked

    async def ack(self, delivery_tag: int, multiple: bool = False) -> None:
        await self._send(commands.Basic.Ack(delivery_tag=delivery_tag, multiple=multiple))

    async def nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        await self._send(
            commands.Basic.Nack(delivery_tag=delivery_tag, multiple=multiple, requeue=requeue)
        )

    # -- plumbing

    def _raise_if_closed(self) -> None:
        if self._error is not None:
            raise _fresh(self._error)

    async def _send(self, method: base.Frame) -> None:
        await self._client._wait_for_room()
        self._raise_if_closed()
        self._client._send(self.number, method)

    async def _call(
        self,
        method: base.Frame,
        reply: type[base.Frame] | tuple[type[base.Frame], ...],
        on_reply: Callable[[Any], None] | None = None,
    ) -> Any:
        await self._client._wait_for_room()
        self._raise_if_closed()
        rpc = self._expect(reply, on_reply)
        self._client._send(self.number, method)
        return await self._answer(rpc)

    def _expect(
        self,
        reply: type[base.Frame] | tuple[type[base.Frame], ...],
        on_reply: Callable[[Any], None] | None = None,
    ) -> _Rpc:
        rpc = _Rpc(reply, on_reply)
        self._rpcs.append(rpc)
        return rpc

    async def _answer(self, rpc: _Rpc) -> Any:
        await rpc.done.wait()
        if rpc.error is not None:
            raise _fresh(rpc.error)
        return rpc.result

    def _on_reply(self, method: base.Frame) -> None:
        if not self._rpcs:
            raise _protocol_error(
                ReplyCode.UNEXPECTED_FRAME, f"unsolicited {method.name} on channel {self.number}"
            )
        rpc = self._rpcs.popleft()
        if not isinstance(method, rpc.reply):
            raise _protocol_error(
                ReplyCode.UNEXPECTED_FRAME,
                f"{method.name} on channel {self.number} does not answer the method sent",
            )
        if rpc.on_reply is not None:
            rpc.on_reply(method)
        rpc.result = method
        rpc.done.set()

    def _deliver(self, delivery: Delivery) -> None:
        consumer = self._consumers.get(delivery.consumer_tag)
        if consumer is not None:
            consumer._put(delivery)

    def _on_confirmed(self, event: Confirmed) -> None:
        confirms = self._confirms
        ack = event.ack
        for seq in event.sequences:
            confirmation = confirms.pop(seq, None)
            if confirmation is not None:
                confirmation._resolve(ack)
        if not ack:
            self._nacked = True
        if self._confirm_wakeup is not None:
            self._confirm_wakeup.set()
            self._confirm_wakeup = None

    def _cancelled_by_broker(self, consumer_tag: str) -> None:
        consumer = self._consumers.pop(consumer_tag, None)
        if consumer is not None:
            consumer._end(ConsumerCancelled(consumer_tag))

    def _finish(self, error: AmqpClientError, *, quiet: bool = False) -> None:
        """The channel is closed: everything pending on it ends with ``error`` (consumers end
        quietly when we closed it)."""
        if self._error is not None:
            return
        self._error = error
        for rpc in self._rpcs:
            rpc.error = error
            rpc.done.set()
        self._rpcs.clear()
        for consumer in self._consumers.values():
            consumer._end(None if quiet else error)
        self._consumers.clear()
        for confirmation in self._confirms.values():
            confirmation._fail(error)
        self._confirms.clear()
        if self._confirm_wakeup is not None:
            self._confirm_wakeup.set()
            self._confirm_wakeup = None
        self._client._channels.pop(self.number, None)


# Refusals every member of a cluster gives alike (users, vhosts and permissions are
# replicated): trying the next URL would only be refused again.
_REFUSALS = frozenset({int(ReplyCode.ACCESS_REFUSED), int(ReplyCode.NOT_ALLOWED)})


class AmqpClient:
    """One AMQP 0-9-1 connection to a broker (module docstring)::

        async with await AmqpClient.connect(urls) as client:
            channel = await client.channel()
            ...

    :meth:`connect` opens it; ``async with`` runs its tasks (in a nursery of its own) and
    closes it on the way out, letting the body's exceptions out as they are (not in an
    ExceptionGroup). A caller with a nursery may pass it to :meth:`connect` instead.

    Owns the socket, the protocol state, its channels and the blocked flag; reports its end
    through its calls and :meth:`wait_closed`, never by raising into the nursery.
    """

    def __init__(self, stream: trio.abc.Stream, proto: ClientProtocol, url: AmqpUrl) -> None:
        self.url = url
        # The broker's connection.blocked reason while it blocks publishers, else None.
        self.blocked_reason: str | None = None
        self._stream = stream
        self._proto = proto
        self._channels: dict[int, Channel] = {}
        # Why the connection ended (or is ending): the first reason recorded wins, so a socket
        # closed after connection.close does not hide the broker's reply code.
        self._reason: ConnectionClosed | None = None
        self._torn_down = False
        self._started = False
        self._lifetime: contextlib.AbstractAsyncContextManager[AmqpClient] | None = None
        self._closed = trio.Event()
        self._close_ok = trio.Event()
        self._unblocked = trio.Event()
        self._unblocked.set()
        self._writer_lot = trio.lowlevel.ParkingLot()
        self._room_lot = trio.lowlevel.ParkingLot()
        self._scope = trio.CancelScope()
        self._last_sent = self._last_received = trio.current_time()

    @property
    def server_properties(self) -> dict[str, Any]:
        return self._proto.server_properties

    @property
    def heartbeat(self) -> int:
        return self._proto.heartbeat

    @property
    def frame_max(self) -> int:
        return self._proto.frame_max

    @property
    def channel_max(self) -> int:
        return self._proto.channel_max

    @property
    def blocked(self) -> bool:
        return self.blocked_reason is not None

    @property
    def is_open(self) -> bool:
        return self._reason is None

    @classmethod
    async def connect(
        cls,
        urls: str | Sequence[str],
        *,
        nursery: trio.Nursery | None = None,
        ssl_context: ssl.SSLContext | None = None,
        heartbeat: int = 60,
        connection_name: str = "cpgbroker",
        client_properties: dict[str, Any] | None = None,
        timeout: float = 10.0,
    ) -> AmqpClient:
        """Connect to the first of ``urls`` that answers (a cluster's members, in the order
        to try them), each within ``timeout`` seconds. Raises :class:`ConnectionClosed`: the
        broker's refusal (403 login, 530 vhost) at once, else after every URL failed.

        The client's tasks start in ``nursery`` when one is given, else on ``async with``.
        ``heartbeat`` (seconds) is our proposal: the lower of it and the broker's is used
        (0 on one side: the other's)."""
        parsed = [AmqpUrl.parse(u) for u in ([urls] if isinstance(urls, str) else urls)]
        if not parsed:
            raise UrlError("no AMQP URL to connect to")
        properties: dict[str, Any] = {
            "product": "cpgbroker",
            "version": _version(),
            "platform": f"Python {sys.version.split()[0]}",
            "capabilities": dict(CLIENT_CAPABILITIES),
            "connection_name": connection_name,
            **(client_properties or {}),
        }
        failures: list[str] = []
        for url in parsed:
            try:
                return await cls._connect_one(
                    url, nursery, ssl_context, heartbeat, properties, timeout
                )
            except ConnectionClosed as e:
                if e.reply_code in _REFUSALS or len(parsed) == 1:
                    raise
                failures.append(str(e) if str(url) in e.reply_text else f"{url}: {e}")
        raise ConnectionClosed(0, "no broker reachable: " + "; ".join(failures))

    @classmethod
    async def _connect_one(
        cls,
        url: AmqpUrl,
        nursery: trio.Nursery | None,
        ssl_context: ssl.SSLContext | None,
        heartbeat: int,
        properties: dict[str, Any],
        timeout: float,
    ) -> AmqpClient:
        proto = ClientProtocol(
            username=url.username,
            password=url.password,
            virtual_host=url.vhost,
            heartbeat=heartbeat,
            client_properties=properties,
        )
        try:
            with trio.fail_after(timeout):
                stream = await _open_stream(url, ssl_context)
                try:
                    leftover = await _handshake(stream, proto)
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
        except trio.TooSlowError:
            raise ConnectionClosed(0, f"{url}: not open within {timeout} s") from None
        except (OSError, trio.BrokenResourceError) as e:
            raise ConnectionClosed(0, f"{url}: {_describe(e)}") from None
        client = cls(stream, proto, url)
        for event in leftover:
            client._dispatch(event)
        if nursery is not None:
            await nursery.start(client._run)
        return client

    async def __aenter__(self) -> AmqpClient:
        if self._started or self._lifetime is not None:
            raise AmqpClientError("the client runs already")
        self._lifetime = self._run_here()
        return await self._lifetime.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._lifetime is not None
        return await self._lifetime.__aexit__(exc_type, exc, tb)

    @contextlib.asynccontextmanager
    async def _run_here(self) -> AsyncIterator[AmqpClient]:
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(self._run)
            try:
                yield self
            except Exception as e:
                # Raised again below, outside the nursery, so it is not wrapped in a group.
                error = e
            finally:
                # Graceful, with a deadline (CLOSE_TIMEOUT), even when cancelled.
                with trio.CancelScope(shield=True):
                    await self.close()
        if error is not None:
            raise error

    async def channel(self) -> Channel:
        await self._wait_for_room()
        number = self._proto.open_channel()
        channel = Channel(self, number)
        self._channels[number] = channel
        rpc = channel._expect(commands.Channel.OpenOk)
        self._wake_writer()
        await channel._answer(rpc)
        return channel

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """connection.close, then up to ``timeout`` seconds for close-ok; a no-op once the
        connection has ended."""
        if self._reason is None:
            self._record(ConnectionClosed(200, "closed by the client"))
            self._proto.close(200, "Normal shutdown")
            self._wake_writer()
            with trio.move_on_after(timeout):
                await self._close_ok.wait()
        self._teardown(ConnectionClosed(200, "closed by the client"))
        await trio.lowlevel.checkpoint()

    async def wait_closed(self) -> ConnectionClosed:
        """Wait until the connection has ended; returns why."""
        await self._closed.wait()
        assert self._reason is not None
        return self._reason

    # -- tasks

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._started = True
        try:
            with self._scope:
                async with trio.open_nursery() as tasks:
                    tasks.start_soon(self._guarded, self._reader)
                    tasks.start_soon(self._guarded, self._writer)
                    if self._proto.heartbeat:
                        tasks.start_soon(self._guarded, self._heartbeats)
                    task_status.started()
        finally:
            self._teardown(ConnectionClosed(0, "the client's tasks were cancelled"))
            await trio.aclose_forcefully(self._stream)

    async def _guarded(self, task: Callable[[], Any]) -> None:
        try:
            await task()
        except ProtocolError as e:
            # The broker broke the protocol: connection.close with our reply code, then the
            # socket once that is out (or after CLOSE_TIMEOUT if it cannot go).
            self._record(e)
            self._proto.abort(e)
            self._wake_writer()
            await trio.sleep(CLOSE_TIMEOUT)
            self._teardown(e)
        except ConnectionClosed as e:
            self._teardown(e)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._teardown(ConnectionClosed(0, f"socket to {self.url}: {_describe(e)}"))

    async def _reader(self) -> None:
        stream, proto, dispatch = self._stream, self._proto, self._dispatch
        while not proto.closed:
            data = await stream.receive_some(RECV_SIZE)
            if not data:
                raise ConnectionClosed(0, f"{self.url} closed the socket")
            self._last_received = trio.current_time()
            for event in proto.receive_data(data):
                dispatch(event)
            if proto.pending_output:
                self._wake_writer()
        # Closed (either side's close answered): the writer sends what is left, then tears
        # down; this is the deadline if it cannot.
        self._wake_writer()
        await trio.sleep(CLOSE_TIMEOUT)
        raise ConnectionClosed(0, "timed out sending connection.close(-ok)")

    async def _writer(self) -> None:
        stream, proto, room = self._stream, self._proto, self._room_lot
        while True:
            if proto.pending_output:
                await stream.send_all(proto.data_to_send())
                self._last_sent = trio.current_time()
                if room:
                    room.unpark_all()
            elif proto.closed:
                raise ConnectionClosed(0, "connection closed")  # the recorded reason wins
            else:
                await self._writer_lot.park()

    async def _heartbeats(self) -> None:
        interval = self._proto.heartbeat
        half = interval / 2
        while True:
            now = trio.current_time()
            if now - self._last_received > 2 * interval:
                raise ConnectionClosed(
                    0, f"missed heartbeats: nothing from {self.url} in {2 * interval} s"
                )
            if now - self._last_sent >= half:
                self._proto.send_heartbeat()
                self._last_sent = now
                self._wake_writer()
            # A little past the due time, so that an equal-time check does not spin.
            due = min(self._last_sent + half, self._last_received + 2 * interval)
            await trio.sleep_until(due + 0.01)

    # -- events

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, Delivery):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._deliver(event)
        elif isinstance(event, Confirmed):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._on_confirmed(event)
        elif isinstance(event, MethodReceived):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._on_reply(event.method)
        elif isinstance(event, ChannelCloseReceived):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._finish(
                    ChannelClosed(
                        event.reply_code, event.reply_text, event.class_id, event.method_id
                    )
                )
        elif isinstance(event, CancelReceived):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._cancelled_by_broker(event.consumer_tag)
        elif isinstance(event, Returned):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel.returned += 1
        elif isinstance(event, ConnectionBlocked):
            if self.blocked_reason is None:
                self._unblocked = trio.Event()
            self.blocked_reason = event.reason
        elif isinstance(event, ConnectionUnblocked):
            self.blocked_reason = None
            self._unblocked.set()
        elif isinstance(event, ConnectionCloseReceived):
            self._record(ConnectionClosed(event.reply_code, event.reply_text))
        elif isinstance(event, ConnectionCloseOk):
            self._close_ok.set()

    # -- plumbing

    def _send(self, channel: int, method: base.Frame) -> None:
        self._proto.send_method(channel, method)
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._writer_lot:
            self._writer_lot.unpark_all()

    async def _wait_for_room(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._started:
            raise AmqpClientError("the client is not running: use `async with client`")
        while self._reason is None and self._proto.pending_output > OUTPUT_HIGH_WATER:
            await self._room_lot.park()
        if self._reason is not None:
            raise _fresh(self._reason)

    async def _wait_to_publish(self) -> None:
        while self.blocked_reason is not None and self._reason is None:
            await self._unblocked.wait()
        await self._wait_for_room()

    def _record(self, reason: ConnectionClosed) -> None:
        if self._reason is None:
            self._reason = reason

    def _teardown(self, reason: ConnectionClosed) -> None:
        """The end: every channel's pending calls, consumers and confirmations end with the
        recorded reason, waiters wake, the tasks are cancelled (the socket closes as they go)."""
        if self._torn_down:
            return
        self._torn_down = True
        self._record(reason)
        assert self._reason is not None
        for channel in list(self._channels.values()):
            channel._finish(self._reason)
        self._channels.clear()
        self._unblocked.set()
        self._room_lot.unpark_all()
        self._writer_lot.unpark_all()
        self._close_ok.set()
        self._closed.set()
        self._scope.cancel()


async def _open_stream(url: AmqpUrl, ssl_context: ssl.SSLContext | None) -> trio.abc.Stream:
    if url.tls:
        context = ssl_context or ssl.create_default_context()
        return await trio.open_ssl_over_tcp_stream(url.host, url.port, ssl_context=context)
    return await trio.open_tcp_stream(url.host, url.port)


async def _handshake(stream: trio.abc.Stream, proto: ClientProtocol) -> list[Event]:
    """Run the handshake to connection.open-ok; returns the events read after it."""
    proto.initiate()
    while True:
        out = proto.data_to_send()
        if out:
            await stream.send_all(out)
        data = await stream.receive_some(RECV_SIZE)
        if not data:
            raise ConnectionClosed(0, "the broker closed the socket during the handshake")
        events = proto.receive_data(data)
        for i, event in enumerate(events):
            if isinstance(event, ConnectionCloseReceived):
                # A refused login or vhost: answer close-ok (best effort), report the reason.
                with trio.move_on_after(1):
                    await stream.send_all(proto.data_to_send())
                raise ConnectionClosed(event.reply_code, event.reply_text)
            if isinstance(event, ConnectionOpened):
                return events[i + 1 :]


def _describe(e: BaseException) -> str:
    # trio's BrokenResourceError says nothing itself: the socket's or TLS's error is its cause.
    cause = e.__cause__
    text = str(e) or type(e).__name__
    return f"{text}: {cause}" if cause is not None else text


def _version() -> str:
    from cpgbroker import __version__

    return __version__

"""The AMQP 0-9-1 client protocol without I/O (h11-style), under runtime/federation/client.py.

:class:`ClientProtocol` is one connection's state. Fed the bytes that arrived
(:meth:`~ClientProtocol.receive_data`), it cuts frames with the broker's own framer (which
checks the negotiated frame_max before it buffers a payload), decodes them with pamqp, answers
what needs no decision (the handshake, close-ok, flow-ok) and returns events: a delivery
reassembled from its method, header and body frames, a publisher confirm expanded to the
publish sequence numbers it covers, a channel or the connection closed by the broker. What the
caller sends (methods; publishes cut at frame_max) is appended to one output buffer that
:meth:`~ClientProtocol.data_to_send` empties. Any input either yields events or raises
:class:`ProtocolError` (a :class:`ConnectionClosed`); nothing else escapes. Also here: the
client's errors, URLs and events, which the trio client hands to its callers.
"""

from __future__ import annotations

import enum
import struct
import urllib.parse
from typing import Any

import attrs
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
_U64 = struct.Struct(">Q")
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


def fresh_error(e: AmqpClientError) -> AmqpClientError:
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
    # The content header's payload as it came (a federation link forwards it byte for byte
    # from model version 8 on: runtime/federation/links.py).
    header: bytes = b""


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

    __slots__ = (
        "body",
        "closing",
        "confirms",
        "content",
        "header",
        "properties",
        "received",
        "size",
    )

    def __init__(self) -> None:
        self.closing = False
        self.confirms: PublishSequence | None = None
        # The basic.deliver/basic.return whose content is arriving, its header, and its body.
        self.content: commands.Basic.Deliver | commands.Basic.Return | None = None
        self.properties: commands.Basic.Properties | None = None
        self.header = b""
        self.size = 0
        self.received = 0
        self.body: list[bytes] = []


def protocol_error(code: ReplyCode, text: str) -> ProtocolError:
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
        header: bytes | None = None,
    ) -> int:
        """Queue basic.publish with its content, the body cut at frame_max. Returns the
        publish's confirm sequence number, 0 when the channel is not in confirm mode.
        ``header``: a content header's payload to send as it is (its body size set to the
        body's) instead of one encoded from ``properties``."""
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
            )
            if header is None:
                head += pframe.marshal(
                    ContentHeader(0, len(body), properties or _EMPTY_PROPERTIES), channel
                )
            else:
                if len(header) < 14:
                    raise ValueError(f"content header of {len(header)} bytes")
                payload = header[:4] + _U64.pack(len(body)) + header[12:]
                head += _BODY_HEAD.pack(FRAME_HEADER, channel, len(payload))
                head += payload + FRAME_END_BYTE
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
            error = protocol_error(e.code, e.text)
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
            raise protocol_error(ReplyCode.FRAME_ERROR, "method frame shorter than its ids")
        index = int.from_bytes(payload[:4], "big")
        cls = commands.INDEX_MAPPING.get(index)
        if cls is None:
            raise protocol_error(ReplyCode.COMMAND_INVALID, f"unknown method {index:#010x}")
        method: base.Frame = cls()
        try:
            method.unmarshal(payload[4:])
        except _DECODE_ERRORS as e:
            raise protocol_error(ReplyCode.FRAME_ERROR, f"cannot decode {method.name}: {e}") from e
        return method

    def _connection_frame(self, frame_type: int, payload: bytes, events: list[Event]) -> None:
        if frame_type == FRAME_HEARTBEAT:  # its arrival is all it says (the caller times reads)
            return
        if frame_type != FRAME_METHOD:
            raise protocol_error(ReplyCode.UNEXPECTED_FRAME, "content frame on channel 0")
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
            raise protocol_error(
                ReplyCode.COMMAND_INVALID, f"unexpected {m.name} in state {state.name}"
            )

    def _start(self, m: commands.Connection.Start) -> None:
        if (m.version_major, m.version_minor) != (0, 9):
            raise protocol_error(
                ReplyCode.NOT_IMPLEMENTED,
                f"broker speaks AMQP {m.version_major}-{m.version_minor}, not 0-9-1",
            )
        mechanisms = str(m.mechanisms).split()
        if "PLAIN" not in mechanisms:
            raise protocol_error(
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
            raise protocol_error(ReplyCode.CHANNEL_ERROR, f"frame on channel {channel} before open")
        st = self._channels.get(channel)
        if st is None:
            raise protocol_error(ReplyCode.CHANNEL_ERROR, f"frame on unopened channel {channel}")
        if st.closing:
            # Spec: a closing channel discards everything but close and close-ok (content
            # frames of a delivery sent before our close included).
            if frame_type == FRAME_METHOD:
                self._closing_method(channel, self._decode(payload), events)
        elif frame_type == FRAME_METHOD:
            if st.content is not None:
                raise protocol_error(
                    ReplyCode.UNEXPECTED_FRAME, f"method frame inside content on channel {channel}"
                )
            self._channel_method(channel, st, self._decode(payload), events)
        elif frame_type == FRAME_HEADER:
            self._content_header(channel, st, payload, events)
        elif frame_type == FRAME_BODY:
            if st.content is None or st.properties is None:
                raise protocol_error(
                    ReplyCode.UNEXPECTED_FRAME, f"body frame without a header on channel {channel}"
                )
            st.body.append(payload)
            st.received += len(payload)
            if st.received >= st.size:
                self._content_done(channel, st, events)
        else:
            raise protocol_error(ReplyCode.FRAME_ERROR, f"heartbeat on channel {channel}")

    def _channel_method(
        self, channel: int, st: _ChannelState, m: base.Frame, events: list[Event]
    ) -> None:
        if isinstance(m, (commands.Basic.Deliver, commands.Basic.Return)):
            st.content = m
        elif isinstance(m, (commands.Basic.Ack, commands.Basic.Nack)):
            if st.confirms is None:
                raise protocol_error(
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
            raise protocol_error(
                ReplyCode.UNEXPECTED_FRAME, f"unexpected content header on channel {channel}"
            )
        header = ContentHeader()
        try:
            header.unmarshal(payload)
        except _DECODE_ERRORS as e:
            raise protocol_error(ReplyCode.FRAME_ERROR, f"cannot decode content header: {e}") from e
        st.properties = header.properties
        st.header = payload
        st.size = header.body_size
        st.received = 0
        if st.size == 0:
            self._content_done(channel, st, events)

    def _content_done(self, channel: int, st: _ChannelState, events: list[Event]) -> None:
        if st.received > st.size:
            raise protocol_error(
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
                    st.header,
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

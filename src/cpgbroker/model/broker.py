"""The deterministic broker: ``Broker.apply(event) -> list[Effect]``.

Theory of operation
-------------------
The broker is a pure state machine over an ordered stream of events (see ``events.py``). It
owns no socket, reads no clock and draws no random number: the same events in the same order
give the same state and the same effects on every replica, which is what lets a cluster of
members replay one CPG stream into identical brokers.

* Client bytes arrive as :class:`ClientData`. The connection's :class:`FrameReader` cuts them
  into frames; each frame is handled in order. A client protocol violation raises an
  :class:`AMQPError` inside a handler and is converted to channel.close / connection.close at
  exactly one place (``_on_data``); it never escapes ``apply``.
* Deliveries to consumers need do-output credit: :class:`DoOutput` grants it, each delivery
  spends one. When credit runs out while messages wait, the model emits :class:`WantOutput` so
  the member owning the connection can grant more once its socket drains. This is the seed
  design's do-output: allocation depends only on ordered events, never on socket writability.
* Time is :class:`Tick` events. Heartbeats, message TTL and queue x-expires act on ticks only;
  ``now_ms`` is the last tick's time.
* Output is collected per connection during one ``apply`` and returned as one :class:`Send`
  per connection, followed by any close. Shadow connections (``emit`` false) skip encoding.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
from collections.abc import Iterable
from typing import Any

from pamqp import commands, decode
from pamqp import frame as pframe
from pamqp.exceptions import PAMQPException

from cpgbroker.errors import (
    AMQPError,
    ChannelError,
    ConnectionError_,
    FrameError,
    InvariantError,
    ReplyCode,
)
from cpgbroker.model import entities as E
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.entities import (
    MAX_PRIORITY,
    Channel,
    Connection,
    Consumer,
    Entry,
    Message,
    Queue,
    put_back,
    ready_messages,
)
from cpgbroker.model.events import (
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    CloseConnection,
    ClusterMembers,
    DoOutput,
    Effect,
    Event,
    MemberLeft,
    Send,
    Throttle,
    Tick,
    WantOutput,
)
from cpgbroker.model.exchange import EXCHANGE_TYPES, Exchange
from cpgbroker.wire import fastpath as fp
from cpgbroker.wire.framer import (
    FRAME_BODY,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    FRAME_MIN_SIZE,
    HEARTBEAT_FRAME,
    PROTOCOL_HEADER,
    FrameReader,
)

R = ReplyCode

CONNECTION_CLASS = 10
CHANNEL_CLASS = 20

_M = commands
IDX_CONNECTION_START_OK = _M.Connection.StartOk.index
IDX_CONNECTION_TUNE_OK = _M.Connection.TuneOk.index
IDX_CONNECTION_OPEN = _M.Connection.Open.index
IDX_CONNECTION_CLOSE = _M.Connection.Close.index
IDX_CONNECTION_CLOSE_OK = _M.Connection.CloseOk.index
IDX_CONNECTION_UPDATE_SECRET = _M.Connection.UpdateSecret.index

# How long (ms of cluster time) a connection we closed may take to answer close-ok.
CLOSE_TIMEOUT_MS = 3000
# How long a client may take from TCP connect to connection.open (RabbitMQ: 10 s).
HANDSHAKE_TIMEOUT_MS = 10000

SERVER_CAPABILITIES = {
    "publisher_confirms": True,
    "exchange_exchange_bindings": True,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "consumer_priorities": False,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
    "direct_reply_to": False,
}

# Fanout exchange carrying the cluster's member list (cluster mode): a queue bound to it gets
# the current list at once and again on every membership change.
FAILOVER_EXCHANGE = "amq.failover"

PREDECLARED = (
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
)


def _method_name(index: int) -> str:
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        return f"method {index >> 16}.{index & 0xFFFF}"
    return str(getattr(cls, "name", cls.__name__)).lower()


class VHost:
    __slots__ = ("exchanges", "name", "queues")

    def __init__(self, name: str) -> None:
        self.name = name
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}


class Broker:
    """The whole replicated broker state and its transition function."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self.users = {u.name: u for u in self.config.users}
        self.now_ms = 0
        self.event_seq = 0
        self.msg_seq = 0
        self.queued_bytes = 0
        self.blocked = False
        self.connections: dict[int, Connection] = {}
        # Client URLs of the cluster's members (empty standalone), in the cluster's order.
        self.member_urls: tuple[str, ...] = self.config.member_urls
        self.vhosts: dict[str, VHost] = {}
        for name in self.config.vhosts:
            self._add_vhost(name)
        # Queues with an entry that can expire / with x-expires, checked on ticks.
        self._ttl_queues: dict[tuple[str, str], Queue] = {}
        self._expiring: dict[tuple[str, str], Queue] = {}
        self._effects: list[Effect] = []
        self._dirty: list[Connection] = []
        # Publisher confirms and tx.commit-oks produced so far for shadow connections (their
        # bytes are not even encoded): a member thereby knows, without being told, that an
        # event gave another member's client a confirm that waits for this member's progress
        # report (runtime/member.py). Not replicated: only its changes matter.
        self.shadow_confirms = 0

    # ------------------------------------------------------------------ entry point

    def apply(self, event: Event) -> list[Effect]:
        """Apply one event; return the effects (sends, closes) it causes, in order."""
        self.event_seq += 1
        t = type(event)
        if t is ClientData:
            self._on_data(event.conn, event.data)  # type: ignore[union-attr]
        elif t is DoOutput:
            self._on_do_output(event.conn, event.limit)  # type: ignore[union-attr]
        elif t is Tick:
            self._on_tick(event.now_ms)  # type: ignore[union-attr]
        elif t is ClientConnected:
            self._on_connected(event)  # type: ignore[arg-type]
        elif t is ClientDisconnected:
            conn = self.connections.get(event.conn)  # type: ignore[union-attr]
            if conn is not None:
                self._drop_connection(conn, event.reason, notify=False)  # type: ignore[union-attr]
        elif t is CloseClient:
            conn = self.connections.get(event.conn)  # type: ignore[union-attr]
            if conn is not None:
                if conn.state == E.OPEN:
                    self._connection_error(
                        conn,
                        ConnectionError_(ReplyCode(event.code), event.text),  # type: ignore[union-attr]
                    )
                else:
                    self._drop_connection(conn, event.text, notify=True)  # type: ignore[union-attr]
        elif t is ClusterMembers:
            self._on_members(event.urls)  # type: ignore[union-attr]
        elif t is MemberLeft:
            gone = [c for c in self.connections.values() if c.member == event.member]  # type: ignore[union-attr]
            for conn in gone:
                _mark_closing(conn)  # none of them may take over what another gives back
            for conn in gone:
                self._drop_connection(conn, "cluster member left", notify=False)
        else:
            raise InvariantError(f"unknown event {event!r}")
        return self._flush()

    def fail_event(self, event: Event, text: str) -> list[Effect]:
        """The cluster decided that applying ``event`` failed (an error-check round whose
        majority hit the same error there): the event counts as applied, and the connection
        it came from, if any, is closed with 541 internal-error rather than left in whatever
        state the failure left it. Every member that continues takes this same step."""
        conn = self.connections.get(getattr(event, "conn", -1))
        if conn is not None:
            if conn.state == E.OPEN:
                self._connection_error(conn, ConnectionError_(ReplyCode.INTERNAL_ERROR, text[:200]))
            else:
                self._drop_connection(conn, text, notify=True)
        return self._flush()

    def set_emit(self, conn_id: int, emit: bool) -> None:
        """Mark a connection as this replica's own (emit output) or a shadow (discard)."""
        conn = self.connections.get(conn_id)
        if conn is not None:
            conn.emit = emit

    # ------------------------------------------------------------------ cluster membership

    def _on_members(self, urls: tuple[str, ...]) -> None:
        self.member_urls = tuple(urls)
        for vh in self.vhosts.values():
            ex = vh.exchanges.get(FAILOVER_EXCHANGE)
            if ex is None:
                ex = Exchange(FAILOVER_EXCHANGE, vh.name, "fanout", True, False, False, {})
                vh.exchanges[FAILOVER_EXCHANGE] = ex
            for b in ex.bindings:
                if isinstance(b.dest, Queue):
                    self._publish_members(b.dest)

    def _publish_members(self, q: Queue) -> None:
        """The member list as a message on ``q`` (amq.failover): body one URL per line, and the
        list in header ``members`` for clients that read headers."""
        from pamqp import header as pheader

        props = commands.Basic.Properties(
            content_type="text/plain", headers={"members": list(self.member_urls)}
        )
        body = "\n".join(self.member_urls).encode()
        hdr = bytes(pheader.ContentHeader(0, len(body), props).marshal())
        info = fp.parse_content_header(hdr)
        self.msg_seq += 1
        msg = Message(self.msg_seq, FAILOVER_EXCHANGE, "", hdr, body, 1, None, info.headers_span)
        if self._enqueue(q, Entry(msg, False, None)):
            self._dispatch(q)

    # ------------------------------------------------------------------ output plumbing

    def _emit(self, conn: Connection, data: bytes) -> None:
        conn.last_tx_ms = self.now_ms
        if not conn.emit:
            return
        if not conn.outbuf:
            self._dirty.append(conn)
        conn.outbuf.append(data)

    def _send_method(self, conn: Connection, channel: int, method: Any) -> None:
        conn.last_tx_ms = self.now_ms
        if conn.emit:
            self._emit(conn, pframe.marshal(method, channel))

    def _flush_conn(self, conn: Connection) -> None:
        if conn.outbuf:
            data = conn.outbuf[0] if len(conn.outbuf) == 1 else b"".join(conn.outbuf)
            conn.outbuf.clear()
            self._effects.append(Send(conn.id, data, conn.confirm_out))
            conn.confirm_out = False

    def _flush(self) -> list[Effect]:
        for conn in self._dirty:
            self._flush_conn(conn)
        self._dirty.clear()
        effects = self._effects
        self._effects = []
        return effects

    def _close_socket(self, conn: Connection, reason: str) -> None:
        self._flush_conn(conn)
        self._effects.append(CloseConnection(conn.id, reason))

    # ------------------------------------------------------------------ vhosts

    def _add_vhost(self, name: str) -> VHost:
        vh = VHost(name)
        vh.exchanges[""] = Exchange("", name, "direct", True, False, False, {})
        for ex_name, ex_type in PREDECLARED:
            vh.exchanges[ex_name] = Exchange(ex_name, name, ex_type, True, False, False, {})
        self.vhosts[name] = vh
        return vh

    # ------------------------------------------------------------------ connections

    def _on_connected(self, ev: ClientConnected) -> None:
        if ev.conn in self.connections:
            raise InvariantError(f"connection {ev.conn} opened twice")
        conn = Connection(
            id=ev.conn,
            member=ev.member,
            peer=ev.peer,
            loopback=ev.loopback,
            reader=FrameReader(self.config.frame_max),
            last_rx_ms=self.now_ms,
            last_tx_ms=self.now_ms,
            close_deadline=self.now_ms + HANDSHAKE_TIMEOUT_MS,
        )
        self.connections[ev.conn] = conn

    def _on_data(self, conn_id: int, data: bytes) -> None:
        conn = self.connections.get(conn_id)
        if conn is None or conn.state == E.CLOSED:
            return
        conn.last_rx_ms = self.now_ms
        if conn.state == E.AWAIT_HEADER:
            buf = conn.header_buf + data
            if len(buf) < 8:
                if not PROTOCOL_HEADER.startswith(buf):
                    self._bad_header(conn)
                else:
                    conn.header_buf = buf
                return
            if buf[:8] != PROTOCOL_HEADER:
                self._bad_header(conn)
                return
            conn.header_buf = b""
            self._send_start(conn)
            conn.state = E.AWAIT_START_OK
            data = buf[8:]
            if not data:
                return
        reader = conn.reader
        reader.feed(data)
        # Errors are handled per frame, so the outcome never depends on how the client's bytes
        # were chunked into events (a property test checks this).
        f: tuple[int, int, bytes] | None = None
        while True:
            try:
                f = reader.next_frame()
                if f is None:
                    break
                self._on_frame(conn, f[0], f[1], f[2])
            except ChannelError as e:
                self._channel_error(conn, f[1] if f else 0, e)
            except FrameError as e:
                # Frame boundaries are lost: nothing after this can be parsed, so close now.
                self._connection_error(conn, e)
                self._drop_connection(conn, f"frame error: {e.text}", notify=True)
                return
            except ConnectionError_ as e:
                self._connection_error(conn, e)
            if conn.state == E.CLOSED:
                return
        if conn.confirm_dirty:
            self._flush_confirms(conn)

    def _bad_header(self, conn: Connection) -> None:
        # Spec 4.2.2: answer a bad protocol header with our own header, then close.
        self._emit(conn, PROTOCOL_HEADER)
        self._drop_connection(conn, "bad AMQP protocol header", notify=True)

    def _send_start(self, conn: Connection) -> None:
        cfg = self.config
        props: dict[str, Any] = {
            "product": cfg.product,
            "version": cfg.version,
            "platform": "Python",
            "copyright": "cpgbroker contributors",
            "information": "AMQP 0-9-1 broker on corosync CPG",
            "capabilities": dict(SERVER_CAPABILITIES),
            "cluster_name": cfg.cluster_name or "standalone",
        }
        if self.member_urls:
            props["cluster_members"] = " ".join(self.member_urls)
        self._send_method(
            conn,
            0,
            commands.Connection.Start(
                server_properties=props, mechanisms="PLAIN AMQPLAIN", locales="en_US"
            ),
        )

    def _connection_error(self, conn: Connection, e: AMQPError) -> None:
        if conn.state >= E.CLOSING:
            return
        self._send_method(
            conn,
            0,
            commands.Connection.Close(
                reply_code=int(e.code),
                reply_text=e.reply_text,
                class_id=e.class_id,
                method_id=e.method_id,
            ),
        )
        self._release_connection(conn)
        conn.state = E.CLOSING
        conn.close_deadline = self.now_ms + CLOSE_TIMEOUT_MS

    def _release_connection(self, conn: Connection) -> None:
        """Give back everything the connection holds: unacked messages are requeued, consumers
        cancelled, exclusive queues deleted (spec: when the connection closes)."""
        # Its channels are all going: no consumer on one may be handed what another one gives
        # back (a single-active-consumer queue's takeover, a requeue's dispatch).
        _mark_closing(conn)
        for ch in list(conn.channels.values()):
            self._release_channel(ch)
        conn.channels.clear()
        for qname in list(conn.exclusive_queues):
            vh = self.vhosts.get(conn.vhost)
            q = vh.queues.get(qname) if vh else None
            if q is not None and not q.deleted:
                self._delete_queue(q)
        conn.exclusive_queues.clear()
        conn.confirm_dirty.clear()

    def _drop_connection(self, conn: Connection, reason: str, *, notify: bool) -> None:
        if conn.state != E.CLOSED:
            self._release_connection(conn)
            conn.state = E.CLOSED
        del self.connections[conn.id]
        if notify:
            self._close_socket(conn, reason)
        else:
            conn.outbuf.clear()

    def _on_do_output(self, conn_id: int, limit: int) -> None:
        conn = self.connections.get(conn_id)
        if conn is None:
            return
        conn.credit = limit
        conn.want_output = False
        conn.granted = True
        if conn.state != E.OPEN:
            return
        # Queues are visited in channel and consumer order: deterministic.
        seen: list[Queue] = []
        for ch in conn.channels.values():
            for c in ch.consumers.values():
                if c.queue not in seen:
                    seen.append(c.queue)
        for q in seen:
            self._dispatch(q)
            if conn.credit <= 0:
                break

    # ------------------------------------------------------------------ time

    def _on_tick(self, now_ms: int) -> None:
        # Another member may take over the clock with a clock slightly behind: cluster time
        # never goes back (every replica clamps the same way, so this stays deterministic).
        now_ms = max(now_ms, self.now_ms)
        self.now_ms = now_ms
        for conn in list(self.connections.values()):
            if conn.state != E.OPEN:
                if conn.close_deadline is not None and now_ms >= conn.close_deadline:
                    self._drop_connection(
                        conn,
                        "no close-ok from client"
                        if conn.state == E.CLOSING
                        else "handshake timeout",
                        notify=True,
                    )
                    continue
                if conn.state == E.CLOSING:
                    continue
            hb = conn.heartbeat * 1000
            if hb <= 0:
                continue
            if now_ms - conn.last_rx_ms > 2 * hb:
                # Spec 4.2.7: a peer silent for two heartbeat intervals is gone.
                self._drop_connection(
                    conn, f"missed heartbeats from client, timeout: {conn.heartbeat}s", notify=True
                )
                continue
            if now_ms - conn.last_tx_ms >= hb // 2:
                self._emit(conn, HEARTBEAT_FRAME)
        if self._ttl_queues:
            for key, q in list(self._ttl_queues.items()):
                self._expire_head(q)
                if not q.messages:
                    del self._ttl_queues[key]
        if self._expiring:
            for q in list(self._expiring.values()):
                if (
                    not q.deleted
                    and not q.consumers
                    and q.expires is not None
                    and now_ms - q.last_used_ms >= q.expires
                ):
                    self._delete_queue(q)

    def _expire_head(self, q: Queue) -> None:
        msgs = q.messages
        now = self.now_ms
        while msgs:
            e = msgs[0]
            if e.expires_at is None or e.expires_at > now:
                return
            msgs.popleft()
            self._settle_dropped(q, e, "expired")

    # ------------------------------------------------------------------ frames

    def _on_frame(self, conn: Connection, ftype: int, ch: int, payload: bytes) -> None:
        if ftype == FRAME_METHOD:
            if len(payload) < 4:
                raise ConnectionError_(R.FRAME_ERROR, "method frame shorter than 4 bytes")
            index = fp.method_index(payload)
            if conn.state == E.OPEN and ch != 0:
                channel = conn.channels.get(ch)
                if channel is not None and not channel.closing and channel.pending is None:
                    if index == fp.BASIC_PUBLISH:
                        self._basic_publish(conn, channel, payload)
                        return
                    if index == fp.BASIC_ACK:
                        self._basic_ack(channel, payload)
                        return
                self._channel_method(conn, ch, index, payload)
                return
            if ch == 0:
                self._connection_method(conn, index, payload)
                return
            if conn.state == E.CLOSING:
                return
            raise ConnectionError_(
                R.CHANNEL_ERROR if conn.state == E.OPEN else R.COMMAND_INVALID,
                f"unexpected {_method_name(index)} on channel {ch} before connection.open",
            )
        if ftype == FRAME_HEARTBEAT:
            if ch != 0:
                raise FrameError(f"heartbeat frame on channel {ch}")
            return
        if conn.state != E.OPEN:
            if conn.state == E.CLOSING:
                return
            raise ConnectionError_(R.UNEXPECTED_FRAME, "content frame before connection.open")
        channel = conn.channels.get(ch)
        if channel is None:
            raise ConnectionError_(R.CHANNEL_ERROR, f"content frame on unopened channel {ch}")
        if channel.closing:
            return
        if ftype == FRAME_HEADER:
            self._content_header(conn, channel, payload)
        elif ftype == FRAME_BODY:
            self._content_body(conn, channel, payload)

    def _decode(self, payload: bytes, index: int, channel: int) -> Any:
        cls = commands.INDEX_MAPPING.get(index)
        if cls is None:
            raise ConnectionError_(
                R.NOT_IMPLEMENTED,
                f"unknown method class {index >> 16} method {index & 0xFFFF}",
                class_id=index >> 16,
                method_id=index & 0xFFFF,
            )
        method = cls()
        try:
            method.unmarshal(payload[4:])
            # 0-9-1 turned these 0-8 fields into reserved ones the server must ignore, and
            # real clients still fill them (pika sends insist=True); pamqp's validate()
            # insists on the defaults, so reset them before validating the rest.
            for name, default in _RESERVED_FIELDS:
                if hasattr(method, name):
                    setattr(method, name, default)
            method.validate()
        except (PAMQPException, ValueError, TypeError, IndexError, KeyError, UnicodeError) as e:
            raise ConnectionError_(
                R.SYNTAX_ERROR,
                f"malformed {_method_name(index)} arguments: {e}",
                class_id=index >> 16,
                method_id=index & 0xFFFF,
            ) from None
        return method

    # ------------------------------------------------------------------ connection class

    def _connection_method(self, conn: Connection, index: int, payload: bytes) -> None:
        state = conn.state
        if state == E.CLOSING:
            if index == IDX_CONNECTION_CLOSE_OK:
                self._drop_connection(conn, "connection closed", notify=True)
            elif index == IDX_CONNECTION_CLOSE:
                self._send_method(conn, 0, commands.Connection.CloseOk())
                self._drop_connection(conn, "connection closed", notify=True)
            return
        if index >> 16 != CONNECTION_CLASS:
            raise ConnectionError_(
                R.COMMAND_INVALID,
                f"{_method_name(index)} is not allowed on channel 0",
                class_id=index >> 16,
                method_id=index & 0xFFFF,
            )
        m = self._decode(payload, index, 0)
        if index == IDX_CONNECTION_CLOSE:
            self._release_connection(conn)
            self._send_method(conn, 0, commands.Connection.CloseOk())
            self._drop_connection(conn, "client closed the connection", notify=True)
            return
        if index == IDX_CONNECTION_UPDATE_SECRET and state == E.OPEN:
            # RabbitMQ extension (10.70): users here have no expiring credentials, so, as
            # RabbitMQ's internal user store, acknowledge it.
            self._send_method(conn, 0, commands.Connection.UpdateSecretOk())
            return
        expected = {
            E.AWAIT_START_OK: IDX_CONNECTION_START_OK,
            E.AWAIT_TUNE_OK: IDX_CONNECTION_TUNE_OK,
            E.AWAIT_OPEN: IDX_CONNECTION_OPEN,
        }.get(state)
        if expected is None or index != expected:
            raise ConnectionError_(
                R.COMMAND_INVALID,
                f"unexpected {_method_name(index)}"
                + (f", expected {_method_name(expected)}" if expected else ""),
                class_id=index >> 16,
                method_id=index & 0xFFFF,
            )
        if state == E.AWAIT_START_OK:
            self._start_ok(conn, m)
        elif state == E.AWAIT_TUNE_OK:
            self._tune_ok(conn, m)
        else:
            self._open(conn, m)

    def _start_ok(self, conn: Connection, m: Any) -> None:
        props = m.client_properties or {}
        conn.client_properties = dict(props)
        caps = props.get("capabilities") or {}
        if isinstance(caps, dict):
            conn.capabilities = {str(k): bool(v) for k, v in caps.items()}
        mechanism = m.mechanism
        response = m.response
        raw = response.encode() if isinstance(response, str) else bytes(response)
        user = password = None
        if mechanism == "PLAIN":
            parts = raw.split(b"\x00")
            if len(parts) == 3:
                user, password = (
                    parts[1].decode(errors="replace"),
                    parts[2].decode(errors="replace"),
                )
        elif mechanism == "AMQPLAIN":
            try:
                table = decode.field_table(len(raw).to_bytes(4, "big") + raw)[1]
                user, password = str(table.get("LOGIN")), str(table.get("PASSWORD"))
            except Exception:
                user = None
        else:
            self._refuse_login(conn, f"unsupported authentication mechanism '{mechanism}'")
            return
        u = self.users.get(user or "")
        if u is None or u.password != password or (u.loopback_only and not conn.loopback):
            self._refuse_login(
                conn,
                f"Login was refused using authentication mechanism {mechanism}. "
                "For details see the broker logfile.",
            )
            return
        conn.user = u.name
        cfg = self.config
        self._send_method(
            conn,
            0,
            commands.Connection.Tune(
                channel_max=cfg.channel_max, frame_max=cfg.frame_max, heartbeat=cfg.heartbeat
            ),
        )
        conn.state = E.AWAIT_TUNE_OK

    def _refuse_login(self, conn: Connection, text: str) -> None:
        self._connection_error(conn, ConnectionError_(R.ACCESS_REFUSED, text))

    def _tune_ok(self, conn: Connection, m: Any) -> None:
        cfg = self.config
        channel_max = m.channel_max or cfg.channel_max
        frame_max = m.frame_max or cfg.frame_max
        if channel_max > cfg.channel_max:
            raise ConnectionError_(
                R.NOT_ALLOWED,
                f"negotiated channel_max = {channel_max} is higher than the maximum allowed "
                f"value ({cfg.channel_max})",
            )
        if frame_max > cfg.frame_max:
            raise ConnectionError_(
                R.NOT_ALLOWED,
                f"negotiated frame_max = {frame_max} is higher than the maximum allowed value "
                f"({cfg.frame_max})",
            )
        if frame_max < FRAME_MIN_SIZE:
            raise ConnectionError_(
                R.NOT_ALLOWED,
                f"negotiated frame_max = {frame_max} is lower than the minimum allowed value "
                f"({FRAME_MIN_SIZE})",
            )
        conn.channel_max = channel_max
        conn.frame_max = frame_max
        conn.reader.frame_max = frame_max
        conn.heartbeat = m.heartbeat
        conn.state = E.AWAIT_OPEN

    def _open(self, conn: Connection, m: Any) -> None:
        vhost = m.virtual_host or "/"
        if vhost not in self.vhosts:
            raise ConnectionError_(R.NOT_ALLOWED, f"vhost {vhost} not found")
        user = self.users[conn.user]
        if vhost not in user.vhosts:
            raise ConnectionError_(
                R.NOT_ALLOWED, f"access to vhost '{vhost}' refused for user '{conn.user}'"
            )
        conn.vhost = vhost
        conn.state = E.OPEN
        conn.close_deadline = None
        self._send_method(conn, 0, commands.Connection.OpenOk())
        if self.blocked and conn.capabilities.get("connection.blocked"):
            self._send_method(conn, 0, commands.Connection.Blocked(reason="low on memory"))
            conn.blocked_sent = True

    # ------------------------------------------------------------------ channels

    def _channel_error(self, conn: Connection, ch: int, e: AMQPError) -> None:
        channel = conn.channels.get(ch)
        if channel is None or channel.closing or conn.state != E.OPEN:
            return
        self._release_channel(channel)
        channel.closing = True
        self._send_method(
            conn,
            ch,
            commands.Channel.Close(
                reply_code=int(e.code),
                reply_text=e.reply_text,
                class_id=e.class_id,
                method_id=e.method_id,
            ),
        )

    def _release_channel(self, ch: Channel) -> None:
        conn = ch.conn
        # As in RabbitMQ, the consumer that takes over a single-active-consumer queue gets the
        # requeued messages before the rest: requeue first, then hand over.
        handover = [c.queue for c in list(ch.consumers.values()) if self._remove_consumer(c)]
        ch.consumers.clear()
        ch.pending = None
        ch.tx_ops.clear()
        if ch in conn.confirm_dirty:
            self._flush_channel_confirms(ch)
            conn.confirm_dirty.remove(ch)
        self._requeue_all(ch)
        for q in handover:
            if not q.deleted:
                self._dispatch(q)

    def _requeue_all(self, ch: Channel) -> None:
        if not ch.unacked:
            return
        touched: list[Queue] = []
        # Taken off the channel first: a dead-lettered one may be delivered again on it below.
        items = list(ch.unacked.values())
        ch.unacked.clear()
        over: list[tuple[Queue, Entry]] = []
        # Back to their original places; in reverse tag order each lands at the head.
        for q, e, c in reversed(items):
            if c is not None:
                c.unacked -= 1
            q.unacked -= 1
            if q.deleted:
                self._account_removed(q, e)
                continue
            if q not in touched:
                touched.append(q)
            if self._over_delivery_limit(q, e):
                over.append((q, e))
                continue
            e.redelivered = True
            put_back(q.messages, e)
        self._dead_letter_over_limit(over)
        for q in reversed(touched):
            if q.messages:
                self._track_ttl(q, q.messages[0])
            self._dispatch(q)

    def _channel_method(self, conn: Connection, ch: int, index: int, payload: bytes) -> None:
        channel = conn.channels.get(ch)
        cls_id = index >> 16
        if cls_id == CONNECTION_CLASS:
            raise ConnectionError_(
                R.COMMAND_INVALID,
                f"{_method_name(index)} is only allowed on channel 0",
                class_id=cls_id,
                method_id=index & 0xFFFF,
            )
        if channel is None:
            if index != commands.Channel.Open.index:
                raise ConnectionError_(
                    R.CHANNEL_ERROR,
                    f"expected 'channel.open' on channel {ch}, got {_method_name(index)}",
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
            self._decode(payload, index, ch)
            channel = Channel(ch, conn, prefetch_count=0)
            conn.channels[ch] = channel
            self._send_method(conn, ch, commands.Channel.OpenOk())
            return
        if channel.closing:
            if index == commands.Channel.CloseOk.index:
                del conn.channels[ch]
            elif index == commands.Channel.Close.index:
                self._send_method(conn, ch, commands.Channel.CloseOk())
                del conn.channels[ch]
            return
        if channel.pending is not None:
            raise ConnectionError_(
                R.UNEXPECTED_FRAME,
                f"expected content header for basic.publish on channel {ch}, "
                f"got {_method_name(index)}",
                class_id=cls_id,
                method_id=index & 0xFFFF,
            )
        handler = _HANDLERS.get(index)
        if handler is None:
            if index in commands.INDEX_MAPPING:
                raise ConnectionError_(
                    R.COMMAND_INVALID if index not in _NOT_IMPLEMENTED else R.NOT_IMPLEMENTED,
                    f"{_method_name(index)} is not allowed from a client"
                    if index not in _NOT_IMPLEMENTED
                    else f"{_method_name(index)} is not implemented",
                    class_id=cls_id,
                    method_id=index & 0xFFFF,
                )
            self._decode(payload, index, ch)  # raises 540 for unknown methods
            return
        if index in _FAST:
            handler(self, conn, channel, payload)
            return
        m = self._decode(payload, index, ch)
        try:
            handler(self, conn, channel, m)
        except AMQPError as e:
            if not e.class_id:
                e.class_id = cls_id
                e.method_id = index & 0xFFFF
            raise

    def _ch_open(self, conn: Connection, ch: Channel, m: Any) -> None:
        raise ConnectionError_(R.CHANNEL_ERROR, f"second 'channel.open' seen on channel {ch.id}")

    def _ch_close(self, conn: Connection, ch: Channel, m: Any) -> None:
        self._release_channel(ch)
        del conn.channels[ch.id]
        self._send_method(conn, ch.id, commands.Channel.CloseOk())

    def _ch_close_ok(self, conn: Connection, ch: Channel, m: Any) -> None:
        # close-ok for a close we never sent: ignore (harmless).
        return

    def _ch_flow(self, conn: Connection, ch: Channel, m: Any) -> None:
        ch.flow_active = bool(m.active)
        self._send_method(conn, ch.id, commands.Channel.FlowOk(active=ch.flow_active))
        # On: its consumers take messages again. Off: lower-priority consumers may no longer
        # have to wait for its consumers.
        self._dispatch_channel(ch)

    def _ch_flow_ok(self, conn: Connection, ch: Channel, m: Any) -> None:
        return

    # ------------------------------------------------------------------ names and checks

    def _vhost(self, conn: Connection) -> VHost:
        return self.vhosts[conn.vhost]

    def _queue_name(self, conn: Connection, ch: Channel, name: str) -> str:
        """Spec: an empty queue name means the last queue declared on the channel."""
        if name == "":
            if not ch.last_queue:
                raise ChannelError(
                    R.NOT_FOUND, f"no previously declared queue in vhost '{conn.vhost}'"
                )
            return ch.last_queue
        return name

    def _queue(self, conn: Connection, ch: Channel, name: str) -> Queue:
        vh = self._vhost(conn)
        name = self._queue_name(conn, ch, name)
        q = vh.queues.get(name)
        if q is None:
            raise ChannelError(R.NOT_FOUND, f"no queue '{name}' in vhost '{vh.name}'")
        self._check_exclusive(conn, q)
        return q

    def _check_exclusive(self, conn: Connection, q: Queue, exclusive: bool | None = None) -> None:
        """405 unless ``conn`` may use ``q``; on a redeclare (``exclusive`` given) the flag must
        also match, as RabbitMQ's check_exclusivity."""
        if (q.exclusive_owner is not None and q.exclusive_owner != conn.id) or (
            exclusive is not None and exclusive != (q.exclusive_owner is not None)
        ):
            raise ChannelError(
                R.RESOURCE_LOCKED,
                f"cannot obtain exclusive access to locked queue '{q.name}' in vhost "
                f"'{q.vhost}'. It could be originally declared on another connection or the "
                "exclusive property value does not match that of the original declaration.",
            )

    def _exchange(self, conn: Connection, name: str) -> Exchange:
        vh = self._vhost(conn)
        ex = vh.exchanges.get(name)
        if ex is None:
            raise ChannelError(R.NOT_FOUND, f"no exchange '{name}' in vhost '{vh.name}'")
        return ex

    def _next_name(self, conn: Connection, prefix: str) -> str:
        # Deterministic, unique per (connection, counter), and as opaque as RabbitMQ's names.
        conn.counter += 1
        digest = hashlib.sha256(f"{conn.id}:{conn.counter}".encode()).digest()
        return prefix + base64.urlsafe_b64encode(digest[:16]).decode().rstrip("=")

    # ------------------------------------------------------------------ exchange class

    def _ex_declare(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self._vhost(conn)
        name = m.exchange
        ex = vh.exchanges.get(name)
        if m.passive:
            if name == "":
                raise ChannelError(
                    R.ACCESS_REFUSED, "operation not permitted on the default exchange"
                )
            if ex is None:
                raise ChannelError(R.NOT_FOUND, f"no exchange '{name}' in vhost '{vh.name}'")
        else:
            if (name == "" or name.startswith("amq.")) and (ex is None or name == ""):
                raise ChannelError(
                    R.ACCESS_REFUSED,
                    f"exchange name '{name}' contains reserved prefix 'amq.*'"
                    if name
                    else "operation not permitted on the default exchange",
                )
            if m.exchange_type not in EXCHANGE_TYPES:
                raise ConnectionError_(
                    R.COMMAND_INVALID, f"unknown exchange type '{m.exchange_type}'"
                )
            args = dict(m.arguments or {})
            if ex is None:
                ex = Exchange(
                    name, vh.name, m.exchange_type, m.durable, m.auto_delete, m.internal, args
                )
                vh.exchanges[name] = ex
            else:
                for field, new, old in (
                    ("type", m.exchange_type, ex.type),
                    ("durable", m.durable, ex.durable),
                    ("auto_delete", m.auto_delete, ex.auto_delete),
                    ("internal", m.internal, ex.internal),
                ):
                    if new != old:
                        raise ChannelError(
                            R.PRECONDITION_FAILED,
                            f"inequivalent arg '{field}' for exchange '{name}' in vhost "
                            f"'{vh.name}': received {_fmt(new)} but current is {_fmt(old)}",
                        )
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Exchange.DeclareOk())

    def _ex_delete(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self._vhost(conn)
        name = m.exchange
        if name == "" or name.startswith("amq."):
            raise ChannelError(R.ACCESS_REFUSED, f"operation not permitted on exchange '{name}'")
        ex = vh.exchanges.get(name)
        if ex is not None:
            if m.if_unused and (ex.bindings or self._bound_to(vh, ex)):
                raise ChannelError(
                    R.PRECONDITION_FAILED, f"exchange '{name}' in vhost '{vh.name}' in use"
                )
            self._delete_exchange(vh, ex)
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Exchange.DeleteOk())

    def _bound_to(self, vh: VHost, ex: Exchange) -> bool:
        return any(b.dest is ex for other in vh.exchanges.values() for b in other.bindings)

    def _delete_exchange(self, vh: VHost, ex: Exchange) -> None:
        ex.deleted = True
        del vh.exchanges[ex.name]
        # Bindings from this exchange go; so do bindings to it from other exchanges.
        for b in ex.bindings:
            if isinstance(b.dest, Queue):
                _drop_queue_binding(b.dest, ex.name, b.key, b.args)
        ex.bindings.clear()
        for other in list(vh.exchanges.values()):
            if other.unbind_dest(ex):
                self._maybe_auto_delete_exchange(vh, other)

    def _maybe_auto_delete_exchange(self, vh: VHost, ex: Exchange) -> None:
        if ex.auto_delete and not ex.bindings and not ex.deleted:
            self._delete_exchange(vh, ex)

    def _ex_bind(self, conn: Connection, ch: Channel, m: Any) -> None:
        dest = self._exchange(conn, m.destination)
        src = self._exchange(conn, m.source)
        if src.name == "" or dest.name == "":
            raise ChannelError(R.ACCESS_REFUSED, "operation not permitted on the default exchange")
        src.bind(dest, m.routing_key, dict(m.arguments or {}))
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Exchange.BindOk())

    def _ex_unbind(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self._vhost(conn)
        dest = vh.exchanges.get(m.destination)
        src = vh.exchanges.get(m.source)
        if (
            src is not None
            and dest is not None
            and src.unbind(dest, m.routing_key, dict(m.arguments or {}))
        ):
            self._maybe_auto_delete_exchange(vh, src)
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Exchange.UnbindOk())

    # ------------------------------------------------------------------ queue class

    def _q_declare(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self._vhost(conn)
        name = m.queue
        if m.passive:
            if name == "":
                raise ChannelError(
                    R.NOT_FOUND, f"no previously declared queue in vhost '{vh.name}'"
                )
            q = self._queue(conn, ch, name)
        else:
            if name.startswith("amq.") and name not in vh.queues:
                raise ChannelError(
                    R.ACCESS_REFUSED, f"queue name '{name}' contains reserved prefix 'amq.*'"
                )
            if name == "":
                name = self._next_name(conn, "amq.gen-")
            existing = vh.queues.get(name)
            args = dict(m.arguments or {})
            if existing is None:
                q = Queue(
                    name=name,
                    vhost=vh.name,
                    durable=m.durable,
                    exclusive_owner=conn.id if m.exclusive else None,
                    auto_delete=m.auto_delete,
                    arguments=args,
                    last_used_ms=self.now_ms,
                )
                _apply_queue_args(q, args)
                vh.queues[name] = q
                if m.exclusive:
                    conn.exclusive_queues.append(name)
                if q.expires is not None:
                    self._expiring[(vh.name, name)] = q
                # Every queue is bound to the default exchange by its name (implicitly).
            else:
                q = existing
                self._check_exclusive(conn, q, bool(m.exclusive))
                for field, new, old in (
                    ("durable", m.durable, q.durable),
                    ("auto_delete", m.auto_delete, q.auto_delete),
                ):
                    if new != old:
                        raise ChannelError(
                            R.PRECONDITION_FAILED,
                            f"inequivalent arg '{field}' for queue '{name}' in vhost "
                            f"'{vh.name}': received {_fmt(new)} but current is {_fmt(old)}",
                        )
                for key in sorted({**args, **q.arguments}):
                    new, cur = args.get(key), q.arguments.get(key)
                    # Typed: true is not 1 (RabbitMQ compares the field-table types too).
                    if (
                        key.startswith("x-")
                        and key in _QUEUE_ARGS
                        and (new != cur or type(new) is not type(cur))
                    ):
                        # RabbitMQ names the type of a value compared with an absent one.
                        typed = new is None or cur is None
                        raise ChannelError(
                            R.PRECONDITION_FAILED,
                            f"inequivalent arg '{key}' for queue '{name}' in vhost '{vh.name}': "
                            f"received {_fmt(new, typed)} but current is {_fmt(cur, typed)}",
                        )
                q.last_used_ms = self.now_ms
        ch.last_queue = q.name
        if not m.nowait:
            self._send_method(
                conn,
                ch.id,
                commands.Queue.DeclareOk(
                    queue=q.name, message_count=len(q.messages), consumer_count=len(q.consumers)
                ),
            )

    def _q_bind(self, conn: Connection, ch: Channel, m: Any) -> None:
        q = self._queue(conn, ch, m.queue)
        ex = self._exchange(conn, m.exchange)
        if ex.name == "":
            raise ChannelError(R.ACCESS_REFUSED, "operation not permitted on the default exchange")
        args = dict(m.arguments or {})
        if ex.bind(q, m.routing_key, args):
            q.bindings.append((ex.name, m.routing_key, args))
            if ex.name == FAILOVER_EXCHANGE:
                self._publish_members(q)
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Queue.BindOk())

    def _q_unbind(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self._vhost(conn)
        q = vh.queues.get(self._queue_name(conn, ch, m.queue))
        ex = vh.exchanges.get(m.exchange)
        if m.exchange == "":
            raise ChannelError(R.ACCESS_REFUSED, "operation not permitted on the default exchange")
        if q is not None:
            self._check_exclusive(conn, q)
        if q is not None and ex is not None:
            args = dict(m.arguments or {})
            if ex.unbind(q, m.routing_key, args):
                _drop_queue_binding(q, ex.name, m.routing_key, args)
                self._maybe_auto_delete_exchange(vh, ex)
        self._send_method(conn, ch.id, commands.Queue.UnbindOk())

    def _q_purge(self, conn: Connection, ch: Channel, m: Any) -> None:
        q = self._queue(conn, ch, m.queue)
        count = len(q.messages)
        for e in q.messages:
            self._account_removed(q, e)
        q.messages.clear()
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Queue.PurgeOk(message_count=count))

    def _q_delete(self, conn: Connection, ch: Channel, m: Any) -> None:
        vh = self._vhost(conn)
        q = vh.queues.get(self._queue_name(conn, ch, m.queue))
        count = 0
        if q is not None:
            self._check_exclusive(conn, q)
            if m.if_unused and q.consumers:
                raise ChannelError(
                    R.PRECONDITION_FAILED, f"queue '{q.name}' in vhost '{vh.name}' in use"
                )
            if m.if_empty and q.messages:
                raise ChannelError(
                    R.PRECONDITION_FAILED, f"queue '{q.name}' in vhost '{vh.name}' is not empty"
                )
            count = len(q.messages)
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Queue.DeleteOk(message_count=count))
        if q is not None:
            # After delete-ok, as RabbitMQ: consumers' basic.cancel must not arrive while the
            # deleting client waits for delete-ok (py-amqp raises ConsumerCancelled then).
            self._delete_queue(q)

    def _delete_queue(self, q: Queue) -> None:
        vh = self.vhosts[q.vhost]
        q.deleted = True
        vh.queues.pop(q.name, None)
        key = (q.vhost, q.name)
        self._ttl_queues.pop(key, None)
        self._expiring.pop(key, None)
        for ex_name, _rk, _args in q.bindings:
            ex = vh.exchanges.get(ex_name)
            if ex is not None and ex.unbind_dest(q):
                self._maybe_auto_delete_exchange(vh, ex)
        q.bindings.clear()
        for c in list(q.consumers):
            ch = c.channel
            ch.consumers.pop(c.tag, None)
            self._detach_unacked(c)
            conn = ch.conn
            if conn.capabilities.get("consumer_cancel_notify") and not ch.closing:
                self._send_method(conn, ch.id, commands.Basic.Cancel(consumer_tag=c.tag))
        q.consumers.clear()
        q.ranked_consumers = 0
        for e in q.messages:
            self._account_removed(q, e)
        q.messages.clear()
        if q.exclusive_owner is not None:
            owner = self.connections.get(q.exclusive_owner)
            if owner is not None and q.name in owner.exclusive_queues:
                owner.exclusive_queues.remove(q.name)

    # ------------------------------------------------------------------ basic class

    def _b_qos(self, conn: Connection, ch: Channel, m: Any) -> None:
        if m.prefetch_size:
            raise ConnectionError_(R.NOT_IMPLEMENTED, f"prefetch_size!=0 ({m.prefetch_size})")
        if m.global_:
            ch.global_prefetch = m.prefetch_count
        else:
            ch.prefetch_count = m.prefetch_count
        self._send_method(conn, ch.id, commands.Basic.QosOk())
        self._dispatch_channel(ch)

    def _b_consume(self, conn: Connection, ch: Channel, m: Any) -> None:
        q = self._queue(conn, ch, m.queue)
        tag = m.consumer_tag or self._next_name(conn, "amq.ctag-")
        if tag in ch.consumers:
            raise ConnectionError_(R.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'")
        # RabbitMQ refuses an exclusive consumer on a single-active-consumer queue outright.
        if (q.consumers or q.single_active) and (
            m.exclusive or any(c.exclusive for c in q.consumers)
        ):
            raise ChannelError(
                R.ACCESS_REFUSED,
                f"queue '{q.name}' in vhost '{q.vhost}' in exclusive use",
            )
        args = dict(m.arguments or {})
        prio = args.get("x-priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise ChannelError(
                R.PRECONDITION_FAILED,
                f"invalid arg 'x-priority' for queue '{q.name}' in vhost '{q.vhost}': "
                f'"expected integer, got {_amqp_type(prio)}"',
            )
        c = Consumer(tag, q, ch, m.no_ack, m.exclusive, ch.prefetch_count, args)
        ch.consumers[tag] = c
        q.consumers.append(c)
        if c.priority:
            q.ranked_consumers += 1
        q.had_consumers = True
        q.last_used_ms = self.now_ms
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Basic.ConsumeOk(consumer_tag=tag))
        self._dispatch(q)

    def _b_cancel(self, conn: Connection, ch: Channel, m: Any) -> None:
        c = ch.consumers.pop(m.consumer_tag, None)
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Basic.CancelOk(consumer_tag=m.consumer_tag))
        if c is not None and self._remove_consumer(c):
            self._dispatch(c.queue)  # a next single active consumer, or a lower priority

    def _detach_unacked(self, c: Consumer) -> None:
        """A consumer goes away (cancel, channel close, queue delete): its unacked deliveries
        stay on the channel but no longer count against it, so a later consumer reusing the
        tag is not charged (and snapshots, which name consumers by tag, stay exact)."""
        if c.unacked:
            ch = c.channel
            for tag, (dq, e, dc) in ch.unacked.items():
                if dc is c:
                    ch.unacked[tag] = (dq, e, None)
            c.unacked = 0

    def _remove_consumer(self, c: Consumer) -> bool:
        """True if the queue still has consumers and ready messages: the caller dispatches it
        (the next single active consumer takes over; a lower-priority consumer may no longer
        have to wait for this one)."""
        q = c.queue
        handover = False
        self._detach_unacked(c)
        if c in q.consumers:
            idx = q.consumers.index(c)
            q.consumers.remove(c)
            if c.priority:
                q.ranked_consumers -= 1
            if idx < q.rr:
                q.rr -= 1
            if q.rr >= len(q.consumers):
                q.rr = 0
            handover = bool(q.consumers) and bool(q.messages)
        q.last_used_ms = self.now_ms
        if q.auto_delete and q.had_consumers and not q.consumers and not q.deleted:
            self._delete_queue(q)
        return handover

    def _b_get(self, conn: Connection, ch: Channel, m: Any) -> None:
        q = self._queue(conn, ch, m.queue)
        q.last_used_ms = self.now_ms
        self._expire_head(q)
        if not q.messages:
            self._send_method(conn, ch.id, commands.Basic.GetEmpty())
            return
        e = q.messages.popleft()
        ch.next_tag += 1
        tag = ch.next_tag
        if m.no_ack:
            self._account_removed(q, e)
        else:
            ch.unacked[tag] = (q, e, None)
            q.unacked += 1
        conn.last_tx_ms = self.now_ms
        if conn.emit:
            msg = e.msg
            self._emit(
                conn,
                fp.encode_get_ok(ch.id, tag, e.redelivered, msg.ex_b, msg.rk_b, len(q.messages))
                + fp.encode_content(
                    ch.id,
                    fp.with_delivery_count(msg.header, e.delivery_count)
                    if e.delivery_count
                    else msg.header,
                    msg.body,
                    conn.frame_max,
                ),
            )

    def _basic_publish(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        exchange, rk, mandatory, immediate = _fast_decode(
            fp.decode_publish, payload, "basic.publish", 40
        )
        if immediate:
            raise ConnectionError_(R.NOT_IMPLEMENTED, "immediate=true", class_id=60, method_id=40)
        ch.pending = [exchange, rk, mandatory, None, 0, []]

    def _content_header(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        pend = ch.pending
        if pend is None or pend[3] is not None:
            raise ConnectionError_(
                R.UNEXPECTED_FRAME, f"unexpected content header frame on channel {ch.id}"
            )
        try:
            info = fp.parse_content_header(payload)
        except (ValueError, IndexError) as e:
            raise ConnectionError_(R.FRAME_ERROR, f"malformed content header: {e}") from None
        if info.class_id != 60:
            raise ConnectionError_(
                R.FRAME_ERROR, f"content header for class {info.class_id}, expected 60 (basic)"
            )
        if info.body_size > self.config.max_message_size:
            ch.pending = None
            raise ChannelError(
                R.PRECONDITION_FAILED,
                f"message size {info.body_size} is larger than configured max size "
                f"{self.config.max_message_size}",
                class_id=60,
                method_id=40,
            )
        pend[3] = payload
        pend[4] = info.body_size
        pend.append(info)
        if info.body_size == 0:
            ch.pending = None
            self._publish(conn, ch, pend, b"")

    def _content_body(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        pend = ch.pending
        if pend is None or pend[3] is None:
            raise ConnectionError_(
                R.UNEXPECTED_FRAME, f"unexpected content body frame on channel {ch.id}"
            )
        remaining = pend[4] - len(payload)
        if remaining < 0:
            raise ConnectionError_(
                R.FRAME_ERROR, "content body frames exceed the size in the content header"
            )
        parts = pend[5]
        parts.append(payload)
        if remaining:
            pend[4] = remaining
            return
        ch.pending = None
        self._publish(conn, ch, pend, parts[0] if len(parts) == 1 else b"".join(parts))

    def _publish(self, conn: Connection, ch: Channel, pend: list[Any], body: bytes) -> None:
        exchange, rk, mandatory, header, _rem, _parts, info = pend
        vh = self.vhosts[conn.vhost]
        ex = vh.exchanges.get(exchange)
        if ex is None:
            raise ChannelError(
                R.NOT_FOUND,
                f"no exchange '{exchange}' in vhost '{vh.name}'",
                class_id=60,
                method_id=40,
            )
        if ex.internal:
            raise ChannelError(
                R.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{exchange}' in vhost '{vh.name}'",
                class_id=60,
                method_id=40,
            )
        if info.user_id is not None and info.user_id != conn.user:
            raise ChannelError(
                R.PRECONDITION_FAILED,
                f"user_id property set to '{info.user_id}' but authenticated user was "
                f"'{conn.user}'",
                class_id=60,
                method_id=40,
            )
        expiration_ms: int | None = None
        if info.expiration is not None:
            exp = info.expiration
            if not exp.isdigit() or not exp.isascii():
                raise ChannelError(
                    R.PRECONDITION_FAILED, f"invalid expiration '{exp}'", class_id=60, method_id=40
                )
            expiration_ms = int(exp)
        self.msg_seq += 1
        msg = Message(
            self.msg_seq,
            exchange,
            rk,
            header,
            body,
            info.delivery_mode,
            expiration_ms,
            info.headers_span,
        )
        conn.published = True
        if ch.tx:
            ch.tx_ops.append(("publish", msg, mandatory))
            return
        self._route_and_enqueue(conn, ch, vh, ex, msg, mandatory)
        if self.queued_bytes > self.config.high_watermark_bytes and not self.blocked:
            self._set_blocked(True)

    def _route_and_enqueue(
        self, conn: Connection, ch: Channel, vh: VHost, ex: Exchange, msg: Message, mandatory: bool
    ) -> None:
        queues = self._route(vh, ex, msg.routing_key, msg)
        refused = False
        if not queues:
            if mandatory:
                self._send_return(conn, ch, msg, R.NO_ROUTE, "NO_ROUTE")
        else:
            for q in queues:
                if self._enqueue(q, Entry(msg, False, None)):
                    self._dispatch(q)
                else:
                    refused = True
        if ch.confirm:
            ch.publish_seq += 1
            if refused:
                self._flush_channel_confirms(ch, upto=ch.publish_seq - 1)
                self._emit(conn, fp.encode_nack(ch.id, ch.publish_seq, False))
                self._confirmed(conn)
                ch.confirm_sent = ch.publish_seq
            else:
                ch.confirm_pending = ch.publish_seq
                if ch not in conn.confirm_dirty:
                    conn.confirm_dirty.append(ch)

    def _send_return(
        self, conn: Connection, ch: Channel, msg: Message, code: int, text: str
    ) -> None:
        conn.last_tx_ms = self.now_ms
        if conn.emit:
            self._emit(
                conn,
                pframe.marshal(
                    commands.Basic.Return(
                        reply_code=code,
                        reply_text=text,
                        exchange=msg.exchange,
                        routing_key=msg.routing_key,
                    ),
                    ch.id,
                )
                + fp.encode_content(ch.id, msg.header, msg.body, conn.frame_max),
            )

    def _flush_confirms(self, conn: Connection) -> None:
        for ch in conn.confirm_dirty:
            self._flush_channel_confirms(ch)
        conn.confirm_dirty.clear()

    def _flush_channel_confirms(self, ch: Channel, upto: int | None = None) -> None:
        """Confirm every publish settled since the last confirm with one (multiple) ack."""
        target = ch.confirm_pending if upto is None else min(upto, ch.confirm_pending)
        if target <= ch.confirm_sent:
            return
        multiple = target - ch.confirm_sent > 1
        self._emit(ch.conn, fp.encode_ack(ch.id, target, multiple))
        self._confirmed(ch.conn)
        ch.confirm_sent = target

    def _confirmed(self, conn: Connection) -> None:
        """A confirm or tx.commit-ok was just emitted for ``conn``."""
        if conn.emit:
            conn.confirm_out = True
        else:
            self.shadow_confirms += 1

    def _route(
        self, vh: VHost, ex: Exchange, rk: str, msg: Message, seen: list[Exchange] | None = None
    ) -> list[Queue]:
        if ex.name == "":
            q = vh.queues.get(rk)
            return [q] if q is not None else []
        found: list[Queue] = []
        visited: list[Exchange] = [ex]
        pending = [ex]
        while pending:
            cur = pending.pop(0)
            for dest in cur.match(rk, msg):
                if isinstance(dest, Queue):
                    if dest not in found:
                        found.append(dest)
                elif dest not in visited:
                    visited.append(dest)
                    pending.append(dest)
        if not found:
            ae_name = ex.alternate
            if ae_name is not None:
                ae = vh.exchanges.get(ae_name)
                # Alternate exchanges may form a cycle (a -> b -> a): every exchange of the
                # chain is tried once, as RabbitMQ does.
                seen = [ex] if seen is None else seen
                if ae is not None and ae not in seen:
                    seen.append(ae)
                    return self._route(vh, ae, rk, msg, seen)
        return found

    def _enqueue(self, q: Queue, e: Entry) -> bool:
        """Append to ``q``; False if the queue refused it (x-overflow reject-publish)."""
        msg = e.msg
        size = len(msg.body)
        if (q.max_length is not None or q.max_length_bytes is not None) and _over(q, size):
            if q.overflow != "drop-head":
                if q.overflow == "reject-publish-dlx":
                    self._dead_letter(q, e, "maxlen")
                return False
            while q.messages and _over(q, size):
                self._settle_dropped(q, q.messages.popleft(), "maxlen")
            if _over(q, size):
                # Does not fit even in an empty queue: it is the head that is dropped.
                if q.dlx is not None:
                    self._dead_letter(q, e, "maxlen")
                return True
        ttl = q.ttl
        exp = msg.expiration_ms
        if ttl is not None or exp is not None:
            if ttl is None:
                lim = exp
            elif exp is None:
                lim = ttl
            else:
                lim = min(ttl, exp)
            e.expires_at = self.now_ms + (lim or 0)
            self._ttl_queues[(q.vhost, q.name)] = q
        q.messages.append(e)
        q.ready_bytes += size
        self.queued_bytes += size
        return True

    def _track_ttl(self, q: Queue, e: Entry) -> None:
        if e.expires_at is not None:
            self._ttl_queues[(q.vhost, q.name)] = q

    def _account_removed(self, q: Queue, e: Entry) -> None:
        size = len(e.msg.body)
        q.ready_bytes -= size
        self.queued_bytes -= size
        if self.blocked and self.queued_bytes < (
            self.config.high_watermark_bytes * self.config.low_watermark_ratio
        ):
            self._set_blocked(False)

    @staticmethod
    def _over_delivery_limit(q: Queue, e: Entry) -> bool:
        """A message comes back to a quorum queue: count it; True if that is past its
        x-delivery-limit (the caller dead-letters it instead, as RabbitMQ's quorum queues do
        with poison messages)."""
        if not q.quorum:
            return False
        e.delivery_count += 1
        return q.delivery_limit is not None and e.delivery_count > q.delivery_limit

    def _dead_letter_over_limit(self, over: list[tuple[Queue, Entry]]) -> None:
        """``over`` was collected newest first (returns walk back from the last tag): dead-letter
        in delivery order, as the messages were published."""
        for q, e in reversed(over):
            self._settle_dropped(q, e, "delivery_limit")

    def _settle_dropped(self, q: Queue, e: Entry, reason: str) -> None:
        """A message leaves ``q`` without being consumed: dead-letter it if configured."""
        self._account_removed(q, e)
        if q.dlx is not None:
            self._dead_letter(q, e, reason)

    def _dead_letter(self, q: Queue, e: Entry, reason: str) -> None:
        vh = self.vhosts[q.vhost]
        ex = vh.exchanges.get(q.dlx or "")
        if ex is None or q.dlx is None:
            return
        msg = e.msg
        rk = q.dlrk if q.dlrk is not None else msg.routing_key
        header = _dead_letter_header(msg, q, reason, self.now_ms)
        self.msg_seq += 1
        info = fp.parse_content_header(header)
        new = Message(
            self.msg_seq, ex.name, rk, header, msg.body, info.delivery_mode, None, info.headers_span
        )
        for target in self._route(vh, ex, rk, new):
            # RabbitMQ drops a message that would dead-letter into the queue it left with the
            # same reason (a cycle) unless it was rejected explicitly.
            if target is q and reason != "rejected":
                continue
            if self._enqueue(target, Entry(new, False, None)):
                self._dispatch(target)

    # ------------------------------------------------------------------ dispatch

    def _dispatch_channel(self, ch: Channel) -> None:
        seen: list[Queue] = []
        for c in ch.consumers.values():
            if c.queue not in seen:
                seen.append(c.queue)
        for q in seen:
            self._dispatch(q)

    def _dispatch(self, q: Queue) -> None:
        msgs = q.messages
        consumers = q.consumers
        if not msgs or not consumers:
            return
        now = self.now_ms
        # A single-active-consumer queue offers messages to its eldest consumer only.
        n = 1 if q.single_active else len(consumers)
        # Consumer priorities (x-priority): the highest that can take a message gets it, in
        # turn among equals; a lower one only while all higher ones cannot (prefetch full,
        # flow off, their connection not draining), as in RabbitMQ.
        ranked = n > 1 and q.ranked_consumers > 0
        while msgs:
            e = msgs[0]
            if e.expires_at is not None and e.expires_at < now:
                msgs.popleft()
                self._settle_dropped(q, e, "expired")
                continue
            chosen: Consumer | None = None
            start = q.rr
            order: Iterable[int] = range(n)
            # The priority of a consumer whose connection waits for its first do-output grant: a
            # lower one must not take the message meanwhile (every fresh connection waits for
            # one, and whose comes first is no measure of who can take more). Out of credit
            # later, a connection has not drained what it was given: it cannot take more, and
            # lower ones may (RabbitMQ's credit flow); so a stuck client holds nobody up.
            waiting: int | None = None
            if ranked:
                order = sorted(order, key=lambda i: (-consumers[(start + i) % n].priority, i))
            for i in order:
                c = consumers[(start + i) % n]
                if waiting is not None and c.priority < waiting:
                    break
                ch = c.channel
                if not ch.flow_active or ch.closing:
                    continue
                if not c.no_ack:
                    if c.prefetch and c.unacked >= c.prefetch:
                        continue
                    if ch.global_prefetch and len(ch.unacked) >= ch.global_prefetch:
                        continue
                conn = ch.conn
                if conn.credit <= 0:
                    if not conn.want_output:
                        conn.want_output = True
                        self._effects.append(WantOutput(conn.id))
                    if ranked and waiting is None and not conn.granted:
                        waiting = c.priority
                    continue
                chosen = c
                q.rr = (start + i + 1) % n
                break
            if chosen is None:
                return
            msgs.popleft()
            self._deliver(chosen, q, e)

    def _deliver(self, c: Consumer, q: Queue, e: Entry) -> None:
        ch = c.channel
        conn = ch.conn
        ch.next_tag += 1
        tag = ch.next_tag
        conn.credit -= 1
        if c.no_ack:
            self._account_removed(q, e)
        else:
            ch.unacked[tag] = (q, e, c)
            c.unacked += 1
            q.unacked += 1
        conn.last_tx_ms = self.now_ms
        if conn.emit:
            msg = e.msg
            header = (
                fp.with_delivery_count(msg.header, e.delivery_count)
                if e.delivery_count
                else msg.header
            )
            data = fp.encode_deliver(
                ch.id, c.tag_b, tag, e.redelivered, msg.ex_b, msg.rk_b
            ) + fp.encode_content(ch.id, header, msg.body, conn.frame_max)
            if not conn.outbuf:
                self._dirty.append(conn)
            conn.outbuf.append(data)

    # ------------------------------------------------------------------ acknowledgements

    def _basic_ack(self, ch: Channel, payload: bytes) -> None:
        tag, multiple = _fast_decode(fp.decode_ack, payload, "basic.ack", 80)
        if ch.tx:
            self._check_tags(ch, tag, multiple, 80)
            ch.tx_ops.append(("ack", tag, multiple))
            return
        self._settle(ch, tag, multiple, None, 80)

    def _b_nack(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        tag, multiple, requeue = _fast_decode(fp.decode_nack, payload, "basic.nack", 120)
        if ch.tx:
            self._check_tags(ch, tag, multiple, 120)
            ch.tx_ops.append(("nack", tag, multiple, requeue))
            return
        self._settle(ch, tag, multiple, requeue, 120)

    def _b_reject(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        tag, requeue = _fast_decode(fp.decode_reject, payload, "basic.reject", 90)
        if ch.tx:
            self._check_tags(ch, tag, False, 90)
            ch.tx_ops.append(("nack", tag, False, requeue))
            return
        self._settle(ch, tag, False, requeue, 90)

    def _b_ack_method(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        # basic.ack arriving while a fast path did not apply (e.g. channel in tx).
        self._basic_ack(ch, payload)

    def _check_tags(self, ch: Channel, tag: int, multiple: bool, method_id: int) -> None:
        if multiple and tag == 0:
            return
        if tag not in ch.unacked:
            raise ChannelError(
                R.PRECONDITION_FAILED,
                f"unknown delivery tag {tag}",
                class_id=60,
                method_id=method_id,
            )

    def _settle(
        self, ch: Channel, tag: int, multiple: bool, requeue: bool | None, method_id: int
    ) -> None:
        """ack (``requeue`` None), or nack/reject with or without requeue."""
        unacked = ch.unacked
        if multiple:
            if tag == 0:
                tag = ch.next_tag
            elif tag not in unacked:
                raise ChannelError(
                    R.PRECONDITION_FAILED,
                    f"unknown delivery tag {tag}",
                    class_id=60,
                    method_id=method_id,
                )
            settled = []
            while unacked:
                t = next(iter(unacked))
                if t > tag:
                    break
                settled.append(unacked.pop(t))
        else:
            item = unacked.pop(tag, None)
            if item is None:
                raise ChannelError(
                    R.PRECONDITION_FAILED,
                    f"unknown delivery tag {tag}",
                    class_id=60,
                    method_id=method_id,
                )
            settled = [item]
        touched: list[Queue] = []
        if requeue:
            over: list[tuple[Queue, Entry]] = []
            for q, e, c in reversed(settled):
                if c is not None:
                    c.unacked -= 1
                q.unacked -= 1
                if q.deleted:
                    self._account_removed(q, e)
                    continue
                if q not in touched:
                    touched.append(q)
                if self._over_delivery_limit(q, e):
                    over.append((q, e))
                    continue
                e.redelivered = True
                put_back(q.messages, e)
                self._track_ttl(q, e)
            self._dead_letter_over_limit(over)
            touched.reverse()
        else:
            for q, e, c in settled:
                if c is not None:
                    c.unacked -= 1
                q.unacked -= 1
                if requeue is None or q.deleted:
                    self._account_removed(q, e)
                else:
                    self._settle_dropped(q, e, "rejected")
                if q not in touched:
                    touched.append(q)
        for q in touched:
            self._dispatch(q)
        if ch.global_prefetch:
            self._dispatch_channel(ch)

    def _b_recover(self, conn: Connection, ch: Channel, m: Any) -> None:
        if not m.requeue:
            raise ConnectionError_(R.NOT_IMPLEMENTED, "requeue=false")
        self._requeue_all(ch)
        if isinstance(m, commands.Basic.Recover):
            self._send_method(conn, ch.id, commands.Basic.RecoverOk())

    # ------------------------------------------------------------------ tx and confirm

    def _tx_select(self, conn: Connection, ch: Channel, m: Any) -> None:
        if ch.confirm:
            raise ChannelError(R.PRECONDITION_FAILED, "cannot switch from confirm to tx mode")
        ch.tx = True
        self._send_method(conn, ch.id, commands.Tx.SelectOk())

    def _tx_commit(self, conn: Connection, ch: Channel, m: Any) -> None:
        if not ch.tx:
            raise ChannelError(R.PRECONDITION_FAILED, "channel is not transactional")
        ops = ch.tx_ops
        ch.tx_ops = []
        vh = self.vhosts[conn.vhost]
        for op in ops:
            if op[0] == "publish":
                msg = op[1]
                ex = vh.exchanges.get(msg.exchange)
                if ex is None:
                    raise ChannelError(
                        R.NOT_FOUND, f"no exchange '{msg.exchange}' in vhost '{vh.name}'"
                    )
                self._route_and_enqueue(conn, ch, vh, ex, msg, op[2])
            elif op[0] == "ack":
                self._settle(ch, op[1], op[2], None, 80)
            else:
                self._settle(ch, op[1], op[2], op[3], 120)
        self._send_method(conn, ch.id, commands.Tx.CommitOk())
        self._confirmed(conn)
        if self.queued_bytes > self.config.high_watermark_bytes and not self.blocked:
            self._set_blocked(True)

    def _tx_rollback(self, conn: Connection, ch: Channel, m: Any) -> None:
        if not ch.tx:
            raise ChannelError(R.PRECONDITION_FAILED, "channel is not transactional")
        ch.tx_ops = []
        self._send_method(conn, ch.id, commands.Tx.RollbackOk())

    def _confirm_select(self, conn: Connection, ch: Channel, m: Any) -> None:
        if ch.tx:
            raise ChannelError(R.PRECONDITION_FAILED, "cannot switch from tx to confirm mode")
        ch.confirm = True
        if not m.nowait:
            self._send_method(conn, ch.id, commands.Confirm.SelectOk())

    # ------------------------------------------------------------------ memory mark

    def _set_blocked(self, blocked: bool) -> None:
        """Block (or unblock) publishers: connection.blocked to clients that understand it, and
        stop reading from connections that publish, so memory stays bounded."""
        self.blocked = blocked
        for conn in self.connections.values():
            if conn.state != E.OPEN:
                continue
            if conn.capabilities.get("connection.blocked"):
                if blocked and not conn.blocked_sent:
                    self._send_method(conn, 0, commands.Connection.Blocked(reason="low on memory"))
                    conn.blocked_sent = True
                elif not blocked and conn.blocked_sent:
                    self._send_method(conn, 0, commands.Connection.Unblocked())
                    conn.blocked_sent = False
            if conn.published:
                self._effects.append(Throttle(conn.id, blocked))


_RESERVED_FIELDS = (
    ("ticket", 0),
    ("insist", False),
    ("capabilities", ""),
    ("known_hosts", ""),
    ("out_of_band", "0"),
    ("channel_id", "0"),
)


def _fast_decode(decoder: Any, payload: bytes, name: str, method_id: int) -> Any:
    """Run a hand-written decoder; malformed arguments are 502 SYNTAX_ERROR, as from pamqp."""
    try:
        return decoder(payload)
    except (ValueError, IndexError) as e:
        raise ConnectionError_(
            R.SYNTAX_ERROR, f"malformed {name} arguments: {e}", class_id=60, method_id=method_id
        ) from None


def _over(q: Queue, size: int) -> bool:
    return (q.max_length is not None and len(q.messages) + 1 > q.max_length) or (
        q.max_length_bytes is not None and q.ready_bytes + size > q.max_length_bytes
    )


def _mark_closing(conn: Connection) -> None:
    for ch in conn.channels.values():
        ch.closing = True


def _fmt(v: Any, typed: bool = False) -> str:
    if v is None:
        return "none"
    text = ("'true'" if v else "'false'") if isinstance(v, bool) else f"'{v}'"
    return f"the value {text} of type '{_amqp_type(v)}'" if typed else text


def _drop_queue_binding(q: Queue, ex_name: str, key: str, args: dict[str, Any]) -> None:
    for i, (e, k, a) in enumerate(q.bindings):
        if e == ex_name and k == key and a == args:
            del q.bindings[i]
            return


# Queue arguments we implement; they must match on redeclare (RabbitMQ's equivalence check).
_QUEUE_ARGS = (
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-max-length-bytes",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-priority",
    "x-queue-type",
    "x-single-active-consumer",
    "x-delivery-limit",
)


def _apply_queue_args(q: Queue, args: dict[str, Any]) -> None:
    def invalid(key: str, why: str) -> ChannelError:
        return ChannelError(
            R.PRECONDITION_FAILED,
            f"invalid arg '{key}' for queue '{q.name}' in vhost '{q.vhost}': {why}",
        )

    def int_arg(key: str, minimum: int) -> int | None:
        if key not in args:
            return None
        v = args[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid(key, f"{{unacceptable_type,{type(v).__name__}}}")
        if v < minimum:
            raise invalid(key, f"{{value_negative,{v}}}" if v < 0 else f"{{value_zero,{v}}}")
        return v

    q.ttl = int_arg("x-message-ttl", 0)
    q.expires = int_arg("x-expires", 1)
    q.max_length = int_arg("x-max-length", 0)
    q.max_length_bytes = int_arg("x-max-length-bytes", 0)
    overflow = args.get("x-overflow", "drop-head")
    if overflow not in ("drop-head", "reject-publish", "reject-publish-dlx"):
        raise invalid("x-overflow", f"{{unknown_overflow,{overflow}}}")
    q.overflow = str(overflow)
    dlx = args.get("x-dead-letter-exchange")
    if dlx is not None and not isinstance(dlx, str):
        raise invalid("x-dead-letter-exchange", "{unacceptable_type,not a string}")
    q.dlx = dlx
    dlrk = args.get("x-dead-letter-routing-key")
    if dlrk is not None:
        if not isinstance(dlrk, str):
            raise invalid("x-dead-letter-routing-key", "{unacceptable_type,not a string}")
        if dlx is None:
            raise invalid(
                "x-dead-letter-routing-key", "Key x-dead-letter-exchange should be present"
            )
    q.dlrk = dlrk
    qtype = args.get("x-queue-type", "classic")
    if qtype not in ("classic", "quorum"):
        raise invalid("x-queue-type", f"unsupported queue type '{qtype}'")
    top = args.get("x-max-priority")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        # (RabbitMQ words this one check differently from the others.)
        raise invalid("x-max-priority", f'"expected integer, got {_amqp_type(top)}"')
    top = int_arg("x-max-priority", 0)
    if top is not None and top > MAX_PRIORITY:
        raise invalid("x-max-priority", f"{{max_value_exceeded,{top}}}")
    if top is not None and qtype == "quorum":
        # Every queue here is replicated, but an application written against us should
        # still declare on RabbitMQ, whose quorum queues refuse priorities.
        raise ChannelError(
            R.PRECONDITION_FAILED,
            f"invalid arg 'x-max-priority' for queue '{q.name}' in vhost '{q.vhost}' "
            "of queue type rabbit_quorum_queue",
        )
    q.messages = ready_messages(args)
    q.quorum = qtype == "quorum"
    if q.quorum:
        # As RabbitMQ: a quorum queue is durable and outlives its declarer.
        for bad, prop in (
            (not q.durable, "non-durable"),
            (q.exclusive_owner is not None, "exclusive-owner"),
            (q.auto_delete, "auto-delete"),
        ):
            if bad:
                raise ChannelError(
                    R.PRECONDITION_FAILED,
                    f"invalid property '{prop}' for queue '{q.name}' in vhost '{q.vhost}'",
                )
    elif "x-delivery-limit" in args:
        raise ChannelError(
            R.PRECONDITION_FAILED,
            f"invalid arg 'x-delivery-limit' for queue '{q.name}' in vhost '{q.vhost}' "
            "of queue type rabbit_classic_queue",
        )
    q.delivery_limit = int_arg("x-delivery-limit", 0)
    sac = args.get("x-single-active-consumer", False)
    if not isinstance(sac, bool):
        raise invalid("x-single-active-consumer", f"{{unacceptable_type,{_amqp_type(sac)}}}")
    q.single_active = sac


def _amqp_type(v: object) -> str:
    """The field-table type name of a decoded argument, as RabbitMQ names it in errors."""
    for t, name in (
        (bool, "bool"),
        (str, "longstr"),
        (bytes, "longstr"),
        (float, "double"),
        (dict, "table"),
        (list, "array"),
    ):
        if isinstance(v, t):
            return name
    if isinstance(v, int):
        # What the value travelled as, as pika and most clients encode a Python int.
        return "signedint" if -(1 << 31) <= v < (1 << 31) else "long"
    return "void" if v is None else type(v).__name__


def _dead_letter_header(msg: Message, q: Queue, reason: str, now_ms: int) -> bytes:
    """The content header of a dead-lettered copy: x-death added or counted up (RabbitMQ's
    format), expiration removed (kept as original-expiration). The only place we re-encode a
    client's properties; rare, so pamqp does it."""
    from pamqp import header as pheader

    ch = pheader.ContentHeader()
    ch.unmarshal(msg.header)
    props = ch.properties
    headers: dict[str, Any] = dict(props.headers or {})
    deaths: list[Any] = list(headers.get("x-death") or [])
    when = datetime.datetime.fromtimestamp(now_ms // 1000, tz=datetime.UTC)
    for i, d in enumerate(deaths):
        if isinstance(d, dict) and d.get("queue") == q.name and d.get("reason") == reason:
            d = dict(d)
            d["count"] = int(d.get("count", 0)) + 1
            d["time"] = when
            deaths.pop(i)
            deaths.insert(0, d)
            break
    else:
        deaths.insert(
            0,
            {
                "count": 1,
                "reason": reason,
                "queue": q.name,
                "time": when,
                "exchange": msg.exchange,
                "routing-keys": [msg.routing_key],
            },
        )
    headers["x-death"] = deaths
    if "x-first-death-reason" not in headers:
        headers["x-first-death-reason"] = reason
        headers["x-first-death-queue"] = q.name
        headers["x-first-death-exchange"] = msg.exchange
    if props.expiration is not None:
        # RabbitMQ keeps it in the x-death entry just added, not as a top-level header.
        if "original-expiration" not in deaths[0]:
            deaths[0]["original-expiration"] = props.expiration
        props.expiration = None
    props.headers = headers
    return bytes(ch.marshal())


# Methods a client may send on a channel, by index. Fast-path handlers take the raw payload.
_HANDLERS: dict[int, Any] = {
    commands.Channel.Open.index: Broker._ch_open,
    commands.Channel.Close.index: Broker._ch_close,
    commands.Channel.CloseOk.index: Broker._ch_close_ok,
    commands.Channel.Flow.index: Broker._ch_flow,
    commands.Channel.FlowOk.index: Broker._ch_flow_ok,
    commands.Exchange.Declare.index: Broker._ex_declare,
    commands.Exchange.Delete.index: Broker._ex_delete,
    commands.Exchange.Bind.index: Broker._ex_bind,
    commands.Exchange.Unbind.index: Broker._ex_unbind,
    commands.Queue.Declare.index: Broker._q_declare,
    commands.Queue.Bind.index: Broker._q_bind,
    commands.Queue.Unbind.index: Broker._q_unbind,
    commands.Queue.Purge.index: Broker._q_purge,
    commands.Queue.Delete.index: Broker._q_delete,
    commands.Basic.Qos.index: Broker._b_qos,
    commands.Basic.Consume.index: Broker._b_consume,
    commands.Basic.Cancel.index: Broker._b_cancel,
    commands.Basic.Publish.index: lambda self, conn, ch, p: self._basic_publish(conn, ch, p),
    commands.Basic.Get.index: Broker._b_get,
    commands.Basic.Ack.index: Broker._b_ack_method,
    commands.Basic.Reject.index: Broker._b_reject,
    commands.Basic.Nack.index: Broker._b_nack,
    commands.Basic.RecoverAsync.index: Broker._b_recover,
    commands.Basic.Recover.index: Broker._b_recover,
    commands.Tx.Select.index: Broker._tx_select,
    commands.Tx.Commit.index: Broker._tx_commit,
    commands.Tx.Rollback.index: Broker._tx_rollback,
    commands.Confirm.Select.index: Broker._confirm_select,
}
_FAST = frozenset(
    {
        commands.Basic.Publish.index,
        commands.Basic.Ack.index,
        commands.Basic.Reject.index,
        commands.Basic.Nack.index,
    }
)
_NOT_IMPLEMENTED: frozenset[int] = frozenset()

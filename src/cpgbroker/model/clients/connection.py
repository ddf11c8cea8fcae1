"""The connection protocol: the handshake, frames, and connections opening and closing.

Theory of operation
-------------------
:class:`ConnectionProtocol` is the only writer of the broker's ``connections`` dict (the broker
creates the dict, so the components that only read it can be given it first). It owns:

* the handshake state machine (``Connection.state``: protocol header, start-ok, tune-ok,
  open, then OPEN; CLOSING after we sent connection.close; CLOSED), with the handshake and
  close timeouts and the heartbeats that ticks act on, through :class:`Deadlines` (derived
  state: a tick costs the connections that are due, not every connection);
* cutting a client's bytes into frames (the connection's :class:`FrameReader`) and routing
  each frame: ``basic.publish`` and ``basic.ack`` on an open channel straight to their fast
  handlers (delivery, consumers), content frames to delivery, channel 0 to the connection
  class here, every other method to the channel protocol (``channel.py``);
* the one boundary where a client's error becomes a close (``on_data``): a channel error
  closes its channel, a connection error the connection, a frame error the socket at once
  (frame boundaries are lost). Errors are handled per frame, so how TCP chunked a client's
  bytes never changes the outcome;
* giving back what a closing connection holds (its channels' deliveries, its exclusive
  queues).

It never routes or delivers a message itself.
"""

from __future__ import annotations

from typing import Any

from pamqp import commands, decode

from cpgbroker.errors import (
    AMQPError,
    ChannelError,
    ConnectionError_,
    FrameError,
    InvariantError,
    ReplyCode,
)
from cpgbroker.model.access.auth import password_ok
from cpgbroker.model.clients.channel import CONNECTION_CLASS, Channels, decode_method, method_name
from cpgbroker.model.clients.deadlines import Deadlines
from cpgbroker.model.config import BrokerConfig, User

# Connection states as module names: compared per frame, and a global is one lookup less.
from cpgbroker.model.entities import (
    AWAIT_HEADER,
    AWAIT_OPEN,
    AWAIT_START_OK,
    AWAIT_TUNE_OK,
    CLOSED,
    CLOSING,
    OPEN,
    Connection,
)
from cpgbroker.model.events import ClientConnected, LoginRefused
from cpgbroker.model.federation import SERVER_ID_PROPERTY
from cpgbroker.model.messages.confirms import Confirms
from cpgbroker.model.messages.consumers import Consumers
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.output import Clock, Output
from cpgbroker.model.resources.limits import check_connection_open
from cpgbroker.model.resources.memory import MemoryMark
from cpgbroker.model.resources.queueflow import QueueFlow
from cpgbroker.model.routing.topology import Topology
from cpgbroker.model.versions import LONG_VHOST_NAMES, ModelVersion
from cpgbroker.wire.fastpath import BASIC_ACK, BASIC_PUBLISH, method_index
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
from cpgbroker.wire.tables import TableError, check_table

R = ReplyCode

_M = commands
IDX_CONNECTION_START_OK = _M.Connection.StartOk.index
IDX_CONNECTION_TUNE_OK = _M.Connection.TuneOk.index
IDX_CONNECTION_OPEN = _M.Connection.Open.index
IDX_CONNECTION_CLOSE = _M.Connection.Close.index
IDX_CONNECTION_CLOSE_OK = _M.Connection.CloseOk.index
IDX_CONNECTION_UPDATE_SECRET = _M.Connection.UpdateSecret.index

# The method each handshake state waits for.
_EXPECTED = {
    AWAIT_START_OK: IDX_CONNECTION_START_OK,
    AWAIT_TUNE_OK: IDX_CONNECTION_TUNE_OK,
    AWAIT_OPEN: IDX_CONNECTION_OPEN,
}

# RabbitMQ's names of the connection states, for its "unexpected method" text.
_STATE_NAMES = {
    AWAIT_START_OK: "starting",
    AWAIT_TUNE_OK: "tuning",
    AWAIT_OPEN: "opening",
    OPEN: "running",
}


# How long (ms of cluster time) a connection we closed may take to answer close-ok.
CLOSE_TIMEOUT_MS = 3000
# How long a client may take from TCP connect to connection.open (RabbitMQ: 10 s).
HANDSHAKE_TIMEOUT_MS = 10000
# connection.start's mechanisms. Over TLS also EXTERNAL (a client certificate names the user),
# as RabbitMQ offers it on every TLS connection, with or without a certificate: a client that
# asks for it without one is then refused with a reason in the log, rather than failing to
# agree on a mechanism.
MECHANISMS = "PLAIN AMQPLAIN"
MECHANISMS_TLS = "PLAIN AMQPLAIN EXTERNAL"
# Why an EXTERNAL login with no name from a verified certificate is refused (logged).
NO_CERT_USER = "connection peer presented no verified TLS (x.509) certificate with a name"
# RabbitMQ's text for every refused login: the details go to the log only.
_REFUSED_TEXT = (
    "Login was refused using authentication mechanism {}. For details see the broker logfile."
)

SERVER_CAPABILITIES = {
    "publisher_confirms": True,
    "exchange_exchange_bindings": True,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "consumer_priorities": False,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
    "direct_reply_to": True,
}


def server_properties(cfg: BrokerConfig, member_urls: tuple[str, ...]) -> dict[str, Any]:
    """connection.start's server-properties (also what a hot-standby backup shows the clients
    it turns away: runtime/replication/standby.py)."""
    props: dict[str, Any] = {
        "product": cfg.product,
        "version": cfg.version,
        "platform": "Python",
        "copyright": "cpgbroker contributors",
        "information": "AMQP 0-9-1 broker on corosync CPG",
        "capabilities": dict(SERVER_CAPABILITIES),
        "cluster_name": cfg.cluster_name or "standalone",
    }
    if cfg.server_id:
        # Federation peers compare it with their own (model/federation.py).
        props[SERVER_ID_PROPERTY] = cfg.server_id
    if member_urls:
        props["cluster_members"] = " ".join(member_urls)
    return props


def mark_closing(conn: Connection) -> None:
    """Every channel of ``conn`` is going: none may be handed what another gives back."""
    for ch in conn.channels.values():
        ch.closing = True


class ConnectionProtocol:
    __slots__ = (
        "_basic_ack",
        "_basic_publish",
        "_channel_error",
        "_channel_method",
        "_channels",
        "_clock",
        "_config",
        "_content_body",
        "_content_header",
        "_flow",
        "_flush_confirms",
        "_mark",
        "_out",
        "_send_method",
        "_topology",
        "_users",
        "_version",
        "connections",
        "deadlines",
    )

    def __init__(
        self,
        config: BrokerConfig,
        connections: dict[int, Connection],
        clock: Clock,
        out: Output,
        mark: MemoryMark,
        topology: Topology,
        delivery: Delivery,
        consumers: Consumers,
        confirms: Confirms,
        channels: Channels,
        flow: QueueFlow,
        users: dict[str, User],
        version: ModelVersion,
    ) -> None:
        self._config = config
        # The cluster's model version (read at every use: it moves up at an event).
        self._version = version
        self._flow = flow
        # The broker's users (model/access/users.py owns the dict and changes it in place).
        self._users = users
        self.connections = connections
        self._clock = clock
        self._out = out
        self._mark = mark
        self._topology = topology
        topology.limits.configure(config, users)
        self._channels = channels
        # Bound once: the per-frame routes.
        self._send_method = out.send_method
        self._basic_publish = delivery.basic_publish
        self._content_header = delivery.content_header
        self._content_body = delivery.content_body
        self._basic_ack = consumers.basic_ack
        self._channel_method = channels.channel_method
        self._channel_error = channels.channel_error
        self._flush_confirms = confirms.flush
        # Derived (see Deadlines); filled as connections open or are restored.
        self.deadlines = Deadlines()

    # ------------------------------------------------------------------ opening

    def on_connected(self, ev: ClientConnected) -> None:
        if ev.conn in self.connections:
            raise InvariantError(f"connection {ev.conn} opened twice")
        now = self._clock.now_ms
        conn = Connection(
            id=ev.conn,
            member=ev.member,
            peer=ev.peer,
            loopback=ev.loopback,
            reader=FrameReader(self._config.frame_max),
            tls=ev.tls,
            cert_user=ev.cert_user,
            last_rx_ms=now,
            last_tx_ms=now,
            close_deadline=now + HANDSHAKE_TIMEOUT_MS,
        )
        self.connections[ev.conn] = conn
        self.deadlines.add(conn)

    def restore(self, conn: Connection) -> None:
        """Install a connection restored from a snapshot (``snapshot.Restorer``, in the
        snapshot's connection order: the deadlines are rebuilt as they go)."""
        if conn.id in self.connections:
            raise InvariantError(f"connection {conn.id} restored twice")
        self.connections[conn.id] = conn
        self._topology.limits.restore_connection(conn)
        self.deadlines.add(conn)

    # ------------------------------------------------------------------ bytes and frames

    def on_data(self, conn_id: int, data: bytes) -> None:
        conn = self.connections.get(conn_id)
        if conn is None or conn.state == CLOSED:
            return
        conn.last_rx_ms = self._clock.now_ms
        if conn.state == AWAIT_HEADER:
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
            conn.state = AWAIT_START_OK
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
                self.connection_error(conn, e)
                self.drop(conn, f"frame error: {e.text}", notify=True)
                return
            except ConnectionError_ as e:
                self.connection_error(conn, e)
            if conn.state == CLOSED:
                return
        if conn.confirm_dirty:
            self._flush_confirms(conn)

    def _on_frame(self, conn: Connection, ftype: int, ch: int, payload: bytes) -> None:
        if ftype == FRAME_METHOD:
            if len(payload) < 4:
                raise ConnectionError_(R.FRAME_ERROR, "method frame shorter than 4 bytes")
            index = method_index(payload)
            if conn.state == OPEN and ch != 0:
                channel = conn.channels.get(ch)
                if channel is not None and not channel.closing and channel.pending is None:
                    if index == BASIC_PUBLISH:
                        self._basic_publish(conn, channel, payload)
                        return
                    if index == BASIC_ACK:
                        self._basic_ack(channel, payload)
                        return
                self._channel_method(conn, ch, index, payload)
                return
            if ch == 0:
                self._connection_method(conn, index, payload)
                return
            if conn.state == CLOSING:
                return
            # RabbitMQ 3.10.8: a frame on a channel before connection.open is out of place, 505
            # (as a content frame is, below).
            raise ConnectionError_(
                R.UNEXPECTED_FRAME,
                f"unexpected {method_name(index)} on channel {ch} before connection.open",
            )
        if ftype == FRAME_HEARTBEAT:
            # As RabbitMQ: a heartbeat with a payload is malformed (501); a well-formed one on
            # a channel other than 0 is a frame out of place (505).
            if payload:
                raise FrameError(f"heartbeat frame with a {len(payload)}-byte payload")
            if ch != 0:
                if conn.state == CLOSING:
                    return
                raise ConnectionError_(R.UNEXPECTED_FRAME, f"heartbeat frame on channel {ch}")
            return
        if conn.state != OPEN:
            if conn.state == CLOSING:
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

    def _bad_header(self, conn: Connection) -> None:
        # Spec 4.2.2: answer a bad protocol header with our own header, then close.
        self._out.emit(conn, PROTOCOL_HEADER)
        self.drop(conn, "bad AMQP protocol header", notify=True)

    # ------------------------------------------------------------------ connection class

    def _connection_method(self, conn: Connection, index: int, payload: bytes) -> None:
        state = conn.state
        if state == CLOSING:
            if index == IDX_CONNECTION_CLOSE_OK:
                self.drop(conn, "connection closed", notify=True)
            elif index == IDX_CONNECTION_CLOSE:
                self._send_method(conn, 0, commands.Connection.CloseOk())
                self.drop(conn, "connection closed", notify=True)
            return
        if index >> 16 != CONNECTION_CLASS:
            # RabbitMQ (and the spec's "work with a channel that had not been correctly
            # opened"): 504 CHANNEL_ERROR.
            raise _unexpected(state, index)
        if index == IDX_CONNECTION_OPEN and self._version.at_least(LONG_VHOST_NAMES):
            # A virtual host name may be any short string, up to 255 bytes, as in RabbitMQ
            # (pamqp holds it to 127 characters: model version 7).
            m = decode_method(payload, index, unchecked=("virtual_host",))
        else:
            m = decode_method(payload, index)
        if index == IDX_CONNECTION_CLOSE:
            self._release(conn)
            self._send_method(conn, 0, commands.Connection.CloseOk())
            self.drop(conn, "client closed the connection", notify=True)
            return
        if index == IDX_CONNECTION_UPDATE_SECRET and state == OPEN:
            # RabbitMQ extension (10.70): users here have no expiring credentials, so, as
            # RabbitMQ's internal user store, acknowledge it.
            self._send_method(conn, 0, commands.Connection.UpdateSecretOk())
            return
        if index != _EXPECTED.get(state):
            # RabbitMQ 3.10.8 answers 504 here too, in every state it answers at all (before
            # tune-ok it closes the socket after 3 s without a word; we say why).
            raise _unexpected(state, index)
        if state == AWAIT_START_OK:
            self._start_ok(conn, m)
        elif state == AWAIT_TUNE_OK:
            self._tune_ok(conn, m)
        else:
            self._open(conn, m)

    def _send_start(self, conn: Connection) -> None:
        props = server_properties(self._config, self._topology.member_urls)
        self._send_method(
            conn,
            0,
            commands.Connection.Start(
                server_properties=props,
                mechanisms=MECHANISMS_TLS if conn.tls else MECHANISMS,
                locales="en_US",
            ),
        )

    def _start_ok(self, conn: Connection, m: Any) -> None:
        props = m.client_properties or {}
        conn.client_properties = dict(props)
        server_id = self._config.server_id
        if server_id and props.get(SERVER_ID_PROPERTY) == server_id:
            # A federation link from a cluster that calls itself what this one is called:
            # one of the two is misconfigured, and messages would loop between "itself".
            # Refused loudly (the owner logs it, the link's side reports the close).
            why = f"duplicate server id '{server_id}': a federation peer uses this cluster's own"
            self._out.effect(LoginRefused(conn.id, "", str(m.mechanism), why))
            self.connection_error(conn, ConnectionError_(R.NOT_ALLOWED, why))
            return
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
            # An unauthenticated client's table: checked iteratively before pamqp sees it.
            data = len(raw).to_bytes(4, "big") + raw
            try:
                check_table(data, 0, len(data))
            except TableError:
                user = None
            else:
                table = decode.field_table(data)[1]
                user, password = str(table.get("LOGIN")), str(table.get("PASSWORD"))
        elif mechanism == "EXTERNAL" and conn.tls:
            # The certificate proved who the client is; its response is not looked at, and
            # the user's password is not checked (RabbitMQ's rabbitmq_auth_mechanism_ssl).
            user = conn.cert_user
            if not user:
                self._out.effect(LoginRefused(conn.id, "", "EXTERNAL", NO_CERT_USER))
                self._refuse_login(conn, _REFUSED_TEXT.format(mechanism))
                return
        else:
            self._out.effect(LoginRefused(conn.id, "", str(mechanism), "unsupported mechanism"))
            self._refuse_login(conn, f"unsupported authentication mechanism '{mechanism}'")
            return
        u = self._users.get(user or "")
        why = ""
        if user is None:
            why = "malformed credentials"
        elif u is None:
            why = "no such user"
        elif mechanism != "EXTERNAL" and not password_ok(u, password or ""):
            why = "wrong password"
        elif u.loopback_only and not conn.loopback:
            why = "user may only connect via localhost"
        if why:
            # The owner logs who and why; the client is told to look there.
            self._out.effect(LoginRefused(conn.id, user or "", str(mechanism), why))
            self._refuse_login(conn, _REFUSED_TEXT.format(mechanism))
            return
        assert u is not None
        conn.user = u.name
        cfg = self._config
        self._send_method(
            conn,
            0,
            commands.Connection.Tune(
                channel_max=cfg.channel_max, frame_max=cfg.frame_max, heartbeat=cfg.heartbeat
            ),
        )
        conn.state = AWAIT_TUNE_OK

    def _refuse_login(self, conn: Connection, text: str) -> None:
        self.connection_error(conn, ConnectionError_(R.ACCESS_REFUSED, text))

    def _tune_ok(self, conn: Connection, m: Any) -> None:
        cfg = self._config
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
        conn.state = AWAIT_OPEN
        self.deadlines.schedule(conn)  # heartbeats may now be due before the handshake timeout

    def _open(self, conn: Connection, m: Any) -> None:
        vhost = m.virtual_host or "/"
        if vhost not in self._topology.vhosts:
            raise ConnectionError_(R.NOT_ALLOWED, f"vhost {vhost} not found")
        user = self._users.get(conn.user)
        # (A user deleted since it logged in opens nothing.)
        if user is None or not user.may_open(vhost):
            raise ConnectionError_(
                R.NOT_ALLOWED, f"access to vhost '{vhost}' refused for user '{conn.user}'"
            )
        limits = self._topology.limits
        check_connection_open(limits, conn, vhost)
        conn.vhost = vhost
        limits.connection_opened(conn)
        conn.state = OPEN
        conn.close_deadline = None
        self._send_method(conn, 0, commands.Connection.OpenOk())
        if self._mark.blocked and conn.capabilities.get("connection.blocked"):
            self._send_method(conn, 0, commands.Connection.Blocked(reason=self._mark.reason))
            conn.blocked_sent = True

    # ------------------------------------------------------------------ closing

    def connection_error(self, conn: Connection, e: AMQPError) -> None:
        """A connection exception: connection.close with its reply code; everything the
        connection holds is given back now, and it has CLOSE_TIMEOUT_MS to answer."""
        if conn.state >= CLOSING:
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
        self._release(conn)
        conn.state = CLOSING
        conn.close_deadline = self._clock.now_ms + CLOSE_TIMEOUT_MS
        self.deadlines.schedule(conn)

    def close(self, conn_id: int, code: int, text: str) -> None:
        """Close a client (shutdown, quorum loss, a failed event): connection.close if it is
        open, else the socket at once."""
        conn = self.connections.get(conn_id)
        if conn is not None:
            if conn.state == OPEN:
                self.connection_error(conn, ConnectionError_(ReplyCode(code), text))
            else:
                self.drop(conn, text, notify=True)

    def _release(self, conn: Connection) -> None:
        """Give back everything the connection holds: unacked messages are requeued, consumers
        cancelled, exclusive queues deleted (spec: when the connection closes)."""
        # Its channels are all going: no consumer on one may be handed what another one gives
        # back (a single-active-consumer queue's takeover, a requeue's dispatch).
        mark_closing(conn)
        release_channel = self._channels.release_channel
        for ch in list(conn.channels.values()):
            release_channel(ch)
        self._topology.limits.channels_closed(conn, len(conn.channels))
        conn.channels.clear()
        self._topology.delete_exclusive(conn)
        conn.confirm_dirty.clear()

    def drop(self, conn: Connection, reason: str, *, notify: bool) -> None:
        """``conn`` is gone: released if it was not yet, forgotten, and its socket closed if
        ``notify`` (else its owner already knows: deliver-close, a member leaving)."""
        if conn.state != CLOSED:
            self._release(conn)
            conn.state = CLOSED
        del self.connections[conn.id]
        self.deadlines.remove(conn.id)
        if conn.flow_pauses:
            self._flow.forget(conn)
        self._topology.limits.connection_gone(conn)
        if notify:
            self._out.close_socket(conn, reason)
        else:
            conn.outbuf.clear()

    def disconnected(self, conn_id: int, reason: str) -> None:
        """deliver-close: the client's socket closed."""
        conn = self.connections.get(conn_id)
        if conn is not None:
            self.drop(conn, reason, notify=False)

    def member_left(self, member: int) -> None:
        """A cluster member left: its clients are gone, and what they held comes back."""
        gone = [c for c in self.connections.values() if c.member == member]
        for conn in gone:
            mark_closing(conn)  # none of them may take over what another gives back
        for conn in gone:
            self.drop(conn, "cluster member left", notify=False)

    # ------------------------------------------------------------------ time

    def on_tick(self) -> None:
        """Handshake and close timeouts, and heartbeats both ways: for the connections that
        are due (``Deadlines``), in ``connections`` order, as a sweep of every connection
        would act (what one does cannot make another due in the same tick: it can only send
        to it, or give it a close timeout in the future)."""
        now_ms = self._clock.now_ms
        deadlines = self.deadlines
        connections = self.connections
        for conn in deadlines.pop_due(now_ms, connections):
            if connections.get(conn.id) is not conn:
                continue  # gone since (nothing drops another connection today)
            self._tick(conn, now_ms)
            if conn.state != CLOSED:
                deadlines.schedule(conn)

    def _tick(self, conn: Connection, now_ms: int) -> None:
        """What a tick does for one connection (what the sweep did for every one)."""
        if conn.state != OPEN:
            if conn.close_deadline is not None and now_ms >= conn.close_deadline:
                self.drop(
                    conn,
                    "no close-ok from client" if conn.state == CLOSING else "handshake timeout",
                    notify=True,
                )
                return
            if conn.state == CLOSING:
                return
        hb = conn.heartbeat * 1000
        if hb <= 0:
            return
        if now_ms - conn.last_rx_ms > 2 * hb:
            # Spec 4.2.7: a peer silent for two heartbeat intervals is gone.
            self.drop(
                conn, f"missed heartbeats from client, timeout: {conn.heartbeat}s", notify=True
            )
            return
        if now_ms - conn.last_tx_ms >= hb // 2:
            self._out.emit(conn, HEARTBEAT_FRAME)


def _unexpected(state: int, index: int) -> ConnectionError_:
    """A method on channel 0 that the connection's state does not take: RabbitMQ's 504."""
    return ConnectionError_(
        R.CHANNEL_ERROR,
        f"unexpected method in connection state {_STATE_NAMES.get(state, str(state))}",
        class_id=index >> 16,
        method_id=index & 0xFFFF,
    )

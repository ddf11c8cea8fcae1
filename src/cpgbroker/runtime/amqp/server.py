"""The trio runtime: TCP listeners, one reader and one writer task per client, the ticker, and
the sequencer that feeds ordered events to the model.

A :class:`AmqpServer` does client I/O only: it is *given* the sequencer its events go to and, in a
cluster, the confirm gate its confirms wait in. Standalone, the sequencer is trivial
(:class:`LocalSequencer`): an event is applied the moment it is submitted (trio runs one task at
a time, so submissions are already totally ordered). A cluster member gives it the CPG
multicaster (``runtime/ring/multicast.py``: the event is applied when CPG delivers it back, and
the member hands the effects to :meth:`AmqpServer.execute`) and its confirm gate
(``runtime/amqp/confirms.py``); nothing here changes.

Flow control, end to end:
* Reading: a connection's reader submits what it reads and reads again; while the model has
  told us to pause (memory mark, :class:`Throttle`) it stops reading, so TCP pushes back.
* Writing: the model only allocates deliveries against do-output credit. The writer grants
  credit (:class:`DoOutput`) once the socket has taken what was queued, sized by how fast the
  client drains: it doubles while the client keeps up and halves when bytes pile up.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeAlias

import trio

from cpgbroker import __version__
from cpgbroker.cluster.codec import conn_id
from cpgbroker.errors import ReplyCode
from cpgbroker.model import NEWEST, OLDEST, Broker, snapshot
from cpgbroker.model.events import (
    AdminReply,
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    CloseConnection,
    DoOutput,
    Effect,
    Event,
    LoginRefused,
    Send,
    Throttle,
    Tick,
    WantOutput,
)
from cpgbroker.runtime.admin.admindesk import AdminDesk
from cpgbroker.runtime.config.settings import ServerConfig, parse_listen
from cpgbroker.runtime.config.tls import (
    TlsConfig,
    TlsListener,
    TlsStream,
    cert_identity,
    server_context,
)

log = logging.getLogger("cpgbroker.server")

# Bytes asked of the kernel per read: large enough to carry many small frames per event.
RECV_SIZE = 256 * 1024
# Reads of one client that may be in flight (multicast, not yet delivered back) at once.
READ_CREDIT = 4
# Grant more do-output credit only when fewer than this many bytes wait for the socket.
OUTPUT_LOW_WATER = 256 * 1024
CREDIT_MIN = 4
CREDIT_START = 64
CREDIT_MAX = 4096
# Bytes of deliveries one grant may produce: bounds what a slow client makes us buffer.
GRANT_BYTES = 1024 * 1024
# After the last output of a closed connection (connection.close-ok, or our connection.close),
# how long we go on reading and discarding what the client still sends before closing the
# socket. A client may have written frames after its connection.close (publishes queued
# behind it): closing a socket with unread input sends a reset, which makes the client's
# writes fail and can destroy the close-ok still unread in its receive buffer. RabbitMQ
# reads on until the client closes; a client that never does is cut after this long.
CLOSE_LINGER = 1.0
# The longest certificate user name a connection carries (bytes): a DN is far shorter, and
# the name travels in every member's stream (a longer one logs in as no one).
MAX_CERT_USER = 4096

# A client's stream: TCP, or TLS over TCP (an amqps listener).
ClientStream: TypeAlias = "trio.SocketStream | TlsStream"


class LocalConn:
    """A client connected to this process."""

    __slots__ = (
        "close_reason",
        "closing",
        "credit",
        "credit_back",
        "eof",
        "fd",
        "held",
        "id",
        "inflight",
        "model_closed",
        "out",
        "out_before_pause",
        "paused",
        "peer",
        "resume",
        "sending",
        "stream",
        "tls",
        "wake",
        "want_output",
        "written",
    )

    def __init__(self, conn_id: int, stream: ClientStream, peer: str) -> None:
        self.id = conn_id
        self.stream = stream
        self.peer = peer
        self.out = bytearray()
        # While the server's output is paused: how much of ``out`` was queued before (whole
        # frames), all a close may still send (AmqpServer.pause_output).
        self.out_before_pause = 0
        self.wake = trio.Event()
        self.want_output = False
        self.credit = CREDIT_START
        self.paused = False
        self.resume = trio.Event()
        self.closing = False
        self.close_reason = ""
        # The model already forgot this connection (it closed it): no deliver-close needed.
        self.model_closed = False
        # The client closed its side, or the socket broke: nothing more to read or write.
        self.eof = False
        # Bytes written since the last do-output grant: sizes the next grant.
        self.written = 0
        # Reads submitted but not yet applied (a cluster member waits for its own events to
        # come back through CPG); the reader stops while READ_CREDIT are in flight.
        self.inflight = 0
        self.credit_back = trio.Event()
        # ``AmqpServer.write`` writes straight to the socket (fd), or encrypts and writes (tls).
        self.tls = stream if isinstance(stream, TlsStream) else None
        self.fd = -1 if self.tls is not None else stream.socket.fileno()
        # The writer task is inside send_all: only it may write until it is done.
        self.sending = False
        # Output waiting, in order, for its event to become stable (cluster members only):
        # (seq it waits for or 0, bytes, or None and a close reason for a held close, whether
        # it also waits for the stores). Only the confirm gate changes it; the node tests it.
        self.held: list[tuple[int, bytes | None, str, bool]] = []


class Sequencer(Protocol):
    """Where a node's events go. ``deferred``: they take effect later (multicast, applied on
    delivery), so the node counts each connection's reads in flight (:data:`READ_CREDIT`)."""

    deferred: bool

    def submit(self, ev: Event) -> Awaitable[None]: ...


class ConfirmGate(Protocol):
    """Holds a connection's output from a confirm on until its event is stable (a cluster
    member's ``runtime/amqp/confirms.py``); standalone there is none, and confirms go out at
    once."""

    def hold(self, lc: LocalConn, eff: Send) -> None: ...

    def hold_close(self, lc: LocalConn, reason: str) -> None: ...


class LocalSequencer:
    """The standalone sequencer: apply at once, in submission order."""

    deferred = False

    def __init__(self, broker: Broker, execute: Callable[[list[Effect]], None]) -> None:
        self.broker = broker
        self._apply = broker.apply
        self._execute = execute

    async def submit(self, ev: Event) -> None:
        self._execute(self._apply(ev))


class AmqpServer:
    """Client I/O of this process: accepts connections, reads what clients send and hands it to
    the sequencer, and executes the model's effects for its own connections (writes, closes,
    do-output, throttling). Owns the local connections; never applies an event itself."""

    def __init__(
        self,
        config: ServerConfig,
        member: int = 0,
        *,
        sequencer: Sequencer | None = None,
        gate: ConfirmGate | None = None,
        conn_counter: int = 0,
    ) -> None:
        self.config = config
        self.member = member
        self.local: dict[int, LocalConn] = {}
        # Connection ids stay unique when the same process rejoins with the same member id.
        self.conn_counter = conn_counter
        self._last_tick = 0
        self.all_closed = trio.Event()
        self.all_closed.set()
        # A local client was handed output since the cluster layer last looked: its answer
        # (an ack for a delivery, the next command after a reply) is probably on its way.
        self.answer_expected = False
        # No client is written to (pause_output): a hot-standby primary in doubt.
        self.output_paused = False
        # Every client handler's cancel scope: the member process cancels what is left of
        # them when an incarnation ends.
        self.client_scopes: dict[int, trio.CancelScope] = {}
        self.standalone: LocalSequencer | None = None
        # Operators' changes (runtime/admin/admindesk.py): a cluster member gives the node its own.
        self.desk: AdminDesk | None = None
        if sequencer is None:
            sequencer = self.standalone = LocalSequencer(Broker(config.broker), self.execute)
            broker = self.standalone.broker
            self.desk = AdminDesk(member, sequencer.submit, lambda: broker.event_seq)
        self.submit = sequencer.submit
        self._count_reads = sequencer.deferred
        self._gate = gate
        # Bound once: called per confirm while the gate is on.
        self._hold = None if gate is None else gate.hold

    def new_conn_id(self) -> int:
        # Unique across a cluster: the member id in the high bits, a counter below.
        self.conn_counter += 1
        return conn_id(self.member, self.conn_counter)

    def execute(self, effects: list[Effect]) -> None:
        local = self.local
        hold = self._hold
        for eff in effects:
            lc = local.get(eff.conn)
            if lc is None:
                # A shadow connection (its owner writes its output), or no connection at all:
                # an operator's answer, for the member that asked.
                if type(eff) is AdminReply and self.desk is not None:
                    self.desk.answered(eff)
                continue
            # type(eff) is ...: mypy narrows the effect by it, as it does not by a saved type.
            if type(eff) is Send:
                if hold is not None and (lc.held or eff.confirm or eff.delivery_waits):
                    # A confirm (shipping changes: some deliveries too) waits until its event
                    # is stable; anything after it for the same connection waits behind it.
                    hold(lc, eff)
                    continue
                self.write(lc, eff.data)
                self.answer_expected = True
            elif type(eff) is WantOutput:
                lc.want_output = True
                lc.wake.set()
            elif type(eff) is CloseConnection:
                lc.model_closed = True
                if lc.held:
                    # After the held output, like every close: whole frames, in order.
                    assert self._gate is not None
                    self._gate.hold_close(lc, eff.reason)
                    continue
                self.begin_close(lc, eff.reason)
            elif type(eff) is LoginRefused:
                # Who and why, never the secret (the client was told to see the log).
                log.warning(
                    "login refused conn=%s peer=%s user=%r mechanism=%s reason=%r",
                    eff.conn,
                    lc.peer,
                    eff.user,
                    eff.mechanism,
                    eff.why,
                )
            elif type(eff) is Throttle:
                lc.paused = eff.paused
                if not lc.paused:
                    lc.resume.set()
                    lc.resume = trio.Event()

    def begin_close(self, lc: LocalConn, reason: str) -> None:
        """The writer closes ``lc`` once what is queued for it is written."""
        lc.closing = True
        lc.close_reason = reason
        lc.wake.set()

    def read_done(self, conn: int) -> None:
        """A read of local connection ``conn`` came back from the sequencer: one more may go."""
        lc = self.local.get(conn)
        if lc is not None:
            lc.inflight -= 1
            lc.credit_back.set()

    def write(self, lc: LocalConn, data: bytes) -> None:
        """Write now rather than one scheduling round later: the socket is non-blocking, and
        whatever it does not take goes to the writer task (in order, after what it holds)."""
        if not lc.out and not lc.closing and not self.output_paused:
            if lc.fd >= 0:
                if not lc.sending:
                    try:
                        n = os.write(lc.fd, data)
                    except OSError:
                        n = 0  # would block, or an error the writer task meets and acts on
                    lc.written += n
                    if n == len(data):
                        return
                    data = data[n:]
            elif lc.tls is not None and lc.tls.send_nowait(data):
                # Encrypted behind everything before it, even while the writer is sending
                # (it sends all the stream's ciphertext); the rest waits for the writer.
                lc.written += len(data)
                if lc.tls.unsent:
                    lc.wake.set()
                return
        lc.out += data
        lc.wake.set()

    def now_ms(self) -> int:
        # Cluster time is wall-clock milliseconds (x-death carries it as a timestamp), made
        # monotonic here so a clock step back never reaches the model.
        self._last_tick = max(self._last_tick, time.time_ns() // 1_000_000)
        return self._last_tick

    # -- per connection
    async def handle(self, stream: ClientStream) -> None:
        try:
            peer_addr = stream.socket.getpeername()
        except OSError:
            return
        host = str(peer_addr[0])
        peer = f"[{host}]:{peer_addr[1]}" if ":" in host else f"{host}:{peer_addr[1]}"
        try:
            loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
        except ValueError:
            loopback = False
        tls = isinstance(stream, TlsStream)
        cert_user = ""
        if isinstance(stream, TlsStream):
            assert self.config.tls is not None
            got = await tls_handshake(stream, self.config.tls, peer)
            if got is None:
                return
            cert_user = got
        lc = LocalConn(self.new_conn_id(), stream, peer)
        self.local[lc.id] = lc
        self.all_closed = trio.Event()
        log.info("connection accepted conn=%s peer=%s tls=%s", lc.id, peer, tls)
        with trio.CancelScope() as scope:
            key = id(scope)
            self.client_scopes[key] = scope
            try:
                await self._serve(
                    lc, ClientConnected(lc.id, self.member, peer, loopback, tls, cert_user)
                )
            finally:
                del self.client_scopes[key]

    async def _serve(self, lc: LocalConn, connected: ClientConnected) -> None:
        stream = lc.stream
        try:
            await self.submit(connected)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader, lc, nursery.cancel_scope)
                await self._writer(lc)
                nursery.cancel_scope.cancel()
            if lc.closing and not lc.eof:
                await _linger(stream)
        finally:
            with trio.CancelScope(shield=True):
                if not lc.model_closed:
                    lc.model_closed = True
                    await self.submit(ClientDisconnected(lc.id, lc.close_reason or "socket closed"))
                del self.local[lc.id]
                if not self.local:
                    self.all_closed.set()
                # Bounded: TLS's close_notify is a write a client that reads nothing blocks.
                with trio.move_on_after(CLOSE_LINGER):
                    await stream.aclose()
            log.info(
                "connection closed conn=%s peer=%s reason=%r",
                lc.id,
                lc.peer,
                lc.close_reason or "client closed the socket",
            )

    async def _reader(self, lc: LocalConn, scope: trio.CancelScope) -> None:
        count = self._count_reads
        try:
            while True:
                if lc.paused:
                    await lc.resume.wait()
                    continue
                if lc.inflight >= READ_CREDIT:
                    lc.credit_back = trio.Event()
                    await lc.credit_back.wait()
                    continue
                data = await lc.stream.receive_some(RECV_SIZE)
                if not data:
                    break
                if count:
                    lc.inflight += 1  # until the sequencer hands it back (``read_done``)
                # (TLS reads come as a bytearray: events hold bytes.)
                await self.submit(ClientData(lc.id, data if type(data) is bytes else bytes(data)))
                if lc.model_closed:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        # The client closed (or broke) its side: deliver-close, and stop the writer.
        lc.eof = True
        if not lc.model_closed:
            lc.model_closed = True
            lc.close_reason = lc.close_reason or "client closed the socket"
            await self.submit(ClientDisconnected(lc.id, lc.close_reason))
        scope.cancel()

    async def _writer(self, lc: LocalConn) -> None:
        stream = lc.stream
        tls = lc.tls
        try:
            while True:
                if self.output_paused and not lc.closing:
                    # Nothing goes out until output resumes, or a close cuts it short.
                    lc.wake = trio.Event()
                    await lc.wake.wait()
                    continue
                if lc.out or (tls is not None and tls.unsent):
                    # (TLS: also ciphertext a direct write left: send_all sends it first.)
                    data = lc.out
                    lc.out = bytearray()
                    lc.written += len(data)
                    lc.sending = True
                    try:
                        await stream.send_all(data)
                    finally:
                        lc.sending = False
                    continue
                if lc.want_output and not lc.closing and not lc.held:
                    # (With output held, the client has not read what it was given: no
                    # more credit until it can.)
                    # The socket took everything queued, so the client keeps up: grow the grant,
                    # but keep the bytes one grant can produce near GRANT_BYTES.
                    per_delivery = max(lc.written // max(lc.credit, 1), 1)
                    lc.credit = max(
                        CREDIT_MIN, min(lc.credit * 2, CREDIT_MAX, GRANT_BYTES // per_delivery)
                    )
                    lc.written = 0
                    lc.want_output = False
                    await self.submit(DoOutput(lc.id, lc.credit))
                    continue
                if lc.closing:
                    return
                lc.wake = trio.Event()
                await lc.wake.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            lc.eof = True
            lc.close_reason = lc.close_reason or "socket write failed"
            return

    # -- time
    async def ticker(self) -> None:
        interval = self.config.tick_ms / 1000
        while True:
            await trio.sleep(interval)
            await self.submit(Tick(self.now_ms()))

    def status(self, with_digest: bool = False) -> dict[str, Any]:
        assert self.standalone is not None, "a cluster member's status is the member's"
        return model_status(self.standalone.broker, len(self.local), with_digest)

    def force_close(self, client_text: str, reason: str) -> list[int]:
        """connection.close 320 to every local client after the output already queued for it
        (whole frames), without the model: nothing of theirs is submitted any more (the
        member no longer applies events, or tells the model itself). Output held for
        stability is dropped. The clients the model had not yet seen go, in order."""
        frame = forced_close_frame(client_text)
        paused, self.output_paused = self.output_paused, False
        told = [lc.id for lc in self.local.values() if not lc.model_closed]
        for lc in self.local.values():
            lc.held.clear()
            if paused:
                # What was produced while output was paused never reaches the client.
                del lc.out[lc.out_before_pause :]
            if not lc.closing:
                lc.out += frame
            lc.closing = True
            lc.model_closed = True
            lc.close_reason = lc.close_reason or reason
            lc.wake.set()
        return told

    def pause_output(self) -> None:
        """Write nothing to any client from now on (what the model produces is kept, in
        order) until :meth:`resume_output`, or :meth:`force_close`, which drops it: a
        hot-standby primary that may no longer be the only one (runtime/member/lease.py,
        "In doubt")."""
        if self.output_paused:
            return
        self.output_paused = True
        for lc in self.local.values():
            lc.out_before_pause = len(lc.out)

    def resume_output(self) -> None:
        """Write again what was kept while output was paused."""
        if not self.output_paused:
            return
        self.output_paused = False
        for lc in self.local.values():
            lc.wake.set()

    def cancel_clients(self) -> None:
        for scope in list(self.client_scopes.values()):
            scope.cancel()

    async def close_all(self, code: int, text: str) -> None:
        for cid in list(self.local):
            await self.submit(CloseClient(cid, code, text))

    async def shutdown_clients(self, grace: float) -> None:
        """connection.close 320 to every client, then at most ``grace`` seconds for them to
        take it and go."""
        await self.close_all(int(ReplyCode.CONNECTION_FORCED), "broker shutdown")
        with trio.move_on_after(grace):
            await self.all_closed.wait()

    async def let_clients_go(self, grace: float) -> None:
        """The clients were told to go already: up to ``grace`` seconds to read their
        connection.close and leave; the rest are cut."""
        with trio.move_on_after(grace):
            while self.local:
                await trio.sleep(0.02)
        self.cancel_clients()

    async def drop_clients(self, text: str) -> None:
        """connection.close 320 with ``text`` straight to every client's socket, without the
        model (its member is leaving the cluster), then close them."""
        frame = forced_close_frame(text)
        for lc in list(self.local.values()):
            with (
                trio.move_on_after(1),
                contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError
                ),
            ):
                await lc.stream.send_all(frame)
            await lc.stream.aclose()


async def _linger(stream: ClientStream) -> None:
    """The connection is closed and its last output written: tell the client (end of stream;
    TLS has no half close: it is told when the socket closes) and read and discard what it
    still sends until it closes, at most CLOSE_LINGER seconds."""
    with trio.move_on_after(CLOSE_LINGER):
        try:
            await stream.send_eof()  # (TLS: nothing; it has no half close)
            while await stream.receive_some(RECV_SIZE):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass


async def tls_handshake(stream: TlsStream, cfg: TlsConfig, peer: str) -> str | None:
    """The TLS handshake of a client of an amqps listener, at most ``cfg.handshake_timeout``
    seconds (a client that connects and says nothing must not hold a connection); the user its
    verified certificate names ("" for none), or None when the handshake failed (logged, the
    socket closed). Decided here once, by the member that accepted the socket: the name then
    travels in ClientConnected, so every replica gives the same login answer."""
    why = "handshake timed out"
    with trio.move_on_after(cfg.handshake_timeout):
        try:
            await stream.do_handshake()
            why = ""
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            cause = e.__cause__
            why = (
                getattr(cause, "verify_message", None)
                or getattr(cause, "reason", None)
                or str(cause or e)
                or "connection closed during the handshake"
            )
    if why:
        # A refused client, as a refused login is (warning): an expired certificate or an
        # untrusted CA must stand out in the log, not hide among accepted connections.
        log.warning("tls handshake failed peer=%s reason=%r", peer, why)
        await trio.aclose_forcefully(stream)
        return None
    try:
        cert = stream.getpeercert()
    except (ValueError, ssl.SSLError):
        cert = None
    user = cert_identity(cert, cfg.cert_login_from)
    if cert and not user:
        log.info("tls client certificate names no user peer=%s from=%s", peer, cfg.cert_login_from)
    if len(user.encode()) > MAX_CERT_USER:
        log.warning("tls client certificate name too long peer=%s bytes=%d", peer, len(user))
        user = ""
    return user


def model_status(broker: Broker, local: int, with_digest: bool) -> dict[str, Any]:
    """What ``cpgbroker status`` shows of a model; a cluster member adds its own fields."""
    return {
        "digest": snapshot.digest(broker) if with_digest else None,
        "member": None,
        "state": "standalone",
        "connections": {"local": local, "shadow": 0},
        "queues": {
            f"{vh.name}:{q.name}": {
                "ready": len(q.messages),
                "unacked": q.unacked,
                "consumers": len(q.consumers),
            }
            for vh in broker.vhosts.values()
            for q in vh.queues.values()
        },
        "event_seq": broker.event_seq,
        # Publishers blocked: above the memory mark, or a member's disk alarm (its id).
        "publishers_blocked": broker.blocked,
        "disk_alarms": list(broker.mark.disk_alarms),
        # The release this process runs and the model versions it applies; the model
        # version the state runs at (a cluster's: one for every member).
        "software": {"release": __version__, "model_versions": [OLDEST, NEWEST]},
        "model_version": broker.version.current,
    }


def forced_close_frame(text: str) -> bytes:
    """connection.close 320 CONNECTION_FORCED, written by the runtime itself when the member
    can no longer go through the model (it is leaving the cluster)."""
    from pamqp import commands
    from pamqp import frame as pframe

    return pframe.marshal(
        commands.Connection.Close(
            reply_code=int(ReplyCode.CONNECTION_FORCED),
            reply_text=f"CONNECTION_FORCED - {text}"[:255],
            class_id=0,
            method_id=0,
        ),
        0,
    )


async def open_listeners(
    config: ServerConfig,
) -> tuple[list[trio.abc.Listener[ClientStream]], list[tuple[str, int]]]:
    """Open every configured AMQP listener, the amqps ones (``listen_tls``) after the others;
    also the (host, port) pairs actually bound by the plain ones."""
    listeners: list[trio.abc.Listener[ClientStream]] = []
    bound = []
    for host, port in (parse_listen(a) for a in config.listen):
        for lst in await trio.open_tcp_listeners(port, host=host):
            addr = lst.socket.getsockname()
            bound.append((str(addr[0]), int(addr[1])))
            log.info("listening host=%s port=%s", addr[0], addr[1])
            listeners.append(lst)
    if config.listen_tls:
        assert config.tls is not None, "settings refuse listen_tls without [tls]"
        ctx = server_context(config.tls)
        for host, port in (parse_listen(a) for a in config.listen_tls):
            for lst in await trio.open_tcp_listeners(port, host=host):
                addr = lst.socket.getsockname()
                log.info("listening amqps host=%s port=%s", addr[0], addr[1])
                # The handshake is not the listener's: AmqpServer.handle does it, under a timeout.
                listeners.append(TlsListener(lst, ctx))
    return listeners, bound


async def wait_for_signal() -> int:
    """Until SIGINT or SIGTERM arrives; returns it."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            return int(signum)
    raise AssertionError("signal receiver ended")  # pragma: no cover

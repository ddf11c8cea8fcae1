"""The trio runtime: TCP listeners, one reader and one writer task per client, the ticker, and
the sequencer that feeds ordered events to the model.

Standalone, the sequencer is trivial: an event is applied the moment it is submitted (trio runs
one task at a time, so submissions are already totally ordered). A cluster member replaces it
with the CPG sequencer (multicast, apply on delivery); the rest of this module does not change.

Flow control, end to end:
* Reading: a connection's reader submits what it reads and reads again; while the model has
  told us to pause (memory mark, :class:`Throttle`) it stops reading, so TCP pushes back.
* Writing: the model only allocates deliveries against do-output credit. The writer grants
  credit (:class:`DoOutput`) once the socket has taken what was queued, sized by how fast the
  client drains: it doubles while the client keeps up and halves when bytes pile up.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import time
from typing import Any

import trio

from cpgbroker.cluster.codec import conn_id
from cpgbroker.errors import ReplyCode
from cpgbroker.model import snapshot
from cpgbroker.model.broker import Broker
from cpgbroker.model.events import (
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    CloseConnection,
    DoOutput,
    Effect,
    Event,
    Send,
    Throttle,
    Tick,
    WantOutput,
)
from cpgbroker.runtime.settings import ServerConfig, parse_listen

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


class LocalConn:
    """A client connected to this process."""

    __slots__ = (
        "close_reason",
        "closing",
        "credit",
        "credit_back",
        "fd",
        "held",
        "id",
        "inflight",
        "model_closed",
        "out",
        "paused",
        "peer",
        "resume",
        "sending",
        "stream",
        "wake",
        "want_output",
        "written",
    )

    def __init__(self, conn_id: int, stream: trio.SocketStream, peer: str) -> None:
        self.id = conn_id
        self.stream = stream
        self.peer = peer
        self.out = bytearray()
        self.wake = trio.Event()
        self.want_output = False
        self.credit = CREDIT_START
        self.paused = False
        self.resume = trio.Event()
        self.closing = False
        self.close_reason = ""
        # The model already forgot this connection (it closed it): no deliver-close needed.
        self.model_closed = False
        # Bytes written since the last do-output grant: sizes the next grant.
        self.written = 0
        # Reads submitted but not yet applied (a cluster member waits for its own events to
        # come back through CPG); the reader stops while READ_CREDIT are in flight.
        self.inflight = 0
        self.credit_back = trio.Event()
        self.fd = stream.socket.fileno()
        # The writer task is inside send_all: only it may write until it is done.
        self.sending = False
        # Output waiting, in order, for its event to become stable (cluster members only):
        # (seq it waits for or 0, bytes, or None and a close reason for a held close).
        self.held: list[tuple[int, bytes | None, str]] = []


class Node:
    """Owns the broker model and executes its effects for this process's connections."""

    # Whether confirms wait in ``hold`` (a cluster member) or go out at once (standalone:
    # an applied event is final).
    gate_confirms = False

    def __init__(self, config: ServerConfig, member: int = 0) -> None:
        self.config = config
        self.member = member
        self.broker = Broker(config.broker)
        self.local: dict[int, LocalConn] = {}
        self._conn_counter = 0
        self._last_tick = 0
        self.all_closed = trio.Event()
        self.all_closed.set()
        # A local client was handed output since the cluster layer last looked: its answer
        # (an ack for a delivery, the next command after a reply) is probably on its way.
        self.answer_expected = False

    # -- the standalone sequencer: apply at once, in submission order
    async def submit(self, ev: Event) -> None:
        self.apply(ev)

    def apply(self, ev: Event) -> None:
        self.execute(self.broker.apply(ev))

    def new_conn_id(self) -> int:
        # Unique across a cluster: the member id in the high bits, a counter below.
        self._conn_counter += 1
        return conn_id(self.member, self._conn_counter)

    def execute(self, effects: list[Effect]) -> None:
        local = self.local
        for eff in effects:
            lc = local.get(eff.conn)
            if lc is None:
                continue  # a shadow connection: its owner writes its output
            t = type(eff)
            if t is Send:
                if lc.held or (eff.confirm and self.gate_confirms):  # type: ignore[union-attr]
                    self.hold(lc, eff)  # type: ignore[arg-type]
                    continue
                self.write(lc, eff.data)  # type: ignore[union-attr]
                self.answer_expected = True
            elif t is WantOutput:
                lc.want_output = True
                lc.wake.set()
            elif t is CloseConnection:
                lc.model_closed = True
                if lc.held:
                    # After the held output, like every close: whole frames, in order.
                    lc.held.append((0, None, eff.reason))  # type: ignore[union-attr]
                    continue
                lc.closing = True
                lc.close_reason = eff.reason  # type: ignore[union-attr]
                lc.wake.set()
            elif t is Throttle:
                lc.paused = eff.paused  # type: ignore[union-attr]
                if not lc.paused:
                    lc.resume.set()
                    lc.resume = trio.Event()

    def hold(self, lc: LocalConn, eff: Send) -> None:
        """Output that waits for its event to be stable (see ``gate_confirms``)."""
        self.write(lc, eff.data)

    def write(self, lc: LocalConn, data: bytes) -> None:
        """Write now rather than one scheduling round later: the socket is non-blocking, and
        whatever it does not take goes to the writer task (in order, after what it holds)."""
        if not lc.out and not lc.sending and not lc.closing:
            try:
                n = os.write(lc.fd, data)
            except OSError:
                n = 0  # would block, or an error the writer task meets and acts on
            lc.written += n
            if n == len(data):
                return
            data = data[n:]
        lc.out += data
        lc.wake.set()

    def now_ms(self) -> int:
        # Cluster time is wall-clock milliseconds (x-death carries it as a timestamp), made
        # monotonic here so a clock step back never reaches the model.
        self._last_tick = max(self._last_tick, time.time_ns() // 1_000_000)
        return self._last_tick

    # -- per connection
    async def handle(self, stream: trio.SocketStream) -> None:
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
        lc = LocalConn(self.new_conn_id(), stream, peer)
        self.local[lc.id] = lc
        self.all_closed = trio.Event()
        log.info("connection accepted conn=%s peer=%s", lc.id, peer)
        try:
            await self.submit(ClientConnected(lc.id, self.member, peer, loopback))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader, lc, nursery.cancel_scope)
                await self._writer(lc)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                if not lc.model_closed:
                    lc.model_closed = True
                    await self.submit(ClientDisconnected(lc.id, lc.close_reason or "socket closed"))
                del self.local[lc.id]
                if not self.local:
                    self.all_closed.set()
                await stream.aclose()
            log.info(
                "connection closed conn=%s peer=%s reason=%r",
                lc.id,
                peer,
                lc.close_reason or "client closed the socket",
            )

    async def _reader(self, lc: LocalConn, scope: trio.CancelScope) -> None:
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
                await self.submit(ClientData(lc.id, data))
                if lc.model_closed:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        # The client closed (or broke) its side: deliver-close, and stop the writer.
        if not lc.model_closed:
            lc.model_closed = True
            lc.close_reason = lc.close_reason or "client closed the socket"
            await self.submit(ClientDisconnected(lc.id, lc.close_reason))
        scope.cancel()

    async def _writer(self, lc: LocalConn) -> None:
        stream = lc.stream
        try:
            while True:
                if lc.out:
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
            lc.close_reason = lc.close_reason or "socket write failed"
            return

    # -- time
    async def ticker(self) -> None:
        interval = self.config.tick_ms / 1000
        while True:
            await trio.sleep(interval)
            await self.submit(Tick(self.now_ms()))

    def status(self, with_digest: bool = False) -> dict[str, Any]:
        b = self.broker
        return {
            "digest": snapshot.digest(b) if with_digest else None,
            "member": None,
            "state": "standalone",
            "connections": {"local": len(self.local), "shadow": 0},
            "queues": {
                f"{vh.name}:{q.name}": {
                    "ready": len(q.messages),
                    "unacked": q.unacked,
                    "consumers": len(q.consumers),
                }
                for vh in b.vhosts.values()
                for q in vh.queues.values()
            },
            "event_seq": b.event_seq,
        }

    async def close_all(self, code: int, text: str) -> None:
        for cid in list(self.local):
            await self.submit(CloseClient(cid, code, text))

    async def shutdown_clients(self, grace: float) -> None:
        """connection.close 320 to every client, then at most ``grace`` seconds for them to
        take it and go."""
        await self.close_all(int(ReplyCode.CONNECTION_FORCED), "broker shutdown")
        with trio.move_on_after(grace):
            await self.all_closed.wait()


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
) -> tuple[list[trio.SocketListener], list[tuple[str, int]]]:
    """Open every configured AMQP listener; also the (host, port) pairs actually bound."""
    listeners: list[trio.SocketListener] = []
    for host, port in (parse_listen(a) for a in config.listen):
        listeners += await trio.open_tcp_listeners(port, host=host)
    bound = []
    for lst in listeners:
        addr = lst.socket.getsockname()
        bound.append((str(addr[0]), int(addr[1])))
        log.info("listening host=%s port=%s", addr[0], addr[1])
    return listeners, bound


async def wait_for_signal() -> int:
    """Until SIGINT or SIGTERM arrives; returns it."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            return int(signum)
    raise AssertionError("signal receiver ended")  # pragma: no cover

"""Closing a connection the way RabbitMQ does: after connection.close-ok (or our own
connection.close) the broker reads and discards what the client still sends until the client
closes, instead of closing a socket with unread input (which sends a reset: the client's writes
fail, and the close-ok can be lost before it reads it). A client that never closes is dropped
after ``server.CLOSE_LINGER``. A standalone broker in this process, a raw socket client in a
thread."""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any

import pytest
import trio
from pamqp import body as pbody
from pamqp import commands, frame, header

from cpgbroker.model.events import Tick
from cpgbroker.runtime.amqp import server
from cpgbroker.runtime.amqp.server import AmqpServer
from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.wire.framer import PROTOCOL_HEADER

BODY = b"x" * 2000


def publish(n: int) -> bytes:
    one = (
        frame.marshal(commands.Basic.Publish(exchange="", routing_key="nowhere"), 1)
        + frame.marshal(header.ContentHeader(0, len(BODY), commands.Basic.Properties()), 1)
        + frame.marshal(pbody.ContentBody(BODY), 1)
    )
    return one * n


class RawClient:
    """A blocking AMQP client on a plain socket: just enough to open a channel and close."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""

    def expect(self, kind: type) -> Any:
        while True:
            while len(self.buf) >= 7:
                size = int.from_bytes(self.buf[3:7], "big")
                if len(self.buf) < size + 8:
                    break
                n, _ch, f = frame.unmarshal(self.buf)
                self.buf = self.buf[n:]
                if isinstance(f, kind):
                    return f
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before {kind.__name__}")
            self.buf += chunk

    def open(self) -> None:
        self.sock.sendall(PROTOCOL_HEADER)
        self.expect(commands.Connection.Start)
        self.sock.sendall(
            frame.marshal(
                commands.Connection.StartOk(
                    client_properties={}, mechanism="PLAIN", response="\0guest\0guest"
                ),
                0,
            )
        )
        self.expect(commands.Connection.Tune)
        self.sock.sendall(
            frame.marshal(
                commands.Connection.TuneOk(channel_max=8, frame_max=131072, heartbeat=0), 0
            )
            + frame.marshal(commands.Connection.Open(virtual_host="/"), 0)
            + frame.marshal(commands.Channel.Open(), 1)
        )
        self.expect(commands.Channel.OpenOk)


CLOSE = frame.marshal(
    commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 0
)


async def standalone(nursery: trio.Nursery) -> tuple[AmqpServer, int]:
    node = AmqpServer(ServerConfig())
    await node.submit(Tick(node.now_ms()))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, node.handle, listeners)
    return node, listeners[0].socket.getsockname()[1]


def close_while_writing(port: int) -> float:
    """Publishes, connection.close, then more publishes, and more writes until the close-ok
    is read: no write or read may fail. Returns how long the writes went on after close-ok."""
    c = RawClient(port)
    c.open()
    c.sock.sendall(publish(500) + CLOSE + publish(500))
    c.sock.setblocking(False)
    deadline = time.monotonic() + 10
    got_close_ok = None
    while time.monotonic() < deadline:
        with contextlib.suppress(BlockingIOError):
            c.sock.send(publish(20))  # a client with publishes queued behind its close
        try:
            chunk = c.sock.recv(65536)
        except BlockingIOError:
            chunk = None
        if chunk:
            c.buf += chunk
            if got_close_ok is None and frame.marshal(commands.Connection.CloseOk(), 0) in c.buf:
                got_close_ok = time.monotonic()
        if got_close_ok is not None and time.monotonic() - got_close_ok > 0.2:
            break
        time.sleep(0.002)
    assert got_close_ok is not None, "no connection.close-ok"
    c.sock.close()
    return time.monotonic() - got_close_ok


async def test_a_client_still_writing_after_its_close_gets_close_ok_and_no_reset() -> None:
    async with trio.open_nursery() as nursery:
        node, port = await standalone(nursery)
        with trio.fail_after(20):
            wrote_on = await trio.to_thread.run_sync(close_while_writing, port)
            assert wrote_on >= 0.2
            while node.local:  # the client closed: the broker closes too, at once
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


def close_and_linger(port: int) -> tuple[float, bytes]:
    """Close, read close-ok, write a little more, then neither write nor close. Returns when
    close-ok arrived and what the client read after it."""
    c = RawClient(port)
    c.open()
    c.sock.sendall(CLOSE)
    c.expect(commands.Connection.CloseOk)
    t = time.monotonic()
    c.sock.sendall(publish(5))  # the broker still reads: no reset
    time.sleep(0.1)
    c.sock.sendall(publish(5))
    c.sock.settimeout(5)
    rest = c.sock.recv(65536)  # the broker ended its side of the stream after close-ok
    SOCKETS.append(c.sock)
    return t, rest


SOCKETS: list[socket.socket] = []


async def test_a_client_that_never_closes_is_dropped_after_the_linger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server, "CLOSE_LINGER", 0.6)
    try:
        async with trio.open_nursery() as nursery:
            node, port = await standalone(nursery)
            with trio.fail_after(20):
                close_ok_at, rest = await trio.to_thread.run_sync(close_and_linger, port)
                assert rest == b"", "end of stream after close-ok"
                assert node.local, "still read (and discarded) while the client may write"
                while node.local:
                    await trio.sleep(0.01)
                dropped_after = time.monotonic() - close_ok_at
            assert 0.5 <= dropped_after < 3, dropped_after
            nursery.cancel_scope.cancel()
    finally:
        while SOCKETS:
            SOCKETS.pop().close()

"""The amqps stream (runtime/config/tls.py TlsStream) against a real client ``ssl`` socket on
loopback: big payloads both ways at once, writes the socket cannot take at once (direct and
waiting), a client that closes in the middle of a record or without close_notify, our
close_notify, and the handshake timeout."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trio
import trustme

from cpgbroker.runtime.amqp.server import tls_handshake
from cpgbroker.runtime.config.tls import TlsConfig, TlsListener, TlsStream, server_context


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("tls-stream")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(d / "srv.pem"))
    return str(d / "ca.pem"), str(d / "srv.pem")


def client_ctx(cafile: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cafile)


class Pair:
    """A TlsStream (server side) and the port its client connects to."""

    def __init__(self, listener: TlsListener, port: int) -> None:
        self.listener = listener
        self.port = port

    def connect_raw(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port))
        s.settimeout(20)
        return s

    def connect(self, cafile: str, **kw: bool) -> ssl.SSLSocket:
        return client_ctx(cafile).wrap_socket(self.connect_raw(), server_hostname="127.0.0.1", **kw)


@pytest.fixture
async def pair(certs: tuple[str, str]) -> AsyncIterator[Pair]:
    ctx = server_context(TlsConfig(certfile=certs[1]))
    (tcp,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = TlsListener(tcp, ctx)
    yield Pair(listener, tcp.socket.getsockname()[1])
    await listener.aclose()


async def accept_and(pair: Pair, client: Callable[[], object]) -> tuple[TlsStream, object]:
    """Accept one connection while ``client`` runs in a thread; the handshake is done."""
    result: list[object] = []

    async def run_client() -> None:
        result.append(await trio.to_thread.run_sync(client))

    async with trio.open_nursery() as n:
        n.start_soon(run_client)
        stream = await pair.listener.accept()
        await stream.do_handshake()
    return stream, result[0]


def digest(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_big_payloads_both_ways_at_once(pair: Pair, certs: tuple[str, str]) -> None:
    size = 8 * 1024 * 1024
    up = os.urandom(size)
    down = os.urandom(size)
    box: dict[str, ssl.SSLSocket] = {}
    stream, _ = await accept_and(pair, lambda: box.setdefault("c", pair.connect(certs[0])))
    c = box["c"]
    assert stream.version() in ("TLSv1.2", "TLSv1.3")

    def client_io() -> bytes:
        """Send ``up`` and read ``down`` at once, in one thread: an SSL socket must not be read
        in one thread while another writes it (OpenSSL's connection object is not thread-safe:
        that fails now and then with an SSL "internal error")."""
        got = bytearray()
        sent = 0
        c.setblocking(False)
        deadline = time.monotonic() + 60
        while len(got) < size or sent < size:
            assert time.monotonic() < deadline, (len(got), sent)
            select.select([c] if len(got) < size else [], [c] if sent < size else [], [], 0.05)
            with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLWantWriteError):
                while len(got) < size:
                    chunk = c.recv(1 << 20)
                    assert chunk, "the server closed early"
                    got.extend(chunk)
            with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLWantWriteError):
                while sent < size:
                    sent += c.send(up[sent : sent + 256 * 1024])
        c.setblocking(True)
        return bytes(got)

    received = bytearray()

    async def server_read() -> None:
        while len(received) < size:
            data = await stream.receive_some(256 * 1024)
            assert data
            assert type(data) is bytes
            received.extend(data)

    async with trio.open_nursery() as n:
        n.start_soon(server_read)
        # One big send_all: far more than the socket takes, so it waits for the client.
        n.start_soon(stream.send_all, down)
        got_down = await trio.to_thread.run_sync(client_io)
    assert digest(received) == digest(up)
    assert digest(got_down) == digest(down)
    await stream.aclose()
    c.close()


async def test_direct_writes_the_socket_cannot_take_keep_their_order(
    pair: Pair, certs: tuple[str, str]
) -> None:
    box: dict[str, ssl.SSLSocket] = {}
    stream, _ = await accept_and(pair, lambda: box.setdefault("c", pair.connect(certs[0])))
    c = box["c"]
    # A small send buffer, a client that does not read yet: direct writes soon stop fitting.
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pieces = [bytes([i % 251]) * (1000 + i) for i in range(3000)]
    expected = b"".join(pieces)
    for p in pieces[:1000]:
        assert stream.send_nowait(p)  # taken: written, or waiting as ciphertext
    assert stream.unsent > 0  # the socket could not take it all
    got = bytearray()

    def read_all() -> None:
        while len(got) < len(expected):
            got.extend(c.recv(1 << 20))

    async with trio.open_nursery() as n:
        # The writer task: a send that must wait, unsent ciphertext first.
        n.start_soon(stream.send_all, pieces[1000])
        await trio.sleep(0.01)
        # Direct writes while it waits: encrypted behind it, sent by it.
        for p in pieces[1001:]:
            assert stream.send_nowait(p)
        await trio.to_thread.run_sync(read_all)
    assert stream.unsent == 0
    assert digest(got) == digest(expected)
    await stream.aclose()
    c.close()


async def test_peer_closes_in_the_middle_of_a_record(pair: Pair, certs: tuple[str, str]) -> None:
    """A client whose last record is cut: the whole records before it are returned, then
    BrokenResourceError (not a clean end of stream)."""
    ctx = client_ctx(certs[0])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    box: dict[str, socket.socket] = {}

    def handshake() -> None:
        raw = box["raw"] = pair.connect_raw()
        while True:
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                raw.sendall(outgoing.read())
                incoming.write(raw.recv(65536))
        raw.sendall(outgoing.read())

    stream, _ = await accept_and(pair, handshake)
    raw = box["raw"]
    obj.write(b"whole record")
    whole = outgoing.read()
    obj.write(b"y" * 5000)
    cut = outgoing.read()
    raw.sendall(whole + cut[: len(cut) // 2])
    raw.close()
    got = b""
    with pytest.raises(trio.BrokenResourceError):
        while True:
            data = await stream.receive_some(65536)
            assert data, "a cut record must not look like a clean end of stream"
            got += data
    assert got == b"whole record"
    await stream.aclose()


async def test_close_notify_both_ways(pair: Pair, certs: tuple[str, str]) -> None:
    box: dict[str, ssl.SSLSocket] = {}
    stream, _ = await accept_and(
        pair, lambda: box.setdefault("c", pair.connect(certs[0], suppress_ragged_eofs=False))
    )
    c = box["c"]
    c.sendall(b"last words")
    await stream.send_all(b"bye")
    assert await stream.receive_some(100) == b"last words"
    await stream.aclose()
    # Our close_notify came before the socket closed: a clean end, not a ragged one.
    assert await trio.to_thread.run_sync(c.recv, 100) == b"bye"
    assert await trio.to_thread.run_sync(c.recv, 100) == b""
    c.close()

    # And the client's close_notify is a clean end of stream for us.
    stream, _ = await accept_and(pair, lambda: box.__setitem__("c", pair.connect(certs[0])))
    c = box["c"]

    def unwrap() -> None:
        c.sendall(b"data")
        c.unwrap().close()  # waits for our close_notify

    got = b""
    async with trio.open_nursery() as n:
        n.start_soon(trio.to_thread.run_sync, unwrap)
        while data := await stream.receive_some(100):
            got += data
        assert got == b"data"
        assert await stream.receive_some(100) == b""
        await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_some(100)


async def test_close_wakes_a_waiting_reader(pair: Pair, certs: tuple[str, str]) -> None:
    box: dict[str, ssl.SSLSocket] = {}
    stream, _ = await accept_and(pair, lambda: box.setdefault("c", pair.connect(certs[0])))

    async def read() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await stream.receive_some(100)

    async with trio.open_nursery() as n:
        n.start_soon(read)
        await trio.sleep(0.05)
        await stream.aclose()
    box["c"].close()


async def test_handshake_timeout_and_failure_are_logged(
    pair: Pair, certs: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    cfg = TlsConfig(certfile=certs[1], handshake_timeout=0.3)
    silent = pair.connect_raw()  # connects and says nothing
    stream = await pair.listener.accept()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, "cpgbroker.server"):
        assert await tls_handshake(stream, cfg, "peer-a") is None
    assert 0.25 < time.monotonic() - t0 < 3
    assert "handshake timed out" in caplog.text
    # Refused, as a client whose login fails is: logged at the same level (warning).
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    silent.close()

    # A client that trusts another CA: refused, with OpenSSL's reason in the log.
    trustme.CA().cert_pem.write_to_path(str(Path(certs[0]).with_name("other.pem")))

    def distrustful() -> None:
        with pytest.raises(ssl.SSLError):
            client_ctx(str(Path(certs[0]).with_name("other.pem"))).wrap_socket(
                pair.connect_raw(), server_hostname="127.0.0.1"
            )

    caplog.clear()
    with caplog.at_level(logging.INFO, "cpgbroker.server"):
        async with trio.open_nursery() as n:
            n.start_soon(trio.to_thread.run_sync, distrustful)
            stream = await pair.listener.accept()
            assert await tls_handshake(stream, cfg, "peer-b") is None
    assert "tls handshake failed peer=peer-b" in caplog.text
    assert "timed out" not in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.WARNING]

"""The state transfer stream (runtime/update/transfer.py) between a sender and a receiver in one
process over loopback TCP: the restored model equals the sent one, and a corrupt or foreign
stream is refused rather than installed."""

from __future__ import annotations

import os
import socket

import pytest
import trio

from cpgbroker.errors import ClusterError
from cpgbroker.model.broker import Broker
from cpgbroker.model.entities import Queue
from cpgbroker.model.state import snapshot as S
from cpgbroker.runtime.update import transfer as update
from workload import generate

TOKEN = b"k" * update.TOKEN_BYTES
MEMBERS = [[1, 1, "amqp://a/", "x", 5], [2, 0, "amqp://b/", "x", 6]]


def _broker(seed: int) -> Broker:
    b = Broker()
    for ev in generate(seed, steps=200):
        b.apply(ev)
    return b


async def _serve_once(handler, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    stream = None
    task_status.started(port)
    stream = await listeners[0].accept()
    async with stream:
        await handler(stream)
    await listeners[0].aclose()


async def _transfer(b: Broker, *, mangle: int | None = None) -> tuple[Broker, list]:
    result: dict[str, object] = {}

    async def handler(stream: trio.SocketStream) -> None:
        reader, token = await update.read_token(stream)
        assert token == TOKEN
        progress = update.UpdateProgress(updater=1)
        try:
            result["ok"] = await update.receive_update(reader, S.Restorer(), progress)
        except ClusterError as e:
            result["error"] = e
        result["progress"] = progress

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_once, handler)
        if mangle is None:
            await trio.to_thread.run_sync(
                update.push_update, f"127.0.0.1:{port}", TOKEN, b, MEMBERS, 1, 2, b.event_seq
            )
        else:
            await trio.to_thread.run_sync(_push_mangled, port, b, mangle)
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["ok"]  # type: ignore[return-value]


def _push_mangled(port: int, b: Broker, flip_at: int) -> None:
    """A sender whose stream gets one byte flipped in transit."""
    real = socket.socket.sendall
    sent = [0]

    def sendall(self: socket.socket, data: bytes) -> None:  # type: ignore[override]
        data = bytes(data)
        if sent[0] <= flip_at < sent[0] + len(data):
            i = flip_at - sent[0]
            data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
        sent[0] += len(data)
        real(self, data)

    socket.socket.sendall = sendall  # type: ignore[method-assign]
    try:
        update.push_update(f"127.0.0.1:{port}", TOKEN, b, MEMBERS, 1, 2, b.event_seq)
    except OSError:
        pass  # the receiver hung up on the corrupt stream
    finally:
        socket.socket.sendall = real  # type: ignore[method-assign]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_transfer_restores_the_same_model(seed: int) -> None:
    b = _broker(seed)
    restored, members = await _transfer(b)
    assert S.digest(restored) == S.digest(b)
    assert members == MEMBERS


async def test_corrupt_transfer_is_refused() -> None:
    b = _broker(4)
    size = sum(len(S.encode(p)) for p in S.parts(b))
    # Flip a byte well inside the parts: either a part no longer decodes or the digest differs.
    with pytest.raises(ClusterError, match="corrupt"):
        await _transfer(b, mangle=size // 2)


async def test_stream_without_the_magic_is_not_a_transfer() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        with pytest.raises(ClusterError, match="not a cpgbroker state transfer"):
            await update.read_token(stream)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_once, handler)
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40)
        await s.aclose()


def test_the_released_pipe_carries_what_consumers_took_and_may_drop_frames() -> None:
    """What a parent writes on a replica update's pipe reaches the child whole, frame by
    frame, however many ids; a full pipe drops frames, never half of one."""
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        released = [("/", "work", i) for i in range(5000)] + [("v", "other", 7)]
        frames = update.released_frames(released)
        assert all(len(f) <= 4096 for f in frames) and len(frames) > 1
        for f in frames:
            os.write(w, f)
        child = update.Released(r)
        work = Queue(
            name="work",
            vhost="/",
            durable=False,
            exclusive_owner=None,
            auto_delete=False,
            arguments={},
        )
        assert child.gone(work) == set(range(5000))
        # Fill the pipe: a write that does not fit fails whole.
        sent = 0
        big = update.released_frames([("/", "work", i) for i in range(5000, 400000)])
        for f in big:
            try:
                os.write(w, f)
                sent += 1
            except BlockingIOError:
                break
        assert sent < len(big)
        ids = child.gone(work)
        assert len(ids) > 5000 and ids <= set(range(400000))
    finally:
        os.close(w)
        os.close(r)

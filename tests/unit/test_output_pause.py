"""A hot-standby primary in doubt writes nothing to its clients (runtime/member/lease.py, "In
doubt"): ``AmqpServer.pause_output`` keeps what the model produces, ``resume_output`` writes it
in order, and a forced close after a pause drops it, so a client never sees what the broker
produced while in doubt. A standalone server in this process, a raw socket client in a thread."""

from __future__ import annotations

import socket
from typing import Any

import trio
from pamqp import commands, frame
from test_runtime_close import RawClient, standalone


def declare(c: RawClient, name: str) -> None:
    c.sock.sendall(frame.marshal(commands.Queue.Declare(queue=name), 1))


def frames_until_close(c: RawClient) -> list[Any]:
    """Every frame the client reads up to and with connection.close."""
    got: list[Any] = []
    while True:
        while len(c.buf) >= 7 and len(c.buf) >= int.from_bytes(c.buf[3:7], "big") + 8:
            n, _ch, f = frame.unmarshal(c.buf)
            c.buf = c.buf[n:]
            got.append(f)
            if isinstance(f, commands.Connection.Close):
                return got
        chunk = c.sock.recv(65536)
        assert chunk, f"closed without connection.close after {got}"
        c.buf += chunk


def nothing_arrives(c: RawClient, seconds: float) -> bool:
    c.sock.settimeout(seconds)
    try:
        return c.sock.recv(65536) == b"" and False
    except TimeoutError:
        return True
    finally:
        c.sock.settimeout(10)


async def test_paused_output_is_kept_and_written_in_order_on_resume() -> None:
    async with trio.open_nursery() as nursery:
        node, port = await standalone(nursery)
        c = RawClient(port)
        await trio.to_thread.run_sync(c.open)
        node.pause_output()
        await trio.to_thread.run_sync(declare, c, "q1")
        await trio.to_thread.run_sync(declare, c, "q2")
        assert await trio.to_thread.run_sync(nothing_arrives, c, 0.3)
        node.resume_output()
        first = await trio.to_thread.run_sync(c.expect, commands.Queue.DeclareOk)
        second = await trio.to_thread.run_sync(c.expect, commands.Queue.DeclareOk)
        assert (first.queue, second.queue) == ("q1", "q2")
        c.sock.close()
        nursery.cancel_scope.cancel()


async def test_a_forced_close_after_a_pause_drops_what_was_kept() -> None:
    async with trio.open_nursery() as nursery:
        node, port = await standalone(nursery)
        c = RawClient(port)
        await trio.to_thread.run_sync(c.open)
        node.pause_output()
        await trio.to_thread.run_sync(declare, c, "q1")
        await trio.sleep(0.2)  # the model answered; the answer is kept
        conns = list(node.local)
        # The clients it closed that the model had not seen go: the caller tells the model.
        assert node.force_close("this member is no longer primary", "lapsed") == conns
        assert node.force_close("again", "lapsed") == [], "told once"
        got = await trio.to_thread.run_sync(frames_until_close, c)
        assert [type(f) for f in got] == [commands.Connection.Close], got
        assert got[0].reply_code == 320 and "no longer primary" in got[0].reply_text
        assert not node.output_paused
        c.sock.shutdown(socket.SHUT_RDWR)
        c.sock.close()
        nursery.cancel_scope.cancel()

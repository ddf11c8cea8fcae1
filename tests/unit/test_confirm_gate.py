"""Publisher confirms and tx.commit-ok wait until their event is stable (applied by every ready
member), in real ``ClusterNode``s on an in-memory total-order bus whose delivery to
each member can be held back: an event delivered on one side of a partition only must never be
confirmed to a client there. Output after a held confirm keeps its order behind it."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
import trio
from pamqp import commands, frame

from cpgbroker.config import ClusterConfig, ServerConfig
from cpgbroker.cpg import ConfChg, Member, MemberChange, Reason
from cpgbroker.model.events import ClientConnected, ClientData, Send
from cpgbroker.runtime.member import ClusterNode, member_id
from cpgbroker.runtime.server import LocalConn
from cpgbroker.wire.framer import PROTOCOL_HEADER
from fakecpg import Bus, FakeCpg
from modelclient import Harness

SOCKETS: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_sockets() -> Any:
    yield
    while SOCKETS:
        SOCKETS.pop().close()


class FakeStream:
    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock


class Client:
    """A local client of ``node`` whose bytes the node writes into a real socket pair."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        ours, self.peer = socket.socketpair()
        SOCKETS.extend((ours, self.peer))
        ours.setblocking(False)
        self.peer.setblocking(False)
        self.lc = LocalConn(node.new_conn_id(), FakeStream(ours), "127.0.0.1:1")  # type: ignore[arg-type]
        node.local[self.lc.id] = self.lc
        self.buf = bytearray()

    async def send(self, ch: int, method: Any) -> None:
        await self.node.submit(ClientData(self.lc.id, frame.marshal(method, ch)))

    def methods(self) -> list[Any]:
        """Methods the client received so far (read from the socket, plus what waits in the
        connection's write buffer for the writer task, which these tests do not run)."""
        try:
            while chunk := self.peer.recv(65536):
                self.buf += chunk
        except BlockingIOError:
            pass
        data = bytes(self.buf) + bytes(self.lc.out)
        out: list[Any] = []
        if data.startswith(b"AMQP"):
            data = data[8:]
        while data:
            n, _ch, f = frame.unmarshal(data)
            data = data[n:]
            out.append(f)
        return out


async def until(cond: Callable[[], bool]) -> None:
    with trio.fail_after(5):
        while not cond():
            await trio.sleep(0.005)


async def start(nursery: trio.Nursery, size: int) -> tuple[list[ClusterNode], list[FakeCpg]]:
    bus = Bus()
    nodes, cpgs = [], []
    for nid in range(1, size + 1):
        cfg = ServerConfig(cluster=ClusterConfig(group="g", size=size))
        cpg = FakeCpg(bus, nid)
        cpgs.append(cpg)
        nodes.append(ClusterNode(cfg, cpg, member_id(nid, 1000)))  # type: ignore[arg-type]
    ids = range(1, size + 1)
    bus.post(
        ConfChg(
            b"g",
            tuple(Member(n, 1000) for n in ids),
            (),
            tuple(MemberChange(n, 1000, Reason.JOIN) for n in ids),
        )
    )
    for n in nodes:
        nursery.start_soon(n.sender)
        nursery.start_soon(n.deliver_loop)
    with trio.fail_after(5):
        for n in nodes:
            await n.ready.wait()
    return nodes, cpgs


async def open_confirm_channel(node: ClusterNode, *, tx: bool = False) -> Client:
    c = Client(node)
    await node.submit(ClientConnected(c.lc.id, node.member, "127.0.0.1:1", True))
    await node.submit(ClientData(c.lc.id, PROTOCOL_HEADER))
    await c.send(
        0,
        commands.Connection.StartOk(
            client_properties={"capabilities": {"publisher_confirms": True}},
            mechanism="PLAIN",
            response="\0guest\0guest",
        ),
    )
    await c.send(0, commands.Connection.TuneOk(channel_max=64, frame_max=131072, heartbeat=0))
    await c.send(0, commands.Connection.Open(virtual_host="/"))
    await c.send(1, commands.Channel.Open())
    await c.send(1, commands.Tx.Select() if tx else commands.Confirm.Select())
    await c.send(1, commands.Queue.Declare(queue="q"))
    await until(lambda: any(isinstance(m, commands.Queue.DeclareOk) for m in c.methods()))
    return c


def publish_bytes(body: bytes) -> bytes:
    from pamqp import body as pbody
    from pamqp import header

    return (
        frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1)
        + frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), 1)
        + frame.marshal(pbody.ContentBody(body), 1)
    )


def acks(c: Client) -> list[Any]:
    return [m for m in c.methods() if isinstance(m, commands.Basic.Ack)]


async def test_confirm_waits_for_every_member_and_keeps_the_connection_order() -> None:
    async with trio.open_nursery() as nursery:
        (a, b, _c), cpgs = await start(nursery, 3)
        client = await open_confirm_channel(a)
        # The two other members do not get the publish (as on the far side of a partition).
        cpgs[1].paused = cpgs[2].paused = True
        seq = a.broker.event_seq
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        # Output without a confirm, after it: must not overtake the held ack.
        await client.send(2, commands.Channel.Open())
        await until(lambda: a.broker.event_seq == seq + 2)
        await trio.sleep(0.05)
        assert a.broker.vhosts["/"].queues["q"].messages, "applied on this member"
        assert acks(client) == []
        assert not any(isinstance(m, commands.Channel.OpenOk) for m in client.methods()[-1:])
        assert [s for s, _d, _r in client.lc.held] == [seq + 1, 0]
        # One member of the two others applies it: a majority, not yet every member. (A
        # majority survives a partition, not the crash of the two members that have it.)
        cpgs[1].resume()
        await until(lambda: b.broker.event_seq >= seq + 1)
        await trio.sleep(0.05)
        assert acks(client) == []
        cpgs[2].resume()
        await until(lambda: bool(acks(client)))
        tail = client.methods()[-2:]
        assert isinstance(tail[0], commands.Basic.Ack) and tail[0].delivery_tag == 1
        assert isinstance(tail[1], commands.Channel.OpenOk)
        assert client.lc.held == [] and not a._holding
        assert b.broker.event_seq >= seq + 1
        nursery.cancel_scope.cancel()


async def test_held_confirm_is_dropped_on_suspend() -> None:
    async with trio.open_nursery() as nursery:
        (a, _b, _c), cpgs = await start(nursery, 3)
        client = await open_confirm_channel(a)
        cpgs[1].paused = cpgs[2].paused = True
        seq = a.broker.event_seq
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        await until(lambda: a.broker.event_seq == seq + 1)
        assert client.lc.held
        a.suspend("test: quorum lost")
        cpgs[1].resume()
        cpgs[2].resume()
        await trio.sleep(0.1)
        ms = client.methods()
        assert acks(client) == []
        assert isinstance(ms[-1], commands.Connection.Close) and ms[-1].reply_code == 320
        assert client.lc.held == [] and not a._holding
        nursery.cancel_scope.cancel()


async def test_tx_commit_ok_waits_too() -> None:
    async with trio.open_nursery() as nursery:
        (a, _b), cpgs = await start(nursery, 2)
        client = await open_confirm_channel(a, tx=True)
        cpgs[1].paused = True  # of two members, both must have it
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        await client.send(1, commands.Tx.Commit())
        await trio.sleep(0.05)
        assert not any(isinstance(m, commands.Tx.CommitOk) for m in client.methods())
        cpgs[1].resume()
        await until(lambda: any(isinstance(m, commands.Tx.CommitOk) for m in client.methods()))
        nursery.cancel_scope.cancel()


async def test_a_single_member_confirms_at_once_and_plain_output_is_never_held() -> None:
    async with trio.open_nursery() as nursery:
        (a,), _cpgs = await start(nursery, 1)
        client = await open_confirm_channel(a)
        assert client.lc.held == []
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        await until(lambda: bool(acks(client)))
        assert not a._holding
        nursery.cancel_scope.cancel()


def test_model_marks_confirm_output_and_counts_shadow_confirms() -> None:
    h = Harness()
    own = h.connect(1)
    own.handshake()
    own.channel(1)
    own.rpc(1, commands.Confirm.Select())
    own.rpc(1, commands.Queue.Declare(queue="q"))
    shadow = h.connect(2)
    shadow.handshake()
    shadow.channel(1)
    shadow.rpc(1, commands.Tx.Select())
    h.broker.set_emit(2, False)
    n = h.broker.shadow_confirms
    h.effects.clear()
    own.publish(1, "", "q", b"x")
    sends = [e for e in h.effects if isinstance(e, Send)]
    assert [s.confirm for s in sends] == [True]
    assert h.broker.shadow_confirms == n, "our own client's confirm: we need no report"
    h.effects.clear()
    own.rpc(1, commands.Queue.Declare(queue="q"))  # plain output: not marked
    assert [s.confirm for s in h.effects if isinstance(s, Send)] == [False]
    shadow.send(1, commands.Tx.Commit())  # a shadow emits no bytes, but the count moves
    assert h.broker.shadow_confirms == n + 1

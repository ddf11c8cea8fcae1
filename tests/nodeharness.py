"""Real ``ClusterNode``s on the in-memory total-order bus (``fakecpg``), with local AMQP
clients whose output the nodes write into real socket pairs: the harness unit tests of the
member runtime share."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
import trio
from pamqp import commands, frame

from cpgbroker.corosync.events import ConfChg, Member, MemberChange, Reason
from cpgbroker.errors import ClusterError
from cpgbroker.model.events import ClientConnected, ClientData
from cpgbroker.runtime.amqp.server import LocalConn
from cpgbroker.runtime.config.settings import ClusterConfig, ServerConfig
from cpgbroker.runtime.member.member import ClusterNode, member_id
from cpgbroker.runtime.process.assembly import assemble
from cpgbroker.wire.framer import PROTOCOL_HEADER
from fakecpg import Bus, FakeCpg

SOCKETS: list[socket.socket] = []


@pytest.fixture(autouse=True)
def close_sockets() -> Any:
    """Use as an autouse fixture (``_close = close_sockets`` in the test module)."""
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
        self.lc = LocalConn(node.io.new_conn_id(), FakeStream(ours), "127.0.0.1:1")  # type: ignore[arg-type]
        node.io.local[self.lc.id] = self.lc
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


async def start(
    nursery: trio.Nursery, size: int, **cluster: Any
) -> tuple[list[ClusterNode], list[FakeCpg]]:
    """``size`` members, ready. A member whose stream processing fails (``ClusterError``, as
    when it leaves after losing a vote) leaves the bus: the others get the CPG leave."""
    bus = Bus()
    nodes, cpgs = [], []
    for nid in range(1, size + 1):
        kw = {k: (v(nid) if callable(v) else v) for k, v in cluster.items()}
        cfg = ServerConfig(cluster=ClusterConfig(group="g", size=size, **kw))
        cpg = FakeCpg(bus, nid)
        cpgs.append(cpg)
        nodes.append(assemble(cfg, cpg, member_id(nid, 1000)))  # type: ignore[arg-type]
    ids = range(1, size + 1)
    bus.post(
        ConfChg(
            b"g",
            tuple(Member(n, 1000) for n in ids),
            (),
            tuple(MemberChange(n, 1000, Reason.JOIN) for n in ids),
        )
    )

    async def deliver(node: ClusterNode, cpg: FakeCpg) -> None:
        try:
            await node.deliver_loop()
        except ClusterError as e:
            node.fail(str(e))
            bus.subs.remove(cpg)
            bus.post(
                ConfChg(
                    b"g",
                    tuple(Member(c.local_nodeid, 1000) for c in bus.subs),
                    (MemberChange(cpg.local_nodeid, 1000, Reason.PROCDOWN),),
                    (),
                )
            )

    for n, c in zip(nodes, cpgs, strict=True):
        nursery.start_soon(n.multicast.sender)
        nursery.start_soon(deliver, n, c)
        nursery.start_soon(n.checkpoints.collect_digests)
        for task in n.replication.tasks():
            nursery.start_soon(task)
    with trio.fail_after(5):
        for n in nodes:
            await n.ready.wait()
    return nodes, cpgs


async def open_confirm_channel(
    node: ClusterNode, *, tx: bool = False, confirms: bool = True
) -> Client:
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
    if tx:
        await c.send(1, commands.Tx.Select())
    elif confirms:
        await c.send(1, commands.Confirm.Select())
    await c.send(1, commands.Queue.Declare(queue="q"))
    await until(lambda: any(isinstance(m, commands.Queue.DeclareOk) for m in c.methods()))
    return c


def publish_bytes(body: bytes, routing_key: str = "q") -> bytes:
    from pamqp import body as pbody
    from pamqp import header

    return (
        frame.marshal(commands.Basic.Publish(exchange="", routing_key=routing_key), 1)
        + frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), 1)
        + frame.marshal(pbody.ContentBody(body), 1)
    )


def acks(c: Client) -> list[Any]:
    return [m for m in c.methods() if isinstance(m, commands.Basic.Ack)]

"""Cluster flow control in real ``ClusterNode``s on an in-memory total-order bus: holding
client traffic back while a member lags must never hold back the progress reports that end
the lag (it once did, and a burst of small client reads stalled the whole cluster for good)."""

from __future__ import annotations

import trio

from cpgbroker.corosync.events import ConfChg, Member, MemberChange, Reason
from cpgbroker.model.events import ClientConnected, ClientData
from cpgbroker.runtime.config.settings import ClusterConfig, ServerConfig
from cpgbroker.runtime.member.member import member_id
from cpgbroker.runtime.process.assembly import assemble
from cpgbroker.wire.framer import PROTOCOL_HEADER
from fakecpg import Bus, FakeCpg

HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"


async def test_a_burst_past_max_lag_does_not_stall_the_cluster() -> None:
    bus = Bus()
    nodes = []
    for nid in (1, 2):
        cfg = ServerConfig(cluster=ClusterConfig(group="g", size=2, max_lag=100))
        nodes.append(assemble(cfg, FakeCpg(bus, nid), member_id(nid, 1000)))  # type: ignore[arg-type]
    bus.post(
        ConfChg(
            b"g",
            tuple(Member(n, 1000) for n in (1, 2)),
            (),
            tuple(MemberChange(n, 1000, Reason.JOIN) for n in (1, 2)),
        )
    )
    a, b = nodes
    async with trio.open_nursery() as nursery:
        for n in nodes:
            nursery.start_soon(n.multicast.sender)
            nursery.start_soon(n.deliver_loop)
        with trio.fail_after(5):
            for n in nodes:
                await n.ready.wait()
        conn = a.io.new_conn_id()
        await a.submit(ClientConnected(conn, a.member, "x:1", True))
        # Far more small reads than max_lag, all queued before any is delivered.
        for i in range(500):
            await a.submit(ClientData(conn, HEARTBEAT if i else PROTOCOL_HEADER))
        other = b.io.new_conn_id()
        await b.submit(ClientConnected(other, b.member, "y:1", True))
        with trio.fail_after(10):
            while other not in a.broker.connections or a.multicast.queued or b.multicast.queued:
                await trio.sleep(0.01)
        assert a.broker.event_seq == b.broker.event_seq
        nursery.cancel_scope.cancel()

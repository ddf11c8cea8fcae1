"""A member frozen past the token (its corosync stopped, then continued) sees one held ring
change: the others leave, come back, and the merge says it was on the smaller side. The ring is
quorate, yet it must suspend before applying the others' departure (which would requeue their
unacked messages and could hand them to its own consumers)."""

from __future__ import annotations

from typing import Any

import trio

from cpgbroker.cluster.merge import Partitions
from cpgbroker.corosync.events import (
    ConfChg,
    Member,
    MemberChange,
    PartitionMerge,
    Reason,
    RingId,
    TotemConfChg,
)
from cpgbroker.runtime.config.settings import ClusterConfig, ServerConfig
from cpgbroker.runtime.member.member import member_id
from cpgbroker.runtime.process.assembly import assemble
from fakecpg import Bus, FakeCpg, FakeQuorum


def confchg(members: tuple[int, ...], left: tuple[int, ...], joined: tuple[int, ...]) -> ConfChg:
    return ConfChg(
        b"g",
        tuple(Member(n, 1000) for n in members),
        tuple(MemberChange(n, 1000, Reason.NODEDOWN) for n in left),
        tuple(MemberChange(n, 1000, Reason.NODEUP) for n in joined),
    )


async def test_frozen_member_suspends_before_applying_the_others_departure() -> None:
    bus = Bus()
    cpgs = [FakeCpg(bus, n) for n in (1, 2, 3)]
    for c in cpgs:
        c.peers = cpgs
    nodes = []
    # Every ring is quorate (as in the frozen member's case: it rejoined the full ring).
    for c in cpgs:
        cfg = ServerConfig(cluster=ClusterConfig(group="g", size=3))
        node = assemble(cfg, c, member_id(c.local_nodeid, 1000), quorum=FakeQuorum())  # type: ignore[arg-type]
        nodes.append(node)
    start = ConfChg(
        b"g",
        tuple(Member(n, 1000) for n in (1, 2, 3)),
        (),
        tuple(MemberChange(n, 1000, Reason.JOIN) for n in (1, 2, 3)),
    )
    for c in cpgs:
        c.post(start)
    a = nodes[0]
    async with trio.open_nursery() as nursery:
        for n in nodes:
            nursery.start_soon(n.multicast.sender)
            nursery.start_soon(n.deliver_loop)
        with trio.fail_after(5):
            for n in nodes:
                await n.ready.wait()
        await trio.sleep(0.05)
        seq = a.broker.event_seq
        members_before = dict(a.membership.members)
        # Only the frozen member sees this ring change.
        for ev in (
            confchg((1,), left=(2, 3), joined=()),
            confchg((1, 2, 3), left=(), joined=(2, 3)),
            PartitionMerge(b"g", (Member(2, 1000), Member(3, 1000)), ()),
            TotemConfChg(RingId(1, 99), (1, 2, 3)),
        ):
            cpgs[0].post(ev)
        with trio.fail_after(5):
            while a.suspended is None:
                await trio.sleep(0.01)
        assert a.discard_state
        assert a.broker.event_seq == seq, "nothing of the ring change was applied"
        assert a.membership.members == members_before
        nursery.cancel_scope.cancel()


def test_merge_scan_follows_the_ring_changes_members() -> None:
    partitions = Partitions()
    members = [member_id(n, 1000) for n in (1, 2, 3)]
    # The majority side {2, 3} sees member 1 come back: it wins, nothing to suspend for.
    batch: list[Any] = [
        confchg((1, 2, 3), left=(), joined=(1,)),
        PartitionMerge(b"g", (Member(1, 1000),), ()),
        TotemConfChg(RingId(1, 99), (1, 2, 3)),
    ]
    assert partitions.lost_in(batch, 0, members) is None
    # Seen from member 2 frozen alone: it loses to {1, 3}.
    batch = [
        confchg((2,), left=(1, 3), joined=()),
        confchg((1, 2, 3), left=(), joined=(1, 3)),
        PartitionMerge(b"g", (Member(1, 1000), Member(3, 1000)), ()),
        TotemConfChg(RingId(1, 99), (1, 2, 3)),
    ]
    assert partitions.lost_in(batch, 0, members) == [member_id(1, 1000), member_id(3, 1000)]

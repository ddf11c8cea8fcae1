"""What a restart from a store keeps (model side): the ``Recovered`` event and which confirms
wait for the stores (``Send.confirm`` levels)."""

from __future__ import annotations

from pamqp import commands as C

from cpgbroker.model.events import (
    CONFIRM,
    CONFIRM_DURABLE,
    DiskAlarm,
    MemberLeft,
    Recovered,
    Send,
    Throttle,
)
from cpgbroker.model.state import snapshot
from modelclient import Client, Harness

PERSISTENT = C.Basic.Properties(delivery_mode=2)
TRANSIENT = C.Basic.Properties(delivery_mode=1)


def _setup(h: Harness) -> Client:
    h.tick(1_000)
    c = h.connect(1, member=7)
    c.handshake()
    c.channel(1)
    c.rpc(1, C.Exchange.Declare(exchange="dx", exchange_type="direct", durable=True))
    c.rpc(1, C.Exchange.Declare(exchange="tx", exchange_type="direct", durable=False))
    c.rpc(1, C.Queue.Declare(queue="dq", durable=True))
    c.rpc(1, C.Queue.Declare(queue="tq", durable=False))
    c.rpc(1, C.Queue.Bind(queue="dq", exchange="dx", routing_key="k"))
    c.rpc(1, C.Queue.Bind(queue="tq", exchange="dx", routing_key="k"))
    c.rpc(1, C.Queue.Bind(queue="dq", exchange="tx", routing_key="k"))
    return c


def test_a_restart_keeps_durable_entities_and_persistent_messages_only() -> None:
    h = Harness()
    c = _setup(h)
    for i in range(4):
        c.publish(1, "dx", "k", f"p{i}".encode(), props=PERSISTENT)
        c.publish(1, "dx", "k", f"t{i}".encode(), props=TRANSIENT)
    # Two persistent messages delivered and not acked when every member stopped.
    c.rpc(1, C.Basic.Qos(prefetch_count=2))
    c.send(1, C.Basic.Consume(queue="dq", consumer_tag="c1"))
    got = c.deliveries()
    assert [b for _m, b in got] == [b"p0", b"t0"]

    h.apply(MemberLeft(7))
    h.apply(Recovered())

    vh = h.broker.topology.vhosts["/"]
    assert "tq" not in vh.queues and "tx" not in vh.exchanges
    assert "dq" in vh.queues and "dx" in vh.exchanges
    dq = vh.queues["dq"]
    assert [(e.msg.body, e.redelivered) for e in dq.messages] == [
        (b"p0", True),
        (b"p1", False),
        (b"p2", False),
        (b"p3", False),
    ]
    # The durable exchange keeps its binding to the durable queue and loses the other one.
    assert [b.dest.name for b in vh.exchanges["dx"].bindings] == ["dq"]

    # A client after the restart gets them in order, the unacked one marked redelivered.
    d = h.connect(2, member=8)
    d.handshake()
    d.channel(1)
    d.send(1, C.Basic.Consume(queue="dq", consumer_tag="c2", no_ack=True))
    got = d.deliveries()
    assert [(b, m.redelivered) for m, b in got] == [
        (b"p0", True),
        (b"p1", False),
        (b"p2", False),
        (b"p3", False),
    ]


def test_recovered_gives_one_digest_on_every_replica() -> None:
    digests = set()
    for _ in range(2):
        h = Harness()
        c = _setup(h)
        for i in range(20):
            c.publish(1, "dx", "k", b"x" * i, props=PERSISTENT if i % 3 else TRANSIENT)
        h.apply(MemberLeft(7))
        h.apply(Recovered())
        digests.add(snapshot.digest(h.broker))
    assert len(digests) == 1


def _confirm_levels(h: Harness, conn: int) -> list[int]:
    return [e.confirm for e in h.effects if isinstance(e, Send) and e.conn == conn and e.confirm]


def test_only_confirms_of_persistent_messages_on_durable_queues_wait_for_the_stores() -> None:
    h = Harness()
    c = _setup(h)
    c.rpc(1, C.Confirm.Select())
    h.effects.clear()
    c.publish(1, "dx", "k", b"a", props=PERSISTENT)  # dq and tq: durable wins
    c.publish(1, "dx", "k", b"b", props=TRANSIENT)
    c.publish(1, "dx", "nowhere", b"c", props=PERSISTENT)  # unroutable: nothing to store
    c.rpc(1, C.Queue.Declare(queue="tq2", durable=False))
    c.rpc(1, C.Queue.Bind(queue="tq2", exchange="dx", routing_key="t"))
    h.effects.clear()
    c.publish(1, "dx", "t", b"d", props=PERSISTENT)  # a non-durable queue only
    assert _confirm_levels(h, 1) == [CONFIRM]


def test_confirm_levels_in_order() -> None:
    h = Harness()
    c = _setup(h)
    c.rpc(1, C.Confirm.Select())
    h.effects.clear()
    c.publish(1, "dx", "k", b"a", props=PERSISTENT)
    c.publish(1, "dx", "k", b"b", props=TRANSIENT)
    c.publish(1, "dx", "nowhere", b"c", props=PERSISTENT)
    assert _confirm_levels(h, 1) == [CONFIRM_DURABLE, CONFIRM, CONFIRM]


def test_a_commit_ok_covering_a_persistent_message_waits_for_the_stores() -> None:
    h = Harness()
    c = _setup(h)
    c.rpc(1, C.Tx.Select())
    c.publish(1, "dx", "k", b"a", props=TRANSIENT)
    h.effects.clear()
    c.rpc(1, C.Tx.Commit())
    assert _confirm_levels(h, 1) == [CONFIRM]
    c.publish(1, "dx", "k", b"a", props=PERSISTENT)
    h.effects.clear()
    c.rpc(1, C.Tx.Commit())
    assert _confirm_levels(h, 1) == [CONFIRM_DURABLE]


def test_a_disk_alarm_of_any_member_blocks_publishers_until_it_clears_or_leaves() -> None:
    h = Harness()
    c = _setup(h)
    c.publish(1, "dx", "k", b"x", props=PERSISTENT)
    c.recv()
    h.apply(DiskAlarm(5, True))
    got = c.methods()
    assert [type(m).__name__ for m in got] == ["Blocked"] and got[0].reason == "low on disk"
    assert h.broker.blocked
    assert any(isinstance(e, Throttle) and e.paused for e in h.effects)
    # A second member in alarm changes nothing; the first clearing leaves the second's.
    h.apply(DiskAlarm(6, True))
    h.apply(DiskAlarm(5, False))
    assert c.methods() == [] and h.broker.blocked
    # A member that leaves takes its alarm with it.
    h.apply(MemberLeft(6))
    assert [type(m).__name__ for m in c.methods()] == ["Unblocked"]
    assert not h.broker.blocked


def test_a_disk_alarm_travels_in_snapshots_and_changes_no_digest_without_one() -> None:
    h = Harness()
    _setup(h)
    before = snapshot.digest(h.broker)
    assert snapshot.digest(snapshot.restore(snapshot.snapshot(h.broker))) == before
    h.apply(DiskAlarm(9, True))
    restored = snapshot.restore(snapshot.snapshot(h.broker))
    assert restored.blocked and list(restored.mark.disk_alarms) == [9]
    assert snapshot.digest(restored) == snapshot.digest(h.broker) != before
    h.apply(DiskAlarm(9, False))
    assert not h.broker.blocked


def test_a_commit_ok_covering_acks_waits_for_the_stores() -> None:
    h = Harness()
    c = _setup(h)
    c.publish(1, "dx", "k", b"a", props=PERSISTENT)
    c.rpc(1, C.Tx.Select())
    c.send(1, C.Basic.Consume(queue="dq", consumer_tag="c1"))
    (m, _body), *_ = c.deliveries()
    c.send(1, C.Basic.Ack(delivery_tag=m.delivery_tag))
    h.effects.clear()
    c.rpc(1, C.Tx.Commit())
    assert _confirm_levels(h, 1) == [CONFIRM_DURABLE]

"""Queue flow (model/resources/queueflow.py): a publisher faster than a queue's consumers is paused
while the queue stands above the mark and resumes once it drained to half, decided from replicated
state (every replica pauses the same connections at the same event)."""

from __future__ import annotations

from pamqp import commands as C

from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.events import Throttle, Tick
from cpgbroker.model.state import snapshot
from modelclient import Client, Harness

HIGH = 4


def _setup(high: int = HIGH, credit: int = 1000) -> tuple[Harness, Client, Client]:
    h = Harness(Broker(BrokerConfig(queue_flow_messages=high)), credit=credit)
    h.tick(1_000)
    pub = h.connect(1)
    pub.handshake()
    pub.channel(1)
    pub.rpc(1, C.Queue.Declare(queue="q"))
    con = h.connect(2)
    con.handshake()
    con.channel(1)
    con.rpc(1, C.Basic.Qos(prefetch_count=1))
    con.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    con.recv()
    return h, pub, con


def _throttles(h: Harness, conn: int) -> list[bool]:
    return [e.paused for e in h.effects if isinstance(e, Throttle) and e.conn == conn]


def _ack_one(con: Client) -> None:
    got = con.deliveries()
    assert got, "no delivery to ack"
    con.send(1, C.Basic.Ack(delivery_tag=got[-1][0].delivery_tag))


def test_a_publisher_faster_than_the_consumer_is_paused_until_the_queue_drains() -> None:
    h, pub, con = _setup()
    for i in range(HIGH + 1):  # one goes to the consumer (prefetch 1), HIGH stay ready
        pub.publish(1, "", "q", b"m%d" % i)
    assert _throttles(h, 1) == []
    pub.publish(1, "", "q", b"over")
    assert _throttles(h, 1) == [True]
    assert h.broker.connections[1].flow_pauses == 1
    # More publishes (already in flight) do not pause it twice.
    pub.publish(1, "", "q", b"more")
    assert _throttles(h, 1) == [True]
    ready = len(h.broker.vhosts["/"].queues["q"].messages)
    for _ in range(ready - HIGH // 2):
        _ack_one(con)
    assert len(h.broker.vhosts["/"].queues["q"].messages) == HIGH // 2
    assert _throttles(h, 1) == [True, False]
    assert h.broker.connections[1].flow_pauses == 0


def test_a_queue_without_consumers_is_a_buffer() -> None:
    h, pub, con = _setup()
    con.send(1, C.Basic.Cancel(consumer_tag="c"))
    for i in range(3 * HIGH):
        pub.publish(1, "", "q", b"m%d" % i)
    assert _throttles(h, 1) == []


def test_losing_its_consumers_releases_the_publishers_at_the_next_tick() -> None:
    h, pub, con = _setup()
    for i in range(HIGH + 2):
        pub.publish(1, "", "q", b"m%d" % i)
    assert _throttles(h, 1) == [True]
    con.send(1, C.Basic.Cancel(consumer_tag="c"))
    assert _throttles(h, 1) == [True]
    h.apply(Tick(2_000))
    assert _throttles(h, 1) == [True, False]
    assert not h.broker.flow.queues


def test_the_memory_mark_does_not_release_a_publisher_a_queue_holds_back() -> None:
    h, pub, _con = _setup()
    for i in range(HIGH + 2):
        pub.publish(1, "", "q", b"m%d" % i)
    assert _throttles(h, 1) == [True]
    h.broker.mark.set_blocked(True)
    h.broker.mark.set_blocked(False)
    h.apply(Tick(1_100))  # flush the effects of the direct calls
    assert _throttles(h, 1)[-1] is True


def test_pauses_travel_in_snapshots_and_a_closed_publisher_is_forgotten() -> None:
    h, pub, _con = _setup()
    before = snapshot.digest(h.broker)
    for i in range(HIGH + 2):
        pub.publish(1, "", "q", b"m%d" % i)
    restored = snapshot.restore(snapshot.snapshot(h.broker), h.broker.config)
    assert snapshot.digest(restored) == snapshot.digest(h.broker)
    assert restored.connections[1].flow_pauses == 1 and len(restored.flow.queues) == 1
    pub.disconnect()
    assert not h.broker.flow.queues
    assert not h.broker.vhosts["/"].queues["q"].flow_paused
    # Without a pause the snapshot has no trace of queue flow (digests as before it existed).
    assert "flow_paused" not in str(snapshot.snapshot(h.broker)) and before

"""One test per kind of state a newcomer must receive (issue: "for every kind of state, a test
that builds it on a running cluster, adds a member, and checks that the newcomer's digest
equals the others' and that clients on the newcomer see exactly what clients on the old
members see").

The three old members run for the whole module; each test builds its own kind of state under
its own names, starts a fourth member (it joins through a state update), checks that all four
hold the same state at the same event, then continues that state from clients on the newcomer
and on the old members and compares what they see. The newcomer is stopped after each test.
``test_update.py`` has the same kinds together in one test, plus the failure cases.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import pytest
import test_update as tu
from brokerclients import assert_same_properties, connect, drain, queues, wait_state

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster

pytestmark = pytest.mark.integration

ALICE = '[[users]]\nname = "alice"\npassword = "s3cret"\nvhosts = ["/"]\n'
GUEST = '[[users]]\nname = "guest"\npassword = "guest"\nvhosts = ["/"]\nloopback_only = true\n'


@pytest.fixture(scope="module")
def old(dev_cluster: DevCluster) -> Iterator[BrokerSet]:
    dev_cluster.repair(timeout=60)
    group = f"k{uuid.uuid4().hex[:10]}"
    bs = BrokerSet(dev_cluster, group=group, name=f"broker-{group}", extra_config=GUEST + ALICE)
    try:
        bs.start_all(timeout=60)
        yield bs
    finally:
        bs.stop_all()


@pytest.fixture
def join(old: BrokerSet) -> Iterator[Any]:
    """``join()``: start a fourth member (on node 1), wait until it serves, check that all four
    members hold the same state at the same event; the newcomer's BrokerSet."""
    started: list[BrokerSet] = []

    def start() -> BrokerSet:
        old.converged([1, 2, 3])
        late = BrokerSet(
            old.dc, group=old.group, name=f"late-{uuid.uuid4().hex[:8]}", extra_config=GUEST + ALICE
        )
        started.append(late)
        late.start(1)
        late.wait_ready([1], timeout=60)
        s = late.status(1)
        assert s is not None and s["update"]["installed"], "it joined through a state update"
        tu.same_state([(old, 1), (old, 2), (old, 3), (late, 1)])
        return late

    yield start
    for late in started:
        late.stop_all()
        print(f"--- late member log\n{late.tail(1, 40)}")


def ch_on(bs: BrokerSet, node: int) -> Any:
    return connect(bs, node).channel()


def test_exchanges(old: BrokerSet, join: Any) -> None:
    ch = ch_on(old, 1)
    for name, kind in (("x.d", "direct"), ("x.f", "fanout"), ("x.t", "topic"), ("x.h", "headers")):
        ch.exchange_declare(name, kind, durable=kind == "topic", auto_delete=kind == "fanout")
    late = join()
    n = ch_on(late, 1)
    for name, kind in (("x.d", "direct"), ("x.f", "fanout"), ("x.t", "topic"), ("x.h", "headers")):
        n.exchange_declare(name, passive=True)
        # Redeclaring with another type fails alike everywhere: the exchange is really there.
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch_on(late, 1).exchange_declare(name, "direct" if kind != "direct" else "fanout")
        assert e.value.reply_code == 406
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        n.exchange_declare("x.none", passive=True)
    assert e.value.reply_code == 404


def test_bindings(old: BrokerSet, join: Any) -> None:
    ch = ch_on(old, 2)
    ch.exchange_declare("b.t", "topic")
    ch.exchange_declare("b.f", "fanout")
    ch.exchange_declare("b.h", "headers")
    ch.exchange_bind("b.f", "b.t", "fan.#")  # exchange to exchange
    for q in ("b.q1", "b.q2", "b.q3"):
        ch.queue_declare(q)
    ch.queue_bind("b.q1", "b.t", "a.*")
    ch.queue_bind("b.q2", "b.f")
    ch.queue_bind("b.q3", "b.h", arguments={"x-match": "any", "k": "v", "z": 1})
    late = join()
    n = ch_on(late, 1)
    n.confirm_delivery()
    n.basic_publish("b.t", "a.b", b"topic")
    n.basic_publish("b.t", "fan.x", b"e2e")
    n.basic_publish("b.h", "", b"hdr", pika.BasicProperties(headers={"z": 1}))
    n.basic_publish("b.t", "nomatch", b"dropped")
    o = ch_on(old, 3)
    assert [b for b, _p, _r in tu.get_all(o, "b.q1")] == [b"topic"]
    assert [b for b, _p, _r in tu.get_all(o, "b.q2")] == [b"e2e"]
    assert [b for b, _p, _r in tu.get_all(o, "b.q3")] == [b"hdr"]


def test_queues_and_their_arguments(old: BrokerSet, join: Any) -> None:
    ch = ch_on(old, 1)
    ch.exchange_declare("qa.dlx", "direct")
    ch.queue_declare("qa.durable", durable=True)
    ch.queue_declare("qa.max", arguments={"x-max-length": 2, "x-dead-letter-exchange": "qa.dlx"})
    ch.queue_declare("qa.dead")
    ch.queue_bind("qa.dead", "qa.dlx", "qa.max")
    ch.queue_declare("qa.auto", auto_delete=True)
    ch.basic_consume("qa.auto", lambda *a: None)
    late = join()
    n = ch_on(late, 1)
    n.confirm_delivery()
    assert n.queue_declare("qa.durable", durable=True, passive=True).method.message_count == 0
    for i in range(4):  # overflow on the newcomer dead-letters the oldest on every member
        n.basic_publish("", "qa.max", b"%d" % i)
    o = ch_on(old, 2)
    assert [b for b, _p, _r in tu.get_all(o, "qa.max")] == [b"2", b"3"]
    assert [b for b, _p, _r in tu.get_all(o, "qa.dead")] == [b"0", b"1"]
    # The auto-delete queue goes when its consumer on member 1 cancels: on the newcomer too.
    ch.close()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch_on(late, 1).queue_declare("qa.auto", passive=True)
    assert e.value.reply_code == 404
    tu.same_state([(late, 1), (old, 3)])  # member 3 may apply the close a moment later
    assert queues(late, 1) == queues(old, 3)


def test_messages_with_properties_and_redelivered_flags(old: BrokerSet, join: Any) -> None:
    ch = ch_on(old, 3)
    ch.confirm_delivery()
    ch.queue_declare("m.q")
    props = pika.BasicProperties(
        content_type="application/json",
        content_encoding="utf-8",
        headers={"k": "v", "n": 7, "nested": {"a": [1, "x"], "b": True}},
        delivery_mode=2,
        priority=5,
        correlation_id="corr",
        reply_to="m.reply",
        message_id="id-1",
        timestamp=1_700_000_000,
        type="t",
        app_id="app",
    )
    for i in range(3):
        ch.basic_publish("", "m.q", b"body-%d" % i, props)
    g = ch_on(old, 2)
    m, _p, _b = g.basic_get("m.q")
    g.basic_nack(m.delivery_tag, requeue=True)  # back in the queue, redelivered
    late = join()
    got = tu.get_all(ch_on(late, 1), "m.q")
    assert [(b, r) for b, _p, r in got] == [
        (b"body-0", True),
        (b"body-1", False),
        (b"body-2", False),
    ]
    for _b, p, _r in got:
        assert_same_properties(p, props)


def test_message_ttl_and_cluster_clock(old: BrokerSet, join: Any) -> None:
    ch = ch_on(old, 1)
    ch.confirm_delivery()
    ch.queue_declare("t.q", arguments={"x-message-ttl": 600_000})
    ch.queue_declare("t.exp", arguments={"x-expires": 2_500})
    ch.basic_publish("", "t.q", b"short", pika.BasicProperties(expiration="2500"))
    ch.basic_publish("", "t.q", b"long")
    late = join()
    # The TTL runs on cluster time, which the newcomer took over: both expire alike.
    time.sleep(3.5)
    tu.same_state([(old, 1), (late, 1)])
    assert [b for b, _p, _r in tu.get_all(ch_on(late, 1), "t.q")] == [b"long"]
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch_on(late, 1).queue_declare("t.exp", passive=True)  # x-expires deleted it
    assert e.value.reply_code == 404


def test_consumers_prefetch_unacked_and_delivery_tags(old: BrokerSet, join: Any) -> None:
    ch = ch_on(old, 1)
    ch.confirm_delivery()
    ch.queue_declare("c.q")
    for i in range(6):
        ch.basic_publish("", "c.q", b"%d" % i)
    c2 = connect(old, 2)
    cc = c2.channel()
    cc.basic_qos(prefetch_count=2)
    held: list[tuple[int, bytes]] = []
    cc.basic_consume("c.q", lambda _c, m, _p, b: held.append((m.delivery_tag, b)))
    drain(c2, lambda: len(held) == 2)
    late = join()
    assert (
        queues(late, 1)["/:c.q"]
        == queues(old, 2)["/:c.q"]
        == {
            "ready": 4,
            "unacked": 2,
            "consumers": 1,
        }
    )
    # The consumer continues: an ack frees one prefetch slot, the next tag is 3 (on every
    # member alike, or the newcomer's digest would differ below).
    cc.basic_ack(held[0][0])
    drain(c2, lambda: len(held) == 3)
    assert held == [(1, b"0"), (2, b"1"), (3, b"2")]
    tu.same_state([(old, 1), (old, 2), (late, 1)])
    # Its connection closing requeues its unacked on the newcomer too, redelivered.
    c2.close()
    got = tu.get_all(ch_on(late, 1), "c.q")
    assert sorted((b, r) for b, _p, r in got) == sorted(
        [(b"1", True), (b"2", True), (b"3", False), (b"4", False), (b"5", False)]
    )


def test_transactions(old: BrokerSet, join: Any) -> None:
    tx = ch_on(old, 3)
    tx.queue_declare("tx.q")
    tx.tx_select()
    tx.basic_publish("", "tx.q", b"in-tx")
    late = join()
    assert queues(late, 1)["/:tx.q"]["ready"] == 0, "buffered, not published"
    tx.basic_publish("", "tx.q", b"in-tx-2")
    tx.tx_commit()
    assert [b for b, _p, _r in tu.get_all(ch_on(late, 1), "tx.q")] == [b"in-tx", b"in-tx-2"]


def test_confirm_counters(old: BrokerSet, join: Any) -> None:
    ch = ch_on(old, 2)
    ch.confirm_delivery()
    ch.queue_declare("cf.q")
    for i in range(5):
        ch.basic_publish("", "cf.q", b"%d" % i)
    late = join()
    for i in range(5, 10):  # pika checks that delivery tags go on from 6
        ch.basic_publish("", "cf.q", b"%d" % i)
    tu.same_state([(old, 2), (late, 1)])
    assert queues(late, 1)["/:cf.q"]["ready"] == 10


def test_partially_received_frames(old: BrokerSet, join: Any) -> None:
    ch_on(old, 1).queue_declare("pf.q")
    raw = tu.raw_client_with_half_a_publish(old, 1, "pf.q", b"completed-later")
    try:
        late = join()
        raw.sendall(tu.RAW_REST)  # the rest of the frame: the publish happens everywhere
        # Nothing answers a publish: wait until member 1 applied it, so that the get below
        # (another client, another member) is ordered after it.
        wait_state(old, 1, lambda s: s["queues"].get("/:pf.q", {}).get("ready") == 1)
        tu.same_state([(old, 1), (late, 1)])
        assert [b for b, _p, _r in tu.get_all(ch_on(late, 1), "pf.q")] == [b"completed-later"]
    finally:
        raw.close()


def test_shadow_connections_channels_and_server_named_queues(old: BrokerSet, join: Any) -> None:
    c1 = connect(old, 1)
    chans = [c1.channel() for _ in range(3)]
    named = chans[0].queue_declare("", exclusive=True).method.queue
    late = join()
    s_new, s_old = late.status(1), old.status(2)
    assert s_new is not None and s_old is not None
    # Every connection of the cluster is a shadow on the newcomer (it has no clients yet).
    total = s_old["connections"]["local"] + s_old["connections"]["shadow"]
    assert s_new["connections"] == {"local": 0, "shadow": total}
    # The exclusive queue is still owned by its connection on member 1.
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch_on(late, 1).queue_declare(named, passive=True)
    assert e.value.reply_code == 405
    # Channels stay usable; a new server-named queue on the newcomer never clashes.
    chans[2].queue_declare("sn.after")
    other = ch_on(late, 1).queue_declare("", exclusive=True).method.queue
    assert other != named
    tu.same_state([(old, 1), (late, 1)])


def test_do_output_limits_and_flow(old: BrokerSet, join: Any) -> None:
    ch = ch_on(old, 1)
    ch.confirm_delivery()
    ch.queue_declare("do.q")
    c3 = connect(old, 3)
    cc = c3.channel()
    got: list[bytes] = []
    cc.basic_consume("do.q", lambda c, m, _p, b: (got.append(b), c.basic_ack(m.delivery_tag)))
    for i in range(200):
        ch.basic_publish("", "do.q", b"%d" % i)
    drain(c3, lambda: len(got) == 200)
    late = join()
    n = ch_on(late, 1)
    n.confirm_delivery()
    for i in range(200, 400):  # the consumer's grants continue across the join
        n.basic_publish("", "do.q", b"%d" % i)
    drain(c3, lambda: len(got) == 400)
    assert got == [b"%d" % i for i in range(400)]
    tu.same_state([(old, 3), (late, 1)])


def test_users_and_vhosts(old: BrokerSet, join: Any) -> None:
    late = join()
    port = late.ports[1][0]
    ok = pika.BlockingConnection(pika.URLParameters(f"amqp://alice:s3cret@127.0.0.1:{port}/"))
    ok.close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(pika.URLParameters(f"amqp://alice:wrong@127.0.0.1:{port}/"))
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.URLParameters(f"amqp://alice:s3cret@127.0.0.1:{port}/nohost"))

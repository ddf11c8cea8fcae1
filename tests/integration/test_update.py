"""New members join a serving cluster through a state update (real corosync in namespaces,
real pika clients): the newcomer ends indistinguishable from the members that were there from
the start, the others keep serving, and no confirmed message is lost when updaters or
newcomers die mid-transfer."""

from __future__ import annotations

import concurrent.futures
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import OPEN, connect, drain, queues, wait_state

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster

pytestmark = pytest.mark.integration


def same_state(sets: list[tuple[BrokerSet, int]], timeout: float = 30.0) -> str:
    """Sample members of (possibly different) broker sets at the same moment until one sample
    catches them all at the same event with the same digest; return that digest."""
    deadline = time.monotonic() + timeout
    with concurrent.futures.ThreadPoolExecutor(len(sets)) as pool:
        while True:
            stats = list(pool.map(lambda sn: sn[0].status(sn[1], digest=True), sets))
            seen = [None if s is None else (s["event_seq"], s["digest"]) for s in stats]
            if all(x is not None for x in seen) and len(set(seen)) == 1:
                return str(seen[0][1])  # type: ignore[index]
            assert time.monotonic() < deadline, f"members did not converge: {seen}"
            time.sleep(0.05)


@pytest.fixture
def late(brokers: BrokerSet) -> Iterator[BrokerSet]:
    """A fourth member of the same cluster (same CPG group), started on node 1 by the test."""
    extra = BrokerSet(brokers.dc, group=brokers.group, name=f"late-{brokers.group}")
    try:
        yield extra
    finally:
        extra.stop_all()
        print(f"--- late member log\n{extra.tail(1, 60)}")


def get_all(ch: Any, queue: str) -> list[tuple[bytes, Any, bool]]:
    out = []
    while True:
        m, p, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            return out
        out.append((body, p, m.redelivered))


def test_newcomer_receives_every_kind_of_state_and_is_indistinguishable(
    brokers: BrokerSet, late: BrokerSet
) -> None:
    c1 = connect(brokers, 1)
    ch = c1.channel()
    ch.confirm_delivery()
    # Exchanges of every type, an exchange-to-exchange binding, bindings with arguments.
    ch.exchange_declare("u.topic", "topic", durable=True)
    ch.exchange_declare("u.fan", "fanout", auto_delete=True)
    ch.exchange_declare("u.hdr", "headers")
    ch.exchange_declare("u.dlx", "direct")
    ch.exchange_bind("u.fan", "u.topic", "fan.#")
    # Queues with every kind of argument.
    ch.queue_declare("u.plain", durable=True)
    ch.queue_declare("u.limits", arguments={"x-max-length": 3, "x-dead-letter-exchange": "u.dlx"})
    ch.queue_declare("u.dead")
    ch.queue_bind("u.dead", "u.dlx", "u.limits")
    ch.queue_declare("u.ttl", arguments={"x-message-ttl": 600_000})
    ch.queue_declare("u.expires", arguments={"x-expires": 600_000})
    ch.queue_declare("u.auto", auto_delete=True)
    ch.queue_bind("u.plain", "u.topic", "a.*")
    ch.queue_bind("u.plain", "u.hdr", arguments={"x-match": "all", "k": "v"})
    ch.queue_bind("u.auto", "u.fan")
    named = ch.queue_declare("", exclusive=True).method.queue  # server-named, exclusive
    # Messages with properties and headers, routed several ways; a per-message TTL; overflow
    # into the dead-letter queue.
    props = pika.BasicProperties(
        content_type="text/plain",
        headers={"k": "v", "n": 7, "nested": {"a": [1, "x"]}},
        message_id="m-1",
        priority=3,
        delivery_mode=2,
        correlation_id="c",
    )
    for i in range(5):
        ch.basic_publish("u.topic", "a.b", b"plain-%d" % i, props)
    ch.basic_publish("u.hdr", "", b"by-headers", props)
    ch.basic_publish("u.topic", "fan.x", b"to-auto")
    for i in range(5):
        ch.basic_publish("", "u.limits", b"lim-%d" % i)
    ch.basic_publish("", "u.ttl", b"short", pika.BasicProperties(expiration="1500"))
    ch.basic_publish("", "u.ttl", b"long")
    ch.basic_publish("", named, b"exclusive")
    # A consumer on member 2 holding unacked deliveries at its prefetch limit; a message
    # requeued by nack (redelivered flag).
    c2 = connect(brokers, 2)
    cc = c2.channel()
    cc.basic_qos(prefetch_count=2)
    held: list[bytes] = []
    cc.basic_consume("u.plain", lambda _c, _m, _p, b: held.append(b))
    drain(c2, lambda: len(held) == 2)
    g = c2.channel()
    m, _p, body = g.basic_get("u.plain")
    assert body == b"plain-2"
    g.basic_nack(m.delivery_tag, requeue=True)
    # A transaction with buffered publishes and an ack, on member 3.
    c3 = connect(brokers, 3)
    tx = c3.channel()
    tx.tx_select()
    tx.basic_publish("", "u.plain", b"tx-publish")
    # Half a frame from a raw client on member 1: the rest comes after the update.
    raw = raw_client_with_half_a_publish(brokers, 1, "u.plain", b"raw-body")

    digest = brokers.converged([1, 2, 3])
    late.start(1)
    late.wait_ready([1], timeout=60)
    assert same_state([(brokers, 1), (brokers, 2), (brokers, 3), (late, 1)]) != ""
    assert digest  # the state before the join was agreed too
    newcomer = late.status(1)
    assert newcomer is not None and newcomer["update"]["installed"]

    # The state was not only copied but works: continue every piece of it, from clients on the
    # newcomer and on the old members, and compare what they see.
    raw.sendall(RAW_REST)  # the partial frame completes: a publish on every member
    tx.basic_publish("", "u.plain", b"tx-publish-2")
    tx.tx_commit()
    cc.close()  # its unacked deliveries go back to the queue, redelivered, on every member
    n = connect(late, 1).channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as locked:
        n.queue_declare(named, exclusive=True)  # still owned by the connection on member 1
    assert locked.value.reply_code == 405
    n = connect(late, 1).channel()
    time.sleep(2.5)  # the 1.5 s per-message TTL passes on cluster time
    same_state([(brokers, 1), (late, 1)])
    ch.basic_publish("", named, b"exclusive-2")  # confirm counters continue (pika checks)
    plain = get_all(n, "u.plain")
    assert held == [b"plain-0", b"plain-1"]
    assert sorted(b for b, _p, _r in plain) == sorted(
        [b"plain-%d" % i for i in range(5)]
        + [b"by-headers", b"raw-body", b"tx-publish", b"tx-publish-2"]
    )
    assert sorted(b for b, _p, r in plain if r) == [b"plain-0", b"plain-1", b"plain-2"]
    first = next(p for b, p, _r in plain if b == b"by-headers")
    assert first.headers == {"k": "v", "n": 7, "nested": {"a": [1, "x"]}}
    assert (first.message_id, first.priority, first.correlation_id) == ("m-1", 3, "c")
    assert [b for b, _p, _r in get_all(n, "u.limits")] == [b"lim-2", b"lim-3", b"lim-4"]
    assert [b for b, _p, _r in get_all(n, "u.dead")] == [b"lim-0", b"lim-1"]
    assert [b for b, _p, _r in get_all(n, "u.ttl")] == [b"long"]
    assert [b for b, _p, _r in get_all(n, "u.auto")] == [b"to-auto"]
    assert [b for b, _p, _r in get_all(ch, named)] == [b"exclusive", b"exclusive-2"]
    # And another server-named queue: the counter continued, no clash with the first.
    assert ch.queue_declare("", exclusive=True).method.queue != named
    same_state([(brokers, 1), (brokers, 2), (brokers, 3), (late, 1)])


RAW_REST = b""


def raw_client_with_half_a_publish(
    bs: BrokerSet, node: int, queue: str, body: bytes
) -> socket.socket:
    """A raw AMQP client that opens a channel and sends a publish up to the middle of its
    content header; the rest (``RAW_REST``) is sent by the test later."""
    global RAW_REST
    from pamqp import body as B
    from pamqp import commands as C
    from pamqp import frame, header

    s = socket.create_connection(("127.0.0.1", bs.ports[node][0]), timeout=5)
    OPEN_RAW.append(s)
    s.sendall(b"AMQP\x00\x00\x09\x01")
    recv_frames(s, 1)  # start
    s.sendall(frame.marshal(C.Connection.StartOk(response="\x00guest\x00guest"), 0))
    recv_frames(s, 1)  # tune
    s.sendall(frame.marshal(C.Connection.TuneOk(channel_max=10, frame_max=131072), 0))
    s.sendall(frame.marshal(C.Connection.Open(), 0))
    recv_frames(s, 1)
    s.sendall(frame.marshal(C.Channel.Open(), 1))
    recv_frames(s, 1)
    data = (
        frame.marshal(C.Basic.Publish(exchange="", routing_key=queue), 1)
        + frame.marshal(header.ContentHeader(0, len(body)), 1)
        + frame.marshal(B.ContentBody(body), 1)
    )
    cut = len(data) - len(body) - 10
    s.sendall(data[:cut])
    RAW_REST = data[cut:]
    return s


OPEN_RAW: list[socket.socket] = []


def recv_frames(s: socket.socket, n: int) -> None:
    buf = b""
    got = 0
    while got < n:
        while len(buf) < 7:
            buf += s.recv(65536)
        size = struct.unpack(">I", buf[3:7])[0]
        while len(buf) < 8 + size:
            buf += s.recv(65536)
        buf = buf[8 + size :]
        got += 1


class Load:
    """Confirmed publishers and acking consumers that fail over between members and keep
    going until stopped; they record what was confirmed and what was consumed."""

    def __init__(self, urls: list[str], queue: str) -> None:
        self.urls = urls
        self.queue = queue
        self.confirmed: set[bytes] = set()
        self.consumed: list[bytes] = []
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def _connect(self, i: int) -> tuple[pika.BlockingConnection, Any]:
        for k in range(60):
            url = self.urls[(i + k) % len(self.urls)]
            try:
                p = pika.URLParameters(url)
                p.socket_timeout = 5
                p.blocked_connection_timeout = 20
                conn = pika.BlockingConnection(p)
                OPEN.append(conn)
                ch = conn.channel()
                ch.queue_declare(self.queue, durable=True)
                return conn, ch
            except (pika.exceptions.AMQPError, OSError):
                time.sleep(0.25)
        raise AssertionError("no member reachable")

    def publisher(self, idx: int) -> None:
        n = 0
        _conn, ch = self._connect(idx)
        ch.confirm_delivery()
        while not self.stop.is_set():
            body = b"p%d-%d" % (idx, n)
            try:
                ch.basic_publish("", self.queue, body)
                self.confirmed.add(body)
                n += 1
            except (pika.exceptions.AMQPError, OSError):
                _conn, ch = self._connect(idx + 1)  # unconfirmed: publish it again
                ch.confirm_delivery()
            time.sleep(0.002)

    def consumer(self, idx: int) -> None:
        _conn, ch = self._connect(idx)
        while not self.stop.is_set() or self.confirmed - set(self.consumed):
            try:
                ch.basic_qos(prefetch_count=20)
                for m, _p, body in ch.consume(self.queue, inactivity_timeout=0.2):
                    if m is not None:
                        self.consumed.append(body)
                        ch.basic_ack(m.delivery_tag)
                    elif self.stop.is_set() and not (self.confirmed - set(self.consumed)):
                        return
            except (pika.exceptions.AMQPError, OSError):
                _conn, ch = self._connect(idx + 1)

    def start(self, publishers: list[int], consumers: list[int]) -> None:
        for fn, idxs in ((self.publisher, publishers), (self.consumer, consumers)):
            for i in idxs:
                t = threading.Thread(target=self._guard, args=(fn, i), daemon=True)
                t.start()
                self.threads.append(t)

    def _guard(self, fn: Any, i: int) -> None:
        try:
            fn(i)
        except Exception as e:  # reported by finish()
            self.errors.append(f"{fn.__name__} {i}: {e!r}")

    def finish(self, timeout: float = 60) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout)
        assert not self.errors, self.errors
        assert not any(t.is_alive() for t in self.threads), "load threads did not finish"
        lost = self.confirmed - set(self.consumed)
        assert not lost, f"{len(lost)} confirmed messages never consumed: {sorted(lost)[:5]}"
        assert len(self.confirmed) > 100


def test_join_under_load_loses_nothing_and_old_members_keep_serving(brokers: BrokerSet) -> None:
    load = Load([brokers.url(1), brokers.url(2)], f"load-{uuid.uuid4().hex[:6]}")
    load.start(publishers=[0, 1], consumers=[0, 1])
    time.sleep(1)
    for _ in range(2):  # member 3 leaves and comes back, twice, under load
        brokers.kill(3)
        time.sleep(0.5)
        before = len(load.confirmed)
        brokers.start(3)
        brokers.wait_ready([3], timeout=60)
        time.sleep(1)
        assert len(load.confirmed) > before  # the old members served throughout
    load.finish()
    brokers.converged([1, 2, 3])
    # Nobody failed while messages were in flight: no message was delivered twice.
    assert len(load.consumed) == len(set(load.consumed))


def test_two_newcomers_at_once_both_update_from_the_survivor(brokers: BrokerSet) -> None:
    ch = connect(brokers, 1).channel()
    ch.queue_declare("pair")
    for i in range(200):
        ch.basic_publish("", "pair", b"%d" % i)
    brokers.kill(2)
    brokers.kill(3)
    brokers.start(2)
    brokers.start(3)
    brokers.wait_ready([2, 3], timeout=60)
    brokers.converged([1, 2, 3])
    for n in (2, 3):
        assert queues(brokers, n)["/:pair"]["ready"] == 200


@pytest.fixture
def slow_brokers(cluster: DevCluster) -> Iterator[BrokerSet]:
    """Members whose state transfers are capped at 1 MiB/s: slow enough to kill mid-way."""
    group = f"t{uuid.uuid4().hex[:10]}"
    bs = BrokerSet(
        cluster, group=group, name=f"broker-{group}", extra_config="update_rate_limit = 1\n"
    )
    try:
        bs.start_all(timeout=60)
        yield bs
    finally:
        bs.stop_all()
        for n in (1, 2, 3):
            print(f"--- broker {n} log\n{bs.tail(n, 40)}")


def _fill(bs: BrokerSet, queue: str, count: int, size: int) -> None:
    ch = connect(bs, 1).channel()
    ch.confirm_delivery()
    ch.queue_declare(queue)
    for i in range(count):
        ch.basic_publish("", queue, b"%06d" % i + b"x" * (size - 6))


def _updating(s: dict[str, Any]) -> bool:
    return s.get("state") == "updating" and (s.get("update") or {}).get("parts", 0) > 1


def test_updater_killed_mid_transfer_the_newcomer_retries_with_another(
    slow_brokers: BrokerSet,
) -> None:
    bs = slow_brokers
    _fill(bs, "big", 3000, 1024)  # ~3 MiB: ~3 s at the capped rate
    bs.kill(3)
    bs.start(3)
    s = wait_state(bs, 3, _updating)
    updater = s["update"]["updater"]
    node = next(n for n in (1, 2) if bs.status(n)["member"] == updater)  # type: ignore[index]
    bs.kill(node)  # its forked sender dies with it
    bs.wait_ready([3], timeout=60)
    other = 3 - node
    st, survivor = bs.status(3), bs.status(other)
    assert st is not None and survivor is not None
    # The state came from the survivor, at the second attempt; or at the third when the
    # transfer broke before the killed member's leave and the survivor's answer to our join
    # reached the newcomer: the killed one was then the only member it knew to serve, and it
    # asked it again.
    assert st["update"]["updater"] == survivor["member"]
    assert st["update"]["attempts"] in (2, 3)
    bs.converged([other, 3])
    assert queues(bs, 3)["/:big"]["ready"] == 3000
    got = get_all(connect(bs, 3).channel(), "big")
    assert [b[:6] for b, _p, _r in got] == [b"%06d" % i for i in range(3000)]


def test_newcomer_killed_mid_transfer_is_forgotten_and_a_later_one_succeeds(
    slow_brokers: BrokerSet,
) -> None:
    bs = slow_brokers
    _fill(bs, "big", 3000, 1024)
    bs.kill(3)
    bs.start(3)
    wait_state(bs, 3, _updating)
    bs.kill(3)
    # The old members serve on and their update senders go away.
    ch = connect(bs, 1).channel()
    ch.confirm_delivery()
    ch.basic_publish("", "big", b"after")
    for n in (1, 2):
        wait_state(bs, n, lambda s: not s["updating"], timeout=30)
    bs.converged([1, 2])
    bs.start(3)
    bs.wait_ready([3], timeout=60)
    bs.converged([1, 2, 3])
    assert queues(bs, 3)["/:big"]["ready"] == 3001


def test_rolling_replacement_of_every_member_under_load_loses_nothing(brokers: BrokerSet) -> None:
    load = Load([brokers.url(n) for n in (1, 2, 3)], f"roll-{uuid.uuid4().hex[:6]}")
    load.start(publishers=[0, 1, 2], consumers=[0, 1, 2])
    time.sleep(1)
    for n in (1, 2, 3):
        brokers.kill(n)
        time.sleep(0.5)
        brokers.start(n)
        brokers.wait_ready([n], timeout=60)
        time.sleep(1)
    load.finish(timeout=90)
    brokers.converged([1, 2, 3])


def test_newcomer_with_another_configuration_is_refused_before_any_state_moves(
    brokers: BrokerSet,
) -> None:
    odd = BrokerSet(
        brokers.dc,
        group=brokers.group,
        name=f"odd-{brokers.group}",
        extra_config="\n[limits]\nframe_max = 65536\n",
    )
    try:
        proc = odd.start(1)
        assert proc.wait(30) == 3, odd.tail(1, 40)
        assert "different configuration" in odd.tail(1, 40)
        for n in (1, 2, 3):
            assert not brokers.status(n)["updating"]  # type: ignore[index]
        brokers.converged([1, 2, 3])
    finally:
        odd.stop_all()

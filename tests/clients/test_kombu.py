"""kombu on its py-amqp transport (``pyamqp://``), plus py-amqp itself for what kombu does not
expose (confirms, immediate, tx, recover): the client stack Celery users run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import amqp
import amqp.exceptions as ax
import kombu
import pytest
from clientutil import BrokerProcess
from kombu import Exchange, Queue
from kombu.simple import SimpleQueue


@pytest.fixture
def conn(broker: BrokerProcess) -> Iterator[kombu.Connection]:
    c = kombu.Connection(f"pyamqp://guest:guest@{broker.host}:{broker.port}//", connect_timeout=5)
    c.connect()
    yield c
    c.release()


@pytest.fixture
def pyamqp(broker: BrokerProcess) -> Iterator[amqp.Connection]:
    c = amqp.Connection(f"{broker.host}:{broker.port}", connect_timeout=5, read_timeout=5)
    c.connect()
    yield c
    if c.connected:
        c.close()


def drain(conn: kombu.Connection, until: Any, timeout: float = 5.0) -> None:
    """drain_events until ``until()`` is true; fails after ``timeout``."""
    end = time.monotonic() + timeout
    while not until():
        remaining = end - time.monotonic()
        assert remaining > 0, "expected messages did not arrive"
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=min(remaining, 0.5))


def test_producer_consumer_direct_exchange(conn: kombu.Connection, prefix: str) -> None:
    ex = Exchange(f"{prefix}.ex", type="direct")
    q_a = Queue(f"{prefix}.a", ex, routing_key="a")
    q_b = Queue(f"{prefix}.b", ex, routing_key="b")
    received: list[tuple[str, Any]] = []

    def on_message(body: Any, message: Any) -> None:
        received.append((message.delivery_info["routing_key"], body))
        message.ack()

    with conn.Consumer([q_a, q_b], callbacks=[on_message], accept=["json"]):
        producer = conn.Producer(serializer="json")
        producer.publish({"n": 1}, exchange=ex, routing_key="a", declare=[q_a, q_b])
        producer.publish({"n": 2}, exchange=ex, routing_key="b")
        producer.publish({"n": 3}, exchange=ex, routing_key="c")
        producer.publish({"n": 4}, exchange=ex, routing_key="a")
        drain(conn, lambda: len(received) >= 3)
    assert sorted(received, key=lambda r: r[1]["n"]) == [
        ("a", {"n": 1}),
        ("b", {"n": 2}),
        ("a", {"n": 4}),
    ]


def test_simple_queue(conn: kombu.Connection, prefix: str) -> None:
    sq = SimpleQueue(conn, f"{prefix}.simple", serializer="json")
    try:
        with pytest.raises(sq.Empty):
            sq.get_nowait()
        sq.put({"hello": "world"}, headers={"h": 1})
        sq.put("second")
        end = time.monotonic() + 5
        while len(sq) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        assert len(sq) == 2
        m = sq.get(timeout=5)
        assert m.payload == {"hello": "world"} and m.headers["h"] == 1
        m.ack()
        m = sq.get(timeout=5)
        assert m.payload == "second"
        m.requeue()
        m = sq.get(timeout=5)
        assert m.payload == "second" and m.delivery_info["redelivered"]
        m.ack()
        with pytest.raises(sq.Empty):
            sq.get(timeout=0.3)
    finally:
        sq.close()


def test_topic_and_headers_bindings(conn: kombu.Connection, prefix: str) -> None:
    topic = Exchange(f"{prefix}.topic", type="topic")
    headers = Exchange(f"{prefix}.headers", type="headers")
    q_topic = Queue(f"{prefix}.t", topic, routing_key="log.*.error")
    q_hash = Queue(f"{prefix}.h", topic, routing_key="log.#")
    q_hdr = Queue(
        f"{prefix}.hdr",
        headers,
        binding_arguments={"x-match": "all", "app": "web", "level": "error"},
    )
    with conn.channel() as channel:
        for q in (q_topic, q_hash, q_hdr):
            q(channel).declare()
        producer = kombu.Producer(channel, serializer="raw")
        for key in ("log.web.error", "log.db.info", "log", "metrics.web.error"):
            producer.publish(key.encode(), exchange=topic, routing_key=key)
        for body, hdrs in ((b"match", {"app": "web", "level": "error"}), (b"no", {"app": "web"})):
            producer.publish(body, exchange=headers, routing_key="", headers=hdrs)

        def bodies(q: Queue) -> list[bytes]:
            bound = q(channel)
            out = []
            while (m := bound.get(no_ack=True)) is not None:
                out.append(m.body)
            return out

        assert bodies(q_topic) == [b"log.web.error"]
        assert bodies(q_hash) == [b"log.web.error", b"log.db.info", b"log"]
        assert bodies(q_hdr) == [b"match"]


def test_reject_requeue_and_prefetch(conn: kombu.Connection, prefix: str) -> None:
    q = Queue(f"{prefix}.q")
    held: list[Any] = []
    with conn.channel() as ch:
        q(ch).declare()
        producer = kombu.Producer(ch, serializer="json")
        for i in range(5):
            producer.publish(i, routing_key=q.name)
    with conn.Consumer([q], callbacks=[lambda b, m: held.append(m)], prefetch_count=2):
        drain(conn, lambda: len(held) >= 2)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.4)  # prefetch 2: nothing more until an ack
        assert [m.payload for m in held] == [0, 1]
        held[0].reject(requeue=True)
        drain(conn, lambda: len(held) >= 3)
        assert held[2].payload == 0 and held[2].delivery_info["redelivered"]
        held[1].ack()
        held[2].ack()
        drain(conn, lambda: len(held) >= 5)
        held[3].ack()
        held[4].ack()
        drain(conn, lambda: len(held) >= 6)
        held[5].ack()
        assert [m.payload for m in held[3:]] == [2, 3, 4]


def test_ttl_dead_letter_and_max_length(conn: kombu.Connection, prefix: str) -> None:
    dlx = Exchange(f"{prefix}.dlx", type="fanout")
    dlq = Queue(f"{prefix}.dlq", dlx)
    short = Queue(
        f"{prefix}.short",
        message_ttl=0.1,
        queue_arguments={"x-dead-letter-exchange": dlx.name},
    )
    capped = Queue(f"{prefix}.capped", max_length=2)
    with conn.channel() as ch:
        for q in (dlq, short, capped):
            q(ch).declare()
        producer = kombu.Producer(ch, serializer="raw")
        producer.publish(b"will-expire", routing_key=short.name)
        for i in range(4):
            producer.publish(b"%d" % i, routing_key=capped.name)
        bound_dlq = dlq(ch)
        dead = None
        end = time.monotonic() + 5
        while dead is None and time.monotonic() < end:
            dead = bound_dlq.get(no_ack=True)
            time.sleep(0.05)
        assert dead is not None and dead.body == b"will-expire"
        death = dead.headers["x-death"][0]
        assert death["reason"] == "expired" and death["queue"] == short.name
        bound_capped = capped(ch)
        kept = []
        while (m := bound_capped.get(no_ack=True)) is not None:
            kept.append(m.body)
        assert kept == [b"2", b"3"]


def test_queue_expires(conn: kombu.Connection, prefix: str) -> None:
    q = Queue(f"{prefix}.q", expires=0.3)
    with conn.channel() as ch:
        q(ch).declare()
    end = time.monotonic() + 5
    while True:
        with conn.channel() as ch:
            try:
                q(ch).queue_declare(passive=True)
            except ax.NotFound:
                break
        assert time.monotonic() < end, "queue with x-expires was not deleted"
        time.sleep(0.5)


def test_consumer_cancelled_when_queue_deleted_elsewhere(
    conn: kombu.Connection, broker: BrokerProcess, prefix: str
) -> None:
    q = Queue(f"{prefix}.q")
    with conn.channel() as ch:
        q(ch).declare()
    with conn.Consumer([q], callbacks=[lambda b, m: m.ack()]):
        other = amqp.Connection(f"{broker.host}:{broker.port}", connect_timeout=5)
        other.connect()
        try:
            other.channel().queue_delete(q.name)
        finally:
            other.close()
        with pytest.raises(ax.ConsumerCancelled):
            conn.drain_events(timeout=5)


def test_mandatory_return(conn: kombu.Connection, prefix: str) -> None:
    returned: list[tuple[Any, Any, str, str]] = []

    def on_return(exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        returned.append((exc.reply_code, message.body, exchange, routing_key))

    with conn.channel() as ch:
        producer = kombu.Producer(ch, serializer="raw", on_return=on_return)
        producer.publish(b"lost", routing_key=f"{prefix}.nowhere", mandatory=True)
        end = time.monotonic() + 5
        while not returned and time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
    assert returned == [(312, b"lost", "", f"{prefix}.nowhere")]


def test_bad_login_and_unknown_vhost(broker: BrokerProcess) -> None:
    bad = amqp.Connection(
        f"{broker.host}:{broker.port}", userid="guest", password="nope", connect_timeout=5
    )
    with pytest.raises(ax.AccessRefused) as info:
        bad.connect()
    assert info.value.code == 403
    vh = amqp.Connection(f"{broker.host}:{broker.port}", virtual_host="missing", connect_timeout=5)
    with pytest.raises(ax.NotAllowed) as info2:
        vh.connect()
    assert info2.value.code == 530


# ---------------------------------------------------------------- py-amqp directly


def test_pyamqp_confirms_and_reject_publish(pyamqp: amqp.Connection, prefix: str) -> None:
    ch = pyamqp.channel()
    q = f"{prefix}.q"
    ch.queue_declare(q, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.confirm_select()
    ch.basic_publish_confirm(amqp.Message(b"1"), routing_key=q)
    with pytest.raises(ax.MessageNacked):
        ch.basic_publish_confirm(amqp.Message(b"2"), routing_key=q)
    msg = ch.basic_get(q, no_ack=True)
    assert msg.body == b"1"
    assert ch.basic_get(q) is None


def test_pyamqp_immediate_is_540(pyamqp: amqp.Connection, prefix: str) -> None:
    ch = pyamqp.channel()
    ch.basic_publish(amqp.Message(b"x"), routing_key=f"{prefix}.q", immediate=True)
    with pytest.raises(ax.AMQPNotImplementedError) as info:
        pyamqp.drain_events(timeout=5)
    assert info.value.reply_code == 540
    assert "NOT_IMPLEMENTED" in info.value.reply_text


def test_pyamqp_tx_and_recover(pyamqp: amqp.Connection, prefix: str) -> None:
    ch = pyamqp.channel()
    q = f"{prefix}.q"
    ch.queue_declare(q)
    ch.tx_select()
    ch.basic_publish(amqp.Message(b"a"), routing_key=q)
    ch.tx_rollback()
    assert ch.basic_get(q) is None
    ch.basic_publish(amqp.Message(b"b"), routing_key=q)
    ch.basic_publish(amqp.Message(b"c"), routing_key=q)
    ch.tx_commit()
    ch2 = pyamqp.channel()
    first = ch2.basic_get(q)
    second = ch2.basic_get(q)
    assert (first.body, second.body) == (b"b", b"c")
    assert not first.delivery_info["redelivered"]
    ch2.basic_recover(requeue=True)
    again = ch2.basic_get(q, no_ack=True)
    assert again.body == b"b" and again.delivery_info["redelivered"]
    again = ch2.basic_get(q, no_ack=True)
    assert again.body == b"c" and again.delivery_info["redelivered"]


def test_pyamqp_errors_and_recovery(pyamqp: amqp.Connection, prefix: str) -> None:
    ch = pyamqp.channel()
    with pytest.raises(ax.NotFound):
        ch.queue_declare(f"{prefix}.missing", passive=True)
    ch = pyamqp.channel()
    ch.queue_declare(f"{prefix}.x", exclusive=True)
    ch.queue_declare(f"{prefix}.d", durable=False)
    with pytest.raises(ax.PreconditionFailed):
        ch.queue_declare(f"{prefix}.d", durable=True)
    assert pyamqp.connected
    q, count, consumers = pyamqp.channel().queue_declare(f"{prefix}.d", passive=True)
    assert (q, count, consumers) == (f"{prefix}.d", 0, 0)

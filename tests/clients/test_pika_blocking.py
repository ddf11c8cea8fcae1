"""pika's BlockingConnection against the broker: routing on every exchange type, acks and
redelivery, QoS, confirms, returns, transactions, TTL / dead-lettering / length limits, and the
channel- and connection-level errors a user sees."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions as px
import pytest
from brokerclients import assert_same_properties
from clientutil import BrokerFactory, BrokerProcess, blocking, drain_get, wait_until


@pytest.fixture
def conn(broker: BrokerProcess) -> Iterator[pika.BlockingConnection]:
    c = blocking(broker.addr)
    yield c
    if c.is_open:
        c.close()


@pytest.fixture
def ch(conn: pika.BlockingConnection) -> Any:
    return conn.channel()


def pump(conn: pika.BlockingConnection) -> Any:
    return lambda step: conn.process_data_events(time_limit=step)


def consume(
    conn: pika.BlockingConnection,
    ch: Any,
    queue: str,
    n: int,
    timeout: float = 5.0,
    auto_ack: bool = True,
    settle: float = 0.0,
) -> list[tuple[Any, Any, bytes]]:
    """Consume until ``n`` messages arrived (or timeout), then keep pumping ``settle`` seconds
    to catch any extra delivery; cancels the consumer and returns what arrived."""
    got: list[tuple[Any, Any, bytes]] = []
    tag = ch.basic_consume(queue, lambda c, m, p, b: got.append((m, p, b)), auto_ack=auto_ack)
    wait_until(lambda: len(got) >= n, timeout, pump=pump(conn))
    if settle:
        conn.process_data_events(time_limit=settle)
    ch.basic_cancel(tag)
    return got


def declare(ch: Any, name: str, **kw: Any) -> str:
    return str(ch.queue_declare(name, **kw).method.queue)


def message_count(ch: Any, queue: str) -> int:
    return int(ch.queue_declare(queue, passive=True).method.message_count)


# ---------------------------------------------------------------- routing


def test_default_exchange_round_trip_keeps_properties(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q")
    props = pika.BasicProperties(
        content_type="application/json",
        content_encoding="utf-8",
        headers={"k": "v", "n": 7, "nested": {"a": [1, 2]}},
        delivery_mode=2,
        priority=3,
        correlation_id="corr-1",
        reply_to="reply.q",
        message_id="msg-1",
        timestamp=1700000000,
        type="t",
        user_id="guest",
        app_id="app",
    )
    ch.basic_publish("", q, b'{"x": 1}', props)
    method, got, body = ch.basic_get(q, auto_ack=True)
    assert body == b'{"x": 1}'
    assert method.exchange == "" and method.routing_key == q and not method.redelivered
    assert method.message_count == 0
    assert_same_properties(got, props)


def test_basic_get_empty_and_message_count(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q")
    assert ch.basic_get(q) == (None, None, None)
    for i in range(3):
        ch.basic_publish("", q, b"m%d" % i)
    counts = []
    for _ in range(3):
        method, _p, _b = ch.basic_get(q, auto_ack=True)
        counts.append(method.message_count)
    assert counts == [2, 1, 0]
    assert ch.basic_get(q) == (None, None, None)


def test_direct_exchange(ch: Any, prefix: str) -> None:
    ex = f"{prefix}.direct"
    ch.exchange_declare(ex, "direct")
    q1, q2, q3 = (declare(ch, f"{prefix}.q{i}") for i in (1, 2, 3))
    ch.queue_bind(q1, ex, "a")
    ch.queue_bind(q2, ex, "b")
    ch.queue_bind(q3, ex, "a")
    ch.queue_bind(q3, ex, "a")  # identical binding: idempotent, no duplicate delivery
    for key in ("a", "b", "c"):
        ch.basic_publish(ex, key, key.encode())
    assert drain_get(ch, q1) == [b"a"]
    assert drain_get(ch, q2) == [b"b"]
    assert drain_get(ch, q3) == [b"a"]
    ch.queue_unbind(q3, ex, "a")
    ch.basic_publish(ex, "a", b"again")
    assert drain_get(ch, q1) == [b"again"]
    assert drain_get(ch, q3) == []


def test_fanout_exchange_ignores_routing_key(ch: Any, prefix: str) -> None:
    ex = f"{prefix}.fanout"
    ch.exchange_declare(ex, "fanout")
    queues = [declare(ch, f"{prefix}.q{i}") for i in range(3)]
    for q in queues:
        ch.queue_bind(q, ex, "whatever")
    ch.basic_publish(ex, "some.key", b"one")
    ch.basic_publish(ex, "", b"two")
    for q in queues:
        assert drain_get(ch, q) == [b"one", b"two"]


def test_topic_exchange_wildcards(ch: Any, prefix: str) -> None:
    ex = f"{prefix}.topic"
    ch.exchange_declare(ex, "topic")
    patterns = {
        "star": "stock.*",
        "hash": "stock.#",
        "all": "#",
        "mid": "*.usd.*",
        "exact": "stock.usd.nyse",
        "tail": "#.nyse",
    }
    queues = {}
    for name, pattern in patterns.items():
        queues[name] = declare(ch, f"{prefix}.{name}")
        ch.queue_bind(queues[name], ex, pattern)
    keys = ["stock", "stock.usd", "stock.usd.nyse", "bond.usd.nyse", "stock.eur", "nyse", ""]
    for key in keys:
        ch.basic_publish(ex, key, key.encode() or b"<empty>")
    got = {name: drain_get(ch, q) for name, q in queues.items()}
    assert got["star"] == [b"stock.usd", b"stock.eur"]
    assert got["hash"] == [b"stock", b"stock.usd", b"stock.usd.nyse", b"stock.eur"]
    assert got["all"] == [k.encode() or b"<empty>" for k in keys]
    assert got["mid"] == [b"stock.usd.nyse", b"bond.usd.nyse"]
    assert got["exact"] == [b"stock.usd.nyse"]
    assert got["tail"] == [b"stock.usd.nyse", b"bond.usd.nyse", b"nyse"]


def test_headers_exchange_all_and_any(ch: Any, prefix: str) -> None:
    ex = f"{prefix}.headers"
    ch.exchange_declare(ex, "headers")
    q_all = declare(ch, f"{prefix}.all")
    q_any = declare(ch, f"{prefix}.any")
    q_default = declare(ch, f"{prefix}.default")
    ch.queue_bind(q_all, ex, "", {"x-match": "all", "format": "pdf", "type": "report"})
    ch.queue_bind(q_any, ex, "", {"x-match": "any", "format": "pdf", "type": "report"})
    ch.queue_bind(q_default, ex, "", {"format": "zip"})  # x-match defaults to all
    cases = {
        b"both": {"format": "pdf", "type": "report"},
        b"both+extra": {"format": "pdf", "type": "report", "x": 1},
        b"format": {"format": "pdf"},
        b"type": {"type": "report"},
        b"other": {"format": "zip", "type": "log"},
        b"none": None,
    }
    for body, headers in cases.items():
        ch.basic_publish(ex, "ignored", body, pika.BasicProperties(headers=headers))
    assert drain_get(ch, q_all) == [b"both", b"both+extra"]
    assert drain_get(ch, q_any) == [b"both", b"both+extra", b"format", b"type"]
    assert drain_get(ch, q_default) == [b"other"]


def test_exchange_to_exchange_bindings(ch: Any, prefix: str) -> None:
    src = f"{prefix}.src"
    dst = f"{prefix}.dst"
    ch.exchange_declare(src, "topic")
    ch.exchange_declare(dst, "fanout")
    q = declare(ch, f"{prefix}.q")
    direct_q = declare(ch, f"{prefix}.direct-q")
    ch.queue_bind(q, dst)
    ch.queue_bind(direct_q, src, "orders.#")
    ch.exchange_bind(destination=dst, source=src, routing_key="orders.*")
    ch.basic_publish(src, "orders.new", b"1")
    ch.basic_publish(src, "orders.new.eu", b"2")
    ch.basic_publish(src, "invoices.new", b"3")
    assert drain_get(ch, q) == [b"1"]
    # A queue reached both directly and through the other exchange gets one copy.
    ch.queue_bind(q, src, "orders.new")
    ch.basic_publish(src, "orders.new", b"4")
    assert drain_get(ch, q) == [b"4"]
    assert drain_get(ch, direct_q) == [b"1", b"2", b"4"]
    ch.queue_unbind(q, src, "orders.new")
    ch.exchange_unbind(destination=dst, source=src, routing_key="orders.*")
    ch.basic_publish(src, "orders.new", b"5")
    assert drain_get(ch, q) == []


def test_alternate_exchange_takes_unroutable(ch: Any, prefix: str) -> None:
    ae = f"{prefix}.ae"
    ex = f"{prefix}.main"
    ch.exchange_declare(ae, "fanout")
    ch.exchange_declare(ex, "direct", arguments={"alternate-exchange": ae})
    routed = declare(ch, f"{prefix}.routed")
    unrouted = declare(ch, f"{prefix}.unrouted")
    ch.queue_bind(routed, ex, "known")
    ch.queue_bind(unrouted, ae)
    ch.confirm_delivery()
    ch.basic_publish(ex, "known", b"to-main")
    # mandatory: routed through the alternate exchange counts as routed (no basic.return)
    ch.basic_publish(ex, "unknown", b"to-ae", mandatory=True)
    assert drain_get(ch, routed) == [b"to-main"]
    method, _props, body = ch.basic_get(unrouted, auto_ack=True)
    assert body == b"to-ae"
    assert method.exchange == ex and method.routing_key == "unknown"


# ---------------------------------------------------------------- acks, redelivery, qos


def test_nack_and_reject_with_and_without_requeue(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q")
    for body in (b"nack-requeue", b"nack-drop", b"reject-requeue", b"reject-drop"):
        ch.basic_publish("", q, body)
    seen: dict[bytes, Any] = {}
    for _ in range(4):
        method, _p, body = ch.basic_get(q)
        assert not method.redelivered
        seen[body] = method
    ch.basic_nack(seen[b"nack-requeue"].delivery_tag, requeue=True)
    ch.basic_nack(seen[b"nack-drop"].delivery_tag, requeue=False)
    ch.basic_reject(seen[b"reject-requeue"].delivery_tag, requeue=True)
    ch.basic_reject(seen[b"reject-drop"].delivery_tag, requeue=False)
    again = []
    while True:
        method, _p, body = ch.basic_get(q)
        if method is None:
            break
        assert method.redelivered, body
        again.append(body)
        ch.basic_ack(method.delivery_tag)
    assert sorted(again) == [b"nack-requeue", b"reject-requeue"]
    assert message_count(ch, q) == 0


def test_nack_multiple_requeues_in_original_order(
    conn: pika.BlockingConnection, ch: Any, prefix: str
) -> None:
    q = declare(ch, f"{prefix}.q")
    for i in range(5):
        ch.basic_publish("", q, b"%d" % i)
    got = consume(conn, ch, q, 5, auto_ack=False)
    assert [b for _m, _p, b in got] == [b"0", b"1", b"2", b"3", b"4"]
    ch.basic_ack(got[0][0].delivery_tag)
    ch.basic_nack(got[3][0].delivery_tag, multiple=True, requeue=True)  # 1, 2, 3
    again = consume(conn, ch, q, 3, auto_ack=True, settle=0.2)
    assert [b for _m, _p, b in again] == [b"1", b"2", b"3"]
    assert all(m.redelivered for m, _p, _b in again)
    ch.basic_ack(got[4][0].delivery_tag)
    assert message_count(ch, q) == 0


def test_unacked_messages_return_when_the_channel_closes(
    conn: pika.BlockingConnection, prefix: str
) -> None:
    ch1 = conn.channel()
    q = declare(ch1, f"{prefix}.q")
    ch1.basic_publish("", q, b"x")
    method, _p, _b = ch1.basic_get(q)
    assert not method.redelivered
    ch1.close()
    ch2 = conn.channel()
    method, _p, body = ch2.basic_get(q, auto_ack=True)
    assert body == b"x" and method.redelivered


def test_basic_recover_redelivers_unacked(
    conn: pika.BlockingConnection, ch: Any, prefix: str
) -> None:
    q = declare(ch, f"{prefix}.q")
    for body in (b"a", b"b"):
        ch.basic_publish("", q, body)
    first = consume(conn, ch, q, 2, auto_ack=False)
    assert [b for _m, _p, b in first] == [b"a", b"b"]
    assert not any(m.redelivered for m, _p, _b in first)
    ch.basic_recover(requeue=True)
    got = []
    while True:
        method, _p, body = ch.basic_get(q, auto_ack=True)
        if method is None:
            break
        assert method.redelivered
        got.append(body)
    assert got == [b"a", b"b"]


def test_prefetch_limits_unacked_deliveries(
    conn: pika.BlockingConnection, ch: Any, prefix: str
) -> None:
    q = declare(ch, f"{prefix}.q")
    for i in range(5):
        ch.basic_publish("", q, b"%d" % i)
    ch.basic_qos(prefetch_count=2)
    got: list[Any] = []
    ch.basic_consume(q, lambda c, m, p, b: got.append((m, b)))
    assert wait_until(lambda: len(got) >= 2, pump=pump(conn))
    conn.process_data_events(time_limit=0.5)
    assert [b for _m, b in got] == [b"0", b"1"]
    assert message_count(ch, q) == 3
    ch.basic_ack(got[0][0].delivery_tag)
    assert wait_until(lambda: len(got) >= 3, pump=pump(conn))
    conn.process_data_events(time_limit=0.3)
    assert [b for _m, b in got] == [b"0", b"1", b"2"]
    ch.basic_ack(got[2][0].delivery_tag, multiple=True)
    assert wait_until(lambda: len(got) >= 5, pump=pump(conn))
    assert [b for _m, b in got] == [b"0", b"1", b"2", b"3", b"4"]


def test_competing_consumers_share_the_queue(broker: BrokerProcess, prefix: str) -> None:
    c1, c2 = blocking(broker.addr), blocking(broker.addr)
    try:
        ch1, ch2 = c1.channel(), c2.channel()
        q = declare(ch1, f"{prefix}.q")
        got1: list[bytes] = []
        got2: list[bytes] = []
        for ch, got in ((ch1, got1), (ch2, got2)):
            ch.basic_qos(prefetch_count=1)
            ch.basic_consume(
                q,
                lambda c, m, p, b, got=got: (got.append(b), c.basic_ack(m.delivery_tag)),
            )
        pub = c1.channel()
        bodies = [b"%d" % i for i in range(20)]
        for body in bodies:
            pub.basic_publish("", q, body)

        def pump_both(step: float) -> None:
            c1.process_data_events(time_limit=step / 2)
            c2.process_data_events(time_limit=step / 2)

        assert wait_until(lambda: len(got1) + len(got2) >= 20, pump=pump_both)
        pump_both(0.2)
        assert got1 and got2, (got1, got2)
        assert sorted(got1 + got2) == sorted(bodies)
        # each consumer sees its share in publish order
        assert got1 == sorted(got1, key=int) and got2 == sorted(got2, key=int)
    finally:
        c1.close()
        c2.close()


# ---------------------------------------------------------------- confirms and returns


def test_publisher_confirms(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q")
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", q, b"%d" % i)  # raises NackError / UnroutableError otherwise
    assert message_count(ch, q) == 50


def test_mandatory_unroutable_is_returned(
    conn: pika.BlockingConnection, ch: Any, prefix: str
) -> None:
    returned: list[tuple[Any, Any, bytes]] = []
    ch.add_on_return_callback(lambda c, m, p, b: returned.append((m, p, b)))
    ch.basic_publish(
        "amq.direct",
        f"{prefix}.nowhere",
        b"lost",
        pika.BasicProperties(message_id="m1"),
        mandatory=True,
    )
    ch.basic_publish("amq.direct", f"{prefix}.nowhere", b"dropped")  # not mandatory: silent
    assert wait_until(lambda: bool(returned), pump=pump(conn))
    conn.process_data_events(time_limit=0.2)
    assert len(returned) == 1
    method, props, body = returned[0]
    assert method.reply_code == 312 and method.reply_text == "NO_ROUTE"
    assert method.exchange == "amq.direct" and method.routing_key == f"{prefix}.nowhere"
    assert body == b"lost" and props.message_id == "m1"


def test_mandatory_unroutable_with_confirms_raises_unroutable(ch: Any, prefix: str) -> None:
    ch.confirm_delivery()
    with pytest.raises(px.UnroutableError) as info:
        ch.basic_publish("", f"{prefix}.missing-queue", b"x", mandatory=True)
    [msg] = info.value.messages
    assert msg.method.reply_code == 312 and msg.body == b"x"
    ch.basic_publish("", f"{prefix}.missing-queue", b"y")  # acked, just dropped


# ---------------------------------------------------------------- transactions


def test_tx_commit_and_rollback(broker: BrokerProcess, prefix: str) -> None:
    c = blocking(broker.addr)
    try:
        tx = c.channel()
        obs = c.channel()
        q = declare(obs, f"{prefix}.q")
        tx.tx_select()
        tx.basic_publish("", q, b"committed")
        assert message_count(obs, q) == 0
        tx.tx_commit()
        assert message_count(obs, q) == 1
        tx.basic_publish("", q, b"rolled-back")
        tx.tx_rollback()
        assert message_count(obs, q) == 1
        # an ack inside a transaction takes effect only on commit
        method, _p, body = tx.basic_get(q)
        assert body == b"committed"
        tx.basic_ack(method.delivery_tag)
        tx.tx_rollback()
        tx.close()  # the ack was rolled back: closing the channel requeues the message
        method, _p, body = obs.basic_get(q)
        assert body == b"committed" and method.redelivered
        tx2 = c.channel()
        tx2.tx_select()
        obs.basic_nack(method.delivery_tag, requeue=True)
        method, _p, _b = tx2.basic_get(q)
        tx2.basic_ack(method.delivery_tag)
        tx2.tx_commit()
        assert message_count(obs, q) == 0
        assert obs.basic_get(q) == (None, None, None)
    finally:
        c.close()


# ---------------------------------------------------------------- ttl, dlx, limits


def test_queue_message_ttl_expires_messages(ch: Any, prefix: str) -> None:
    # Long enough that the count right after the confirm sees it on a slow machine too (the
    # expiry clock ticks every 100 ms, so a message may live up to a tick less).
    q = declare(ch, f"{prefix}.q", arguments={"x-message-ttl": 1000})
    ch.confirm_delivery()  # once confirmed, the message is in the queue
    ch.basic_publish("", q, b"short-lived")
    assert message_count(ch, q) == 1
    assert wait_until(lambda: message_count(ch, q) == 0, timeout=5)
    assert ch.basic_get(q) == (None, None, None)


def test_per_message_expiration(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q")
    ch.confirm_delivery()
    ch.basic_publish("", q, b"expires", pika.BasicProperties(expiration="150"))
    ch.basic_publish("", q, b"stays")
    assert wait_until(lambda: message_count(ch, q) == 1, timeout=5)
    assert drain_get(ch, q) == [b"stays"]


def test_dead_lettering_on_expiry_and_reject(ch: Any, prefix: str) -> None:
    dlx = f"{prefix}.dlx"
    ch.exchange_declare(dlx, "direct")
    dlq = declare(ch, f"{prefix}.dlq")
    ch.queue_bind(dlq, dlx, "dead")
    src = declare(
        ch,
        f"{prefix}.src",
        arguments={
            "x-message-ttl": 150,
            "x-dead-letter-exchange": dlx,
            "x-dead-letter-routing-key": "dead",
        },
    )
    ch.basic_publish("", src, b"expired", pika.BasicProperties(headers={"orig": "h"}))
    assert wait_until(lambda: message_count(ch, dlq) == 1, timeout=5)
    method, props, body = ch.basic_get(dlq, auto_ack=True)
    assert body == b"expired"
    assert method.exchange == dlx and method.routing_key == "dead"
    assert props.headers["orig"] == "h"
    [death] = props.headers["x-death"]
    assert death["reason"] == "expired"
    assert death["queue"] == src
    assert death["count"] == 1
    assert death["exchange"] == ""
    assert death["routing-keys"] == [src]
    assert isinstance(death["time"], datetime.datetime)
    assert props.headers["x-first-death-reason"] == "expired"

    # explicitly rejected (from a queue without TTL, so only the reject can dead-letter it)
    src2 = declare(
        ch,
        f"{prefix}.src2",
        arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "dead"},
    )
    ch.basic_publish("", src2, b"rejected")
    method, _p, _b = ch.basic_get(src2)
    ch.basic_reject(method.delivery_tag, requeue=False)
    assert wait_until(lambda: message_count(ch, dlq) == 1, timeout=5)
    _m, props, body = ch.basic_get(dlq, auto_ack=True)
    assert body == b"rejected"
    assert props.headers["x-death"][0]["reason"] == "rejected"
    assert props.headers["x-death"][0]["queue"] == src2


def test_dead_letter_keeps_original_routing_key_without_dlrk(ch: Any, prefix: str) -> None:
    dlx = f"{prefix}.dlx"
    ch.exchange_declare(dlx, "fanout")
    dlq = declare(ch, f"{prefix}.dlq")
    ch.queue_bind(dlq, dlx)
    src = declare(ch, f"{prefix}.src", arguments={"x-dead-letter-exchange": dlx})
    ch.basic_publish("", src, b"m", pika.BasicProperties(expiration="60000"))
    method, _p, _b = ch.basic_get(src)
    ch.basic_nack(method.delivery_tag, requeue=False)
    assert wait_until(lambda: message_count(ch, dlq) == 1, timeout=5)
    method, props, _b = ch.basic_get(dlq, auto_ack=True)
    assert method.routing_key == src
    assert props.expiration is None  # removed on dead-lettering
    assert props.headers["x-death"][0]["reason"] == "rejected"


def test_max_length_drop_head(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q", arguments={"x-max-length": 2})
    for body in (b"1", b"2", b"3", b"4"):
        ch.basic_publish("", q, body)
    assert drain_get(ch, q) == [b"3", b"4"]


def test_max_length_drop_head_dead_letters(ch: Any, prefix: str) -> None:
    dlq = declare(ch, f"{prefix}.dlq")
    q = declare(
        ch,
        f"{prefix}.q",
        arguments={
            "x-max-length": 1,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dlq,
        },
    )
    ch.basic_publish("", q, b"old")
    ch.basic_publish("", q, b"new")
    assert drain_get(ch, q) == [b"new"]
    _m, props, body = ch.basic_get(dlq, auto_ack=True)
    assert body == b"old" and props.headers["x-death"][0]["reason"] == "maxlen"


def test_max_length_reject_publish_nacks_confirm(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q", arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"1")
    ch.basic_publish("", q, b"2")
    with pytest.raises(px.NackError):
        ch.basic_publish("", q, b"3")
    assert drain_get(ch, q) == [b"1", b"2"]
    ch.basic_publish("", q, b"4")  # room again: acked
    assert drain_get(ch, q) == [b"4"]


def test_queue_expires_when_unused(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q", arguments={"x-expires": 1000})
    assert message_count(ch, q) == 0

    def gone() -> bool:
        probe = ch.connection.channel()
        try:
            probe.queue_declare(q, passive=True)
        except px.ChannelClosedByBroker as e:
            assert e.reply_code == 404
            return True
        probe.close()
        return False

    # polls further apart than x-expires, in case a passive declare counts as a use
    assert wait_until(gone, timeout=5, step=0.5)


def test_queue_with_consumer_does_not_expire(
    conn: pika.BlockingConnection, ch: Any, prefix: str
) -> None:
    q = declare(ch, f"{prefix}.q", arguments={"x-expires": 1000})
    ch.basic_consume(q, lambda *a: None, auto_ack=True)
    conn.process_data_events(time_limit=2.5)
    other = conn.channel()
    assert other.queue_declare(q, passive=True).method.consumer_count == 1


# ---------------------------------------------------------------- consumer cancel


def test_queue_deleted_while_consumed_notifies_consumer(
    conn: pika.BlockingConnection, broker: BrokerProcess, prefix: str
) -> None:
    ch = conn.channel()
    q = declare(ch, f"{prefix}.q")
    cancelled: list[Any] = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method))
    tag = ch.basic_consume(q, lambda *a: None)
    assert ch.consumer_tags == [tag]
    other = blocking(broker.addr)
    try:
        assert other.channel().queue_delete(q).method.message_count == 0
    finally:
        other.close()
    assert wait_until(lambda: bool(cancelled), pump=pump(conn))
    assert cancelled[0].consumer_tag == tag
    assert ch.consumer_tags == []
    assert ch.is_open and conn.is_open


def test_auto_delete_queue_goes_with_its_last_consumer(
    conn: pika.BlockingConnection, ch: Any, prefix: str
) -> None:
    q = declare(ch, f"{prefix}.q", auto_delete=True)
    tag = ch.basic_consume(q, lambda *a: None, auto_ack=True)
    ch.basic_cancel(tag)
    probe = conn.channel()
    with pytest.raises(px.ChannelClosedByBroker) as info:
        probe.queue_declare(q, passive=True)
    assert info.value.reply_code == 404


# ---------------------------------------------------------------- errors


def test_exclusive_queue_is_locked_to_its_connection(
    conn: pika.BlockingConnection, broker: BrokerProcess, prefix: str
) -> None:
    q = declare(conn.channel(), f"{prefix}.q", exclusive=True)
    other = blocking(broker.addr)
    try:
        for attempt in (
            lambda ch: ch.queue_declare(q, exclusive=True),
            lambda ch: ch.queue_declare(q, passive=True),
            lambda ch: ch.basic_consume(q, lambda *a: None),
            lambda ch: ch.basic_get(q),
        ):
            ch = other.channel()
            with pytest.raises(px.ChannelClosedByBroker) as info:
                attempt(ch)
            assert info.value.reply_code == 405
            assert info.value.reply_text.startswith("RESOURCE_LOCKED")
        assert other.is_open
    finally:
        other.close()
    # gone with its connection
    conn.close()
    c2 = blocking(broker.addr)
    try:
        with pytest.raises(px.ChannelClosedByBroker) as info:
            c2.channel().queue_declare(q, passive=True)
        assert info.value.reply_code == 404
    finally:
        c2.close()


def test_passive_declare_of_missing_queue_and_exchange(
    conn: pika.BlockingConnection, prefix: str
) -> None:
    ch = conn.channel()
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.queue_declare(f"{prefix}.missing", passive=True)
    assert info.value.reply_code == 404
    assert info.value.reply_text == f"NOT_FOUND - no queue '{prefix}.missing' in vhost '/'"
    assert ch.is_closed and conn.is_open
    ch = conn.channel()
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.exchange_declare(f"{prefix}.missing-ex", passive=True)
    assert info.value.reply_code == 404
    assert conn.channel().queue_declare("", exclusive=True).method.queue.startswith("amq.gen-")


def test_redeclare_with_different_properties_is_refused(
    conn: pika.BlockingConnection, prefix: str
) -> None:
    ch = conn.channel()
    q = declare(ch, f"{prefix}.q", durable=False)
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.queue_declare(q, durable=True)
    assert info.value.reply_code == 406
    assert "inequivalent arg 'durable'" in info.value.reply_text
    ch = conn.channel()
    declare(ch, f"{prefix}.ttl", arguments={"x-message-ttl": 1000})
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.queue_declare(f"{prefix}.ttl", arguments={"x-message-ttl": 2000})
    assert info.value.reply_code == 406
    ch = conn.channel()
    ch.exchange_declare(f"{prefix}.ex", "direct")
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.exchange_declare(f"{prefix}.ex", "fanout")
    assert info.value.reply_code == 406
    # identical redeclares are fine
    ch = conn.channel()
    assert declare(ch, f"{prefix}.q", durable=False) == q
    ch.exchange_declare(f"{prefix}.ex", "direct")


def test_publish_to_missing_exchange_closes_only_the_channel(
    conn: pika.BlockingConnection, prefix: str
) -> None:
    ch = conn.channel()
    ch.basic_publish(f"{prefix}.no-such-exchange", "rk", b"x")
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.queue_declare("", exclusive=True)  # the close arrives before this answer
    assert info.value.reply_code == 404
    assert info.value.reply_text == (
        f"NOT_FOUND - no exchange '{prefix}.no-such-exchange' in vhost '/'"
    )
    assert conn.is_open
    ch2 = conn.channel()
    q = declare(ch2, f"{prefix}.q")
    ch2.basic_publish("", q, b"still works")
    assert drain_get(ch2, q) == [b"still works"]


def test_reserved_names_are_refused(conn: pika.BlockingConnection, prefix: str) -> None:
    ch = conn.channel()
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.exchange_declare(f"amq.{prefix}", "direct")
    assert info.value.reply_code == 403
    ch = conn.channel()
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.queue_declare(f"amq.{prefix}")
    assert info.value.reply_code == 403


def test_ack_of_unknown_delivery_tag_is_406(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.basic_ack(42)
    with pytest.raises(px.ChannelClosedByBroker) as info:
        ch.queue_declare("", exclusive=True)
    assert info.value.reply_code == 406
    assert conn.is_open


def test_bad_credentials_are_refused(broker: BrokerProcess) -> None:
    with pytest.raises(px.ProbableAuthenticationError) as info:
        blocking(broker.addr, credentials=pika.PlainCredentials("guest", "wrong"))
    assert "403" in str(info.value) and "ACCESS_REFUSED" in str(info.value)
    with pytest.raises(px.ProbableAuthenticationError):
        blocking(broker.addr, credentials=pika.PlainCredentials("nobody", "guest"))


def test_unknown_vhost_is_530(broker: BrokerProcess) -> None:
    with pytest.raises(px.ProbableAccessDeniedError) as info:
        blocking(broker.addr, virtual_host="no-such-vhost")
    assert "530" in str(info.value) and "NOT_ALLOWED" in str(info.value)


def test_user_vhost_permissions(broker_factory: BrokerFactory) -> None:
    b = broker_factory(
        """
vhosts = ["/", "orders"]

[[users]]
name = "alice"
password = "s3cret"
vhosts = ["orders"]

[[users]]
name = "guest"
password = "guest"
vhosts = ["/"]
loopback_only = true
"""
    )
    alice = pika.PlainCredentials("alice", "s3cret")
    c = blocking(b.addr, credentials=alice, virtual_host="orders")
    q = declare(c.channel(), "in-orders")
    c.close()
    with pytest.raises(px.ProbableAccessDeniedError) as info:
        blocking(b.addr, credentials=alice, virtual_host="/")
    assert "530" in str(info.value)
    # vhosts are separate namespaces
    g = blocking(b.addr)
    try:
        with pytest.raises(px.ChannelClosedByBroker) as info2:
            g.channel().queue_declare(q, passive=True)
        assert info2.value.reply_code == 404
    finally:
        g.close()


def test_heartbeat_negotiation(broker: BrokerProcess, broker_factory: BrokerFactory) -> None:
    proposed: list[int] = []

    def choose(conn: Any, server_value: int) -> int:
        proposed.append(server_value)
        return 7

    c = blocking(broker.addr, heartbeat=choose)
    try:
        assert proposed == [60]  # the broker proposes RabbitMQ's default
        assert c._impl.params.heartbeat == 7
    finally:
        c.close()
    c = blocking(broker.addr, heartbeat=3)
    try:
        assert c._impl.params.heartbeat == 3
        ch = c.channel()
        assert ch.queue_declare("", exclusive=True).method.queue
    finally:
        c.close()
    b = broker_factory("[limits]\nheartbeat = 17\n")
    c = blocking(b.addr)  # heartbeat=None: take the broker's proposal
    try:
        assert c._impl.params.heartbeat == 17
    finally:
        c.close()


def test_large_message_spans_many_frames(ch: Any, prefix: str) -> None:
    q = declare(ch, f"{prefix}.q")
    body = bytes(range(256)) * 4096 + b"tail"  # ~1 MiB: several frame_max-sized body frames
    ch.confirm_delivery()
    ch.basic_publish("", q, body)
    _m, _p, got = ch.basic_get(q, auto_ack=True)
    assert got == body
    ch.basic_publish("", q, b"")  # and an empty body
    _m, _p, got = ch.basic_get(q, auto_ack=True)
    assert got == b""


def test_memory_watermark_blocks_and_unblocks_publishers(
    broker_factory: BrokerFactory, prefix: str
) -> None:
    b = broker_factory("[limits]\nhigh_watermark_bytes = 100000\n")
    events: list[Any] = []
    pub = blocking(b.addr)
    drainer = blocking(b.addr)
    try:
        pub.add_on_connection_blocked_callback(
            lambda c, frame: events.append(("blocked", frame.method.reason))
        )
        pub.add_on_connection_unblocked_callback(lambda c, frame: events.append("unblocked"))
        ch = pub.channel()
        q = declare(ch, f"{prefix}.q")
        for _ in range(3):
            ch.basic_publish("", q, b"x" * 40000)  # 120 kB queued > 100 kB mark
        assert wait_until(lambda: bool(events), pump=pump(pub))
        assert events == [("blocked", "low on memory")]
        dch = drainer.channel()
        assert len(drain_get(dch, q)) == 3
        assert wait_until(lambda: "unblocked" in events, pump=pump(pub))
        ch.basic_publish("", q, b"after")  # publishing works again
        assert wait_until(lambda: message_count(dch, q) == 1)
    finally:
        pub.close()
        drainer.close()


def test_ipv4_and_ipv6_listeners(broker_factory: BrokerFactory, prefix: str) -> None:
    try:
        socket.socket(socket.AF_INET6).close()
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    b = broker_factory('[server]\nlisten = ["127.0.0.1:0", "[::1]:0"]\n', listen=None)
    hosts = sorted(h for h, _p in b.listeners)
    assert hosts == ["127.0.0.1", "::1"], b.listeners
    for host, port in b.listeners:
        c = blocking((host, port))
        try:
            ch = c.channel()
            q = declare(ch, f"{prefix}.{host}")
            ch.basic_publish("", q, host.encode())
            assert drain_get(ch, q) == [host.encode()]
        finally:
            c.close()

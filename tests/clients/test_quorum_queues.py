"""Queues declared with ``x-queue-type: quorum`` as pika sees them, with RabbitMQ's rules (every
queue here is replicated to all members anyway; these are the rules an application written for
RabbitMQ's quorum queues relies on): such a queue is durable and belongs to no connection, a
message that came back (requeued, or its channel closed) carries ``x-delivery-count`` (how often)
when it is delivered again, and past ``x-delivery-limit`` it is dead-lettered with reason
``delivery_limit`` instead of coming back again. Every test here also passes against RabbitMQ
3.10.8, whose basic.get (not its consumers) also sends a count of 0 on a first delivery: the
tests do not look at the first one's headers there."""

from __future__ import annotations

from typing import Any

import pika
import pika.exceptions as px
import pytest
from clientutil import BrokerProcess, blocking

Chan = pika.adapters.blocking_connection.BlockingChannel
QUORUM = {"x-queue-type": "quorum"}


def _refused(ch: Chan, **declare: Any) -> tuple[int, str]:
    with pytest.raises(px.ChannelClosedByBroker) as e:
        ch.connection.channel().queue_declare(**declare)
    return e.value.reply_code, e.value.reply_text


def test_a_quorum_queue_is_durable_and_belongs_to_no_connection(
    confirm_ch: Chan, prefix: str
) -> None:
    q = f"{prefix}.qq"
    for props, word in (
        ({}, "non-durable"),
        ({"durable": True, "exclusive": True}, "exclusive-owner"),
        ({"durable": True, "auto_delete": True}, "auto-delete"),
    ):
        assert _refused(confirm_ch, queue=q, arguments=QUORUM, **props) == (
            406,
            f"PRECONDITION_FAILED - invalid property '{word}' for queue '{q}' in vhost '/'",
        )
    assert _refused(confirm_ch, queue=f"{prefix}.cq", arguments={"x-delivery-limit": 2}) == (
        406,
        f"PRECONDITION_FAILED - invalid arg 'x-delivery-limit' for queue '{prefix}.cq' in "
        "vhost '/' of queue type rabbit_classic_queue",
    )


def test_deliveries_count_returns_and_the_limit_dead_letters(confirm_ch: Chan, prefix: str) -> None:
    ch = confirm_ch
    dlx, dead, q = f"{prefix}.dlx", f"{prefix}.dead", f"{prefix}.qq"
    ch.exchange_declare(dlx, "fanout")
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx)
    args = {**QUORUM, "x-delivery-limit": 2, "x-dead-letter-exchange": dlx}
    ch.queue_declare(q, durable=True, arguments=args)
    ch.basic_publish("", q, b"m", pika.BasicProperties(headers={"a": 1}))
    seen = []
    for _ in range(10):  # bounded: a broken limit fails instead of looping
        m, p, _body = ch.basic_get(q)
        if m is None:
            break
        seen.append((m.redelivered, p.headers))
        ch.basic_nack(m.delivery_tag, requeue=True)
    assert seen[0][0] is False and seen[0][1]["a"] == 1
    assert seen[1:] == [
        (True, {"a": 1, "x-delivery-count": 1}),
        (True, {"a": 1, "x-delivery-count": 2}),
    ]
    m, p, body = ch.basic_get(dead, auto_ack=True)
    assert body == b"m"
    assert p.headers["x-first-death-reason"] == "delivery_limit"
    assert p.headers["x-death"][0]["reason"] == "delivery_limit"
    assert p.headers["x-death"][0]["queue"] == q
    assert p.headers["a"] == 1 and "x-delivery-count" not in p.headers


def test_a_closed_channel_counts_as_a_return(confirm_ch: Chan, prefix: str) -> None:
    q = f"{prefix}.qq"
    confirm_ch.queue_declare(q, durable=True, arguments={**QUORUM, "x-delivery-limit": 1})
    # A count the publisher set itself is the broker's to set.
    confirm_ch.basic_publish("", q, b"n", pika.BasicProperties(headers={"x-delivery-count": 7}))
    seen = []
    for _ in range(3):
        k = confirm_ch.connection.channel()
        m, p, _body = k.basic_get(q)
        if m is None:
            break
        seen.append((m.redelivered, p.headers))
        k.close()  # unacked: back to the queue, counted
    # The broker's count replaced the publisher's; past the limit, with no dead-letter
    # exchange, the message is dropped.
    assert len(seen) == 2 and seen[0][0] is False
    assert seen[1] == (True, {"x-delivery-count": 1})
    assert confirm_ch.queue_declare(q, passive=True).method.message_count == 0


def test_consumers_get_the_count_too_and_without_a_limit_it_only_counts(
    broker: BrokerProcess, confirm_ch: Chan, prefix: str
) -> None:
    q = f"{prefix}.qq"
    confirm_ch.queue_declare(q, durable=True, arguments=QUORUM)
    confirm_ch.basic_publish("", q, b"c")
    # A connection of its own: pika's blocking adapter may hold back deliveries to one channel
    # while it waits for a reply on another channel of the same connection.
    conn = blocking(broker.addr)
    k = conn.channel()
    got: list[tuple[bool, Any]] = []

    def on(_c: Any, m: Any, p: Any, _b: bytes) -> None:
        got.append((m.redelivered, p.headers))
        if len(got) < 5:
            k.basic_reject(m.delivery_tag, requeue=True)
        else:
            k.basic_ack(m.delivery_tag)

    k.basic_consume(q, on)
    try:
        for _ in range(300):  # up to 15 s
            if len(got) == 5:
                break
            conn.process_data_events(time_limit=0.05)
    finally:
        conn.close()
    assert got == [
        (False, None),
        (True, {"x-delivery-count": 1}),
        (True, {"x-delivery-count": 2}),
        (True, {"x-delivery-count": 3}),
        (True, {"x-delivery-count": 4}),
    ]

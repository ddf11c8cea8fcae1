"""Priority queues (``x-max-priority``) as pika sees them, with RabbitMQ's rules: the highest
priority goes first and equal priorities keep their order; no priority counts as 0, one above
the maximum as the maximum; a requeued message goes back to its place. Every test here also
passes against RabbitMQ 3.10.8."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pika
import pika.exceptions as px
import pytest
from clientutil import BrokerProcess, blocking

Chan = pika.adapters.blocking_connection.BlockingChannel


@contextlib.contextmanager
def _channel(broker: BrokerProcess) -> Iterator[Chan]:
    """A channel in confirm mode: a publish returns once the broker has it."""
    c = blocking(broker.addr)
    try:
        ch = c.channel()
        ch.confirm_delivery()
        yield ch
    finally:
        c.close()


def _publish(ch: Chan, q: str, *prios: int | None) -> None:
    for i, p in enumerate(prios):
        ch.basic_publish("", q, f"{i}:{p}".encode(), pika.BasicProperties(priority=p))


def _drain(ch: Chan, q: str) -> list[str]:
    got = []
    while True:
        _m, _p, body = ch.basic_get(q, auto_ack=True)
        if body is None:
            return got
        got.append(body.decode())


def test_highest_priority_first_and_fifo_within_a_priority(
    broker: BrokerProcess, prefix: str
) -> None:
    with _channel(broker) as ch:
        q = ch.queue_declare(f"{prefix}.pq", arguments={"x-max-priority": 10}).method.queue
        _publish(ch, q, 1, 5, None, 9, 5, 200, 0)
        assert ch.queue_declare(q, passive=True).method.message_count == 7
        # 200 is above the maximum: it counts as 10. No priority is 0, after the 1.
        assert _drain(ch, q) == ["5:200", "3:9", "1:5", "4:5", "0:1", "2:None", "6:0"]

        # Without x-max-priority the priority property changes nothing.
        plain = ch.queue_declare(f"{prefix}.plain").method.queue
        _publish(ch, plain, 1, 9, 5)
        assert _drain(ch, plain) == ["0:1", "1:9", "2:5"]


def test_a_consumer_gets_priority_order_and_a_requeued_message_its_place_back(
    broker: BrokerProcess, prefix: str
) -> None:
    with _channel(broker) as ch:
        q = ch.queue_declare(f"{prefix}.pq", arguments={"x-max-priority": 3}).method.queue
        _publish(ch, q, 1, 3, 2, 3)
        method, _p, body = ch.basic_get(q)
        assert body == b"1:3"
        ch.basic_nack(method.delivery_tag, requeue=True)
        ch.basic_qos(prefetch_count=1)
        got = []
        for method, _props, body in ch.consume(q, inactivity_timeout=5):
            assert method is not None, f"stalled after {got}"
            got.append((body.decode(), method.redelivered))
            ch.basic_ack(method.delivery_tag)
            if len(got) == 4:
                break
        ch.cancel()
        assert got == [("1:3", True), ("3:3", False), ("2:2", False), ("0:1", False)]


@pytest.mark.parametrize(
    ("value", "why"),
    # RabbitMQ 3.10.8's words, each.
    [
        (256, "{max_value_exceeded,256}"),
        (-1, "{value_negative,-1}"),
        ("10", '"expected integer, got longstr"'),
    ],
)
def test_a_bad_max_priority_is_406(
    broker: BrokerProcess, prefix: str, value: object, why: str
) -> None:
    with _channel(broker) as ch, pytest.raises(px.ChannelClosedByBroker) as info:
        ch.queue_declare(f"{prefix}.bad", arguments={"x-max-priority": value})
    assert info.value.reply_code == 406
    assert "x-max-priority" in info.value.reply_text and why in info.value.reply_text


def test_a_quorum_queue_refuses_priorities(broker: BrokerProcess, prefix: str) -> None:
    with _channel(broker) as ch, pytest.raises(px.ChannelClosedByBroker) as info:
        ch.queue_declare(
            f"{prefix}.qq", durable=True, arguments={"x-queue-type": "quorum", "x-max-priority": 5}
        )
    assert info.value.reply_code == 406
    assert info.value.reply_text.endswith(
        "invalid arg 'x-max-priority' for queue "
        f"'{prefix}.qq' in vhost '/' of queue type rabbit_quorum_queue"
    )


def test_redeclare_with_another_max_priority_is_406(broker: BrokerProcess, prefix: str) -> None:
    with _channel(broker) as ch:
        q = ch.queue_declare(f"{prefix}.pq", arguments={"x-max-priority": 5}).method.queue
        ch.queue_declare(q, arguments={"x-max-priority": 5})  # the same: fine
        with pytest.raises(px.ChannelClosedByBroker) as info:
            ch.queue_declare(q, arguments={"x-max-priority": 6})
        assert info.value.reply_code == 406 and "inequivalent arg 'x-max-priority'" in (
            info.value.reply_text
        )


@pytest.mark.parametrize("arguments", [{}, {"x-max-priority": 5}])
def test_messages_rejected_one_by_one_go_back_to_their_places(
    broker: BrokerProcess, prefix: str, arguments: dict[str, int]
) -> None:
    # RabbitMQ puts a requeued message back at its original position where it can: taking
    # A, B, C and rejecting them one by one in the order B, A, C queues A, B, C again.
    with _channel(broker) as ch:
        q = ch.queue_declare(f"{prefix}.q", arguments=arguments).method.queue
        _publish(ch, q, 2, 2, 2, 2)
        tags = {}
        for _ in range(3):
            method, _p, body = ch.basic_get(q)
            tags[body.decode()] = method.delivery_tag
        for name in ("1:2", "0:2", "2:2"):
            ch.basic_reject(tags[name], requeue=True)
        assert _drain(ch, q) == ["0:2", "1:2", "2:2", "3:2"]

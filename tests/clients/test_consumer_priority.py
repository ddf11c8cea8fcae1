"""Consumer priorities (``x-priority`` on basic.consume) as pika sees them, with RabbitMQ's
rules: the highest-priority consumers that can take a message get it, in turn among equals; a
lower one gets messages only while every higher one cannot take more (prefetch full). No
priority counts as 0, negative ones are lower. Every test here also passes against RabbitMQ
3.10.8. (A consumer whose connection the broker may not yet write to, waiting for its member's
grant, keeps lower priorities waiting: it can take more, just not at this instant.)

Each consumer has a connection of its own: pika's blocking adapter may hold back deliveries to
one channel while it waits for a reply on another channel of the same connection."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions as px
import pytest
from clientutil import BrokerProcess, blocking

Chan = pika.adapters.blocking_connection.BlockingChannel


@pytest.fixture
def ch(confirm_ch: Chan) -> Chan:
    """The publishing channel, in confirm mode: a publish returns once the broker has it."""
    return confirm_ch


@pytest.fixture
def consumers(broker: BrokerProcess) -> Iterator[Any]:
    """``consumers(queue, [(priority or None, prefetch, auto_ack), ...])`` -> a list of the
    bodies each consumer gets, and a function that pumps all their connections."""
    conns: list[pika.BlockingConnection] = []

    def make(queue: str, specs: list[tuple[int | None, int, bool]]) -> tuple[list[Any], Any]:
        got: list[list[bytes]] = []
        for prio, prefetch, auto_ack in specs:
            c = blocking(broker.addr)
            conns.append(c)
            k = c.channel()
            if prefetch:
                k.basic_qos(prefetch_count=prefetch)
            bodies: list[bytes] = []
            got.append(bodies)
            k.basic_consume(
                queue,
                lambda _c, _m, _p, b, into=bodies: into.append(b),
                auto_ack=auto_ack,
                arguments={} if prio is None else {"x-priority": prio},
            )

        def pump(until: Any, seconds: float = 5.0) -> None:
            for _ in range(int(seconds / 0.1)):
                if until():
                    break
                for c in conns:
                    c.process_data_events(time_limit=0.05)
            for c in conns:  # anything more that would arrive, to be seen by the test
                c.process_data_events(time_limit=0.1)

        return got, pump

    yield make
    for c in conns:
        if c.is_open:
            c.close()


def _publish(ch: Chan, q: str, n: int) -> None:
    for i in range(n):
        ch.basic_publish("", q, b"%d" % i)


def _total(got: list[list[bytes]], n: int) -> Any:
    return lambda: sum(map(len, got)) >= n


def test_a_lower_priority_consumer_gets_messages_only_while_the_higher_is_full(
    ch: Chan, consumers: Any, prefix: str
) -> None:
    q = ch.queue_declare(f"{prefix}.q").method.queue
    (hi, lo), pump = consumers(q, [(10, 1, False), (0, 0, True)])
    _publish(ch, q, 5)
    pump(_total([hi, lo], 5))
    assert hi == [b"0"] and lo == [b"1", b"2", b"3", b"4"]


def test_equal_priorities_take_turns_and_a_lower_one_gets_nothing(
    ch: Chan, consumers: Any, prefix: str
) -> None:
    q = ch.queue_declare(f"{prefix}.q").method.queue
    (a, b, lo), pump = consumers(q, [(5, 0, True), (5, 0, True), (None, 0, True)])
    _publish(ch, q, 6)
    pump(_total([a, b, lo], 6))
    # Both take part; who gets the first ones depends on which connection the broker may
    # write to first (RabbitMQ alternates strictly: 0, 2, 4 and 1, 3, 5).
    assert sorted(a + b) == [b"%d" % i for i in range(6)] and a and b and lo == []


def test_no_priority_counts_as_zero_above_a_negative_one(
    ch: Chan, consumers: Any, prefix: str
) -> None:
    q = ch.queue_declare(f"{prefix}.q").method.queue
    (neg, none), pump = consumers(q, [(-1, 0, True), (None, 0, True)])
    _publish(ch, q, 4)
    pump(_total([neg, none], 4))
    assert neg == [] and none == [b"0", b"1", b"2", b"3"]


def test_full_higher_consumers_pass_the_rest_down(ch: Chan, consumers: Any, prefix: str) -> None:
    q = ch.queue_declare(f"{prefix}.q").method.queue
    (a, b, c), pump = consumers(q, [(5, 2, False), (5, 2, False), (1, 0, True)])
    _publish(ch, q, 8)
    pump(_total([a, b, c], 8))
    assert sorted(a + b) == [b"0", b"1", b"2", b"3"] and len(a) == len(b) == 2
    assert c == [b"4", b"5", b"6", b"7"]


def test_a_single_active_consumer_queue_ignores_priorities(
    ch: Chan, consumers: Any, prefix: str
) -> None:
    """The eldest consumer is the active one whatever the priorities (RabbitMQ 3.10.8)."""
    q = ch.queue_declare(f"{prefix}.q", arguments={"x-single-active-consumer": True})
    name = q.method.queue
    (first, second), pump = consumers(name, [(0, 0, True), (10, 0, True)])
    _publish(ch, name, 3)
    pump(_total([first, second], 3))
    assert first == [b"0", b"1", b"2"] and second == []


def test_a_priority_that_is_not_an_integer_is_406(ch: Chan, prefix: str) -> None:
    q = ch.queue_declare(f"{prefix}.q").method.queue
    with pytest.raises(px.ChannelClosedByBroker) as e:
        ch.connection.channel().basic_consume(q, lambda *a: None, arguments={"x-priority": "high"})
    assert e.value.reply_code == 406
    assert e.value.reply_text == (
        f"PRECONDITION_FAILED - invalid arg 'x-priority' for queue '{q}' in vhost '/': "
        '"expected integer, got longstr"'
    )
    # Any integer will do, large and negative ones too.
    for prio in (2**40, -5):
        ch.connection.channel().basic_consume(q, lambda *a: None, arguments={"x-priority": prio})

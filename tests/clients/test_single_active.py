"""Single active consumer (``x-single-active-consumer``) as pika sees it, with RabbitMQ's
rules: of a queue's consumers only the eldest gets messages; when it is cancelled or its
channel or connection closes, the next in the order they subscribed takes over. Messages the
old one had not acknowledged stay with its channel after a cancel and go back to their places
when it closes. Every test here also passes against RabbitMQ 3.10.8 but one, which says where
RabbitMQ differs.

Each consumer has a connection of its own: pika's blocking adapter may hold back deliveries to
one channel while it waits for a reply on another channel of the same connection."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import pika
import pika.exceptions as px
import pytest
from clientutil import BrokerProcess, blocking

Chan = pika.adapters.blocking_connection.BlockingChannel
SAC = {"x-single-active-consumer": True}


class Consumer:
    """A consumer on a connection of its own that records (body, redelivered, tag)."""

    def __init__(
        self, broker: BrokerProcess, queue: str, auto_ack: bool = True, prefetch: int = 0
    ) -> None:
        self.conn = blocking(broker.addr)
        self.ch = self.conn.channel()
        if prefetch:
            self.ch.basic_qos(prefetch_count=prefetch)
        self.got: list[tuple[bytes, bool, int]] = []
        self.tag = self.ch.basic_consume(queue, self._on, auto_ack=auto_ack)

    def _on(self, _ch: Any, m: Any, _p: Any, body: bytes) -> None:
        self.got.append((body, m.redelivered, m.delivery_tag))

    def bodies(self) -> list[bytes]:
        return [b for b, _r, _t in self.got]

    def pump(self, seconds: float = 0.3) -> None:
        self.conn.process_data_events(time_limit=seconds)

    def close(self) -> None:
        if self.conn.is_open:
            self.conn.close()


@pytest.fixture
def ch(confirm_ch: Chan) -> Chan:
    """The publishing channel, in confirm mode: a publish returns once the broker has it."""
    return confirm_ch


def _publish(ch: Chan, q: str, *bodies: bytes) -> None:
    for b in bodies:
        ch.basic_publish("", q, b)


def _pump_until(consumers: list[Consumer], done: Any, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.1)):
        if done():
            return
        for c in consumers:
            c.pump(0.05)
    assert done()


def test_only_the_eldest_consumer_gets_messages(
    broker: BrokerProcess, ch: Chan, prefix: str
) -> None:
    q = ch.queue_declare(f"{prefix}.sac", arguments=SAC).method.queue
    first, second = Consumer(broker, q), Consumer(broker, q)
    try:
        assert ch.queue_declare(q, passive=True).method.consumer_count == 2
        _publish(ch, q, b"1", b"2", b"3", b"4")
        _pump_until([first, second], lambda: len(first.got) == 4)
        second.pump(0.3)
        assert first.bodies() == [b"1", b"2", b"3", b"4"] and second.got == []
    finally:
        first.close()
        second.close()


def test_without_the_argument_consumers_share(broker: BrokerProcess, ch: Chan, prefix: str) -> None:
    q = ch.queue_declare(f"{prefix}.plain", arguments={"x-single-active-consumer": False})
    name = q.method.queue
    a, b = Consumer(broker, name), Consumer(broker, name)
    try:
        _publish(ch, name, b"1", b"2", b"3", b"4")
        _pump_until([a, b], lambda: len(a.got) + len(b.got) == 4)
        assert a.got and b.got
    finally:
        a.close()
        b.close()


def test_cancel_hands_over_to_the_next_consumer(
    broker: BrokerProcess, ch: Chan, prefix: str
) -> None:
    q = ch.queue_declare(f"{prefix}.sac", arguments=SAC).method.queue
    first, second, third = Consumer(broker, q), Consumer(broker, q), Consumer(broker, q)
    try:
        _publish(ch, q, b"1")
        _pump_until([first], lambda: len(first.got) == 1)
        first.ch.basic_cancel(first.tag)
        _publish(ch, q, b"2", b"3")
        _pump_until([second, third], lambda: len(second.got) == 2)
        third.pump(0.3)
        assert second.bodies() == [b"2", b"3"] and third.got == []
    finally:
        for c in (first, second, third):
            c.close()


def test_cancel_with_unacked_hands_over_at_once_and_they_follow_when_requeued(
    broker: BrokerProcess, ch: Chan, prefix: str
) -> None:
    q = ch.queue_declare(f"{prefix}.sac", arguments=SAC).method.queue
    first = Consumer(broker, q, auto_ack=False)
    second = Consumer(broker, q)
    try:
        _publish(ch, q, b"1", b"2", b"3")
        _pump_until([first], lambda: len(first.got) == 3)
        # A cancelled consumer's unacked messages stay with its channel; the next consumer
        # takes over now, and gets them when they are requeued, redelivered.
        first.ch.basic_cancel(first.tag)
        _publish(ch, q, b"4")
        _pump_until([second], lambda: len(second.got) == 1)
        assert second.got[0][:2] == (b"4", False)
        first.ch.basic_nack(first.got[-1][2], multiple=True, requeue=True)
        _pump_until([second], lambda: len(second.got) == 4)
        assert [(b, r) for b, r, _t in second.got[1:]] == [(b"1", True), (b"2", True), (b"3", True)]
    finally:
        first.close()
        second.close()


def test_cancel_hands_messages_that_were_waiting_to_the_next_at_once(
    broker: BrokerProcess, ch: Chan, prefix: str
) -> None:
    """RabbitMQ 3.10.8 differs: it leaves them waiting until the next publish or requeue
    (and passes this test only if one comes)."""
    q = ch.queue_declare(f"{prefix}.sac", arguments=SAC).method.queue
    first = Consumer(broker, q, auto_ack=False, prefetch=2)
    second = Consumer(broker, q)
    try:
        _publish(ch, q, b"0", b"1", b"2", b"3")
        _pump_until([first], lambda: len(first.got) == 2)
        first.ch.basic_cancel(first.tag)
        _pump_until([second], lambda: len(second.got) == 2)
        assert second.bodies() == [b"2", b"3"]
    finally:
        first.close()
        second.close()


def test_a_dead_active_consumer_s_unacked_go_to_the_next_first(
    broker: BrokerProcess, ch: Chan, prefix: str
) -> None:
    q = ch.queue_declare(f"{prefix}.sac", arguments=SAC).method.queue
    first = Consumer(broker, q, auto_ack=False, prefetch=2)
    second = Consumer(broker, q, auto_ack=False)
    try:
        _publish(ch, q, b"0", b"1", b"2", b"3", b"4")
        _pump_until([first], lambda: len(first.got) == 2)
        second.pump(0.3)
        assert first.bodies() == [b"0", b"1"] and second.got == []
        # The consumer dies: its socket closes with no basic.cancel or close before it (a
        # clean pika close cancels first, and a cancel hands over at once, see above). Its
        # unacked 0 and 1 go back before 2, 3 and 4, and the next consumer gets them first.
        first.conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)
        _pump_until([second], lambda: len(second.got) == 5)
        assert [(b, r) for b, r, _t in second.got] == [
            (b"0", True),
            (b"1", True),
            (b"2", False),
            (b"3", False),
            (b"4", False),
        ]
    finally:
        with contextlib.suppress(px.AMQPError):
            first.pump(0.1)  # pika notices the end of its socket and releases what it holds
        second.close()


def test_bad_value_and_inequivalent_redeclare_are_406(
    broker: BrokerProcess, ch: Chan, prefix: str
) -> None:
    c = ch.connection
    with pytest.raises(px.ChannelClosedByBroker) as e:
        c.channel().queue_declare(f"{prefix}.bad", arguments={"x-single-active-consumer": "yes"})
    assert e.value.reply_code == 406
    assert e.value.reply_text == (
        f"PRECONDITION_FAILED - invalid arg 'x-single-active-consumer' for queue "
        f"'{prefix}.bad' in vhost '/': {{unacceptable_type,longstr}}"
    )
    with pytest.raises(px.ChannelClosedByBroker) as e:
        c.channel().queue_declare(f"{prefix}.bad", arguments={"x-single-active-consumer": 1})
    assert e.value.reply_text.endswith("{unacceptable_type,signedint}")

    q = f"{prefix}.sac"
    c.channel().queue_declare(q, arguments=SAC)
    for args, received, current in (
        ({"x-single-active-consumer": False}, "'false'", "'true'"),
        ({}, "none", "the value 'true' of type 'bool'"),
    ):
        with pytest.raises(px.ChannelClosedByBroker) as e:
            c.channel().queue_declare(q, arguments=args)
        assert e.value.reply_code == 406
        assert e.value.reply_text == (
            f"PRECONDITION_FAILED - inequivalent arg 'x-single-active-consumer' for queue "
            f"'{q}' in vhost '/': received {received} but current is {current}"
        )
    plain = f"{prefix}.plain"
    c.channel().queue_declare(plain)
    with pytest.raises(px.ChannelClosedByBroker) as e:
        c.channel().queue_declare(plain, arguments=SAC)
    assert e.value.reply_text.endswith(
        "received the value 'true' of type 'bool' but current is none"
    )


def test_an_exclusive_consumer_is_refused_even_on_an_unused_queue(ch: Chan, prefix: str) -> None:
    q = ch.queue_declare(f"{prefix}.sac", arguments=SAC).method.queue
    with pytest.raises(px.ChannelClosedByBroker) as e:
        ch.connection.channel().basic_consume(q, lambda *a: None, exclusive=True)
    assert e.value.reply_code == 403
    assert e.value.reply_text == f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use"

"""Consumer timeouts with real clients (model version 8, what a fresh standalone broker runs):
a pika consumer that never acknowledges loses its channel after ``[limits] consumer_timeout``
with RabbitMQ's 406 and text, its connection stays open, and its messages go to another
consumer, redelivered; a queue's ``x-consumer-timeout`` holds for its own deliveries."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from clientutil import BrokerFactory, BrokerProcess
from clientutil import blocking as _blocking

TIMEOUT_MS = 500
# The model's time is the last tick's (``[server] tick_ms``): a delivery counts from the tick
# before it, and the channel closes at the first tick past the timeout.
TICK_S = 0.1
CONFIG = f"""
[limits]
consumer_timeout = {TIMEOUT_MS}
"""


def _text(channel: int, ms: int) -> str:
    return (
        f"PRECONDITION_FAILED - delivery acknowledgement on channel {channel} timed out. "
        f"Timeout value used: {ms} ms. This timeout value can be configured, see consumers doc "
        "guide to learn more"
    )


def _hold_until_closed(ch: Any, queue: str, limit: float = 10.0) -> tuple[list[bytes], Any]:
    """Consume ``queue`` on ``ch`` and never acknowledge: what arrived, and the channel's
    close (the broker's ``ChannelClosedByBroker``)."""
    got: list[bytes] = []
    end = time.monotonic() + limit
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
        for method, _props, body in ch.consume(queue, inactivity_timeout=0.05):
            if method is not None:
                got.append(body)
            assert time.monotonic() < end, "the channel was never closed"
    return got, closed.value


def _drain(ch: Any, queue: str, n: int, limit: float = 10.0) -> list[tuple[bool, bytes]]:
    out: list[tuple[bool, bytes]] = []
    end = time.monotonic() + limit
    for method, _props, body in ch.consume(queue, inactivity_timeout=0.05):
        if method is not None:
            out.append((method.redelivered, body))
            ch.basic_ack(method.delivery_tag)
        if len(out) == n:
            break
        assert time.monotonic() < end, f"got {out}"
    ch.cancel()
    return out


@pytest.fixture
def connect() -> Iterator[Any]:
    """``connect(broker)``: a pika connection, closed after the test."""
    opened: list[pika.BlockingConnection] = []

    def make(b: BrokerProcess) -> pika.BlockingConnection:
        c = _blocking(b.addr)
        opened.append(c)
        return c

    yield make
    for c in opened:
        with contextlib.suppress(Exception):
            if c.is_open:
                c.close()


def test_a_consumer_that_never_acks_loses_its_channel_and_another_gets_its_messages(
    broker_factory: BrokerFactory, connect: Any
) -> None:
    b = broker_factory(CONFIG)
    pub = connect(b).channel()
    pub.confirm_delivery()
    pub.queue_declare("work")
    stuck = connect(b)
    ch = stuck.channel()
    ch.basic_qos(prefetch_count=10)
    for i in range(3):
        pub.basic_publish("", "work", b"job%d" % i)
    started = time.monotonic()
    got, close = _hold_until_closed(ch, "work")
    waited = time.monotonic() - started
    assert got == [b"job0", b"job1", b"job2"]
    assert close.reply_code == 406
    assert close.reply_text == _text(ch.channel_number, TIMEOUT_MS)
    assert waited >= TIMEOUT_MS / 1000 - TICK_S
    # Only the channel: the connection goes on, and a new channel on it works.
    assert stuck.is_open
    stuck.channel().queue_declare("work", passive=True)
    # Its messages went back to the queue, redelivered, for the next consumer.
    other = connect(b).channel()
    assert _drain(other, "work", 3) == [(True, b"job0"), (True, b"job1"), (True, b"job2")]
    # A consumer that acks in time keeps its channel.
    pub.basic_publish("", "work", b"fresh")
    assert _drain(other, "work", 1) == [(False, b"fresh")]
    time.sleep(3 * TIMEOUT_MS / 1000)
    assert other.is_open
    other.queue_declare("work", passive=True)


def test_a_queues_x_consumer_timeout_holds_for_its_deliveries(
    broker_factory: BrokerFactory, connect: Any
) -> None:
    b = broker_factory("[limits]\nconsumer_timeout = false\n")
    pub = connect(b).channel()
    pub.confirm_delivery()
    pub.queue_declare("short", arguments={"x-consumer-timeout": 300})
    pub.queue_declare("none")
    pub.basic_publish("", "short", b"s")
    pub.basic_publish("", "none", b"n")
    ch = connect(b).channel()
    got, close = _hold_until_closed(ch, "short")
    assert got == [b"s"] and close.reply_text == _text(ch.channel_number, 300)
    # Without the argument, and with no configured timeout, nothing closes.
    keep = connect(b)
    kc = keep.channel()
    method, _props, _body = next(kc.consume("none", inactivity_timeout=2))
    assert method is not None
    keep.sleep(1.0)
    assert kc.is_open
    kc.queue_declare("none", passive=True)

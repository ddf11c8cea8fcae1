"""Consumer timeouts on a real 3-member corosync cluster (model version 8): a pika consumer on
one member that never acknowledges has its channel closed with RabbitMQ's 406, decided on
cluster time by every replica at the same event (their digests agree at every checkpoint after
it), and its messages are redelivered to a consumer on another member."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import connect, queues, wait_state

from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

TIMEOUT_MS = 800


def test_the_same_channel_times_out_on_every_member_and_another_member_gets_its_messages(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(
        extra_config=f"\n[limits]\nconsumer_timeout = {TIMEOUT_MS}\n", checkpoint_every=20
    )
    assert all(s is not None and s["model_version"] >= 8 for s in map(bs.status, (1, 2, 3)))
    pub = connect(bs, 2).channel()
    pub.confirm_delivery()
    pub.queue_declare("work")
    stuck = connect(bs, 1)
    ch = stuck.channel()
    ch.basic_qos(prefetch_count=10)
    for i in range(3):
        pub.basic_publish("", "work", b"job%d" % i)
    got: list[bytes] = []
    deadline = time.monotonic() + 20
    started = time.monotonic()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
        for method, _props, body in ch.consume("work", inactivity_timeout=0.05):
            if method is not None:
                got.append(body)
            assert time.monotonic() < deadline, "the channel was never closed"
    # (A delivery counts from the tick before it: the close may come up to a tick early.)
    assert time.monotonic() - started >= TIMEOUT_MS / 1000 - 0.2
    assert got == [b"job0", b"job1", b"job2"]
    assert closed.value.reply_code == 406
    assert closed.value.reply_text == (
        f"PRECONDITION_FAILED - delivery acknowledgement on channel {ch.channel_number} timed "
        f"out. Timeout value used: {TIMEOUT_MS} ms. This timeout value can be configured, see "
        "consumers doc guide to learn more"
    )
    assert stuck.is_open  # the channel, not the connection
    # Every member holds the messages as ready again: the same state at the same event.
    bs.converged([1, 2, 3])
    for n in (1, 2, 3):
        assert queues(bs, n)["/:work"] == {"ready": 3, "unacked": 0, "consumers": 0}
    # A checkpoint after the close: every member's digest agreed (a replica that closed the
    # channel at another event, or not at all, would have lost the vote).
    after = _status(bs, 1)["event_seq"]
    for n in (1, 2, 3):
        s = wait_state(
            bs,
            n,
            lambda s: s["checkpoint"] is not None and s["checkpoint"]["seq"] > after,
        )
        assert s["checkpoint"]["agreed"] and s["checkpoint"]["losers"] == []
    # The messages go to a consumer on another member, redelivered.
    other = connect(bs, 3)
    och = other.channel()
    again: list[tuple[bool, bytes]] = []
    for method, _props, body in och.consume("work", inactivity_timeout=0.05):
        if method is not None:
            again.append((method.redelivered, body))
            och.basic_ack(method.delivery_tag)
        if len(again) == 3:
            break
        assert time.monotonic() < deadline + 20, again
    assert again == [(True, b"job0"), (True, b"job1"), (True, b"job2")]
    och.cancel()
    bs.converged([1, 2, 3])
    for n in (1, 2, 3):
        assert queues(bs, n)["/:work"]["ready"] == 0


def _status(bs: BrokerSet, n: int) -> dict[str, Any]:
    s = bs.status(n)
    assert s is not None
    return s

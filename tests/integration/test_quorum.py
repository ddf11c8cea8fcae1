"""Quorum on a real 3-node corosync cluster in network namespaces, with real pika clients: a
member whose node loses quorum stops serving at once (its clients get 320, new connections are
refused with the reason), the quorate side serves on, and after the partition heals the member
rejoins through a state update and serves the same state again."""

from __future__ import annotations

import time
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import assert_serves, connect, queues, wait_state

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster

pytestmark = pytest.mark.integration

# The dev cluster runs with token 1000 ms: a cut link is noticed after token + consensus
# (1.2 x token), about 2.2 s. The margin covers a 2-core machine shared with other work
# (a flood of publishes in test_stable_confirms keeps both cores busy meanwhile).
TOKEN_S = 1.0
STOP_WITHIN = TOKEN_S * 2.2 + 6.0


def not_serving(s: dict[str, Any]) -> bool:
    return s["state"] != "ready" and not s["quorum"]["quorate"]


def assert_refused(bs: BrokerSet, node: int) -> None:
    """A new connection is turned away with 320 and the reason."""
    with pytest.raises(pika.exceptions.AMQPConnectionError) as info:
        connect(bs, node)
    assert "not in a quorate partition" in repr(info.value), repr(info.value)


def test_partitioned_member_stops_serving_and_rejoins_through_an_update(
    brokers: BrokerSet, cluster: DevCluster
) -> None:
    c1 = connect(brokers, 1)
    ch1 = c1.channel()
    ch1.confirm_delivery()
    ch1.queue_declare("kept")
    for i in range(30):
        ch1.basic_publish("", "kept", b"%d" % i)
    brokers.converged([1, 2, 3])
    # A consumer and a publisher on the member that will be cut off.
    c3 = connect(brokers, 3)
    ch3 = c3.channel()
    ch3.queue_declare("minority")
    ch3.basic_consume("minority", lambda *a: None)
    # consume-ok means member 3 applied the consume; member 1 may apply it a moment later.
    brokers.converged([1, 2, 3])
    assert queues(brokers, 1)["/:minority"]["consumers"] == 1

    t0 = time.monotonic()
    cluster.partition(3)
    s3 = wait_state(brokers, 3, not_serving, STOP_WITHIN)
    stopped_after = time.monotonic() - t0
    # Its client was told why (320) and can neither publish nor consume there.
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            c3.process_data_events(0.1)
            ch3.basic_publish("", "minority", b"lost?")
    assert closed.value.reply_code == 320
    assert "not in a quorate partition" in closed.value.reply_text
    wait_state(brokers, 3, lambda s: s["connections"]["local"] == 0, 5)
    assert_refused(brokers, 3)

    # The quorate side serves on; it closed the consumer of the member it lost.
    wait_state(brokers, 1, lambda s: len(s["members"]) == 2, STOP_WITHIN)
    assert queues(brokers, 1)["/:minority"]["consumers"] == 0
    assert_serves(brokers, 1, 2, "during", 20)
    ch1 = connect(brokers, 1).channel()
    ch1.confirm_delivery()
    for i in range(10):
        ch1.basic_publish("", "kept", b"late-%d" % i)
    s1 = brokers.status(1)
    assert s1 is not None and s1["quorum"]["quorate"] and s1["quorum"]["votes"] == 2

    cluster.heal(3)
    t1 = time.monotonic()
    s3 = wait_state(brokers, 3, lambda s: s["state"] == "ready", 60)
    rejoined_after = time.monotonic() - t1
    # At least one rejoin (a spurious ring re-formation under load may add another).
    assert s3["incarnations"] >= 2 and s3["quorum"]["quorate"]
    assert s3["quorum"]["votes"] == 3 and s3["quorum"]["expected_votes"] == 3
    assert "quorum" in s3["last_suspension"] or "quorate" in s3["last_suspension"]
    digest = brokers.converged([1, 2, 3], timeout=30)
    assert digest
    assert queues(brokers, 3)["/:kept"]["ready"] == 40
    # It serves again, to old and new clients alike.
    assert_serves(brokers, 3, 1, "after", 10)
    print(
        f"stopped serving after {stopped_after:.1f} s, serving again {rejoined_after:.1f} s "
        "after the heal"
    )


def test_three_way_partition_nobody_serves_then_the_cluster_serves_again(
    brokers: BrokerSet, cluster: DevCluster
) -> None:
    c1 = connect(brokers, 1)
    ch1 = c1.channel()
    ch1.confirm_delivery()
    ch1.queue_declare("before")
    for i in range(25):
        ch1.basic_publish("", "before", b"%d" % i)
    brokers.converged([1, 2, 3])
    for n in (1, 2, 3):
        cluster.partition(n)
    for n in (1, 2, 3):
        wait_state(brokers, n, not_serving, STOP_WITHIN + 2)
    for n in (1, 2, 3):
        assert_refused(brokers, n)
    with pytest.raises(pika.exceptions.AMQPError):
        ch1.basic_publish("", "before", b"during")
    for n in (1, 2, 3):
        cluster.heal(n)
    for n in (1, 2, 3):
        wait_state(brokers, n, lambda s: s["state"] == "ready", 60)
    brokers.converged([1, 2, 3], timeout=30)
    # Nobody was quorate meanwhile, so nobody moved on: what the cluster confirmed before the
    # split is still there.
    for n in (1, 2, 3):
        assert queues(brokers, n)["/:before"]["ready"] == 25
    assert_serves(brokers, 2, 3, "again", 10)

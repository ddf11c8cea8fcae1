"""Hot standby shipping changes under faults, on real corosync with real clients: a primary cut
off from the others never makes a consumer see a message twice without the redelivered flag,
stops writing to its clients and lets them go before the others can have promoted one of
theirs, and comes back a backup; a backup's death costs the primary its clients for a moment,
not its role.

The fault loop (``cpgbroker.dev.faultloop``; ``bench/standby_faults.py`` runs it for longer):
producers with confirms that never republish, consumers with manual acks, every client given
every member's URL. The consumers are held below the producers' rate and queue flow is off, so
the queue stands deep: what a cut-off primary still hands out of it is what a new primary would
hand out again (docs/operations.md, "Hot standby shipping changes").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pytest

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster
from cpgbroker.dev.faultloop import (
    DEEP_QUEUE,
    FAULT_KINDS,
    STANDBY_CHANGES,
    FaultLoopOptions,
    frozen_primary,
    run_fault_loop,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def standby(broker_set: Callable[..., BrokerSet]) -> BrokerSet:
    return broker_set(
        store=True, fsync="always", cluster_options=STANDBY_CHANGES, extra_config=DEEP_QUEUE
    )


def marks(result: dict[str, Any], node: int, text: str) -> list[float]:
    """When ``node`` logged ``text`` (seconds into the loop)."""
    return [m["t_s"] for m in result["log_marks"] if m["node"] == node and text in m["msg"]]


def assert_nothing_lost_or_unflagged(result: dict[str, Any]) -> None:
    assert result["all_ready"] and result["digests_equal"], result["repair"]
    assert result["confirmed"] > 10_000, result
    assert result["lost"] == 0, result["lost_sample"]
    assert result["unflagged_duplicates"] == 0, (
        result["unflagged_by_members"],
        result["faults"],
        result["log_marks"],
    )


def test_a_frozen_primary_gives_its_clients_up_and_comes_back_a_backup(
    cluster: DevCluster, broker_set: Callable[..., BrokerSet]
) -> None:
    bs = standby(broker_set)
    result = run_fault_loop(cluster, bs, frozen_primary())
    assert_nothing_lost_or_unflagged(result)
    (fault,) = result["faults"]
    old = fault["node"]
    assert fault["primary"] == old
    # The others promoted one of theirs; the old primary's lease lapsed (1.76 s with token
    # 1000 ms) before that promotion, and it closed its clients then.
    promoted = [
        t
        for n in (node.nodeid for node in cluster.nodes)
        if n != old
        for t in marks(result, n, "promoted to hot-standby primary")
        if t > fault["t_s"]
    ]
    (lapsed,) = marks(result, old, "hot-standby lease lapsed:")
    assert promoted and fault["t_s"] < lapsed < min(promoted), result["log_marks"]
    # Before that, the old primary was in doubt and wrote nothing more to its clients
    # (runtime/member/lease.py, "In doubt"): its consumers got nothing from it after, so
    # nothing it produced once another could be promoted reached anyone.
    doubted = [t for t in marks(result, old, "hot-standby lease in doubt") if t > fault["t_s"]]
    assert doubted and doubted[0] < lapsed, result["log_marks"]
    assert result["last_delivery_by_node"].get(old, 0) <= doubted[0] + 0.05, result
    # Its corosync frozen, no membership change kept it primary: it never took clients again.
    assert not marks(result, old, "lease renewed by a membership change"), result["log_marks"]
    # After SIGCONT it came back, a backup.
    status = bs.status(old)
    assert status is not None and status["state"] == "ready", status
    assert status["role"] == "backup", status


def test_a_short_fault_loop_loses_nothing_and_flags_every_duplicate(
    cluster: DevCluster, broker_set: Callable[..., BrokerSet]
) -> None:
    """Each kind of fault once: the primary's broker killed, its corosync frozen, its node
    partitioned away, a backup's corosync killed."""
    bs = standby(broker_set)
    result = run_fault_loop(
        cluster,
        bs,
        FaultLoopOptions(seconds=36, interval=8, faults=FAULT_KINDS, consume_rate=1500),
    )
    assert_nothing_lost_or_unflagged(result)
    assert [f["kind"] for f in result["faults"]] == list(FAULT_KINDS)
    partition = result["faults"][2]
    # The minority side serves no one: the partitioned primary stopped once its partition
    # lost quorum, and its consumers got nothing from it after.
    cut_off = partition["node"]
    stopped = [t for t in marks(result, cut_off, "stopping client service") if t > partition["t_s"]]
    assert stopped, result["log_marks"]
    assert result["last_delivery_by_node"].get(cut_off, 0) <= min(stopped) + 0.05, result
    # A backup's death stalls the ring as long as the primary's would: the primary's lease
    # lapsed and it let its clients go, then the membership change that removed the backup
    # kept it primary and it took them again. No one else was promoted.
    backup = result["faults"][3]
    primary = backup["primary"]
    assert backup["node"] != primary
    after = backup["t_s"]
    assert [t for t in marks(result, primary, "hot-standby lease lapsed:") if t > after]
    renewed = [t for t in marks(result, primary, "lease renewed by a membership") if t > after]
    assert renewed, result["log_marks"]
    promoted = [
        t
        for n in (node.nodeid for node in cluster.nodes)
        if n != primary
        for t in marks(result, n, "promoted to hot-standby primary")
        if t > after
    ]
    assert not promoted, result["log_marks"]


def test_a_backup_holds_a_client_while_the_ring_stands_still_and_serves_it_once_promoted(
    cluster: DevCluster, broker_set: Callable[..., BrokerSet]
) -> None:
    """The primary's corosync frozen: a client connecting to either backup between the
    primary's doubt and the promotion is held rather than turned away (neither is primary yet),
    then served by the one promoted, and told where the new primary is by the other
    (runtime/replication/standby.py, "Holding clients")."""
    bs = broker_set(cluster_options=STANDBY_CHANGES)
    nodes = [n.nodeid for n in cluster.nodes]
    statuses = {n: bs.status(n) for n in nodes}
    (primary,) = [n for n, s in statuses.items() if s is not None and s["role"] == "primary"]
    backups = [n for n in nodes if n != primary]
    outcome: dict[int, tuple[str, float, str]] = {}

    def connect(node: int, started: float) -> None:
        params = pika.URLParameters(bs.url(node))
        params.socket_timeout = 10
        params.connection_attempts = 1
        try:
            conn = pika.BlockingConnection(params)
        except pika.exceptions.AMQPError as e:
            outcome[node] = ("turned away", time.monotonic() - started, repr(e))
            return
        outcome[node] = ("served", time.monotonic() - started, "")
        conn.close()

    cluster.stop(primary)
    try:
        time.sleep(1.6)  # past the primary's doubt (1.32 s), before any promotion (2.2 s)
        started = time.monotonic()
        threads = [threading.Thread(target=connect, args=(n, started)) for n in backups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        cluster.resume(primary)
    served = [n for n in backups if outcome.get(n, ("",))[0] == "served"]
    assert len(served) == 1, outcome
    status = bs.status(served[0])
    assert status is not None and status["role"] == "primary", status
    (other,) = [n for n in backups if n not in served]
    assert outcome[other][0] == "turned away", outcome
    # Held until the promotion, not turned away and retried: served within a second of it.
    assert outcome[served[0]][1] < 3.0, outcome

"""End to end: a real 3-member cluster under confirmed traffic loses a member (SIGKILL, with a
producer and a consumer connected to it); the members' event logs, the clients' histories
(recorded by ``cpgbroker.audit.history``) and the fault log are audited by ``cpgbroker audit``
run as an operator runs it, and every check passes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import run_audit

from cpgbroker.audit.history import HistoryRecorder, decode_body, encode_body, producer_name
from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster
from prereq import require_spark

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.slow]

QUEUE = "audited"
RUN_ID = 7
# Enough events for digest checkpoints (every 10,000 events) before and after the kill.
EVENTS_BEFORE_KILL = 11_000
EVENTS_AFTER_KILL = 10_000
CLIENT_ERRORS = (pika.exceptions.AMQPError, OSError)
# pika raises ValueError ("Expected connected socket") when a member that is
# going down resets the TCP connection between connect() and pika's transport
# setup: for a client that is a refused connection like any other.
CONNECT_ERRORS = (*CLIENT_ERRORS, ValueError)


class Traffic:
    """Producers and consumers in threads (pika), each failing over along its URL list and
    recording everything into a history file; in-memory bookkeeping says when all is drained."""

    def __init__(self, brokers: BrokerSet, out: Path) -> None:
        self.brokers = brokers
        self.out = out
        self.lock = threading.Lock()
        self.confirmed: set[tuple[str, int]] = set()
        self.consumed: set[tuple[str, int]] = set()
        self.stop_publishing = threading.Event()
        self.stop_consuming = threading.Event()
        self.errors: list[str] = []
        self.producers: list[threading.Thread] = []
        self.consumers: list[threading.Thread] = []

    def urls(self, first: int) -> list[str]:
        order = [first, *(n for n in (1, 2, 3) if n != first)]
        return [self.brokers.url(n) for n in order]

    def _connect(self, rec: HistoryRecorder, urls: list[str], stop: threading.Event) -> Any:
        while not stop.is_set():
            for url in urls:
                params = pika.URLParameters(url)
                params.connection_attempts = 1
                params.socket_timeout = 2
                params.blocked_connection_timeout = 10
                try:
                    conn = pika.BlockingConnection(params)
                except CONNECT_ERRORS:
                    continue
                rec.connected(url)
                return conn
            time.sleep(0.1)
        return None

    def _run(
        self, name: str, body: Callable[[HistoryRecorder], None], threads: list[threading.Thread]
    ) -> None:
        def target() -> None:
            with HistoryRecorder(self.out / f"{name}.history.jsonl", name) as rec:
                try:
                    body(rec)
                except Exception as e:  # shown by the test's assertion on self.errors
                    self.errors.append(f"{name}: {e!r}")

        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        threads.append(t)

    def producer(self, pid: int, node: int) -> None:
        name = f"producer-{pid}"
        pname = producer_name(RUN_ID, pid)

        def body(rec: HistoryRecorder) -> None:
            seq = 0
            while not self.stop_publishing.is_set():
                conn = self._connect(rec, self.urls(node), self.stop_publishing)
                if conn is None:
                    return
                try:
                    ch = conn.channel()
                    ch.confirm_delivery()
                    ch.queue_declare(QUEUE)
                    while not self.stop_publishing.is_set():
                        seq += 1  # every attempt is a new message id
                        rec.published(pname, seq, QUEUE)
                        try:
                            ch.basic_publish("", QUEUE, encode_body(RUN_ID, pid, seq, 64))
                        except pika.exceptions.NackError:
                            rec.confirmed(pname, seq, "nack")
                            continue
                        except CLIENT_ERRORS:
                            rec.confirmed(pname, seq, "unknown")
                            raise
                        rec.confirmed(pname, seq, "ack")
                        with self.lock:
                            self.confirmed.add((pname, seq))
                    conn.close()
                    rec.disconnected("closed")
                except CLIENT_ERRORS as e:
                    rec.disconnected(f"lost: {type(e).__name__}")

        self._run(name, body, self.producers)

    def consumer(self, cid: int, node: int) -> None:
        name = f"consumer-{cid}"

        def body(rec: HistoryRecorder) -> None:
            while not self.stop_consuming.is_set():
                conn = self._connect(rec, self.urls(node), self.stop_consuming)
                if conn is None:
                    return
                try:
                    ch = conn.channel()
                    ch.queue_declare(QUEUE)
                    ch.basic_qos(prefetch_count=20)
                    for method, _props, payload in ch.consume(QUEUE, inactivity_timeout=0.2):
                        if self.stop_consuming.is_set():
                            break
                        if method is None:
                            continue
                        mid, _sent = decode_body(payload)
                        rec.delivered(name, QUEUE, mid.producer, mid.seq, method.redelivered)
                        ch.basic_ack(method.delivery_tag)
                        rec.acked(name, QUEUE, mid.producer, mid.seq)
                        with self.lock:
                            self.consumed.add(mid)
                    conn.close()
                    rec.disconnected("closed")
                except CLIENT_ERRORS as e:
                    rec.disconnected(f"lost: {type(e).__name__}")

        self._run(name, body, self.consumers)

    def drained(self) -> bool:
        with self.lock:
            return self.confirmed <= self.consumed

    def finish(self, brokers: BrokerSet) -> None:
        """Publishing was told to stop: wait until every confirmed message is consumed, stop
        the consumers, check the clients met no error, and stop the brokers (the members
        flush their event logs)."""
        # Only once no publish is in flight does "every confirmed message consumed" mean
        # drained.
        self.join(self.producers, 30)
        deadline = time.monotonic() + 60
        while not self.drained():
            assert time.monotonic() < deadline, "confirmed messages were not all consumed"
            time.sleep(0.2)
        self.stop_consuming.set()
        self.join(self.consumers, 30)
        assert not self.errors, self.errors
        with self.lock:
            assert len(self.confirmed) > 1000
        brokers.stop_all()

    @staticmethod
    def join(threads: list[threading.Thread], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "client threads did not stop"


def _wait_events(brokers: BrokerSet, node: int, seq: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = brokers.status(node)
        if s is not None and s["event_seq"] >= seq:
            return
        assert time.monotonic() < deadline, f"member {node} at {s and s['event_seq']} < {seq}"
        time.sleep(0.2)


def test_a_run_with_a_killed_member_audits_green(
    brokers: BrokerSet, cluster: DevCluster, tmp_path: Path
) -> None:
    require_spark()
    started = time.time_ns()
    histories = tmp_path / "histories"
    histories.mkdir()
    traffic = Traffic(brokers, histories)
    # Node 3 will die: one producer and one consumer start there.
    traffic.producer(1, node=1)
    traffic.producer(2, node=3)
    traffic.consumer(1, node=2)
    traffic.consumer(2, node=3)
    try:
        _wait_events(brokers, 1, EVENTS_BEFORE_KILL, timeout=90)
        cluster.record_fault("kill-broker", 3, url=brokers.url(3))
        brokers.kill(3)
        at_kill = brokers.status(1)
        assert at_kill is not None
        _wait_events(brokers, 1, at_kill["event_seq"] + EVENTS_AFTER_KILL, timeout=90)
    finally:
        traffic.stop_publishing.set()
    traffic.finish(brokers)

    # The fault log of this test only (the dev cluster is shared by the session's tests).
    out = tmp_path / "audit"
    proc, verdict = run_audit(brokers, histories, started, tmp_path, timeout=900)
    assert proc.returncode == 0, (proc.stderr[-3000:], json.dumps(verdict["checks"], indent=1))
    assert verdict["ok"] and json.loads(proc.stdout)["ok"]
    checks = verdict["checks"]
    assert all(c["status"] == "pass" for c in checks.values()), checks
    # Real comparisons happened: checkpoints voted by several members, three members' streams.
    assert checks["replica_consistency"]["compared"] >= 1
    members = checks["total_order"]["members"]
    assert len(members) == 3 and checks["total_order"]["overlap_all_members"] is not None
    perf = verdict["performance"]
    assert perf["confirmed"] >= len(traffic.confirmed)
    assert perf["delivered"] >= perf["confirmed"]
    # The clients of the killed member failed over; the audit measured how long that took.
    gaps = perf["failover"]
    assert gaps and {g["client"] for g in gaps} <= {"producer-2", "consumer-2"}
    assert all(g["reconnect_gap_ms"] is not None for g in gaps), gaps
    # The killed member's log may end with a partial line: reported, never a failure.
    for p in verdict["inputs"]["events"]["reported"]:
        assert p["kind"] == "partial-tail" and p["file"] == str(brokers.event_log_path(3))
    assert (out / "report.html").exists()
    assert "step 12/12" in proc.stderr  # progress was shown


def test_a_hot_standby_run_shipping_changes_audits_green(
    broker_set: Callable[..., BrokerSet], cluster: DevCluster, tmp_path: Path
) -> None:
    """The same audit of a hot-standby cluster shipping state changes whose primary is
    killed: its members log change batches, not client events, and the audit's checks (the
    replicas' digests, the members' common order, every confirmed message delivered once)
    hold all the same; every client fails over to the new primary."""
    require_spark()
    brokers = broker_set(cluster_options='mode = "hot-standby"\nreplication = "changes"')
    status = brokers.status(1)
    assert status is not None
    port = status["primary_url"].rsplit(":", 1)[1].strip("/")
    primary = next(n for n in (1, 2, 3) if brokers.url(n).endswith(f":{port}/"))
    backup = next(n for n in (1, 2, 3) if n != primary)
    started = time.time_ns()
    histories = tmp_path / "histories"
    histories.mkdir()
    traffic = Traffic(brokers, histories)
    # Every client tries the primary first; the backups would turn it away.
    for i in (1, 2):
        traffic.producer(i, node=primary)
        traffic.consumer(i, node=primary)
    try:
        _wait_events(brokers, backup, EVENTS_BEFORE_KILL, timeout=120)
        cluster.record_fault("kill-broker", primary, url=brokers.url(primary))
        brokers.kill(primary)
        at_kill = brokers.status(backup)
        assert at_kill is not None
        _wait_events(brokers, backup, at_kill["event_seq"] + EVENTS_AFTER_KILL, timeout=120)
    finally:
        traffic.stop_publishing.set()
    traffic.finish(brokers)

    proc, verdict = run_audit(brokers, histories, started, tmp_path, timeout=900)
    assert proc.returncode == 0, (proc.stderr[-3000:], json.dumps(verdict["checks"], indent=1))
    checks = verdict["checks"]
    assert all(c["status"] == "pass" for c in checks.values()), checks
    assert checks["replica_consistency"]["compared"] >= 1
    assert len(checks["total_order"]["members"]) == 3
    perf = verdict["performance"]
    assert perf["confirmed"] >= len(traffic.confirmed)
    assert perf["delivered"] >= perf["confirmed"]
    gaps = perf["failover"]
    assert {g["client"] for g in gaps} == {"producer-1", "producer-2", "consumer-1", "consumer-2"}

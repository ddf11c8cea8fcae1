"""End to end: a whole-cluster restart, audited. A real 3-member cluster with durable stores
serves recording clients (persistent messages with confirms on a durable queue, a few transient
ones, consumers that ack); every member is killed with SIGKILL mid-run and started again; the
clients fail over to the restarted cluster and finish. ``cpgbroker audit``, run as an operator
runs it, passes the run (no confirmed persistent message lost across the restart, no false
divergence between the sequence numbers before and after it) and reports the restart."""

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

QUEUE = "audited.recovery"
RUN_ID = 11
SECONDS_BEFORE_KILL = 4.0
SECONDS_AFTER_RESTART = 3.0
# Digest checkpoints in both eras of a short run.
CHECKPOINT_EVERY = 300
# What the holding consumer holds when the cluster dies.
HOLD = 5
CLIENT_ERRORS = (pika.exceptions.AMQPError, OSError)
# pika raises ValueError ("Expected connected socket") when a member that is
# going down resets the TCP connection between connect() and pika's transport
# setup: for a client that is a refused connection like any other.
CONNECT_ERRORS = (*CLIENT_ERRORS, ValueError)


class Clients:
    """Producers and consumers in threads (pika), each failing over along its URL list and
    recording everything; in memory, the messages that must reach a consumer (confirmed
    persistent ones, and every confirmed one published after the restart) and those that
    did."""

    def __init__(self, bs: BrokerSet, out: Path) -> None:
        self.bs = bs
        self.out = out
        self.lock = threading.Lock()
        self.must_consume: set[tuple[str, int]] = set()
        self.consumed: set[tuple[str, int]] = set()
        self.restarted = threading.Event()
        self.stop_publishing = threading.Event()
        self.stop_consuming = threading.Event()
        self.errors: list[str] = []
        self.producers: list[threading.Thread] = []
        self.consumers: list[threading.Thread] = []

    def _connect(self, rec: HistoryRecorder, first: int, stop: threading.Event) -> Any:
        order = [first, *(n for n in (1, 2, 3) if n != first)]
        while not stop.is_set():
            for url in (self.bs.url(n) for n in order):
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
            time.sleep(0.2)  # the whole cluster is down: wait for it
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

    def producer(self, pid: int, node: int, *, persistent: bool) -> None:
        name = f"producer-{pid}"
        pname = producer_name(RUN_ID, pid)
        props = pika.BasicProperties(delivery_mode=2 if persistent else 1)

        def body(rec: HistoryRecorder) -> None:
            seq = 0
            while not self.stop_publishing.is_set():
                conn = self._connect(rec, node, self.stop_publishing)
                if conn is None:
                    return
                try:
                    ch = conn.channel()
                    ch.confirm_delivery()
                    ch.queue_declare(QUEUE, durable=True)
                    while not self.stop_publishing.is_set():
                        seq += 1  # every attempt is a new message id
                        rec.published(pname, seq, QUEUE, persistent=persistent, durable=True)
                        try:
                            ch.basic_publish("", QUEUE, encode_body(RUN_ID, pid, seq, 64), props)
                        except pika.exceptions.NackError:
                            rec.confirmed(pname, seq, "nack")
                            continue
                        except CLIENT_ERRORS:
                            rec.confirmed(pname, seq, "unknown")
                            raise
                        rec.confirmed(pname, seq, "ack")
                        if persistent or self.restarted.is_set():
                            with self.lock:
                                self.must_consume.add((pname, seq))
                        if not persistent:
                            time.sleep(0.01)  # a trickle of transient messages
                    conn.close()
                    rec.disconnected("closed")
                except CLIENT_ERRORS as e:
                    rec.disconnected(f"lost: {type(e).__name__}")

        self._run(name, body, self.producers)

    def consumer(self, cid: int, node: int, *, ack_every: int = 1, hold: bool = False) -> None:
        """Acks every ``ack_every`` deliveries at once (``multiple``), and when idle. ``hold``:
        acks nothing until the cluster restarted (it holds its prefetch when the cluster dies:
        those messages must come back after the restart, flagged redelivered)."""
        name = f"consumer-{cid}"

        def body(rec: HistoryRecorder) -> None:
            while not self.stop_consuming.is_set():
                conn = self._connect(rec, node, self.stop_consuming)
                if conn is None:
                    return
                held: list[tuple[int, tuple[str, int]]] = []  # (delivery tag, message)
                try:
                    ch = conn.channel()
                    ch.queue_declare(QUEUE, durable=True)
                    ch.basic_qos(prefetch_count=HOLD if hold else 20)
                    for method, _props, payload in ch.consume(QUEUE, inactivity_timeout=0.2):
                        if self.stop_consuming.is_set():
                            break
                        holding = hold and not self.restarted.is_set()
                        if method is None:
                            if not holding:
                                self._ack(rec, name, ch, held)
                            continue
                        mid, _sent = decode_body(payload)
                        rec.delivered(name, QUEUE, mid.producer, mid.seq, method.redelivered)
                        held.append((method.delivery_tag, (mid.producer, mid.seq)))
                        if len(held) >= ack_every and not holding:
                            self._ack(rec, name, ch, held)
                    conn.close()
                    rec.disconnected("closed")
                except CLIENT_ERRORS as e:
                    rec.disconnected(f"lost: {type(e).__name__}")

        self._run(name, body, self.consumers)

    def _ack(
        self, rec: HistoryRecorder, name: str, ch: Any, held: list[tuple[int, tuple[str, int]]]
    ) -> None:
        """Ack what ``held`` holds, with one ``basic.ack`` (``multiple``)."""
        if held:
            ch.basic_ack(held[-1][0], multiple=True)
            for _tag, (producer, seq) in held:
                rec.acked(name, QUEUE, producer, seq)
            with self.lock:
                self.consumed.update(mid for _tag, mid in held)
            held.clear()

    def missing(self) -> int:
        with self.lock:
            return len(self.must_consume - self.consumed)

    @staticmethod
    def join(threads: list[threading.Thread], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "client threads did not stop"


def test_a_run_with_a_whole_cluster_restart_audits_green(
    broker_set: Callable[..., BrokerSet], cluster: DevCluster, tmp_path: Path
) -> None:
    require_spark()
    bs = broker_set(store=True, checkpoint_every=CHECKPOINT_EVERY)
    started = time.time_ns()
    histories = tmp_path / "histories"
    histories.mkdir()
    clients = Clients(bs, histories)
    clients.producer(1, node=1, persistent=True)
    clients.producer(2, node=2, persistent=True)
    clients.producer(3, node=3, persistent=False)
    clients.consumer(1, node=2)
    clients.consumer(2, node=3, ack_every=10)
    clients.consumer(3, node=1, hold=True)
    try:
        time.sleep(SECONDS_BEFORE_KILL)
        with clients.lock:
            confirmed_before = len(clients.must_consume)
        for n in (1, 2, 3):
            cluster.record_fault("kill-broker", n, url=bs.url(n))
            bs.kill(n)
        time.sleep(1.0)
        for n in (1, 2, 3):
            cluster.record_fault("start-broker", n, url=bs.url(n))
            bs.start(n)
        bs.wait_ready([1, 2, 3], timeout=60)
        clients.restarted.set()
        time.sleep(SECONDS_AFTER_RESTART)
    finally:
        clients.stop_publishing.set()
    # Only once no publish is in flight does "everything that must be consumed was" mean
    # drained.
    clients.join(clients.producers, 30)
    deadline = time.monotonic() + 30
    while clients.missing():
        assert time.monotonic() < deadline, f"{clients.missing()} messages never consumed"
        time.sleep(0.2)
    clients.stop_consuming.set()
    clients.join(clients.consumers, 30)
    assert not clients.errors, clients.errors
    # The persistent messages consumer-3 held when the cluster died came back, flagged
    # redelivered (the transient ones it held may be gone).
    deliveries: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for path in histories.glob("*.history.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["op"] == "deliver":
                deliveries.setdefault((r["producer"], r["seq"]), []).append(r)
    for ds in deliveries.values():
        ds.sort(key=lambda r: r["t_ns"])
    transient = producer_name(RUN_ID, 3)
    held = [
        k
        for k, ds in deliveries.items()
        if (ds[0]["client"], ds[0]["session"]) == ("consumer-3", 1) and k[0] != transient
    ]
    assert held and all(
        len(deliveries[k]) >= 2 and deliveries[k][-1]["redelivered"] for k in held
    ), [deliveries[k] for k in held]
    assert confirmed_before > 50  # the restart had confirmed persistent messages to keep
    with clients.lock:
        assert len(clients.must_consume) > confirmed_before  # and the clients went on after it
    bs.stop_all()  # the members flush their event logs

    out = tmp_path / "audit"
    proc, verdict = run_audit(bs, histories, started, tmp_path, timeout=300)
    assert proc.returncode == 0, (proc.stderr[-3000:], json.dumps(verdict["checks"], indent=1))
    assert verdict["ok"] and all(c["status"] != "fail" for c in verdict["checks"].values())

    # The restart, as the audit found it in the event logs.
    [restart] = verdict["restarts"]
    assert restart["summary"].startswith("whole-cluster restart at ")
    assert 0 < restart["down_s"] < 60 and restart["recovered_seq"] > 0
    assert len(restart["replicas"]) == 3
    to = verdict["checks"]["total_order"]
    assert to["eras"][-1]["era"] == 1 and to["status"] == "pass"
    assert verdict["checks"]["replica_consistency"]["compared"] >= 1
    # Every client was cut off by the restart and came back.
    gaps = [g for g in verdict["performance"]["failover"] if g["action"] == "cluster-restart"]
    assert {g["client"] for g in gaps} >= {"producer-1", "producer-2", "consumer-1", "consumer-2"}
    assert all(g["reconnect_gap_ms"] is not None for g in gaps), gaps
    assert restart["summary"] in proc.stderr  # the operator's summary shows it
    assert "Whole-cluster restarts" in (out / "report.html").read_text()
    # The logs of killed members may end with a partial line, torn where the restarted
    # process appended: reported, never a failure.
    for p in verdict["inputs"]["events"]["reported"]:
        assert p["kind"] in ("partial-tail", "torn-line"), p

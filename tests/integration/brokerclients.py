"""Real AMQP clients (pika) against a broker cluster: the helpers integration tests share."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pika
import pika.exceptions

from cpgbroker.dev.brokers import BrokerSet

OPEN: list[pika.BlockingConnection] = []

# Every basic.properties field a pika client sets (``cluster_id`` is deprecated and unset).
PROPERTY_FIELDS = (
    "content_type",
    "content_encoding",
    "headers",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
)


# guest with the administrator tag (still loopback-only): it may use the management API.
ADMIN_GUEST = """
[[users]]
name = "guest"
password = "guest"
loopback_only = true
tags = ["administrator"]
"""
GUEST_AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()


def management(
    bs: BrokerSet, node: int, method: str, path: str, auth: str, body: Any = None
) -> tuple[int, Any]:
    """One request to a member's management API: the status and the answer (JSON parsed, an
    empty body as None, anything else as text)."""
    url = f"http://127.0.0.1:{bs.ports[node][1]}{path}"
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": auth, "Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    if not raw:
        return status, None
    return status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw.decode()


def assert_same_properties(got: pika.BasicProperties, sent: pika.BasicProperties) -> None:
    """A message came back with every property it was published with."""
    for field in PROPERTY_FIELDS:
        assert getattr(got, field) == getattr(sent, field), field


def connect(bs: BrokerSet, node: int) -> pika.BlockingConnection:
    p = pika.URLParameters(bs.url(node))
    p.socket_timeout = 5
    p.blocked_connection_timeout = 10
    conn = pika.BlockingConnection(p)
    OPEN.append(conn)
    return conn


def drain(conn: pika.BlockingConnection, until, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out waiting for deliveries"
        conn.process_data_events(0.05)


def wait_state(bs: BrokerSet, node: int, pred: Any, timeout: float = 30.0) -> dict[str, Any]:
    """Poll a member's status until ``pred(status)`` holds; the status then."""
    deadline = time.monotonic() + timeout
    while True:
        s = bs.status(node)
        if s is not None and pred(s):
            return s
        assert time.monotonic() < deadline, f"node {node} never reached the state: {s}"
        time.sleep(0.02)


def assert_serves(bs: BrokerSet, publish_on: int, consume_on: int, queue: str, n: int) -> None:
    """``n`` confirmed publishes on one member all reach a consumer on another."""
    cp = connect(bs, publish_on)
    chp = cp.channel()
    chp.confirm_delivery()
    chp.queue_declare(queue)
    for i in range(n):
        chp.basic_publish("", queue, b"%d" % i)
    cc = connect(bs, consume_on)
    chc = cc.channel()
    got: list[bytes] = []
    chc.basic_consume(queue, lambda c, m, p, b: (got.append(b), c.basic_ack(m.delivery_tag)))
    drain(cc, lambda: len(got) >= n)
    assert sorted(got, key=int) == [b"%d" % i for i in range(n)]


def queues(bs: BrokerSet, node: int) -> dict:
    s = bs.status(node)
    assert s is not None
    return s["queues"]


def close_all() -> None:
    """Close every client connection opened through :func:`connect` (also those whose member
    died), so no socket outlives its test."""
    while OPEN:
        conn = OPEN.pop()
        with contextlib.suppress(Exception):
            if conn.is_open:
                conn.close()
        with contextlib.suppress(Exception):
            conn._impl._transport._sock.close()  # the member may have died under it


class ConfirmingPublisher(threading.Thread):
    """A publisher with confirms that fails over: it publishes ``<name>-<i>`` to ``queue`` on
    the first of ``nodes``, one confirmed publish at a time, and when its connection is
    closed or lost it records why and goes on at the next member in the list. ``confirmed``
    holds every body the broker confirmed."""

    def __init__(self, bs: BrokerSet, nodes: list[int], queue: str, name: str = "p") -> None:
        super().__init__(daemon=True)
        self.bs, self.nodes, self.queue, self.name = bs, nodes, queue, name
        self.confirmed: list[bytes] = []
        self.closes: list[tuple[int, int | None, str]] = []  # (node, reply code, text)
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        i = 0
        k = 0
        try:
            while not self.stopping.is_set():
                node = self.nodes[k % len(self.nodes)]
                try:
                    conn = connect(self.bs, node)
                    ch = conn.channel()
                    ch.confirm_delivery()
                    ch.queue_declare(self.queue)
                    while not self.stopping.is_set():
                        body = b"%s-%d" % (self.name.encode(), i)
                        i += 1
                        ch.basic_publish("", self.queue, body)
                        self.confirmed.append(body)
                except pika.exceptions.AMQPError as e:
                    code = getattr(e, "reply_code", None)
                    self.closes.append((node, code, repr(e)))
                    k += 1
                    time.sleep(0.1)
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> list[bytes]:
        self.stopping.set()
        self.join(30)
        assert not self.is_alive(), "publisher did not stop"
        if self.error is not None:
            raise self.error
        return self.confirmed


def drain_queue(bs: BrokerSet, node: int, queue: str) -> list[bytes]:
    """Every message in ``queue``, taken (and acked) on ``node`` until it is empty."""
    conn = connect(bs, node)
    ch = conn.channel()
    got: list[bytes] = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return got
        got.append(body)


def load_until(pub: ConfirmingPublisher, n: int, timeout: float = 30.0) -> None:
    """Until ``pub`` has ``n`` more confirms (it keeps publishing meanwhile)."""
    deadline = time.monotonic() + timeout
    start = len(pub.confirmed)
    while len(pub.confirmed) < start + n:
        assert pub.error is None, pub.error
        assert time.monotonic() < deadline, f"only {len(pub.confirmed) - start} confirms"
        time.sleep(0.05)


def run_audit(
    bs: BrokerSet, histories: Path, started: int, tmp_path: Path, timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run ``cpgbroker audit`` on a test's run: the members' event logs, the clients'
    histories in ``histories`` and the dev cluster's fault log from ``started`` (ns) on (the
    cluster is shared by the session's tests). The finished process and its verdict."""
    faults = tmp_path / "faults.jsonl"
    lines = (bs.dc.base / "faults.jsonl").read_text().splitlines()
    faults.write_text("".join(line + "\n" for line in lines if json.loads(line)["t_ns"] >= started))
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "cpgbroker", "audit", "--out", str(out), "--master", "local[2]"]
    cmd += ["--conf", "spark.sql.shuffle.partitions=4", "--history", str(histories)]
    cmd += ["--faults", str(faults)]
    for n in (1, 2, 3):
        cmd += ["--events", str(bs.event_log_path(n))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    verdict: dict[str, Any] = json.loads((out / "verdict.json").read_text())
    return proc, verdict

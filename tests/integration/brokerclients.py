"""Real AMQP clients (pika) against a broker cluster: the helpers integration tests share."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pika

from cpgbroker.devbrokers import BrokerSet

OPEN: list[pika.BlockingConnection] = []


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

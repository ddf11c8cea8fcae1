"""Message headers with edge values on a real 3-member cluster, both modes (model version 8,
issue 33): a raw client publishes, through a headers exchange bound on edge values, a message
whose headers hold what version 7 refused or changed (1e308 and NaN doubles, 1.1, a long string
that is not UTF-8, a decimal with a mantissa of 2**32-1, nested arrays and tables); it is
routed as RabbitMQ routes it, rejected without requeue and dead-lettered, and the
dead-lettered copy is read on another member (active-active) or on the backup promoted after
the primary stopped (hot standby): every header the publisher wrote is there byte for byte, in
its place, followed by a correct x-death and x-first-death-*."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
from brokerclients import connect, wait_state
from pamqp import commands, frame

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.wire import fastpath as fp
from cpgbroker.wire.fieldtable import (
    ARRAY,
    DECIMAL,
    DOUBLE,
    FLOAT,
    LONG_L,
    TABLE,
    Field,
    Table,
    decode_table,
)

pytestmark = pytest.mark.integration

HOT_STANDBY = 'mode = "hot-standby"\nreplication = "changes"'
F_HEADERS = 0x2000

EDGE = Table(
    [
        ("big", Field.of(DOUBLE, 1e308)),
        ("nan", Field.of(DOUBLE, float("nan"))),
        ("nan-payload", Field(DOUBLE, b"\x7f\xf0\x00\x00\x00\x00\x12\x34")),
        ("one-point-one", Field.of(DOUBLE, 1.1)),
        ("f", Field.of(FLOAT, 1.1)),
        ("not-utf8", Field.longstr(b"\xff\xfe\x00")),
        ("dec", Field(DECIMAL, struct.pack(">BI", 2, 2**32 - 1))),
        (
            "nested",
            Field.array(
                [
                    Field.array([Field.of(DOUBLE, 1.1), Field.longstr(b"\x80")]),
                    Field.table(Table([("n", Field.of(LONG_L, -1))])),
                ]
            ),
        ),
        ("twice", Field.of(DOUBLE, 1.0)),
        ("twice", Field.of(DOUBLE, 2.0)),
    ]
)
# The binding that routes it (RabbitMQ 3.10.8 routes it too: values compared whatever their
# types, the decimal as scale and mantissa, the long string as bytes).
BINDING = Table(
    [
        ("x-match", Field.longstr("all")),
        ("dec", Field(DECIMAL, struct.pack(">BI", 2, 2**32 - 1))),
        ("not-utf8", Field.longstr(b"\xff\xfe\x00")),
        ("big", Field.of(DOUBLE, 1e308)),
        ("nested", EDGE.get("nested")),  # type: ignore[list-item]
    ]
)


class Raw:
    """A hand-driven AMQP client: what no library writes (the headers above) and reads (the
    content header's bytes)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        assert isinstance(self.method(), commands.Connection.Start)
        self.send_method(
            0,
            commands.Connection.StartOk(
                client_properties={"product": "raw"},
                mechanism="PLAIN",
                response="\x00guest\x00guest",
                locale="en_US",
            ),
        )
        tune = self.method()
        assert isinstance(tune, commands.Connection.Tune), tune
        self.send_method(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        self.send_method(0, commands.Connection.Open(virtual_host="/"))
        assert isinstance(self.method(), commands.Connection.OpenOk)
        self.send_method(1, commands.Channel.Open())
        assert isinstance(self.method(), commands.Channel.OpenOk)

    def close(self) -> None:
        self.sock.close()

    def send_method(self, channel: int, m: Any) -> None:
        self.sock.sendall(frame.marshal(m, channel))

    def send_raw(self, kind: int, payload: bytes) -> None:
        self.sock.sendall(struct.pack(">BHI", kind, 1, len(payload)) + payload + b"\xce")

    def frame(self) -> tuple[int, bytes]:
        while len(self.buf) < 7 or len(self.buf) < 8 + struct.unpack_from(">I", self.buf, 3)[0]:
            chunk = self.sock.recv(65536)
            assert chunk, "the broker closed the connection"
            self.buf += chunk
        kind, _ch, size = struct.unpack_from(">BHI", self.buf)
        payload, self.buf = self.buf[7 : 7 + size], self.buf[8 + size :]
        return kind, payload

    def method(self) -> Any:
        kind, payload = self.frame()
        while kind == 8:  # heartbeats
            kind, payload = self.frame()
        assert kind == 1, kind
        whole = struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce"
        m = frame.unmarshal(whole)[2]
        assert not isinstance(m, commands.Channel.Close | commands.Connection.Close), m
        return m

    def bind(self, queue: str, exchange: str, args: Table) -> None:
        q, ex = queue.encode(), exchange.encode()
        method = (
            struct.pack(">HHH", 50, 20, 0)
            + bytes((len(q),))
            + q
            + bytes((len(ex),))
            + ex
            + b"\x00\x00"
            + args.encode()
        )
        self.send_raw(1, method)
        assert isinstance(self.method(), commands.Queue.BindOk)

    def publish_confirmed(self, exchange: str, header: bytes) -> None:
        self.send_method(1, commands.Confirm.Select())
        assert isinstance(self.method(), commands.Confirm.SelectOk)
        ex = exchange.encode()
        method = (
            struct.pack(">HHH", 60, 40, 0) + bytes((len(ex),)) + ex + b"\x00\x01"
        )  # "", mandatory
        self.send_raw(1, method)
        self.send_raw(2, header)
        self.send_raw(3, b"x")
        got = self.method()
        assert isinstance(got, commands.Basic.Ack), got  # not returned: it was routed

    def get(self, queue: str, no_ack: bool) -> tuple[int, bytes] | None:
        """basic.get: (delivery tag, the content header's bytes), None when empty."""
        self.send_method(1, commands.Basic.Get(queue=queue, no_ack=no_ack))
        m = self.method()
        if isinstance(m, commands.Basic.GetEmpty):
            return None
        assert isinstance(m, commands.Basic.GetOk), m
        kind, header = self.frame()
        assert kind == 2
        size = struct.unpack_from(">Q", header, 4)[0]
        while size:
            kind, body = self.frame()
            assert kind == 3
            size -= len(body)
        return int(m.delivery_tag), header

    def wait_get(self, queue: str, timeout: float = 15.0) -> bytes:
        deadline = time.monotonic() + timeout
        while (got := self.get(queue, no_ack=True)) is None:
            assert time.monotonic() < deadline, f"nothing arrived in {queue}"
            time.sleep(0.05)
        return got[1]


def _setup(bs: BrokerSet, node: int, prefix: str) -> tuple[str, str, str]:
    """A headers exchange routing to a work queue whose rejects go to a dead-letter queue."""
    hx, work, dead = f"{prefix}.hx", f"{prefix}.work", f"{prefix}.dead"
    ch = connect(bs, node).channel()
    ch.exchange_declare(hx, "headers")
    ch.exchange_declare(f"{prefix}.dlx", "fanout")
    ch.queue_declare(dead)
    ch.queue_bind(dead, f"{prefix}.dlx")
    ch.queue_declare(work, arguments={"x-dead-letter-exchange": f"{prefix}.dlx"})
    raw = Raw(bs.ports[node][0])
    try:
        raw.bind(work, hx, BINDING)
    finally:
        raw.close()
    return hx, work, dead


def _publish_and_reject(bs: BrokerSet, pub: int, rej: int, hx: str, work: str) -> bytes:
    """Publish on ``pub``, get (as published, byte for byte) and reject on ``rej``."""
    header = struct.pack(">HHQH", 60, 0, 1, F_HEADERS) + EDGE.encode()
    raw = Raw(bs.ports[pub][0])
    try:
        raw.publish_confirmed(hx, header)
    finally:
        raw.close()
    raw = Raw(bs.ports[rej][0])
    try:
        got = raw.get(work, no_ack=False)
        assert got is not None
        tag, delivered = got
        assert delivered == header
        raw.send_method(1, commands.Basic.Reject(delivery_tag=tag, requeue=False))
        # Applied once a later command of the same channel is answered.
        raw.send_method(1, commands.Queue.Declare(queue=work, passive=True))
        ok = raw.method()
        assert isinstance(ok, commands.Queue.DeclareOk) and ok.message_count == 0, ok
    finally:
        raw.close()
    return header


def _check_dead_lettered(dead: bytes, hx: str, work: str) -> None:
    flags = dead[12] << 8 | dead[13]
    assert flags == F_HEADERS
    start, end = fp.property_span(dead, F_HEADERS)
    after = decode_table(dead, start, end)[0]
    n = len(EDGE)
    assert after.entries[:n] == EDGE.entries  # byte for byte, in place (the NaNs too)
    assert [k for k, _ in after.entries[n:]] == [
        "x-death",
        "x-first-death-reason",
        "x-first-death-queue",
        "x-first-death-exchange",
    ]
    assert after.get("x-first-death-reason") == Field.longstr("rejected")
    assert after.get("x-first-death-queue") == Field.longstr(work)
    assert after.get("x-first-death-exchange") == Field.longstr(hx)
    xdeath = after.get("x-death")
    assert xdeath is not None and xdeath.kind == ARRAY
    [entry] = xdeath.value  # type: ignore[misc]
    assert entry.kind == TABLE
    t = entry.value
    assert [k for k, _ in t] == ["count", "exchange", "queue", "reason", "routing-keys", "time"]
    assert t.get("count") == Field.long(1)
    assert t.get("exchange") == Field.longstr(hx)
    assert t.get("queue") == Field.longstr(work)
    assert t.get("reason") == Field.longstr("rejected")
    assert t.get("routing-keys") == Field.array([Field.longstr("")])
    assert abs(t.get("time").value - time.time()) < 120  # type: ignore[operator,union-attr]


def test_edge_headers_routed_and_dead_lettered_across_members(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set()
    hx, work, dead = _setup(bs, 1, "edge")
    _publish_and_reject(bs, 1, 2, hx, work)
    raw = Raw(bs.ports[3][0])
    try:
        _check_dead_lettered(raw.wait_get(dead), hx, work)
    finally:
        raw.close()


def _primary(bs: BrokerSet, nodes: list[int]) -> int:
    for n in nodes:
        s = bs.status(n)
        if s is not None and s.get("role") == "primary" and s["state"] == "ready":
            return n
    raise AssertionError("no primary")


def test_edge_headers_dead_lettered_on_the_primary_are_read_on_the_promoted_backup(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(cluster_options=HOT_STANDBY)
    primary = _primary(bs, [1, 2, 3])
    backups = [n for n in (1, 2, 3) if n != primary]
    hx, work, dead = _setup(bs, primary, "edge")
    _publish_and_reject(bs, primary, primary, hx, work)
    # Shipped to the backups before the primary goes.
    for n in backups:
        wait_state(bs, n, lambda s: s["queues"].get(f"/:{dead}", {}).get("ready") == 1)
    bs.stop(primary)
    deadline = time.monotonic() + 30
    while True:
        try:
            new = _primary(bs, backups)
            break
        except AssertionError:
            assert time.monotonic() < deadline, "no backup was promoted"
            time.sleep(0.1)
    raw = Raw(bs.ports[new][0])
    try:
        _check_dead_lettered(raw.wait_get(dead), hx, work)
    finally:
        raw.close()

"""Message headers carried byte for byte (model version 8, the newest: what a fresh standalone
broker runs): values version 7 refused or changed go through delivery and dead-lettering as
the publisher wrote them.

* py-amqp (kombu's client) writes floats as doubles (``d``) and ``bytes`` as long strings
  (``S``), so it can send a 1e308 double, 1.1 and a long string that is not UTF-8.
* pika 1.3 cannot write a float at all and reads a double as an int (``long(value)``): it
  consumes, rejects and dead-letters here, and what it reads of the dead-lettered copy must be
  what it read of the original; its own values (``x`` byte arrays, decimals, 64-bit integers,
  timestamps, nested tables) go through too.
* A raw socket checks the bytes themselves: the content header the broker delivers is the
  publisher's, and the dead-lettered copy's headers keep every entry byte for byte.
"""

from __future__ import annotations

import datetime
import decimal
import math
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import amqp
import pika
import pytest
from clientutil import BrokerProcess, RawClient, blocking, wait_until
from pamqp import commands

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

DEATH_HEADERS = ("x-death", "x-first-death-reason", "x-first-death-queue", "x-first-death-exchange")


@pytest.fixture
def pyamqp(broker: BrokerProcess) -> Iterator[amqp.Connection]:
    c = amqp.Connection(f"{broker.host}:{broker.port}", connect_timeout=5, read_timeout=5)
    c.connect()
    yield c
    if c.connected:
        c.close()


def _dead_lettering(ch: Any, prefix: str) -> tuple[str, str]:
    """A work queue whose rejected messages go to a dead-letter queue (pika channel)."""
    dlx, work, dead = f"{prefix}.dlx", f"{prefix}.work", f"{prefix}.dead"
    ch.exchange_declare(dlx, "fanout")
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx)
    ch.queue_declare(work, arguments={"x-dead-letter-exchange": dlx})
    return work, dead


def _poll(get: Callable[[], Any], timeout: float = 5.0) -> Any:
    """``get()`` until it returns something (a message: basic.get answered get-ok)."""
    end = time.monotonic() + timeout
    while (got := get()) is None:
        assert time.monotonic() < end, "nothing arrived"
        time.sleep(0.05)
    return got


def _count(ch: Any, queue: str) -> int:
    return int(ch.queue_declare(queue, passive=True).method.message_count)


PYAMQP_HEADERS: dict[str, Any] = {
    "big": 1e308,
    "one-point-one": 1.1,
    "tiny": 5e-324,
    "neg": -2.5e-310,
    "not-utf8": b"\xff\xfe\x00",
    "text": "é",
    "n": 2**40,
    "nested": {"f": 1.1, "l": [1e308, b"\x80", "x"]},
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_doubles_and_non_utf8_long_strings_are_delivered_and_dead_lettered_unchanged(
    broker: BrokerProcess, pyamqp: amqp.Connection, prefix: str
) -> None:
    pc = blocking(broker.addr)
    try:
        work, dead = _dead_lettering(pc.channel(), prefix)
        headers = {**PYAMQP_HEADERS, "nan": math.nan, "inf": math.inf}
        ch = pyamqp.channel()
        ch.basic_publish(amqp.Message(b"m", application_headers=headers), routing_key=work)
        msg = _poll(lambda: ch.basic_get(work))
        assert _same(msg.headers, headers), msg.headers
        ch.basic_reject(msg.delivery_tag, requeue=False)
        pch = pc.channel()
        assert wait_until(lambda: _count(pch, dead) == 1, timeout=5)
        copy = ch.basic_get(dead, no_ack=True)
        assert copy.body == b"m"
        assert _same({k: v for k, v in copy.headers.items() if k not in DEATH_HEADERS}, headers)
        [death] = copy.headers["x-death"]
        assert death["count"] == 1 and death["reason"] == "rejected"
        assert death["queue"] == work and death["exchange"] == ""
        assert death["routing-keys"] == [work]
        assert copy.headers["x-first-death-queue"] == work
    finally:
        pc.close()


def test_pika_reads_the_dead_lettered_copy_as_it_read_the_original(
    broker: BrokerProcess, pyamqp: amqp.Connection, prefix: str
) -> None:
    conn = blocking(broker.addr)
    try:
        ch = conn.channel()
        work, dead = _dead_lettering(ch, prefix)
        pika_headers = {
            "bytes": b"\xff\x00",  # pika writes bytes as a byte array (x)
            "dec": decimal.Decimal("1.25"),
            "long": 2**62,
            "int": -5,
            "flag": True,
            "when": datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
            "none": None,
            "nested": {"a": [1, "b", {"c": b"\x80"}]},
        }
        ch.basic_publish("", work, b"p", pika.BasicProperties(headers=pika_headers))
        # And the doubles and long strings only py-amqp writes (no NaN or infinity: pika's
        # int() of them raises).
        pyamqp.channel().basic_publish(
            amqp.Message(b"q", application_headers=PYAMQP_HEADERS), routing_key=work
        )
        assert wait_until(lambda: _count(ch, work) == 2, timeout=5)
        originals = {}
        for _ in range(2):
            method, props, body = ch.basic_get(work)
            originals[body] = props.headers
            ch.basic_reject(method.delivery_tag, requeue=False)
        assert originals[b"p"] == pika_headers
        assert wait_until(lambda: _count(ch, dead) == 2, timeout=5)
        for _ in range(2):
            _m, props, body = ch.basic_get(dead, auto_ack=True)
            kept = {k: v for k, v in props.headers.items() if k not in DEATH_HEADERS}
            assert kept == originals[body]
            assert props.headers["x-death"][0]["reason"] == "rejected"
    finally:
        conn.close()


# ------------------------------------------------------------------ the bytes themselves


def _raw_frame(c: RawClient) -> tuple[int, bytes]:
    head = c.recv_raw(7)
    assert len(head) == 7, "broker closed"
    kind, _channel, size = struct.unpack(">BHI", head)
    payload = c.recv_raw(size + 1)
    assert payload[-1:] == b"\xce"
    return kind, payload[:-1]


def _get_raw(c: RawClient, queue: str) -> bytes | None:
    """basic.get with no-ack: the content-header payload as the broker sent it."""
    c.send_method(1, commands.Basic.Get(queue=queue, no_ack=True))
    kind, payload = _raw_frame(c)
    assert kind == 1
    if struct.unpack_from(">HH", payload)[1] == 72:  # get-empty
        return None
    kind, header = _raw_frame(c)
    assert kind == 2
    size = struct.unpack_from(">Q", header, 4)[0]
    while size:
        kind, body = _raw_frame(c)
        assert kind == 3
        size -= len(body)
    return header


EXACT_TABLE = Table(
    [
        ("nan-payload", Field(DOUBLE, b"\x7f\xf0\x00\x00\x00\x00\x12\x34")),
        ("big", Field.of(DOUBLE, 1e308)),
        ("one-point-one", Field.of(DOUBLE, 1.1)),
        ("f", Field.of(FLOAT, 1.1)),
        ("not-utf8", Field.longstr(b"\xff\xfe")),
        ("dec", Field(DECIMAL, struct.pack(">BI", 2, 2**32 - 1))),
        ("L", Field.of(LONG_L, -1)),
        ("t2", Field(ord("t"), b"\x02")),
        ("void0", Field(0, b"")),
        ("twice", Field.of(DOUBLE, 1.0)),
        ("twice", Field.of(DOUBLE, 2.0)),
        ("arr", Field.array([Field.table(Table([("d", Field.of(DOUBLE, 4.9e-324))]))])),
    ]
)


def test_the_content_header_is_delivered_and_dead_lettered_byte_for_byte(
    broker: BrokerProcess, prefix: str
) -> None:
    conn = blocking(broker.addr)
    try:
        work, dead = _dead_lettering(conn.channel(), prefix)
    finally:
        conn.close()
    flags = 0x8000 | 0x2000 | 0x1000 | 0x0100  # content-type, headers, delivery-mode, expiration
    props = b"\x04text" + EXACT_TABLE.encode() + b"\x02" + b"\x0560000"
    header = struct.pack(">HHQH", 60, 0, 1, flags) + props
    with RawClient(broker.addr) as c:
        c.handshake()
        c.open_channel(1)
        wq = work.encode()
        method = struct.pack(">HHH", 60, 40, 0) + b"\x00" + bytes((len(wq),)) + wq + b"\x00"
        c.send(
            struct.pack(">BHI", 1, 1, len(method))
            + method
            + b"\xce"
            + struct.pack(">BHI", 2, 1, len(header))
            + header
            + b"\xce"
            + struct.pack(">BHI", 3, 1, 1)
            + b"x\xce"
        )
        # Delivered as published.
        c.send_method(1, commands.Basic.Get(queue=work, no_ack=False))
        kind, payload = _raw_frame(c)
        assert kind == 1 and struct.unpack_from(">HH", payload) == (60, 71), payload
        tag = struct.unpack_from(">Q", payload, 4)[0]
        assert _raw_frame(c) == (2, header)
        assert _raw_frame(c) == (3, b"x")
        c.send_method(1, commands.Basic.Reject(delivery_tag=tag, requeue=False))
        copy = _poll(lambda: _get_raw(c, dead))
    # Every property but headers and expiration as sent; every header entry as sent, then ours.
    flags_out = copy[12] << 8 | copy[13]
    assert flags_out == flags & ~0x0100
    start, end = fp.property_span(copy, 0x2000)
    assert copy[14:start] == b"\x04text" and copy[end:] == b"\x02"
    after = decode_table(copy, start, end)[0]
    n = len(EXACT_TABLE)
    assert after.entries[:n] == EXACT_TABLE.entries
    assert [k for k, _ in after.entries[n:]] == list(DEATH_HEADERS)
    xdeath = after.get("x-death")
    assert xdeath is not None and xdeath.kind == ARRAY
    [entry] = xdeath.value  # type: ignore[misc]
    assert entry.kind == TABLE
    assert entry.value.get("original-expiration") == Field.longstr("60000")
    assert entry.value.get("count") == Field.long(1)

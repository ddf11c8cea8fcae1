"""Client input that once broke a replica (found by review): every case must end in the spec's
reply on the offending channel or connection, identically whether this replica owns the
connection (encodes output) or shadows it, and never raise out of ``Broker.apply``."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from pamqp import commands as C
from pamqp import header
from test_snapshot import assert_indistinguishable

from cpgbroker.model.broker import Broker
from cpgbroker.model.state import snapshot as S
from cpgbroker.wire.framer import frame
from modelclient import Client, Harness


def _raw_publish(ch: int, exchange: str, rk: str, body: bytes) -> bytes:
    """A publish packed by hand: the name is not checked by any client library."""
    exb, rkb = exchange.encode(), rk.encode()
    p = struct.pack(">HHH", 60, 40, 0) + bytes([len(exb)]) + exb + bytes([len(rkb)]) + rkb + b"\0"
    from pamqp import frame as pf

    return (
        frame(1, ch, p)
        + pf.marshal(header.ContentHeader(0, len(body), C.Basic.Properties()), ch)
        + frame(3, ch, body)
    )


def _client(emit: bool, version: int | None = None) -> tuple[Harness, Client]:
    h = Harness(None if version is None else Broker(version=version))
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    h.broker.set_emit(1, emit)
    return h, c


def test_non_ascii_name_at_the_255_byte_limit_gets_404_on_owner_and_shadow() -> None:
    digests = []
    for emit in (True, False):
        h, c = _client(emit)
        c.send_raw(_raw_publish(1, "é" * 127, "rk", b"x"))
        digests.append(S.digest(h.broker))
        if emit:
            close = [m for m in c.methods() if isinstance(m, C.Channel.Close)]
            assert close and close[0].reply_code == 404
            assert len(close[0].reply_text.encode()) <= 255
    assert digests[0] == digests[1]


def test_alternate_exchange_cycle_is_tried_once_and_the_message_dropped() -> None:
    h, c = _client(True)
    c.send(
        1,
        C.Exchange.Declare(
            exchange="a", exchange_type="fanout", arguments={"alternate-exchange": "b"}
        ),
    )
    c.send(
        1,
        C.Exchange.Declare(
            exchange="b", exchange_type="fanout", arguments={"alternate-exchange": "a"}
        ),
    )
    c.send(1, C.Queue.Declare(queue="q"))
    c.publish(1, "a", "k", b"unroutable")  # a -> b -> a: no queue anywhere
    c.send(1, C.Queue.Bind(queue="q", exchange="b"))
    c.publish(1, "a", "k", b"via-b")
    assert [m.message_count for m in c.methods() if isinstance(m, C.Queue.DeclareOk)] == [0]
    assert len(h.broker.vhosts["/"].queues["q"].messages) == 1


@pytest.mark.parametrize("reuse_tag", [False, True])
def test_deleting_a_queue_under_a_consumer_restores_exactly(reuse_tag: bool) -> None:
    """The consumer's unacked deliveries outlive it; a restored replica must not tie them to a
    later consumer that reuses the tag (it would charge that consumer's prefetch)."""
    h, c = _client(True)
    c.send(1, C.Basic.Qos(prefetch_count=1))
    c.send(1, C.Queue.Declare(queue="q"))
    c.send(1, C.Basic.Consume(queue="q", consumer_tag="t"))
    c.publish(1, "", "q", b"m1")
    c.send(1, C.Queue.Delete(queue="q"))
    if reuse_tag:
        c.send(1, C.Queue.Declare(queue="q2"))
        c.send(1, C.Basic.Consume(queue="q2", consumer_tag="t"))
    restored = S.restore(S.snapshot(h.broker))
    assert_indistinguishable(h.broker, restored)
    assert S.digest(restored) == S.digest(h.broker)


# ---------------------------------------------------------------------------------------------
# Malformed input that once escaped the codec as an exception (an error-check round and 541
# INTERNAL_ERROR on every member), and reply codes that now follow RabbitMQ 3.10.


def _codes(c: Client) -> list[tuple[str, int]]:
    from modelclient import close_codes

    return close_codes(bytes(c.h.out.pop(c.conn, b"")))


def _both(send: Any, version: int | None = None) -> list[tuple[str, int]]:
    """Run ``send(client)`` on an owner and a shadow replica: no exception, same state."""
    from modelclient import close_codes

    digests, codes = [], []
    for emit in (True, False):
        h, c = _client(emit, version)
        c.recv()
        send(c)
        digests.append(S.digest(h.broker))
        codes.append(close_codes(bytes(h.out.pop(1, b""))))
    assert digests[0] == digests[1]
    return codes[0]


def _publish_with_header(hp: bytes) -> Any:
    pm = frame(1, 1, struct.pack(">HHH", 60, 40, 0) + b"\x00\x01q\x00")
    return lambda c: c.send_raw(pm + frame(2, 1, hp) + frame(3, 1, b"x"))


@pytest.mark.parametrize("n", [0, 4, 11, 12, 13])
def test_a_content_header_shorter_than_its_fixed_part_is_501(n: int) -> None:
    hp = struct.pack(">HHQH", 60, 0, 1, 0)[:n]
    assert _both(_publish_with_header(hp)) == [("connection", 501)]


def test_a_content_header_for_another_class_is_505() -> None:
    assert _both(_publish_with_header(struct.pack(">HHQH", 50, 0, 1, 0))) == [("connection", 505)]


def test_a_content_header_with_a_weight_is_505() -> None:
    assert _both(_publish_with_header(struct.pack(">HHQH", 60, 1, 1, 0))) == [("connection", 505)]


def test_a_heartbeat_with_a_payload_is_501_and_on_a_channel_505() -> None:
    assert _both(lambda c: c.send_raw(frame(8, 0, b"x"))) == [("connection", 501)]
    assert _both(lambda c: c.send_raw(frame(8, 1, b""))) == [("connection", 505)]


def test_a_non_connection_method_on_channel_0_is_504() -> None:
    assert _both(lambda c: c.send(0, C.Basic.Qos(prefetch_count=1))) == [("connection", 504)]


def _deep(depth: int) -> bytes:
    from modelclient import deep_table

    return deep_table(depth)


def test_deep_client_properties_before_authentication_are_502_not_a_recursion_error() -> None:
    for emit in (True, False):
        h = Harness()
        c = h.connect(1)
        h.broker.set_emit(1, emit)
        c.send_raw(b"AMQP\x00\x00\x09\x01")
        tbl = _deep(5000)
        args = tbl + b"\x05PLAIN" + struct.pack(">I", 12) + b"\0guest\0guest" + b"\x05en_US"
        c.send_raw(frame(1, 0, struct.pack(">HH", 10, 11) + args))
        if emit:
            assert _codes(c) == [("connection", 502)]


def test_deep_amqplain_response_is_refused_as_a_login() -> None:
    h = Harness()
    c = h.connect(1)
    c.send_raw(b"AMQP\x00\x00\x09\x01")
    tbl = _deep(3000)
    resp = tbl[4:]
    args = (
        struct.pack(">I", 0) + b"\x08AMQPLAIN" + struct.pack(">I", len(resp)) + resp + b"\x05en_US"
    )
    c.send_raw(frame(1, 0, struct.pack(">HH", 10, 11) + args))
    assert _codes(c) == [("connection", 403)]


@pytest.mark.parametrize("depth", [101, 2000])
def test_deep_declare_arguments_are_502(depth: int) -> None:
    q = b"\x01q"
    args = struct.pack(">HHH", 50, 10, 0) + q + b"\x00" + _deep(depth)
    assert _both(lambda c: c.send_raw(frame(1, 1, args))) == [("connection", 502)]


def _headers_header(table: bytes, flags: int = 0x2000) -> bytes:
    return struct.pack(">HHQH", 60, 0, 1, flags) + table


@pytest.mark.parametrize(
    "table",
    [
        _deep(101),
        _deep(3000),
        struct.pack(">I", 100) + b"\x01aS",  # length past the frame
        struct.pack(">I", 3) + b"\x01a?",  # unknown type
        struct.pack(">I", 8) + b"\x01aS\x00\x00\x00\x09",  # value past its table
        struct.pack(">I", 3) + b"\x01\xff" + b"t",  # key not UTF-8
        struct.pack(">I", 11) + b"\x01aT" + struct.pack(">Q", 2**64 - 1),  # year > 9999
    ],
)
@pytest.mark.parametrize("version", [7, 8])
def test_a_poison_headers_table_is_refused_at_publish_with_501(table: bytes, version: int) -> None:
    codes = _both(_publish_with_header(_headers_header(table)), version)
    assert codes == [("connection", 501)]


# Values pamqp cannot write again: model version 7 refuses them at publish, 8 takes them.
PAMQP_CANNOT_WRITE = [
    struct.pack(">I", 9) + b"\x01aS\x00\x00\x00\x02\xff\xfe",  # long string, not UTF-8
    struct.pack(">I", 8) + b"\x01aD\x00\xff\xff\xff\xff",  # mantissa > 2**31-1
    struct.pack(">I", 11) + b"\x01ad" + struct.pack(">d", 1e300),  # beyond float32
]


@pytest.mark.parametrize("table", PAMQP_CANNOT_WRITE)
def test_values_pamqp_cannot_write_are_501_at_model_version_7_only(table: bytes) -> None:
    assert _both(_publish_with_header(_headers_header(table)), 7) == [("connection", 501)]
    assert _both(_publish_with_header(_headers_header(table)), 8) == []


def test_a_short_string_property_that_is_not_utf8_is_501() -> None:
    hp = struct.pack(">HHQH", 60, 0, 1, 0x8000) + b"\x02\xff\xfe"
    assert _both(_publish_with_header(hp)) == [("connection", 501)]


@pytest.mark.parametrize(
    "xdeath", [5, 1.5, {"x": [{"count": "many", "queue": "q", "reason": "expired"}]}]
)
def test_an_x_death_header_dead_lettering_could_not_count_is_406_at_version_7(
    xdeath: Any,
) -> None:
    """Version 8 takes it, and dead-letters it as RabbitMQ does (test_deadletter_exact.py)."""
    from pamqp import encode

    value = xdeath["x"] if isinstance(xdeath, dict) else xdeath
    table = encode.field_table({"x-death": value})
    assert _both(_publish_with_header(_headers_header(table)), 7) == [("channel", 406)]
    assert _both(_publish_with_header(_headers_header(table)), 8) == []


@pytest.mark.parametrize("version", [7, 8])
def test_messages_accepted_at_publish_survive_headers_routing_dead_letters_and_ttl(
    version: int,
) -> None:
    """Every value type pamqp knows, nested, through a headers exchange, then expired into a
    dead-letter queue whose consumer is another client: nobody gets a close."""
    h = Harness(Broker(version=version))
    pub = h.connect(1)
    pub.handshake()
    pub.channel(1)
    pub.send(1, C.Exchange.Declare(exchange="dlx", exchange_type="fanout"))
    pub.send(1, C.Exchange.Declare(exchange="hx", exchange_type="headers"))
    pub.send(1, C.Queue.Declare(queue="dead"))
    pub.send(1, C.Queue.Bind(queue="dead", exchange="dlx"))
    pub.send(
        1,
        C.Queue.Declare(
            queue="ttl", arguments={"x-message-ttl": 0, "x-dead-letter-exchange": "dlx"}
        ),
    )
    pub.send(1, C.Queue.Bind(queue="ttl", exchange="hx", arguments={"x-match": "any", "k": 1}))
    other = h.connect(2)
    other.handshake()
    other.channel(1)
    other.send(1, C.Basic.Consume(queue="dead", no_ack=True))
    import datetime
    import decimal

    headers = {
        "k": 1,
        "deep": _nested(98),
        "all": [
            True,
            -5,
            70000,
            2**40,
            1.5,
            decimal.Decimal("1.25"),
            "é",
            bytearray(b"\xff"),
            None,
            datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
            {"x-death": 1},
        ],
        "x-death": [{"count": 2, "queue": "ttl", "reason": "expired"}, "junk"],
    }
    pub.publish(
        1,
        "hx",
        "",
        b"m",
        props=C.Basic.Properties(headers=headers, timestamp=datetime.datetime(2020, 1, 1)),
    )
    h.tick(10)
    assert not [m for m in pub.methods() if isinstance(m, C.Connection.Close | C.Channel.Close)]
    got = other.deliveries()
    assert [b for _m, b in got] == [b"m"]


def _nested(depth: int) -> Any:
    v: Any = {}
    for _ in range(depth):
        v = {"a": v}
    return v


def test_two_full_queues_dead_lettering_into_each_other_do_not_hang_the_broker() -> None:
    """Two capped queues whose dead-letter exchanges lead to each other: a publish to a full
    one dead-letters its head into the other, whose head comes back... RabbitMQ's cycle rule
    drops a message headed back to a queue it died in; without it every member looped for
    ever within one event."""
    from pamqp import commands as c

    from modelclient import Harness

    h = Harness()
    cl = h.connect(1)
    cl.handshake()
    cl.channel()
    for ex in ("dx", "dy"):
        cl.rpc(1, c.Exchange.Declare(exchange=ex, exchange_type="fanout"))
    for q, dlx in (("a", "dy"), ("b", "dx")):
        cl.rpc(
            1,
            c.Queue.Declare(queue=q, arguments={"x-max-length": 1, "x-dead-letter-exchange": dlx}),
        )
    cl.rpc(1, c.Queue.Bind(queue="a", exchange="dx"))
    cl.rpc(1, c.Queue.Bind(queue="b", exchange="dy"))
    for i in range(3):
        cl.publish(1, "", "a", b"m%d" % i)
        cl.publish(1, "", "b", b"n%d" % i)
    queues = h.broker.vhosts["/"].queues
    assert not cl.is_closed
    assert [e.msg.body for e in queues["a"].messages] == [b"m2"]
    assert [e.msg.body for e in queues["b"].messages] == [b"n2"]

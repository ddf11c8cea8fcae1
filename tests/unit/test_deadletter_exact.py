"""Model version 8 (``EXACT_FIELD_TABLES``): message headers are carried byte for byte.

At version 8 a message whose headers hold every field type with its edge values (NaN with a
payload, infinities, 1e308 and the smallest subnormal doubles, 32-bit floats, long strings that
are not UTF-8, decimals with a mantissa of 2**32-1, integers of every width, timestamps, voids,
nested arrays and tables, a name given twice) is accepted, delivered unchanged, and
dead-lettered (rejected, expired) and redelivered by a quorum queue with every header value it
does not change byte-identical, x-death as RabbitMQ writes it. At version 7 the broker is what
it was: the same refusals, the same (pamqp-written, lossy) dead-lettered headers."""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any

import pytest
from pamqp import commands as C
from pamqp import decode as pdecode
from pamqp import header as H

from cpgbroker.model.broker import Broker
from cpgbroker.model.entities import Message
from cpgbroker.model.routing.deadletter import dead_letter_header, dead_letter_header_exact
from cpgbroker.model.state import snapshot as S
from cpgbroker.wire import fastpath as fp
from cpgbroker.wire.fieldtable import (
    ARRAY,
    BOOL,
    BYTE,
    BYTE_ARRAY,
    DECIMAL,
    DOUBLE,
    FLOAT,
    LONG,
    LONG_L,
    SHORT,
    SIGNED_INT,
    TABLE,
    UNSIGNED_BYTE,
    UNSIGNED_INT,
    UNSIGNED_SHORT,
    VOID,
    VOID_0,
    Field,
    Table,
    decode_table,
)
from cpgbroker.wire.framer import frame
from modelclient import Client, Harness, _frames_of


def _d(x: float) -> Field:
    return Field.of(DOUBLE, x)


# A double NaN with a payload (not Python's canonical NaN) and a signalling 32-bit NaN: kept
# as sent, bit for bit.
NAN_PAYLOAD = Field(DOUBLE, b"\x7f\xf0\x00\x00\x00\x00\x12\x34")
SNAN32 = Field(FLOAT, b"\x7f\x80\x00\x01")


def edge_table() -> Table:
    inner = Table(
        [
            ("deep", Field.array([_d(1.1), Field.array([Field.longstr(b"\x80"), _d(-0.0)])])),
            ("t", Field.table(Table([("n", Field.of(LONG_L, -1))]))),
        ]
    )
    return Table(
        [
            ("nan", _d(float("nan"))),
            ("nan-payload", NAN_PAYLOAD),
            ("inf", _d(float("inf"))),
            ("-inf", _d(float("-inf"))),
            ("big", _d(1e308)),
            ("tiny", _d(4.9e-324)),
            ("negzero", _d(-0.0)),
            ("one-point-one", _d(1.1)),
            ("f", Field.of(FLOAT, 1.1)),
            ("f-max", Field.of(FLOAT, 3.4028234663852886e38)),
            ("f-snan", SNAN32),
            ("not-utf8", Field.longstr(b"\xff\xfe\x00")),
            ("empty", Field.longstr(b"")),
            ("text", Field.longstr("é")),
            ("bytes", Field.of(BYTE_ARRAY, b"\x00\xff")),
            ("dec-max", Field(DECIMAL, struct.pack(">BI", 0, 2**32 - 1))),
            ("dec-scale", Field(DECIMAL, struct.pack(">BI", 255, 2**32 - 1))),
            ("b", Field.of(BYTE, -128)),
            ("B", Field.of(UNSIGNED_BYTE, 255)),
            ("s", Field.of(SHORT, -32768)),
            ("u", Field.of(UNSIGNED_SHORT, 65535)),
            ("I", Field.of(SIGNED_INT, -(2**31))),
            ("i", Field.of(UNSIGNED_INT, 2**32 - 1)),
            ("l", Field.of(LONG, -(2**63))),
            ("L", Field.of(LONG_L, 2**63 - 1)),
            ("t2", Field(BOOL, b"\x02")),
            ("false", Field.of(BOOL, False)),
            ("ts", Field.timestamp(0)),
            ("ts32", Field.timestamp(2**32 - 1)),
            ("ts-ms", Field.timestamp(1_700_000_000_123)),
            ("void", Field.of(VOID, None)),
            ("void0", Field.of(VOID_0, None)),
            ("arr", Field.array([_d(1e308), Field.table(inner), Field.array([])])),
            ("tbl", Field.table(inner)),
            ("twice", Field.of(SHORT, 1)),
            ("twice", Field.of(SHORT, 2)),
        ]
    )


# Basic's property flags used here.
F_CONTENT_TYPE, F_HEADERS, F_DELIVERY_MODE = 0x8000, 0x2000, 0x1000
F_EXPIRATION, F_MESSAGE_ID, F_APP_ID = 0x0100, 0x0080, 0x0008


def content_header(
    table: Table | None, size: int, expiration: bytes | None = None, app_id: bytes = b"app"
) -> bytes:
    """content-type, headers, delivery-mode 2, [expiration], message-id, app-id."""
    flags = F_CONTENT_TYPE | F_DELIVERY_MODE | F_MESSAGE_ID | F_APP_ID
    props = b"\x0aapp/x-test"
    if table is not None:
        flags |= F_HEADERS
        props += table.encode()
    props += b"\x02"
    if expiration is not None:
        flags |= F_EXPIRATION
        props += bytes((len(expiration),)) + expiration
    props += b"\x04id-1" + bytes((len(app_id),)) + app_id
    return struct.pack(">HHQH", 60, 0, size, flags) + props


def publish_raw(c: Client, exchange: str, rk: str, hp: bytes, body: bytes) -> None:
    ex, key = exchange.encode(), rk.encode()
    method = struct.pack(">HHH", 60, 40, 0) + bytes((len(ex),)) + ex + bytes((len(key),)) + key
    c.send_raw(frame(1, 1, method + b"\x00") + frame(2, 1, hp) + frame(3, 1, body))


def raw_deliveries(h: Harness, conn: int) -> list[bytes]:
    """The content-header payloads sent to ``conn`` since the last call, as sent."""
    return [p for t, _ch, p in _frames_of(bytes(h.out.pop(conn, b""))) if t == 2]


def opened(version: int, now_ms: int = 5_000_000) -> tuple[Harness, Client]:
    h = Harness(Broker(version=version))
    h.tick(now_ms)
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    c.send(1, C.Exchange.Declare(exchange="dlx", exchange_type="fanout"))
    c.send(1, C.Queue.Declare(queue="dead"))
    c.send(1, C.Queue.Bind(queue="dead", exchange="dlx"))
    c.send(1, C.Queue.Declare(queue="src", arguments={"x-dead-letter-exchange": "dlx"}))
    c.recv()
    return h, c


def closes(c: Client) -> list[Any]:
    return [m for m in c.methods() if isinstance(m, C.Connection.Close | C.Channel.Close)]


def get_raw(h: Harness, c: Client, queue: str) -> bytes:
    c.send(1, C.Basic.Get(queue=queue, no_ack=True))
    [hp] = raw_deliveries(h, c.conn)
    return hp


def props_without(hp: bytes, *flags: int) -> tuple[int, bytes]:
    """The header's flags and property bytes with the properties ``flags`` cut out."""
    f = hp[12] << 8 | hp[13]
    spans = sorted(fp.property_span(hp, flag) for flag in flags)
    out, p = b"", 14
    for start, end in spans:
        out += hp[p:start]
        p = end
    return f, out + hp[p:]


def check_dead_lettered(
    original: bytes,
    dead: bytes,
    *,
    reason: str,
    queue: str,
    exchange: str,
    routing_key: str,
    now_ms: int,
    expiration: bytes | None = None,
) -> Table:
    """``dead`` is ``original`` dead-lettered once: the same properties but headers and
    expiration, every header entry of the original in place and byte-identical, then x-death
    and x-first-death-*. Returns the x-death entry."""
    assert dead[:12] == original[:12]  # class, weight, body size
    flags_o, rest_o = props_without(original, F_HEADERS, F_EXPIRATION)
    flags_d, rest_d = props_without(dead, F_HEADERS, F_EXPIRATION)
    assert flags_d == (flags_o | F_HEADERS) & ~F_EXPIRATION
    assert rest_d == rest_o
    start, end = fp.property_span(original, F_HEADERS)
    before = decode_table(original, start, end)[0] if flags_o & F_HEADERS else Table()
    start, end = fp.property_span(dead, F_HEADERS)
    after, _ = decode_table(dead, start, end)
    n = len(before)
    assert after.entries[:n] == before.entries
    assert [k for k, _ in after.entries[n:]] == [
        "x-death",
        "x-first-death-reason",
        "x-first-death-queue",
        "x-first-death-exchange",
    ]
    assert after.get("x-first-death-reason") == Field.longstr(reason)
    assert after.get("x-first-death-queue") == Field.longstr(queue)
    assert after.get("x-first-death-exchange") == Field.longstr(exchange)
    xdeath = after.get("x-death")
    assert xdeath is not None and xdeath.kind == ARRAY
    [entry] = xdeath.value  # type: ignore[misc]
    assert entry.kind == TABLE
    want = [
        ("count", Field.long(1)),
        ("exchange", Field.longstr(exchange)),
        ("queue", Field.longstr(queue)),
        ("reason", Field.longstr(reason)),
        ("routing-keys", Field.array([Field.longstr(routing_key)])),
        ("time", Field.timestamp(now_ms // 1000)),
    ]
    if expiration is not None:
        want.insert(2, ("original-expiration", Field.longstr(expiration)))
    assert entry.value == Table(want)
    return entry.value  # type: ignore[no-any-return]


# ------------------------------------------------------------------ version 8


def test_every_type_is_accepted_and_delivered_byte_for_byte() -> None:
    h, c = opened(8)
    hp = content_header(edge_table(), 4)
    publish_raw(c, "", "src", hp, b"body")
    assert not closes(c)
    c.send(1, C.Basic.Consume(queue="src", no_ack=True))
    assert raw_deliveries(h, 1) == [hp]


def test_a_rejected_message_is_dead_lettered_with_every_value_byte_identical() -> None:
    h, c = opened(8, now_ms=1_700_000_000_999)
    hp = content_header(edge_table(), 4)
    publish_raw(c, "", "src", hp, b"body")
    c.send(1, C.Basic.Get(queue="src"))
    [(got, _)] = c.deliveries()
    c.send(1, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=False))
    assert not closes(c)
    dead = get_raw(h, c, "dead")
    check_dead_lettered(
        hp,
        dead,
        reason="rejected",
        queue="src",
        exchange="",
        routing_key="src",
        now_ms=1_700_000_000_999,
    )
    # What a client library sees of it: pamqp, as pika would.
    headers = pdecode.field_table(dead[fp.property_span(dead, F_HEADERS)[0] :])[1]
    assert headers["one-point-one"] == 1.1 and headers["big"] == 1e308
    assert headers["tiny"] == 4.9e-324 and headers["not-utf8"] == b"\xff\xfe\x00"


def test_an_expired_message_is_dead_lettered_with_its_expiration_in_x_death() -> None:
    h, c = opened(8, now_ms=10_000)
    c.send(
        1,
        C.Queue.Declare(
            queue="ttl",
            arguments={"x-dead-letter-exchange": "dlx", "x-message-ttl": 1000},
        ),
    )
    hp = content_header(edge_table(), 1, expiration=b"100")
    c.send(1, C.Queue.Bind(queue="ttl", exchange="amq.direct", routing_key="k"))
    publish_raw(c, "amq.direct", "k", hp, b"x")
    h.tick(10_050)
    assert len(h.broker.vhosts["/"].queues["ttl"].messages) == 1
    h.tick(10_100)
    assert not h.broker.vhosts["/"].queues["ttl"].messages
    assert not closes(c)
    dead = get_raw(h, c, "dead")
    check_dead_lettered(
        hp,
        dead,
        reason="expired",
        queue="ttl",
        exchange="amq.direct",
        routing_key="k",
        now_ms=10_100,
        expiration=b"100",
    )


def test_a_message_without_headers_gets_them() -> None:
    h, c = opened(8, now_ms=3_000)
    hp = content_header(None, 1)
    publish_raw(c, "", "src", hp, b"x")
    c.send(1, C.Basic.Get(queue="src"))
    [(got, _)] = c.deliveries()
    c.send(1, C.Basic.Nack(delivery_tag=got.delivery_tag, requeue=False))
    dead = get_raw(h, c, "dead")
    check_dead_lettered(
        hp, dead, reason="rejected", queue="src", exchange="", routing_key="src", now_ms=3_000
    )


def test_dying_again_in_the_same_queue_counts_up_and_keeps_the_rest() -> None:
    """src dead-letters to back (via dlx2), back dead-letters to src: rejected in src, in back,
    in src again. The entry of (src, rejected) moves to the front with count 2 (``l``) and the
    time of its second death; the entry of back stays as it was."""
    h, c = opened(8, now_ms=1_000_000)
    c.send(1, C.Exchange.Declare(exchange="to-back", exchange_type="fanout"))
    c.send(1, C.Exchange.Declare(exchange="to-src", exchange_type="fanout"))
    c.send(1, C.Queue.Declare(queue="a", arguments={"x-dead-letter-exchange": "to-back"}))
    c.send(1, C.Queue.Declare(queue="back", arguments={"x-dead-letter-exchange": "to-src"}))
    c.send(1, C.Queue.Bind(queue="back", exchange="to-back"))
    c.send(1, C.Queue.Bind(queue="a", exchange="to-src"))
    c.recv()
    hp = content_header(edge_table(), 1)
    publish_raw(c, "", "a", hp, b"x")
    for i, q in enumerate(("a", "back", "a")):
        h.tick(1_000_000 + 7_000 * (i + 1))
        c.send(1, C.Basic.Get(queue=q))
        [(got, _)] = c.deliveries()
        c.send(1, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=False))
    assert not closes(c)
    final = h.broker.vhosts["/"].queues["back"].messages[0].msg.header
    start, end = fp.property_span(final, F_HEADERS)
    after = decode_table(final, start, end)[0]
    before = edge_table()
    assert after.entries[: len(before)] == before.entries
    deaths = after.get("x-death").value  # type: ignore[union-attr]
    assert isinstance(deaths, list)
    first, second = (d.value for d in deaths)
    assert isinstance(first, Table) and isinstance(second, Table)
    assert first.get("queue") == Field.longstr("a")
    assert first.get("count") == Field.long(2)
    assert first.get("time") == Field.timestamp(1_021)
    assert second.get("queue") == Field.longstr("back")
    assert second.get("count") == Field.long(1)
    assert second.get("time") == Field.timestamp(1_014)
    # The first death stays the first.
    assert after.get("x-first-death-queue") == Field.longstr("a")


def test_a_publishers_x_delivery_count_is_replaced_in_place_on_quorum_redelivery() -> None:
    h, c = opened(8)
    c.send(1, C.Queue.Declare(queue="qq", durable=True, arguments={"x-queue-type": "quorum"}))
    table = edge_table()
    table.entries.insert(3, ("x-delivery-count", Field.of(BYTE, 7)))
    hp = content_header(table, 1)
    publish_raw(c, "", "qq", hp, b"x")
    c.send(1, C.Basic.Get(queue="qq"))
    [(got, _)] = c.deliveries()
    c.send(1, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=True))
    c.recv()
    redelivered = get_raw(h, c, "qq")
    start, end = fp.property_span(redelivered, F_HEADERS)
    after = decode_table(redelivered, start, end)[0]
    want = edge_table()
    want.entries.insert(3, ("x-delivery-count", Field.long(1)))
    assert after == want
    assert props_without(redelivered, F_HEADERS) == props_without(hp, F_HEADERS)


@pytest.mark.parametrize(
    ("xdeath", "count"),
    [
        (Field.of(SHORT, 5), 1),  # not an array: replaced (RabbitMQ resets it)
        (Field.array([Field.table(Table([("count", Field.longstr("many"))]))]), 1),
        (Field.array([Field.table(Table([("count", Field.of(UNSIGNED_BYTE, 4))]))]), 5),
        (Field.array([Field.table(Table([("count", Field.of(LONG, 2**63 - 1))]))]), 2**63 - 1),
        (Field.array([Field.table(Table([("count", _d(2.0))]))]), 1),
        (Field.array([Field.table(Table())]), 1),
    ],
)
def test_an_x_death_version_7_refused_is_dead_lettered_as_rabbitmq_does(
    xdeath: Field, count: int
) -> None:
    h, c = opened(8)
    if xdeath.kind == ARRAY:
        # The entry is src's, for rejection: the one that counts up.
        [entry] = xdeath.value  # type: ignore[misc]
        t = entry.value
        t.entries += [("queue", Field.longstr("src")), ("reason", Field.longstr("rejected"))]
        xdeath = Field.array([Field.table(t), Field.longstr("junk")])
    table = Table([("a", _d(1.1)), ("x-death", xdeath), ("z", Field.of(LONG, 1))])
    publish_raw(c, "", "src", content_header(table, 1), b"x")
    assert not closes(c)
    c.send(1, C.Basic.Get(queue="src"))
    [(got, _)] = c.deliveries()
    c.send(1, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=False))
    dead = get_raw(h, c, "dead")
    start, end = fp.property_span(dead, F_HEADERS)
    after = decode_table(dead, start, end)[0]
    assert [k for k, _ in after.entries[:3]] == ["a", "x-death", "z"]
    assert after.entries[0] == table.entries[0] and after.entries[2] == table.entries[2]
    deaths = after.get("x-death").value  # type: ignore[union-attr]
    assert isinstance(deaths, list)
    front = deaths[0].value
    assert isinstance(front, Table)
    assert front.get("count") == Field.long(count)
    assert front.get("queue") == Field.longstr("src")
    if xdeath.kind == ARRAY:
        assert deaths[1:] == [Field.longstr("junk")]
    else:
        assert len(deaths) == 1


def test_snapshot_and_restore_keep_such_headers() -> None:
    h, c = opened(8)
    hp = content_header(edge_table(), 1)
    publish_raw(c, "", "src", hp, b"x")
    restored = S.restore(S.snapshot(h.broker))
    assert S.digest(restored) == S.digest(h.broker)
    assert restored.vhosts["/"].queues["src"].messages[0].msg.header == hp


def test_version_8_dead_letter_header_keeps_what_version_7_rewrites() -> None:
    """The same message through both functions: version 7's still sorts the headers and cuts
    floats (its documented behaviour), version 8's keeps them."""
    table = Table([("z", _d(1.1)), ("a", Field.of(LONG, 1))])
    hp = content_header(table, 1)
    span = fp.property_span(hp, F_HEADERS)
    msg = Message(1, "ex", "rk", hp, b"x", 2, None, span)
    q: Any = SimpleNamespace(name="q")
    v7 = pdecode.field_table(dead_letter_header(msg, q, "expired", 0)[span[0] :])[1]
    assert list(v7)[:2] == ["a", "x-death"] and v7["z"] == 1.100000023841858
    exact = dead_letter_header_exact(msg, q, "expired", 0)
    after = decode_table(exact, *fp.property_span(exact, F_HEADERS))[0]
    assert after.entries[:2] == table.entries


# ------------------------------------------------------------------ version 7, as it was

# Values version 7 accepts, and rewrites when it dead-letters: a double within float32 range, an
# integer written in the smallest type, a key order pamqp sorts.
V7_TABLE = Table(
    [
        ("z", _d(1.1)),
        ("n", Field.of(LONG, 5)),
        ("s", Field.longstr("é")),
        ("f", Field.of(FLOAT, 4.9e-324)),
        ("arr", Field.array([_d(1.1), Field.table(Table([("x", Field.of(UNSIGNED_INT, 3))]))])),
    ]
)


@pytest.mark.parametrize("expiration", [None, b"100"])
def test_version_7_dead_letters_with_pamqp_as_before(expiration: bytes | None) -> None:
    h, c = opened(7, now_ms=2_000_000)
    hp = content_header(V7_TABLE, 1, expiration=expiration)
    publish_raw(c, "", "src", hp, b"x")
    src = h.broker.vhosts["/"].queues["src"]
    msg = src.messages[0].msg
    want = dead_letter_header(msg, src, "rejected", 2_000_000)
    c.send(1, C.Basic.Get(queue="src"))
    [(got, _)] = c.deliveries()
    c.send(1, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=False))
    dead = get_raw(h, c, "dead")
    assert dead == want
    ch = H.ContentHeader()
    ch.unmarshal(dead)
    assert ch.properties.headers["z"] == 1.100000023841858  # cut to 32 bits: version 7
    assert ch.properties.headers["f"] == 0.0


def test_version_7_redelivers_a_publishers_x_delivery_count_through_pamqp() -> None:
    h, c = opened(7)
    c.send(1, C.Queue.Declare(queue="qq", durable=True, arguments={"x-queue-type": "quorum"}))
    table = Table([*V7_TABLE.entries, ("x-delivery-count", Field.of(LONG, 7))])
    hp = content_header(table, 1)
    publish_raw(c, "", "qq", hp, b"x")
    c.send(1, C.Basic.Get(queue="qq"))
    [(got, _)] = c.deliveries()
    c.send(1, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=True))
    c.recv()
    assert get_raw(h, c, "qq") == fp.with_delivery_count(hp, 1)


@pytest.mark.parametrize(
    "value",
    [_d(1e308), _d(1e39), Field.longstr(b"\xff"), Field(DECIMAL, b"\x00\x80\0\0\0")],
)
def test_version_7_still_refuses_what_pamqp_cannot_write_again(value: Field) -> None:
    for version, codes in ((7, [501]), (8, [])):
        _h, c = opened(version)
        publish_raw(c, "", "src", content_header(Table([("v", value)]), 1), b"x")
        got = closes(c)
        assert [m.reply_code for m in got] == codes
        if codes:
            assert "malformed content header" in got[0].reply_text


def test_floats_pamqp_cuts_are_accepted_at_version_7_and_cut_as_before() -> None:
    """A double inside float32 range passed version 7's check: its dead-lettered copy carries
    pamqp's 32-bit float; version 8's carries the double."""
    for version, want in ((7, Field.of(FLOAT, 1.1)), (8, _d(1.1))):
        h, c = opened(version)
        publish_raw(c, "", "src", content_header(Table([("v", _d(1.1))]), 1), b"x")
        c.send(1, C.Basic.Get(queue="src"))
        [(got, _)] = c.deliveries()
        c.send(1, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=False))
        dead = get_raw(h, c, "dead")
        assert decode_table(dead, *fp.property_span(dead, F_HEADERS))[0].get("v") == want


# What RabbitMQ 3.10.8 wrote, measured on a private node (started as
# shared/bench/rabbitmq_baseline.sh describes; a raw-socket client published to the default
# exchange with routing key "<q>" to a queue "<q>" whose x-dead-letter-exchange is a fanout
# exchange, got the message, rejected it without requeue and read the dead-lettered copy's
# headers): an x-death that is not an array (a long 5, a long string, a table) is replaced by
# an array of one new entry, in this order, and no x-first-death-* header is written; a message
# without x-death gets x-first-death-* whatever it had (a publisher's x-first-death-reason is
# overwritten); one whose x-death is an array without them gets none. (RabbitMQ also sorts
# the headers by name, which we do not: every other header stays where it was.)
def _rabbitmq_reset_entry(queue: str, now_ms: int) -> Table:
    return Table(
        [
            ("count", Field.long(1)),
            ("reason", Field.longstr("rejected")),
            ("queue", Field.longstr(queue)),
            ("time", Field.timestamp(now_ms // 1000)),
            ("exchange", Field.longstr("")),
            ("routing-keys", Field.array([Field.longstr(queue)])),
        ]
    )


def _reject_to_dead(h: Harness, c: Client, table: Table) -> Table:
    publish_raw(c, "", "src", content_header(table, 1), b"x")
    assert not closes(c)
    c.send(1, C.Basic.Get(queue="src"))
    [(got, _)] = c.deliveries()
    c.send(1, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=False))
    dead = get_raw(h, c, "dead")
    start, end = fp.property_span(dead, F_HEADERS)
    return decode_table(dead, start, end)[0]


@pytest.mark.parametrize(
    "xdeath",
    [
        Field.of(LONG, 5),
        Field.longstr("str"),
        Field.table(Table([("count", Field.of(LONG, 3))])),
    ],
    ids=["long", "string", "table"],
)
def test_an_x_death_that_is_not_an_array_is_reset_as_rabbitmq_3_10_8_does(xdeath: Field) -> None:
    h, c = opened(8)
    before = Table([("a", Field.of(LONG, 7)), ("x-death", xdeath), ("b", Field.longstr("z"))])
    after = _reject_to_dead(h, c, before)
    want = Table(
        [
            ("a", Field.of(LONG, 7)),
            ("x-death", Field.array([Field.table(_rabbitmq_reset_entry("src", 5_000_000))])),
            ("b", Field.longstr("z")),
        ]
    )
    assert after == want


def test_an_x_death_that_is_not_an_array_keeps_x_first_death() -> None:
    h, c = opened(8)
    after = _reject_to_dead(
        h,
        c,
        Table([("x-death", Field.of(LONG, 5)), ("x-first-death-reason", Field.longstr("keep"))]),
    )
    assert [k for k, _ in after] == ["x-death", "x-first-death-reason"]
    assert after.get("x-first-death-reason") == Field.longstr("keep")


def test_without_x_death_x_first_death_is_written_over_a_publishers() -> None:
    h, c = opened(8)
    after = _reject_to_dead(h, c, Table([("x-first-death-reason", Field.longstr("keep"))]))
    assert [k for k, _ in after] == [
        "x-first-death-reason",
        "x-death",
        "x-first-death-queue",
        "x-first-death-exchange",
    ]
    assert after.get("x-first-death-reason") == Field.longstr("rejected")
    assert after.get("x-first-death-queue") == Field.longstr("src")
    assert after.get("x-first-death-exchange") == Field.longstr("")


def test_an_x_death_array_without_x_first_death_gets_none() -> None:
    h, c = opened(8)
    other = Field.table(
        Table(
            [
                ("count", Field.of(LONG, 2)),
                ("queue", Field.longstr("elsewhere")),
                ("reason", Field.longstr("expired")),
            ]
        )
    )
    after = _reject_to_dead(h, c, Table([("x-death", Field.array([other]))]))
    assert [k for k, _ in after] == ["x-death"]
    deaths = after.get("x-death").value  # type: ignore[union-attr]
    assert deaths[1:] == [other]  # type: ignore[index]
    entry = deaths[0].value  # type: ignore[index]
    assert [k for k, _ in entry] == ["count", "exchange", "queue", "reason", "routing-keys", "time"]

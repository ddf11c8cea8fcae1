"""Headers exchanges at model version 8 (``EXACT_FIELD_TABLES``): the message's headers are read
with our codec (``wire/fieldtable.py``) and compared with a binding's arguments as RabbitMQ
3.10.8's ``rabbit_exchange_type_headers`` compares them (``model/routing/exchange.py``,
``headers_match_exact``). At model version 7 routing is what it was (pamqp's values, Python's
``==``).

``RABBITMQ_3_10_8`` is what a RabbitMQ 3.10.8 node answered (measured 2026-11-28 on a private
node started as ``shared/bench/rabbitmq_baseline.sh`` describes, with a raw-socket client: for
each case a headers exchange, one queue bound with the binding's arguments as written below,
one message published with the headers below, then basic.get on the queue)."""

from __future__ import annotations

import fractions
import math
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands as C
from pamqp import decode as pdecode

from cpgbroker.model.broker import Broker
from cpgbroker.model.entities import Message
from cpgbroker.model.routing.exchange import (
    Exchange,
    exact_spec,
    headers_match_exact,
    sorted_headers,
)
from cpgbroker.wire import fieldtable as ft
from cpgbroker.wire.fieldtable import (
    BOOL,
    BYTE_ARRAY,
    DECIMAL,
    DOUBLE,
    FLOAT,
    LONG,
    SHORT,
    SIGNED_INT,
    VOID,
    Field,
    Table,
)
from cpgbroker.wire.framer import frame
from modelclient import Client, Harness


def L(n: int) -> Field:
    return Field.of(LONG, n)


def S(s: str | bytes) -> Field:
    return Field.longstr(s)


def D(x: float) -> Field:
    return Field.of(DOUBLE, x)


def dec(scale: int, mantissa: int) -> Field:
    return Field(DECIMAL, struct.pack(">BI", scale, mantissa))


def T(entries: list[tuple[str, Field]]) -> Table:
    return Table(entries)


NAN = Field(DOUBLE, b"\x7f\xf8\x00\x00\x00\x00\x00\x00")

# (name, binding arguments, message headers, routed on RabbitMQ 3.10.8)
RABBITMQ_3_10_8: list[tuple[str, Table, Table, bool]] = [
    ("long 1 / short 1", T([("n", L(1))]), T([("n", Field.of(SHORT, 1))]), True),
    ("long 1 / double 1.0", T([("n", L(1))]), T([("n", D(1.0))]), True),
    ("long 1 / bool true", T([("n", L(1))]), T([("n", Field.of(BOOL, True))]), False),
    ("longstr / byte array", T([("s", S("abc"))]), T([("s", Field.of(BYTE_ARRAY, b"abc"))]), True),
    ("long 5 / timestamp 5", T([("t", L(5))]), T([("t", Field.timestamp(5))]), True),
    (
        "long / timestamp above 2**32",
        T([("t", L(5_000_000_000))]),
        T([("t", Field.timestamp(5_000_000_000))]),
        True,
    ),
    ("decimal 2**32-1", T([("d", dec(2, 2**32 - 1))]), T([("d", dec(2, 2**32 - 1))]), True),
    ("decimal 1.0 / 1", T([("d", dec(1, 10))]), T([("d", dec(0, 1))]), False),
    ("decimal 1 / long 1", T([("d", dec(0, 1))]), T([("d", L(1))]), False),
    (
        "table of long / of short",
        T([("n", Field.table(T([("a", L(1))])))]),
        T([("n", Field.table(T([("a", Field.of(SHORT, 1))])))]),
        False,
    ),
    (
        "same table",
        T([("n", Field.table(T([("a", L(1))])))]),
        T([("n", Field.table(T([("a", L(1))])))]),
        True,
    ),
    (
        "same array",
        T([("a", Field.array([L(1), S("x")]))]),
        T([("a", Field.array([L(1), S("x")]))]),
        True,
    ),
    (
        "array of long / of int",
        T([("a", Field.array([L(1)]))]),
        T([("a", Field.array([Field.of(SIGNED_INT, 1)]))]),
        False,
    ),
    ("double 1.1 / float 1.1", T([("f", D(1.1))]), T([("f", Field.of(FLOAT, 1.1))]), False),
    ("double 1.5 / float 1.5", T([("f", D(1.5))]), T([("f", Field.of(FLOAT, 1.5))]), True),
    ("a header twice, 2 then 1", T([("k", L(1))]), T([("k", L(2)), ("k", L(1))]), False),
    ("a header twice, 1 then 2", T([("k", L(1))]), T([("k", L(1)), ("k", L(2))]), True),
    ("-0.0 / long 0", T([("z", D(-0.0))]), T([("z", L(0))]), True),
    ("void: presence", T([("v", Field(VOID, b""))]), T([("v", L(3))]), True),
    ("2**53+1 / double 2**53", T([("b", L(2**53 + 1))]), T([("b", D(float(2**53)))]), False),
    ("not UTF-8", T([("s", S(b"\xff\xfe"))]), T([("s", S(b"\xff\xfe"))]), True),
    (
        "all-with-x",
        T([("x-match", S("all-with-x")), ("x-k", S("v"))]),
        T([("x-k", S("v"))]),
        True,
    ),
    ("x- names ignored", T([("x-k", S("v"))]), T([("y", L(1))]), True),
    (
        "any of two",
        T([("x-match", S("any")), ("a", L(1)), ("b", L(2))]),
        T([("b", L(2))]),
        True,
    ),
    ("double 1e308", T([("d", D(1e308))]), T([("d", D(1e308))]), True),
]

# Measured too: a NaN double in the headers closes the publishing connection on RabbitMQ 3.10.8
# (its parser has no clause for it: function_clause in rabbit_binary_parser:parse_table at
# basic.publish, the socket closed without a connection.close). Here the message is accepted
# (issue 33) and a NaN equals nothing: only a void binding value (presence) matches it.
OURS_ONLY: list[tuple[str, Table, Table, bool]] = [
    ("NaN / long 1", T([("n", L(1))]), T([("n", NAN)]), False),
    ("NaN / NaN", T([("n", NAN)]), T([("n", NAN)]), False),
    ("NaN / void", T([("n", Field(VOID, b""))]), T([("n", NAN)]), True),
    ("NaN elsewhere", T([("n", L(1))]), T([("n", L(1)), ("z", NAN)]), True),
]


def binding_args(table: Table) -> dict[str, Any]:
    """The arguments as the model keeps them: pamqp's decoding of the client's table."""
    return dict(pdecode.field_table(table.encode())[1])


def message(headers: Table | None) -> Message:
    flags = 0x2000 if headers is not None else 0
    header = struct.pack(">HHQH", 60, 0, 1, flags) + (
        headers.encode() if headers is not None else b""
    )
    span = (14, len(header)) if headers is not None else None
    return Message(1, "hx", "", header, b"x", 1, None, span)


def routed(args: Table, headers: Table, sent: bool = True) -> bool:
    """Matched at model version 8, the binding made by a client (``sent``: its table kept)
    or not (federation's, the management API's, one made at version 7: pamqp's values)."""
    spec = exact_spec(binding_args(args), args if sent else None)
    return headers_match_exact(spec, sorted_headers(message(headers).header_table()))


@pytest.mark.parametrize(
    ("args", "headers", "want"),
    [pytest.param(a, h, w, id=n) for n, a, h, w in RABBITMQ_3_10_8 + OURS_ONLY],
)
def test_version_8_matches_as_rabbitmq_3_10_8(args: Table, headers: Table, want: bool) -> None:
    assert routed(args, headers) is want


# A binding kept only as pamqp's values (made at version 7, or by federation or the
# management API) lost the field types inside arrays and tables: there it matches as RabbitMQ
# but for these.
WITHOUT_TYPES = {"table of long / of short", "array of long / of int"}


@pytest.mark.parametrize(
    ("name", "args", "headers", "want"),
    [pytest.param(n, a, h, w, id=n) for n, a, h, w in RABBITMQ_3_10_8 + OURS_ONLY],
)
def test_version_8_matches_a_binding_without_its_table(
    name: str, args: Table, headers: Table, want: bool
) -> None:
    assert routed(args, headers, sent=False) is (want ^ (name in WITHOUT_TYPES))


# ------------------------------------------------------------------ through the model


def bind_raw(c: Client, queue: str, exchange: str, args: Table) -> None:
    q, ex = queue.encode(), exchange.encode()
    method = (
        struct.pack(">HHH", 50, 20, 0)
        + bytes((len(q),))
        + q
        + bytes((len(ex),))
        + ex
        + b"\x00\x00"  # routing key "", nowait off
        + args.encode()
    )
    c.send_raw(frame(1, 1, method))


def publish_raw(c: Client, exchange: str, headers: Table) -> None:
    ex = exchange.encode()
    method = struct.pack(">HHH", 60, 40, 0) + bytes((len(ex),)) + ex + b"\x00\x00"
    hp = struct.pack(">HHQH", 60, 0, 1, 0x2000) + headers.encode()
    c.send_raw(frame(1, 1, method) + frame(2, 1, hp) + frame(3, 1, b"x"))


def route_through_model(
    version: int, cases: list[tuple[str, Table, Table, bool]]
) -> dict[str, bool]:
    """Every case on its own headers exchange and queue of one broker: was it routed?"""
    h = Harness(Broker(version=version))
    h.tick(1_000_000)
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    out: dict[str, bool] = {}
    for i, (name, args, headers, _) in enumerate(cases):
        c.send(1, C.Exchange.Declare(exchange=f"hx{i}", exchange_type="headers"))
        c.send(1, C.Queue.Declare(queue=f"q{i}"))
        bind_raw(c, f"q{i}", f"hx{i}", args)
        publish_raw(c, f"hx{i}", headers)
        c.recv()
        c.send(1, C.Queue.Declare(queue=f"q{i}", passive=True))
        [ok] = [m for m in c.methods() if isinstance(m, C.Queue.DeclareOk)]
        out[name] = ok.message_count == 1
    assert not [m for m in c.methods() if isinstance(m, C.Channel.Close | C.Connection.Close)]
    return out


def test_version_8_routes_as_rabbitmq_through_the_model() -> None:
    cases = RABBITMQ_3_10_8 + OURS_ONLY
    assert route_through_model(8, cases) == {n: w for n, _, _, w in cases}


# What version 7 read (pamqp's values, Python's ==) where RabbitMQ differs, among the cases
# version 7 accepts at publish: kept as it was.
VERSION_7 = {
    "long 1 / bool true": True,  # True == 1
    "longstr / byte array": False,  # 'abc' != b'abc'
    "long 5 / timestamp 5": False,  # a datetime
    "decimal 1.0 / 1": True,  # Decimal('1.0') == Decimal('1')
    "decimal 1 / long 1": True,
    "table of long / of short": True,  # types lost
    "array of long / of int": True,
    "a header twice, 2 then 1": True,  # the last one
    "a header twice, 1 then 2": False,
}


def test_version_7_routes_as_it_did() -> None:
    cases = [c for c in RABBITMQ_3_10_8 if c[0] in VERSION_7]
    got = route_through_model(7, cases)
    assert got == VERSION_7
    assert all(VERSION_7[n] != w for n, _, _, w in cases)


def test_version_8_routes_edge_values_version_7_refused() -> None:
    """Headers version 7 refuses at publish route at version 8 as RabbitMQ would route them."""
    edge = T(
        [
            ("big", D(1e308)),
            ("one-point-one", D(1.1)),
            ("not-utf8", S(b"\xff\xfe")),
            ("dec", dec(2, 2**32 - 1)),
            ("ts", Field.timestamp(5_000_000_000)),
            ("nan", NAN),
            ("arr", Field.array([Field.array([D(1.1)])])),
        ]
    )
    cases = [
        ("each value", edge, edge, True),
        ("dec", T([("dec", dec(2, 2**32 - 1))]), edge, True),
        (
            "not-utf8 as a byte array",
            T([("not-utf8", Field.of(BYTE_ARRAY, b"\xff\xfe"))]),
            edge,
            True,
        ),
        ("ts as seconds", T([("ts", L(5_000_000_000))]), edge, True),
        ("ts as pamqp's milliseconds", T([("ts", L(5_000_000))]), edge, False),
        ("1.1 as a float", T([("one-point-one", Field.of(FLOAT, 1.1))]), edge, False),
        ("nested", T([("arr", Field.array([Field.array([D(1.1)])]))]), edge, True),
    ]
    # The binding of every edge value at once, but the NaN (which equals nothing).
    each = T([(k, f) for k, f in edge.entries if k != "nan"])
    cases[0] = ("each value", each, edge, True)
    assert route_through_model(8, cases) == {n: w for n, _, _, w in cases}


# ------------------------------------------------------------------ differential


_NUMERIC = {
    ft.BYTE,
    ft.UNSIGNED_BYTE,
    ft.SHORT,
    ft.UNSIGNED_SHORT,
    ft.SIGNED_INT,
    ft.UNSIGNED_INT,
    ft.LONG,
    ft.LONG_L,
    ft.TIMESTAMP,
    ft.FLOAT,
    ft.DOUBLE,
}
# RabbitMQ's type names: 'l' and 'L' are both long.
_RMQ_TYPE = {ft.LONG_L: ft.LONG}


def _erlang_eq(a: Field, b: Field) -> bool:
    """Erlang's ``==`` between two values as RabbitMQ's parser gives them, written from the
    Erlang reference, independently of the model's stand-ins: numbers exactly (as fractions),
    the rest by type and value."""
    if a.kind in _NUMERIC and b.kind in _NUMERIC:
        x, y = a.value, b.value
        assert isinstance(x, int | float) and isinstance(y, int | float)
        if isinstance(x, float) and not math.isfinite(x):
            return False
        if isinstance(y, float) and not math.isfinite(y):
            return False
        return fractions.Fraction(x) == fractions.Fraction(y)
    binaries = (ft.LONG_STRING, ft.BYTE_ARRAY)
    if a.kind in binaries and b.kind in binaries:
        return a.data[4:] == b.data[4:]
    if a.kind == ft.BOOL and b.kind == ft.BOOL:
        return a.value == b.value
    if a.kind == DECIMAL and b.kind == DECIMAL:
        return a.data == b.data
    voids = (ft.VOID, ft.VOID_0)
    return a.kind in voids and b.kind in voids


def rabbitmq_headers_match(args: Table, headers: Table) -> bool:
    """``rabbit_exchange_type_headers:headers_match/2`` of 3.10.8, clause by clause
    (recursion as in Erlang), on binding arguments without containers."""
    mode_f = args.get("x-match")
    mode = "all"
    if mode_f is not None and mode_f.kind == ft.LONG_STRING:
        m = mode_f.data[4:]
        mode = {b"any": "any", b"all-with-x": "all_with_x", b"any-with-x": "any_with_x"}.get(
            m, "all"
        )
    pattern = sorted(args.entries, key=lambda e: e[0].encode())
    data = sorted(headers.entries, key=lambda e: e[0].encode())

    def go(p: list[Any], d: list[Any], all_m: bool, any_m: bool) -> bool:
        if not all_m and mode in ("all", "all_with_x"):
            return False
        if any_m and mode in ("any", "any_with_x"):
            return True
        if not p:
            return all_m if mode in ("all", "all_with_x") else any_m
        pk, pf = p[0]
        if pk == "x-match":
            return go(p[1:], d, all_m, any_m)
        if pk.startswith("x-") and mode not in ("all_with_x", "any_with_x"):
            return go(p[1:], d, all_m, any_m)
        if not d:
            return go([], [], False, any_m)
        dk, df = d[0]
        if pk.encode() > dk.encode():
            return go(p, d[1:], all_m, any_m)
        if pk.encode() < dk.encode():
            return go(p[1:], d, False, any_m)
        if pf.kind == ft.VOID:
            return go(p[1:], d[1:], all_m, True)
        if _erlang_eq(pf, df):
            return go(p[1:], d[1:], all_m, True)
        return go(p[1:], d[1:], False, any_m)

    return go(pattern, data, True, False)


_names = st.sampled_from(["a", "b", "c", "x-a", "é"])


def _scalar(finite: bool) -> st.SearchStrategy[Field]:
    small = st.integers(-3, 3)
    return st.one_of(
        small.map(lambda n: Field.of(ft.BYTE, n)),
        st.integers(0, 3).map(lambda n: Field.of(ft.UNSIGNED_SHORT, n)),
        small.map(lambda n: Field.of(ft.SIGNED_INT, n)),
        (small | st.sampled_from([2**53, 2**53 + 1, -(2**63)])).map(L),
        st.integers(0, 3).map(Field.timestamp),
        st.sampled_from([0.0, -0.0, 1.0, 1.5, 2.0, float(2**53), 1e308]).map(D),
        st.sampled_from([0.0, 1.5, 1.1]).map(lambda x: Field.of(FLOAT, x)),
        st.sampled_from([b"", b"a", b"\xff"]).map(S),
        st.sampled_from([b"a", b"\xff"]).map(lambda b: Field.of(BYTE_ARRAY, b)),
        st.booleans().map(lambda b: Field.of(BOOL, b)),
        st.sampled_from([(0, 1), (1, 10), (2, 2**32 - 1)]).map(lambda sm: dec(*sm)),
        st.just(Field(VOID, b"")),
        *([] if finite else [st.just(NAN), st.just(D(math.inf))]),
    )


_modes = st.sampled_from(["all", "any", "all-with-x", "any-with-x", "other"])


@st.composite
def _binding(draw: st.DrawFn) -> Table:
    names = draw(st.lists(_names, unique=True, max_size=4))
    entries = [(n, draw(_scalar(finite=True))) for n in names]
    mode = draw(st.none() | _modes)
    if mode is not None:
        entries.insert(draw(st.integers(0, len(entries))), ("x-match", S(mode)))
    return Table(entries)


_headers = st.lists(st.tuples(_names, _scalar(finite=True)), max_size=6).map(Table)


@settings(max_examples=400, deadline=None)
@given(_binding(), _headers)
def test_version_8_agrees_with_rabbitmqs_algorithm(args: Table, headers: Table) -> None:
    """Random binding arguments (names once, as pamqp keeps them) and headers (names twice
    too): the model's matching equals a clause-by-clause transcription of RabbitMQ's."""
    assert routed(args, headers) is rabbitmq_headers_match(args, headers)


@settings(max_examples=150, deadline=None)
@given(st.lists(_binding(), min_size=1, max_size=8), st.lists(_headers, max_size=4))
def test_version_8_index_gives_what_a_scan_gives(bindings: list[Table], msgs: list[Table]) -> None:
    """The index by header name finds every binding that matches, in binding order, also
    after unbinding some."""
    ex = Exchange("hx", "/", "headers", False, False, False, {})
    dests = [SimpleNamespace(name=f"q{i}") for i in range(len(bindings))]
    for i, (d, t) in enumerate(zip(dests, bindings, strict=True)):
        # A client's binding keeps its table; others (federation's, the API's) do not.
        ex.bind(d, "", binding_args(t), t if i % 2 else None)  # type: ignore[arg-type]
    for round_ in range(2):
        for t in msgs:
            m = message(t)
            data = sorted_headers(m.header_table())
            scan = [
                b.dest
                for b in ex.bindings
                if headers_match_exact(exact_spec(b.args, b.table), data)
            ]
            assert ex.match("", m, exact=True) == scan
        if round_ == 0:
            for b in list(ex.bindings)[::2]:
                ex.unbind(b.dest, b.key, b.args)


def test_a_message_without_headers() -> None:
    assert headers_match_exact(exact_spec({}), [])
    assert headers_match_exact(exact_spec({"x-match": "any-with-x"}), []) is False
    assert headers_match_exact(exact_spec({"a": None}), []) is False
    assert message(None).header_table() == Table()


# ------------------------------------------------------------------ replicated


def test_a_clients_binding_table_survives_snapshot_and_restore_at_version_8_only() -> None:
    """The table a client bound with is replicated state at version 8 (snapshots, the store,
    hot standby's definitions): a restored replica routes alike. At version 7 nothing is kept,
    so snapshots stay release 0.1.0's."""
    from cpgbroker.model.state import snapshot as Snap

    args = T([("n", Field.table(T([("a", L(1))])))])
    for version in (7, 8):
        h = Harness(Broker(version=version))
        h.tick(1_000_000)
        c = h.connect(1)
        c.handshake()
        c.channel(1)
        c.send(1, C.Exchange.Declare(exchange="hx", exchange_type="headers"))
        c.send(1, C.Queue.Declare(queue="q"))
        bind_raw(c, "q", "hx", args)
        c.recv()
        restored = Snap.restore(Snap.snapshot(h.broker))
        assert Snap.digest(restored) == Snap.digest(h.broker)
        [b] = restored.vhosts["/"].exchanges["hx"].bindings
        [orig] = h.broker.vhosts["/"].exchanges["hx"].bindings
        assert b.table == orig.table == (args if version == 8 else None)
        short = message(T([("n", Field.table(T([("a", Field.of(SHORT, 1))])))]))
        for broker in (h.broker, restored):
            got = broker.vhosts["/"].exchanges["hx"].match("", short, exact=True)
            assert [q.name for q in got] == ([] if version == 8 else ["q"])  # type: ignore[union-attr]

"""Our field-table codec (``wire/fieldtable.py``, model version 8) on random tables: decoding
and encoding again gives the same bytes, its values agree with pamqp's decoder (where pamqp
reads a type as RabbitMQ does), ``check_table`` accepts everything it writes, it is total on
any bytes, and dead-lettering and quorum redelivery at version 8 keep every header they do not
change byte for byte."""

from __future__ import annotations

import datetime
import decimal
import math
import struct
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import decode as pdecode

from cpgbroker.model.entities import Message
from cpgbroker.model.routing.deadletter import dead_letter_header_exact, is_cycle_exact
from cpgbroker.wire import fastpath as fp
from cpgbroker.wire import fieldtable as ft
from cpgbroker.wire.fieldtable import Field, Table, decode_table
from cpgbroker.wire.tables import TableError, check_table

# The largest timestamp pamqp (and so check_table) takes: read as milliseconds above 2**32,
# it must stay within year 9999.
MAX_TIMESTAMP = 253402300799999
_FIXED_SIZES = {
    ft.BOOL: 1,
    ft.BYTE: 1,
    ft.UNSIGNED_BYTE: 1,
    ft.SHORT: 2,
    ft.UNSIGNED_SHORT: 2,
    ft.SIGNED_INT: 4,
    ft.UNSIGNED_INT: 4,
    ft.LONG: 8,
    ft.LONG_L: 8,
    ft.FLOAT: 4,
    ft.DOUBLE: 8,
    ft.DECIMAL: 5,
}


def _raw(kind: int, size: int) -> st.SearchStrategy[Field]:
    """Any bits: NaNs with payloads, subnormals, boolean octets other than 0 and 1."""
    return st.binary(min_size=size, max_size=size).map(lambda b: Field(kind, b))


def scalars(any_timestamp: bool = False) -> st.SearchStrategy[Field]:
    ts = (
        st.integers(0, 2**64 - 1)
        if any_timestamp
        else st.integers(0, 2**32 - 1) | st.integers(2**32, MAX_TIMESTAMP)
    )
    return st.one_of(
        *(_raw(kind, size) for kind, size in _FIXED_SIZES.items()),
        st.floats(allow_nan=True).map(lambda x: Field.of(ft.DOUBLE, x)),
        st.floats(width=32).map(lambda x: Field.of(ft.FLOAT, x)),
        ts.map(Field.timestamp),
        st.binary(max_size=12).map(Field.longstr),
        st.text(max_size=6).map(Field.longstr),
        st.binary(max_size=12).map(lambda b: Field.of(ft.BYTE_ARRAY, b)),
        st.sampled_from([Field.of(ft.VOID, None), Field.of(ft.VOID_0, None)]),
    )


# Names from a small set too, so that tables name a key twice and carry x-death-like entries.
names = st.sampled_from(["a", "b", "x-death", "count", "queue", "reason"]) | st.text(max_size=6)


def _table_of(values: st.SearchStrategy[Field], size: int = 5) -> st.SearchStrategy[Table]:
    return st.lists(st.tuples(names, values), max_size=size).map(Table)


def fields(any_timestamp: bool = False) -> st.SearchStrategy[Field]:
    return st.recursive(
        scalars(any_timestamp),
        lambda inner: (
            st.lists(inner, max_size=4).map(Field.array) | _table_of(inner).map(Field.table)
        ),
        max_leaves=25,
    )


def tables(any_timestamp: bool = False) -> st.SearchStrategy[Table]:
    return _table_of(fields(any_timestamp), size=8)


def rebuilt(f: Field) -> Field:
    """``f`` decoded all the way down and written again from its parts."""
    if f.kind == ft.ARRAY:
        return Field.array([rebuilt(x) for x in f.value])  # type: ignore[union-attr]
    if f.kind == ft.TABLE:
        t = f.value
        assert isinstance(t, Table)
        return Field.table(Table((k, rebuilt(v)) for k, v in t))
    return Field(f.kind, f.data)


@given(tables(any_timestamp=True))
def test_decode_then_encode_gives_the_same_bytes(table: Table) -> None:
    buf = table.encode()
    got, end = decode_table(buf)
    assert end == len(buf)
    assert got == table
    assert got.encode() == buf
    assert rebuilt(Field.table(got)).data == buf


def _leaves(f: Field) -> list[Field]:
    if f.kind == ft.ARRAY:
        return [x for item in f.value for x in _leaves(item)]  # type: ignore[union-attr]
    if f.kind == ft.TABLE:
        return [x for _k, v in f.value for x in _leaves(v)]  # type: ignore[union-attr]
    return [f]


@given(tables(any_timestamp=True))
def test_values_write_back_as_they_were_read(table: Table) -> None:
    """A scalar's value, written again with its type, is the same bytes: but for a boolean
    octet other than 0 and 1 (read as true) and a 32-bit NaN (a signalling one comes back
    quiet through a double), which only the bytes keep."""
    for leaf in _leaves(Field.table(table)):
        if leaf.kind == ft.BOOL and leaf.data not in (b"\x00", b"\x01"):
            continue
        v = leaf.value
        if leaf.kind == ft.FLOAT and isinstance(v, float) and math.isnan(v):
            continue
        assert Field.of(leaf.kind, v) == leaf


def _as_pamqp(f: Field) -> Any:
    """The value pamqp 4's decoder gives for ``f``, from ours."""
    v = f.value
    if f.kind == ft.LONG_STRING:
        assert isinstance(v, bytes)
        try:
            return v.decode()
        except UnicodeDecodeError:
            return v
    if f.kind == ft.BYTE_ARRAY:
        return bytearray(v)  # type: ignore[arg-type]
    if f.kind == ft.TIMESTAMP:
        assert isinstance(v, int)
        return datetime.datetime.fromtimestamp(v / 1000.0 if v > 0xFFFFFFFF else v, tz=datetime.UTC)
    if f.kind == ft.DECIMAL:
        # Ours reads the mantissa unsigned (the spec's long-uint, RabbitMQ's After:32/unsigned);
        # pamqp 4 reads it signed: the same below 2**31.
        scale, mantissa = struct.unpack(">BI", f.data)
        assert v == decimal.Decimal(mantissa).scaleb(-scale)
        if mantissa >= 2**31:
            mantissa -= 2**32
        return decimal.Decimal(mantissa) * (decimal.Decimal(10) ** -scale)
    if f.kind == ft.ARRAY:
        return [_as_pamqp(x) for x in v]  # type: ignore[union-attr]
    if f.kind == ft.TABLE:
        return {k: _as_pamqp(x) for k, x in v}  # type: ignore[union-attr]
    return v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@given(tables())
def test_values_agree_with_pamqps_decoder(table: Table) -> None:
    buf = table.encode()
    theirs = pdecode.field_table(buf)[1]
    ours = _as_pamqp(Field.table(decode_table(buf)[0]))
    assert _same(ours, theirs), (ours, theirs)


@given(tables())
def test_check_table_accepts_every_table_we_write(table: Table) -> None:
    buf = table.encode()
    assert check_table(buf, 0, len(buf)) == len(buf)


@given(st.binary(max_size=200))
@settings(max_examples=500)
def test_decoding_any_bytes_gives_a_table_or_a_table_error(data: bytes) -> None:
    buf = struct.pack(">I", len(data)) + data
    try:
        accepted = check_table(buf, 0, len(buf)) == len(buf)
    except TableError:
        accepted = False
    try:
        table, end = decode_table(buf)
        whole = rebuilt(Field.table(table))
    except TableError:
        assert not accepted
        return
    assert end == len(buf)
    assert whole.data == buf


# ------------------------------------------------------------------ what the model does with it


def _content_header(table: Table | None, expiration: bytes | None) -> bytes:
    flags, props = 0x8000 | 0x1000, b"\x04text"
    if table is not None:
        flags |= 0x2000
        props += table.encode()
    props += b"\x01"
    if expiration is not None:
        flags |= 0x0100
        props += bytes((len(expiration),)) + expiration
    flags |= 0x0008
    props += b"\x03app"
    return struct.pack(">HHQH", 60, 0, 3, flags) + props


# x-death entries like RabbitMQ's and ours, for the queues and reasons the test dead-letters
# from (so that some count up), with counts of every type, extra and missing fields.
_integers = st.one_of(*(_raw(kind, _FIXED_SIZES[kind]) for kind in sorted(ft.INTEGER_KINDS)))
death_entries = st.builds(
    lambda queue, reason, count, extra: Field.table(
        Table([*extra, queue, reason, *([("count", count)] if count else [])])
    ),
    st.tuples(st.just("queue"), st.sampled_from(["q", "a"]).map(Field.longstr)),
    st.tuples(st.just("reason"), st.sampled_from(["expired", "rejected"]).map(Field.longstr)),
    st.none() | _integers | st.just(Field.long(2**63 - 1)) | scalars(),
    st.lists(
        st.tuples(st.sampled_from(["time", "original-expiration", "extra"]), scalars()),
        max_size=3,
    ),
)
xdeaths = (
    st.lists(death_entries, min_size=1, max_size=3).map(Field.array)
    | st.lists(death_entries | fields(), max_size=4).map(Field.array)
    | fields()
)


def _matching_entry(headers: Table, queue: str, reason: str) -> Table | None:
    """The x-death entry dead-lettering from ``queue`` for ``reason`` counts up, if any."""
    deaths = headers.get("x-death")
    if deaths is None or deaths.kind != ft.ARRAY:
        return None
    for d in deaths.value:  # type: ignore[union-attr]
        if d.kind == ft.TABLE:
            t = d.value
            if t.get("queue") == Field.longstr(queue) and t.get("reason") == Field.longstr(reason):
                return t  # type: ignore[no-any-return]
    return None


def _with_x_death(args: tuple[Table, Field, int]) -> Table:
    table, xdeath, at = args
    table.entries.insert(min(at, len(table)), ("x-death", xdeath))
    return table


def _last(table: Table, name: str) -> int:
    return max((i for i, (k, _) in enumerate(table) if k == name), default=-1)


@given(
    st.tuples(tables(), xdeaths, st.integers(0, 8)).map(_with_x_death) | st.none() | tables(),
    st.none() | st.from_regex(r"\A[0-9]{1,5}\Z").map(str.encode),
    st.sampled_from(["q", "a"]),
    st.sampled_from(["expired", "rejected"]),
    st.integers(0, 2**50),
)
@settings(max_examples=300)
def test_dead_lettering_keeps_every_header_it_does_not_change(
    table: Table | None, expiration: bytes | None, queue: str, reason: str, now_ms: int
) -> None:
    hp = _content_header(table, expiration)
    info = fp.parse_content_header(hp, roundtrip=False)
    msg = Message(1, "ex", "rk", hp, b"abc", 1, None, info.headers_span)
    q: Any = SimpleNamespace(name=queue)
    dead = dead_letter_header_exact(msg, q, reason, now_ms)
    out = fp.parse_content_header(dead, roundtrip=False)
    assert out.expiration is None and out.delivery_mode == 1 and out.body_size == 3
    assert out.headers_span is not None
    after = decode_table(dead, *out.headers_span)[0]
    before = table or Table()
    replaced = _last(before, "x-death")
    for i, entry in enumerate(before):
        if i != replaced:
            assert after.entries[i] == entry
    deaths = after.get("x-death")
    assert deaths is not None and deaths.kind == ft.ARRAY
    front = deaths.value[0]  # type: ignore[index]
    assert front.kind == ft.TABLE
    entry = front.value
    assert entry.get("queue") == Field.longstr(queue)
    assert entry.get("reason") == Field.longstr(reason)
    assert entry.get("time") == Field.timestamp(now_ms // 1000)
    old = _matching_entry(before, queue, reason)
    found = before.get("x-death")
    if found is not None and found.kind != ft.ARRAY:
        # Replaced as RabbitMQ 3.10.8 replaces it (measured, tests/unit/test_deadletter_exact.py),
        # the x-first-death ones untouched.
        want = [
            ("count", Field.long(1)),
            ("reason", Field.longstr(reason)),
            ("queue", Field.longstr(queue)),
            ("time", Field.timestamp(now_ms // 1000)),
            ("exchange", Field.longstr("ex")),
            ("routing-keys", Field.array([Field.longstr("rk")])),
        ]
        if expiration is not None:
            want.append(("original-expiration", Field.longstr(expiration)))
        assert entry == Table(want)
        assert deaths.value == [front]
        for k in ("x-first-death-reason", "x-first-death-queue", "x-first-death-exchange"):
            assert after.get(k) == before.get(k)
    elif old is None:
        want = [
            ("count", Field.long(1)),
            ("exchange", Field.longstr("ex")),
            ("queue", Field.longstr(queue)),
            ("reason", Field.longstr(reason)),
            ("routing-keys", Field.array([Field.longstr("rk")])),
            ("time", Field.timestamp(now_ms // 1000)),
        ]
        if expiration is not None:
            want.insert(2, ("original-expiration", Field.longstr(expiration)))
        assert entry == Table(want)
    else:
        n = old.get("count")
        counted = n.value + 1 if n is not None and n.kind in ft.INTEGER_KINDS else 1
        assert entry.get("count") == Field.long(min(counted, 2**63 - 1))  # type: ignore[operator]
        for k, f in old:
            if k not in ("count", "time"):
                assert (k, f) in entry.entries
        if expiration is not None and old.get("original-expiration") is None:
            assert entry.entries[-1] == ("original-expiration", Field.longstr(expiration))
    # The copy's own cycle check reads it; a rejection never makes a cycle.
    assert is_cycle_exact(dead, queue) == (reason != "rejected")


@given(st.none() | tables(), st.integers(1, 2**63 - 1))
@settings(max_examples=300)
def test_redelivery_sets_x_delivery_count_and_keeps_the_rest(
    table: Table | None, count: int
) -> None:
    hp = _content_header(table, None)
    patched = fp.with_delivery_count(hp, count, exact=True)
    out = fp.parse_content_header(patched, roundtrip=False)
    assert out.headers_span is not None
    after = decode_table(patched, *out.headers_span)[0]
    before = table or Table()
    i = _last(before, "x-delivery-count")
    want = Table(before.entries)
    want.set("x-delivery-count", Field.long(count))
    assert after == want
    if i < 0:
        assert after.entries[-1] == ("x-delivery-count", Field.long(count))

"""Totality of the codec: whatever bytes a client sends end in normal processing or an AMQP
close with the spec's reply code, never an exception out of ``Broker.apply``; owner and shadow
replicas agree. A few seconds of the structured fuzzer (``bench/fuzz_bench.py`` runs a million
cases) and hypothesis properties of the table checker and the content-header parser, with pamqp
as the oracle."""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands as C
from pamqp import decode, encode
from pamqp import header as H

from cpgbroker.model.entities import Message
from cpgbroker.model.routing.deadletter import (
    dead_letter_header,
    dead_letter_header_exact,
    is_cycle,
    is_cycle_exact,
)
from cpgbroker.wire.fastpath import parse_content_header, with_delivery_count
from cpgbroker.wire.tables import MAX_TABLE_DEPTH, TableError, check_table
from modelclient import Fuzzer, deep_table


def test_the_fuzzer_finds_nothing_in_a_few_seconds() -> None:
    result = Fuzzer(seed=7, reset_every=200).run(seconds=3.0)
    assert result["cases"] > 500
    assert not result["crashes"], result["first_crashes"]


@given(st.binary(max_size=200))
@settings(max_examples=400)
def test_any_bytes_are_a_table_pamqp_decodes_or_a_table_error(data: bytes) -> None:
    buf = struct.pack(">I", len(data)) + data
    for roundtrip in (False, True):
        try:
            end = check_table(buf, 0, len(buf), roundtrip=roundtrip)
        except TableError:
            continue
        assert end == len(buf)
        table = decode.field_table(buf)[1]
        if roundtrip:
            encode.field_table(table)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(width=32, allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10).map(bytearray)
)
tables = st.recursive(
    st.dictionaries(st.text(max_size=5), scalars, max_size=4),
    lambda inner: st.dictionaries(st.text(max_size=5), inner | st.lists(inner, max_size=3)),
    max_leaves=20,
)


@given(tables)
def test_tables_pamqp_encodes_are_accepted(table: dict[str, Any]) -> None:
    buf = encode.field_table(table)
    assert check_table(buf, 0, len(buf), roundtrip=True) == len(buf)


@pytest.mark.parametrize("depth", [MAX_TABLE_DEPTH - 1, MAX_TABLE_DEPTH])
def test_tables_at_the_depth_limit_decode(depth: int) -> None:
    buf = deep_table(depth)
    check_table(buf, 0, len(buf))
    decode.field_table(buf)


@pytest.mark.parametrize("depth", [MAX_TABLE_DEPTH + 1, 5000])
def test_deeper_tables_are_refused_without_recursion(depth: int) -> None:
    buf = deep_table(depth)
    with pytest.raises(TableError, match="nested deeper"):
        check_table(buf, 0, len(buf))


def _dead_letter(hdr: bytes, span: tuple[int, int] | None) -> None:
    msg = Message(1, "ex", "rk", hdr, b"", 1, None, span)
    dead = dead_letter_header(msg, SimpleNamespace(name="q"), "expired", 0)  # type: ignore[arg-type]
    is_cycle(dead, "q")
    msg.headers()
    with_delivery_count(hdr, 3)


def _dead_letter_exact(hdr: bytes) -> None:
    """Model version 8: whatever the parser accepts without pamqp's round trip survives the
    exact dead-lettering and redelivery, and their results parse again."""
    try:
        info = parse_content_header(hdr, roundtrip=False)
    except (ValueError, IndexError):
        return
    msg = Message(1, "ex", "rk", hdr, b"", 1, None, info.headers_span)
    dead = dead_letter_header_exact(msg, SimpleNamespace(name="q"), "expired", 0)  # type: ignore[arg-type]
    parse_content_header(dead, roundtrip=False)
    is_cycle_exact(dead, "q")
    msg.headers()
    parse_content_header(with_delivery_count(hdr, 3, exact=True), roundtrip=False)


@given(st.binary(max_size=80))
@settings(max_examples=400)
def test_any_content_header_is_refused_or_survives_everything_done_later(props: bytes) -> None:
    hdr = struct.pack(">HHQ", 60, 0, 0) + props
    _dead_letter_exact(hdr)
    try:
        info = parse_content_header(hdr)
    except (ValueError, IndexError):
        return
    ch = H.ContentHeader()
    ch.unmarshal(hdr)
    _dead_letter(hdr, info.headers_span)


@given(st.binary(max_size=60), st.sampled_from([0x2000, 0x2040, 0xA000, 0x3000]))
@settings(max_examples=400)
def test_any_headers_table_is_refused_or_survives_everything_done_later(
    table: bytes, flags: int
) -> None:
    props = b""
    if flags & 0x8000:
        props += b"\x04text"
    props += struct.pack(">I", len(table)) + table
    if flags & 0x1000:
        props += b"\x02"
    if flags & 0x0040:
        props += struct.pack(">Q", 1_700_000_000)
    hdr = struct.pack(">HHQH", 60, 0, 0, flags) + props
    _dead_letter_exact(hdr)
    try:
        info = parse_content_header(hdr)
    except ValueError:
        return
    _dead_letter(hdr, info.headers_span)


def test_pamqp_properties_survive_the_parser() -> None:
    props = C.Basic.Properties(
        content_type="a/b", headers={"x": [1, {"y": "é"}]}, delivery_mode=2, app_id="ü"
    )
    hdr = bytes(H.ContentHeader(0, 3, props).marshal())
    info = parse_content_header(hdr)
    assert info.headers_span is not None and info.delivery_mode == 2

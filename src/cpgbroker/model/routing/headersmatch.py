"""Headers exchanges at model version 8 (``versions.EXACT_FIELD_TABLES``): a message's headers
read with our codec (``wire/fieldtable.py``) and compared with a binding's arguments as
RabbitMQ 3.10.8's ``rabbit_exchange_type_headers`` compares them. Pure functions:
``model/routing/exchange.py`` keeps the bindings and their index and calls :func:`exact_spec` when
it binds and :func:`headers_match_exact` when it routes (version 7 matches with pamqp's values,
``exchange.headers_match``).
"""

from __future__ import annotations

import datetime
import decimal
from typing import Any

from cpgbroker.wire.fieldtable import (
    ARRAY,
    BOOL,
    BYTE_ARRAY,
    DECIMAL,
    DOUBLE,
    FLOAT,
    INTEGER_KINDS,
    LONG_L,
    LONG_STRING,
    TABLE,
    TIMESTAMP,
    VOID,
    VOID_0,
    Field,
    Table,
)

#
# RabbitMQ 3.10.8 (``rabbit_exchange_type_headers``, read) sorts the binding's arguments and the
# message's headers by name (stably: a name given twice keeps its order) and walks both at
# once: ``x-match`` is always skipped, other names starting with ``x-`` unless x-match is
# ``all-with-x`` or ``any-with-x``; a header the binding does not name is passed over; a name
# the message lacks fails ``all``; a void binding value asks for presence only; other values
# match when Erlang's ``==`` holds between the two *values*, whatever their field types. So
# (measured on a RabbitMQ 3.10.8 node): a long 1 matches a short 1, a double 1.0 and a timestamp
# 1, not a boolean true; a long string matches a byte array of the same bytes; a decimal matches
# only a decimal of the same scale and mantissa (1.0 is not 1); a double 1.1 does not match the
# 32-bit float 1.1 (read as 1.100000023841858); -0.0 matches 0; 2**53+1 does not match the
# double 2**53 (numbers compare exactly); arrays and tables match only with the same field
# types inside (a table {a: long 1} does not match {a: short 1}); and with a header given twice
# the binding's value is compared with the first of them in the walk (its first on the wire),
# the second one then with the binding's next name. An x-match other than those four long
# strings reads as ``all``.
#
# Values here are Python stand-ins on which ``==`` is Erlang's: integers (every integer type
# and timestamps) and floats as such (Python compares int and float exactly, as Erlang's ``==``
# does); booleans, decimals, arrays and tables as tagged tuples, long strings and byte arrays
# as bytes; a void as None. NaN (which RabbitMQ 3.10.8 cannot read at all: its parser has no
# clause for a non-finite double, and the publishing connection is closed) equals nothing.
#
# A binding a client made at model version 8 keeps the arguments it sent (``Binding.table``,
# replicated), read with our codec: values inside arrays and tables compare with their field
# types, as RabbitMQ's (``l`` and ``L`` are both ``long`` there). A binding without them (made
# at version 7, or by federation or the management API) is matched from its arguments as pamqp
# decoded them (or as JSON gave them), which lost the types inside arrays and tables: there
# integers of any width compare as one type, 32- and 64-bit floats as one, long strings and
# byte arrays as one; and a timestamp argument above 2**32 that is a whole number of seconds
# reads as seconds.

_TAG_BOOL = "t"
_TAG_DECIMAL = "D"
_TAG_ARRAY = "A"
_TAG_TABLE = "F"

# The type classes values inside arrays and tables are compared with (see above).
_CLASS_OF_KIND: dict[int, str] = {k: "int" for k in INTEGER_KINDS}
_CLASS_OF_KIND.update(
    {
        TIMESTAMP: "T",
        FLOAT: "float",
        DOUBLE: "float",
        BOOL: "t",
        DECIMAL: "D",
        LONG_STRING: "bin",
        BYTE_ARRAY: "bin",
        ARRAY: "A",
        TABLE: "F",
    }
)

_VOID_BINDING = object()  # a binding value that asks for the header's presence only
_VOID_KINDS = (VOID, VOID_0)
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MATCH_MODES = ("all", "any", "all-with-x", "any-with-x")

# (x-match any, -with-x, typed, the binding's names and values sorted by name)
ExactSpec = tuple[bool, bool, bool, tuple[tuple[str, Any], ...]]


# RabbitMQ's types (``rabbit_binary_parser``), which values inside arrays and tables compare
# with when the binding's own table is known.
_TYPE_OF_KIND: dict[int, str] = {k: chr(k) for k in _CLASS_OF_KIND}
_TYPE_OF_KIND[LONG_L] = "l"


def _erl_field(f: Field, typed: bool = True) -> Any:
    """The stand-in of a header value (our codec's :class:`Field`); inside arrays and tables
    with RabbitMQ's field types (``typed``) or only their classes (a binding from pamqp's
    values)."""
    kind = f.kind
    if kind == BOOL:
        return (_TAG_BOOL, f.value)
    if kind == DECIMAL:
        data = f.data
        return (_TAG_DECIMAL, data[0], int.from_bytes(data[1:5], "big"))
    if kind in (LONG_STRING, BYTE_ARRAY):
        return f.data[4:]
    if kind in (ARRAY, TABLE):
        types = _TYPE_OF_KIND if typed else _CLASS_OF_KIND
        inner = f.value
        if isinstance(inner, Table):
            return (
                _TAG_TABLE,
                tuple([(k, types.get(x.kind, "V"), _erl_field(x, typed)) for k, x in inner]),
            )
        assert isinstance(inner, list)
        return (_TAG_ARRAY, tuple([(types.get(x.kind, "V"), _erl_field(x, typed)) for x in inner]))
    return f.value  # integers, timestamps, floats; None for a void


def _timestamp_seconds(dt: datetime.datetime) -> int:
    """The u64 pamqp read into ``dt``: seconds, or milliseconds where it read them (above
    2**32), as far as the datetime tells (module comment)."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.UTC)
    us = (dt - _EPOCH) // datetime.timedelta(microseconds=1)
    if us % 1_000_000 == 0 and 0 <= us // 1_000_000 <= 0xFFFFFFFF:
        return us // 1_000_000
    return (us + 500) // 1000


def _decimal_key(v: decimal.Decimal) -> Any:
    sign, digits, exponent = v.as_tuple()
    if not isinstance(exponent, int):
        return object()  # not a value a decimal field holds: equal to nothing
    mantissa = int("".join(map(str, digits)) or "0")
    if exponent > 0:
        mantissa *= 10**exponent
        exponent = 0
    # pamqp reads the mantissa as a signed 32-bit integer: its bits are the unsigned one sent.
    return (_TAG_DECIMAL, -exponent, (-mantissa if sign else mantissa) & 0xFFFFFFFF)


def _erl_py(v: Any) -> Any:
    """The stand-in of a binding argument value (as pamqp decoded it, or as the management
    API's JSON gave it)."""
    if isinstance(v, bool):
        return (_TAG_BOOL, v)
    if isinstance(v, (int, float)) or v is None:
        return v
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, decimal.Decimal):
        return _decimal_key(v)
    if isinstance(v, datetime.datetime):
        return _timestamp_seconds(v)
    if isinstance(v, (list, tuple)):
        return (_TAG_ARRAY, tuple([(_class_of_py(x), _erl_py(x)) for x in v]))
    if isinstance(v, dict):
        return (
            _TAG_TABLE,
            tuple([(str(k), _class_of_py(x), _erl_py(x)) for k, x in v.items()]),
        )
    return object()  # nothing a field table decodes to: equal to nothing


def _class_of_py(v: Any) -> str:
    if isinstance(v, bool):
        return "t"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, (str, bytes, bytearray, memoryview)):
        return "bin"
    if isinstance(v, decimal.Decimal):
        return "D"
    if isinstance(v, datetime.datetime):
        return "T"
    if isinstance(v, (list, tuple)):
        return "A"
    if isinstance(v, dict):
        return "F"
    return "V"


def exact_spec(args: dict[str, Any], table: Table | None = None) -> ExactSpec:
    """A binding's arguments as model version 8 matches them, as RabbitMQ's ``parse_x_match``
    and sorted table: from the client's ``table`` when known, else from ``args``."""
    if table is not None:
        x_match = table.get("x-match")
        raw = x_match.long_string() if x_match is not None else None
        mode = raw.decode("utf-8", "replace") if raw is not None else "all"
        entries = [(k, _VOID_BINDING if f.kind in _VOID_KINDS else _erl_field(f)) for k, f in table]
    else:
        m = args.get("x-match")
        mode = m if isinstance(m, str) else "all"
        entries = [(k, _VOID_BINDING if v is None else _erl_py(v)) for k, v in args.items()]
    if mode not in _MATCH_MODES:
        mode = "all"
    pattern = tuple(sorted(entries, key=_name))
    return (mode.startswith("any"), mode.endswith("-with-x"), table is not None, pattern)


def exact_names(spec: ExactSpec) -> list[str] | None:
    """The header names a message must have one of to match ``spec`` (for all, its first
    compared name; for any, each); None when every message matches (all, nothing compared)."""
    want_any, with_x, _, pattern = spec
    names = [k for k, _ in pattern if k != "x-match" and (with_x or not k.startswith("x-"))]
    if not names:
        return [] if want_any else None
    # A name given twice is one bucket.
    return list(dict.fromkeys(names)) if want_any else names[:1]


def _name(entry: tuple[str, Any]) -> str:
    # Names sort as RabbitMQ sorts binaries: bytewise, which for UTF-8 is code point order.
    return entry[0]


def sorted_headers(headers: Table) -> list[tuple[str, Field]]:
    """A message's headers as RabbitMQ matches them: sorted by name, stably."""
    return sorted(headers.entries, key=_name)


def headers_match_exact(spec: ExactSpec, data: list[tuple[str, Field]]) -> bool:
    """RabbitMQ 3.10.8's ``headers_match`` (module comment): ``spec`` from :func:`exact_spec`,
    ``data`` from :func:`sorted_headers`."""
    want_any, with_x, typed, pattern = spec
    all_ok, any_ok = True, False
    i = j = 0
    np_, nd = len(pattern), len(data)
    while True:
        if want_any:
            if any_ok:
                return True
        elif not all_ok:
            return False
        if i == np_:
            return any_ok if want_any else all_ok
        pk, pv = pattern[i]
        if pk == "x-match" or (not with_x and pk.startswith("x-")):
            i += 1
            continue
        if j == nd:
            # No more headers: every name still to compare fails.
            return any_ok if want_any else False
        dk, field = data[j]
        if pk > dk:
            j += 1
            continue
        if pk < dk:
            all_ok = False
            i += 1
            continue
        if pv is _VOID_BINDING or pv == _erl_field(field, typed):
            any_ok = True
        else:
            all_ok = False
        i += 1
        j += 1

"""Field tables kept byte for byte: our own codec for AMQP 0-9-1 tables and arrays (model
version 8, ``model/versions.py`` ``EXACT_FIELD_TABLES``).

Theory of operation
-------------------
The broker changes a client's ``headers`` in two places: dead-lettering counts up or adds an
``x-death`` entry (``model/routing/deadletter.py``), and a quorum queue's redelivery sets
``x-delivery-count`` (``wire/fastpath.py``). Model version 7 decoded the whole table with
pamqp and had pamqp write it again, which is lossy: pamqp writes every float as a 32-bit
``f`` (a double 1.1 comes back 1.100000023841858, 4.9e-324 comes back 0.0, 1e308 cannot be
written at all), every integer in the smallest type that holds it, a long string that is not
UTF-8 not at all, and it sorts the keys and keeps one of two equal ones. So version 7 refused at
publish what it could not write again (``tables.check_table(roundtrip=True)``).

Here a table decodes into its entries in wire order, ``(name, Field)``, duplicates kept, and a
:class:`Field` is a type octet and *the bytes that followed it on the wire* (for a long string,
a byte array, an array or a table: its u32 length and contents). Its Python value
(:attr:`Field.value`) is computed from those bytes on demand, an array's or a table's one level
at a time: nothing is decoded that the broker does not look at, nothing is ever re-encoded
that it did not change, so what it leaves alone comes out identical, bit for bit (a NaN's
payload, a boolean octet of 2, an ``L``, a type octet 0 included). What the broker writes
itself it builds with the constructors below, in the types RabbitMQ 3.10.8's own
``rabbit_dead_letter`` writes them.

The types are those ``tables.check_table`` accepts: RabbitMQ's (``rabbit_binary_parser``:
``t b B s u I i l L f d D S x A F T V``, where ``L`` reads as a *signed* 64-bit integer like
``l``, ``t`` is true for any non-zero octet and a decimal is an unsigned 32-bit mantissa with
an 8-bit scale) and pamqp's octet 0, a void "seen in the wild".

Values (:attr:`Field.value`): ``t`` bool; ``b B s u I i l L`` int; ``f d`` float; ``D``
:class:`decimal.Decimal` (exact: mantissa and exponent as sent); ``S x`` bytes (AMQP long
strings are bytes: no UTF-8 is required of them); ``T`` int (the u64 as sent: seconds in the
spec; pamqp's datetime reads a value above 2**32 as milliseconds); ``V`` and 0 None; ``A`` a
list of :class:`Field`; ``F`` a :class:`Table`.

Decoding is total: malformed bytes raise :class:`~cpgbroker.wire.tables.TableError` and
nothing else. It checks one level at a time (a container's contents when its value is asked
for) and needs no recursion; tables the broker decodes were accepted by ``check_table`` at
publish, whole and within its depth and size limits, before they were stored.
"""

from __future__ import annotations

import decimal
import struct
from collections.abc import Iterable, Iterator
from typing import TypeAlias

from cpgbroker.wire.tables import _SIZE_LIST, TableError

# Type octets (as RabbitMQ names them).
BOOL = ord("t")
BYTE = ord("b")
UNSIGNED_BYTE = ord("B")
SHORT = ord("s")
UNSIGNED_SHORT = ord("u")
SIGNED_INT = ord("I")
UNSIGNED_INT = ord("i")
LONG = ord("l")
LONG_L = ord("L")  # read as a signed 64-bit integer, like 'l'
FLOAT = ord("f")
DOUBLE = ord("d")
DECIMAL = ord("D")
LONG_STRING = ord("S")
BYTE_ARRAY = ord("x")
ARRAY = ord("A")
TABLE = ord("F")
TIMESTAMP = ord("T")
VOID = ord("V")
VOID_0 = 0  # pamqp's void ("seen in the wild")

INTEGER_KINDS = frozenset(
    {BYTE, UNSIGNED_BYTE, SHORT, UNSIGNED_SHORT, SIGNED_INT, UNSIGNED_INT, LONG, LONG_L}
)

_U32 = struct.Struct(">I")
_u32 = _U32.unpack_from
_DECIMAL = struct.Struct(">BI")
# Fixed-size scalars and how their bytes read and write.
_STRUCTS: dict[int, struct.Struct] = {
    BOOL: struct.Struct(">B"),
    BYTE: struct.Struct(">b"),
    UNSIGNED_BYTE: struct.Struct(">B"),
    SHORT: struct.Struct(">h"),
    UNSIGNED_SHORT: struct.Struct(">H"),
    SIGNED_INT: struct.Struct(">i"),
    UNSIGNED_INT: struct.Struct(">I"),
    LONG: struct.Struct(">q"),
    LONG_L: struct.Struct(">q"),
    FLOAT: struct.Struct(">f"),
    DOUBLE: struct.Struct(">d"),
    TIMESTAMP: struct.Struct(">Q"),
}
_VOIDS = (VOID, VOID_0)
_LENGTH_PREFIXED = (LONG_STRING, BYTE_ARRAY, ARRAY, TABLE)

Value: TypeAlias = "bool | int | float | decimal.Decimal | bytes | list[Field] | Table | None"


class Field:
    """One typed value: its type octet (``kind``) and the bytes that follow it on the wire
    (``data``; for ``S x A F`` the u32 length included). Immutable by convention: a changed
    value is a new Field."""

    __slots__ = ("data", "kind")

    def __init__(self, kind: int, data: bytes) -> None:
        self.kind = kind
        self.data = data

    def __repr__(self) -> str:
        return f"Field({chr(self.kind)!r}, {self.data!r})"

    def __eq__(self, other: object) -> bool:
        # Equal encodings: NaN equals itself here, 1.0 as 'f' differs from 1.0 as 'd'.
        if not isinstance(other, Field):
            return NotImplemented
        return self.kind == other.kind and self.data == other.data

    def __hash__(self) -> int:
        return hash((self.kind, self.data))

    def encode(self) -> bytes:
        """The type octet and the value's bytes, as on the wire."""
        return bytes((self.kind,)) + self.data

    @property
    def value(self) -> Value:
        """The value in Python (module docstring); containers one level deep."""
        kind, data = self.kind, self.data
        st = _STRUCTS.get(kind)
        if st is not None:
            v = st.unpack(data)[0]
            return bool(v) if kind == BOOL else v
        if kind in (LONG_STRING, BYTE_ARRAY):
            return data[4:]
        if kind == ARRAY:
            return decode_array(data)
        if kind == TABLE:
            return decode_table(data)[0]
        if kind == DECIMAL:
            scale, mantissa = _DECIMAL.unpack(data)
            return decimal.Decimal(f"{mantissa}E-{scale}")
        return None  # V, 0

    def long_string(self) -> bytes | None:
        """The bytes of a long string (``S``), None for a value of any other type: what
        RabbitMQ's dead-lettering compares queue names and reasons with."""
        return self.data[4:] if self.kind == LONG_STRING else None

    # -- the values the broker writes itself

    @classmethod
    def of(cls, kind: int, value: Value) -> Field:
        """``value`` written as type ``kind`` (:attr:`value`'s types; a bool or 0/1 for
        ``t``). Raises ``ValueError`` for a value the type cannot hold."""
        st = _STRUCTS.get(kind)
        try:
            if st is not None:
                if kind == BOOL:
                    return cls(kind, b"\x01" if value else b"\x00")
                if kind not in (FLOAT, DOUBLE) and (
                    isinstance(value, bool) or not isinstance(value, int)
                ):
                    raise ValueError(f"{chr(kind)} takes an int, not {type(value).__name__}")
                return cls(kind, st.pack(value))
            if kind in _VOIDS:
                if value is not None:
                    raise ValueError("a void holds nothing")
                return cls(kind, b"")
            if kind in (LONG_STRING, BYTE_ARRAY):
                if not isinstance(value, bytes):
                    raise ValueError(f"{chr(kind)} takes bytes, not {type(value).__name__}")
                return cls(kind, _U32.pack(len(value)) + value)
            if kind == ARRAY:
                if not isinstance(value, list):
                    raise ValueError(f"A takes a list of Field, not {type(value).__name__}")
                return cls.array(value)
            if kind == TABLE:
                if not isinstance(value, Table):
                    raise ValueError(f"F takes a Table, not {type(value).__name__}")
                return cls(kind, value.encode())
            if kind == DECIMAL:
                if not isinstance(value, decimal.Decimal):
                    raise ValueError(f"D takes a Decimal, not {type(value).__name__}")
                return cls(kind, _encode_decimal(value))
        except (struct.error, OverflowError) as e:
            raise ValueError(f"{chr(kind)} cannot hold {value!r}: {e}") from None
        raise ValueError(f"unknown field value type 0x{kind:02x}")

    @classmethod
    def long(cls, n: int) -> Field:
        """A signed 64-bit integer (``l``)."""
        return cls(LONG, _STRUCTS[LONG].pack(n))

    @classmethod
    def longstr(cls, s: str | bytes) -> Field:
        """A long string (``S``); text is written as UTF-8."""
        b = s.encode() if isinstance(s, str) else s
        return cls(LONG_STRING, _U32.pack(len(b)) + b)

    @classmethod
    def timestamp(cls, seconds: int) -> Field:
        """A timestamp (``T``: u64 seconds since the epoch)."""
        return cls(TIMESTAMP, _STRUCTS[TIMESTAMP].pack(seconds))

    @classmethod
    def array(cls, items: Iterable[Field]) -> Field:
        """An array (``A``) of ``items``, each written as it is."""
        body = b"".join([f.encode() for f in items])
        return cls(ARRAY, _U32.pack(len(body)) + body)

    @classmethod
    def table(cls, table: Table) -> Field:
        """A table (``F``)."""
        return cls(TABLE, table.encode())


def _encode_decimal(value: decimal.Decimal) -> bytes:
    sign, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):
        raise ValueError(f"cannot write {value} as a decimal")
    mantissa = int("".join(map(str, digits)) or "0")
    if exponent > 0:
        mantissa *= 10**exponent
        exponent = 0
    if sign and mantissa:
        raise ValueError("a decimal's mantissa is unsigned")
    if -exponent > 255:
        raise ValueError("a decimal's scale is at most 255")
    return _DECIMAL.pack(-exponent, mantissa)


class Table:
    """A field table: its entries in wire order, a name that comes twice kept twice.

    A name's value is its *last* entry's, as pamqp and every dict-based client read a table
    (:meth:`get`, :meth:`set`); the entries before it stay as they were."""

    __slots__ = ("entries",)

    def __init__(self, entries: Iterable[tuple[str, Field]] = ()) -> None:
        self.entries: list[tuple[str, Field]] = list(entries)

    def __repr__(self) -> str:
        return f"Table({self.entries!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Table):
            return NotImplemented
        return self.entries == other.entries

    __hash__ = None  # type: ignore[assignment]

    def __iter__(self) -> Iterator[tuple[str, Field]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return any(k == name for k, _ in self.entries)

    def get(self, name: str) -> Field | None:
        """The value of ``name`` (its last entry), None without one."""
        for k, f in reversed(self.entries):
            if k == name:
                return f
        return None

    def set(self, name: str, field: Field) -> None:
        """``name``'s value becomes ``field``: in place of its last entry, else a new entry at
        the end."""
        entries = self.entries
        for i in range(len(entries) - 1, -1, -1):
            if entries[i][0] == name:
                entries[i] = (name, field)
                return
        entries.append((name, field))

    def encode(self) -> bytes:
        """The table as on the wire, u32 length first."""
        parts: list[bytes] = []
        for name, f in self.entries:
            key = name.encode()
            if len(key) > 255:
                raise ValueError(f"field name of {len(key)} bytes, more than a short string")
            parts += (bytes((len(key),)), key, bytes((f.kind,)), f.data)
        body = b"".join(parts)
        return _U32.pack(len(body)) + body


def _field_at(buf: bytes, p: int, end: int) -> tuple[Field, int]:
    """The value whose type octet is at ``buf[p]``, inside a container ending at ``end``."""
    kind = buf[p]
    size = _SIZE_LIST[kind]
    p += 1
    if size is None:
        raise TableError(f"unknown field value type 0x{kind:02x}")
    if kind in _LENGTH_PREFIXED:
        if p + 4 > end:
            raise TableError("field value length truncated")
        vend = p + 4 + _u32(buf, p)[0]
    else:
        vend = p + size
    if vend > end:
        raise TableError("field value runs past its table")
    return Field(kind, buf[p:vend]), vend


def decode_table(buf: bytes, pos: int = 0, limit: int | None = None) -> tuple[Table, int]:
    """The table whose u32 length is at ``buf[pos]`` and which ends by ``limit`` (default:
    the end of ``buf``): its entries, and the offset just past it. Raises
    :class:`TableError` for bytes that are not a table."""
    limit = len(buf) if limit is None else limit
    if pos + 4 > limit:
        raise TableError("field table length truncated")
    end = pos + 4 + _u32(buf, pos)[0]
    if end > limit:
        raise TableError("field table longer than the data that holds it")
    entries: list[tuple[str, Field]] = []
    p = pos + 4
    while p < end:
        kend = p + 1 + buf[p]
        if kend >= end:
            raise TableError("field table entry without a value")
        try:
            name = buf[p + 1 : kend].decode()
        except UnicodeDecodeError:
            raise TableError("field name is not UTF-8") from None
        field, p = _field_at(buf, kend, end)
        entries.append((name, field))
    return Table(entries), end


def decode_array(data: bytes) -> list[Field]:
    """The values of an array from its bytes (``data``: u32 length first, as
    :attr:`Field.data` holds it). Raises :class:`TableError`."""
    if len(data) < 4:
        raise TableError("field array length truncated")
    end = 4 + _u32(data, 0)[0]
    if end > len(data):
        raise TableError("field array longer than the data that holds it")
    items: list[Field] = []
    p = 4
    while p < end:
        field, p = _field_at(data, p, end)
        items.append(field)
    return items

"""Field tables checked before anyone decodes them: iteratively, with depth and size limits.

Theory of operation
-------------------
pamqp decodes field tables recursively (``field_table`` -> ``embedded_value`` ->
``field_table`` ...), slices the rest of the buffer at every value (quadratic in the number of
values) and trusts declared lengths that run past the end of the enclosing table. Fed a client's
bytes directly it can therefore raise ``RecursionError`` (whose depth depends on the stack of the
member that decodes, so replicas could disagree), ``OverflowError`` (a timestamp past year 9999)
or burn milliseconds on one frame. Every table a client sends is walked here first, with an
explicit stack: once :func:`check_table` accepts a table, pamqp decodes it without error, within
bounded depth and bounded work.

A table is accepted when every key is a short string of valid UTF-8, every value has a known
type and lies wholly inside its container, containers nest at most ``MAX_TABLE_DEPTH`` deep and
hold at most ``MAX_TABLE_VALUES`` values in all. With ``roundtrip`` (the ``headers`` of a
message at model version 7, whose dead-lettering and quorum redelivery decode *and re-encode*
them with pamqp), values pamqp decodes but cannot encode again are refused too: long strings
that are not UTF-8 (pamqp hands them out as ``bytes``, which it cannot encode), decimals whose
mantissa is above 2**31-1 (read unsigned, written signed) and doubles beyond single-precision
range (pamqp writes every float as a 32-bit ``f``). From model version 8 on the broker changes
headers with its own codec (``wire/fieldtable.py``), which keeps every value it does not change
byte for byte, and checks them without ``roundtrip``: every value the grammar allows passes.

Malformed input raises :class:`TableError`, a ``ValueError`` like the other wire decoders'; the
model turns it into the reply code of the frame it came in. A table over one of our limits raises
its subclass :class:`TableLimitError`: RabbitMQ would have decoded it, so the model can tell a
table it refuses by choice from bytes that cannot be decoded at all.

:func:`check_fields` walks a method's arguments the same way and returns where they end, so
that arguments cut short or followed by stray bytes are found as RabbitMQ finds them (its
decoder matches the whole argument binary, and refuses both).
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Sequence

# Nesting depth of tables and arrays, the outermost table counting 1. Real clients nest a few
# levels (x-death: headers -> array -> table -> array is 4); 100 leaves ample room while pamqp's
# recursive decoder (about 3 Python frames a level) and the snapshot encoder stay far below
# Python's recursion limit of 1000 on any member's stack.
MAX_TABLE_DEPTH = 100
# Values (at every depth) in one table. pamqp copies the rest of its buffer at each value, so the
# work of decoding a table grows with values x bytes: 4096 values in a frame_max (128 KiB) frame
# stay around a few ms, and no real client comes near (RabbitMQ's own x-death tables, CC/BCC
# lists of hundreds of routing keys).
MAX_TABLE_VALUES = 4096


class TableError(ValueError):
    """A field table that is malformed, over a limit, or (``roundtrip``) not re-encodable by
    pamqp."""


class TableLimitError(TableError):
    """A well-formed field table over ``MAX_TABLE_DEPTH`` or ``MAX_TABLE_VALUES``."""


_U32 = struct.Struct(">I")
_u32 = _U32.unpack_from
_Q = struct.Struct(">Q")
_D = struct.Struct(">d")
_F = struct.Struct(">f")

# Value sizes by type octet: >= 0 a fixed size; the negative kinds below; absent: unknown type.
_LONG = -1  # 'S' long string, 'x' byte array: u32 length + bytes
_ARRAY = -2
_TABLE = -3
_SIZES: dict[int, int] = {
    ord("t"): 1,
    ord("b"): 1,
    ord("B"): 1,
    ord("s"): 2,
    ord("u"): 2,
    ord("I"): 4,
    ord("i"): 4,
    ord("l"): 8,
    ord("L"): 8,
    ord("f"): 4,
    ord("d"): 8,
    ord("D"): 5,
    ord("T"): 8,
    ord("V"): 0,
    0: 0,  # pamqp reads a 0 octet as void ("seen in the wild")
    ord("S"): _LONG,
    ord("x"): _LONG,
    ord("A"): _ARRAY,
    ord("F"): _TABLE,
}
_SIZE_LIST = [_SIZES.get(i) for i in range(256)]
_T = ord("T")
_D_TYPE = ord("D")
_DOUBLE = ord("d")
_S = ord("S")


def check_timestamp(buf: bytes, p: int) -> None:
    """The u64 timestamp at ``p`` must be one pamqp can turn into a datetime (it reads values
    above 2**32 as milliseconds; the year must stay below 10000)."""
    ts = _Q.unpack_from(buf, p)[0]
    if ts > 0xFFFFFFFF:
        try:
            datetime.datetime.fromtimestamp(ts / 1000.0, tz=datetime.UTC)
        except (OverflowError, ValueError, OSError):
            raise TableError(f"timestamp {ts} out of range") from None


def check_table(buf: bytes, pos: int, limit: int, *, roundtrip: bool = False) -> int:
    """Check the field table whose u32 length is at ``buf[pos]`` and which must end by
    ``limit``; return the offset just past it. Raises :class:`TableError`."""
    if pos + 4 > limit:
        raise TableError("field table length truncated")
    end: int = pos + 4 + _u32(buf, pos)[0]
    if end > limit:
        raise TableError("field table longer than the data that holds it")
    sizes = _SIZE_LIST
    # Open containers: (end offset, is a table). Values never run past their container's end.
    stack: list[tuple[int, bool]] = [(end, True)]
    cend, is_table = end, True
    p = pos + 4
    values = 0
    while True:
        if p == cend:
            stack.pop()
            if not stack:
                return end
            cend, is_table = stack[-1]
            continue
        if is_table:
            klen = buf[p]
            kend = p + 1 + klen
            if kend >= cend:
                raise TableError("field table entry without a value")
            key = buf[p + 1 : kend]
            if not key.isascii():
                try:
                    key.decode()
                except UnicodeDecodeError:
                    raise TableError("field name is not UTF-8") from None
            p = kend
        t = buf[p]
        p += 1
        values += 1
        if values > MAX_TABLE_VALUES:
            raise TableLimitError(f"field table holds more than {MAX_TABLE_VALUES} values")
        size = sizes[t]
        if size is None:
            raise TableError(f"unknown field value type 0x{t:02x}")
        if size >= 0:
            vend = p + size
            if vend > cend:
                raise TableError("field value runs past its table")
            if t == _T:
                check_timestamp(buf, p)
            elif roundtrip:
                if t == _D_TYPE:
                    if _u32(buf, p + 1)[0] > 0x7FFFFFFF:
                        raise TableError("decimal mantissa above 2**31-1")
                elif t == _DOUBLE:
                    try:
                        _F.pack(_D.unpack_from(buf, p)[0])
                    except OverflowError:
                        raise TableError("double outside single-precision range") from None
            p = vend
            continue
        if p + 4 > cend:
            raise TableError("field value length truncated")
        vend = p + 4 + _u32(buf, p)[0]
        if vend > cend:
            raise TableError("field value runs past its table")
        if size == _LONG:
            if roundtrip and t == _S:
                s = buf[p + 4 : vend]
                if not s.isascii():
                    try:
                        s.decode()
                    except UnicodeDecodeError:
                        raise TableError("long string value is not UTF-8") from None
            p = vend
            continue
        if len(stack) >= MAX_TABLE_DEPTH:
            raise TableLimitError(f"field tables nested deeper than {MAX_TABLE_DEPTH}")
        cend, is_table = vend, size == _TABLE
        stack.append((cend, is_table))
        p += 4


def check_fields(types: Sequence[str], buf: bytes, p: int) -> int:
    """Walk a method's arguments (pamqp's type names, in order) from ``buf[p]`` and check every
    field table among them; bits pack as pamqp unpacks them. Returns the offset just past the
    last argument (the caller compares it with the payload's end). Raises :class:`TableError`
    for arguments that run past the end of ``buf``."""
    n = len(buf)
    bits = 8  # bits used in the current bit octet; 8: none open
    for t in types:
        if t == "bit":
            if bits == 8:
                if p >= n:
                    raise TableError("arguments truncated")
                p += 1
                bits = 0
            bits += 1
            continue
        bits = 8
        if t == "table":
            p = check_table(buf, p, n)
            continue
        if t == "shortstr":
            if p >= n:
                raise TableError("arguments truncated")
            p += 1 + buf[p]
        elif t == "longstr":
            if p + 4 > n:
                raise TableError("arguments truncated")
            p += 4 + _u32(buf, p)[0]
        elif t == "octet":
            p += 1
        elif t == "short":
            p += 2
        elif t == "long":
            p += 4
        elif t in ("longlong", "timestamp"):
            p += 8
        else:
            raise TableError(f"unknown argument type {t}")
        if p > n:
            raise TableError("arguments truncated")
    return p

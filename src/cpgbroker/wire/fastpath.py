"""Hand-written codecs for the per-message methods, with pamqp as their oracle.

Every member replays every client's bytes, so the cost of decoding basic.publish and
basic.ack/nack/reject and of encoding basic.deliver bounds the whole cluster. pamqp spends ~13 us
on a publish decode where ``struct.unpack_from`` takes ~1 us. The property tests compare each
function here with pamqp on generated input (``tests/property/test_fastpath.py``).

The method decoders are total: arguments that do not decode raise the connection error
RabbitMQ 3.10.8 answers with (:func:`cannot_decode`: 501 FRAME_ERROR, ``cannot decode`` and the
argument bytes, as its decoder reports a binary that does not match the method's layout, cut
short or with bytes after the last argument; :func:`malformed_utf8` for a short string that is
not UTF-8), and nothing else. ``decode_method`` (``model/clients/channel.py``) uses the same two for
the methods pamqp decodes. The content-header parser raises :class:`ValueError` (``IndexError``
for a property past the end), never ``struct.error`` (lengths are checked before unpacking);
the model turns that into 501 FRAME_ERROR.
"""

from __future__ import annotations

import struct

from cpgbroker.errors import ConnectionError_, ReplyCode
from cpgbroker.wire.fieldtable import Field, decode_table
from cpgbroker.wire.framer import FRAME_BODY, FRAME_END_BYTE, FRAME_HEADER, FRAME_METHOD
from cpgbroker.wire.tables import check_table, check_timestamp

BASIC_PUBLISH = 0x003C0028
BASIC_ACK = 0x003C0050
BASIC_REJECT = 0x003C005A
BASIC_NACK = 0x003C0078
BASIC_DELIVER = 0x003C003C
BASIC_GET_OK = 0x003C0047

_U8 = struct.Struct(">B")
_U32 = struct.Struct(">I")
_U64B = struct.Struct(">QB")
_HEAD = struct.Struct(">BHI")
_HEAD_IDX = struct.Struct(">BHII")
_CH_HDR = struct.Struct(">HHQH")
_unpack_u64b = _U64B.unpack_from


def method_index(payload: bytes) -> int:
    return int(_U32.unpack_from(payload, 0)[0])


# A reply text is a short string: RabbitMQ cuts a longer one to 252 bytes and "...".
_REPLY_TEXT_MAX = 255
_FRAME_ERROR_PREFIX = f"{ReplyCode.FRAME_ERROR.name} - "
# Argument bytes worth printing: more always makes the text longer than a short string holds.
_PRINTED_BYTES = _REPLY_TEXT_MAX // 2


def cannot_decode(payload: bytes) -> ConnectionError_:
    """The error for a method frame (``payload``: class and method id, then the arguments)
    whose arguments do not decode: RabbitMQ's 501 ``cannot decode <<...>>``, the argument bytes
    printed as Erlang prints a binary, the text cut as RabbitMQ cuts it."""
    index = method_index(payload)
    shown = ",".join(map(str, payload[4 : 4 + _PRINTED_BYTES]))
    text = f"{_FRAME_ERROR_PREFIX}cannot decode <<{shown}>>"
    if len(text) > _REPLY_TEXT_MAX:  # all ASCII: characters are bytes
        text = text[: _REPLY_TEXT_MAX - 3] + "..."
    return ConnectionError_(
        ReplyCode.FRAME_ERROR,
        text[len(_FRAME_ERROR_PREFIX) :],
        class_id=index >> 16,
        method_id=index & 0xFFFF,
    )


def malformed_utf8(payload: bytes) -> ConnectionError_:
    """The error for a method frame with a short-string argument that is not UTF-8 (RabbitMQ's
    text; it names no method, we do)."""
    index = method_index(payload)
    return ConnectionError_(
        ReplyCode.FRAME_ERROR,
        "Malformed UTF-8 in shortstr",
        class_id=index >> 16,
        method_id=index & 0xFFFF,
    )


def decode_publish(payload: bytes) -> tuple[str, str, bool, bool]:
    """basic.publish arguments: ``(exchange, routing_key, mandatory, immediate)``."""
    # layout: u32 index | u16 ticket | shortstr exchange | shortstr routing-key | bits
    try:
        n = payload[6]
        p = 7 + n
        m = payload[p]
        q = p + 1 + m
        bits = payload[q]
    except IndexError:
        raise cannot_decode(payload) from None
    if len(payload) != q + 1:
        raise cannot_decode(payload)
    try:
        exchange = payload[7:p].decode()
        routing_key = payload[p + 1 : q].decode()
    except UnicodeDecodeError:
        raise malformed_utf8(payload) from None
    return exchange, routing_key, bool(bits & 1), bool(bits & 2)


def decode_ack(payload: bytes) -> tuple[int, bool]:
    """basic.ack arguments: ``(delivery_tag, multiple)``."""
    if len(payload) != 13:
        raise cannot_decode(payload)
    tag, bits = _unpack_u64b(payload, 4)
    return tag, bool(bits & 1)


def decode_nack(payload: bytes) -> tuple[int, bool, bool]:
    """basic.nack arguments: ``(delivery_tag, multiple, requeue)``."""
    if len(payload) != 13:
        raise cannot_decode(payload)
    tag, bits = _unpack_u64b(payload, 4)
    return tag, bool(bits & 1), bool(bits & 2)


def decode_reject(payload: bytes) -> tuple[int, bool]:
    """basic.reject arguments: ``(delivery_tag, requeue)``."""
    if len(payload) != 13:
        raise cannot_decode(payload)
    tag, bits = _unpack_u64b(payload, 4)
    return tag, bool(bits & 1)


def _shortstr(s: str) -> bytes:
    b = s.encode()
    if len(b) > 255:
        raise ValueError("short string longer than 255 bytes")
    return _U8.pack(len(b)) + b


def encode_deliver(
    channel: int,
    consumer_tag: bytes,
    delivery_tag: int,
    redelivered: bool,
    exchange: bytes,
    routing_key: bytes,
) -> bytes:
    """A complete basic.deliver method frame. Short strings arrive pre-encoded (cached per
    consumer and per message) so the hot path does no str -> bytes work."""
    args = b"".join(
        (
            _U8.pack(len(consumer_tag)),
            consumer_tag,
            _U64B.pack(delivery_tag, 1 if redelivered else 0),
            _U8.pack(len(exchange)),
            exchange,
            _U8.pack(len(routing_key)),
            routing_key,
        )
    )
    return (
        _HEAD_IDX.pack(FRAME_METHOD, channel, len(args) + 4, BASIC_DELIVER) + args + FRAME_END_BYTE
    )


def encode_get_ok(
    channel: int,
    delivery_tag: int,
    redelivered: bool,
    exchange: bytes,
    routing_key: bytes,
    message_count: int,
) -> bytes:
    args = b"".join(
        (
            _U64B.pack(delivery_tag, 1 if redelivered else 0),
            _U8.pack(len(exchange)),
            exchange,
            _U8.pack(len(routing_key)),
            routing_key,
            _U32.pack(message_count),
        )
    )
    return (
        _HEAD_IDX.pack(FRAME_METHOD, channel, len(args) + 4, BASIC_GET_OK) + args + FRAME_END_BYTE
    )


def encode_ack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """basic.ack from the broker (publisher confirms)."""
    return (
        _HEAD_IDX.pack(FRAME_METHOD, channel, 13, BASIC_ACK)
        + _U64B.pack(delivery_tag, 1 if multiple else 0)
        + FRAME_END_BYTE
    )


def encode_nack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """basic.nack from the broker (publisher confirms: the message was refused)."""
    return (
        _HEAD_IDX.pack(FRAME_METHOD, channel, 13, BASIC_NACK)
        + _U64B.pack(delivery_tag, 1 if multiple else 0)
        + FRAME_END_BYTE
    )


def encode_content(channel: int, header_payload: bytes, body: bytes, frame_max: int) -> bytes:
    """Content header frame (the payload as given: the client's own bytes, not re-encoded, or
    a dead-letter or redelivery copy of them) and body frames split to the receiving
    connection's ``frame_max``."""
    parts: list[bytes | memoryview] = [
        _HEAD.pack(FRAME_HEADER, channel, len(header_payload)),
        header_payload,
        FRAME_END_BYTE,
    ]
    size = len(body)
    if size:
        chunk = frame_max - 8
        if size <= chunk:
            parts += (_HEAD.pack(FRAME_BODY, channel, size), body, FRAME_END_BYTE)
        else:
            mv = memoryview(body)
            for off in range(0, size, chunk):
                piece = mv[off : off + chunk]
                parts += (_HEAD.pack(FRAME_BODY, channel, len(piece)), piece, FRAME_END_BYTE)
    return b"".join(parts)


# Property flag bits of basic's content header, highest first (spec 4.2.6.1 / pamqp order).
FLAG_CONTENT_TYPE = 1 << 15
FLAG_CONTENT_ENCODING = 1 << 14
FLAG_HEADERS = 1 << 13
FLAG_DELIVERY_MODE = 1 << 12
FLAG_PRIORITY = 1 << 11
FLAG_CORRELATION_ID = 1 << 10
FLAG_REPLY_TO = 1 << 9
FLAG_EXPIRATION = 1 << 8
FLAG_MESSAGE_ID = 1 << 7
FLAG_TIMESTAMP = 1 << 6
FLAG_TYPE = 1 << 5
FLAG_USER_ID = 1 << 4
FLAG_APP_ID = 1 << 3
FLAG_CLUSTER_ID = 1 << 2


class HeaderInfo:
    """What the broker needs from a content header; the rest stays in the client's bytes."""

    __slots__ = (
        "body_size",
        "class_id",
        "delivery_mode",
        "direct_reply_at",
        "expiration",
        "headers_span",
        "user_id",
    )

    def __init__(
        self,
        class_id: int,
        body_size: int,
        delivery_mode: int,
        expiration: str | None,
        user_id: str | None,
        headers_span: tuple[int, int] | None,
        direct_reply_at: int = -1,
    ) -> None:
        self.class_id = class_id
        self.body_size = body_size
        self.delivery_mode = delivery_mode
        self.expiration = expiration
        self.user_id = user_id
        self.headers_span = headers_span
        # Where the reply-to property starts (its length byte) when it is exactly RabbitMQ's
        # direct reply-to pseudo-queue, which the broker replaces; else -1.
        self.direct_reply_at = direct_reply_at


def header_priority(payload: bytes) -> int:
    """The ``priority`` property of a content header the broker already accepted (0 without
    one): only priority queues ask, once per message they take in."""
    flags = payload[12] << 8 | payload[13]
    if not flags & FLAG_PRIORITY:
        return 0
    p = 14
    if flags & FLAG_CONTENT_TYPE:
        p += 1 + payload[p]
    if flags & FLAG_CONTENT_ENCODING:
        p += 1 + payload[p]
    if flags & FLAG_HEADERS:
        p += 4 + _U32.unpack_from(payload, p)[0]
    if flags & FLAG_DELIVERY_MODE:
        p += 1
    return payload[p]


_DELIVERY_COUNT_KEY = b"\x10x-delivery-count"
_I64 = struct.Struct(">q")


def with_delivery_count(payload: bytes, count: int, *, exact: bool = False) -> bytes:
    """The content header ``payload`` with ``x-delivery-count: count`` (a signed 64-bit field,
    as RabbitMQ's quorum queues send it) set in its headers table, for the redelivery of a
    message that came back to a quorum queue. Patched rather than re-encoded by pamqp: a
    poison message may come back many times.

    A publisher that sent an ``x-delivery-count`` itself has it replaced: ``exact`` (model
    version 8) in place, every other byte of the table kept (``wire/fieldtable.py``); else
    (version 7) through pamqp, which writes the whole table again its own way (keys sorted,
    floats as 32 bits, integers in the smallest type, this one too)."""
    flags = payload[12] << 8 | payload[13]
    p = 14
    if flags & FLAG_CONTENT_TYPE:
        p += 1 + payload[p]
    if flags & FLAG_CONTENT_ENCODING:
        p += 1 + payload[p]
    field = _DELIVERY_COUNT_KEY + b"l" + _I64.pack(count)
    if not flags & FLAG_HEADERS:
        flags |= FLAG_HEADERS
        return b"".join(
            (
                payload[:12],
                bytes((flags >> 8, flags & 0xFF)),
                payload[14:p],
                _U32.pack(len(field)),
                field,
                payload[p:],
            )
        )
    size = _U32.unpack_from(payload, p)[0]
    end = p + 4 + size
    if _DELIVERY_COUNT_KEY in payload[p + 4 : end]:
        # The publisher sent one itself (rare; or the bytes are inside another value).
        if exact:
            exact_table = decode_table(payload, p, end)[0]
            exact_table.set("x-delivery-count", Field.long(count))
            return payload[:p] + exact_table.encode() + payload[end:]
        from pamqp import decode, encode

        table = decode.field_table(payload[p:end])[1]
        table["x-delivery-count"] = count
        return payload[:p] + encode.field_table(table) + payload[end:]
    return b"".join(
        (payload[:p], _U32.pack(size + len(field)), payload[p + 4 : end], field, payload[end:])
    )


# Basic's properties in wire order: each flag with its size (>= 0), or -1 for a short string
# and -4 for a table (their length prefix is one octet and four).
_PROPERTY_LAYOUT = (
    (FLAG_CONTENT_TYPE, -1),
    (FLAG_CONTENT_ENCODING, -1),
    (FLAG_HEADERS, -4),
    (FLAG_DELIVERY_MODE, 1),
    (FLAG_PRIORITY, 1),
    (FLAG_CORRELATION_ID, -1),
    (FLAG_REPLY_TO, -1),
    (FLAG_EXPIRATION, -1),
    (FLAG_MESSAGE_ID, -1),
    (FLAG_TIMESTAMP, 8),
    (FLAG_TYPE, -1),
    (FLAG_USER_ID, -1),
    (FLAG_APP_ID, -1),
    (FLAG_CLUSTER_ID, -1),
)


def property_span(payload: bytes, flag: int) -> tuple[int, int]:
    """Where property ``flag`` lies in a content header the broker accepted (its length
    prefix included): ``(start, end)``; ``start == end`` where it would go when it is not
    set. For the broker's own edits of a header (dead-lettering at model version 8)."""
    flags = payload[12] << 8 | payload[13]
    p = 14
    for f, size in _PROPERTY_LAYOUT:
        if f == flag:
            if not flags & f:
                return p, p
            if size == -1:
                return p, p + 1 + payload[p]
            if size == -4:
                return p, p + 4 + _U32.unpack_from(payload, p)[0]
            return p, p + size
        if flags & f:
            if size == -1:
                p += 1 + payload[p]
            elif size == -4:
                p += 4 + _U32.unpack_from(payload, p)[0]
            else:
                p += size
    raise ValueError(f"no property with flag 0x{flag:04x}")


def with_headers(payload: bytes, table: bytes) -> bytes:
    """The content header ``payload`` with ``table`` (an encoded field table, its u32 length
    first) as its headers, set or replaced; every other byte as it was. For the broker's own
    edits of a header from model version 8 (federation's hop, the management API's publish)."""
    flags = (payload[12] << 8 | payload[13]) | FLAG_HEADERS
    start, end = property_span(payload, FLAG_HEADERS)
    return b"".join(
        (payload[:12], bytes((flags >> 8, flags & 0xFF)), payload[14:start], table, payload[end:])
    )


_SHORTSTR_FLAGS = (
    FLAG_CONTENT_TYPE,
    FLAG_CONTENT_ENCODING,
    FLAG_CORRELATION_ID,
    FLAG_REPLY_TO,
    FLAG_EXPIRATION,
    FLAG_MESSAGE_ID,
    FLAG_TYPE,
    FLAG_USER_ID,
    FLAG_APP_ID,
    FLAG_CLUSTER_ID,
)


def _check_short_strings(payload: bytes, flags: int) -> None:
    """Every short-string property of a header whose layout already checked out must be UTF-8
    (pamqp decodes them when it dead-letters): the slow path, for headers that are not all
    ASCII."""
    p = 14
    for flag in (
        FLAG_CONTENT_TYPE,
        FLAG_CONTENT_ENCODING,
        FLAG_HEADERS,
        FLAG_DELIVERY_MODE,
        FLAG_PRIORITY,
        FLAG_CORRELATION_ID,
        FLAG_REPLY_TO,
        FLAG_EXPIRATION,
        FLAG_MESSAGE_ID,
        FLAG_TIMESTAMP,
        FLAG_TYPE,
        FLAG_USER_ID,
        FLAG_APP_ID,
        FLAG_CLUSTER_ID,
    ):
        if not flags & flag:
            continue
        if flag in _SHORTSTR_FLAGS:
            q = p + 1 + payload[p]
            payload[p + 1 : q].decode()
            p = q
        elif flag == FLAG_HEADERS:
            p += 4 + _U32.unpack_from(payload, p)[0]
        elif flag == FLAG_TIMESTAMP:
            p += 8
        else:
            p += 1


# RabbitMQ's direct reply-to pseudo-queue, as a reply-to property names it
# (model/routing/topology.py).
DIRECT_REPLY = b"amq.rabbitmq.reply-to"


def parse_content_header(payload: bytes, *, roundtrip: bool = True) -> HeaderInfo:
    """Walk the property list once, picking out the few fields routing and expiry need, and
    check everything that is later decoded (dead-lettering, quorum redelivery, headers
    exchanges): short strings in bounds and UTF-8, the timestamp in range, the headers table
    (:func:`~cpgbroker.wire.tables.check_table`, iterative, with limits). With ``roundtrip``
    (model version 7, whose dead-lettering and redelivery write headers again with pamqp) the
    table must also be one pamqp can write again; the model passes False from version 8 on
    (``wire/fieldtable.py`` keeps what it does not change byte for byte), and so may any
    caller for a header that was accepted already. Any malformed header raises
    :class:`ValueError` (``UnicodeDecodeError`` and ``TableError`` are ValueErrors) or
    ``IndexError`` (a property past the end), and nothing else (property tests check this for
    arbitrary bytes)."""
    n = len(payload)
    if n < 14:
        raise ValueError(f"content header of {n} bytes, shorter than its 14-byte fixed part")
    class_id, _weight, body_size, flags = _CH_HDR.unpack_from(payload, 0)
    if flags & 1:
        # More than 15 properties is never valid for class basic.
        raise ValueError("content header uses property flag continuation")
    p = 14
    delivery_mode = 0
    expiration: str | None = None
    user_id: str | None = None
    headers_span: tuple[int, int] | None = None
    if flags & FLAG_CONTENT_TYPE:
        p += 1 + payload[p]
    if flags & FLAG_CONTENT_ENCODING:
        p += 1 + payload[p]
    if flags & FLAG_HEADERS:
        end = check_table(payload, p, n, roundtrip=roundtrip)
        headers_span = (p, end)
        p = end
    if flags & FLAG_DELIVERY_MODE:
        delivery_mode = payload[p]
        p += 1
    if flags & FLAG_PRIORITY:
        p += 1
    if flags & FLAG_CORRELATION_ID:
        p += 1 + payload[p]
    direct_reply_at = -1
    if flags & FLAG_REPLY_TO:
        m = payload[p]
        if m == len(DIRECT_REPLY) and payload[p + 1 : p + 1 + m] == DIRECT_REPLY:
            direct_reply_at = p
        p += 1 + m
    if flags & FLAG_EXPIRATION:
        m = payload[p]
        expiration = payload[p + 1 : p + 1 + m].decode()
        p += 1 + m
    if flags & FLAG_MESSAGE_ID:
        p += 1 + payload[p]
    if flags & FLAG_TIMESTAMP:
        if p + 8 > n:
            raise ValueError("content header property runs past the frame")
        check_timestamp(payload, p)
        p += 8
    if flags & FLAG_TYPE:
        p += 1 + payload[p]
    if flags & FLAG_USER_ID:
        m = payload[p]
        user_id = payload[p + 1 : p + 1 + m].decode()
        p += 1 + m
    if flags & FLAG_APP_ID:
        p += 1 + payload[p]
    if flags & FLAG_CLUSTER_ID:
        p += 1 + payload[p]
    if p != n:
        # Also catches a short string running past the frame (slicing does not raise).
        raise ValueError("content header properties do not match their flags")
    if n > 14 and not payload[14:].isascii():
        # One test instead of one per string: the usual header (content-type, delivery-mode)
        # is all ASCII and needs no UTF-8 check.
        _check_short_strings(payload, flags)
    return HeaderInfo(
        class_id, body_size, delivery_mode, expiration, user_id, headers_span, direct_reply_at
    )

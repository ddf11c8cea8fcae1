"""AMQP 0-9-1 frame reader: bytes in, complete frames out, or a protocol error.

Theory of operation (h11 style): the caller feeds whatever bytes arrived with :meth:`feed`, then
calls :meth:`next_frame` until it returns ``None`` (need more data). A frame is only returned once
all of its ``7 + size + 1`` bytes are buffered; the size field is checked against ``frame_max``
*before* the payload is buffered, so a client cannot make us hold an oversized frame. Any input
either yields frames or raises :class:`~cpgbroker.errors.FrameError`; nothing else escapes (the
property tests check this for arbitrary bytes, whole and byte by byte).
"""

from __future__ import annotations

import struct

from cpgbroker.errors import FrameError, ReplyCode

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
FRAME_END_BYTE = b"\xce"
FRAME_TYPES = frozenset({FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT})

# The spec's floor: every peer must accept frames of this size, even before tuning.
FRAME_MIN_SIZE = 4096
# Header (type, channel, size) and the frame-end octet.
FRAME_OVERHEAD = 8

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"

_HEAD = struct.Struct(">BHI")
_unpack_head = _HEAD.unpack_from


class FrameReader:
    """Incremental frame parser for one connection.

    ``frame_max`` is the negotiated maximum frame size including the 8 bytes of overhead; it may
    be changed between calls (after connection.tune-ok).
    """

    __slots__ = ("_buf", "_pos", "frame_max")

    def __init__(self, frame_max: int) -> None:
        self._buf = bytearray()
        self._pos = 0
        self.frame_max = frame_max

    def feed(self, data: bytes) -> None:
        if self._pos:
            # Drop what was consumed before growing: keeps the buffer at most one frame + one read.
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    @property
    def pending(self) -> bytes:
        """Bytes received but not yet returned as a frame (a partial frame)."""
        return bytes(self._buf[self._pos :])

    def next_frame(self) -> tuple[int, int, bytes] | None:
        """Return ``(frame_type, channel, payload)`` or ``None`` when more bytes are needed."""
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if avail < 7:
            return None
        frame_type, channel, size = _unpack_head(buf, pos)
        if frame_type not in FRAME_TYPES:
            raise FrameError(f"unknown frame type {frame_type}")
        # RabbitMQ tolerates payloads up to frame_max (FRAME_SIZE_FUDGE = 8): rabbitpy and
        # amqpstorm cut bodies at frame_max instead of frame_max - 8.
        if size > self.frame_max:
            raise FrameError(
                f"frame size {size + FRAME_OVERHEAD} larger than negotiated maximum "
                f"{self.frame_max}"
            )
        end = pos + 7 + size
        if end >= len(buf):
            return None
        if buf[end] != FRAME_END:
            raise FrameError(f"bad frame end marker 0x{buf[end]:02x}, expected 0xce")
        payload = bytes(buf[pos + 7 : end])
        self._pos = end + 1
        if self._pos == len(buf):
            buf.clear()
            self._pos = 0
        return frame_type, channel, payload

    def clear(self) -> None:
        self._buf.clear()
        self._pos = 0


def check_protocol_header(data: bytes) -> None:
    """Raise unless ``data`` (8 bytes) is the AMQP 0-9-1 protocol header."""
    if data != PROTOCOL_HEADER:
        raise FrameError("bad protocol header", ReplyCode.FRAME_ERROR)


def frame(frame_type: int, channel: int, payload: bytes) -> bytes:
    return _HEAD.pack(frame_type, channel, len(payload)) + payload + FRAME_END_BYTE

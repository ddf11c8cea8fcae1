"""The change batch's layout (model/standby/changebatch.py): what the encoder writes, the decoder
reads back, record by record, for every kind of record and every flag; its bytes are pinned, since
a batch crosses to members running another build."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from cpgbroker.errors import InvariantError
from cpgbroker.model.changes import CREATED, DELETED, DELIVERED, ENQUEUED, RELEASED, REQUEUED
from cpgbroker.model.entities import Message, Queue
from cpgbroker.model.standby import changebatch
from cpgbroker.model.state import snapshot


class Collected:
    """A :class:`changebatch.Records` that keeps what it is handed, in order."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, ...]] = []

    def queue_named(self, ref: int, vhost: str, name: str) -> None:
        self.got.append(("named", ref, vhost, name))

    def queue_created(self, ref: int, q: Queue) -> None:
        self.got.append(("created", ref, snapshot.queue_meta(q)))

    def queue_deleted(self, ref: int) -> None:
        self.got.append(("deleted", ref))

    def msg_enqueued(self, ref: int, msg: Message, expires_at: int | None) -> None:
        self.got.append(("enqueued", ref, _message(msg), expires_at))

    def msg_delivered(self, ref: int, msg_id: int) -> None:
        self.got.append(("delivered", ref, msg_id))

    def msg_requeued(self, ref: int, msg_id: int, redelivered: bool, delivery_count: int) -> None:
        self.got.append(("requeued", ref, msg_id, redelivered, delivery_count))

    def msg_released(self, ref: int, msg_id: int) -> None:
        self.got.append(("released", ref, msg_id))


def _message(m: Message) -> tuple[Any, ...]:
    return (
        m.id,
        m.exchange,
        m.routing_key,
        m.ex_b,
        m.rk_b,
        m.header,
        m.body,
        m.delivery_mode,
        m.expiration_ms,
        m.headers_span,
    )


def _queue_meta(q: Queue) -> bytes:
    return snapshot.encode(snapshot.queue_meta(q))


def _queue(name: str, vhost: str = "/") -> Queue:
    return Queue(
        name=name,
        vhost=vhost,
        durable=True,
        exclusive_owner=None,
        auto_delete=False,
        arguments={"x-max-length": 5},
    )


def _records() -> tuple[list[Any], Queue, Queue, Message, Message]:
    """Every kind of record: a queue declared in the batch and one named (with a vhost and
    a name that are not ASCII), a message new in the batch and the same message again in
    another queue (by id only), one with headers and an expiration, elided records."""
    old = _queue("old-é", "vh-ü")
    new = _queue("new")
    m1 = Message(7, "ex", "rk", b"\x00\x3chead", b"body", 2, 1500, (3, 6))
    m2 = Message(8, "", "q", b"hdr", b"", 1, None, None)
    records: list[Any] = [
        (ENQUEUED, old, m1, None),
        None,
        (CREATED, new),
        (ENQUEUED, new, m1, 12_345),
        (ENQUEUED, new, m2, None),
        (DELIVERED, old, 7),
        (REQUEUED, old, 7, True, 3),
        (REQUEUED, new, 8, False, 0),
        (RELEASED, new, 8),
        None,
        (DELETED, new),
    ]
    return records, old, new, m1, m2


def test_every_record_kind_round_trips_in_order() -> None:
    records, _old, new, m1, m2 = _records()
    defs = snapshot.encode(["head", {"x": 1}])
    batch = changebatch.encode(records, 41, 99_000, defs, _queue_meta, True, True, True)
    sink = Collected()
    head = changebatch.decode(batch, sink)
    assert head == changebatch.Head(41, 99_000, defs, True, True, True)
    assert sink.got == [
        ("named", 1, "vh-ü", "old-é"),
        ("enqueued", 1, _message(m1), None),
        ("created", 2, snapshot.queue_meta(new)),
        ("enqueued", 2, _message(m1), 12_345),
        ("enqueued", 2, _message(m2), None),
        ("delivered", 1, 7),
        ("requeued", 1, 7, True, 3),
        ("requeued", 2, 8, False, 0),
        ("released", 2, 8),
        ("deleted", 2),
    ]
    # The same message in a second queue travels by id only: its bytes once in the batch.
    assert batch.count(b"\x00\x3chead") == 1


@pytest.mark.parametrize(
    ("confirms", "durable", "applied", "flags"),
    [
        (False, False, False, (False, False, False)),
        (True, False, False, (True, False, False)),
        (True, True, False, (True, True, False)),
        # Applied-only is said only beside a durable confirm (changebatch.encode).
        (True, False, True, (True, False, False)),
        (False, True, True, (False, True, True)),
    ],
)
def test_flags_and_no_definitions(
    confirms: bool, durable: bool, applied: bool, flags: tuple[bool, bool, bool]
) -> None:
    batch = changebatch.encode([], 1, 2, None, _queue_meta, confirms, durable, applied)
    head = changebatch.decode(batch, Collected())
    assert head == changebatch.Head(1, 2, None, *flags)
    assert len(batch) == changebatch.HEAD_S.size


def test_bytes_are_pinned() -> None:
    """The layout of format 1, byte for byte (a change here is a new format)."""
    records, *_ = _records()
    records = [r for r in records if r is None or r[0] != CREATED]
    batch = changebatch.encode(records, 3, 4, b"D", _queue_meta, True, False, False)
    assert batch.hex() == (
        "010000000000000003000000000000000403000000014400000000010005000676682dc3"
        "bc6f6c642dc3a902000000010000000000000007ffffffffffffffff0102000000000000"
        "05dc0000000300000006020200000006000000046578726b003c68656164626f64790000"
        "000002000100032f6e657702000000020000000000000007000000000000303900020000"
        "00020000000000000008ffffffffffffffff0101ffffffffffffffff0000000000000000"
        "000100000003000000007168647203000000010000000000000007040000000100000000"
        "000000070100000003040000000200000000000000080000000000050000000200000000"
        "000000080600000002"
    )


@pytest.mark.parametrize(
    ("batch", "error"),
    [
        (bytes([2]) + bytes(17), InvariantError),  # another format
        (changebatch.HEAD_S.pack(1, 0, 0, 0) + bytes([9]), InvariantError),  # unknown kind
        (changebatch.HEAD_S.pack(1, 0, 0, 0) + bytes([RELEASED, 0]), struct.error),  # cut short
        # A message named by id that the batch never carried.
        (
            changebatch.HEAD_S.pack(1, 0, 0, 0) + changebatch.ENQUEUED_S.pack(2, 1, 5, -1, 0),
            KeyError,
        ),
    ],
)
def test_a_batch_that_does_not_decode_raises(batch: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        changebatch.decode(batch, Collected())

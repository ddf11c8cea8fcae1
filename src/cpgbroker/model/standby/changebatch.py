"""The change batch: a hot-standby primary's records (``model/changes.py``) on the wire, written
by :func:`encode` (``model/shipping.py``'s ``Shipper``) and read by :func:`decode` (a backup's
``model/standby/replica.py``, which applies what it reads).

A batch crosses the network to members that may run another build, so its layout is fixed and
versioned by its first byte (:data:`BATCH_FORMAT`): no pickle or marshal. It is, in order:

* the head (:data:`HEAD_S`): the format, the primary's message counter and cluster time, and
  flags (:data:`F_DEFINITIONS`, :data:`F_CONFIRMS`, :data:`F_DURABLE`, :data:`F_APPLIED`);
* with :data:`F_DEFINITIONS`, the primary's definitions: a u32 length, then
  ``snapshot.definitions`` in the canonical encoding (``model/canonical.py``);
* the records, each a kind byte (``changes.CREATED`` ... ``changes.DELETED``, or
  :data:`NAME_KIND`) and a queue's number in this batch (*ref*): a queue the batch declares
  gets its number at its ``created`` record, any other one at a :data:`NAME_KIND` record
  naming it before its first record. A message's bytes follow its first ``enqueued`` record
  in the batch only; later ones (the same message in another queue) name it by id.

:func:`decode` hands each record, its layout resolved, to a :class:`Records` (the applying
side) in the batch's order; it checks the layout, not what the records mean.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from cpgbroker.errors import InvariantError
from cpgbroker.model.canonical import decode as decode_plain
from cpgbroker.model.canonical import queue_from_meta
from cpgbroker.model.changes import CREATED, DELETED, DELIVERED, ENQUEUED, RELEASED, REQUEUED
from cpgbroker.model.entities import Message, Queue

BATCH_FORMAT = 1

# Names a queue for the records after it (a queue the batch did not declare).
NAME_KIND = 0
HEAD_S = struct.Struct(">BQQB")  # format, msg_seq, now_ms, flags
F_DEFINITIONS = 1  # the definitions follow the head
F_CONFIRMS = 2  # a client waits for a confirm of this batch: report it at once
F_DURABLE = 4  # ... a confirm that waits for every store: report it once it is stored
# ... and output waits for it to be applied only (a delivery, a transient message's confirm):
# report it applied at once too, not only once stored. Release 0.1.0 ignores the bit (and so
# reports such a batch once stored: later, never wrong).
F_APPLIED = 8
LEN_S = struct.Struct(">I")
NAMED_S = struct.Struct(">BIHH")  # kind, ref, vhost length, name length
CREATED_S = struct.Struct(">BII")  # kind, ref, metadata length (then snapshot.encode of it)
REF_S = struct.Struct(">BI")  # kind, ref (deleted)
REF_ID_S = struct.Struct(">BIQ")  # kind, ref, message id (delivered, released)
REQUEUED_S = struct.Struct(">BIQBI")  # + redelivered, delivery count
# kind, ref, message id, expires_at (-1: none), whether the message follows: when it is new
# in this batch, its delivery mode, expiration (-1: none), where its header table is in the
# header (start and end, 0 and 0: none; not parsed again on every backup), the lengths of
# exchange, routing key, header and body, then those bytes.
ENQUEUED_S = struct.Struct(">BIQqB")
MESSAGE_S = struct.Struct(">BqIIBBII")

# A record as the change log holds it (``model/changes.py``), None where it was elided.
Record = tuple[Any, ...] | None


def encode(
    records: list[Record],
    msg_seq: int,
    now_ms: int,
    definitions: bytes | None,
    queue_meta: Callable[[Queue], bytes],
    confirms: bool = False,
    durable: bool = False,
    applied: bool = False,
) -> bytes:
    """One change batch: the primary's counters, its definitions if they changed (already
    encoded with ``snapshot.encode``), and the records of ``ChangeLog.take``; ``queue_meta``
    encodes a declared queue's metadata (``snapshot.queue_meta``). ``confirms``: a client of
    the primary waits for a confirm (or a delivery) that this batch makes good (``durable``:
    one that waits for every member's store; ``applied``: one that waits for every member to
    have applied it only, while another waits for the stores)."""
    flags = (
        (F_DEFINITIONS if definitions is not None else 0)
        | (F_CONFIRMS if confirms else 0)
        | (F_DURABLE if durable else 0)
        | (F_APPLIED if applied and durable else 0)
    )
    out = [HEAD_S.pack(BATCH_FORMAT, msg_seq, now_ms, flags)]
    if definitions is not None:
        out.append(LEN_S.pack(len(definitions)))
        out.append(definitions)
    append = out.append
    # id(queue) -> its number in this batch (the records hold the queues: no id is reused).
    refs: dict[int, int] = {}
    sent: dict[int, None] = {}
    ref_id = REF_ID_S.pack
    for r in records:
        if r is None:
            continue
        kind = r[0]
        q: Queue = r[1]
        if kind == CREATED:
            ref = refs[id(q)] = len(refs) + 1
            meta = queue_meta(q)
            append(CREATED_S.pack(CREATED, ref, len(meta)))
            append(meta)
            continue
        ref = refs.get(id(q), 0)
        if not ref:
            ref = refs[id(q)] = len(refs) + 1
            vh, name = q.vhost.encode(), q.name.encode()
            append(NAMED_S.pack(NAME_KIND, ref, len(vh), len(name)))
            append(vh)
            append(name)
        if kind == ENQUEUED:
            msg: Message = r[2]
            exp = -1 if r[3] is None else r[3]
            if msg.id in sent:
                append(ENQUEUED_S.pack(ENQUEUED, ref, msg.id, exp, 0))
                continue
            sent[msg.id] = None
            append(ENQUEUED_S.pack(ENQUEUED, ref, msg.id, exp, 1))
            ex, rk = msg.ex_b, msg.rk_b
            span = msg.headers_span or (0, 0)
            append(
                MESSAGE_S.pack(
                    msg.delivery_mode,
                    -1 if msg.expiration_ms is None else msg.expiration_ms,
                    span[0],
                    span[1],
                    len(ex),
                    len(rk),
                    len(msg.header),
                    len(msg.body),
                )
            )
            append(ex)
            append(rk)
            append(msg.header)
            append(msg.body)
        elif kind in (RELEASED, DELIVERED):
            append(ref_id(kind, ref, r[2]))
        elif kind == REQUEUED:
            append(REQUEUED_S.pack(REQUEUED, ref, r[2], r[3], r[4]))
        elif kind == DELETED:
            append(REF_S.pack(DELETED, ref))
        else:
            raise InvariantError(f"unknown change record {kind}")
    return b"".join(out)


class Head(NamedTuple):
    """What a batch says besides its records."""

    msg_seq: int
    now_ms: int
    # The primary's definitions in the canonical encoding, when they changed (F_DEFINITIONS).
    definitions: bytes | None
    confirms: bool  # F_CONFIRMS
    durable: bool  # F_DURABLE
    applied: bool  # F_APPLIED


class Records(Protocol):
    """What :func:`decode` hands the records to, one call per record in the batch's order;
    ``ref`` is the queue's number in the batch (module docstring)."""

    def queue_named(self, ref: int, vhost: str, name: str) -> None:
        """``ref`` is the queue ``name`` of ``vhost`` (one the batch did not declare)."""

    def queue_created(self, ref: int, q: Queue) -> None:
        """``q`` was declared (no messages yet); ``ref`` names it from here on."""

    def queue_deleted(self, ref: int) -> None: ...

    def msg_enqueued(self, ref: int, msg: Message, expires_at: int | None) -> None: ...

    def msg_delivered(self, ref: int, msg_id: int) -> None: ...

    def msg_requeued(
        self, ref: int, msg_id: int, redelivered: bool, delivery_count: int
    ) -> None: ...

    def msg_released(self, ref: int, msg_id: int) -> None: ...


def decode(batch: bytes, into: Records) -> Head:
    """Hand ``batch``'s records to ``into``, in order, and return its head. A batch that does
    not decode raises ``InvariantError``, or the ``KeyError``, ``IndexError``,
    ``ValueError``, ``UnicodeDecodeError`` or ``struct.error`` of a layout cut short (a
    message named by id that the batch never carried: ``KeyError``)."""
    fmt, msg_seq, now_ms, flags = HEAD_S.unpack_from(batch)
    if fmt != BATCH_FORMAT:
        raise InvariantError(f"change batch format {fmt} is not {BATCH_FORMAT}")
    p = HEAD_S.size
    defs: bytes | None = None
    if flags & F_DEFINITIONS:
        (n,) = LEN_S.unpack_from(batch, p)
        p += LEN_S.size
        defs = batch[p : p + n]
        p += n
    # The messages this batch carried so far, by id.
    new: dict[int, Message] = {}
    ref_id = REF_ID_S.unpack_from
    released = into.msg_released
    enqueued = into.msg_enqueued
    delivered = into.msg_delivered
    requeued = into.msg_requeued
    end = len(batch)
    while p < end:
        kind = batch[p]
        if kind == RELEASED:
            _, ref, mid = ref_id(batch, p)
            p += 13
            released(ref, mid)
        elif kind == ENQUEUED:
            _, ref, mid, exp, has_msg = ENQUEUED_S.unpack_from(batch, p)
            p += ENQUEUED_S.size
            if has_msg:
                mode, expiration, h0, h1, nx, nr, nh, nb = MESSAGE_S.unpack_from(batch, p)
                p += MESSAGE_S.size
                ex_b = batch[p : p + nx]
                p += nx
                rk_b = batch[p : p + nr]
                p += nr
                header = batch[p : p + nh]
                p += nh
                body = batch[p : p + nb]
                p += nb
                if p > end:
                    raise InvariantError("change batch: a message overruns the batch")
                msg = new[mid] = Message.encoded(
                    mid,
                    ex_b,
                    rk_b,
                    header,
                    body,
                    mode,
                    None if expiration < 0 else expiration,
                    (h0, h1) if h1 else None,
                )
            else:
                msg = new[mid]
            enqueued(ref, msg, None if exp < 0 else exp)
        elif kind == DELIVERED:
            _, ref, mid = ref_id(batch, p)
            p += 13
            delivered(ref, mid)
        elif kind == REQUEUED:
            _, ref, mid, redelivered, count = REQUEUED_S.unpack_from(batch, p)
            p += REQUEUED_S.size
            requeued(ref, mid, bool(redelivered), count)
        elif kind == NAME_KIND:
            _, ref, nv, nn = NAMED_S.unpack_from(batch, p)
            p += NAMED_S.size
            vhost = batch[p : p + nv].decode()
            p += nv
            name = batch[p : p + nn].decode()
            p += nn
            into.queue_named(ref, vhost, name)
        elif kind == CREATED:
            _, ref, n = CREATED_S.unpack_from(batch, p)
            p += CREATED_S.size
            q = queue_from_meta(decode_plain(batch[p : p + n]))
            p += n
            into.queue_created(ref, q)
        elif kind == DELETED:
            _, ref = REF_S.unpack_from(batch, p)
            p += REF_S.size
            into.queue_deleted(ref)
        else:
            raise InvariantError(f"unknown change record kind {kind} at byte {p}")
    if p != end:
        raise InvariantError(f"change batch overruns its {end} bytes")
    return Head(
        msg_seq,
        now_ms,
        defs,
        bool(flags & F_CONFIRMS),
        bool(flags & F_DURABLE),
        bool(flags & F_APPLIED),
    )

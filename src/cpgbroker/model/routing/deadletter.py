"""The dead-lettered copy of a message: RabbitMQ's x-death bookkeeping in its content header.

Pure functions (no broker state): delivery decides *when* a message is dead-lettered and
where the copy goes (``delivery.py``); this module only says what the copy looks like.

Two generations, chosen by the model version (``model/versions.py``):

* :func:`dead_letter_header` and :func:`is_cycle` (version 7) decode the header with pamqp and
  have pamqp write all of it again: headers sorted by name, floats cut to 32 bits, integers in
  the smallest type that holds them. Kept as they are: a version-7 cluster writes these bytes.
* :func:`dead_letter_header_exact` and :func:`is_cycle_exact` (version 8,
  ``EXACT_FIELD_TABLES``) do the same bookkeeping on the header's bytes (``wire/fieldtable.py``):
  every property but ``headers`` and ``expiration`` stays as the publisher sent it, every header
  value but ``x-death`` and the ``x-first-death-*`` ones it adds stays byte for byte, in its
  place, and what it writes has RabbitMQ 3.10.8's types (``rabbit_dead_letter``).
"""

from __future__ import annotations

import datetime
from typing import Any

from cpgbroker.model.entities import Message, Queue
from cpgbroker.wire.fastpath import FLAG_EXPIRATION, FLAG_HEADERS, property_span
from cpgbroker.wire.fieldtable import (
    ARRAY,
    INTEGER_KINDS,
    TABLE,
    Field,
    Table,
    decode_table,
)

# The largest count an x-death entry can hold ('l', signed 64 bits): a count stops there.
_MAX_COUNT = 2**63 - 1


def dead_letter_header(msg: Message, q: Queue, reason: str, now_ms: int) -> bytes:
    """The content header of a dead-lettered copy: x-death added or counted up (RabbitMQ's
    format), expiration removed (kept as original-expiration). The only place we re-encode a
    client's properties; rare, so pamqp does it."""
    from pamqp import header as pheader

    ch = pheader.ContentHeader()
    ch.unmarshal(msg.header)
    props = ch.properties
    headers: dict[str, Any] = dict(props.headers or {})
    deaths: list[Any] = list(headers.get("x-death") or [])
    # Cluster time, not the wall clock: every replica writes the same header.
    when = datetime.datetime.fromtimestamp(now_ms // 1000, tz=datetime.UTC)
    for i, d in enumerate(deaths):
        if isinstance(d, dict) and d.get("queue") == q.name and d.get("reason") == reason:
            d = dict(d)
            d["count"] = int(d.get("count", 0)) + 1
            d["time"] = when
            deaths.pop(i)
            deaths.insert(0, d)
            break
    else:
        deaths.insert(
            0,
            {
                "count": 1,
                "reason": reason,
                "queue": q.name,
                "time": when,
                "exchange": msg.exchange,
                "routing-keys": [msg.routing_key],
            },
        )
    headers["x-death"] = deaths
    if "x-first-death-reason" not in headers:
        headers["x-first-death-reason"] = reason
        headers["x-first-death-queue"] = q.name
        headers["x-first-death-exchange"] = msg.exchange
    if props.expiration is not None:
        # RabbitMQ keeps it in the x-death entry just added, not as a top-level header.
        if "original-expiration" not in deaths[0]:
            deaths[0]["original-expiration"] = props.expiration
        props.expiration = None
    props.headers = headers
    return bytes(ch.marshal())


def is_cycle(header: bytes, target: str) -> bool:
    """RabbitMQ's cycle rule (``rabbit_dead_letter``): a dead-lettered message whose x-death
    (newest first) names ``target`` already, with no death by rejection on the way there, is
    going round in circles and is dropped instead of enqueued. Without it, two full queues that
    dead-letter into each other would hand messages back and forth for ever within one event.
    """
    from pamqp import header as pheader

    ch = pheader.ContentHeader()
    ch.unmarshal(header)
    deaths = (ch.properties.headers or {}).get("x-death")
    for d in deaths if isinstance(deaths, list) else ():
        if not isinstance(d, dict) or d.get("reason") == "rejected":
            return False
        if d.get("queue") == target:
            return True
    return False


def dead_letter_header_exact(msg: Message, q: Queue, reason: str, now_ms: int) -> bytes:
    """The content header of a dead-lettered copy at model version 8: the bookkeeping of
    :func:`dead_letter_header`, done on the header's bytes.

    * The entry of ``x-death`` (an array) whose ``queue`` and ``reason`` (long strings) are this
      queue's and this reason moves to the front with ``count`` one up (a signed 64-bit ``l``
      whatever integer type it had, as RabbitMQ writes it; a count that is not an integer,
      on which RabbitMQ 3.10.8 fails, starts again at 1, as later RabbitMQs reset it) and
      ``time`` now, its other values unchanged;
      without one, a new entry goes in front: ``count`` 1, ``exchange``, ``queue``,
      ``reason`` (long strings ``S``), ``routing-keys`` (an array of ``S``), ``time`` (a
      timestamp ``T``, seconds of cluster time), in that order (pamqp's sorted order, as
      version 7 wrote it). Other entries stay as they were, in their order. An ``x-death`` that
      is not an array is replaced by an array of the new entry alone, in the order RabbitMQ
      3.10.8 writes it there: ``count``, ``reason``, ``queue``, ``time``, ``exchange``,
      ``routing-keys`` (and ``original-expiration`` last).
    * ``x-first-death-reason``, ``-queue`` and ``-exchange`` (``S``) are written only when the
      message had no ``x-death`` at all, as RabbitMQ 3.10.8 does: each replaces a value the
      message had (in place), or is added at the end of the headers. A message whose
      ``x-death`` was an array, or was not an array, keeps the ones it has and gets none.
      (Measured on a RabbitMQ 3.10.8 node: ``tests/unit/test_deadletter_exact.py``.)
    * ``expiration`` is removed and goes into the entry in front as ``original-expiration``
      (``S``, the property's bytes), unless it holds one already.
    * Every other header stays where it was, a name given twice included; the value of
      ``x-death`` (its last entry, as clients read a table) is replaced in place, or added at
      the end of the headers.
    """
    header = msg.header
    flags = header[12] << 8 | header[13]
    h_start, h_end = property_span(header, FLAG_HEADERS)
    e_start, e_end = property_span(header, FLAG_EXPIRATION)
    headers = decode_table(header, h_start, h_end)[0] if flags & FLAG_HEADERS else Table()
    qname, why = q.name.encode(), reason.encode()
    when = Field.timestamp(now_ms // 1000)
    found = headers.get("x-death")
    deaths = found.value if found is not None and found.kind == ARRAY else []
    assert isinstance(deaths, list)
    # RabbitMQ resets an x-death that is not an array (rabbitmq-server#767).
    reset = found is not None and found.kind != ARRAY
    first: Table | None = None
    for i, d in enumerate(deaths):
        if d.kind != TABLE:
            continue
        entry = d.value
        assert isinstance(entry, Table)
        if _long_string(entry, "queue") == qname and _long_string(entry, "reason") == why:
            count = entry.get("count")
            n = count.value if count is not None and count.kind in INTEGER_KINDS else 0
            assert isinstance(n, int)
            entry.set("count", Field.long(min(n + 1, _MAX_COUNT)))
            entry.set("time", when)
            del deaths[i]
            first = entry
            break
    new_entry = first is None
    if reset:
        first = Table(
            [
                ("count", Field.long(1)),
                ("reason", Field.longstr(why)),
                ("queue", Field.longstr(qname)),
                ("time", when),
                ("exchange", Field.longstr(msg.exchange)),
                ("routing-keys", Field.array([Field.longstr(msg.routing_key)])),
            ]
        )
    elif first is None:
        first = Table(
            [
                ("count", Field.long(1)),
                ("exchange", Field.longstr(msg.exchange)),
                ("queue", Field.longstr(qname)),
                ("reason", Field.longstr(why)),
                ("routing-keys", Field.array([Field.longstr(msg.routing_key)])),
                ("time", when),
            ]
        )
    if flags & FLAG_EXPIRATION and first.get("original-expiration") is None:
        # RabbitMQ keeps it in the x-death entry, not as a top-level header; in pamqp's
        # sorted order in a new entry (after exchange), at the end of an older one (and of
        # the entry that replaces an x-death that was not an array).
        original = ("original-expiration", Field.longstr(header[e_start + 1 : e_end]))
        if new_entry and not reset:
            first.entries.insert(2, original)
        else:
            first.entries.append(original)
    deaths.insert(0, Field.table(first))
    headers.set("x-death", Field.array(deaths))
    if found is None:
        headers.set("x-first-death-reason", Field.longstr(why))
        headers.set("x-first-death-queue", Field.longstr(qname))
        headers.set("x-first-death-exchange", Field.longstr(msg.exchange))
    flags = (flags | FLAG_HEADERS) & ~FLAG_EXPIRATION
    return b"".join(
        (
            header[:12],
            bytes((flags >> 8, flags & 0xFF)),
            header[14:h_start],
            headers.encode(),
            header[h_end:e_start],
            header[e_end:],
        )
    )


def _long_string(table: Table, name: str) -> bytes | None:
    f = table.get(name)
    return None if f is None else f.long_string()


def is_cycle_exact(header: bytes, target: str) -> bool:
    """:func:`is_cycle` at model version 8, on the header's bytes (same rule, same reading:
    the last ``x-death``, ``queue`` and ``reason`` compared as long strings)."""
    flags = header[12] << 8 | header[13]
    if not flags & FLAG_HEADERS:
        return False
    start, end = property_span(header, FLAG_HEADERS)
    found = decode_table(header, start, end)[0].get("x-death")
    if found is None or found.kind != ARRAY:
        return False
    deaths = found.value
    assert isinstance(deaths, list)
    name = target.encode()
    for d in deaths:
        if d.kind != TABLE:
            return False
        entry = d.value
        assert isinstance(entry, Table)
        if _long_string(entry, "reason") == b"rejected":
            return False
        if _long_string(entry, "queue") == name:
            return True
    return False

"""Plain values: the canonical encoding of snapshots, definitions and change batches, and the
entities rebuilt from their parts.

A snapshot (``model/state/snapshot.py``) is a tree of plain values (None, bool, int, float, str,
bytes, list, dict with str keys, and the datetime/Decimal values that AMQP tables may carry),
built in a fixed order from the model's insertion-ordered collections. :func:`encode` turns it
into canonical bytes (no pickle: a snapshot crosses the network to new members and must never
execute code). What rebuilds queues, vhosts and users from their parts is here too, so that a
hot-standby backup installing a primary's definitions (``model/standby/replica.py``, which the
broker imports) shares it with a restore without importing the snapshot module (which imports the
broker).
"""

from __future__ import annotations

import collections
import datetime
import decimal
from typing import Any

from cpgbroker.errors import InvariantError
from cpgbroker.model.config import Permission, User
from cpgbroker.model.entities import IdList, Queue, QueueBinding, ready_messages
from cpgbroker.model.routing.exchange import Exchange
from cpgbroker.model.routing.topology import VHost
from cpgbroker.wire.fieldtable import decode_table

# 2: queues carry single_active (x-single-active-consumer), quorum and delivery_limit; entries
#    of quorum queues their delivery count (a fourth element, when not 0); connections whether
#    they were ever granted output.
SNAPSHOT_FORMAT = 2


def encode(obj: Any) -> bytes:
    out: list[bytes] = []
    _enc(obj, out.append)
    return b"".join(out)


def _enc(o: Any, w: Any) -> None:
    if o is None:
        w(b"N")
    elif o is True:
        w(b"T")
    elif o is False:
        w(b"F")
    elif isinstance(o, int):
        w(b"i%d;" % o)
    elif isinstance(o, str):
        b = o.encode()
        w(b"s%d:" % len(b))
        w(b)
    elif isinstance(o, bytes | bytearray | memoryview):
        b = bytes(o)
        w(b"b%d:" % len(b))
        w(b)
    elif isinstance(o, list | tuple | collections.deque):
        w(b"l")
        for x in o:
            _enc(x, w)
        w(b"e")
    elif isinstance(o, dict):
        w(b"d")
        for k, v in o.items():
            if not isinstance(k, str):
                raise InvariantError(f"snapshot dict key {k!r} is not a str")
            _enc(k, w)
            _enc(v, w)
        w(b"e")
    elif isinstance(o, float):
        r = repr(o).encode()
        w(b"f%d:" % len(r))
        w(r)
    elif isinstance(o, datetime.datetime):
        r = o.isoformat().encode()
        w(b"t%d:" % len(r))
        w(r)
    elif isinstance(o, decimal.Decimal):
        r = str(o).encode()
        w(b"D%d:" % len(r))
        w(r)
    else:
        raise InvariantError(f"cannot snapshot a {type(o).__name__}")


def decode(data: bytes) -> Any:
    value, pos = _dec(data, 0)
    if pos != len(data):
        raise InvariantError("trailing bytes after snapshot")
    return value


def _dec(d: bytes, p: int) -> tuple[Any, int]:
    tag = d[p : p + 1]
    p += 1
    if tag == b"N":
        return None, p
    if tag == b"T":
        return True, p
    if tag == b"F":
        return False, p
    if tag == b"i":
        end = d.index(b";", p)
        return int(d[p:end]), end + 1
    if tag == b"l":
        items = []
        while d[p : p + 1] != b"e":
            v, p = _dec(d, p)
            items.append(v)
        return items, p + 1
    if tag == b"d":
        obj = {}
        while d[p : p + 1] != b"e":
            k, p = _dec(d, p)
            v, p = _dec(d, p)
            obj[k] = v
        return obj, p + 1
    colon = d.index(b":", p)
    n = int(d[p:colon])
    raw = d[colon + 1 : colon + 1 + n]
    p = colon + 1 + n
    if tag == b"s":
        return raw.decode(), p
    if tag == b"b":
        return bytes(raw), p
    if tag == b"f":
        return float(raw), p
    if tag == b"t":
        return datetime.datetime.fromisoformat(raw.decode()), p
    if tag == b"D":
        return decimal.Decimal(raw.decode()), p
    raise InvariantError(f"bad snapshot tag {tag!r} at {p - 1}")


# ---------------------------------------------------------------------- entities from parts


def restore_user(d: dict[str, Any]) -> User:
    return User(
        d["name"],
        "",
        vhosts=(),
        loopback_only=d["loopback_only"],
        tags=tuple(d["tags"]),
        max_connections=d.get("max_connections"),
        max_channels=d.get("max_channels"),
        password_hash=d["password_hash"],
        hashing_algorithm=d["hashing_algorithm"],
        permissions=tuple(Permission(*p) for p in d["permissions"]),
    )


def queue_from_meta(qd: dict[str, Any]) -> Queue:
    """A queue, without messages or consumers, from its snapshot part's metadata."""
    return Queue(
        name=qd["name"],
        vhost=qd["vhost"],
        durable=qd["durable"],
        exclusive_owner=qd["exclusive_owner"],
        auto_delete=qd["auto_delete"],
        arguments=qd["arguments"],
        ttl=qd["ttl"],
        expires=qd["expires"],
        max_length=qd["max_length"],
        max_length_bytes=qd["max_length_bytes"],
        overflow=qd["overflow"],
        dlx=qd["dlx"],
        dlrk=qd["dlrk"],
        single_active=qd["single_active"],
        quorum=qd["quorum"],
        delivery_limit=qd["delivery_limit"],
        rr=qd["rr"],
        unacked=qd["unacked"],
        ready_bytes=qd["ready_bytes"],
        had_consumers=qd["had_consumers"],
        last_used_ms=qd["last_used_ms"],
        deleted=qd["deleted"],
        bindings=IdList(QueueBinding(x[0], x[1], x[2]) for x in qd["bindings"]),
        # Per priority for x-max-priority: entries then go back to their bands.
        messages=ready_messages(qd["arguments"]),
    )


def vhost_from_part(vd: dict[str, Any], queues: list[Queue]) -> VHost:
    """A vhost, its exchanges and their bindings, from its snapshot part (``queues``: the
    snapshot's queues, by number)."""
    vh = VHost(vd["name"])
    for xd in vd["exchanges"]:
        vh.exchanges[xd["name"]] = Exchange(
            xd["name"],
            vd["name"],
            xd["type"],
            xd["durable"],
            xd["auto_delete"],
            xd["internal"],
            xd["arguments"],
            deleted=xd["deleted"],
        )
    # Bind once every exchange exists (exchange-to-exchange bindings), in recorded order;
    # each queue binding is linked to the queue's record of it (derived: ``Binding.qb``).
    records: dict[tuple[int, str, str, bytes], QueueBinding] = {}
    for qi in dict.fromkeys(
        dest for xd in vd["exchanges"] for kind, dest, *_ in xd["bindings"] if kind == "q"
    ):
        for qb in queues[qi].bindings:
            records[(qi, qb.exchange, qb.routing_key, encode(qb.arguments))] = qb
    for xd in vd["exchanges"]:
        ex = vh.exchanges[xd["name"]]
        for kind, dest, key, args, *table in xd["bindings"]:
            b = ex.bind(
                queues[dest] if kind == "q" else vh.exchanges[dest],
                key,
                args,
                decode_table(table[0])[0] if table else None,
            )
            if b is not None and kind == "q":
                b.qb = records.get((dest, ex.name, key, encode(args)))
    for qi in vd["queues"]:
        vh.queues[queues[qi].name] = queues[qi]
    return vh

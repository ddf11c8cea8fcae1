"""Events (facts in total order) that drive the model, and effects (commands) it returns.

The model is a pure function of the ordered event stream. In standalone mode a local sequencer
numbers the events; in a cluster, CPG's total order does. The member that owns a connection
executes the effects for it; every other member drops them (shadow connections).
"""

from __future__ import annotations

import struct
from typing import Any

import attrs


@attrs.frozen
class ClientConnected:
    """A client opened a TCP connection to ``member``.

    ``conn`` is unique across the cluster (it embeds the member). ``loopback`` says whether the
    peer address is a loopback address, decided once by the member that accepted the socket, so
    the loopback-only rule for the guest user gives the same answer on every replica.
    ``tls``: the client came in over an amqps listener. ``cert_user``: the name its verified
    client certificate stands for (the EXTERNAL mechanism's user; "" for none), decided the
    same way once by that member: the model never reads certificates.
    """

    conn: int
    member: int = 0
    peer: str = ""
    loopback: bool = True
    tls: bool = False
    cert_user: str = ""


@attrs.frozen
class ClientData:
    """Bytes a client sent, exactly as read from the socket (any chunking)."""

    conn: int
    data: bytes


@attrs.frozen
class ClientDisconnected:
    """deliver-close: the client's socket closed (or its member decided to drop it)."""

    conn: int
    reason: str = "client closed the connection"


@attrs.frozen
class CloseClient:
    """Close a client's connection with connection.close (``code``, ``text``): broker shutdown
    (320 CONNECTION_FORCED), a member leaving the cluster, an administrator's request."""

    conn: int
    code: int
    text: str


@attrs.frozen
class Tick:
    """Cluster time in milliseconds. Timers (heartbeats, TTL, x-expires) act only on ticks."""

    now_ms: int


@attrs.frozen
class DoOutput:
    """do-output: the owner of ``conn`` lets the model allocate up to ``limit`` more deliveries
    to that connection's consumers (it has room to write them)."""

    conn: int
    limit: int


@attrs.frozen
class MemberLeft:
    """A cluster member is gone: every replica closes its clients' connections at this point."""

    member: int


@attrs.frozen
class ClusterMembers:
    """The cluster's members changed: ``urls`` are the client URLs of the members now in it,
    in a fixed order. Sent to clients in connection.start and published on amq.failover."""

    urls: tuple[str, ...]


@attrs.frozen
class Recovered:
    """The cluster restarts from a member's store after every member stopped: what AMQP does
    not keep across a broker restart goes (non-durable exchanges and queues, transient
    messages). Applied once, after the connections of the stopped members were closed (their
    unacked messages are back in their queues, marked redelivered), so every replica and every
    later replay drops exactly the same things."""


@attrs.frozen
class DiskAlarm:
    """``member``'s store has less free disk space than its limit (``low``), or has enough
    again: while any member is in alarm, publishers are blocked (RabbitMQ's disk alarm)."""

    member: int
    low: bool


@attrs.frozen
class AdminCommand:
    """An operator's change through the management API or ``cpgbroker ctl``
    (model/operators/admin.py): users, vhosts, permissions, policies, queues, exchanges, bindings,
    messages.

    ``member`` and ``ticket`` name the request, so that the member whose operator asked
    answers it (:class:`AdminReply`). ``user`` is who asked, as that member authenticated them
    (a broker user, whose vhost permissions then apply, or ``permissions.TRUSTED`` for the
    holder of the member's admin secret). ``op`` names the change and ``args`` holds its
    arguments as a JSON object (UTF-8): the model checks them, so a malformed request is a 400
    answer on every replica alike, never an error of the member. Passwords never travel in
    it: the asking member hashes them first."""

    member: int
    ticket: int
    user: str
    op: str
    args: bytes


@attrs.frozen
class Forward:
    """Messages the federation link (``vhost``, ``exchange``, ``upstream``) of ``member``
    brought in from an upstream cluster (runtime/federation/links.py), to publish into the
    exchange in this order, as (routing key, content header, body, digest, redelivered): the header
    already carries ``x-received-from``; ``digest`` names the message as the upstream sent
    it, and ``redelivered`` says the upstream sent it before (to a runner that may have handed
    it over already: model/federation.py drops it then). Answered like an
    :class:`AdminCommand` (``member``, ``ticket``): the link acknowledges them upstream once
    the answer says every member has them."""

    member: int
    ticket: int
    vhost: str
    exchange: str
    upstream: str
    messages: tuple[tuple[str, bytes, bytes, bytes, bool], ...]


@attrs.frozen
class Changes:
    """A hot-standby primary's change batch (model/changes.py, model/standby/replica.py): what its
    broker changed, applied by every backup's broker in place of its clients' bytes."""

    data: bytes


Event = (
    ClientConnected
    | ClientData
    | ClientDisconnected
    | CloseClient
    | Tick
    | DoOutput
    | MemberLeft
    | ClusterMembers
    | Recovered
    | DiskAlarm
    | AdminCommand
    | Forward
    | Changes
)


# ``Send.confirm`` levels.
CONFIRM = 1
CONFIRM_DURABLE = 2


@attrs.frozen
class Send:
    """Write ``data`` to the client of ``conn``.

    ``confirm``: the bytes carry a publisher confirm (basic.ack/nack) or tx.commit-ok
    (:data:`CONFIRM`), one that covers a persistent message routed to a durable queue
    (:data:`CONFIRM_DURABLE`), or neither (0). A cluster member writes such output only once
    the event is stable (applied by every ready member), so a confirm never reaches a client
    for an event a surviving member may lack; a durable one only once every ready member has
    also written the event to its store (fsynced it, by default).

    ``delivery_waits``: the bytes carry a delivery (basic.deliver or basic.get-ok) of a
    message a hot-standby primary shipping changes shipped in an earlier batch than the one
    recording the delivery (``ChangeLog.delivery_waits``). Such output is written only once
    that batch is stable, as a confirm is, so that a member promoted after it knows of every
    delivery a client may have seen (runtime/replication/shipping.py, "Deliveries").
    """

    conn: int
    data: bytes
    confirm: int = 0
    delivery_waits: bool = False


@attrs.frozen
class CloseConnection:
    """Close the client's socket after writing what was sent before."""

    conn: int
    reason: str


@attrs.frozen
class WantOutput:
    """Deliveries are waiting for ``conn`` but its do-output credit is spent: the owner should
    grant more (a :class:`DoOutput` event) once its socket has room."""

    conn: int


@attrs.frozen
class Throttle:
    """Stop (``paused``) or resume reading from ``conn``: publishers are blocked (memory mark,
    disk alarm) or a queue holds this publisher back (queue flow)."""

    conn: int
    paused: bool


@attrs.frozen
class LoginRefused:
    """The client of ``conn`` was refused at login: its owner logs who and why (the client
    is told to see the log). Never carries the secret."""

    conn: int
    user: str
    mechanism: str
    why: str


@attrs.frozen
class AdminReply:
    """The answer to :class:`AdminCommand` ``(member, ticket)``: an HTTP status and a JSON
    value in RabbitMQ's shapes. Only the member that asked acts on it; it has no client
    connection (``conn`` is never one), so client I/O passes it by."""

    member: int
    ticket: int
    status: int
    body: Any
    conn: int = -1


Effect = Send | CloseConnection | WantOutput | Throttle | LoginRefused | AdminReply

# -- Forward's binary form: the multicast codec's and the journal's (cluster/codec.py,
# store/records.py), here so that both layers can share it.

_Q = struct.Struct(">Q")
_I = struct.Struct(">I")
_H = struct.Struct(">H")


def _s(text: str) -> bytes:
    b = text.encode()
    return _H.pack(len(b)) + b


def _read_s(data: bytes, p: int) -> tuple[str, int]:
    (n,) = _H.unpack_from(data, p)
    end = p + 2 + n
    if end > len(data):
        raise IndexError("string past the end")
    return data[p + 2 : end].decode(), end


def encode_forward(ev: Forward) -> bytes:
    """A Forward's body (also the journal's: store/records.py)."""
    parts = [
        _Q.pack(ev.member),
        _Q.pack(ev.ticket),
        _s(ev.vhost),
        _s(ev.exchange),
        _s(ev.upstream),
        _I.pack(len(ev.messages)),
    ]
    for rk, header, body, digest, redelivered in ev.messages:
        parts += [
            _s(rk),
            _I.pack(len(header)),
            header,
            _I.pack(len(body)),
            body,
            bytes([len(digest), redelivered]),
            digest,
        ]
    return b"".join(parts)


def decode_forward(data: bytes, p: int) -> tuple[Forward, int]:
    """A Forward's body at ``p``; the event and where it ends (IndexError if cut short)."""
    member, ticket = struct.unpack_from(">QQ", data, p)
    vhost, p = _read_s(data, p + 16)
    exchange, p = _read_s(data, p)
    upstream, p = _read_s(data, p)
    (n,) = _I.unpack_from(data, p)
    p += 4
    messages = []
    for _ in range(n):
        rk, p = _read_s(data, p)
        (hlen,) = _I.unpack_from(data, p)
        header = bytes(data[p + 4 : p + 4 + hlen])
        p += 4 + hlen
        (blen,) = _I.unpack_from(data, p)
        body = bytes(data[p + 4 : p + 4 + blen])
        p += 4 + blen
        dlen, redelivered = data[p], data[p + 1]
        digest = bytes(data[p + 2 : p + 2 + dlen])
        p += 2 + dlen
        if len(header) != hlen or len(body) != blen or len(digest) != dlen:
            raise IndexError("forwarded message past the end")
        messages.append((rk, header, body, digest, bool(redelivered)))
    return Forward(member, ticket, vhost, exchange, upstream, tuple(messages)), p

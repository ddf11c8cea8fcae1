"""The journal's payloads: one applied stream event each (pure: bytes in, events out).

A member journals exactly what it applied to its model, in order, so replaying the journal on
top of the snapshot it starts from rebuilds the same model (the model is deterministic). The
encoding is this package's own, not the multicast codec's: it covers the events a member
applies without their being multicast (``MemberLeft``, ``ClusterMembers``, ``Recovered``) and
says whether the cluster failed the event in an error-check round (then the replay counts it
and closes its connection, as ``Broker.fail_event`` did, instead of applying it).

Client bytes are most of what a member journals, so ``ClientData`` is one struct and a copy.
"""

from __future__ import annotations

import struct

from cpgbroker.errors import InvariantError
from cpgbroker.model import journal_type
from cpgbroker.model.events import (
    AdminCommand,
    Changes,
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    ClusterMembers,
    DiskAlarm,
    DoOutput,
    Event,
    Forward,
    MemberLeft,
    Recovered,
    Tick,
    decode_forward,
    encode_forward,
)

# The record types: model/eventtypes.py numbers every kind of event once, for both codecs.
R_DATA = journal_type(ClientData)
R_CONNECTED = journal_type(ClientConnected)
R_DISCONNECTED = journal_type(ClientDisconnected)
R_DO_OUTPUT = journal_type(DoOutput)
R_CLOSE_CLIENT = journal_type(CloseClient)
R_TICK = journal_type(Tick)
R_MEMBER_LEFT = journal_type(MemberLeft)
R_MEMBERS = journal_type(ClusterMembers)
R_RECOVERED = journal_type(Recovered)
R_DISK_ALARM = journal_type(DiskAlarm)
R_ADMIN = journal_type(AdminCommand)
R_FORWARD = journal_type(Forward)
R_CHANGES = journal_type(Changes)
# Or'ed into the type byte: the cluster failed this event (it counts, its connection closes).
FAILED = 0x80

_DATA = struct.Struct(">BQ")
_Q = struct.Struct(">BQ")
_QQ = struct.Struct(">BQQ")
_QH = struct.Struct(">BQH")
# type, conn, member, flags (loopback; TLS: then the peer is length-prefixed and the
# certificate's user follows it).
_CONN = struct.Struct(">BQQB")
_F_LOOPBACK = 1
_F_TLS = 2
_LEN = struct.Struct(">I")


def _s(text: str) -> bytes:
    b = text.encode()
    return _LEN.pack(len(b)) + b


def encode(ev: Event, failed: bool = False) -> bytes:
    """The payload that journals ``ev`` (applied, or failed by the cluster)."""
    flag = FAILED if failed else 0
    if type(ev) is ClientData:
        return _DATA.pack(R_DATA | flag, ev.conn) + ev.data
    if type(ev) is Tick:
        return _Q.pack(R_TICK | flag, ev.now_ms)
    if type(ev) is DoOutput:
        return _QQ.pack(R_DO_OUTPUT | flag, ev.conn, ev.limit)
    if type(ev) is ClientConnected:
        if not ev.tls:
            return (
                _CONN.pack(R_CONNECTED | flag, ev.conn, ev.member, ev.loopback) + ev.peer.encode()
            )
        flags = (_F_LOOPBACK if ev.loopback else 0) | _F_TLS
        return (
            _CONN.pack(R_CONNECTED | flag, ev.conn, ev.member, flags)
            + _s(ev.peer)
            + ev.cert_user.encode()
        )
    if type(ev) is ClientDisconnected:
        return _Q.pack(R_DISCONNECTED | flag, ev.conn) + ev.reason.encode()
    if type(ev) is CloseClient:
        return _QH.pack(R_CLOSE_CLIENT | flag, ev.conn, ev.code) + ev.text.encode()
    if type(ev) is MemberLeft:
        return _Q.pack(R_MEMBER_LEFT | flag, ev.member)
    if type(ev) is ClusterMembers:
        return bytes([R_MEMBERS | flag]) + b"".join(_s(u) for u in ev.urls)
    if type(ev) is Recovered:
        return bytes([R_RECOVERED | flag])
    if type(ev) is DiskAlarm:
        return _Q.pack(R_DISK_ALARM | flag, ev.member) + bytes([ev.low])
    if type(ev) is AdminCommand:
        return _QQ.pack(R_ADMIN | flag, ev.member, ev.ticket) + _s(ev.user) + _s(ev.op) + ev.args
    if type(ev) is Forward:
        return bytes([R_FORWARD | flag]) + encode_forward(ev)
    if type(ev) is Changes:
        return bytes([R_CHANGES | flag]) + ev.data
    raise InvariantError(f"cannot journal {ev!r}")


def decode(payload: bytes) -> tuple[Event, bool]:
    """The event a payload journals, and whether the cluster failed it."""
    if not payload:
        raise InvariantError("empty journal record")
    kind = payload[0] & ~FAILED
    failed = bool(payload[0] & FAILED)
    ev: Event
    if kind == R_DATA:
        ev = ClientData(_DATA.unpack_from(payload)[1], payload[_DATA.size :])
    elif kind == R_TICK:
        ev = Tick(_Q.unpack_from(payload)[1])
    elif kind == R_DO_OUTPUT:
        _, conn, limit = _QQ.unpack_from(payload)
        ev = DoOutput(conn, limit)
    elif kind == R_CONNECTED:
        _, conn, member, flags = _CONN.unpack_from(payload)
        loopback = bool(flags & _F_LOOPBACK)
        if not flags & _F_TLS:
            ev = ClientConnected(conn, member, payload[_CONN.size :].decode(), loopback)
        else:
            (n,) = _LEN.unpack_from(payload, _CONN.size)
            p = _CONN.size + _LEN.size
            peer = payload[p : p + n].decode()
            ev = ClientConnected(conn, member, peer, loopback, True, payload[p + n :].decode())
    elif kind == R_DISCONNECTED:
        ev = ClientDisconnected(_Q.unpack_from(payload)[1], payload[_Q.size :].decode())
    elif kind == R_CLOSE_CLIENT:
        _, conn, code = _QH.unpack_from(payload)
        ev = CloseClient(conn, code, payload[_QH.size :].decode())
    elif kind == R_MEMBER_LEFT:
        ev = MemberLeft(_Q.unpack_from(payload)[1])
    elif kind == R_MEMBERS:
        urls: list[str] = []
        p = 1
        while p < len(payload):
            (n,) = _LEN.unpack_from(payload, p)
            p += _LEN.size
            urls.append(payload[p : p + n].decode())
            p += n
        if p != len(payload):
            raise InvariantError("journal record: member list overruns its record")
        ev = ClusterMembers(tuple(urls))
    elif kind == R_RECOVERED:
        ev = Recovered()
    elif kind == R_DISK_ALARM:
        ev = DiskAlarm(_Q.unpack_from(payload)[1], bool(payload[_Q.size]))
    elif kind == R_FORWARD:
        ev = decode_forward(payload, 1)[0]
    elif kind == R_CHANGES:
        ev = Changes(payload[1:])
    elif kind == R_ADMIN:
        _, member, ticket = _QQ.unpack_from(payload)
        p = _QQ.size
        (n,) = _LEN.unpack_from(payload, p)
        user = payload[p + 4 : p + 4 + n].decode()
        p += 4 + n
        (n,) = _LEN.unpack_from(payload, p)
        op = payload[p + 4 : p + 4 + n].decode()
        ev = AdminCommand(member, ticket, user, op, payload[p + 4 + n :])
    else:
        raise InvariantError(f"unknown journal record type {kind}")
    return ev, failed

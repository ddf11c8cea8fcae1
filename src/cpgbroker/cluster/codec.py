"""How events travel in CPG messages.

One CPG message carries a *batch*: the magic ``b"\\xcb"``, a format byte, then events back to
back. Batching many client frames per CPG message is what makes replication cheap (CPG costs
~10-15 us per message in Python whatever its size). A member's events keep their submission
order inside and across batches, so the order of every connection's bytes is preserved.

Connection ids are ``(member << 32) | counter``: unique across the cluster because the member id
is unique among live members, and compact on the wire as ``member:u64 counter:u32``.

Cluster control events (:class:`Hello`, :class:`Checkpoint`, :class:`ErrorCheck`, ...) ride in
the same stream, so they are ordered with client traffic: every member sees a checkpoint at
the same event sequence.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import attrs

from cpgbroker.errors import ClusterError
from cpgbroker.model import cpg_type
from cpgbroker.model.events import (
    AdminCommand,
    Changes,
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    DiskAlarm,
    DoOutput,
    Forward,
    Tick,
    decode_forward,
    encode_forward,
)

MAGIC = 0xCB
# 2: Hello carries the state a member kept when its partition lost quorum.
# 3: error-check rounds and stop requests.
# 4: progress reports carry the durable sequence; disk alarms.
# 5: a connection says whether it came over TLS and whom its client certificate names.
# 6: operators' changes (AdminCommand) and federation links' messages (Forward).
FORMAT = 6

# Model events: model/eventtypes.py numbers every kind once, for this codec and the journal's.
T_DATA = cpg_type(ClientData)
T_CONNECTED = cpg_type(ClientConnected)
T_DISCONNECTED = cpg_type(ClientDisconnected)
T_DO_OUTPUT = cpg_type(DoOutput)
T_CLOSE_CLIENT = cpg_type(CloseClient)
T_TICK = cpg_type(Tick)
T_DISK_ALARM = cpg_type(DiskAlarm)
# Cluster control events: never applied to a model, never journaled.
T_HELLO = 10
T_CHECKPOINT = 11
T_PROGRESS = 12
T_UPDATE_REQUEST = 13
T_ERROR_CHECK = 14
T_STOP = 15
T_ADMIN = cpg_type(AdminCommand)
T_FORWARD = cpg_type(Forward)
# A hot-standby primary's change batch (model/standby/replica.py): u32 length, the batch.
T_CHANGES = cpg_type(Changes)

# ClientConnected's flags.
F_LOOPBACK = 1
F_TLS = 2

STATUS_NEW = 0
STATUS_READY = 1
STATUS_NAMES = {STATUS_NEW: "new", STATUS_READY: "ready"}


@attrs.frozen
class Hello:
    """A member announces itself after joining, and ready members answer every join.

    ``config_digest`` must match for members to share state, and the cluster's model version
    must be one each member applies (cluster/membership.py): ``model_version`` is the version
    of the sender's state (a member without state announces the lowest it applies), and
    ``software`` says which versions it applies (:func:`software_range`). ``status`` says
    whether the sender already serves (its state is not the empty initial state).
    """

    member: int
    status: int
    model_version: int
    config_digest: bytes
    url: str
    software: str
    # The sender's clock (ms) when it said hello: members becoming ready start cluster time at
    # the latest of these, so the first client event never sees time jump from zero.
    now_ms: int = 0
    # The state a member kept (0, 0: none): kept in memory when its partition lost quorum, or
    # recovered from its store after the whole cluster stopped. Nobody serves then, so the
    # freshest such state is resumed: the latest history epoch (a forced boot starts a new one,
    # which must win over stores it did not see), then the most events (one cluster history
    # numbers its events alike on every member: nothing is applied in an inquorate ring).
    recover_epoch: int = 0
    recover_seq: int = 0


# A Hello's ``software`` names the release and, since release 0.2.0, the model versions it
# applies: "cpgbroker 0.2.0 (models 7-8)". The range rides in this text, which release 0.1.0
# shows without reading it, because 0.1.0's decoder refuses a Hello with any field more: a new
# member must be able to join a cluster of old ones. A Hello without a range (0.1.0) applies
# only the ``model_version`` it announces.
_RANGE = re.compile(r" \(models (\d+)-(\d+)\)$")


def software_label(release: str, oldest: int, newest: int) -> str:
    """What a member announces as its software: its release and the model versions it applies."""
    return f"cpgbroker {release} (models {oldest}-{newest})"


def software_range(h: Hello) -> tuple[int, int]:
    """The model versions the sender of ``h`` applies (lowest, highest)."""
    m = _RANGE.search(h.software)
    if m is None:
        return h.model_version, h.model_version
    lo, hi = int(m.group(1)), int(m.group(2))
    return (lo, hi) if lo <= hi else (h.model_version, h.model_version)


@attrs.frozen
class Checkpoint:
    """``member``'s model digest after applying event ``seq``."""

    member: int
    seq: int
    digest: bytes


@attrs.frozen
class Progress:
    """``member`` has applied events up to ``seq``: lets the others see how far behind it is;
    and its store holds events up to ``durable`` (a member without a store says ``seq``)."""

    member: int
    seq: int
    durable: int = 0


@attrs.frozen
class UpdateRequest:
    """Newcomer ``member`` asks ``updater`` for the state at the point where this request is
    delivered. The updater connects to ``address`` and proves with ``token`` that it is the
    member this request reached: the token travels only inside the CPG group."""

    member: int
    updater: int
    address: str
    token: bytes


@attrs.frozen
class ErrorCheck:
    """``member``'s outcome of applying event ``seq``: ``OK``, or the error it hit there that
    the stream does not explain (a failed local write, an unexpected exception). The first one
    for a ``seq`` opens an error-check round; every ready member answers with its own outcome
    and the majority decides who leaves (docs/architecture.md, "Error-check rounds")."""

    member: int
    seq: int
    outcome: str


OK = "ok"


@attrs.frozen
class StopRequest:
    """Stop ``target`` (0: every member) at the point where this request is delivered."""

    member: int
    target: int


ClusterControl = Hello | Checkpoint | Progress | UpdateRequest | ErrorCheck | StopRequest

_CONN = struct.Struct(">QI")
_PROGRESS = struct.Struct(">QQQ")
_DATA = struct.Struct(">BQII")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

HEADER = bytes([MAGIC, FORMAT])


def conn_id(member: int, counter: int) -> int:
    return (member << 32) | counter


def split_conn(conn: int) -> tuple[int, int]:
    return conn >> 32, conn & 0xFFFFFFFF


def _str(s: str) -> bytes:
    b = s.encode()
    return _U16.pack(len(b)) + b


def encode_data(conn: int, data: bytes) -> bytes:
    """The hot path: one client read as one event."""
    return _DATA.pack(T_DATA, conn >> 32, conn & 0xFFFFFFFF, len(data)) + data


def encode(ev: Any) -> bytes:
    t = type(ev)
    if t is ClientData:
        return encode_data(ev.conn, ev.data)
    if t is ClientConnected:
        return (
            _U8.pack(T_CONNECTED)
            + _CONN.pack(*split_conn(ev.conn))
            + _U8.pack((F_LOOPBACK if ev.loopback else 0) | (F_TLS if ev.tls else 0))
            + _str(ev.peer)
            + _str(ev.cert_user)
        )
    if t is ClientDisconnected:
        return _U8.pack(T_DISCONNECTED) + _CONN.pack(*split_conn(ev.conn)) + _str(ev.reason)
    if t is DoOutput:
        return _U8.pack(T_DO_OUTPUT) + _CONN.pack(*split_conn(ev.conn)) + _U32.pack(ev.limit)
    if t is CloseClient:
        return (
            _U8.pack(T_CLOSE_CLIENT)
            + _CONN.pack(*split_conn(ev.conn))
            + _U16.pack(ev.code)
            + _str(ev.text)
        )
    if t is Tick:
        return _U8.pack(T_TICK) + _U64.pack(ev.now_ms)
    if t is DiskAlarm:
        return _U8.pack(T_DISK_ALARM) + _U64.pack(ev.member) + _U8.pack(ev.low)
    if t is Hello:
        return (
            _U8.pack(T_HELLO)
            + _U64.pack(ev.member)
            + _U8.pack(ev.status)
            + _U16.pack(ev.model_version)
            + _U8.pack(len(ev.config_digest))
            + bytes(ev.config_digest)
            + _str(ev.url)
            + _str(ev.software)
            + _U64.pack(ev.now_ms)
            + _U64.pack(ev.recover_epoch)
            + _U64.pack(ev.recover_seq)
        )
    if t is Checkpoint:
        return (
            _U8.pack(T_CHECKPOINT)
            + _U64.pack(ev.member)
            + _U64.pack(ev.seq)
            + _U8.pack(len(ev.digest))
            + bytes(ev.digest)
        )
    if t is Progress:
        return _U8.pack(T_PROGRESS) + _PROGRESS.pack(ev.member, ev.seq, ev.durable)
    if t is UpdateRequest:
        return (
            _U8.pack(T_UPDATE_REQUEST)
            + _U64.pack(ev.member)
            + _U64.pack(ev.updater)
            + _str(ev.address)
            + _U8.pack(len(ev.token))
            + bytes(ev.token)
        )
    if t is ErrorCheck:
        return _U8.pack(T_ERROR_CHECK) + _U64.pack(ev.member) + _U64.pack(ev.seq) + _str(ev.outcome)
    if t is StopRequest:
        return _U8.pack(T_STOP) + _U64.pack(ev.member) + _U64.pack(ev.target)
    if t is AdminCommand:
        return (
            _U8.pack(T_ADMIN)
            + _U64.pack(ev.member)
            + _U64.pack(ev.ticket)
            + _str(ev.user)
            + _str(ev.op)
            + _U32.pack(len(ev.args))
            + bytes(ev.args)
        )
    if t is Forward:
        return _U8.pack(T_FORWARD) + encode_forward(ev)
    if t is Changes:
        data: bytes = ev.data
        return _U8.pack(T_CHANGES) + _U32.pack(len(data)) + data
    raise ClusterError(f"cannot encode {ev!r}")


def decode_batch(data: bytes, sender: int) -> list[Any]:
    """Events of one CPG message multicast by member ``sender``. Connection events must be for
    the sender's own clients: a member never speaks for another's connections."""
    if len(data) < 2 or data[0] != MAGIC:
        raise ClusterError("CPG message without the cpgbroker batch header")
    if data[1] != FORMAT:
        raise ClusterError(f"CPG batch format {data[1]} is not {FORMAT}")
    out: list[Any] = []
    p = 2
    n = len(data)
    mv = memoryview(data)
    try:
        while p < n:
            t = data[p]
            if t == T_DATA:
                _t, member, counter, size = _DATA.unpack_from(data, p)
                if member != sender:
                    raise ClusterError(f"member {sender} sent data for member {member}'s client")
                p += 17
                out.append(ClientData((member << 32) | counter, bytes(mv[p : p + size])))
                p += size
                continue
            p += 1
            if t == T_TICK:
                out.append(Tick(_U64.unpack_from(data, p)[0]))
                p += 8
                continue
            if t == T_DISK_ALARM:
                member = _U64.unpack_from(data, p)[0]
                if member != sender:
                    raise ClusterError(f"member {sender} sent a disk alarm for member {member}")
                out.append(DiskAlarm(member, bool(data[p + 8])))
                p += 9
                continue
            if t in (T_CONNECTED, T_DISCONNECTED, T_DO_OUTPUT, T_CLOSE_CLIENT):
                member, counter = _CONN.unpack_from(data, p)
                if member != sender:
                    raise ClusterError(
                        f"member {sender} sent an event for member {member}'s client"
                    )
                p += 12
                conn = (member << 32) | counter
                if t == T_CONNECTED:
                    flags = data[p]
                    peer, p = _read_str(data, p + 1)
                    cert_user, p = _read_str(data, p)
                    out.append(
                        ClientConnected(
                            conn,
                            member,
                            peer,
                            bool(flags & F_LOOPBACK),
                            bool(flags & F_TLS),
                            cert_user,
                        )
                    )
                elif t == T_DISCONNECTED:
                    reason, p = _read_str(data, p)
                    out.append(ClientDisconnected(conn, reason))
                elif t == T_DO_OUTPUT:
                    out.append(DoOutput(conn, _U32.unpack_from(data, p)[0]))
                    p += 4
                else:
                    code = _U16.unpack_from(data, p)[0]
                    text, p = _read_str(data, p + 2)
                    out.append(CloseClient(conn, code, text))
                continue
            if t == T_HELLO:
                member = _U64.unpack_from(data, p)[0]
                status = data[p + 8]
                version = _U16.unpack_from(data, p + 9)[0]
                dlen = data[p + 11]
                digest = bytes(data[p + 12 : p + 12 + dlen])
                url, p = _read_str(data, p + 12 + dlen)
                software, p = _read_str(data, p)
                now_ms, recover_epoch, recover_seq = struct.unpack_from(">QQQ", data, p)
                p += 24
                out.append(
                    Hello(
                        member,
                        status,
                        version,
                        digest,
                        url,
                        software,
                        now_ms,
                        recover_epoch,
                        recover_seq,
                    )
                )
                continue
            if t == T_PROGRESS:
                member, seq, durable = _PROGRESS.unpack_from(data, p)
                out.append(Progress(member, seq, durable))
                p += _PROGRESS.size
                continue
            if t == T_UPDATE_REQUEST:
                member, updater = struct.unpack_from(">QQ", data, p)
                if member != sender:
                    raise ClusterError(f"member {sender} asked for an update for {member}")
                address, p = _read_str(data, p + 16)
                tlen = data[p]
                token = bytes(data[p + 1 : p + 1 + tlen])
                if len(token) != tlen:
                    raise IndexError("token past the end of the batch")
                out.append(UpdateRequest(member, updater, address, token))
                p += 1 + tlen
                continue
            if t == T_ERROR_CHECK:
                member, seq = struct.unpack_from(">QQ", data, p)
                if member != sender:
                    raise ClusterError(f"member {sender} sent an error-check for {member}")
                outcome, p = _read_str(data, p + 16)
                out.append(ErrorCheck(member, seq, outcome))
                continue
            if t == T_STOP:
                member, target = struct.unpack_from(">QQ", data, p)
                if member != sender:
                    raise ClusterError(f"member {sender} sent a stop request for {member}")
                out.append(StopRequest(member, target))
                p += 16
                continue
            if t == T_ADMIN:
                member, ticket = struct.unpack_from(">QQ", data, p)
                if member != sender:
                    raise ClusterError(f"member {sender} sent an admin command for {member}")
                user, p = _read_str(data, p + 16)
                op, p = _read_str(data, p)
                size = _U32.unpack_from(data, p)[0]
                args = bytes(data[p + 4 : p + 4 + size])
                if len(args) != size:
                    raise IndexError("admin arguments past the end of the batch")
                out.append(AdminCommand(member, ticket, user, op, args))
                p += 4 + size
                continue
            if t == T_CHANGES:
                size = _U32.unpack_from(data, p)[0]
                batch = bytes(mv[p + 4 : p + 4 + size])
                if len(batch) != size:
                    raise IndexError("change batch past the end of the batch")
                out.append(Changes(batch))
                p += 4 + size
                continue
            if t == T_FORWARD:
                fwd, p = decode_forward(data, p)
                if fwd.member != sender:
                    raise ClusterError(f"member {sender} sent messages of {fwd.member}'s link")
                out.append(fwd)
                continue
            if t == T_CHECKPOINT:
                member, seq = struct.unpack_from(">QQ", data, p)
                dlen = data[p + 16]
                out.append(Checkpoint(member, seq, bytes(data[p + 17 : p + 17 + dlen])))
                p += 17 + dlen
                continue
            raise ClusterError(f"unknown event type {t} in CPG batch from member {sender}")
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ClusterError(f"truncated CPG batch from member {sender}: {e}") from None
    if p != n:
        raise ClusterError(f"CPG batch from member {sender} overruns its length")
    return out


def _read_str(data: bytes, p: int) -> tuple[str, int]:
    n = _U16.unpack_from(data, p)[0]
    end = p + 2 + n
    if end > len(data):
        raise IndexError("string past the end of the batch")
    return data[p + 2 : end].decode(), end

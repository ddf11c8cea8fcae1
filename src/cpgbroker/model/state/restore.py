"""Restoring the broker model from a snapshot (``model/state/snapshot.py``), part by part.

A member receiving a state update restores while it does other work (:class:`Restorer`
takes the parts in the order ``snapshot.parts`` yields them); a store restores its
checkpoint; a hot-standby backup becoming primary restores a copy of its replica (parts
carrying entries and messages themselves: ``snapshot.parts``, ``share``). Every connection
comes back as a shadow: the restoring member owns none of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cpgbroker.errors import InvariantError
from cpgbroker.model import entities as E
from cpgbroker.model.broker import Broker
from cpgbroker.model.canonical import (
    SNAPSHOT_FORMAT,
    queue_from_meta,
    restore_user,
    vhost_from_part,
)
from cpgbroker.model.config import BrokerConfig, Policy
from cpgbroker.model.entities import (
    Channel,
    Connection,
    Consumer,
    Entry,
    Message,
    PendingPublish,
    Queue,
    TxAck,
    TxNack,
    TxOp,
    TxPublish,
)
from cpgbroker.model.federation import Upstream
from cpgbroker.model.routing.topology import VHost
from cpgbroker.model.versions import NEWEST, OLDEST, supports
from cpgbroker.wire import fastpath as fp
from cpgbroker.wire.framer import FrameReader


def restore(data: Iterable[Any], config: BrokerConfig | None = None) -> Broker:
    """Rebuild a broker from ``snapshot.snapshot`` output (or ``snapshot.parts`` themselves)."""
    r = Restorer(config)
    for part in data:
        r.feed(part)
    return r.finish()


class Restorer:
    """Rebuilds a broker part by part, in the order :func:`parts` yields them, so a member
    receiving a state transfer can restore while it does other work. Every connection comes
    back as a shadow (``emit`` false): the restoring member owns none of them."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.b = Broker(config)
        self.head: dict[str, Any] | None = None
        self.vhosts: list[VHost] = []
        self.queues: list[Queue] = []
        self.msgs: dict[int, Message] = {}
        self.consumers: dict[tuple[int, int, str], Consumer] = {}
        self.tail: dict[str, Any] | None = None
        # Queue index -> ids of the connections it holds back (resolved once they exist).
        self.flow_paused: dict[int, list[int]] = {}
        self.parts = 0
        self.messages = 0  # ready and unacked entries restored so far (progress)
        # Messages came from the back, some left out (``parts``, ``gone``): the byte counts
        # the head and the queues carry are recounted from what arrived.
        self.from_back = False

    def feed(self, part: Any) -> None:
        self.parts += 1
        if self.head is None:
            if not isinstance(part, dict) or part.get("format") != SNAPSHOT_FORMAT:
                got = part.get("format") if isinstance(part, dict) else type(part).__name__
                raise InvariantError(f"snapshot format {got} is not {SNAPSHOT_FORMAT}")
            self._head(part)
            self.from_back = bool(part.get("from_back"))
            return
        if self.tail is not None:
            raise InvariantError("snapshot part after the tail")
        kind = part[0]
        if kind == "entries":
            self._messages(part[2])
            q = self.queues[part[1]]
            rows = part[3]
            if rows and type(rows[0]) is Entry:  # copies already (``parts``, ``share``)
                q.messages.extend(rows)
            else:
                msgs = self.msgs
                q.messages.extend(Entry(msgs[r[0]], *r[1:]) for r in rows)
            self.messages += len(rows)
        elif kind == "entries_back":
            # A replica's update from the back of each queue (``parts``, ``gone``).
            self._messages(part[2])
            q = self.queues[part[1]]
            msgs = self.msgs
            front = [Entry(msgs[r[0]], *r[1:]) for r in part[3]]
            for e in reversed(front):
                q.messages.appendleft(e)
            self.messages += len(front)
        elif kind == "queue":
            self._queue(part[1], part[2])
        elif kind == "vhost":
            self._vhost(part[1])
        elif kind == "conn":
            self._messages(part[1])
            self._connection(part[2])
        elif kind == "tail":
            self.tail = part[1]
        else:
            raise InvariantError(f"unknown snapshot part {kind!r}")

    def finish(self) -> Broker:
        if self.head is None or self.tail is None:
            raise InvariantError("snapshot ended before its tail")
        b, queues = self.b, self.queues
        if len(queues) != self.head["queues"]:
            raise InvariantError(
                f"snapshot has {len(queues)} queues, expected {self.head['queues']}"
            )
        for q, keys in zip(queues, self.tail["queue_consumers"], strict=True):
            q.consumers = [self.consumers[(k[0], k[1], k[2])] for k in keys]
            q.ranked_consumers = sum(1 for c in q.consumers if c.priority)
        for i, ids in self.flow_paused.items():
            # Connections leave every queue's list when they close: all are there.
            queues[i].flow_paused = {c: b.connections[c] for c in ids}
        if self.from_back:
            # (A replica: every message of a queue, out with a consumer or not, is in it.)
            for q in queues:
                q.ready_bytes = sum(len(e.msg.body) for e in q.messages)
            b.mark.recount(sum(q.ready_bytes for q in queues if not q.deleted))
        b.flow.restore(queues)
        b.topology.restore(
            self.vhosts,
            tuple(self.head["member_urls"]),
            [queues[i] for i in self.tail["ttl_queues"]],
            [queues[i] for i in self.tail["expiring"]],
        )
        b.policies.mark_applied(b.vhosts.values())
        b.timeouts.rebuild()
        _check(b)
        return b

    # -- parts
    def _head(self, h: dict[str, Any]) -> None:
        # Absent: written at the oldest model version (as every release before versions did).
        version = h.get("model_version", OLDEST)
        if not isinstance(version, int) or not supports(version):
            raise InvariantError(
                f"the snapshot holds a state at model version {version}; this software applies "
                f"model versions {OLDEST} to {NEWEST}"
            )
        self.b.version.current = version
        self.b.restore_counters(
            now_ms=h["now_ms"],
            event_seq=h["event_seq"],
            msg_seq=h["msg_seq"],
            queued_bytes=h["queued_bytes"],
            blocked=h["blocked"],
            # Written only with a disk alarm (see _head).
            memory_blocked=h.get("memory_blocked", h["blocked"]),
            disk_alarms=h.get("disk_alarms", []),
        )
        if "users" in h:
            self.b.users.restore(restore_user(d) for d in h["users"])
        self.b.policies.restore([Policy(*p) for p in h.get("policies", [])])
        fed = h.get("federation", {"upstreams": [], "status": [], "recent": []})
        self.b.federation.restore(
            [Upstream(u[0], u[1], tuple(u[2]), *u[3:]) for u in fed["upstreams"]],
            fed["status"],
            fed["recent"],
        )
        self.head = h

    def _messages(self, rows: list[Any]) -> None:
        msgs = self.msgs
        for m in rows:
            if type(m) is Message:  # shared (``parts``, ``share``)
                msgs[m.id] = m
            else:
                msgs[m[0]] = _restore_message(m)

    def _entry(self, raw: list[Any]) -> Entry:
        return Entry(self.msgs[raw[0]], *raw[1:])

    def _queue(self, i: int, qd: dict[str, Any]) -> None:
        if i != len(self.queues):
            raise InvariantError(f"snapshot queue {i} out of order")
        self.queues.append(queue_from_meta(qd))
        if "flow_paused" in qd:
            self.flow_paused[i] = qd["flow_paused"]

    def _vhost(self, vd: dict[str, Any]) -> None:
        self.vhosts.append(vhost_from_part(vd, self.queues))

    def _connection(self, cd: dict[str, Any]) -> None:
        queues = self.queues
        conn = Connection(
            id=cd["id"],
            member=cd["member"],
            peer=cd["peer"],
            loopback=cd["loopback"],
            reader=FrameReader(cd["reader_frame_max"]),
            tls=cd.get("tls", False),
            cert_user=cd.get("cert_user", ""),
            state=cd["state"],
            header_buf=cd["header_buf"],
            user=cd["user"],
            vhost=cd["vhost"],
            channel_max=cd["channel_max"],
            frame_max=cd["frame_max"],
            heartbeat=cd["heartbeat"],
            capabilities=cd["capabilities"],
            client_properties=cd["client_properties"],
            credit=cd["credit"],
            want_output=cd["want_output"],
            granted=cd["granted"],
            last_rx_ms=cd["last_rx_ms"],
            last_tx_ms=cd["last_tx_ms"],
            close_deadline=cd["close_deadline"],
            exclusive_queues=dict.fromkeys(cd["exclusive_queues"]),
            counter=cd["counter"],
            published=cd["published"],
            blocked_sent=cd["blocked_sent"],
            emit=False,
        )
        if cd["reader_pending"]:
            conn.reader.feed(cd["reader_pending"])
        for chd in cd["channels"]:
            ch = Channel(
                chd["id"],
                conn,
                closing=chd["closing"],
                flow_active=chd["flow_active"],
                prefetch_count=chd["prefetch_count"],
                global_prefetch=chd["global_prefetch"],
                next_tag=chd["next_tag"],
                confirm=chd["confirm"],
                publish_seq=chd["publish_seq"],
                confirm_pending=chd["confirm_pending"],
                confirm_sent=chd["confirm_sent"],
                tx=chd["tx"],
                last_queue=chd["last_queue"],
            )
            for kd in chd["consumers"]:
                c = Consumer(
                    kd["tag"],
                    queues[kd["queue"]],
                    ch,
                    kd["no_ack"],
                    kd["exclusive"],
                    kd["prefetch"],
                    kd["args"],
                )
                c.unacked = kd["unacked"]
                ch.consumers[c.tag] = c
                self.consumers[(conn.id, ch.id, c.tag)] = c
            for row in chd["unacked"]:
                tag, qi, raw, ctag = row[:4]
                ch.unacked[tag] = (
                    queues[qi],
                    self._entry(raw),
                    None if ctag is None else ch.consumers.get(ctag),
                    # Its time from model version 8 on (snapshot._channel); at 7 nothing
                    # reads it (the switch to 8 sets it anew: model/messages/consumertimeout.py).
                    row[4] if len(row) > 4 else 0,
                )
            self.messages += len(chd["unacked"])
            ch.tx_ops.extend(_restore_tx_op(op) for op in chd["tx_ops"])
            if chd["pending"] is not None:
                exchange, rk, mandatory, header, remaining, parts = chd["pending"]
                pend = ch.pending = PendingPublish(exchange, rk, mandatory)
                if header is not None:
                    pend.header = header
                    # (Checked at publish, at the version of the day: never refused again.)
                    pend.info = fp.parse_content_header(header, roundtrip=False)
                pend.remaining = remaining
                pend.parts = list(parts) or None
            conn.channels[ch.id] = ch
        self.b.protocol.restore(conn)


def _restore_message(m: list[Any]) -> Message:
    info = fp.parse_content_header(m[3], roundtrip=False)
    return Message(m[0], m[1], m[2], m[3], m[4], m[5], m[6], info.headers_span)


def _check(b: Broker) -> None:
    for conn in b.connections.values():
        if conn.state not in (
            E.AWAIT_HEADER,
            E.AWAIT_START_OK,
            E.AWAIT_TUNE_OK,
            E.AWAIT_OPEN,
            E.OPEN,
            E.CLOSING,
        ):
            raise InvariantError(f"restored connection {conn.id} in state {conn.state}")


def _restore_tx_op(raw: list[Any]) -> TxOp:
    kind = raw[0]
    if kind == "publish":
        return TxPublish(_restore_message(raw[1]), raw[2])
    if kind == "ack":
        return TxAck(raw[1], raw[2])
    if kind == "nack":
        return TxNack(raw[1], raw[2], raw[3])
    raise InvariantError(f"unknown tx operation {kind!r} in snapshot")

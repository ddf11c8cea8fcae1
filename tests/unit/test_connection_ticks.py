"""Connection ticks (``ConnectionProtocol.on_tick`` over ``deadlines.Deadlines``' due-heap) behave
exactly as the full sweep of every connection did (``full_sweep`` below): same effects in the
same order and same state digest after every event of random workloads with many connections,
heartbeats both ways, handshake and close timeouts, connection errors, requeues that send to
other connections in the middle of a tick, disconnects and a member leaving, also across
snapshot restore; and a tick visits the connections that are due, not every connection
(counted, not timed)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pamqp import commands as C

from cpgbroker.model.broker import Broker
from cpgbroker.model.clients.connection import ConnectionProtocol
from cpgbroker.model.clients.deadlines import next_due
from cpgbroker.model.entities import CLOSING, OPEN
from cpgbroker.model.events import (
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    DoOutput,
    Event,
    MemberLeft,
    Send,
    Tick,
)
from cpgbroker.model.state import snapshot as S
from cpgbroker.wire.framer import HEARTBEAT_FRAME, PROTOCOL_HEADER
from modelclient import Client, Harness


def full_sweep(self: ConnectionProtocol) -> None:
    """The reference ``ConnectionProtocol.on_tick`` must match: every connection, in the dict's
    order, as ticks did before the due-heap."""
    now_ms = self._clock.now_ms
    for conn in list(self.connections.values()):
        if conn.state != OPEN:
            if conn.close_deadline is not None and now_ms >= conn.close_deadline:
                self.drop(
                    conn,
                    "no close-ok from client" if conn.state == CLOSING else "handshake timeout",
                    notify=True,
                )
                continue
            if conn.state == CLOSING:
                continue
        hb = conn.heartbeat * 1000
        if hb <= 0:
            continue
        if now_ms - conn.last_rx_ms > 2 * hb:
            self.drop(
                conn, f"missed heartbeats from client, timeout: {conn.heartbeat}s", notify=True
            )
            continue
        if now_ms - conn.last_tx_ms >= hb // 2:
            self._out.emit(conn, HEARTBEAT_FRAME)


HEARTBEATS = (0, 1, 1, 2, 3, 10)
STEPS_MS = (0, 1, 99, 250, 499, 500, 501, 999, 1000, 1001, 1500, 2001, 3000, 4001)


def _new_client(rng: random.Random, h: Harness, conn_id: int) -> Client:
    """A connection taken to a random point of the handshake; open ones consume from or
    publish to the shared queue (deliveries move between connections)."""
    c = h.connect(conn_id, member=rng.choice((0, 0, 1)))
    stage = rng.random()
    if stage < 0.1:
        return c  # never sends a byte: handshake timeout
    if stage < 0.18:
        c.send_raw(PROTOCOL_HEADER)
        return c
    hb = rng.choice(HEARTBEATS)
    if stage < 0.3:
        c.send_raw(PROTOCOL_HEADER)
        c.rpc(0, C.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
        # Heartbeats negotiated, connection.open never sent: both kinds of deadline at once.
        c.send(0, C.Connection.TuneOk(channel_max=16, frame_max=131072, heartbeat=hb))
        return c
    c.handshake(heartbeat=hb)
    c.channel(1)
    c.send(1, C.Queue.Declare(queue="shared", nowait=True))
    if rng.random() < 0.6:
        c.send(1, C.Basic.Qos(prefetch_count=rng.choice((1, 2, 5))))
        c.send(1, C.Basic.Consume(queue="shared", consumer_tag="t", nowait=True))
    return c


def _workload(seed: int, steps: int) -> list[Event]:
    """A random event log over many connections (DoOutputs included: the harness grants)."""
    rng = random.Random(seed)
    h = Harness(credit=4)
    now = 1000
    h.apply(Tick(now))
    clients: dict[int, Client] = {}
    next_id = 1
    for _ in range(steps):
        live = [c for cid, c in clients.items() if cid in h.broker.connections]
        op = rng.random()
        if op < 0.12 or len(live) < 3:
            if live and rng.random() < 0.05:
                # A new connection under the id of one that is gone: the end of the order.
                gone = [cid for cid in clients if cid not in h.broker.connections]
                cid = rng.choice(gone) if gone else next_id
            else:
                cid = next_id
            if cid == next_id:
                next_id += 1
            clients[cid] = _new_client(rng, h, cid)
            continue
        c = rng.choice(live)
        conn = h.broker.connections[c.conn]
        if op < 0.4:
            now += rng.choice(STEPS_MS)
            h.apply(Tick(now))
        elif op < 0.5:
            c.send_raw(HEARTBEAT_FRAME)  # the client's heartbeat: only its last receive moves
        elif op < 0.6:
            if conn.state == OPEN and 1 in conn.channels:
                for _ in range(rng.randrange(1, 4)):
                    c.publish(1, "", "shared", b"m")
        elif op < 0.66:
            ch = conn.channels.get(1)
            if conn.state == OPEN and ch is not None and ch.unacked:
                tag = rng.choice(list(ch.unacked))
                c.send(1, C.Basic.Ack(delivery_tag=tag, multiple=rng.random() < 0.3))
        elif op < 0.71:
            # A connection error: connection.close 504 sent, a close timeout started.
            c.send(0, C.Basic.Qos(prefetch_count=1))
        elif op < 0.76:
            if conn.state == CLOSING:
                c.send(0, C.Connection.CloseOk())
        elif op < 0.79:
            h.apply(ClientDisconnected(c.conn))
        elif op < 0.81:
            h.apply(CloseClient(c.conn, 320, "shutdown"))
        elif op < 0.812:
            h.apply(MemberLeft(1))
        else:
            now += rng.choice(STEPS_MS)
            h.apply(Tick(now))
    return h.log


def check_deadlines(b: Broker) -> None:
    """Every connection that can become due has a live heap entry no later than its due time;
    order numbers follow the connections' order."""
    d = b.protocol.deadlines
    assert list(d.order) == list(b.connections)
    orders = list(d.order.values())
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    assert all(o < d.next_order for o in orders)
    assert all(cid in b.connections for cid in d.due)
    live = {(t, o, cid) for t, o, cid in d.heap}
    for cid, conn in b.connections.items():
        due = next_due(conn)
        if due is None:
            continue
        assert cid in d.due and d.due[cid] <= due, cid
        assert (d.due[cid], d.order[cid], cid) in live, cid


def _run(log: list[Event], b: Broker) -> list[tuple[list[Any], str]]:
    return [(b.apply(ev), S.digest(b)) for ev in log]


@pytest.mark.parametrize("seed", range(6))
def test_connection_ticks_match_the_full_sweep(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _workload(seed, 700)
    assert sum(isinstance(ev, Tick) for ev in log) > 150
    assert sum(isinstance(ev, ClientConnected) for ev in log) > 40
    b = Broker()
    got = []
    dropped_on_tick = 0
    for ev in log:
        before = len(b.connections)
        got.append((b.apply(ev), S.digest(b)))
        check_deadlines(b)
        dropped_on_tick += isinstance(ev, Tick) and len(b.connections) < before
    # A replica restored half way goes on identically.
    half = len(log) // 2
    r = Broker()
    for ev in log[:half]:
        r.apply(ev)
    r = S.restore(S.snapshot(r))
    check_deadlines(r)
    restored = []
    for ev in log[half:]:
        r.apply(ev)  # its connections do not emit (output is not state): digests only
        check_deadlines(r)
        restored.append(S.digest(r))
    # The reference: every tick visits every connection, in the dict's order.
    monkeypatch.setattr(ConnectionProtocol, "on_tick", full_sweep)
    want = _run(log, Broker())
    monkeypatch.undo()
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"event {n}: {log[n]!r}"
    assert restored == [d for _, d in want[half:]]
    assert dropped_on_tick  # ticks did time connections out
    heartbeats = sum(
        eff.data.count(HEARTBEAT_FRAME) for effs, _ in got for eff in effs if isinstance(eff, Send)
    )
    assert heartbeats > 20  # and sent heartbeats


def test_a_requeue_in_the_middle_of_a_tick_spares_a_later_connection_its_heartbeat() -> None:
    """A tick drops a silent consumer whose unacked message goes to another connection, which
    was due for a heartbeat: the delivery is its output, so no heartbeat follows (as in the
    sweep, which visited it after the drop)."""
    h = Harness()
    a = h.connect(1)
    a.handshake(heartbeat=2)
    a.channel(1)
    a.send(1, C.Queue.Declare(queue="q"))
    a.send(1, C.Basic.Consume(queue="q", consumer_tag="a"))
    b = h.connect(2)
    b.handshake(heartbeat=2)
    b.channel(1)
    b.send(1, C.Basic.Qos(prefetch_count=1))
    b.publish(1, "", "q", b"m")  # delivered to a, unacked
    h.tick(1_100)
    b.send(1, C.Basic.Consume(queue="q", consumer_tag="b"))
    h.apply(DoOutput(2, 10))  # b may take deliveries at once
    a.recv()
    b.recv()
    b.send_raw(HEARTBEAT_FRAME)  # b is alive; a stays silent
    h.tick(4_100)  # a: silent > 4 s, dropped; b: 1 s since it last got output, due
    assert "missed heartbeats" in h.closed[1]
    got = b.recv()
    assert [type(f).__name__ for _ch, f in got] == ["Deliver", "ContentHeader", "ContentBody"]


def test_a_tick_visits_only_due_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness()
    n = 3_000
    for i in range(1, n + 1):
        c = h.connect(i)
        c.handshake(heartbeat=60)
    late = h.connect(n + 1)  # never sends a byte: handshake timeout at 10 s
    visits = 0
    tick = ConnectionProtocol._tick

    def counted(self: ConnectionProtocol, conn: Any, now_ms: int) -> None:
        nonlocal visits
        visits += 1
        tick(self, conn, now_ms)

    monkeypatch.setattr(ConnectionProtocol, "_tick", counted)
    for t in range(100, 10_000, 100):
        h.tick(t)
    assert visits == 0
    h.tick(10_000)
    assert visits == 1 and late.conn in h.closed
    h.tick(30_000)  # half the heartbeat interval: every connection gets one
    assert visits == 1 + n
    assert len(h.broker.protocol.deadlines.heap) == n


def test_deadlines_survive_restore_and_compact() -> None:
    h = Harness()
    for i in range(1, 201):
        c = h.connect(i)
        c.handshake(heartbeat=5)
    for i in range(1, 151):
        h.apply(ClientDisconnected(i))
    d = h.broker.protocol.deadlines
    # Entries of gone connections are dropped once they dominate the heap.
    assert len(d.heap) <= 2 * len(d.order) + 64
    check_deadlines(h.broker)
    r = S.restore(S.snapshot(h.broker))
    check_deadlines(r)
    assert list(r.protocol.deadlines.order) == list(range(151, 201))
    r.apply(Tick(2_500))
    assert len(r.protocol.deadlines.due) == 50
    h.apply(ClientData(151, HEARTBEAT_FRAME))
    check_deadlines(h.broker)

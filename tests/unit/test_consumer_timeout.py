"""Consumer timeouts (model/messages/consumertimeout.py, model version 8): a channel whose oldest
delivery to acknowledge waited longer than its queue's timeout is closed with RabbitMQ's 406
and text at the first tick past it, and what it held goes back to its queues, redelivered, on
every replica at the same event; at model version 7 nothing of it happens and nothing of it is
in snapshots. The due-heap behind it gives the effects, in the same order, and the digests of a
sweep of every channel at every tick (``full_sweep``), also across a restore half way."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands as C
from test_replica import Replica, assert_promotes_to

from cpgbroker.errors import ChannelError, ReplyCode
from cpgbroker.model.broker import Broker
from cpgbroker.model.changes import ChangeLog
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.entities import OPEN, Channel
from cpgbroker.model.events import AdminCommand, ClientDisconnected, Event, Tick
from cpgbroker.model.messages.consumertimeout import (
    ConsumerTimeouts,
    _close_order,
    _oldest,
    timeout_text,
)
from cpgbroker.model.operators.admin import RAISE_MODEL_VERSION
from cpgbroker.model.shipping import Shipper
from cpgbroker.model.state import snapshot as S
from cpgbroker.model.versions import NEWEST, OLDEST
from modelclient import Client, Harness

T = 500  # the configured timeout of most tests (ms)


def _broker(timeout: int | None = T, version: int = NEWEST) -> Broker:
    return Broker(BrokerConfig(consumer_timeout=timeout), version=version)


def _consumer(h: Harness, conn: int, queue: str = "q", prefetch: int = 10, **args: Any) -> Client:
    c = h.connect(conn)
    c.handshake()
    c.channel(1)
    c.send(1, C.Queue.Declare(queue=queue, arguments=args or None))
    c.send(1, C.Basic.Qos(prefetch_count=prefetch))
    c.send(1, C.Basic.Consume(queue=queue, consumer_tag=f"c{conn}"))
    return c


def _publisher(h: Harness, conn: int = 1_000_000) -> Client:
    p = h.connect(conn)
    p.handshake()
    p.channel(1)
    return p


def _closes(c: Client) -> list[Any]:
    return [m for m in c.methods() if isinstance(m, C.Channel.Close)]


def test_a_delivery_unacked_past_the_timeout_closes_its_channel_with_rabbitmqs_text() -> None:
    h = Harness(_broker())
    h.tick(1_000)
    c = _consumer(h, 1)
    p = _publisher(h)
    p.publish(1, "", "q", b"one")
    p.publish(1, "", "q", b"two")
    assert [body for _m, body in c.deliveries()] == [b"one", b"two"]
    h.tick(1_000 + T)  # waited exactly the timeout: RabbitMQ's test is "more than"
    assert _closes(c) == []
    h.tick(1_000 + T + 1)
    (close,) = _closes(c)
    assert close.reply_code == 406
    assert close.reply_text == (
        "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout value "
        f"used: {T} ms. This timeout value can be configured, see consumers doc guide to learn "
        "more"
    )
    assert (close.class_id, close.method_id) == (0, 0)
    # Its messages are back in the queue, redelivered, for the next consumer.
    q = h.broker.vhosts["/"].queues["q"]
    assert [e.msg.body for e in q.messages] == [b"one", b"two"]
    assert all(e.redelivered for e in q.messages) and q.unacked == 0
    c.send(1, C.Channel.CloseOk())
    other = _consumer(h, 2)
    got = other.deliveries()
    assert [(m.redelivered, body) for m, body in got] == [(True, b"one"), (True, b"two")]
    # The connection is still open; a new channel on it consumes again.
    assert 1 in h.broker.connections and h.broker.connections[1].state == OPEN


def test_model_version_7_never_times_a_consumer_out() -> None:
    h = Harness(_broker(version=OLDEST))
    h.tick(1_000)
    c = _consumer(h, 1)
    _publisher(h).publish(1, "", "q", b"m")
    assert len(c.deliveries()) == 1
    for t in (2_000, 10**7, 10**12):
        h.tick(t)
    assert _closes(c) == []
    assert h.broker.timeouts.heap == []
    # A version-7 snapshot carries no delivery time: release 0.1.0's rows.
    (row,) = _rows(h.broker)
    assert len(row) == 4


def test_the_queues_own_timeout_and_a_disabled_configuration() -> None:
    """``x-consumer-timeout`` (RabbitMQ 3.12) holds for its queue's deliveries whatever the
    configuration says; an integer of any type is the timeout, 0 closes at the next tick,
    any other value means none; without it the configuration's applies."""
    h = Harness(_broker(timeout=None))
    h.tick(1_000)
    plain = _consumer(h, 1, "plain")
    short = _consumer(h, 2, "short", **{"x-consumer-timeout": 200})
    zero = _consumer(h, 3, "zero", **{"x-consumer-timeout": 0})
    text = _consumer(h, 4, "text", **{"x-consumer-timeout": "200"})
    p = _publisher(h)
    for q in ("plain", "short", "zero", "text"):
        p.publish(1, "", q, b"m")
    h.tick(1_000)  # a tick at the time of the deliveries: none waited at all
    assert [_closes(c) for c in (plain, short, zero, text)] == [[], [], [], []]
    h.tick(1_001)
    assert [len(_closes(c)) for c in (plain, short, zero, text)] == [0, 0, 1, 0]
    h.tick(1_201)
    (close,) = _closes(short)
    assert "Timeout value used: 200 ms" in close.reply_text
    h.tick(10**9)
    assert _closes(plain) == [] and _closes(text) == []


def test_basic_get_deliveries_time_out_too() -> None:
    h = Harness(_broker())
    h.tick(1_000)
    p = _publisher(h)
    p.send(1, C.Queue.Declare(queue="q"))
    p.publish(1, "", "q", b"m")
    g = h.connect(2)
    g.handshake()
    g.channel(1)
    assert isinstance(g.rpc(1, C.Basic.Get(queue="q")), C.Basic.GetOk)
    h.tick(1_000 + T + 1)
    (close,) = _closes(g)
    assert close.reply_code == 406


def test_only_the_oldest_delivery_counts_as_in_rabbitmq() -> None:
    """Acking the oldest delivery gives the channel until the next one's own timeout."""
    h = Harness(_broker())
    h.tick(1_000)
    c = _consumer(h, 1)
    p = _publisher(h)
    p.publish(1, "", "q", b"a")
    h.tick(1_300)
    p.publish(1, "", "q", b"b")
    tags = [m.delivery_tag for m, _ in c.deliveries()]
    h.tick(1_000 + T)
    c.send(1, C.Basic.Ack(delivery_tag=tags[0]))
    h.tick(1_000 + T + 1)
    h.tick(1_300 + T)
    assert _closes(c) == []
    h.tick(1_300 + T + 1)
    assert len(_closes(c)) == 1


def test_the_oldest_deliverys_queue_decides_as_in_rabbitmq() -> None:
    """A channel consuming from a queue with a long timeout and one with a short one: the
    oldest delivery's queue's timeout decides (RabbitMQ 3.12's rule), also once the oldest is
    acknowledged and a delivery of the other queue becomes the oldest."""
    h = Harness(_broker(timeout=10_000))
    h.tick(1_000)
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    c.send(1, C.Queue.Declare(queue="long"))
    c.send(1, C.Queue.Declare(queue="short", arguments={"x-consumer-timeout": 100}))
    c.send(1, C.Basic.Consume(queue="long", consumer_tag="l"))
    c.send(1, C.Basic.Consume(queue="short", consumer_tag="s"))
    p = _publisher(h)
    p.publish(1, "", "long", b"l")
    h.tick(1_050)
    p.publish(1, "", "short", b"s")
    tags = {body: m.delivery_tag for m, body in c.deliveries()}
    for t in range(1_100, 1_600, 100):
        h.tick(t)  # the short queue's delivery is overdue, but it is not the oldest
    assert _closes(c) == []
    c.send(1, C.Basic.Ack(delivery_tag=tags[b"l"]))
    h.tick(1_600)
    (close,) = _closes(c)
    assert "Timeout value used: 100 ms" in close.reply_text


def test_acks_held_by_a_transaction_count_as_given() -> None:
    """RabbitMQ takes an acknowledged delivery off its list at the ack, also in a
    transaction; a rollback puts it back, with its old time."""
    h = Harness(_broker())
    h.tick(1_000)
    c = _consumer(h, 1)
    p = _publisher(h)
    p.publish(1, "", "q", b"m")
    (tag,) = [m.delivery_tag for m, _ in c.deliveries()]
    c.rpc(1, C.Tx.Select())
    c.send(1, C.Basic.Ack(delivery_tag=tag))
    h.tick(1_000 + T + 1)
    h.tick(5_000)
    assert _closes(c) == []
    c.rpc(1, C.Tx.Rollback())
    h.tick(5_100)
    assert len(_closes(c)) == 1


def test_deliveries_made_before_the_switch_to_version_8_count_from_it() -> None:
    h = Harness(_broker(version=OLDEST))
    h.tick(1_000)
    c = _consumer(h, 1)
    _publisher(h).publish(1, "", "q", b"m")
    h.tick(100_000)
    before = S.digest(h.broker)
    h.apply(
        AdminCommand(0, 1, "operator", RAISE_MODEL_VERSION, json.dumps({"version": 8}).encode())
    )
    assert h.broker.version.current == 8 and S.digest(h.broker) != before
    (row,) = _rows(h.broker)
    assert row[4] == 100_000  # the switch's time
    h.tick(100_000 + T)
    assert _closes(c) == []
    h.tick(100_000 + T + 1)
    assert len(_closes(c)) == 1


def test_a_restored_replica_closes_the_same_channel_at_the_same_event() -> None:
    h = Harness(_broker())
    h.tick(1_000)
    c = _consumer(h, 1)
    _consumer(h, 2)
    p = _publisher(h)
    for i in range(6):
        p.publish(1, "", "q", b"%d" % i)
        h.tick(1_000 + 10 * i)
    copy = S.restore((S.decode(S.encode(part)) for part in S.parts(h.broker)), h.broker.config)
    assert S.digest(copy) == S.digest(h.broker)
    # The rows carry each delivery's time (model version 8).
    rows = _rows(copy)
    assert rows and all(len(row) == 5 for row in rows)
    closed_at: dict[int, int] = {}
    for t in range(1_100, 1_700, 50):
        h.tick(t)
        copy.apply(Tick(t))
        assert S.digest(copy) == S.digest(h.broker)
        closing = _closing(h.broker)
        assert closing == _closing(copy), t
        for cid in closing:
            closed_at.setdefault(cid, t)
    # Both consumers held deliveries from the first tens of ms: closed at 1 550 and 1 600.
    assert closed_at == {1: 1_550, 2: 1_550}
    assert len(_closes(c)) == 1


def _rows(b: Broker) -> list[list[Any]]:
    """The unacked rows of every channel in ``b``'s snapshot."""
    return [
        row
        for part in S.snapshot(b)
        if isinstance(part, list) and part[0] == "conn"
        for ch in part[2]["channels"]
        for row in ch["unacked"]
    ]


def _closing(b: Broker) -> list[int]:
    return [
        conn.id for conn in b.connections.values() for ch in conn.channels.values() if ch.closing
    ]


# ------------------------------------------------------------------ the sweep it must equal


def full_sweep(self: ConsumerTimeouts) -> None:
    """The reference ``ConsumerTimeouts.on_tick``: every channel of every connection at every
    tick, RabbitMQ's rule applied to each, closes in the order of their due time."""
    if self._version.current < 8:
        return
    now = self._clock.now_ms
    found: list[tuple[int, int, int, Channel, int]] = []
    for conn in self._connections.values():
        if conn.state != OPEN:
            continue
        for ch in conn.channels.values():
            if ch.closing or not ch.unacked:
                continue
            oldest = _oldest(ch)
            if oldest is None:
                continue
            timeout = self.timeout_of(oldest[0])
            if timeout is None:
                continue
            real = oldest[3] + max(timeout, -1) + 1
            if real <= now:
                found.append((real, conn.id, ch.id, ch, timeout))
    found.sort(key=_close_order)
    assert self.close_channel is not None
    for _, _, _, ch, timeout in found:
        self.close_channel(
            ch.conn,
            ch.id,
            ChannelError(ReplyCode.PRECONDITION_FAILED, timeout_text(ch.id, timeout)),
        )


STEPS_MS = (0, 1, 50, 99, 100, 101, 250, 499, 500, 501, 1_000)
QUEUES = {"a": None, "b": {"x-consumer-timeout": 300}, "c": {"x-consumer-timeout": "x"}}


def _workload(seed: int, steps: int) -> list[Event]:
    """Connections with several channels consuming (and getting) from queues of different
    timeouts, acking late or never, in and out of transactions, closing channels, going away;
    ticks of every size."""
    rng = random.Random(seed)
    h = Harness(_broker(), credit=6)
    now = 1_000
    h.tick(now)
    p = _publisher(h)
    for q, args in QUEUES.items():
        p.send(1, C.Queue.Declare(queue=q, arguments=args))
    clients: list[Client] = []
    next_id = 1
    for _ in range(steps):
        live = [c for c in clients if c.conn in h.broker.connections]
        op = rng.random()
        if op < 0.06 or len(live) < 3:
            c = h.connect(next_id)
            next_id += 1
            c.handshake()
            clients.append(c)
            continue
        c = rng.choice(live)
        conn = h.broker.connections[c.conn]
        if conn.state != OPEN:
            h.apply(ClientDisconnected(c.conn))
            continue
        n = rng.choice((1, 2, 3))
        ch = conn.channels.get(n)
        if op < 0.3:
            now += rng.choice(STEPS_MS)
            h.tick(now)
        elif op < 0.4:
            for _ in range(rng.randrange(1, 4)):
                p.publish(1, "", rng.choice(list(QUEUES)), b"m")
        elif ch is None:
            c.channel(n)
            if rng.random() < 0.2:
                c.send(n, C.Tx.Select())
        elif ch.closing:
            c.send(n, C.Channel.CloseOk())
        elif op < 0.5:
            c.send(n, C.Basic.Qos(prefetch_count=rng.choice((1, 2, 5))))
            q = rng.choice(list(QUEUES))
            c.send(n, C.Basic.Consume(queue=q, consumer_tag=f"t{len(ch.consumers)}", nowait=True))
        elif op < 0.55:
            c.send(n, C.Basic.Get(queue=rng.choice(list(QUEUES))))
        elif op < 0.75:
            if ch.unacked:
                tag = rng.choice(list(ch.unacked))
                kind = rng.random()
                if kind < 0.6:
                    c.send(n, C.Basic.Ack(delivery_tag=tag, multiple=rng.random() < 0.3))
                elif kind < 0.8:
                    c.send(n, C.Basic.Nack(delivery_tag=tag, requeue=True))
                else:
                    c.send(n, C.Basic.Reject(delivery_tag=tag, requeue=False))
        elif op < 0.8:
            if ch.tx:
                c.send(n, rng.choice((C.Tx.Commit(), C.Tx.Rollback())))
        elif op < 0.85:
            c.send(n, C.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0))
        elif op < 0.87:
            h.apply(ClientDisconnected(c.conn))
        else:
            now += rng.choice(STEPS_MS)
            h.tick(now)
    return h.log


def _run(log: list[Event], b: Broker) -> list[tuple[list[Any], str]]:
    return [(b.apply(ev), S.digest(b)) for ev in log]


@pytest.mark.parametrize("seed", range(4))
def test_the_due_heap_acts_as_a_sweep_of_every_channel(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _workload(seed, 600)
    got = _run(log, _broker())
    timed_out = sum(
        1
        for effs, _ in got
        for e in effs
        if b"delivery acknowledgement on" in getattr(e, "data", b"")
    )
    assert timed_out >= 3, timed_out
    # A replica restored at three points goes on identically.
    for cut in (len(log) // 4, len(log) // 2, 3 * len(log) // 4):
        r = _broker()
        for ev in log[:cut]:
            r.apply(ev)
        r = S.restore((S.decode(S.encode(part)) for part in S.parts(r, chunk=3)), r.config)
        digests = [(r.apply(ev), S.digest(r))[1] for ev in log[cut:]]
        assert digests == [d for _, d in got[cut:]], cut
    monkeypatch.setattr(ConsumerTimeouts, "on_tick", full_sweep)
    want = _run(log, _broker())
    monkeypatch.undo()
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"event {n}: {log[n]!r}"


def test_a_tick_visits_only_the_channels_that_may_be_due(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(_broker(timeout=60_000))
    h.tick(1_000)
    p = _publisher(h)
    p.send(1, C.Queue.Declare(queue="q"))
    n = 500
    for i in range(1, n + 1):
        _consumer(h, i, prefetch=1)
    for _ in range(n):
        p.publish(1, "", "q", b"m")
    assert (
        sum(len(ch.unacked) for c in h.broker.connections.values() for ch in c.channels.values())
        == n
    )
    visits = 0
    live = ConsumerTimeouts._live

    def counted(self: ConsumerTimeouts, ch: Channel) -> bool:
        nonlocal visits
        visits += 1
        return live(self, ch)

    monkeypatch.setattr(ConsumerTimeouts, "_live", counted)
    for t in range(1_100, 61_000, 100):
        h.tick(t)
    assert visits == 0
    h.tick(61_001)
    assert visits >= n and all(
        ch.closing for c in h.broker.connections.values() if c.id <= n for ch in c.channels.values()
    )


_CHILD = """
import hashlib, json, sys
sys.path[:0] = [{tests!r}, {unit!r}]
from cpgbroker.model.state import snapshot as S
from test_consumer_timeout import _broker, _workload
from cpgbroker.model.events import Send
out = []
for seed in (0, 1):
    b = _broker()
    h = hashlib.sha256()
    for ev in _workload(seed, 400):
        for eff in b.apply(ev):
            h.update(eff.data if isinstance(eff, Send) else repr(eff).encode())
    out.append([S.digest(b), h.hexdigest()])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_same_channels_close_whatever_the_hash_seed() -> None:
    root = Path(__file__).resolve().parents[1]
    code = _CHILD.format(tests=str(root), unit=str(root / "unit"))
    results = []
    for hashseed in ("0", "1", "random"):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=dict(os.environ, PYTHONHASHSEED=hashseed),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        results.append(json.loads(proc.stdout))
    assert all(r == results[0] for r in results), results


def test_a_hot_standby_primary_ships_what_a_timeout_gave_back_and_a_promoted_backup_has_it() -> (
    None
):
    """Shipping changes, the primary's serving broker closes the channel on its own ticks and
    ships the requeues; the backups' replica holds the messages as ready, redelivered, and a
    backup promoted has no channel (the primary's clients are gone): whatever it delivers
    from then on is timed from its own deliveries."""
    h = Harness(_broker())
    h.tick(1_000)
    h.broker.record_changes(ChangeLog())
    shipper, view = Shipper(), Replica()
    c = _consumer(h, 1)
    _publisher(h).publish(1, "", "q", b"m")
    assert len(c.deliveries()) == 1
    view.apply(shipper.batch(h.broker))
    h.tick(1_000 + T + 1)
    assert len(_closes(c)) == 1
    view.apply(shipper.batch(h.broker))
    q = view.broker.vhosts["/"].queues["q"]
    (entry,) = view.broker.replication.in_order(q)
    (back,) = h.broker.vhosts["/"].queues["q"].messages
    assert (entry.msg.id, entry.redelivered) == (back.msg.id, back.redelivered) == (1, True)
    assert_promotes_to(view, h.broker)
    promoted = view.promote()
    assert not promoted.connections and promoted.timeouts.heap == []

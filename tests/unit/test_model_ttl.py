"""Message TTL ticks (``Delivery.expire_ttl`` over ``ttlindex.TtlQueues``' due-heap) behave
exactly as the full sweep of every queue in ``ttl_queues`` did (``full_sweep`` below):
same effects and same state digest after every event of random workloads with x-message-ttl,
per-message expiration, priorities, drop-head and dead-letter cycles, also across snapshot
restore; and a tick visits the queues that are due, not every queue that holds TTL'd messages
(counted, not timed)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pamqp import commands as C

from cpgbroker.model.broker import Broker
from cpgbroker.model.events import Event, Tick
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.routing.ttlindex import EMPTY_DUE
from cpgbroker.model.state import snapshot as S
from modelclient import Harness

QUEUE_ARGS: tuple[dict[str, Any], ...] = (
    {"x-message-ttl": 0, "x-dead-letter-exchange": "dlx"},
    {"x-message-ttl": 200, "x-dead-letter-exchange": "dlx"},
    {"x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "q6"},
    {"x-message-ttl": 500, "x-max-length": 3, "x-dead-letter-exchange": "dlx2"},
    {"x-max-priority": 5, "x-message-ttl": 300, "x-dead-letter-exchange": "dlx"},
    {"x-message-ttl": 100},
    {"x-message-ttl": 0, "x-dead-letter-exchange": "dlx2"},
    {"x-message-ttl": 0, "x-dead-letter-exchange": "dlx"},
    {},
)
EXPIRATIONS = (None, None, "0", "30", "150", "400", "5000")


def full_sweep(self: Delivery) -> None:
    """The reference ``Delivery.expire_ttl`` must match: every queue of the index, in its
    order, as ticks did before the due-heap."""
    index = self._ttl_queues
    for q in list(index.values()):
        self.expire_head(q)
        if not q.messages:
            index.leave(q)


def _workload(seed: int, steps: int) -> list[Event]:
    """A random event log (the harness grants credit, so DoOutputs are in it too)."""
    rng = random.Random(seed)
    h = Harness(credit=3)
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    c.send(1, C.Exchange.Declare(exchange="dlx", exchange_type="fanout", nowait=True))
    c.send(1, C.Exchange.Declare(exchange="dlx2", exchange_type="direct", nowait=True))
    now = 1000
    for _ in range(steps):
        op = rng.random()
        i = rng.randrange(len(QUEUE_ARGS))
        q = f"q{i}"
        if op < 0.08:
            c.send(1, C.Queue.Declare(queue=q, arguments=QUEUE_ARGS[i], nowait=True))
        elif op < 0.14:
            # Dead-letter routes stay acyclic (q0-q4, q7 -> dlx -> q6, q8; q3, q6 -> dlx2 -> q5,
            # q8): a cycle through a fanout would double messages on every tick.
            ex, q = rng.choice((("dlx", "q6"), ("dlx", "q8"), ("dlx2", "q5"), ("dlx2", "q8")))
            rk = f"q{rng.randrange(len(QUEUE_ARGS))}"
            c.send(1, C.Queue.Bind(queue=q, exchange=ex, routing_key=rk, nowait=True))
        elif op < 0.5:
            kw: dict[str, Any] = {}
            exp = rng.choice(EXPIRATIONS)
            if exp is not None:
                kw["expiration"] = exp
            if rng.random() < 0.5:
                kw["priority"] = rng.choice((1, 5))
            props = C.Basic.Properties(**kw)
            c.publish(1, rng.choice(("", "", "", "dlx", "dlx2")), q, b"m", props=props)
        elif op < 0.56:
            c.send(1, C.Basic.Get(queue=q, no_ack=rng.random() < 0.5))
        elif op < 0.6:
            c.send(
                1,
                C.Basic.Consume(
                    queue=q, consumer_tag=f"t{rng.randrange(1000)}", no_ack=rng.random() < 0.3
                ),
            )
        elif op < 0.63:
            c.send(1, C.Basic.Cancel(consumer_tag=f"t{rng.randrange(1000)}"))
        elif op < 0.7:
            conn = h.broker.connections.get(c.conn)
            chan = conn.channels.get(1) if conn else None
            if chan is not None and chan.unacked:
                tag = rng.choice(list(chan.unacked))
                kind = rng.randrange(3)
                if kind == 0:
                    c.send(1, C.Basic.Ack(delivery_tag=tag, multiple=rng.random() < 0.3))
                elif kind == 1:
                    c.send(1, C.Basic.Nack(delivery_tag=tag, requeue=rng.random() < 0.6))
                else:
                    c.send(1, C.Basic.Reject(delivery_tag=tag, requeue=rng.random() < 0.6))
        elif op < 0.72:
            c.send(1, C.Basic.Recover(requeue=True))
        elif op < 0.74:
            c.send(1, C.Queue.Purge(queue=q, nowait=True))
        elif op < 0.76:
            c.send(1, C.Queue.Delete(queue=q, nowait=True))
        elif op < 0.78:
            c.send(1, C.Channel.Close(reply_code=200, class_id=0, method_id=0))
        else:
            now += rng.choice((0, 1, 20, 60, 100, 250, 700))
            h.apply(Tick(now))
        conn = h.broker.connections.get(c.conn)
        if conn is None or conn.state != 4:
            c = h.connect(c.conn + 1)
            c.handshake()
            c.channel(1)
        elif conn.channels.get(1) is None or conn.channels[1].closing:
            if 1 in conn.channels:
                c.send(1, C.Channel.CloseOk())
            c.channel(1)
    return h.log


def check_due_heap(b: Broker) -> None:
    """Every queue of ``ttl_queues`` that is or can become due has a live heap entry no later
    than its due time; join numbers follow the index's order."""
    index = b.topology.ttl_queues
    live = {(t, o, id(q)) for t, o, _, q in index.heap}
    orders = [q.ttl_order for q in index.values()]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    assert all(o >= 0 for o in orders) and (not orders or orders[-1] < index.next_order)
    for q in index.values():
        due = EMPTY_DUE if not q.messages else q.messages[0].expires_at
        if due is None:
            continue
        assert q.ttl_due is not None and q.ttl_due <= due, q.name
        assert (q.ttl_due, q.ttl_order, id(q)) in live, q.name


def _run(log: list[Event], b: Broker) -> list[tuple[list[Any], bytes]]:
    return [(b.apply(ev), S.digest(b)) for ev in log]


@pytest.mark.parametrize("seed", range(8))
def test_ttl_ticks_match_the_full_sweep(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _workload(seed, 500)
    assert sum(isinstance(ev, Tick) for ev in log) > 50
    b = Broker()
    got = []
    shrank = 0
    for ev in log:
        before = len(b.topology.ttl_queues)
        got.append((b.apply(ev), S.digest(b)))
        check_due_heap(b)
        shrank += isinstance(ev, Tick) and len(b.topology.ttl_queues) < before
    # A replica restored half way goes on identically.
    half = len(log) // 2
    r = Broker()
    for ev in log[:half]:
        r.apply(ev)
    r = S.restore(S.snapshot(r))
    check_due_heap(r)
    restored = []
    for ev in log[half:]:
        r.apply(ev)  # its connections do not emit (output is not state): digests only
        restored.append(S.digest(r))
    # The reference: every tick visits every queue of the index, in its order.
    monkeypatch.setattr(Delivery, "expire_ttl", full_sweep)
    want = _run(log, Broker())
    monkeypatch.undo()
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"event {n}: {log[n]!r}"
    assert restored == [d for _, d in want[half:]]
    assert shrank  # ticks did drop queues from the index


def test_a_tick_visits_only_due_queues(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    n = 10_000
    for i in range(n):
        ttl = 100 if i == n // 2 else 10_000_000
        c.send(1, C.Queue.Declare(queue=f"t{i}", arguments={"x-message-ttl": ttl}, nowait=True))
        c.publish(1, "", f"t{i}", b"m")
    b = h.broker
    assert len(b.topology.ttl_queues) == n
    visits = 0
    expire_head = Delivery.expire_head

    def counted(self: Delivery, q: Any) -> None:
        nonlocal visits
        visits += 1
        expire_head(self, q)

    monkeypatch.setattr(Delivery, "expire_head", counted)
    h.apply(Tick(50))
    assert visits == 0
    h.apply(Tick(5000))
    # The due queue lost its message and left the index; no other queue was looked at.
    assert visits == 1 and len(b.topology.ttl_queues) == n - 1
    assert not b.topology.vhosts["/"].queues[f"t{n // 2}"].messages
    h.apply(Tick(6000))
    assert visits == 1
    assert len(b.topology.ttl_queues.heap) <= n
    check_due_heap(b)

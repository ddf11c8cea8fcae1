"""The derived indexes that keep every command's cost to what it touches (``Exchange``'s
per-destination, per-key, topic and headers indexes and ``sources``; queue binding records;
binding counts; exclusive queues; the x-expires heap) stay equal to a brute-force
recomputation across random mutations and across snapshot restore; and operations touch
what they concern, not what exists (counted, not timed)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pamqp import commands as C
from pamqp import header as pheader

from cpgbroker.model.broker import Broker
from cpgbroker.model.entities import Message, Queue
from cpgbroker.model.events import Tick
from cpgbroker.model.routing import exchange as X
from cpgbroker.model.routing.exchange import Exchange, headers_match, topic_match
from cpgbroker.model.state import snapshot as S
from cpgbroker.wire.fastpath import parse_content_header
from modelclient import Client, Harness

TYPES = ("direct", "topic", "fanout", "headers")
KEYS = ("a", "b", "a.b", "a.*", "#", "*.b", "a.#", "")
HEADER_ARGS: tuple[dict[str, Any], ...] = (
    {"x-match": "all", "k": "1"},
    {"x-match": "any", "k": "1", "j": 2},
    {"x-match": "all"},
    {"x-match": "any"},
    {"k": None},
    {"x-match": "all-with-x", "x-y": "z"},
    {"x-match": "all", "k": [1, 2]},
)
SAMPLE_HEADERS: tuple[dict[str, Any], ...] = (
    {},
    {"k": "1"},
    {"j": 2, "k": "2"},
    {"x-y": "z", "k": "1"},
    {"k": [1, 2]},
    {"k": True},
)


def _msg(headers: dict[str, Any] | None = None) -> Message:
    props = C.Basic.Properties(headers=headers) if headers else C.Basic.Properties()
    hdr = bytes(pheader.ContentHeader(0, 0, props).marshal())
    info = parse_content_header(hdr)
    return Message(1, "", "", hdr, b"", 1, None, info.headers_span)


def check_indexes(b: Broker) -> None:
    """Every derived index equals what a scan of the replicated state gives."""
    topo = b.topology
    for vh in topo.vhosts.values():
        sources: dict[int, dict[int, int]] = {}
        records: dict[int, list[tuple[str, str, Any]]] = {}
        count = 0
        for ex in vh.exchanges.values():
            bl = list(ex.bindings)
            count += len(bl)
            assert [x.seq for x in bl] == sorted(x.seq for x in bl)
            by_dest: dict[int, list[Any]] = {}
            for bd in bl:
                by_dest.setdefault(id(bd.dest), []).append(bd)
                if isinstance(bd.dest, Exchange):
                    per = sources.setdefault(id(bd.dest), {})
                    per[id(ex)] = per.get(id(ex), 0) + 1
                else:
                    assert bd.qb is not None and bd.qb in bd.dest.bindings
                    records.setdefault(id(bd.dest), []).append((ex.name, bd.key, bd.args))
            assert {k: list(v) for k, v in ex.by_dest.items()} == by_dest
            for (dk, key), lst in ex.by_dest_key.items():
                assert lst == [x for x in by_dest[dk] if x.key == key]
            assert sum(len(v) for v in ex.by_dest_key.values()) == len(bl)
            if ex.type == "direct":
                want: dict[str, list[Any]] = {}
                for bd in bl:
                    d = want.setdefault(bd.key, [])
                    if not any(x is bd.dest for x in d):
                        d.append(bd.dest)
                assert ex.by_key.keys() == want.keys()
                for k in want:
                    assert [id(x) for x in ex.by_key[k]] == [id(x) for x in want[k]]
            if ex.type == "topic":
                for rk in ("a", "b", "a.b", "a.b.c", "", "c.b"):
                    words = rk.split(".") if rk else []
                    brute = [bd.dest for bd in bl if topic_match(bd.words, words)]
                    ex.cache.clear()
                    got = ex.match(rk, _msg())
                    assert [id(x) for x in got] == [id(x) for x in brute], rk
            if ex.type == "headers":
                for hdrs in SAMPLE_HEADERS:
                    m = _msg(hdrs)
                    brute = [bd.dest for bd in bl if headers_match(bd.args, hdrs)]
                    got = ex.match("", m)
                    assert [id(x) for x in got] == [id(x) for x in brute], hdrs
        for ex in vh.exchanges.values():
            got_src = {id(s): n for s, n in ex.sources.items()}
            assert got_src == sources.get(id(ex), {}), ex.name
        assert vh.binding_count == count
        for q in vh.queues.values():
            recs = [(r.exchange, r.routing_key, r.arguments) for r in q.bindings]
            assert sorted(map(repr, recs)) == sorted(map(repr, records.get(id(q), []))), q.name
    for conn in b.connections.values():
        vh = topo.vhosts.get(conn.vhost)
        if vh is None:
            continue
        mine = sorted(n for n, q in vh.queues.items() if q.exclusive_owner == conn.id)
        assert sorted(conn.exclusive_queues) == mine
    heap_q = {id(q): d for d, _, q in topo._expiry_heap}
    for q in topo.expiring.values():
        # (A queue with consumers cannot expire: it is looked at again one x-expires later.)
        if not q.deleted and not q.consumers:
            assert id(q) in heap_q and heap_q[id(q)] <= q.last_used_ms + (q.expires or 0)


def _random_workload(c: Client, h: Harness, rng: random.Random, steps: int) -> None:
    now = 1000
    for step in range(steps):
        op = rng.random()
        ch = 1
        e = f"e{rng.randrange(8)}"
        e2 = f"e{rng.randrange(8)}"
        q = f"q{rng.randrange(8)}"
        key = rng.choice(KEYS)
        if op < 0.12:
            c.send(
                ch,
                C.Exchange.Declare(
                    exchange=e,
                    exchange_type=TYPES[int(e[1:]) % 4],
                    auto_delete=int(e[1:]) >= 6,
                    nowait=True,
                ),
            )
        elif op < 0.22:
            c.send(
                ch,
                C.Queue.Declare(
                    queue=q,
                    nowait=True,
                    exclusive=q == "q7",
                    arguments={"x-expires": 500} if q == "q6" else {},
                ),
            )
        elif op < 0.45:
            args = rng.choice(HEADER_ARGS) if rng.random() < 0.4 else {}
            c.send(
                ch, C.Queue.Bind(queue=q, exchange=e, routing_key=key, arguments=args, nowait=True)
            )
        elif op < 0.6:
            c.send(ch, C.Exchange.Bind(destination=e2, source=e, routing_key=key, nowait=True))
        elif op < 0.68:
            c.send(ch, C.Queue.Unbind(queue=q, exchange=e, routing_key=key))
        elif op < 0.74:
            c.send(ch, C.Exchange.Unbind(destination=e2, source=e, routing_key=key, nowait=True))
        elif op < 0.8:
            c.send(ch, C.Exchange.Delete(exchange=e, if_unused=rng.random() < 0.3, nowait=True))
        elif op < 0.86:
            c.send(ch, C.Queue.Delete(queue=q, nowait=True))
        elif op < 0.9:
            c.send(ch, C.Basic.Consume(queue=q, nowait=True))
        elif op < 0.93:
            now += rng.choice((100, 700))
            h.apply(Tick(now))
        else:
            c.publish(1, e, key, b"x")
        conn = h.broker.connections.get(c.conn)
        if conn is None or conn.state != 4:
            c.h.closed.pop(c.conn, None)
            c = h.connect(c.conn + 1)
            c.handshake()
            c.channel(1)
        elif conn.channels.get(1) is None or conn.channels[1].closing:
            if 1 in conn.channels:
                c.send(1, C.Channel.CloseOk())
            c.channel(1)
        if step % 7 == 0:
            check_indexes(h.broker)


@pytest.mark.parametrize("seed", range(6))
def test_indexes_match_brute_force_across_mutations_and_restore(seed: int) -> None:
    rng = random.Random(seed)
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    _random_workload(c, h, rng, 400)
    check_indexes(h.broker)
    restored = S.restore(S.snapshot(h.broker))
    check_indexes(restored)
    assert S.digest(restored) == S.digest(h.broker)
    # ... and they go on agreeing after more mutations applied to both (the same events).
    start = len(h.log)
    live = max(h.broker.connections)
    _random_workload(Client(h, live), h, random.Random(seed + 100), 150)
    for ev in h.log[start:]:
        restored.apply(ev)
    check_indexes(restored)
    assert S.digest(restored) == S.digest(h.broker)


# ---------------------------------------------------------------------- bounded cost


def _filled(n: int) -> tuple[Harness, Client]:
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    for t in ("direct", "topic", "headers", "fanout"):
        c.send(1, C.Exchange.Declare(exchange=f"big.{t}", exchange_type=t, nowait=True))
    for i in range(n):
        c.send(1, C.Exchange.Declare(exchange=f"x{i}", nowait=True))
        c.send(1, C.Queue.Declare(queue=f"q{i}", nowait=True))
        c.send(
            1, C.Queue.Bind(queue=f"q{i}", exchange="big.direct", routing_key=f"k{i}", nowait=True)
        )
        c.send(
            1, C.Queue.Bind(queue=f"q{i}", exchange="big.topic", routing_key=f"t{i}.*", nowait=True)
        )
        c.send(
            1, C.Queue.Bind(queue=f"q{i}", exchange="big.headers", nowait=True, arguments={"id": i})
        )
        c.send(1, C.Exchange.Bind(destination=f"x{i}", source="big.fanout", nowait=True))
    c.methods()
    return h, c


def _counted(monkeypatch: pytest.MonkeyPatch, h: Harness, c: Client, work: Any) -> int:
    """How many bindings the model looked at during ``work``: calls of the per-binding
    predicates and of the per-destination and per-exchange index walks."""
    calls = 0
    for name in ("headers_match", "topic_match", "_topic_walk"):
        orig = getattr(X, name)

        def wrapped(*a: Any, _o: Any = orig) -> Any:
            nonlocal calls
            calls += 1
            return _o(*a)

        monkeypatch.setattr(X, name, wrapped)
    orig_unbind_dest = Exchange.unbind_dest

    def unbind_dest(self: Exchange, dest: Any) -> Any:
        nonlocal calls
        calls += 1
        return orig_unbind_dest(self, dest)

    monkeypatch.setattr(Exchange, "unbind_dest", unbind_dest)
    orig_iter = type(h.broker.topology.vhosts["/"].exchanges["big.direct"].bindings).__iter__

    def it(self: Any) -> Any:
        nonlocal calls
        calls += len(self)
        return orig_iter(self)

    monkeypatch.setattr(
        type(h.broker.topology.vhosts["/"].exchanges["big.direct"].bindings), "__iter__", it
    )
    work()
    monkeypatch.undo()
    return calls


@pytest.mark.parametrize(
    "what",
    [
        "exchange_delete",
        "queue_delete",
        "unbind",
        "publish_topic",
        "publish_headers",
        "publish_direct",
    ],
)
def test_cost_does_not_grow_with_what_exists(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    costs = []
    for n in (20, 200):
        h, c = _filled(n)

        def work(c: Client = c) -> None:
            if what == "exchange_delete":
                c.send(1, C.Exchange.Delete(exchange="x3"))
            elif what == "queue_delete":
                c.send(1, C.Queue.Delete(queue="q3"))
            elif what == "unbind":
                c.send(1, C.Queue.Unbind(queue="q3", exchange="big.direct", routing_key="k3"))
            elif what == "publish_topic":
                c.publish(1, "big.topic", "t3.x", b"x")
            elif what == "publish_headers":
                c.publish(1, "big.headers", "", b"x", props=C.Basic.Properties(headers={"id": 3}))
            else:
                c.publish(1, "big.direct", "k3", b"x")

        costs.append(_counted(monkeypatch, h, c, work))
        assert not c.is_closed
        q3 = h.broker.topology.vhosts["/"].queues.get("q3")
        if what.startswith("publish"):
            assert q3 is not None and len(q3.messages) == 1
    assert costs[0] == costs[1], costs


def test_closing_a_channel_with_many_consumers_removes_them_in_one_pass() -> None:
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    c.send(1, C.Queue.Declare(queue="q"))
    for i in range(300):
        c.send(1, C.Basic.Consume(queue="q", consumer_tag=f"t{i}", nowait=True))
    c2 = h.connect(2)
    c2.handshake()
    c2.channel(1)
    c2.send(1, C.Basic.Consume(queue="q", consumer_tag="other", nowait=True))
    q: Queue = h.broker.topology.vhosts["/"].queues["q"]
    q.rr = 150
    c.disconnect()
    assert [x.tag for x in q.consumers] == ["other"] and q.rr == 0
    check_indexes(h.broker)


def test_exclusive_queues_go_with_their_connection() -> None:
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    for i in range(50):
        c.send(1, C.Queue.Declare(queue=f"x{i}", exclusive=True, nowait=True))
    c.send(1, C.Queue.Delete(queue="x7", nowait=True))
    assert "x7" not in h.broker.connections[1].exclusive_queues
    c.disconnect()
    assert not h.broker.topology.vhosts["/"].queues


def test_x_expires_ticks_look_only_at_due_queues() -> None:
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    for i in range(100):
        c.send(
            1,
            C.Queue.Declare(
                queue=f"e{i}", nowait=True, arguments={"x-expires": 1000 if i % 2 else 100_000}
            ),
        )
    c.send(1, C.Basic.Consume(queue="e1", nowait=True))
    h.apply(Tick(500))
    assert len(h.broker.topology.vhosts["/"].queues) == 100
    h.apply(Tick(1500))
    left = list(h.broker.topology.vhosts["/"].queues)
    assert left == ["e1"] + [f"e{i}" for i in range(0, 100, 2)] or sorted(left) == sorted(
        ["e1"] + [f"e{i}" for i in range(0, 100, 2)]
    )
    # The consumer's queue is looked at again later, not on every tick.
    heap = h.broker.topology._expiry_heap
    assert all(d > 1500 for d, _, _ in heap)
    c.disconnect()
    h.apply(Tick(2600))
    assert "e1" not in h.broker.topology.vhosts["/"].queues
    check_indexes(h.broker)

"""Taking a consumer off its queue (basic.cancel, a channel or connection closing) finds it by
bisection on ``Consumer.qseq`` instead of scanning the queue's consumers, and changes nothing
else: same effects in the same order and same state digest after every event as the scans did
(``scan_remove_consumer`` / ``scan_remove_consumers`` below), on random workloads with many
consumers per queue, round-robin, consumer priorities and single active consumers, also after
a snapshot restore (whose consumers are numbered again on first use); and a cancel among many
consumers looks at a logarithmic number of them (counted, not timed)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pamqp import commands as C
from pamqp import frame

from cpgbroker.model.broker import Broker
from cpgbroker.model.entities import Consumer, Queue, detach_unacked
from cpgbroker.model.events import ClientDisconnected, Event
from cpgbroker.model.messages import consumers as consumers_module
from cpgbroker.model.messages.consumers import Consumers
from cpgbroker.model.state import snapshot as S
from modelclient import Client, Harness


def scan_remove_consumer(self: Consumers, c: Consumer) -> bool:
    """The reference ``Consumers.remove_consumer``: a scan of the queue's consumers."""
    q = c.queue
    handover = False
    detach_unacked(c)
    if c in q.consumers:
        idx = q.consumers.index(c)
        q.consumers.remove(c)
        if c.priority:
            q.ranked_consumers -= 1
        if idx < q.rr:
            q.rr -= 1
        if q.rr >= len(q.consumers):
            q.rr = 0
        handover = bool(q.consumers) and bool(q.messages)
    q.last_used_ms = self._clock.now_ms
    if q.auto_delete and q.had_consumers and not q.consumers and not q.deleted:
        self._topology.delete_queue(q)
    return handover


def _scan_drop(q: Queue, gone: dict[int, Consumer]) -> dict[int, None]:
    rr = q.rr
    kept: list[Consumer] = []
    present: dict[int, None] = {}
    new_rr = -1
    ranked = 0
    for idx, c in enumerate(q.consumers):
        if id(c) in gone:
            present[id(c)] = None
            if c.priority:
                ranked += 1
            continue
        if new_rr < 0 and idx >= rr:
            new_rr = len(kept)
        kept.append(c)
    if present:
        q.consumers = kept
        q.ranked_consumers -= ranked
        q.rr = new_rr if new_rr >= 0 else 0
    return present


def scan_remove_consumers(self: Consumers, cs: list[Consumer]) -> list[Queue]:
    """The reference ``Consumers.remove_consumers``: each queue's list filtered once."""
    if not cs:
        return []
    ch = cs[0].channel
    gone = {id(c): c for c in cs}
    if any(c.unacked for c in cs):
        unacked = ch.unacked
        for tag, (dq, e, dc, at) in unacked.items():
            if dc is not None and id(dc) in gone:
                unacked[tag] = (dq, e, None, at)
        for c in cs:
            c.unacked = 0
    now = self._clock.now_ms
    handover: list[Queue] = []
    state: dict[int, tuple[int, dict[int, None]]] = {}
    removed: dict[int, int] = {}
    for c in cs:
        q = c.queue
        qk = id(q)
        st = state.get(qk)
        if st is None:
            st = state[qk] = (len(q.consumers), _scan_drop(q, gone))
            removed[qk] = 0
        before, present = st
        if id(c) in present:
            removed[qk] += 1
            left = before - removed[qk]
            if left and q.messages:
                handover.append(q)
        else:
            left = before - removed[qk]
        q.last_used_ms = now
        if q.auto_delete and q.had_consumers and not left and not q.deleted:
            self._topology.delete_queue(q)
    return handover


QUEUES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("rr", {}),
    ("rr2", {}),
    ("sac", {"x-single-active-consumer": True}),
    ("ad", {}),
)
N_CONNS = 4
N_CHANNELS = 3


def c_bytes(ch: int, method: Any) -> bytes:
    return bytes(frame.marshal(method, ch))


def _open(h: Harness, conn_id: int) -> Client:
    c = h.connect(conn_id)
    c.handshake()
    for ch in range(1, N_CHANNELS + 1):
        c.channel(ch)
    return c


def _workload(seed: int, steps: int) -> list[Event]:
    rng = random.Random(seed)
    h = Harness(credit=5)
    clients = {i: _open(h, i) for i in range(1, N_CONNS + 1)}
    next_conn = N_CONNS + 1
    c0 = clients[1]
    for name, args in QUEUES:
        c0.send(1, C.Queue.Declare(queue=name, arguments=args, auto_delete=name == "ad"))
    tags = 0
    for _ in range(steps):
        cid = rng.choice(list(clients))
        c = clients[cid]
        conn = h.broker.connections.get(cid)
        if conn is None:
            del clients[cid]
            clients[next_conn] = _open(h, next_conn)
            next_conn += 1
            continue
        ch_id = rng.randrange(1, N_CHANNELS + 1)
        ch = conn.channels.get(ch_id)
        if ch is None or ch.closing:
            if ch is not None:
                c.send(ch_id, C.Channel.CloseOk())
            c.channel(ch_id)
            continue
        q = rng.choice(QUEUES)[0]
        op = rng.random()
        if op < 0.35:
            # Many consumers per queue: batches of consumes in one event.
            frames = b""
            for _ in range(rng.randrange(1, 6)):
                tags += 1
                args = {"x-priority": rng.choice((0, 0, 0, 1, 5))} if q != "sac" else {}
                frames += c_bytes(ch_id, C.Basic.Qos(prefetch_count=rng.choice((0, 1, 2))))
                frames += c_bytes(
                    ch_id,
                    C.Basic.Consume(
                        queue=q,
                        consumer_tag=f"t{tags}",
                        no_ack=rng.random() < 0.2,
                        arguments=args,
                    ),
                )
            c.send_raw(frames)
        elif op < 0.6:
            if ch.consumers:
                tag = rng.choice(list(ch.consumers))
                c.send(ch_id, C.Basic.Cancel(consumer_tag=tag, nowait=rng.random() < 0.5))
        elif op < 0.8:
            for _ in range(rng.randrange(1, 5)):
                c.publish(ch_id, "", q, b"m")
        elif op < 0.88:
            if ch.unacked:
                tag = rng.choice(list(ch.unacked))
                if rng.random() < 0.5:
                    c.send(ch_id, C.Basic.Ack(delivery_tag=tag, multiple=rng.random() < 0.3))
                else:
                    c.send(ch_id, C.Basic.Nack(delivery_tag=tag, requeue=True))
        elif op < 0.95:
            # A channel close: few of a queue's consumers, or most of them.
            c.send(ch_id, C.Channel.Close(reply_code=200, class_id=0, method_id=0))
        elif op < 0.97:
            h.apply(ClientDisconnected(cid))
        elif op < 0.98:
            c.send(ch_id, C.Queue.Delete(queue=q, nowait=True))
            c.send(ch_id, C.Queue.Declare(queue=q, arguments=dict(QUEUES)[q], nowait=True))
        else:
            c.send(ch_id, C.Basic.Recover(requeue=True))
    return h.log


def _run(log: list[Event], b: Broker) -> list[tuple[list[Any], str]]:
    return [(b.apply(ev), S.digest(b)) for ev in log]


def check_numbers(b: Broker) -> None:
    """A queue's consumers are numbered increasingly, except a list restored and not yet
    used (all numbered 0 then)."""
    for vh in b.topology.vhosts.values():
        for q in vh.queues.values():
            seqs = [c.qseq for c in q.consumers]
            assert seqs == sorted(seqs), q.name


@pytest.mark.parametrize("seed", range(6))
def test_consumer_removal_matches_the_scan(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _workload(seed, 500)
    b = Broker()
    got = []
    most = 0
    for ev in log:
        got.append((b.apply(ev), S.digest(b)))
        check_numbers(b)
        most = max(
            [most]
            + [len(q.consumers) for vh in b.topology.vhosts.values() for q in vh.queues.values()]
        )
    assert most > 30  # queues did hold many consumers
    half = len(log) // 2
    r = Broker()
    for ev in log[:half]:
        r.apply(ev)
    r = S.restore(S.snapshot(r))
    restored = []
    for ev in log[half:]:
        r.apply(ev)
        restored.append(S.digest(r))
    monkeypatch.setattr(Consumers, "remove_consumer", scan_remove_consumer)
    monkeypatch.setattr(Consumers, "remove_consumers", scan_remove_consumers)
    want = _run(log, Broker())
    monkeypatch.undo()
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"event {n}: {log[n]!r}"
    assert restored == [d for _, d in want[half:]]


def _many_consumers(n: int) -> tuple[Harness, Client]:
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    c.send(1, C.Queue.Declare(queue="q"))
    c.send_raw(
        b"".join(
            c_bytes(1, C.Basic.Consume(queue="q", consumer_tag=f"t{i}", nowait=True))
            for i in range(n)
        )
    )
    return h, c


def test_a_cancel_among_many_consumers_looks_at_a_few(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 20_000
    h, c = _many_consumers(n)
    q = h.broker.topology.vhosts["/"].queues["q"]
    assert len(q.consumers) == n
    looked = 0

    def counted(x: Consumer) -> int:
        nonlocal looked
        looked += 1
        return x.qseq

    monkeypatch.setattr(consumers_module, "_QSEQ", counted)
    cancels = [f"t{i}" for i in range(0, n, 97)]
    c.send_raw(b"".join(c_bytes(1, C.Basic.Cancel(consumer_tag=t, nowait=True)) for t in cancels))
    assert len(q.consumers) == n - len(cancels)
    assert looked <= len(cancels) * 16  # log2(20,000) < 15
    # The channel closes: the rest go in one pass over the list.
    c.send(1, C.Channel.Close(reply_code=200, class_id=0, method_id=0))
    assert not q.consumers


def test_a_restored_queue_is_numbered_once_then_bisected(monkeypatch: pytest.MonkeyPatch) -> None:
    h, _c = _many_consumers(1_000)
    r = S.restore(S.snapshot(h.broker))
    q = r.topology.vhosts["/"].queues["q"]
    assert {c.qseq for c in q.consumers} == {0}
    conn = r.connections[1]
    ch = conn.channels[1]
    cs = q.consumers
    r.consumers.remove_consumer(ch.consumers.pop("t500"))
    assert [c.qseq for c in cs] == [i for i in range(1_000) if i != 500]
    looked = 0

    def counted(x: Consumer) -> int:
        nonlocal looked
        looked += 1
        return x.qseq

    monkeypatch.setattr(consumers_module, "_QSEQ", counted)
    for t in ("t1", "t999", "t250"):
        r.consumers.remove_consumer(ch.consumers.pop(t))
    assert looked <= 3 * 11
    assert [c.tag for c in q.consumers][:3] == ["t0", "t2", "t3"]

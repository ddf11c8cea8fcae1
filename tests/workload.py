"""Random but reproducible client workloads against the model, recorded as event logs.

``generate(seed)`` drives a :class:`Harness` with several clients doing declares (priority,
single-active-consumer and quorum queues with a delivery limit too), binds, publishes (confirm
and tx too), consumes (with consumer priorities too), gets, acks, nacks, rejects, cancels,
channel closes, disconnects, protocol garbage, ticks and tight do-output credit, and returns
the applied event log. Replaying that log into a fresh broker must give the same state on any
replica.
"""

from __future__ import annotations

import random

from pamqp import commands as C

from cpgbroker.model.events import DoOutput, Event, MemberLeft
from modelclient import Client, Harness

QUEUES = ["q0", "q1", "q2"]
EXCHANGES = [("ex.d", "direct"), ("ex.f", "fanout"), ("ex.t", "topic")]


def generate(seed: int, steps: int = 300, clients: int = 4, members: int = 3) -> list[Event]:
    rnd = random.Random(seed)
    h = Harness(credit=rnd.choice([1, 2, 5, 100]))
    now = 1_000
    h.tick(now)
    live: dict[int, Client] = {}
    next_conn = 1

    def new_client() -> None:
        nonlocal next_conn
        cid = next_conn
        next_conn += 1
        c = h.connect(cid, member=rnd.randrange(members))
        c.handshake(heartbeat=rnd.choice([0, 0, 5]))
        c.channel(1)
        c.recv()
        live[cid] = c

    for _ in range(clients):
        new_client()
    c0 = next(iter(live.values()))
    for name, kind in EXCHANGES:
        c0.send(1, C.Exchange.Declare(exchange=name, exchange_type=kind))
    for q in QUEUES:
        args = rnd.choice(
            [
                {},
                {"x-message-ttl": 300},
                {"x-max-length": 5},
                {"x-dead-letter-exchange": "ex.f"},
                {"x-max-priority": 3, "x-max-length": 6},
                {"x-single-active-consumer": True},
                {"x-queue-type": "quorum", "x-delivery-limit": 1, "x-dead-letter-exchange": "ex.f"},
            ]
        )
        # (A quorum queue must be durable.)
        durable = args.get("x-queue-type") == "quorum"
        c0.send(1, C.Queue.Declare(queue=q, durable=durable, arguments=args))
    c0.recv()

    for _ in range(steps):
        if not live:
            new_client()
        cid = rnd.choice(list(live))
        c = live[cid]
        if c.is_closed or cid not in h.broker.connections:
            del live[cid]
            continue
        ch = h.broker.connections[cid].channels.get(1)
        if ch is None or ch.closing:
            if ch is not None:
                c.send(1, C.Channel.CloseOk())
            c.send(1, C.Channel.Open())
            c.recv()
            continue
        op = rnd.random()
        q = rnd.choice(QUEUES)
        if op < 0.30:
            ex, kind = rnd.choice([*EXCHANGES, ("", "default")])
            rk = q if ex == "" else rnd.choice(["a", "b", "a.b", q])
            batch = b"".join(
                c.publish_bytes(
                    1,
                    ex,
                    rk,
                    rnd.randbytes(rnd.choice([0, 10, 300])),
                    # Priorities above a priority queue's maximum too (they count as it).
                    C.Basic.Properties(priority=rnd.choice([None, 0, 1, 3, 7])),
                    mandatory=rnd.random() < 0.2,
                )
                for _ in range(rnd.randint(1, 4))
            )
            # Arbitrary chunking of the client's bytes, as TCP would deliver them.
            while batch:
                n = rnd.randint(1, len(batch))
                c.send_raw(batch[:n])
                batch = batch[n:]
        elif op < 0.38:
            ex, kind = rnd.choice(EXCHANGES)
            c.send(1, C.Queue.Bind(queue=q, exchange=ex, routing_key=rnd.choice(["a", "#", "*.b"])))
        elif op < 0.48:
            prio = rnd.choice([None, None, -1, 0, 5])  # consumer priorities (x-priority)
            c.send(
                1,
                C.Basic.Consume(
                    queue=q,
                    no_ack=rnd.random() < 0.3,
                    arguments={} if prio is None else {"x-priority": prio},
                ),
            )
        elif op < 0.55:
            tags = list(ch.consumers)
            if tags:
                c.send(1, C.Basic.Cancel(consumer_tag=rnd.choice(tags)))
        elif op < 0.70:
            tags = list(ch.unacked)
            if tags:
                tag = rnd.choice(tags)
                kind = rnd.random()
                if kind < 0.5:
                    c.send(1, C.Basic.Ack(delivery_tag=tag, multiple=rnd.random() < 0.3))
                elif kind < 0.8:
                    c.send(1, C.Basic.Nack(delivery_tag=tag, requeue=rnd.random() < 0.7))
                else:
                    c.send(1, C.Basic.Reject(delivery_tag=tag, requeue=False))
        elif op < 0.75:
            c.send(1, C.Basic.Get(queue=q, no_ack=rnd.random() < 0.5))
        elif op < 0.78:
            c.send(1, C.Basic.Qos(prefetch_count=rnd.choice([0, 1, 3])))
        elif op < 0.80:
            c.send(1, C.Confirm.Select() if not ch.tx else C.Tx.Commit())
        elif op < 0.82:
            c.send(1, C.Tx.Select() if not ch.confirm else C.Basic.Recover(requeue=True))
        elif op < 0.85:
            now += rnd.choice([50, 200, 1_000])
            h.tick(now)
        elif op < 0.88:
            h.apply(DoOutput(cid, rnd.choice([0, 1, 3, 50])))
        elif op < 0.90:
            c.send(1, C.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0))
        elif op < 0.92:
            c.disconnect()
            del live[cid]
        elif op < 0.93:
            c.send_raw(rnd.randbytes(rnd.randint(1, 20)))  # protocol garbage
        elif op < 0.94:
            h.apply(MemberLeft(rnd.randrange(members)))
        elif op < 0.96:
            c.send(1, C.Queue.Purge(queue=q))
        else:
            c.send(1, C.Queue.Declare(queue="", exclusive=True))
        c.recv()
    return h.log

"""Cost of one model operation against how much exists: prints JSON.

    python bench/model_cost_bench.py              # 1k, 10k and 100k existing entities
    python bench/model_cost_bench.py --sizes 1000,10000
    python bench/model_cost_bench.py --only connections   # the connection and consumer cases

Single process, the model only (``Broker.apply`` driven as ``tests/modelclient.Harness``
does): every member applies every client's commands, so what one command costs here is what
it costs every member of a cluster. For each size the broker is filled with that many
exchanges, queues and bindings (a quarter of the bindings each on one direct, one topic and
one headers exchange and on exchange-to-exchange bindings), then each operation is applied
``--ops`` times, pre-encoded and sent as one ``ClientData`` event (as the attack sent 2,000
exchange.delete at once), and reported as µs per operation. ``ratio`` is the cost at the
largest size over the cost at the smallest: near 1 means the cost does not depend on what
exists. Never run it next to another benchmark on a 2-core machine.

The connection and consumer cases (``--only connections``) need no topology: a tick among n
idle connections with heartbeats (installed through ``Connections.restore``, the snapshot
path, so that building 100k of them takes a second, not a handshake each), and basic.cancel
among n consumers of one queue.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from pamqp import commands as C  # noqa: E402
from pamqp import frame  # noqa: E402

from cpgbroker.model.broker import Broker  # noqa: E402
from cpgbroker.model.config import BrokerConfig  # noqa: E402
from cpgbroker.model.entities import OPEN, Connection  # noqa: E402
from cpgbroker.model.events import ClientData, Tick  # noqa: E402
from cpgbroker.wire.framer import FrameReader  # noqa: E402
from modelclient import Client, Harness  # noqa: E402

CHUNK = 2000


def m(ch: int, method: Any) -> bytes:
    return bytes(frame.marshal(method, ch))


def send_all(c: Client, frames: list[bytes]) -> None:
    for i in range(0, len(frames), CHUNK):
        c.h.apply(ClientData(c.conn, b"".join(frames[i : i + CHUNK])))
        c.h.out.pop(c.conn, None)


def timed(c: Client, frames: list[bytes]) -> float:
    """µs per frame group, all sent in one event."""
    data = b"".join(frames)
    gc.collect()
    # The collector's full passes cost O(every object) whatever runs: not the operation's cost.
    gc.disable()
    t0 = time.perf_counter()
    c.h.apply(ClientData(c.conn, data))
    dt = time.perf_counter() - t0
    gc.enable()
    c.h.out.pop(c.conn, None)
    assert not c.is_closed, c.h.closed
    ch = c.h.broker.connections[c.conn].channels.get(1)
    assert ch is not None and not ch.closing, "an operation failed: channel 1 was closed"
    return dt * 1e6


def build(n: int) -> tuple[Harness, Client]:
    unlimited = BrokerConfig(
        vhost_max_queues=None,
        vhost_max_exchanges=None,
        vhost_max_bindings=None,
        vhost_max_connections=None,
    )
    h = Harness(Broker(unlimited))
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    fr: list[bytes] = []
    for t in ("direct", "topic", "headers", "fanout"):
        fr.append(m(1, C.Exchange.Declare(exchange=f"big.{t}", exchange_type=t, nowait=True)))
    fr.append(m(1, C.Exchange.Declare(exchange="small.fanout", exchange_type="fanout")))
    for i in range(n):
        fr.append(m(1, C.Exchange.Declare(exchange=f"x{i}", exchange_type="direct", nowait=True)))
        fr.append(m(1, C.Queue.Declare(queue=f"q{i}", nowait=True)))
    q4 = n // 4
    for i in range(q4):
        fr.append(
            m(
                1,
                C.Queue.Bind(
                    queue=f"q{i}", exchange="big.direct", routing_key=f"k{i}", nowait=True
                ),
            )
        )
        fr.append(
            m(
                1,
                C.Queue.Bind(
                    queue=f"q{i}",
                    exchange="big.topic",
                    routing_key=f"a{i}.*.c{i % 97}",
                    nowait=True,
                ),
            )
        )
        fr.append(
            m(
                1,
                C.Queue.Bind(
                    queue=f"q{i}",
                    exchange="big.headers",
                    nowait=True,
                    arguments={"x-match": "all", "id": f"h{i}"},
                ),
            )
        )
        fr.append(
            m(
                1,
                C.Exchange.Bind(
                    destination=f"x{i}", source="big.fanout", routing_key="", nowait=True
                ),
            )
        )
    for i in range(2):
        fr.append(m(1, C.Queue.Bind(queue=f"q{i}", exchange="small.fanout", nowait=True)))
    send_all(c, fr)
    return h, c


def publish(c: Client, ex: str, rk: str, headers: dict[str, Any] | None = None) -> bytes:
    props = C.Basic.Properties(headers=headers) if headers else None
    return c.publish_bytes(1, ex, rk, b"x", props)


def ops(h: Harness, c: Client, n: int, r: int) -> dict[str, float]:
    out: dict[str, float] = {}

    def run(name: str, frames: list[bytes]) -> None:
        out[name] = round(timed(c, frames) / r, 2)

    run(
        "exchange_declare",
        [m(1, C.Exchange.Declare(exchange=f"new{i}", nowait=True)) for i in range(r)],
    )
    run(
        "exchange_delete",
        [m(1, C.Exchange.Delete(exchange=f"new{i}", nowait=True)) for i in range(r)],
    )
    # The attack: deleting exchanges that exist among many (and are bound to from big.fanout).
    run(
        "exchange_delete_bound",
        [m(1, C.Exchange.Delete(exchange=f"x{i}", nowait=True)) for i in range(r)],
    )
    run("queue_declare", [m(1, C.Queue.Declare(queue=f"nq{i}", nowait=True)) for i in range(r)])
    run(
        "bind_queue",
        [
            m(
                1,
                C.Queue.Bind(
                    queue=f"nq{i}", exchange="big.direct", routing_key=f"n{i}", nowait=True
                ),
            )
            for i in range(r)
        ],
    )
    run(
        "unbind_queue",
        [
            m(1, C.Queue.Unbind(queue=f"nq{i}", exchange="big.direct", routing_key=f"n{i}"))
            for i in range(r)
        ],
    )
    run(
        "bind_exchange",
        [
            m(
                1,
                C.Exchange.Bind(
                    destination=f"x{n - 1 - i}",
                    source="big.topic",
                    routing_key=f"e{i}",
                    nowait=True,
                ),
            )
            for i in range(r)
        ],
    )
    run(
        "unbind_exchange",
        [
            m(
                1,
                C.Exchange.Unbind(
                    destination=f"x{n - 1 - i}",
                    source="big.topic",
                    routing_key=f"e{i}",
                    nowait=True,
                ),
            )
            for i in range(r)
        ],
    )
    run("queue_delete", [m(1, C.Queue.Delete(queue=f"nq{i}", nowait=True)) for i in range(r)])
    # Bound queues: each delete unbinds from big exchanges holding n/4 bindings each.
    run(
        "queue_delete_bound",
        [m(1, C.Queue.Delete(queue=f"q{n // 4 - 1 - i}", nowait=True)) for i in range(r)],
    )
    run("publish_direct", [publish(c, "big.direct", f"k{i}") for i in range(r)])
    run("publish_topic", [publish(c, "big.topic", f"a{i}.b.c{i % 97}") for i in range(r)])
    run("publish_headers", [publish(c, "big.headers", "", {"id": f"h{i}"}) for i in range(r)])
    run("publish_fanout_small", [publish(c, "small.fanout", "") for i in range(r)])
    run("purge", [m(1, C.Queue.Purge(queue=f"q{i}", nowait=True)) for i in range(r)])
    # Auto-delete cascade: deleting a queue deletes the auto-delete exchange bound to it,
    # which is bound (exchange-to-exchange) from the big fanout exchange.
    setup = []
    for i in range(r):
        setup.append(
            m(
                1,
                C.Exchange.Declare(
                    exchange=f"ad{i}", exchange_type="fanout", auto_delete=True, nowait=True
                ),
            )
        )
        setup.append(m(1, C.Queue.Declare(queue=f"adq{i}", nowait=True)))
        setup.append(m(1, C.Queue.Bind(queue=f"adq{i}", exchange=f"ad{i}", nowait=True)))
    send_all(c, setup)
    run(
        "auto_delete_cascade",
        [m(1, C.Queue.Delete(queue=f"adq{i}", nowait=True)) for i in range(r)],
    )
    # Connection close: one connection with 20 channels x 10 consumers on existing queues.
    reps = 5
    total = 0.0
    for k in range(reps):
        cc = h.connect(100 + k)
        cc.handshake()
        fr = []
        for ch in range(1, 21):
            fr.append(m(ch, C.Channel.Open()))
            for j in range(10):
                fr.append(m(ch, C.Basic.Consume(queue=f"q{n - 1 - j}", nowait=True)))
        send_all(cc, fr)
        t0 = time.perf_counter()
        cc.disconnect()
        total += time.perf_counter() - t0
    out["connection_close_200_consumers"] = round(total * 1e6 / reps, 2)
    # Ticks: TTL (heads of queues holding messages with a TTL) and x-expires, with r queues of
    # each kind due at every size while the rest of the broker is idle.
    now = h.broker.now_ms
    setup = []
    for i in range(r):
        setup.append(
            m(1, C.Queue.Declare(queue=f"tq{i}", nowait=True, arguments={"x-message-ttl": 10}))
        )
        setup.append(publish(c, "", f"tq{i}"))
        setup.append(
            m(1, C.Queue.Declare(queue=f"eq{i}", nowait=True, arguments={"x-expires": 10}))
        )
    send_all(c, setup)
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    h.apply(Tick(now + 1000))
    out["tick_expiring_per_due_queue"] = round((time.perf_counter() - t0) * 1e6 / (2 * r), 2)
    gc.enable()
    t0 = time.perf_counter()
    for k in range(10):
        h.apply(Tick(now + 2000 + k * 100))
    out["tick_idle"] = round((time.perf_counter() - t0) * 1e6 / 10, 2)
    # One tick among n queues whose heads hold a TTL, one of them due: what every tick would
    # cost if a tick visited every such queue (one client can declare them all).
    setup = []
    for i in range(n):
        ttl = {"x-message-ttl": 1_000_000_000}
        setup.append(m(1, C.Queue.Declare(queue=f"lq{i}", nowait=True, arguments=ttl)))
        setup.append(publish(c, "", f"lq{i}"))
    setup.append(m(1, C.Queue.Declare(queue="dq", nowait=True, arguments={"x-message-ttl": 10})))
    setup.append(publish(c, "", "dq"))
    send_all(c, setup)
    later = h.broker.now_ms + 1000
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    h.apply(Tick(later))
    out["tick_ttl_many_queues_one_due"] = round((time.perf_counter() - t0) * 1e6, 2)
    gc.enable()
    return out


HEARTBEAT_S = 60


def idle_connections(n: int) -> Harness:
    """A broker with n open connections that negotiated heartbeats, silent since time 0."""
    h = Harness(Broker(BrokerConfig(vhost_max_connections=None)))
    conns = h.broker.conns
    for i in range(1, n + 1):
        conns.restore(
            Connection(
                id=i,
                member=0,
                peer=f"127.0.0.1:{i}",
                loopback=True,
                reader=FrameReader(131072),
                state=OPEN,
                user="guest",
                vhost="/",
                channel_max=2047,
                frame_max=131072,
                heartbeat=HEARTBEAT_S,
            )
        )
    return h


def connection_ops(n: int, r: int) -> dict[str, float]:
    out: dict[str, float] = {}
    # Ticks among n idle connections with heartbeats: none due (every tick but one in
    # HEARTBEAT_S * 10 with the default 100 ms ticks), then the tick where all are due.
    h = idle_connections(n)
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    for k in range(r):
        h.apply(Tick(100 + k * 100))
    out["tick_heartbeat_conns_none_due"] = round((time.perf_counter() - t0) * 1e6 / r, 2)
    t0 = time.perf_counter()
    h.apply(Tick(HEARTBEAT_S * 500))  # half the interval: a heartbeat to every connection
    out["tick_heartbeat_per_due_conn"] = round((time.perf_counter() - t0) * 1e6 / n, 2)
    gc.enable()
    sent = sum(1 for c in range(1, n + 1) if h.out.pop(c, None))
    assert sent == n, sent
    del h
    gc.collect()
    # basic.cancel of r consumers spread over the n consumers of one queue.
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    c.send(1, C.Queue.Declare(queue="cq", nowait=True))
    send_all(
        c,
        [m(1, C.Basic.Consume(queue="cq", consumer_tag=f"c{i}", nowait=True)) for i in range(n)],
    )
    q = h.broker.topology.vhosts["/"].queues["cq"]
    assert len(q.consumers) == n
    step = n // r
    run = [m(1, C.Basic.Cancel(consumer_tag=f"c{i * step}", nowait=True)) for i in range(r)]
    out["basic_cancel_among_n_consumers"] = round(timed(c, run) / r, 2)
    assert len(q.consumers) == n - r
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,100000")
    # At most an eighth of the smallest size: operations use distinct existing entities.
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument(
        "--only",
        choices=("all", "topology", "connections"),
        default="all",
        help="topology: exchanges, queues, bindings, publishes, ticks over queues; "
        "connections: ticks over idle heartbeat connections, basic.cancel among consumers",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.ops * 8 > min(sizes):
        ap.error("--ops must be at most an eighth of the smallest size")
    results: dict[str, dict[str, float]] = {}
    for n in sizes:
        results[str(n)] = {}
        if args.only in ("all", "topology"):
            t0 = time.perf_counter()
            h, c = build(n)
            build_s = time.perf_counter() - t0
            results[str(n)].update(ops(h, c, n, args.ops))
            results[str(n)]["build_s"] = round(build_s, 1)
            print(f"size {n}: built in {build_s:.1f}s", file=sys.stderr)
            del h, c
            gc.collect()
        if args.only in ("all", "connections"):
            results[str(n)].update(connection_ops(n, args.ops))
            gc.collect()
    lo, hi = str(sizes[0]), str(sizes[-1])
    ratio = {
        k: round(results[hi][k] / results[lo][k], 2) if results[lo][k] else None
        for k in results[lo]
        if k != "build_s"
    }
    print(json.dumps({"us_per_op": results, f"ratio_{hi}_over_{lo}": ratio}, indent=1))


if __name__ == "__main__":
    main()

"""RPC round trips with RabbitMQ's direct reply-to, requester and server on one broker; prints
JSON.

    python bench/rpc_bench.py                 # standalone cpgbroker, a 3-member cluster (both
                                              # clients on member 1) and a RabbitMQ node
    python bench/rpc_bench.py --calls 5000 --no-cluster --no-rabbitmq

One requester sends a request, waits for its answer and sends the next (pika, one connection
each, the requester consuming ``amq.rabbitmq.reply-to``); one server answers each request to
its reply-to. ``p50_ms``/``p99_ms`` are round trips as the requester times them; ``calls_s``
the calls per second. In the cluster both clients are on the same member, first on its AMQP
port, where every request and every answer crosses CPG (and waits for the ring's order) before
the member applies it, then on its member-local port (``[cluster] local_listen``), where
nothing does: that is measured against a standalone broker. Last, a hot-standby cluster
shipping changes (``[cluster] mode = "hot-standby"``, ``replication = "changes"``), both
clients on the primary's AMQP port: the primary applies requests and answers as they come
and ships what they changed afterwards (the reply-to never ships), so no call waits for CPG.
RabbitMQ 3.10.8 (Debian's package) runs as a private node (tests/clients/rabbitmqnode.py).
Root for the cluster (namespaces). Never run two benchmarks at once on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pika
from reply_codes import start_cpgbroker

ROOT = Path(__file__).resolve().parents[1]
REPLY = "amq.rabbitmq.reply-to"


def _server(url: str, ready: threading.Event, stop: threading.Event) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare("rpc_bench")

    def answer(c: Any, m: Any, p: pika.BasicProperties, body: bytes) -> None:
        c.basic_publish("", p.reply_to, body, pika.BasicProperties(correlation_id=p.correlation_id))

    ch.basic_consume("rpc_bench", answer, auto_ack=True)
    ready.set()
    while not stop.is_set():
        conn.process_data_events(0.05)
    conn.close()


def measure(url: str, calls: int) -> dict[str, Any]:
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=_server, args=(url, ready, stop), daemon=True)
    server.start()
    assert ready.wait(30), "the RPC server did not start"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    got: dict[str, bytes] = {}
    ch.basic_consume(
        REPLY, lambda _c, _m, p, body: got.__setitem__(p.correlation_id, body), auto_ack=True
    )
    times = []
    started = time.perf_counter()
    for i in range(calls + calls // 10):  # the first tenth warms up and is not counted
        cid = str(i)
        t0 = time.perf_counter()
        ch.basic_publish(
            "", "rpc_bench", b"x" * 100, pika.BasicProperties(reply_to=REPLY, correlation_id=cid)
        )
        while cid not in got:
            conn.process_data_events(None)
        if i >= calls // 10:
            times.append(time.perf_counter() - t0)
        else:
            started = time.perf_counter()
    elapsed = time.perf_counter() - started
    conn.close()
    stop.set()
    server.join(10)
    times.sort()
    return {
        "calls": len(times),
        "calls_s": round(len(times) / elapsed, 1),
        "p50_ms": round(statistics.median(times) * 1000, 3),
        "p99_ms": round(times[int(len(times) * 0.99) - 1] * 1000, 3),
    }


def standalone(calls: int) -> dict[str, Any]:
    proc, where = start_cpgbroker()
    try:
        return measure(f"amqp://guest:guest@{where}/", calls)
    finally:
        proc.terminate()
        proc.wait(10)


def cluster(calls: int) -> dict[str, Any]:
    from cpgbroker.dev.brokers import BrokerSet
    from cpgbroker.dev.cluster import DevCluster

    dc = DevCluster(3, prefix="rpcbench", token_ms=3000)
    with dc:
        brokers = BrokerSet(dc, event_log=False, local=True)
        brokers.start_all()
        try:
            # Replicated (the member's AMQP port), then member-local (its local_listen port:
            # runtime/amqp/localbroker.py), on the same member of the same cluster.
            return {
                "replicated": measure(brokers.url(1), calls),
                "member_local": measure(brokers.local_url(1), calls),
            }
        finally:
            brokers.stop_all()


def hot_standby_changes(calls: int) -> dict[str, Any]:
    from cpgbroker.dev.brokers import BrokerSet
    from cpgbroker.dev.cluster import DevCluster

    dc = DevCluster(3, prefix="rpcbench", token_ms=3000)
    with dc:
        brokers = BrokerSet(
            dc,
            event_log=False,
            cluster_options='mode = "hot-standby"\nreplication = "changes"',
        )
        brokers.start_all()
        try:
            st = brokers.status(1)
            assert st is not None and st["mode"] == "hot-standby", st
            port = st["primary_url"].rsplit(":", 1)[1].strip("/")
            primary = next(n for n in (1, 2, 3) if brokers.url(n).endswith(f":{port}/"))
            return measure(brokers.url(primary), calls)
        finally:
            brokers.stop_all()


def rabbitmq(calls: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests" / "clients"))
    from rabbitmqnode import problem, rabbitmq_node

    why = problem()
    if why is not None:
        return {"skipped": why}
    with (
        tempfile.TemporaryDirectory(prefix="rpc-bench-rmq-") as base,
        rabbitmq_node(Path(base)) as node,
    ):
        return measure(f"amqp://guest:guest@127.0.0.1:{node.amqp_port}/", calls)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--cluster", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--rabbitmq", action=argparse.BooleanOptionalAction, default=True)
    a = ap.parse_args()
    out: dict[str, Any] = {"calls": a.calls, "cpgbroker_standalone": standalone(a.calls)}
    if a.cluster:
        both = cluster(a.calls)
        out["cpgbroker_cluster_one_member"] = both["replicated"]
        out["cpgbroker_cluster_member_local"] = both["member_local"]
        out["cpgbroker_hot_standby_changes_primary"] = hot_standby_changes(a.calls)
    if a.rabbitmq:
        out["rabbitmq_single"] = rabbitmq(a.calls)
    base = out["cpgbroker_standalone"]["p50_ms"]
    for key in (
        "cpgbroker_cluster_one_member",
        "cpgbroker_cluster_member_local",
        "cpgbroker_hot_standby_changes_primary",
        "rabbitmq_single",
    ):
        if "p50_ms" in out.get(key, {}):
            out[f"{key}_p50_x_standalone"] = round(out[key]["p50_ms"] / base, 2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

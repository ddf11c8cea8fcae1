"""Whole-cluster recovery: N persistent messages queued, every member killed, time until the
cluster serves clients again, against RabbitMQ restarting a 3-node quorum queue holding the
same messages, in one run; prints JSON.

    python bench/recovery_bench.py --messages 1000000            # cpgbroker and RabbitMQ
    python bench/recovery_bench.py --messages 100000 --no-rabbitmq

cpgbroker: a 3-member cluster in network namespaces (root), each member with a store (fsync
always); the load generator publishes N persistent 1 KiB messages with confirms to a durable
queue; then kill -9 of the three brokers; then all three are started again and the clock runs
until a client gets the queue's message count back from ``queue.declare(passive)`` and the
first message with ``basic.get``. Also reported: what each member's store held (snapshot and
journal bytes) and how long its recovery took, from its status.

RabbitMQ: nodes r1..r3 of the shared ``rabbitmq_baseline.sh`` (private, under /tmp), one
quorum queue with the same N messages; the three beam processes killed with SIGKILL, started
again on the same data, and the same client check.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pika
import pika.exceptions

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "recovery_q"


def publish(shared: Path, url: str, n: int, queue_type: str | None) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable,
        str(shared / "bench" / "amqp_load.py"),
        "--url",
        url,
        "--queue",
        QUEUE,
        "--size",
        "1024",
        "--confirm",
        "--persistent",
        "--consumers",
        "0",
        "--count",
        str(n),
        "--json-out",
        out,
    ]
    if queue_type:
        cmd += ["--queue-type", queue_type]
    t0 = time.monotonic()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    r: dict[str, Any] = json.loads(Path(out).read_text())
    return {
        "confirmed": r.get("confirmed"),
        "publish_msg_s": r.get("publish_rate"),
        "seconds": round(time.monotonic() - t0, 1),
    }


def wait_served(urls: list[str], n: int, timeout: float) -> float:
    """Seconds until one of ``urls`` reports the queue with ``n`` messages and hands out one."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for url in urls:
            try:
                p = pika.URLParameters(url)
                p.socket_timeout = 2
                p.blocked_connection_timeout = 5
                conn = pika.BlockingConnection(p)
                try:
                    ch = conn.channel()
                    q = ch.queue_declare(QUEUE, passive=True)
                    if q.method.message_count >= n:
                        m, _p, _b = ch.basic_get(QUEUE, auto_ack=False)
                        if m is not None:
                            return time.monotonic() - t0
                finally:
                    conn.close()
            except (pika.exceptions.AMQPError, OSError):
                pass
        time.sleep(0.2)
    raise TimeoutError(f"not served within {timeout} s")


def run_ours(shared: Path, n: int) -> dict[str, Any]:
    from cpgbroker.dev.brokers import BrokerSet
    from cpgbroker.dev.cluster import DevCluster

    dc = DevCluster(3, prefix=f"recov-{os.getpid() % 100000}", token_ms=3000)
    out: dict[str, Any] = {}
    with dc:
        # The queue holds every message with no consumer: lift the memory mark (default
        # 512 MiB) above it, as RabbitMQ's (40% of RAM) is.
        mark = max(2 * n * 1100, 512 * 2**20)
        bs = BrokerSet(
            dc,
            event_log=False,
            store=True,
            extra_config=f"\n[limits]\nhigh_watermark_bytes = {mark}\n",
        )
        bs.start_all()
        urls = [bs.url(i) for i in (1, 2, 3)]
        out["publish"] = publish(shared, urls[0], n, None)
        before = {i: (bs.status(i) or {}).get("store", {}) for i in (1, 2, 3)}
        out["store_before_kill"] = {
            f"member{i}": {
                k: before[i].get(k)
                for k in ("durable_seq", "journal_bytes", "snapshots", "bytes_written", "fsyncs")
            }
            for i in (1, 2, 3)
        }
        out["store_dir_mib"] = {
            f"member{i}": round(
                sum(f.stat().st_size for f in bs.store_path(i).glob("*")) / 2**20, 1
            )
            for i in (1, 2, 3)
        }
        for i in (1, 2, 3):
            bs.kill(i)
        t0 = time.monotonic()
        for i in (1, 2, 3):
            bs.start(i)
        wait_served(urls, n, 1800)
        out["seconds_until_served"] = round(time.monotonic() - t0, 1)
        bs.wait_ready([1, 2, 3], timeout=1800)
        out["seconds_until_all_members_ready"] = round(time.monotonic() - t0, 1)
        out["recovery"] = {
            f"member{i}": ((bs.status(i) or {}).get("store") or {}).get("recovery")
            for i in (1, 2, 3)
        }
        bs.stop_all()
    return out


RMQ_HEAD_LINES = 184


def _rmq(shared: Path, script: str, env: dict[str, str]) -> None:
    head = "\n".join(
        (shared / "bench" / "rabbitmq_baseline.sh").read_text().splitlines()[:RMQ_HEAD_LINES]
    )
    subprocess.run(["bash", "-c", head + "\n" + script], env=env, check=True)


def run_rabbitmq(shared: Path, n: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="rmq-recov-"))
    env = dict(os.environ, RMQ_BENCH_BASE=str(base))
    subprocess.run(
        ["bash", str(shared / "bench" / "rabbitmq_baseline.sh"), "install"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    out: dict[str, Any] = {}
    urls = [f"amqp://guest:guest@127.0.0.1:{p}/" for p in (5681, 5682, 5683)]
    # Start the three nodes fresh and cluster them, as the baseline script's cluster phase.
    _rmq(
        shared,
        """
prep_base
for n in r1 r2 r3; do start_node $n; done
for n in r2 r3; do
  rmq $n "$SBIN/rabbitmqctl" -n $n@localhost -q stop_app
  rmq $n "$SBIN/rabbitmqctl" -n $n@localhost -q join_cluster r1@localhost
  rmq $n "$SBIN/rabbitmqctl" -n $n@localhost -q start_app
done
""",
        env,
    )
    try:
        out["publish"] = publish(shared, urls[0], n, "quorum")
        pids = [int((base / name / "beam.pid").read_text()) for name in ("r1", "r2", "r3")]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        time.sleep(1)
        t0 = time.monotonic()
        # Start again on the same data (start_node would wipe it).
        _rmq(
            shared,
            """
ensure_epmd
for n in r1 r2 r3; do
  dir=$BASE/$n; rm -f "$dir/beam.pid"; cd "$dir"
  rmq $n setsid "$SBIN/rabbitmq-server" >> "$dir/log/stdout" 2>&1 < /dev/null &
done
""",
            env,
        )
        wait_served(urls, n, 1800)
        out["seconds_until_served"] = round(time.monotonic() - t0, 1)
    finally:
        _rmq(shared, "for n in r3 r2 r1; do stop_node $n; done; stop_epmd", env)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--rabbitmq", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    args = ap.parse_args()
    result: dict[str, Any] = {"messages": args.messages, "size": 1024}
    result["cpgbroker"] = run_ours(args.shared, args.messages)
    print(json.dumps(result["cpgbroker"]), file=sys.stderr)
    if args.rabbitmq:
        result["rabbitmq_quorum"] = run_rabbitmq(args.shared, args.messages)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hot standby: a backup joins a primary holding a large queue while consumers eat it; prints
JSON.

    python bench/catchup_bench.py                       # 1,000,000 messages of 100 bytes
    python bench/catchup_bench.py --messages 200000
    python bench/catchup_bench.py --changes    # replication = "changes": the update goes
                                               # from the back of the queue, without what
                                               # the consumer took meanwhile

A 3-member dev cluster (corosync in namespaces, token 3000 ms) with ``[cluster] mode =
"hot-standby"``; member 1 is the primary. Steps: fill queue ``big`` with ``--messages``
confirmed messages (the shared ``amqp_load.py``); kill backup 3; start a consumer of ``big`` on
the primary (the runtime's trio client, prefetch 1000, acks of 100 at a time) and a publisher
of one confirmed 1 KiB message every 2 ms to another queue; after ``--before`` seconds start
member 3 again, so that it joins through a state update of the queue as it is then; run
``--after`` seconds past its readiness. Reported: the queue's depth when the backup joined and
when it was ready, what the update transferred (messages, MiB, seconds) and how long the join
took; the primary's consume rate and the publisher's confirm latency before and during the
update (does the primary stall?); whether every message of ``big`` was consumed exactly once
or is still there; whether the members' digests agree afterwards. Root only (namespaces).
Never run two benchmarks at once on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
from update_bench import installed_transfer

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster
from cpgbroker.runtime.federation.client import AmqpClient

ROOT = Path(__file__).resolve().parents[1]
LOAD = ROOT.parent / "shared" / "bench" / "amqp_load.py"


class Run:
    def __init__(self) -> None:
        self.consumed: list[float] = []  # monotonic time of each consumed message
        self.bodies: set[bytes] = set()
        self.duplicates = 0
        self.confirms: list[tuple[float, float]] = []  # (sent at, latency)
        self.stop = trio.Event()

    async def consume(self, url: str) -> None:
        async with await AmqpClient.connect(url) as client:
            ch = await client.channel()
            await ch.basic_qos(1000)
            consumer = await ch.consume("big")
            n = last = 0
            while not self.stop.is_set():
                with trio.move_on_after(0.2):  # an empty queue: look at the stop flag again
                    d = await consumer.receive()
                    if d.body in self.bodies:
                        self.duplicates += 1
                    self.bodies.add(d.body)
                    self.consumed.append(trio.current_time())
                    n, last = n + 1, d.delivery_tag
                    if n % 100 == 0:
                        await ch.ack(last, multiple=True)
            if last:
                # Everything counted as consumed is acknowledged: none of it comes back.
                await ch.ack(last, multiple=True)
            await ch.close()

    async def publish(self, url: str) -> None:
        async with await AmqpClient.connect(url) as client:
            ch = await client.channel()
            await ch.queue_declare("live")
            await ch.confirm_select()
            while not self.stop.is_set():
                t = trio.current_time()
                c = await ch.publish("", "live", bytes(1024))
                assert c is not None and await c.wait()
                self.confirms.append((t, trio.current_time() - t))
                await trio.sleep(max(0.0, 0.002 - (trio.current_time() - t)))


def rate(times: list[float], start: float, end: float) -> float | None:
    n = sum(1 for t in times if start <= t < end)
    return round(n / (end - start)) if end > start else None


def latencies(confirms: list[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    xs = sorted(lat for t, lat in confirms if start <= t < end)
    if not xs:
        return {}
    return {
        "confirms": len(xs),
        "p50_ms": round(statistics.median(xs) * 1000, 2),
        "p99_ms": round(xs[max(0, math.ceil(len(xs) * 0.99) - 1)] * 1000, 2),
        "max_ms": round(xs[-1] * 1000, 1),
    }


async def measure(bs: BrokerSet, args: argparse.Namespace, out: dict[str, Any]) -> None:
    run = Run()
    url = bs.url(1)
    depth = lambda n: (bs.status(n) or {}).get("queues", {}).get("/:big", {})  # noqa: E731
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run.consume, url)
        nursery.start_soon(run.publish, url)
        t0 = trio.current_time()
        await trio.sleep(args.before)
        out["depth_at_join"] = (await trio.to_thread.run_sync(depth, 1)).get("ready")
        t_join = trio.current_time()
        await trio.to_thread.run_sync(bs.start, 3)
        while ((await trio.to_thread.run_sync(bs.status, 3)) or {}).get("state") != "ready":
            assert trio.current_time() - t_join < 900, "the backup was not ready in 900 s"
            await trio.sleep(0.2)
        t_ready = trio.current_time()
        out["depth_at_ready"] = (await trio.to_thread.run_sync(depth, 1)).get("ready")
        await trio.sleep(args.after)
        run.stop.set()
        t_end = trio.current_time()
    out["join_to_ready_s"] = round(t_ready - t_join, 2)
    out["transfer"] = installed_transfer(bs.log_path(3).read_text(errors="replace"))
    out["primary_consume_msg_s"] = {
        "before": rate(run.consumed, t0 + 1, t_join),
        "during_update": rate(run.consumed, t_join, t_ready),
        "after": rate(run.consumed, t_ready, t_end),
    }
    out["primary_confirm_latency"] = {
        "before": latencies(run.confirms, t0 + 1, t_join),
        "during_update": latencies(run.confirms, t_join, t_ready),
        "after": latencies(run.confirms, t_ready, t_end),
    }
    out["consumed"] = len(run.bodies)
    out["consumed_twice"] = run.duplicates
    left = depth(1)
    out["left_in_queue"] = (left.get("ready") or 0) + (left.get("unacked") or 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--before", type=float, default=10.0)
    ap.add_argument("--after", type=float, default=10.0)
    ap.add_argument("--load", default=str(LOAD), help="path of amqp_load.py")
    ap.add_argument("--changes", action="store_true", help='[cluster] replication = "changes"')
    args = ap.parse_args()
    out: dict[str, Any] = {
        "messages": args.messages,
        "size": args.size,
        "replication": "changes" if args.changes else "bytes",
    }
    options = 'mode = "hot-standby"' + ('\nreplication = "changes"' if args.changes else "")
    with DevCluster(3, prefix="catchup", token_ms=3000) as dc:
        bs = BrokerSet(dc, event_log=False, cluster_options=options)
        bs.start_all()
        try:
            t = time.monotonic()
            per = args.messages // 2
            subprocess.run(
                [
                    sys.executable,
                    args.load,
                    *("--url", bs.url(1), "--producers", "2", "--consumers", "0"),
                    *("--count", str(per), "--confirm", "--size", str(args.size)),
                    *("--queue", "big", "--drain-timeout", "5"),
                ],
                check=True,
                capture_output=True,
            )
            out["fill_seconds"] = round(time.monotonic() - t, 1)
            out["filled"] = (bs.status(1) or {})["queues"]["/:big"]["ready"]
            bs.kill(3)
            trio.run(measure, bs, args, out)
            out["accounted_for"] = out["consumed"] + out["left_in_queue"] == out["filled"]
            out["converged_digest"] = bs.converged([1, 2, 3], timeout=300)[:16]
        except Exception as e:  # still print what was measured
            out["error"] = repr(e)
        finally:
            bs.stop_all()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

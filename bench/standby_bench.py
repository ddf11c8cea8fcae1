"""Hot standby: many clients failing over when the primary is killed; prints JSON.

    python bench/standby_bench.py                      # 200 clients, corosync token 1000 ms
    python bench/standby_bench.py --clients 200 --token 3000
    python bench/standby_bench.py --node                # the primary's whole node dies
    python bench/standby_bench.py --changes             # replication = "changes"
    python bench/standby_bench.py --changes --queued 500000   # a deep queue to take over

A 3-member dev cluster (corosync in namespaces) with ``[cluster] mode = "hot-standby"``. The
clients, one AMQP connection each, all in this process (the runtime's trio client), are given
every member's URL with the primary last, as clients that do not know which member is primary:
each is turned away by both backups first. Each publishes one confirmed message every
``--interval`` seconds to one queue. Once every client is publishing, the primary is killed
with SIGKILL: its broker process (the node's corosync reports it gone at once), or with
``--node`` its node's corosync too (a machine lost: the others notice after the token
timeout). Reported: how long the first client took to be served again (a confirm after the
kill: failure detection plus the takeover), how long until every client was (each one's first
confirm after the kill; p50, p99, max), how many reconnect attempts that took, and whether
the queue holds every confirmed message (nothing lost). ``--queued N`` first fills a second
queue with N confirmed 100-byte messages that nobody consumes: a new primary shipping changes
copies its replica before it serves (``Shipping.promote``), so this shows what a deep queue adds
to the takeover. Root only (namespaces). Never run two benchmarks at once on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import trio

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster
from cpgbroker.runtime.federation.client import AmqpClient, AmqpClientError

QUEUE = "standby_bench"
HELD = "standby_bench_held"


class Clients:
    def __init__(self, n: int, urls: list[str], interval: float) -> None:
        self.n, self.urls, self.interval = n, urls, interval
        self.confirmed = 0
        self.attempts = 0
        self.publishing: set[int] = set()
        self.killed_at: float | None = None
        # Client -> its first confirm after the kill (seconds after it).
        self.back: dict[int, float] = {}

    async def client(self, i: int) -> None:
        while True:
            try:
                self.attempts += 1
                conn = await AmqpClient.connect(self.urls, timeout=5.0, heartbeat=10)
                async with conn:
                    ch = await conn.channel()
                    await ch.confirm_select()
                    while True:
                        c = await ch.publish("", QUEUE, b"%d" % i)
                        assert c is not None
                        if await c.wait():
                            self.confirmed += 1
                            self.publishing.add(i)
                            if self.killed_at is not None and i not in self.back:
                                self.back[i] = trio.current_time() - self.killed_at
                        await trio.sleep(self.interval)
            except (AmqpClientError, OSError, trio.TooSlowError):
                await trio.sleep(0.05)


async def run(bs: BrokerSet, primary: int, args: argparse.Namespace) -> dict[str, Any]:
    urls = [bs.url(n) for n in (1, 2, 3) if n != primary] + [bs.url(primary)]
    setup = await AmqpClient.connect(bs.url(primary))
    async with setup:
        ch = await setup.channel()
        await ch.queue_declare(QUEUE, durable=False)
        await ch.queue_declare(HELD, durable=False)
        await ch.confirm_select()
        body = b"h" * 100
        for start in range(0, args.queued, 1000):
            confirms = [
                await ch.publish("", HELD, body) for _ in range(min(1000, args.queued - start))
            ]
            for c in confirms:
                assert c is not None and await c.wait()
    clients = Clients(args.clients, urls, args.interval)
    async with trio.open_nursery() as nursery:
        for i in range(args.clients):
            nursery.start_soon(clients.client, i)
        with trio.fail_after(120):
            while len(clients.publishing) < args.clients:
                await trio.sleep(0.1)
        attempts_before = clients.attempts
        await trio.sleep(args.settle)
        clients.killed_at = trio.current_time()
        if args.node:
            bs.dc.kill(primary)
        bs.kill(primary)
        with trio.move_on_after(args.timeout):
            while len(clients.back) < args.clients:
                await trio.sleep(0.05)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    back = sorted(clients.back.values())
    return {
        "clients_served_again": len(back),
        "first_served_again_s": round(back[0], 3) if back else None,
        "all_served_again_s": round(back[-1], 3) if len(back) == args.clients else None,
        "p50_s": round(statistics.median(back), 3) if back else None,
        "p99_s": round(back[max(0, int(len(back) * 0.99) - 1)], 3) if back else None,
        "reconnect_attempts": clients.attempts - attempts_before,
        "confirmed": clients.confirmed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument(
        "--interval", type=float, default=0.2, help="seconds between a client's publishes"
    )
    ap.add_argument("--token", type=int, default=1000, help="corosync token (ms)")
    ap.add_argument(
        "--settle", type=float, default=3.0, help="seconds of steady load before the kill"
    )
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--node", action="store_true", help="kill the primary's corosync too")
    ap.add_argument("--changes", action="store_true", help='[cluster] replication = "changes"')
    ap.add_argument("--queued", type=int, default=0, help="messages queued in a second queue")
    args = ap.parse_args()
    options = 'mode = "hot-standby"' + ('\nreplication = "changes"' if args.changes else "")
    dc = DevCluster(3, prefix=f"sbbench-{os.getpid() % 100000}", token_ms=args.token)
    with dc:
        bs = BrokerSet(dc, event_log=False, cluster_options=options)
        bs.start_all()
        try:
            st = bs.status(1)
            assert st is not None and st["mode"] == "hot-standby", st
            port = st["primary_url"].rsplit(":", 1)[1].strip("/")
            (primary,) = [n for n in (1, 2, 3) if bs.url(n).endswith(f":{port}/")]
            t0 = time.monotonic()
            out = trio.run(run, bs, primary, args)
            survivors = [n for n in (1, 2, 3) if n != primary]
            new = bs.status(survivors[0])
            assert new is not None
            depth = new["queues"].get(f"/:{QUEUE}", {}).get("ready")
            held = new["queues"].get(f"/:{HELD}", {}).get("ready")
            out.update(
                {
                    "clients": args.clients,
                    "replication": "changes" if args.changes else "bytes",
                    "interval_s": args.interval,
                    "corosync_token_ms": args.token,
                    "killed": f"member {primary} (primary)"
                    + (" and its node's corosync" if args.node else ""),
                    "new_primary": new.get("primary_url"),
                    "queue_messages": depth,
                    "queued": args.queued,
                    "nothing_lost": depth is not None
                    and depth >= out["confirmed"]
                    and held == args.queued,
                    "run_s": round(time.monotonic() - t0, 1),
                }
            )
        finally:
            bs.stop_all()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

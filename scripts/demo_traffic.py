"""Demo traffic for a local 3-member cluster: a confirmed publisher and two consumers on
different members; after a while one member is killed and the clients fail over.

    python scripts/demo_traffic.py --url U1 --url U2 --url U3 --kill "cmd to kill member 2"

Prints a line per second (published, confirmed, consumed per consumer, which member each client
uses) and a verdict at the end: every confirmed message was consumed (none lost), and how many
were delivered again after the failure (at-least-once: allowed, flagged redelivered).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import pika
import pika.exceptions

QUEUE = "demo"


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.confirmed: set[int] = set()
        self.consumed: dict[int, int] = {}
        self.redelivered = 0
        self.where: dict[str, str] = {}
        self.events: list[str] = []
        self.stop = threading.Event()


def connect(urls: list[str], who: str, stats: Stats) -> tuple[pika.BlockingConnection, str]:
    while not stats.stop.is_set():
        for url in urls:
            p = pika.URLParameters(url)
            p.connection_attempts = 1
            p.socket_timeout = 2
            p.heartbeat = 5
            try:
                conn = pika.BlockingConnection(p)
            except pika.exceptions.AMQPConnectionError:
                continue
            member = url.split("@")[-1].rstrip("/")
            with stats.lock:
                old = stats.where.get(who)
                stats.where[who] = member
                if old is not None and old != member:
                    stats.events.append(f"{who} failed over {old} -> {member}")
            return conn, member
        time.sleep(0.3)
    raise SystemExit(0)


def producer(urls: list[str], stats: Stats, rate: float) -> None:
    n = 0
    while not stats.stop.is_set():
        try:
            conn, _ = connect(urls, "producer", stats)
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(QUEUE, durable=True)
            while not stats.stop.is_set():
                ch.basic_publish("", QUEUE, str(n).encode())  # returns once confirmed
                with stats.lock:
                    stats.confirmed.add(n)
                n += 1
                time.sleep(1 / rate)
            conn.close()
        except (pika.exceptions.AMQPError, OSError):
            continue  # unconfirmed message n is published again on the next member


def consumer(name: str, urls: list[str], stats: Stats) -> None:
    while not stats.stop.is_set():
        try:
            conn, _ = connect(urls, name, stats)
            ch = conn.channel()
            ch.queue_declare(QUEUE, durable=True)
            ch.basic_qos(prefetch_count=20)
            for method, _props, body in ch.consume(QUEUE, inactivity_timeout=0.5):
                if stats.stop.is_set() and method is None:
                    break
                if method is None:
                    continue
                with stats.lock:
                    k = int(body)
                    stats.consumed[k] = stats.consumed.get(k, 0) + 1
                    stats.redelivered += method.redelivered
                ch.basic_ack(method.delivery_tag)
            conn.close()
        except (pika.exceptions.AMQPError, OSError):
            continue


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", action="append", required=True)
    ap.add_argument("--kill", help="shell command that kills one member")
    ap.add_argument("--kill-after", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--rate", type=float, default=200.0)
    args = ap.parse_args()
    urls = args.url
    stats = Stats()
    rot = lambda k: urls[k:] + urls[:k]  # noqa: E731 - each client prefers another member
    threads = [
        threading.Thread(target=producer, args=(rot(0), stats, args.rate), daemon=True),
        threading.Thread(target=consumer, args=("consumer-a", rot(1), stats), daemon=True),
        threading.Thread(
            target=consumer, args=("consumer-b", rot(2 % len(urls)), stats), daemon=True
        ),
    ]
    for t in threads:
        t.start()
    start = time.time()
    killed = False
    shown = 0
    while time.time() - start < args.seconds:
        time.sleep(1)
        with stats.lock:
            for e in stats.events[shown:]:
                print(f"  ** {e}")
            shown = len(stats.events)
            print(
                f"t={time.time() - start:4.1f}s confirmed={len(stats.confirmed):5d} "
                f"consumed={len(stats.consumed):5d} redelivered={stats.redelivered:3d} "
                f"clients on {dict(sorted(stats.where.items()))}"
            )
        if args.kill and not killed and time.time() - start >= args.kill_after:
            print(f"  ** killing a member: {args.kill}")
            subprocess.run(args.kill, shell=True, check=False)
            killed = True
    # Let the consumers drain what was confirmed.
    deadline = time.time() + 15
    while time.time() < deadline:
        with stats.lock:
            if stats.confirmed <= stats.consumed.keys():
                break
        time.sleep(0.2)
    stats.stop.set()
    time.sleep(1)
    with stats.lock:
        lost = sorted(stats.confirmed - stats.consumed.keys())
        dup = sum(1 for c in stats.consumed.values() if c > 1)
        for e in stats.events[shown:]:
            print(f"  ** {e}")
        print(
            f"\nconfirmed {len(stats.confirmed)}, consumed {len(stats.consumed)} distinct, "
            f"lost {len(lost)}, delivered more than once {dup} (redelivered flag on "
            f"{stats.redelivered})"
        )
    if lost:
        print(f"LOST confirmed messages: {lost[:20]}")
        return 1
    print("OK: every confirmed message was consumed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Demo traffic for a local 3-member cluster: a confirmed publisher and two consumers on
different members; after a while one member is killed and the clients fail over.

    python scripts/demo_traffic.py --url U1 --url U2 --url U3 --kill "cmd to kill member 2"

Prints a line per second (published, confirmed, consumed per consumer, which member each client
uses) and a verdict at the end: every confirmed message was consumed (none lost), and how many
were delivered again after the failure (at-least-once: allowed, flagged redelivered).

With ``--history DIR`` every client also records what it did and saw into
``DIR/<client>.history.jsonl`` (``cpgbroker.audit.history``), for ``cpgbroker audit``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pika
import pika.exceptions

from cpgbroker.audit.history import HistoryRecorder, decode_body, encode_body, producer_name

QUEUE = "demo"
# The run id in the message bodies (amqp_load's layout); one producer, id 1.
RUN_ID = 1
PRODUCER = producer_name(RUN_ID, 1)


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.confirmed: set[int] = set()
        self.consumed: dict[int, int] = {}
        self.redelivered = 0
        self.where: dict[str, str] = {}
        self.events: list[str] = []
        self.stop = threading.Event()


def connect(
    urls: list[str], who: str, stats: Stats, rec: HistoryRecorder
) -> tuple[pika.BlockingConnection, str]:
    while not stats.stop.is_set():
        for url in urls:
            p = pika.URLParameters(url)
            p.connection_attempts = 1
            p.socket_timeout = 2
            p.heartbeat = 5
            try:
                conn = pika.BlockingConnection(p)
            except (pika.exceptions.AMQPConnectionError, ValueError):
                # ValueError: pika's "Expected connected socket" when the member
                # being killed resets the connection mid-handshake; try the next.
                continue
            member = url.split("@")[-1].rstrip("/")
            rec.connected(url)
            with stats.lock:
                old = stats.where.get(who)
                stats.where[who] = member
                if old is not None and old != member:
                    stats.events.append(f"{who} failed over {old} -> {member}")
            return conn, member
        time.sleep(0.3)
    raise SystemExit(0)


def producer(urls: list[str], stats: Stats, rate: float, rec: HistoryRecorder) -> None:
    n = 0
    while not stats.stop.is_set():
        try:
            conn, _ = connect(urls, "producer", stats, rec)
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(QUEUE, durable=True)
            while not stats.stop.is_set():
                # Every attempt is a new message: one the connection lost before its confirm is
                # published again as the next n on the next member.
                n += 1
                rec.published(PRODUCER, n, QUEUE, persistent=False, durable=True)
                try:
                    ch.basic_publish("", QUEUE, encode_body(RUN_ID, 1, n))  # returns on confirm
                except pika.exceptions.NackError:
                    rec.confirmed(PRODUCER, n, "nack")
                    continue
                except (pika.exceptions.AMQPError, OSError):
                    rec.confirmed(PRODUCER, n, "unknown")
                    raise
                rec.confirmed(PRODUCER, n, "ack")
                with stats.lock:
                    stats.confirmed.add(n)
                time.sleep(1 / rate)
            conn.close()
            rec.disconnected("closed")
        except (pika.exceptions.AMQPError, OSError) as e:
            rec.disconnected(f"lost: {type(e).__name__}")


def consumer(name: str, urls: list[str], stats: Stats, rec: HistoryRecorder) -> None:
    while not stats.stop.is_set():
        try:
            conn, _ = connect(urls, name, stats, rec)
            ch = conn.channel()
            ch.queue_declare(QUEUE, durable=True)
            ch.basic_qos(prefetch_count=20)
            for method, _props, body in ch.consume(QUEUE, inactivity_timeout=0.5):
                if stats.stop.is_set() and method is None:
                    break
                if method is None:
                    continue
                mid, _sent = decode_body(body)
                rec.delivered(name, QUEUE, mid.producer, mid.seq, method.redelivered)
                with stats.lock:
                    stats.consumed[mid.seq] = stats.consumed.get(mid.seq, 0) + 1
                    stats.redelivered += method.redelivered
                ch.basic_ack(method.delivery_tag)
                rec.acked(name, QUEUE, mid.producer, mid.seq)
            conn.close()
            rec.disconnected("closed")
        except (pika.exceptions.AMQPError, OSError) as e:
            rec.disconnected(f"lost: {type(e).__name__}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", action="append", required=True)
    ap.add_argument("--kill", help="shell command that kills one member")
    ap.add_argument("--kill-after", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--history", type=Path, help="record each client's history in this directory")
    args = ap.parse_args()
    urls = args.url
    stats = Stats()
    # Without --history the histories go to a directory that is removed at the end.
    scratch = tempfile.TemporaryDirectory(prefix="demo-history-")
    history: Path = args.history or Path(scratch.name)
    history.mkdir(parents=True, exist_ok=True)
    recs = {
        c: HistoryRecorder(history / f"{c}.history.jsonl", c)
        for c in ("producer", "consumer-a", "consumer-b")
    }
    rot = lambda k: urls[k:] + urls[:k]  # noqa: E731 - each client prefers another member
    threads = [
        threading.Thread(
            target=producer, args=(rot(0), stats, args.rate, recs["producer"]), daemon=True
        ),
        threading.Thread(
            target=consumer, args=("consumer-a", rot(1), stats, recs["consumer-a"]), daemon=True
        ),
        threading.Thread(
            target=consumer,
            args=("consumer-b", rot(2 % len(urls)), stats, recs["consumer-b"]),
            daemon=True,
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
    for t in threads:
        t.join(5)
    for r in recs.values():
        r.close()
    scratch.cleanup()
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

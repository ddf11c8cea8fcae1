"""What a hot-standby backup spends per message: replaying client bytes, or applying changes.

    python bench/shipping_bench.py                    # 200,000 messages of 1 KiB
    python bench/shipping_bench.py --messages 50000 --size 100

Single process, the model only: the CPU a member spends per message outside its runtime.
One publisher with confirms and one consumer with acks (prefetch 100) exchange ``--messages``
messages through one queue, recorded as the event log a cluster would order (the publisher's
bytes in reads of ``--per-read`` messages, the consumer's acks, do-output grants). Then, each
timed alone with the collector off:

* ``owner``: a broker applying the log as the member whose clients these are (it encodes
  every delivery and confirm): an active-active member's cost for its own clients, and a
  hot-standby primary's today;
* ``replay``: a broker applying the same log as a member to which the clients are shadows:
  what every other active-active member, and every hot-standby backup, spends today;
* ``primary``: ``owner`` plus recording the changes and encoding one change batch per
  ``--batch`` events (``model/changes.py``, ``model/standby/replica.py``): a primary that ships
  changes;
* ``replica``: a backup's replica applying those batches: what a backup spends with state
  shipping;
* ``promotion``: a backup becoming primary with ``--messages`` messages queued (the same
  publisher, no consumer): the copy of its replica that it serves (``Shipping.promote``), in
  seconds, which its clients wait for.

Prints JSON: µs per message for each, the replica's cost over ``replay`` and ``owner``, and the
bytes shipped per message against the client bytes multicast today. RabbitMQ has no part that
does either job, so none is measured here: the throughput comparison is ``standby_bench.py``'s
and ``amqp_load.py``'s. Never run it next to another benchmark on a 2-core machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import types
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from pamqp import commands as C  # noqa: E402
from pamqp import frame  # noqa: E402

from cpgbroker.model.broker import Broker  # noqa: E402
from cpgbroker.model.changes import ChangeLog  # noqa: E402
from cpgbroker.model.events import (  # noqa: E402
    Changes,
    ClientConnected,
    ClientData,
    DoOutput,
    Event,
)
from cpgbroker.model.shipping import Shipper, messages  # noqa: E402
from cpgbroker.runtime.replication.shipping import Shipping  # noqa: E402
from modelclient import Harness  # noqa: E402


def record(messages: int, size: int, per_read: int, consume: bool = True) -> list[Event]:
    """The ordered log of a confirmed 1-publisher, 1-consumer run (no consumer: the
    messages stay queued)."""
    h = Harness(credit=per_read)
    h.tick(1_000)
    pub, con = h.connect(1), h.connect(2)
    for c in (pub, con):
        c.handshake()
        c.channel(1)
    pub.rpc(1, C.Queue.Declare(queue="work", durable=True))
    pub.rpc(1, C.Confirm.Select())
    con.rpc(1, C.Basic.Qos(prefetch_count=100))
    if consume:
        con.rpc(1, C.Basic.Consume(queue="work"))
    body = b"x" * size
    persistent = C.Basic.Properties(delivery_mode=2)
    one = pub.publish_bytes(1, "", "work", body, persistent)
    sent = 0
    while sent < messages:
        n = min(per_read, messages - sent)
        pub.send_raw(one * n)
        sent += n
        h.out.pop(1, None)
        tags = [m.delivery_tag for m, _ in con.deliveries()]
        if tags:
            con.send_raw(
                b"".join(bytes(frame.marshal(C.Basic.Ack(delivery_tag=t), 1)) for t in tags)
            )
    # What is still out gets acked too: every message ends settled.
    while True:
        h.apply(DoOutput(2, per_read))
        tags = [m.delivery_tag for m, _ in con.deliveries()]
        if not tags:
            break
        con.send_raw(b"".join(bytes(frame.marshal(C.Basic.Ack(delivery_tag=t), 1)) for t in tags))
    return h.log


def timed(fn: Any) -> float:
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    gc.enable()
    return dt


def apply_all(log: list[Event], emit: bool, ship_every: int = 0) -> tuple[float, list[bytes]]:
    """Seconds a fresh broker takes to apply ``log``, and the change batches it shipped."""
    b = Broker()
    batches: list[bytes] = []
    shipper = Shipper()
    if ship_every:
        b.record_changes(ChangeLog("all"))

    def run() -> None:
        for i, ev in enumerate(log, 1):
            b.apply(ev)
            if not emit and type(ev) is ClientConnected:
                b.set_emit(ev.conn, False)
            if ship_every and i % ship_every == 0:
                batches.append(shipper.batch(b))
        if ship_every:
            batches.append(shipper.batch(b))

    return timed(run), batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--per-read", type=int, default=50)
    ap.add_argument("--batch", type=int, default=20, help="events per change batch")
    args = ap.parse_args()
    log = record(args.messages, args.size, args.per_read)
    n = args.messages
    client_bytes = sum(len(ev.data) for ev in log if type(ev) is ClientData)

    def per_msg(seconds: float) -> float:
        return round(seconds / n * 1e6, 2)

    owner_s, _ = apply_all(log, emit=True)
    replay_s, _ = apply_all(log, emit=False)
    primary_s, batches = apply_all(log, emit=True, ship_every=args.batch)
    replica = Broker()

    def apply_replica() -> None:
        for batch in batches:
            replica.apply(Changes(batch))

    replica_s = timed(apply_replica)
    assert messages(replica) == 0, "every message was acked: the replica must be empty"
    result = {
        "messages": n,
        "size": args.size,
        "events": len(log),
        "batches": len(batches),
        "us_per_message": {
            "owner": per_msg(owner_s),
            "replay": per_msg(replay_s),
            "primary": per_msg(primary_s),
            "replica": per_msg(replica_s),
        },
        "replica_over_replay": round(replica_s / replay_s, 3),
        "replica_over_owner": round(replica_s / owner_s, 3),
        "primary_over_owner": round(primary_s / owner_s, 3),
        "bytes_per_message": {
            "client_bytes": round(client_bytes / n, 1),
            "change_batches": round(sum(len(b) for b in batches) / n, 1),
        },
    }
    # Promotion: a replica holding every message, copied and promoted as a new primary.
    _, held = apply_all(record(n, args.size, args.per_read, consume=False), True, args.batch)
    backup = Broker()
    for batch in held:
        backup.apply(Changes(batch))
    assert messages(backup) == n
    shipping = Shipping(1, "all", 1000, lambda ev: None, lambda: 0)
    # Output goes nowhere: the new primary has no client yet.
    shipping.attach(cast(Any, types.SimpleNamespace(execute=lambda out: None)))
    result["promotion_s"] = round(timed(lambda: shipping.promote(backup, backup.now_ms)), 3)
    assert shipping.broker is not None and messages(shipping.broker) == n
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

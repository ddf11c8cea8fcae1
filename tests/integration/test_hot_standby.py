"""Hot standby on real corosync with real clients (pika): only the primary (the member that has
served longest) takes clients, the backups turn them away naming it, and when the primary is
killed the next one takes over without losing a confirmed message; the old primary, restarted,
is a backup (runtime/replication/standby.py)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pika
import pika.exceptions
import pytest
from brokerclients import ConfirmingPublisher, connect, drain_queue
from pamqp import frame

from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

MODE = 'mode = "hot-standby"'
ROOT = Path(__file__).resolve().parents[2]


def roles(bs: BrokerSet, nodes: list[int]) -> dict[int, str]:
    """Each member's own view of its role."""
    out = {}
    for n in nodes:
        s = bs.status(n)
        assert s is not None and s["mode"] == "hot-standby", s
        out[n] = s["role"]
    return out


def the_primary(bs: BrokerSet, nodes: list[int]) -> int:
    """The node every listed member names as primary (they must agree)."""
    named = set()
    for n in nodes:
        s = bs.status(n)
        assert s is not None
        named.add(s["primary_url"])
    assert len(named) == 1, named
    (url,) = named
    (node,) = [n for n in nodes if bs.url(n).endswith(url.split("@")[-1].split("://")[-1])]
    return node


def ready(bs: BrokerSet, member: int, queue: str) -> int:
    """Messages ready in ``queue`` as ``member``'s status shows them."""
    status = bs.status(member)
    assert status is not None
    return int(status["queues"][f"/:{queue}"]["ready"])


def until_confirmed(pub: ConfirmingPublisher, n: int, seconds: float, what: str) -> None:
    """Wait until ``pub`` has ``n`` confirms (failing with ``what`` after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while len(pub.confirmed) < n:
        assert pub.error is None, pub.error
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def kill_under_load(bs: BrokerSet, pub: ConfirmingPublisher, primary: int, more: int) -> float:
    """Kill -9 the primary under ``pub``; seconds until ``more`` further confirms came."""
    bs.kill(primary)
    killed_at = time.monotonic()
    until_confirmed(pub, len(pub.confirmed) + more, 60, "publishing did not resume after the kill")
    return time.monotonic() - killed_at


def test_clients_reach_the_primary_and_survive_its_kill_and_it_comes_back_a_backup(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(cluster_options=MODE)
    primary = the_primary(bs, [1, 2, 3])
    backups = [n for n in (1, 2, 3) if n != primary]
    assert roles(bs, [1, 2, 3]) == {n: "primary" if n == primary else "backup" for n in (1, 2, 3)}
    # A client of a backup is told where the primary is.
    for n in backups:
        with pytest.raises(pika.exceptions.AMQPConnectionError) as e:
            pika.BlockingConnection(pika.URLParameters(bs.url(n) + "?connection_attempts=1"))
        assert "hot-standby backup" in str(e.value), e.value
        assert f"127.0.0.1:{bs.ports[primary][0]}" in str(e.value), e.value
    # What a backup says, in AMQP: connection.start with the member list and the primary in
    # its server-properties, then connection.close 320.
    with socket.create_connection(("127.0.0.1", bs.ports[backups[0]][0]), timeout=10) as s:
        s.sendall(b"AMQP\x00\x00\x09\x01")
        data = b""
        while not data.endswith(b"\xce") or len(data) < 20:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    _, _, start = frame.unmarshal(data)
    props = start.server_properties
    assert props["cpgbroker_primary"] == f"amqp://127.0.0.1:{bs.ports[primary][0]}/", props
    assert len(props["cluster_members"].split()) == 3, props
    # Clients given every member's URL, backups first, end up on the primary.
    params = [pika.URLParameters(bs.url(n) + "?connection_attempts=1") for n in (*backups, primary)]
    conn = pika.BlockingConnection(params)
    conn.channel().queue_declare("hs.q")
    status = bs.status(primary)
    assert status is not None and status["connections"]["local"] == 1, status
    conn.close()
    # The documented failover examples (pika; kombu, as celery uses it) with the backups first.
    urls = [bs.url(n) for n in (*backups, primary)]
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs/examples/pika_failover.py"), *urls],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "consumed 100 distinct messages" in out.stdout
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "docs/examples/kombu_failover.py"),
            ";".join(u + "/" for u in urls),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "received [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in out.stdout
    assert f"127.0.0.1:{bs.ports[primary][0]}" in out.stdout.split("received")[0], out.stdout
    # Under a confirmed publisher that tries the members in turn, kill -9 the primary.
    pub = ConfirmingPublisher(bs, [*backups, primary], "hs.q")
    pub.start()
    until_confirmed(pub, 300, 30, "the publisher never got going")
    resumed = kill_under_load(bs, pub, primary, 300)
    confirmed = pub.stop()
    new_primary = the_primary(bs, backups)
    assert new_primary in backups
    print(f"hot standby: served again {resumed:.1f} s after the primary was killed")
    # Restarted, the old primary catches up and is a backup; the primary does not move.
    bs.start(primary)
    bs.wait_ready([primary], timeout=90)
    bs.converged([1, 2, 3])
    assert the_primary(bs, [1, 2, 3]) == new_primary
    assert roles(bs, [primary])[primary] == "backup"
    # Nothing the cluster confirmed was lost (a publish whose confirm died with the primary
    # may be there too: it was never confirmed).
    got = drain_queue(bs, new_primary, "hs.q")
    assert set(confirmed) <= set(got)
    assert len(got) == len(set(got))
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        connect(bs, primary)


def test_shipping_changes_backups_take_over_with_every_confirmed_message(
    broker_set: Callable[..., BrokerSet],
) -> None:
    """``replication = "changes"``: the primary alone applies its clients' bytes and ships what
    its broker changed. Kill -9 the primary under a confirmed publisher and a consumer: the
    next member serves on with every confirmed message, and the old primary, restarted, takes
    a state update of the replica and is a backup."""
    bs = broker_set(cluster_options=MODE + '\nreplication = "changes"')
    primary = the_primary(bs, [1, 2, 3])
    backups = [n for n in (1, 2, 3) if n != primary]
    status = bs.status(primary)
    assert status is not None and status["replication"] == "changes", status
    conn = connect(bs, primary)
    ch = conn.channel()
    ch.queue_declare("ship.q")
    ch.queue_declare("ship.rpc", exclusive=True)
    conn.close()
    pub = ConfirmingPublisher(bs, [*backups, primary], "ship.q")
    pub.start()
    until_confirmed(pub, 500, 30, "the publisher never got going")
    # The backups hold the queue and its messages, not the primary's connections, nor the
    # exclusive queue (it dies with its connection, which dies with the primary).
    for n in backups:
        s = bs.status(n)
        assert s is not None and s["connections"] == {"local": 0, "shadow": 0}, s
        assert s["queues"]["/:ship.q"]["ready"] > 0, s
        assert "/:ship.rpc" not in s["queues"], s
    resumed = kill_under_load(bs, pub, primary, 500)
    confirmed = pub.stop()
    new_primary = the_primary(bs, backups)
    print(f"hot standby shipping changes: served again {resumed:.1f} s after the kill")
    bs.start(primary)
    bs.wait_ready([primary], timeout=90)
    assert the_primary(bs, [1, 2, 3]) == new_primary
    assert roles(bs, [primary])[primary] == "backup"
    # Every member's stream broker is the same replica.
    bs.converged([1, 2, 3])
    got = drain_queue(bs, new_primary, "ship.q")
    assert set(confirmed) <= set(got)
    assert len(got) == len(set(got))
    # What an operator sees of the new primary's batches.
    out = subprocess.run(
        [sys.executable, "-m", "cpgbroker", "status", *bs.cli_args(new_primary)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    line = re.search(r"replication: changes \(replicate all\)  batches shipped (\d+)", out.stdout)
    assert line is not None and int(line.group(1)) > 0, out.stdout


def test_shipping_changes_a_backup_catches_up_from_the_back_while_a_consumer_eats(
    broker_set: Callable[..., BrokerSet],
) -> None:
    """The seeds' LIFO catch-up: a backup that joins a primary holding a deep queue gets it
    from the back, without what the primary's consumer took while the update was sent (the
    transfer is slowed to a few MiB/s so that the consumer takes much of it meanwhile), and
    ends with the same state as the others; every message is consumed once or still there."""
    bs = broker_set(cluster_options=MODE + '\nreplication = "changes"\nupdate_rate_limit = 2.0')
    primary = the_primary(bs, [1, 2, 3])
    backup = max(n for n in (1, 2, 3) if n != primary)
    total = 60_000
    conn = connect(bs, primary)
    ch = conn.channel()
    ch.queue_declare("deep")
    for i in range(total):
        ch.basic_publish("", "deep", b"%07d" % i + b"x" * 120)
    ch.confirm_delivery()  # the publishes before it are applied once this is answered
    conn.close()
    # ... by the primary's serving broker; its replica, which the status reads, has them
    # once their batch is cut: a batch no confirm waits for lingers
    # (runtime/replication/shipping.py).
    deadline = time.monotonic() + 10
    while (depth := ready(bs, primary, "deep")) != total and time.monotonic() < deadline:
        time.sleep(0.05)
    assert depth == total
    bs.kill(backup)
    consumed: list[bytes] = []
    stop = threading.Event()

    def consume() -> None:
        # Acks, not auto-ack: what the client holds unprocessed when it stops goes back to
        # the queue (an auto-ack consumer would drop it).
        c = connect(bs, primary)
        cch = c.channel()
        cch.basic_qos(prefetch_count=200)
        for m, _p, body in cch.consume("deep", inactivity_timeout=0.5):
            if stop.is_set():
                break
            if m is not None:
                consumed.append(body[:7])
                cch.basic_ack(m.delivery_tag)
        cch.cancel()
        c.close()

    reader = threading.Thread(target=consume, daemon=True)
    bs.start(backup)
    reader.start()
    bs.wait_ready([backup], timeout=120)
    stop.set()
    reader.join(30)
    log = bs.log_path(backup).read_text(errors="replace")
    sent = [int(m) for m in re.findall(r"state update installed seq=\d+ messages=(\d+)", log)]
    assert sent, log[-2000:]
    print(f"LIFO catch-up: {depth} queued at the join, {sent[-1]} transferred")
    assert sent[-1] < depth * 0.9, (sent, depth, len(consumed))
    bs.converged([1, 2, 3])
    left = drain_queue(bs, primary, "deep")
    got = consumed + [b[:7] for b in left]
    assert sorted(got) == [b"%07d" % i for i in range(total)]

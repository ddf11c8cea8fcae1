"""Power cuts of real brokers: no confirmed message is lost when what was not fsynced is lost.

Killing a process loses nothing it wrote (the kernel keeps the pages); a power cut loses what
was not fsynced. So each broker runs with ``[store] sync_trace`` (store/tracedisk.py), which
writes down what each fsync made durable, and after killing every process the test puts each
store directory into a state a power cut could have left (dev/powercut.py: unsynced names
gone, unsynced renames undone, each file cut to its synced bytes plus a random part of the
rest, now and then garbled), restarts, and counts what is there.

The control runs the same with ``fsync = "never"`` and a cut that keeps nothing unsynced: it
must lose confirmed messages, or the cut would prove nothing.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import connect
from test_standalone_store import Broker

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.powercut import cut, power_off

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PERSISTENT = pika.BasicProperties(delivery_mode=2)
QUEUE = "pc.q"
# Small segments and snapshots: segment rolls, snapshot children (forked, traced too) and
# segment deletions all happen while the publishers run.
STORE_OPTIONS = "sync_trace = true\nsegment_mib = 1\nsnapshot_mib = 1"
# Messages confirmed before the power goes off.
CONFIRMED = 2500
PAD = b"." * 600


class _Publisher(threading.Thread):
    """Publishes persistent messages with confirms, one at a time, until its broker dies;
    ``confirmed``: the bodies the broker confirmed."""

    def __init__(self, connect_to: Callable[[], pika.BlockingConnection], tag: str) -> None:
        super().__init__(daemon=True)
        self.connect_to, self.tag = connect_to, tag
        self.confirmed: list[bytes] = []

    def run(self) -> None:
        try:
            ch = self.connect_to().channel()
            ch.confirm_delivery()
            i = 0
            while True:
                body = b"%s-%d-" % (self.tag.encode(), i) + PAD
                i += 1
                ch.basic_publish("", QUEUE, body, PERSISTENT)  # raises unless confirmed
                self.confirmed.append(body)
        except (pika.exceptions.AMQPError, OSError):
            pass  # the power went off: what was confirmed before counts


def _publish_until_cut(pubs: list[_Publisher], pids: Callable[[], list[int]]) -> set[bytes]:
    for p in pubs:
        p.start()
    deadline = time.monotonic() + 40
    while sum(len(p.confirmed) for p in pubs) < CONFIRMED:
        assert all(p.is_alive() for p in pubs), "a publisher stopped before the cut"
        assert time.monotonic() < deadline, sum(len(p.confirmed) for p in pubs)
        time.sleep(0.05)
    power_off(pids())
    for p in pubs:
        p.join(30)
    return {b for p in pubs for b in p.confirmed}


def _drain(ch: Any) -> set[bytes]:
    try:
        ch.queue_declare(QUEUE, durable=True, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == 404
        return set()  # lost with everything else
    got: list[bytes] = []
    for m, _p, body in ch.consume(QUEUE, auto_ack=True, inactivity_timeout=2.0):
        if m is None:
            break
        got.append(body)
    ch.cancel()
    assert len(got) == len(set(got))
    return set(got)


def _cut_all(dirs: list[Path], seed: int, keep: str) -> None:
    for k, d in enumerate(dirs):
        done = cut(d, random.Random(seed * 10 + k), "random" if keep == "random" else "none")
        print(f"{d.name}: {done.summary()}")  # shown when the test fails


def _check(confirmed: set[bytes], found: set[bytes], fsync: str, keep: str, lost: bool) -> None:
    """Every confirmed message found, or (the control) some of them lost."""
    missing = confirmed - found
    print(f"fsync {fsync}, cut {keep}: {len(confirmed)} confirmed, {len(found)} found")
    if lost:
        assert missing, f"the control lost nothing of {len(confirmed)} confirmed"
    else:
        assert not missing, f"{len(missing)} of {len(confirmed)} confirmed messages lost"


@pytest.mark.parametrize(
    ("fsync", "keep", "lost"),
    [("always", "random", False), ("never", "none", True)],
    ids=["fsync-always", "control-fsync-never"],
)
def test_a_power_cut_of_the_whole_cluster_loses_no_confirmed_message(
    broker_set: Callable[..., BrokerSet], fsync: str, keep: str, lost: bool
) -> None:
    bs = broker_set(store=True, fsync=fsync, store_options=STORE_OPTIONS)
    members = [1, 2, 3]
    c = connect(bs, 1)
    c.channel().queue_declare(QUEUE, durable=True)
    c.close()
    # Active-active: a publisher on every member.
    pubs = [_Publisher(lambda n=n: connect(bs, n), f"m{n}") for n in members]  # type: ignore[misc]
    confirmed = _publish_until_cut(pubs, lambda: [bs.procs[n].pid for n in members])
    for n in members:
        bs.procs[n].wait(10)
    _cut_all([bs.store_path(n) for n in members], 7, keep)
    for n in members:
        bs.start(n)
    bs.wait_ready(members, timeout=90)
    found = _drain(connect(bs, 2).channel())
    _check(confirmed, found, fsync, keep, lost)
    bs.converged(members)


@pytest.mark.parametrize(
    ("fsync", "keep", "lost"),
    [("always", "random", False), ("never", "none", True)],
    ids=["fsync-always", "control-fsync-never"],
)
def test_a_power_cut_of_a_standalone_broker_loses_no_confirmed_message(
    tmp_path: Path, fsync: str, keep: str, lost: bool
) -> None:
    broker = Broker(tmp_path)
    broker.config.write_text(broker.config.read_text() + f'fsync = "{fsync}"\n{STORE_OPTIONS}\n')
    try:
        broker.start()
        c = broker.connect()
        c.channel().queue_declare(QUEUE, durable=True)
        c.close()
        pubs = [_Publisher(broker.connect, f"p{k}") for k in range(2)]
        assert broker.proc is not None
        confirmed = _publish_until_cut(pubs, lambda: [broker.proc.pid])  # type: ignore[union-attr]
        broker.proc.wait(10)
        _cut_all([tmp_path / "store"], 11, keep)
        broker.start()
        found = _drain(broker.connect().channel())
    finally:
        broker.close()
        for n in range(1, broker.starts + 1):  # shown when the test fails
            print(f"--- start {n}\n{(tmp_path / f'broker-{n}.log').read_text(errors='replace')}")
    _check(confirmed, found, fsync, keep, lost)

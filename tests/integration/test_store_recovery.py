"""Durable stores on real corosync with real clients: what the cluster confirmed survives losing
every member at once (kill -9 of all three, a cluster stop), whichever order they come back
in, and the freshest store wins even when a stale member starts first."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import connect, management

from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _declare(ch: Any, queues: list[str]) -> None:
    ch.exchange_declare("dur.x", "direct", durable=True)
    ch.exchange_declare("tmp.x", "direct", durable=False)
    for q in queues:
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, "dur.x", q)
    ch.queue_declare("tmp.q", durable=False)
    ch.queue_bind("tmp.q", "dur.x", queues[0])


def _declare_on(bs: BrokerSet, queues: list[str]) -> None:
    c = connect(bs, 1)
    _declare(c.channel(), queues)
    c.close()


def _publish_confirmed(bs: BrokerSet, node: int, queue: str, n: int, tag: str) -> list[bytes]:
    conn = connect(bs, node)
    ch = conn.channel()
    ch.confirm_delivery()
    sent = []
    for i in range(n):
        body = f"{tag}-{i}".encode()
        ch.basic_publish("dur.x", queue, body, PERSISTENT)  # raises unless confirmed
        sent.append(body)
    conn.close()
    return sent


def _get_all(bs: BrokerSet, node: int, queue: str) -> list[tuple[bytes, bool]]:
    conn = connect(bs, node)
    ch = conn.channel()
    out = []
    while True:
        m, _p, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            break
        out.append((body, bool(m.redelivered)))
    conn.close()
    return out


def _restart(bs: BrokerSet, order: list[int], gap: float = 0.0) -> None:
    for n in order:
        bs.start(n)
        time.sleep(gap)
    bs.wait_ready(order, timeout=90)


def _kill_all(bs: BrokerSet) -> None:
    for n in (1, 2, 3):
        bs.kill(n)


class _Publisher(threading.Thread):
    """Publishes persistent messages with confirms until stopped or cut off; remembers which
    ones the cluster confirmed."""

    def __init__(self, bs: BrokerSet, node: int, queue: str, tx: bool = False) -> None:
        super().__init__(daemon=True)
        self.bs, self.node, self.queue, self.tx = bs, node, queue, tx
        self.confirmed: list[bytes] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = connect(self.bs, self.node)
            ch = conn.channel()
            if self.tx:
                ch.tx_select()
            else:
                ch.confirm_delivery()
            i = 0
            while not self.stop.is_set():
                batch = [f"{self.queue}-{self.node}-{i + k}".encode() for k in range(5)]
                i += 5
                if self.tx:
                    for body in batch:
                        ch.basic_publish("dur.x", self.queue, body, PERSISTENT)
                    ch.tx_commit()
                    self.confirmed += batch
                else:
                    for body in batch:
                        ch.basic_publish("dur.x", self.queue, body, PERSISTENT)
                        self.confirmed.append(body)
        except (pika.exceptions.AMQPError, OSError) as e:
            self.error = e  # cut off by the kill: what was confirmed before counts


class _Consumer(threading.Thread):
    """Consumes and acks; remembers what it acked (never to be delivered again)."""

    def __init__(self, bs: BrokerSet, node: int, queue: str) -> None:
        super().__init__(daemon=True)
        self.bs, self.node, self.queue = bs, node, queue
        self.acked: list[bytes] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            conn = connect(self.bs, self.node)
            ch = conn.channel()
            ch.basic_qos(prefetch_count=20)
            for m, _p, body in ch.consume(self.queue, inactivity_timeout=0.05):
                if self.stop.is_set():
                    break
                if m is None:
                    continue
                ch.basic_ack(m.delivery_tag)
                # Counted once the ack left: a kill may still lose it (then the message comes
                # back, which at-least-once allows); an ack the broker applied never does.
                self.acked.append(body)
        except (pika.exceptions.AMQPError, OSError):
            pass


def _run_load_and_kill(
    bs: BrokerSet, queues: list[str], seconds: float
) -> tuple[dict[str, list[bytes]], dict[str, list[bytes]]]:
    pubs = [
        _Publisher(bs, 1, queues[0]),
        _Publisher(bs, 2, queues[1]),
        _Publisher(bs, 3, queues[2], tx=True),
    ]
    cons = [_Consumer(bs, 2, queues[0]), _Consumer(bs, 3, queues[1])]
    for t in [*pubs, *cons]:
        t.start()
    time.sleep(seconds)
    _kill_all(bs)
    for t in [*pubs, *cons]:
        t.stop.set()
        t.join(15)
    confirmed: dict[str, list[bytes]] = {q: [] for q in queues}
    for p in pubs:
        confirmed[p.queue] += p.confirmed
    acked: dict[str, list[bytes]] = {q: [] for q in queues}
    for c in cons:
        acked[c.queue] += c.acked
    return confirmed, acked


def _check_after_recovery(
    bs: BrokerSet,
    queues: list[str],
    confirmed: dict[str, list[bytes]],
    acked: dict[str, list[bytes]],
) -> None:
    digest = bs.converged([1, 2, 3], timeout=30)
    assert digest
    for q in queues:
        got = [b for b, _r in _get_all(bs, 1 + queues.index(q) % 3, q)]
        # Every confirmed message is there unless it was acked before the kill.
        missing = set(confirmed[q]) - set(got) - set(acked[q])
        assert not missing, (
            f"{q}: {len(missing)} confirmed messages lost, e.g. {sorted(missing)[:3]}"
        )
    assert sum(len(v) for v in confirmed.values()) > 100


@pytest.fixture
def stored(broker_set: Callable[..., BrokerSet]) -> BrokerSet:
    return broker_set(store=True)


def test_confirmed_persistent_messages_survive_kill_9_of_every_member(stored: BrokerSet) -> None:
    bs = stored
    queues = ["s.q1", "s.q2", "s.q3"]
    c = connect(bs, 1)
    _declare(c.channel(), queues)
    c.close()
    confirmed, acked = _run_load_and_kill(bs, queues, seconds=4)
    _restart(bs, [3, 1, 2])
    _check_after_recovery(bs, queues, confirmed, acked)
    # What a restart drops is gone, everywhere alike; the durable topology is back.
    conn = connect(bs, 2)
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.queue_declare("tmp.q", passive=True)
    assert e.value.reply_code == 404
    ch = conn.channel()
    ch.exchange_declare("dur.x", "direct", durable=True, passive=True)
    for n in (1, 2, 3):
        s = bs.status(n)
        assert s is not None and s["store"]["durable_seq"] > 0
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpgbroker",
            "status",
            *bs.cli_args(2),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "store: " in shown and "fsync always" in shown and "durable event" in shown


def test_operators_changes_survive_kill_9_of_every_member(stored: BrokerSet) -> None:
    """Users, vhosts, permissions, policies and federation upstreams changed at runtime through
    the management API: once a change is answered it is stored on every member, so killing all
    of them with SIGKILL the moment after loses none of it (and a deleted user stays deleted)."""
    bs = stored

    def api(node: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return management(bs, node, method, path, f"Bearer {bs.admin_target(node).secret}", body)

    assert (
        api(2, "PUT", "/api/users/ops", {"password": "s3cret", "tags": "administrator"})[0] == 201
    )
    assert api(3, "PUT", "/api/users/gone", {"password": "x", "tags": ""})[0] == 201
    assert api(1, "PUT", "/api/vhosts/prod")[0] == 201
    perms = {"configure": ".*", "write": ".*", "read": ".*"}
    assert api(1, "PUT", "/api/permissions/prod/ops", perms)[0] == 201
    policy = {"pattern": "^capped$", "apply-to": "queues", "definition": {"max-length": 2}}
    assert api(2, "PUT", "/api/policies/%2F/cap", policy)[0] == 201
    upstream = {"value": {"uri": "amqp://127.0.0.1:1/", "ack-mode": "on-publish"}}
    assert api(3, "PUT", "/api/parameters/federation-upstream/%2F/far", upstream)[0] == 201
    c = connect(bs, 1)
    ch = c.channel()
    ch.confirm_delivery()
    ch.queue_declare("capped", durable=True)
    for i in range(5):
        ch.basic_publish("", "capped", b"%d" % i, PERSISTENT)
    c.close()
    # The last change, answered, then every member killed at once.
    assert api(1, "DELETE", "/api/users/gone")[0] == 204
    _kill_all(bs)
    _restart(bs, [3, 2, 1])
    bs.converged([1, 2, 3])
    for n in (1, 2, 3):
        assert api(n, "GET", "/api/users/ops")[1]["tags"] == ["administrator"]
        assert api(n, "GET", "/api/users/gone")[0] == 404
        assert api(n, "GET", "/api/policies/%2F/cap")[1]["definition"] == {"max-length": 2}
        got = api(n, "GET", "/api/parameters/federation-upstream/%2F/far")[1]
        assert got["value"]["ack-mode"] == "on-publish", got
    # The restored user logs in to the restored vhost with the password it was given; another
    # password is refused; the policy still caps the queue.
    port = bs.ports[2][0]
    login = pika.BlockingConnection(
        pika.URLParameters(f"amqp://ops:s3cret@127.0.0.1:{port}/prod?connection_attempts=1")
    )
    login.channel().queue_declare("in-prod")
    login.close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(
            pika.URLParameters(f"amqp://ops:wrong@127.0.0.1:{port}/prod?connection_attempts=1")
        )
    c = connect(bs, 3)
    ch = c.channel()
    ch.confirm_delivery()
    ch.basic_publish("", "capped", b"5", PERSISTENT)
    c.close()
    assert [b for b, _r in _get_all(bs, 2, "capped")] == [b"4", b"5"]


def test_a_cluster_stop_and_start_keeps_queues_exchanges_and_messages(stored: BrokerSet) -> None:
    bs = stored
    _declare_on(bs, ["s.stop"])
    sent = _publish_confirmed(bs, 2, "s.stop", 300, "stop")
    code, answer = bs.control(1, "/stop", {})
    assert code == 202, answer
    for n in (1, 2, 3):
        bs.procs[n].wait(30)
    for n in (1, 2, 3):
        s = (bs.store_path(n) / "meta.json").read_text()
        assert '"state": "clean"' in s
    _restart(bs, [2, 3, 1])
    assert [b for b, _r in _get_all(bs, 3, "s.stop")] == sent
    bs.converged([1, 2, 3])


def test_the_freshest_store_wins_even_when_a_stale_member_starts_first(stored: BrokerSet) -> None:
    bs = stored
    _declare_on(bs, ["s.fresh"])
    early = _publish_confirmed(bs, 1, "s.fresh", 50, "early")
    bs.kill(3)  # member 3's store stops here: stale from now on
    late = _publish_confirmed(bs, 1, "s.fresh", 50, "late")
    _kill_all(bs)
    _restart(bs, [3, 2, 1], gap=1.0)  # the stale member first
    assert [b for b, _r in _get_all(bs, 3, "s.fresh")] == early + late
    bs.converged([1, 2, 3])
    assert "replaced" in bs.tail(3, 200) or "takes a state update" in bs.tail(3, 200)


def test_a_member_with_its_store_deleted_is_updated_from_the_others(stored: BrokerSet) -> None:
    bs = stored
    _declare_on(bs, ["s.del"])
    sent = _publish_confirmed(bs, 2, "s.del", 100, "del")
    _kill_all(bs)
    shutil.rmtree(bs.store_path(2))
    _restart(bs, [2, 1, 3])
    assert [b for b, _r in _get_all(bs, 2, "s.del")] == sent
    bs.converged([1, 2, 3])


def test_the_last_member_standing_restarts_alone_with_force_boot(stored: BrokerSet) -> None:
    bs = stored
    _declare_on(bs, ["s.last"])
    first = _publish_confirmed(bs, 1, "s.last", 40, "first")
    bs.kill(2)
    bs.kill(3)
    # Member 1 serves alone (the corosync nodes keep quorum) and confirms more.
    last = _publish_confirmed(bs, 1, "s.last", 40, "last")
    bs.kill(1)
    bs.start(1, force_boot=True)
    bs.wait_ready([1], timeout=60)
    assert "FORCED BOOT" in bs.tail(1, 200)
    s = bs.status(1)
    assert s is not None and s["store"]["epoch"] == 2
    # The stale members come back and take the state of the forced boot.
    for n in (2, 3):
        bs.start(n)
    bs.wait_ready([2, 3], timeout=60)
    assert [b for b, _r in _get_all(bs, 2, "s.last")] == first + last
    bs.converged([1, 2, 3])


@pytest.fixture
def small_disk(cluster: Any) -> Any:
    """``small_disk(bs, node, mib)``: put ``node``'s store on a tmpfs of ``mib`` MiB (before
    the broker starts); unmounted after the test."""
    mounted: list[Path] = []

    def mount(bs: BrokerSet, node: int, mib: int) -> Path:
        path = bs.store_path(node)
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], check=True
        )
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def own_set(cluster: Any) -> Any:
    """``own_set(**options)``: a 3-member set with stores, not started (a test prepares its
    disks first); stopped after the test, member 2's log shown if it failed."""
    made: list[BrokerSet] = []

    def make(**options: Any) -> BrokerSet:
        group = f"t{uuid.uuid4().hex[:10]}"
        bs = BrokerSet(cluster, group=group, name=f"broker-{group}", store=True, **options)
        made.append(bs)
        return bs

    yield make
    for bs in made:
        bs.stop_all()
        print(f"--- broker 2 log\n{bs.tail(2, 40)}")


def test_a_member_low_on_disk_blocks_publishers_everywhere_until_space_is_back(
    own_set: Any, small_disk: Any
) -> None:
    bs = own_set(store_options="free_disk_limit_mib = 32")
    small_disk(bs, 2, 64)
    bs.start_all(timeout=60)
    conn = connect(bs, 1)
    blocked: list[str] = []
    conn.add_on_connection_blocked_callback(lambda _c, m: blocked.append(m.method.reason))
    ch = conn.channel()
    _declare(ch, ["s.disk"])
    ch.basic_publish("dur.x", "s.disk", b"before", PERSISTENT)
    filler = bs.store_path(2) / "filler"
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=40"],
        check=True,
        capture_output=True,
    )
    deadline = time.monotonic() + 15
    while not blocked:
        assert time.monotonic() < deadline, "no connection.blocked after the disk filled"
        conn.process_data_events(0.1)
    assert blocked == ["low on disk"]
    for n in (1, 2, 3):  # at the same event everywhere: every replica says so
        s = bs.status(n)
        assert s is not None and s["publishers_blocked"] and len(s["disk_alarms"]) == 1
    filler.unlink()
    deadline = time.monotonic() + 15
    while any((bs.status(n) or {}).get("publishers_blocked") for n in (1, 2, 3)):
        assert time.monotonic() < deadline, "publishers still blocked after space came back"
        conn.process_data_events(0.1)
    ch.confirm_delivery()
    ch.basic_publish("dur.x", "s.disk", b"after", PERSISTENT)
    conn.close()
    assert [b for b, _r in _get_all(bs, 3, "s.disk")] == [b"before", b"after"]


def test_a_member_whose_disk_fills_leaves_and_nothing_confirmed_is_lost(
    own_set: Any, small_disk: Any
) -> None:
    bs = own_set(store_options="free_disk_limit_mib = 0")
    small_disk(bs, 2, 6)
    bs.start_all(timeout=60)
    _declare_on(bs, ["s.full1", "s.full2"])
    confirmed: dict[str, list[bytes]] = {"s.full1": [], "s.full2": []}
    body = b"x" * 1000

    def publish(node: int, queue: str, n: int) -> None:
        nodes = [node, 3]  # fail over to member 3
        i = 0
        while i < n:
            try:
                conn = connect(bs, nodes[0])
                ch = conn.channel()
                ch.confirm_delivery()
                while i < n:
                    tag = f"{queue}-{i}".encode()
                    ch.basic_publish("dur.x", queue, tag + body, PERSISTENT)
                    confirmed[queue].append(tag)
                    i += 1
                conn.close()
            except (pika.exceptions.AMQPError, OSError):
                nodes = nodes[1:] or [3]
                time.sleep(0.5)

    t1 = threading.Thread(target=publish, args=(1, "s.full1", 5000))
    t2 = threading.Thread(target=publish, args=(2, "s.full2", 5000))
    t1.start()
    t2.start()
    t1.join(120)
    t2.join(120)
    assert bs.procs[2].wait(30) != 0  # member 2 left the cluster
    assert "store-write: ENOSPC" in bs.tail(2, 300)
    for q, sent in confirmed.items():
        got = {b.split(b"x", 1)[0] for b, _r in _get_all(bs, 3, q)}
        missing = [t for t in sent if t not in got]
        assert not missing, f"{q}: {len(missing)} confirmed messages lost"
    assert len(confirmed["s.full1"]) == 5000
    bs.converged([1, 3])


def test_a_store_corrupted_before_its_tail_is_set_aside_and_its_member_updated(
    stored: BrokerSet,
) -> None:
    bs = stored
    _declare_on(bs, ["s.corrupt"])
    sent = _publish_confirmed(bs, 3, "s.corrupt", 200, "corrupt")
    code, answer = bs.control(1, "/stop", {})
    assert code == 202, answer
    for n in (1, 2, 3):
        bs.procs[n].wait(30)
    # Flip a byte in the middle of member 2's journal: valid records follow it, so this is
    # no torn write but corruption.
    seg = sorted(bs.store_path(2).glob("journal-*.log"))[0]
    data = bytearray(seg.read_bytes())
    at = len(data) // 2
    data[at] ^= 0xFF
    seg.write_bytes(bytes(data))
    _restart(bs, [2, 1, 3])
    log = bs.tail(2, 300)
    assert "cannot be trusted" in log and seg.name in log and "offset" in log
    assert list(bs.store_path(2).parent.glob(f"{bs.store_path(2).name}.discarded-*"))
    assert [b for b, _r in _get_all(bs, 2, "s.corrupt")] == sent
    bs.converged([1, 2, 3])


def test_with_recover_with_majority_two_members_restart_the_cluster_and_the_third_catches_up(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(store=True, store_options='recover_with = "majority"')
    _declare_on(bs, ["s.major"])
    sent = _publish_confirmed(bs, 2, "s.major", 100, "major")
    _kill_all(bs)
    _restart(bs, [3, 1])  # member 2 stays down
    assert [b for b, _r in _get_all(bs, 1, "s.major")] == sent
    more = _publish_confirmed(bs, 3, "s.major", 20, "more")
    # With one member left, a persistent message is not confirmed: no majority of stores.
    bs.kill(1)
    conn = connect(bs, 3)
    ch = conn.channel()
    ch.confirm_delivery()
    done = threading.Event()

    def publish() -> None:
        with contextlib.suppress(pika.exceptions.AMQPError, OSError):
            ch.basic_publish("dur.x", "s.major", b"lonely", PERSISTENT)
            done.set()

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    t.join(3)
    assert not done.is_set(), "a persistent message was confirmed by one member of three"
    # Member 2 comes back: a majority serves again and the confirm goes out.
    bs.start(2)
    bs.wait_ready([2], timeout=60)
    t.join(30)
    assert done.is_set()
    conn.close()
    bs.start(1)
    bs.wait_ready([1], timeout=60)
    got = [b for b, _r in _get_all(bs, 2, "s.major")]
    assert got == [*more, b"lonely"]  # the first 100 were taken by the get above
    bs.converged([1, 2, 3])


def test_a_killed_member_loses_at_most_a_tick_of_its_event_log(brokers: BrokerSet) -> None:
    bs = brokers
    _declare_on(bs, ["s.log"])
    _publish_confirmed(bs, 2, "s.log", 300, "log")
    time.sleep(0.5)  # quiet: only ticks from here
    s = bs.status(2)
    assert s is not None
    seen = int(s["event_seq"])
    bs.kill(2)
    last = 0
    for line in bs.event_log_path(2).read_text().splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("type") == "tick" or rec.get("type") == "data":
                last = max(last, int(rec["seq"]))
    # Ticks come every 100 ms: at most the one (or two, with the status read in between)
    # applied since the last flush are missing.
    assert last >= seen - 2, (last, seen)


def _primary(bs: BrokerSet) -> int:
    """The hot-standby primary, as member 1 names it."""
    status = bs.status(1)
    assert status is not None and status["primary_url"], status
    port = status["primary_url"].rsplit(":", 1)[1].strip("/")
    return next(n for n in (1, 2, 3) if bs.url(n).endswith(f":{port}/"))


def test_hot_standby_shipping_changes_stores_what_it_confirms(
    broker_set: Callable[..., BrokerSet],
) -> None:
    """``replication = "changes"`` with stores: every member journals the primary's change
    batches, a persistent message's confirm waits for every store, and after kill -9 of
    every member the cluster comes back from the stores with every confirmed message (and
    without what a restart drops)."""
    bs = broker_set(store=True, cluster_options='mode = "hot-standby"\nreplication = "changes"')
    primary = _primary(bs)
    queues = ["hs.q1", "hs.q2"]
    c = connect(bs, primary)
    _declare(c.channel(), queues)
    c.close()
    pubs = [_Publisher(bs, primary, queues[0]), _Publisher(bs, primary, queues[1], tx=True)]
    cons = [_Consumer(bs, primary, queues[0])]
    for t in [*pubs, *cons]:
        t.start()
    time.sleep(4)
    for n in (1, 2, 3):
        s = bs.status(n)
        assert s is not None and s["store"]["durable_seq"] > 0, s
    _kill_all(bs)
    for t in [*pubs, *cons]:
        t.stop.set()
        t.join(15)
    confirmed = {q: [b for p in pubs if p.queue == q for b in p.confirmed] for q in queues}
    acked = {q: [b for k in cons if k.queue == q for b in k.acked] for q in queues}
    assert sum(len(v) for v in confirmed.values()) > 100
    _restart(bs, [3, 1, 2])
    digest = bs.converged([1, 2, 3], timeout=30)
    assert digest
    primary = _primary(bs)
    for q in queues:
        got = [b for b, _r in _get_all(bs, primary, q)]
        missing = set(confirmed[q]) - set(got) - set(acked[q])
        assert not missing, f"{q}: {len(missing)} confirmed messages lost"
    conn = connect(bs, primary)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        conn.channel().queue_declare("tmp.q", passive=True)
    assert e.value.reply_code == 404


_GUEST = (
    '[[users]]\nname = "guest"\npassword = "guest"\nvhosts = ["/"]\nloopback_only = true\n'
    'tags = ["administrator"]\n'
)


def _app_user(password: str) -> str:
    return f'[[users]]\nname = "app"\npassword = "{password}"\nvhosts = ["/"]\n'


def _publish_as_app(bs: BrokerSet, node: int, password: str, n: int, tag: str) -> list[bytes]:
    params = pika.URLParameters(f"amqp://app:{password}@127.0.0.1:{bs.ports[node][0]}/")
    params.socket_timeout = 5
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.confirm_delivery()
    sent = []
    for i in range(n):
        body = f"{tag}-{i}".encode()
        ch.basic_publish("dur.x", "pw.q", body, PERSISTENT)  # raises unless confirmed
        sent.append(body)
    conn.close()
    return sent


def _serving(bs: BrokerSet, hot_standby: bool) -> list[int]:
    """The members that take clients: all of them, or the one every member names primary."""
    if not hot_standby:
        return [1, 2, 3]
    named = set()
    for n in (1, 2, 3):
        s = bs.status(n)
        assert s is not None
        named.add(s["primary_url"].split("@")[-1].split("://")[-1])
    assert len(named) == 1, named
    (where,) = named
    return [n for n in (1, 2, 3) if bs.url(n).endswith(where)]


def _ready(bs: BrokerSet, node: int, queue: str) -> int:
    s = bs.status(node)
    assert s is not None
    return int(s["queues"][f"/:{queue}"]["ready"])


@pytest.mark.parametrize("hot_standby", [False, True], ids=["active-active", "hot-standby"])
def test_a_restart_with_a_changed_password_keeps_what_the_old_one_published(
    own_set: Any, hot_standby: bool
) -> None:
    """The journals hold the clients' logins as they were sent: every member's file changes a
    user's password, then the whole cluster is killed and restarted. The journal replays under
    the password it was written with (or every message that user published would be lost), the
    new password applies from the restart on, alike on every member, and what is published
    under it survives the next kill of every member."""
    mode = 'mode = "hot-standby"' if hot_standby else ""
    bs = own_set(extra_config=_GUEST + _app_user("old"), cluster_options=mode)
    bs.start_all(timeout=60)
    serving = _serving(bs, hot_standby)
    c = connect(bs, serving[0])
    _declare(c.channel(), ["pw.q"])
    c.close()
    sent = [b for n in serving for b in _publish_as_app(bs, n, "old", 120 // len(serving), f"o{n}")]
    _kill_all(bs)
    bs.extra_config = _GUEST + _app_user("new")  # every member's file, alike
    _restart(bs, [1, 2, 3])
    bs.converged([1, 2, 3])
    for n in (1, 2, 3):
        found = _ready(bs, n, "pw.q")
        assert found == len(sent), f"member {n}: {len(sent)} confirmed, {found} found"
        # Every member read its recovered state back with the new settings before joining.
        bs.wait_log(n, "they apply from a snapshot at event")
    serving = _serving(bs, hot_standby)
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        _publish_as_app(bs, serving[0], "old", 1, "refused")
    sent += [
        b for n in serving for b in _publish_as_app(bs, n, "new", 120 // len(serving), f"n{n}")
    ]
    _kill_all(bs)
    _restart(bs, [3, 2, 1])
    bs.converged([1, 2, 3])
    got = [body for body, _r in _get_all(bs, _serving(bs, hot_standby)[0], "pw.q")]
    assert len(got) == len(sent) and sorted(got) == sorted(sent), (
        f"{len(sent)} confirmed, {len(got)} found: lost {sorted(set(sent) - set(got))[:5]}"
    )

"""Upgrades on real corosync: release 0.1.0 (built from this repository's history,
tests/upgrade/releases.toml) replaced member by member by the current code under confirmed load,
after a whole-cluster SIGKILL, and rolled back; a member outside the cluster's model versions
refused with nothing altered."""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import amqp
import pika
import pytest
from brokerclients import connect, drain_queue, management, wait_state

from cpgbroker import __version__
from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.model.versions import NEWEST, OLDEST

pytestmark = pytest.mark.integration

OLD = "0.1.0"
QUEUE = "upgrade.q"
PERSISTENT = pika.BasicProperties(delivery_mode=2)
HOT_STANDBY = 'mode = "hot-standby"\nreplication = "changes"'


class Publisher(threading.Thread):
    """Persistent messages with confirms to a durable queue, one at a time, failing over to
    the next member whenever its connection goes (a member stopped for its upgrade, or a
    hot-standby backup that turns clients away). Records when each confirm came."""

    def __init__(self, bs: BrokerSet) -> None:
        super().__init__(daemon=True)
        self.bs = bs
        self.confirmed: list[bytes] = []
        self.times: list[float] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        i, k = 0, 0
        try:
            while not self.stopping.is_set():
                node = 1 + k % 3
                try:
                    conn = connect(self.bs, node)
                    ch = conn.channel()
                    ch.confirm_delivery()
                    ch.queue_declare(QUEUE, durable=True)
                    while not self.stopping.is_set():
                        body = b"m-%d" % i
                        i += 1
                        ch.basic_publish("", QUEUE, body, PERSISTENT)
                        self.confirmed.append(body)
                        self.times.append(time.monotonic())
                except (pika.exceptions.AMQPError, OSError):
                    k += 1
                    time.sleep(0.05)
        except BaseException as e:  # reported by stop()
            self.error = e

    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)

    def wait_for(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        start = len(self.confirmed)
        while len(self.confirmed) < start + n:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"only {len(self.confirmed) - start} confirms"
            time.sleep(0.05)

    def stop(self) -> list[bytes]:
        self.stopping.set()
        self.join(30)
        assert not self.is_alive(), "publisher did not stop"
        if self.error is not None:
            raise self.error
        return self.confirmed


def _serving(bs: BrokerSet) -> int:
    """A member that takes clients (hot standby: the primary)."""
    for n in (1, 2, 3):
        s = bs.status(n)
        if s is not None and s.get("role", "primary") == "primary" and s["state"] == "ready":
            return n
    raise AssertionError("no member serves")


def _versions(bs: BrokerSet, nodes: list[int]) -> dict[int, tuple[str | None, int | None]]:
    out: dict[int, tuple[str | None, int | None]] = {}
    for n in nodes:
        s = bs.status(n)
        assert s is not None
        out[n] = ((s.get("software") or {}).get("release"), s.get("model_version"))
    return out


def _big_double(bs: BrokerSet, node: int) -> float | None:
    """Publish (confirmed) a message whose header holds a 1e308 double, as Java and Go
    clients send them, and get it back: its value, or None when the member refused it (501 at
    model version 7, release 0.1.0's behaviour; accepted from model version 8)."""
    c = amqp.Connection(
        bs.url(node).removeprefix("amqp://").split("@")[-1].rstrip("/"),
        userid="guest",
        password="guest",
        confirm_publish=True,
        connect_timeout=5,
        read_timeout=5,
    )
    c.connect()
    try:
        ch = c.channel()
        ch.queue_declare("doubles.q", durable=True, auto_delete=False)
        ch.basic_publish(amqp.Message(b"d", application_headers={"big": 1e308}), "", "doubles.q")
        got = ch.basic_get("doubles.q", no_ack=True)
        assert got is not None
        value: float = got.application_headers["big"]
        return value
    except amqp.exceptions.AMQPError as e:
        assert e.reply_code == 501 and "single-precision" in e.reply_text, e
        return None
    finally:
        with contextlib.suppress(Exception):
            c.collect()


def _flag(bs: BrokerSet, node: int) -> str:
    """The state of model version NEWEST's feature flag, as the member's management API says."""
    bearer = f"Bearer {bs.admin_target(node).secret}"
    status, flags = management(bs, node, "GET", "/api/feature-flags", bearer)
    assert status == 200, flags
    (flag,) = [f for f in flags if f["name"] == f"model_version_{NEWEST}"]
    state: str = flag["state"]
    return state


def _upgrade_member(bs: BrokerSet, n: int, python: str) -> None:
    bs.stop(n)
    bs.set_python(n, python)
    bs.start(n)
    bs.wait_ready([n], timeout=60)


def _finish(bs: BrokerSet, node: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cpgbroker",
            "cluster",
            "upgrade-finish",
            *bs.cli_args(node),
            *list(extra),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("mode", ["active-active", "hot-standby"])
def test_a_rolling_upgrade_from_0_1_0_under_confirmed_load_loses_nothing(
    broker_set: Callable[..., BrokerSet], releases: dict[str, str], mode: str
) -> None:
    options: dict[str, Any] = {"store": True, "python": releases[OLD]}
    if mode == "hot-standby":
        options["cluster_options"] = HOT_STANDBY
    bs = broker_set(**options)
    pub = Publisher(bs)
    pub.start()
    pub.wait_for(200)
    gaps: dict[int, float] = {}
    # Hot standby: the backups first, the primary last (its clients fail over once).
    primary = _serving(bs)
    order = [n for n in (1, 2, 3) if n != primary] + [primary]
    for i, n in enumerate(order):
        _upgrade_member(bs, n, sys.executable)
        pub.wait_for(200, timeout=60)
        gaps[n] = pub.longest_gap()
        bs.converged([1, 2, 3], timeout=30)
        if i == 0:
            # Not every member applies model version 8 yet: the feature flag says so.
            assert _flag(bs, n) == "unavailable"
        # The new member runs at the cluster's version, the old release's.
        assert _versions(bs, [n])[n] == (__version__, OLDEST)
    # Every member runs the new release, the cluster still the old model: the old behaviour.
    assert _big_double(bs, _serving(bs)) is None
    status = wait_state(bs, _serving(bs), lambda s: bool(s.get("upgrade")))
    assert status["upgrade"]["pending"] and status["upgrade"]["newest_all_apply"] == NEWEST
    bearer = f"Bearer {bs.admin_target(1).secret}"
    _, metrics = management(bs, 1, "GET", "/metrics", bearer)
    assert "cpgbroker_upgrade_pending 1.0" in metrics
    assert (
        f'cpgbroker_build_info{{model_versions="{OLDEST}-{NEWEST}",release="{__version__}"}}'
        in (metrics)
    )
    assert _flag(bs, _serving(bs)) == "disabled"
    if mode == "active-active":
        done = _finish(bs, _serving(bs))
        assert done.returncode == 0, done.stderr
        assert f"model version {NEWEST} (was {OLDEST})" in done.stdout
    else:
        # RabbitMQ's way, through the management API of the primary.
        answer = management(
            bs, _serving(bs), "PUT", f"/api/feature-flags/model_version_{NEWEST}/enable", bearer
        )
        assert answer == (204, None)
    for n in (1, 2, 3):
        wait_state(bs, n, lambda s: s.get("model_version") == NEWEST)
    assert _big_double(bs, _serving(bs)) == 1e308
    _, overview = management(bs, 2, "GET", "/api/overview", bearer)
    assert overview["cpgbroker_cluster"]["model_version"] == NEWEST
    assert not overview["cpgbroker_cluster"]["upgrade"]["pending"]
    assert _flag(bs, 3) == "enabled"
    pub.wait_for(200, timeout=60)
    confirmed = pub.stop()
    bs.converged([1, 2, 3], timeout=30)
    got = drain_queue(bs, _serving(bs), QUEUE)
    lost = set(confirmed) - set(got)
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:5]}"
    print(f"{mode}: {len(confirmed)} confirmed; longest confirm gap per step {gaps}")


def test_a_whole_0_1_0_cluster_killed_comes_back_on_the_current_code_with_every_message(
    broker_set: Callable[..., BrokerSet], releases: dict[str, str]
) -> None:
    bs = broker_set(store=True, python=releases[OLD])
    ch = connect(bs, 1).channel()
    ch.confirm_delivery()
    ch.queue_declare(QUEUE, durable=True)
    sent = [b"kept-%d" % i for i in range(500)]
    for body in sent:
        ch.basic_publish("", QUEUE, body, PERSISTENT)
    for n in (1, 2, 3):
        bs.kill(n)
    for n in (1, 2, 3):
        bs.set_python(n, sys.executable)
    bs.start_all(timeout=90)
    assert _versions(bs, [1, 2, 3]) == {n: (__version__, OLDEST) for n in (1, 2, 3)}
    bs.converged([1, 2, 3], timeout=30)
    assert drain_queue(bs, 2, QUEUE) == sent
    # Raised afterwards, the cluster serves at the new version.
    done = _finish(bs, 1)
    assert done.returncode == 0, done.stderr
    for n in (1, 2, 3):
        wait_state(bs, n, lambda s: s.get("model_version") == NEWEST)
    bs.converged([1, 2, 3], timeout=30)


def test_a_member_rolled_back_to_0_1_0_before_the_upgrade_is_finished_rejoins(
    broker_set: Callable[..., BrokerSet], releases: dict[str, str]
) -> None:
    bs = broker_set(store=True, python=releases[OLD])
    for n in (1, 2):
        _upgrade_member(bs, n, sys.executable)
    ch = connect(bs, 1).channel()
    ch.confirm_delivery()
    ch.queue_declare(QUEUE, durable=True)
    ch.basic_publish("", QUEUE, b"before the rollback", PERSISTENT)
    # Member 2's store was written by the current code at model version 7: 0.1.0 reads it.
    _upgrade_member(bs, 2, releases[OLD])
    assert _versions(bs, [1, 2, 3]) == {1: (__version__, OLDEST), 2: (None, None), 3: (None, None)}
    bs.converged([1, 2, 3], timeout=30)
    ch2 = connect(bs, 2).channel()
    ch2.confirm_delivery()
    ch2.basic_publish("", QUEUE, b"after the rollback", PERSISTENT)
    assert drain_queue(bs, 3, QUEUE) == [b"before the rollback", b"after the rollback"]
    # With an old member present the cluster cannot move up, and says which member holds it.
    refused = _finish(bs, 1)
    assert refused.returncode == 1
    assert "not every member applies model version" in refused.stderr
    assert "cpgbroker 0.1.0" in refused.stderr
    assert _versions(bs, [1])[1] == (__version__, OLDEST)


def test_a_0_1_0_member_is_refused_by_a_cluster_that_moved_up_and_its_store_is_untouched(
    broker_set: Callable[..., BrokerSet], releases: dict[str, str]
) -> None:
    bs = broker_set(store=True)
    assert _versions(bs, [1, 2, 3]) == {n: (__version__, NEWEST) for n in (1, 2, 3)}
    bs.stop(3)
    store = Path(bs.store_path(3))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in store.iterdir()}
    bs.set_python(3, releases[OLD])
    proc = bs.start(3)
    assert proc.wait(60) != 0
    log = bs.tail(3, 40)
    # 0.1.0 refuses a store at a model version it cannot replay, naming it.
    assert f"model version {NEWEST}" in log, log
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in store.iterdir()}
    assert after == before
    # The others serve on.
    ch = connect(bs, 1).channel()
    ch.confirm_delivery()
    ch.queue_declare("still.q")
    ch.basic_publish("", "still.q", b"x")


def _users(app_password: str) -> str:
    return (
        '[[users]]\nname = "guest"\npassword = "guest"\nvhosts = ["/"]\nloopback_only = true\n'
        'tags = ["administrator"]\n'
        f'[[users]]\nname = "app"\npassword = "{app_password}"\nvhosts = ["/"]\n'
    )


def test_a_store_0_1_0_wrote_under_other_settings_after_the_current_code_keeps_its_messages(
    broker_set: Callable[..., BrokerSet], releases: dict[str, str]
) -> None:
    """The current code keeps the settings a store's journal was written with beside it; 0.1.0
    ignores that file. A cluster upgraded, rolled back whole with every file's password
    changed, then upgraded again must not replay what 0.1.0 journaled under the stale file:
    the metadata 0.1.0 rewrote no longer names it, so the configuration's settings apply."""
    bs = broker_set(store=True, python=releases[OLD], extra_config=_users("a"))
    for n in (1, 2, 3):
        _upgrade_member(bs, n, sys.executable)  # each store keeps the settings with "a"
    for n in (1, 2, 3):
        bs.kill(n)
        bs.set_python(n, releases[OLD])
    bs.extra_config = _users("b")
    bs.start_all(timeout=90)
    params = pika.URLParameters(f"amqp://app:b@127.0.0.1:{bs.ports[1][0]}/")
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(QUEUE, durable=True)
    sent = [b"under-b-%d" % i for i in range(60)]
    for body in sent:
        ch.basic_publish("", QUEUE, body, PERSISTENT)  # raises unless confirmed
    conn.close()
    for n in (1, 2, 3):
        bs.kill(n)
        bs.set_python(n, sys.executable)
    bs.start_all(timeout=90)
    bs.converged([1, 2, 3], timeout=30)
    assert drain_queue(bs, 2, QUEUE) == sent

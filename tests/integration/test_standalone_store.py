"""A standalone broker (``cpgbroker start`` without ``[cluster]``) with a ``[store]`` keeps what a
RabbitMQ node keeps across a restart: killed with SIGKILL or stopped with SIGTERM and started
again on the same store, every confirmed persistent message on a durable queue is there, in
order (those delivered and not acked back and marked redelivered), with the durable exchange,
its binding and a user made through the management API; the non-durable queue and the
transient messages are gone. A store that cannot be recovered stops the process (exit status 3,
naming the file) instead of starting empty.

A real process on loopback and a real client (pika); no corosync, so it runs everywhere."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import OPEN

from cpgbroker.dev.brokers import free_ports

pytestmark = pytest.mark.slow

GUEST = "Basic " + base64.b64encode(b"guest:guest").decode()
PERSISTENT = pika.BasicProperties(delivery_mode=2)
TRANSIENT = pika.BasicProperties(delivery_mode=1)
N = 500


class Broker:
    """``cpgbroker start`` on a config of its own, its store in ``tmp_path/store``."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.port, self.admin = free_ports(2)
        self.config = tmp_path / "cpgbroker.toml"
        self.config.write_text(
            f"""
[server]
listen = ["127.0.0.1:{self.port}"]
admin = "127.0.0.1:{self.admin}"
admin_secret_file = "{tmp_path / "admin.secret"}"
shutdown_grace = 2.0

[[users]]
name = "guest"
password = "guest"
loopback_only = true
tags = ["administrator"]

[store]
dir = "{tmp_path / "store"}"
"""
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.dir / f"broker-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cpgbroker", "start", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                self.connect().close()
                break
            except pika.exceptions.AMQPConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        # The admin endpoint opens after the AMQP listeners.
        while self.management("GET", "/api/overview")[0] != 200:
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def connect(self) -> pika.BlockingConnection:
        p = pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{self.port}/")
        p.connection_attempts = 1
        p.socket_timeout = 5
        conn = pika.BlockingConnection(p)
        OPEN.append(conn)  # closed after the test, even if the broker died under it
        return conn

    def status(self) -> dict[str, Any]:
        secret = (self.dir / "admin.secret").read_text().strip()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin}/status",
            headers={"Authorization": f"Bearer {secret}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            out: dict[str, Any] = json.loads(resp.read())
        return out

    def wait_stored(self) -> None:
        """Until the store holds every event applied so far."""
        seq = self.status()["event_seq"]
        deadline = time.monotonic() + 10
        while self.status()["store"]["durable_seq"] < seq:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def management(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin}{path}",
            data=data,
            method=method,
            headers={"Authorization": GUEST, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw, status = resp.read(), resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        except OSError:
            return 0, None
        return status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw


@pytest.fixture
def broker(tmp_path: Path) -> Any:
    b = Broker(tmp_path)
    yield b
    b.close()
    for n in range(1, b.starts + 1):  # shown by pytest only when the test failed
        print(f"--- start {n}\n{(tmp_path / f'broker-{n}.log').read_text(errors='replace')}")


def publish_and_hold(broker: Broker) -> list[bytes]:
    """Definitions, N confirmed persistent messages on the durable queue ``dq`` (transient ones
    between them), some on the non-durable ``tq``, and 5 of ``dq``'s delivered, not acked, to a
    consumer whose connection the caller leaves open. The persistent bodies, in order."""
    assert broker.management("PUT", "/api/users/alice", {"password": "s3cret", "tags": ""})[0] in (
        201,
        204,
    )
    conn = broker.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare("dx", "direct", durable=True)
    ch.queue_declare("dq", durable=True)
    ch.queue_declare("tq", durable=False)
    ch.queue_bind("dq", "dx", "k")
    sent = []
    for i in range(N):
        body = f"p{i}".encode()
        ch.basic_publish("dx", "k", body, PERSISTENT, mandatory=True)  # raises unless confirmed
        sent.append(body)
        if i % 10 == 9:
            ch.basic_publish("dx", "k", f"t{i}".encode(), TRANSIENT)
            ch.basic_publish("", "tq", f"q{i}".encode(), PERSISTENT)
    holder = broker.connect()
    hch = holder.channel()
    hch.basic_qos(prefetch_count=5)
    held: list[bytes] = []
    hch.basic_consume("dq", lambda _c, _m, _p, body: held.append(body))
    deadline = time.monotonic() + 10
    while len(held) < 5:
        assert time.monotonic() < deadline
        holder.process_data_events(time_limit=0.1)
    assert held == sent[:5]
    conn.close()
    # The deliveries went out without waiting for the disk (only confirms wait): once the store
    # holds them, a restart marks those messages redelivered. (A delivery the process dies
    # before writing leaves its message unmarked, which the flag's "may have been delivered"
    # allows, as in RabbitMQ.)
    broker.wait_stored()
    return sent


def assert_kept(broker: Broker, sent: list[bytes], redelivered: int) -> None:
    """Every persistent message in order (the first ``redelivered`` marked so), the durable
    definitions and the user; the non-durable queue gone."""
    conn = broker.connect()
    ch = conn.channel()
    assert ch.queue_declare("dq", durable=True).method.message_count == len(sent)
    got: list[tuple[bytes, bool]] = []
    while True:
        method, _props, body = ch.basic_get("dq", auto_ack=True)
        if method is None:
            break
        got.append((body, bool(method.redelivered)))
    assert [b for b, _r in got] == sent
    assert [r for _b, r in got] == [True] * redelivered + [False] * (len(sent) - redelivered)
    # The binding routes: a mandatory publish to dx with key k is not returned.
    ch.confirm_delivery()
    ch.basic_publish("dx", "k", b"after", PERSISTENT, mandatory=True)
    assert ch.basic_get("dq", auto_ack=True)[2] == b"after"
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
        ch.queue_declare("tq", passive=True)
    assert gone.value.reply_code == 404
    conn.close()
    status, user = broker.management("GET", "/api/users/alice")
    assert status == 200 and user["name"] == "alice"


def test_sigkill_then_restart_keeps_every_confirmed_persistent_message(broker: Broker) -> None:
    broker.start()
    sent = publish_and_hold(broker)
    broker.kill()
    broker.start()
    assert "recovered event" in broker.log.read_text()
    assert_kept(broker, sent, redelivered=5)
    # A second kill, after the restart's own events were journaled: nothing is lost either.
    conn = broker.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    more = [f"m{i}".encode() for i in range(50)]
    for body in more:
        ch.basic_publish("", "dq", body, PERSISTENT, mandatory=True)
    broker.kill()
    broker.start()
    assert_kept(broker, more, redelivered=0)


def test_sigterm_closes_the_store_clean_and_a_restart_keeps_everything(broker: Broker) -> None:
    broker.start()
    sent = publish_and_hold(broker)
    assert broker.terminate() == 0
    meta = json.loads((broker.dir / "store" / "meta.json").read_text())
    assert meta["state"] == "clean", meta
    assert "store closed cleanly" in broker.log.read_text()
    broker.start()
    assert "stopped cleanly" in broker.log.read_text()
    assert_kept(broker, sent, redelivered=5)


def test_a_store_that_cannot_be_recovered_stops_the_broker(broker: Broker) -> None:
    broker.start()
    conn = broker.connect()
    conn.channel().queue_declare("dq", durable=True)
    conn.close()
    assert broker.terminate() == 0
    journal = sorted((broker.dir / "store").glob("journal-*"))[0]
    data = bytearray(journal.read_bytes())
    data[40] ^= 0xFF  # in an early record, good ones after it: corruption, not a torn tail
    journal.write_bytes(bytes(data))
    broker.starts += 1
    with open(broker.log, "wb") as log:
        code = subprocess.run(
            [sys.executable, "-m", "cpgbroker", "start", "--config", str(broker.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=60,
            check=False,
        ).returncode
    assert code == 3
    text = broker.log.read_text()
    assert "cannot be recovered" in text and journal.name in text, text
    assert journal.read_bytes() == bytes(data)  # left as it was

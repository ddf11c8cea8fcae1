"""No client can hurt the cluster with ordinary commands (#21): one client declares 40,000
exchanges and deletes 2,000 of them in one burst while a well-behaved client publishes with
confirms on another member. Every member replays the burst; with bounded-cost commands no
member stalls long enough to be killed, and the other client's confirms stay fast."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from brokerclients import connect
from pamqp import commands as C
from pamqp import frame

from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

EXCHANGES = 40_000
DELETES = 2_000


class RawClient:
    """A minimal AMQP client on a socket: sends pre-encoded frames in bulk (nowait), as an
    abusive client would, and waits for one reply when told to."""

    def __init__(self, url_port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", url_port), timeout=30)
        self.buf = b""
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self.expect(C.Connection.Start)
        self.send(
            0,
            C.Connection.StartOk(
                client_properties={}, mechanism="PLAIN", response="\0guest\0guest"
            ),
        )
        tune = self.expect(C.Connection.Tune)
        self.send(
            0,
            C.Connection.TuneOk(
                channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=0
            ),
        )
        self.send(0, C.Connection.Open(virtual_host="/"))
        self.expect(C.Connection.OpenOk)
        self.send(1, C.Channel.Open())
        self.expect(C.Channel.OpenOk)

    def send(self, ch: int, method: object) -> None:
        self.sock.sendall(bytes(frame.marshal(method, ch)))

    def expect(self, cls: type) -> object:
        while True:
            while len(self.buf) < 7 or len(self.buf) < 8 + struct.unpack_from(">I", self.buf, 3)[0]:
                data = self.sock.recv(65536)
                assert data, "connection closed"
                self.buf += data
            size = struct.unpack_from(">I", self.buf, 3)[0]
            raw, self.buf = self.buf[: size + 8], self.buf[size + 8 :]
            _, _, value = frame.unmarshal(raw)
            if isinstance(value, C.Connection.Close | C.Channel.Close):
                raise AssertionError(f"closed by the broker: {value.reply_text}")
            if isinstance(value, cls):
                return value

    def bulk(self, methods: list[object]) -> None:
        """Send ``methods`` (nowait) in one write, then a round trip to wait for them."""
        self.sock.sendall(b"".join(bytes(frame.marshal(m, 1)) for m in methods))
        self.send(1, C.Exchange.Declare(exchange="sync", exchange_type="direct"))
        self.expect(C.Exchange.DeclareOk)


def test_exchange_delete_burst_does_not_stall_the_cluster(brokers: BrokerSet) -> None:
    port = int(brokers.url(1).rsplit(":", 1)[1].split("/")[0])
    bad = RawClient(port)
    try:
        _burst(brokers, bad)
    finally:
        bad.sock.close()


def _burst(brokers: BrokerSet, bad: RawClient) -> None:
    for start in range(0, EXCHANGES, 2_000):
        bad.bulk(
            [
                C.Exchange.Declare(exchange=f"x{i}", exchange_type="direct", nowait=True)
                for i in range(start, start + 2_000)
            ]
        )

    good = connect(brokers, 2)
    ch = good.channel()
    ch.confirm_delivery()
    ch.queue_declare("work")
    latencies: list[float] = []
    burst_at: list[float] = []
    stop = threading.Event()

    def attack() -> None:
        time.sleep(1.0)  # let the publisher reach a steady state first
        burst_at.append(time.monotonic())
        bad.bulk([C.Exchange.Delete(exchange=f"x{i}", nowait=True) for i in range(DELETES)])
        burst_at.append(time.monotonic())
        time.sleep(1.0)
        stop.set()

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not stop.is_set():
        assert time.monotonic() < deadline, "the burst did not complete"
        t0 = time.monotonic()
        ch.basic_publish("", "work", b"m")  # blocks until confirmed
        latencies.append(time.monotonic() - t0)
    t.join(5)

    # Every member is alive and serving, and they agree.
    for n in (1, 2, 3):
        assert brokers.status(n) is not None, f"member {n} is gone"
    brokers.converged([1, 2, 3])
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    print(
        f"confirms: {len(latencies)}, p50 {latencies[len(latencies) // 2] * 1e3:.1f} ms, "
        f"p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms, "
        f"burst applied in {(burst_at[1] - burst_at[0]) * 1e3:.0f} ms"
    )
    assert len(latencies) > 50
    assert p99 < 0.050, f"confirm p99 {p99 * 1e3:.1f} ms"

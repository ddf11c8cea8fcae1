"""A confirmed message survives a partition: a publisher on the member being cut off publishes
as fast as it can with many confirms outstanding; every message it saw confirmed must be on the
quorate side afterwards. Messages multicast just before the cut can be applied on the cut-off
member only; their confirms must never reach the client."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
import urllib.parse

import pytest
from brokerclients import connect, drain, queues, wait_state
from pamqp import body as pbody
from pamqp import commands, frame, header
from test_quorum import STOP_WITHIN, not_serving

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster

pytestmark = pytest.mark.integration

# Unconfirmed publishes the client keeps in flight: enough that, whenever the link is cut,
# some of them were just multicast by the member being cut off.
WINDOW = 2000
# Large bodies keep the cut-off member's corosync transmitting for much of each token
# rotation, so the cut likely lands while it sends.
BODY = 4096


class RawPublisher(threading.Thread):
    """A pipelined confirm-mode publisher on a plain socket (pika's blocking channel waits for
    each confirm). Bodies are publish sequence numbers; ``confirmed`` gets those acked."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        u = urllib.parse.urlsplit(url)
        self.addr = (u.hostname or "127.0.0.1", u.port or 5672)
        self.queue = queue
        self.confirmed: set[int] = set()
        self.nacked: set[int] = set()
        self.sent = 0
        self.close_code: int | None = None
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.buf = bytearray()

    def _frames(self, sock: socket.socket, block: bool) -> list[object]:
        if block or select.select([sock], [], [], 0.005)[0]:
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError("closed by the broker")
            self.buf += data
        out = []
        while len(self.buf) >= 7:
            (size,) = struct.unpack_from(">I", self.buf, 3)
            if len(self.buf) < size + 8:
                break
            _n, _ch, f = frame.unmarshal(bytes(self.buf[: size + 8]))
            del self.buf[: size + 8]
            out.append(f)
        return out

    def _rpc(self, sock: socket.socket, ch: int, method: object, reply: type) -> None:
        sock.sendall(frame.marshal(method, ch))
        while True:
            for f in self._frames(sock, True):
                if isinstance(f, reply):
                    return

    def run(self) -> None:
        try:
            self._run()
        except (OSError, ConnectionError) as e:
            self.error = e

    def _run(self) -> None:
        sock = socket.create_connection(self.addr, timeout=10)
        with sock:
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            while not any(
                isinstance(f, commands.Connection.Start) for f in self._frames(sock, True)
            ):
                pass
            sock.sendall(
                frame.marshal(
                    commands.Connection.StartOk(
                        client_properties={"capabilities": {"publisher_confirms": True}},
                        mechanism="PLAIN",
                        response="\0guest\0guest",
                    ),
                    0,
                )
            )
            while not any(
                isinstance(f, commands.Connection.Tune) for f in self._frames(sock, True)
            ):
                pass
            sock.sendall(frame.marshal(commands.Connection.TuneOk(2047, 131072, 0), 0))
            self._rpc(
                sock, 0, commands.Connection.Open(virtual_host="/"), commands.Connection.OpenOk
            )
            self._rpc(sock, 1, commands.Channel.Open(), commands.Channel.OpenOk)
            self._rpc(sock, 1, commands.Confirm.Select(), commands.Confirm.SelectOk)
            self._rpc(sock, 1, commands.Queue.Declare(queue=self.queue), commands.Queue.DeclareOk)
            acked = 0
            while not self.stop.is_set():
                if self.sent - acked - len(self.nacked) < WINDOW:
                    chunk = bytearray()
                    for _ in range(50):
                        self.sent += 1
                        body = b"%d " % self.sent
                        body += b"x" * (BODY - len(body))
                        chunk += frame.marshal(commands.Basic.Publish(routing_key=self.queue), 1)
                        chunk += frame.marshal(
                            header.ContentHeader(0, len(body), commands.Basic.Properties()), 1
                        )
                        chunk += frame.marshal(pbody.ContentBody(body), 1)
                    sock.sendall(chunk)
                for f in self._frames(sock, False):
                    if isinstance(f, commands.Basic.Ack):
                        first = acked + 1 if f.multiple else f.delivery_tag
                        self.confirmed.update(range(first, f.delivery_tag + 1))
                        acked = max(acked, f.delivery_tag)
                    elif isinstance(f, commands.Basic.Nack):
                        self.nacked.add(f.delivery_tag)
                    elif isinstance(f, commands.Connection.Close):
                        self.close_code = f.reply_code
                        return


def test_every_confirm_from_a_member_cut_off_is_on_the_majority(
    brokers: BrokerSet, cluster: DevCluster
) -> None:
    pub = RawPublisher(brokers.url(3), "cut")
    pub.start()
    deadline = time.monotonic() + 10
    while len(pub.confirmed) < 500:
        assert time.monotonic() < deadline and pub.is_alive(), (pub.error, pub.sent)
        time.sleep(0.02)
    cluster.partition(3)
    wait_state(brokers, 3, not_serving, STOP_WITHIN)
    pub.join(10)
    pub.stop.set()
    pub.join(5)
    confirmed = set(pub.confirmed)
    assert confirmed, "the publisher saw no confirm"
    assert pub.close_code in (320, None), pub.close_code
    cluster.heal(3)
    wait_state(brokers, 3, lambda s: s["state"] == "ready", 60)
    brokers.converged([1, 2, 3], timeout=30)

    # Everything the quorate side holds, read on a member of it.
    depth = queues(brokers, 1)["/:cut"]["ready"]
    conn = connect(brokers, 1)
    ch = conn.channel()
    got: set[int] = set()
    ch.basic_consume("cut", lambda _c, _m, _p, body: got.add(int(body.split()[0])), auto_ack=True)
    drain(conn, lambda: len(got) >= depth, timeout=60)
    assert len(got) == depth
    missing = sorted(confirmed - got)
    print(
        f"sent {pub.sent}, confirmed {len(confirmed)}, on the majority {len(got)}, "
        f"unconfirmed there {len(got - confirmed)}"
    )
    assert not missing, f"{len(missing)} confirmed messages lost, e.g. {missing[:10]}"

"""What a broker answers to malformed and unusual input, one raw connection per case; prints
JSON. Run it against cpgbroker and against RabbitMQ (e.g. a private node from the shared
``rabbitmq_baseline.sh``) to compare reply codes where the spec leaves room:

    python bench/reply_codes.py --addr 127.0.0.1:5672 [--user guest --password guest]
    python bench/reply_codes.py --start     # a standalone cpgbroker of this tree, on a free port

Each case opens a connection (to a handshake stage, or open with channel 1), sends one thing and
reports the first answer: ``connection.close CODE TEXT [class.method]``, ``channel.close ...``,
another method's name, ``eof`` (the socket closed without a close) or ``nothing`` (no answer
within the timeout).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from pamqp import commands, frame

FRAME_END = b"\xce"


def raw_frame(ftype: int, channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + FRAME_END


def nested_table(depth: int) -> bytes:
    """A field table nested ``depth`` levels deep ({"a": {"a": ...}}), encoded by hand: pamqp's
    recursive encoder is what such input is meant to stress."""
    inner = b""
    for _ in range(depth):
        body = b"\x01a" + b"F" + struct.pack(">I", len(inner)) + inner
        inner = body
    return struct.pack(">I", len(inner)) + inner


class Conn:
    def __init__(self, addr: tuple[str, int], timeout: float) -> None:
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def method(self, channel: int, m: Any) -> None:
        self.send(frame.marshal(m, channel))

    def read(self) -> tuple[int, Any] | str:
        while True:
            if len(self.buf) >= 7:
                size = struct.unpack_from(">I", self.buf, 3)[0]
                if len(self.buf) >= size + 8:
                    used, ch, fr = frame.unmarshal(self.buf)
                    self.buf = self.buf[used:]
                    return ch, fr
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return "nothing"
            except ConnectionError:
                return "eof"
            if not data:
                return "eof"
            self.buf += data

    def read_method(self) -> tuple[int, Any] | str:
        while True:
            got = self.read()
            if isinstance(got, str) or not isinstance(got[1], frame.heartbeat.Heartbeat):
                return got

    def close(self) -> None:
        self.sock.close()


def open_conn(
    addr: tuple[str, int],
    user: str,
    password: str,
    timeout: float,
    client_props: bytes | None,
    stage: str = "channel",
) -> Conn:
    """A connection taken to ``stage``: ``start`` (connection.start received), ``tune``
    (connection.tune received), ``open`` (tune-ok sent) or ``channel`` (channel 1 open)."""
    c = Conn(addr, timeout)
    c.send(b"AMQP\x00\x00\x09\x01")
    c.read_method()  # connection.start
    if stage == "start":
        return c
    if client_props is None:
        c.method(0, commands.Connection.StartOk(response=f"\0{user}\0{password}"))
    else:
        # start-ok with hand-made client properties: table, mechanism, response, locale.
        response = f"\0{user}\0{password}".encode()
        args = (
            client_props + b"\x05PLAIN" + struct.pack(">I", len(response)) + response + b"\x05en_US"
        )
        c.send(raw_frame(1, 0, struct.pack(">HH", 10, 11) + args))
        return c
    c.read_method()  # tune
    if stage == "tune":
        return c
    c.method(0, commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0))
    if stage == "open":
        return c
    c.method(0, commands.Connection.Open(virtual_host="/"))
    c.read_method()  # open-ok
    c.method(1, commands.Channel.Open())
    c.read_method()  # channel open-ok
    return c


def describe(got: tuple[int, Any] | str) -> str:
    if isinstance(got, str):
        return got
    _ch, m = got
    if isinstance(m, commands.Connection.Close | commands.Channel.Close):
        kind = "connection.close" if isinstance(m, commands.Connection.Close) else "channel.close"
        return f"{kind} {m.reply_code} {m.reply_text} [{m.class_id}.{m.method_id}]"
    return str(m.name)


def header_payload(class_id: int, weight: int, props: bytes = b"\x00\x00") -> bytes:
    return struct.pack(">HHQ", class_id, weight, 3) + props


def publish(c: Conn) -> None:
    c.method(1, commands.Basic.Publish(exchange="", routing_key="reply-codes-none"))


def args_of(m: Any) -> bytes:
    """A method's arguments as pamqp encodes them (the payload after class and method id)."""
    return bytes(frame.marshal(m, 0))[11:-1]


def method_raw(channel: int, class_id: int, method_id: int, args: bytes) -> bytes:
    return raw_frame(1, channel, struct.pack(">HH", class_id, method_id) + args)


def headers_props(table: bytes) -> bytes:
    # property flags: only `headers` (bit 13 of the first flag word).
    return struct.pack(">H", 1 << 13) + table


CASES: dict[str, Callable[[Conn], None]] = {
    "content header shorter than its fixed part": lambda c: (
        publish(c),
        c.send(raw_frame(2, 1, b"\x00\x3c\x00")),
    ),
    "content header of another class": lambda c: (
        publish(c),
        c.send(raw_frame(2, 1, header_payload(50, 0))),
    ),
    "content header with a non-zero weight": lambda c: (
        publish(c),
        c.send(raw_frame(2, 1, header_payload(60, 1))),
    ),
    "heartbeat with a payload": lambda c: c.send(raw_frame(8, 0, b"xx")),
    "heartbeat on channel 1": lambda c: c.send(raw_frame(8, 1, b"")),
    "queue.declare on channel 0": lambda c: c.method(0, commands.Queue.Declare(queue="rc-q0")),
    "queue.declare arguments nested 300 deep": lambda c: c.send(
        raw_frame(
            1,
            1,
            struct.pack(">HH", 50, 10) + b"\x00\x00" + b"\x05rc-dq" + b"\x00" + nested_table(300),
        )
    ),
    "headers table nested 300 deep at publish": lambda c: (
        publish(c),
        c.send(raw_frame(2, 1, header_payload(60, 0, headers_props(nested_table(300))))),
    ),
    "headers table whose length runs past the header": lambda c: (
        publish(c),
        c.send(
            raw_frame(
                2, 1, header_payload(60, 0, headers_props(struct.pack(">I", 1000) + b"\x01aS"))
            )
        ),
    ),
    "method with trailing bytes": lambda c: c.send(
        raw_frame(1, 1, frame.marshal(commands.Basic.Qos(prefetch_count=1), 1)[7:-1] + b"zz")
    ),
    "queue.declare with trailing bytes": lambda c: c.send(
        method_raw(1, 50, 10, args_of(commands.Queue.Declare(queue="rc-tq")) + b"\x00")
    ),
    "basic.ack with trailing bytes": lambda c: c.send(
        method_raw(1, 60, 80, args_of(commands.Basic.Ack(delivery_tag=1)) + b"\x00")
    ),
    "basic.publish with trailing bytes": lambda c: c.send(
        method_raw(1, 60, 40, args_of(commands.Basic.Publish(routing_key="rc-none")) + b"z")
    ),
    "trailing bytes making the text longer than 255": lambda c: c.send(
        method_raw(1, 60, 10, args_of(commands.Basic.Qos(prefetch_count=1)) + b"z" * 200)
    ),
    "basic.qos arguments cut short": lambda c: c.send(method_raw(1, 60, 10, b"\x00\x00\x00")),
    "basic.ack arguments cut short": lambda c: c.send(method_raw(1, 60, 80, b"\x00" * 8)),
    "basic.publish routing key running past the frame": lambda c: c.send(
        method_raw(1, 60, 40, b"\x00\x00\x00\x09rc")
    ),
    "queue.declare name running past the frame": lambda c: c.send(
        method_raw(1, 50, 10, b"\x00\x00\x20rc")
    ),
    "queue.declare arguments table running past the frame": lambda c: c.send(
        method_raw(1, 50, 10, b"\x00\x00\x02rc\x00" + struct.pack(">I", 100) + b"\x01aI")
    ),
    "queue.declare arguments table with an unknown field type": lambda c: c.send(
        method_raw(1, 50, 10, b"\x00\x00\x02rc\x00" + struct.pack(">I", 4) + b"\x01aZ\x00")
    ),
    "queue.declare name that is not UTF-8": lambda c: c.send(
        method_raw(1, 50, 10, b"\x00\x00\x02\xff\xfe\x00\x00\x00\x00\x00")
    ),
    "method frame shorter than its class and method ids": lambda c: c.send(
        raw_frame(1, 1, b"\x00\x3c\x00")
    ),
    "connection.open after open": lambda c: c.method(0, commands.Connection.Open(virtual_host="/")),
    "connection.tune-ok after open": lambda c: c.method(
        0, commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0)
    ),
    "connection.start-ok after open": lambda c: c.method(
        0, commands.Connection.StartOk(response="\0guest\0guest")
    ),
    "connection.close-ok after open": lambda c: c.method(0, commands.Connection.CloseOk()),
    "connection.start from the client": lambda c: c.method(0, commands.Connection.Start()),
    "connection.tune-ok cut short after open": lambda c: c.send(method_raw(0, 10, 31, b"\x00\x01")),
    # Encoded by hand: pamqp's own name pattern and length check would refuse to encode these.
    "exchange name of 200 bytes": lambda c: c.send(
        raw_frame(
            1,
            1,
            struct.pack(">HH", 40, 10)
            + b"\x00\x00"
            + bytes([200])
            + b"e" * 200
            + b"\x06direct"
            + b"\x00"
            + b"\x00\x00\x00\x00",
        )
    ),
    "queue name with '='": lambda c: c.send(
        raw_frame(
            1,
            1,
            struct.pack(">HH", 50, 10) + b"\x00\x00" + b"\x03a=b" + b"\x08" + b"\x00\x00\x00\x00",
        )
    ),
}


# Cases sent before connection.open: (the stage the connection is taken to, what to send).
HANDSHAKE_CASES: dict[str, tuple[str, Callable[[Conn], None]]] = {
    "connection.tune-ok while awaiting start-ok": (
        "start",
        lambda c: c.method(0, commands.Connection.TuneOk(frame_max=131072)),
    ),
    "connection.open while awaiting start-ok": (
        "start",
        lambda c: c.method(0, commands.Connection.Open(virtual_host="/")),
    ),
    "queue.declare on channel 0 while awaiting start-ok": (
        "start",
        lambda c: c.method(0, commands.Queue.Declare(queue="rc-h")),
    ),
    "channel.open on channel 1 while awaiting start-ok": (
        "start",
        lambda c: c.method(1, commands.Channel.Open()),
    ),
    "connection.close while awaiting start-ok": (
        "start",
        lambda c: c.method(0, commands.Connection.Close(reply_code=200, class_id=0, method_id=0)),
    ),
    "connection.start-ok cut short": ("start", lambda c: c.send(method_raw(0, 10, 11, b"\x00"))),
    "connection.open while awaiting tune-ok": (
        "tune",
        lambda c: c.method(0, commands.Connection.Open(virtual_host="/")),
    ),
    "connection.start-ok while awaiting tune-ok": (
        "tune",
        lambda c: c.method(0, commands.Connection.StartOk(response="\0guest\0guest")),
    ),
    "connection.tune-ok with trailing bytes": (
        "tune",
        lambda c: c.send(
            method_raw(0, 10, 31, args_of(commands.Connection.TuneOk(frame_max=131072)) + b"z")
        ),
    ),
    "connection.close while awaiting tune-ok": (
        "tune",
        lambda c: c.method(0, commands.Connection.Close(reply_code=200, class_id=0, method_id=0)),
    ),
    "connection.tune-ok while awaiting open": (
        "open",
        lambda c: c.method(0, commands.Connection.TuneOk(frame_max=131072)),
    ),
    "connection.update-secret while awaiting open": (
        "open",
        lambda c: c.method(0, commands.Connection.UpdateSecret(new_secret="x", reason="r")),
    ),
    "channel.open on channel 1 while awaiting open": (
        "open",
        lambda c: c.method(1, commands.Channel.Open()),
    ),
    "connection.open with trailing bytes": (
        "open",
        lambda c: c.send(
            method_raw(0, 10, 40, args_of(commands.Connection.Open(virtual_host="/")) + b"z")
        ),
    ),
}


def start_cpgbroker() -> tuple[subprocess.Popen[str], str]:
    """A standalone cpgbroker of this tree on a free loopback port (default users)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpgbroker", "start", "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"listening host=\S+ port=(\d+)", line)
        if m:
            return proc, f"127.0.0.1:{m.group(1)}"
    proc.kill()
    raise SystemExit("cpgbroker did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--addr", default="127.0.0.1:5672")
    ap.add_argument(
        "--start",
        action="store_true",
        help="start a standalone cpgbroker of this tree on a free port and ask it (not --addr)",
    )
    ap.add_argument("--user", default="guest")
    ap.add_argument("--password", default="guest")
    ap.add_argument("--timeout", type=float, default=3.0)
    a = ap.parse_args()
    proc = None
    if a.start:
        proc, a.addr = start_cpgbroker()
    try:
        print(json.dumps(run(a), indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)


def run(a: argparse.Namespace) -> dict[str, str]:
    host, port = a.addr.rsplit(":", 1)
    addr = (host, int(port))
    out: dict[str, str] = {}
    # Before authentication: client properties nested 300 deep in connection.start-ok.
    c = open_conn(addr, a.user, a.password, a.timeout, client_props=nested_table(300))
    out["start-ok client properties nested 300 deep"] = describe(c.read_method())
    c.close()
    for name, case in CASES.items():
        c = open_conn(addr, a.user, a.password, a.timeout, client_props=None)
        try:
            case(c)
            out[name] = describe(c.read_method())
        except OSError as e:
            out[name] = f"error {e!r}"
        finally:
            c.close()
    for name, (stage, case) in HANDSHAKE_CASES.items():
        c = open_conn(addr, a.user, a.password, a.timeout, client_props=None, stage=stage)
        try:
            case(c)
            out[name] = describe(c.read_method())
        except OSError as e:
            out[name] = f"error {e!r}"
        finally:
            c.close()
    return out


if __name__ == "__main__":
    main()

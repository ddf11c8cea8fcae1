"""What a broker answers to malformed and unusual input, one raw connection per case; prints
JSON. Run it against cpgbroker and against RabbitMQ (e.g. a private node from the shared
``rabbitmq_baseline.sh``) to compare reply codes where the spec leaves room:

    python bench/reply_codes.py --addr 127.0.0.1:5672 [--user guest --password guest]

Each case opens a connection (and channel 1), sends one thing and reports the first answer:
``connection.close CODE TEXT``, ``channel.close CODE TEXT``, another method's name, ``eof``
(the socket closed without a close) or ``nothing`` (no answer within the timeout).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
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
    addr: tuple[str, int], user: str, password: str, timeout: float, client_props: bytes | None
) -> Conn:
    c = Conn(addr, timeout)
    c.send(b"AMQP\x00\x00\x09\x01")
    c.read_method()  # connection.start
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
    c.method(0, commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0))
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
        return f"{kind} {m.reply_code} {m.reply_text}"
    return str(m.name)


def header_payload(class_id: int, weight: int, props: bytes = b"\x00\x00") -> bytes:
    return struct.pack(">HHQ", class_id, weight, 3) + props


def publish(c: Conn) -> None:
    c.method(1, commands.Basic.Publish(exchange="", routing_key="reply-codes-none"))


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", default="127.0.0.1:5672")
    ap.add_argument("--user", default="guest")
    ap.add_argument("--password", default="guest")
    ap.add_argument("--timeout", type=float, default=3.0)
    a = ap.parse_args()
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
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Protocol violations from a raw socket, heartbeat behaviour on the wire, and configured limits.
After every misbehaving client a well-behaved pika client must find the broker unaffected."""

from __future__ import annotations

import contextlib
import random
import struct
import time
from typing import Any

import pika.exceptions as px
import pytest
from clientutil import (
    PROTOCOL_HEADER,
    BrokerFactory,
    BrokerProcess,
    RawClient,
    blocking,
    drain_get,
)
from pamqp import commands
from pamqp import frame as pframe
from pamqp import heartbeat as pheartbeat


def assert_broker_serves(addr: tuple[str, int], prefix: str) -> None:
    """A fresh pika client can still declare, publish and get."""
    c = blocking(addr)
    try:
        ch = c.channel()
        q = ch.queue_declare(f"{prefix}.after", auto_delete=False).method.queue
        ch.confirm_delivery()
        ch.basic_publish("", q, b"still serving")
        assert drain_get(ch, q) == [b"still serving"]
        ch.queue_delete(q)
    finally:
        c.close()


def expect_connection_close(raw: RawClient) -> Any:
    """The next method is connection.close; answer close-ok and check the socket closes."""
    f = raw.read_method()
    assert f is not None, "broker closed the socket without connection.close"
    channel, method = f
    assert channel == 0 and isinstance(method, commands.Connection.Close), f
    # After a frame error the broker may close the socket right after connection.close
    # (frame boundaries are lost), so close-ok may find the socket already gone.
    with contextlib.suppress(OSError):
        raw.send_method(0, commands.Connection.CloseOk())
    assert raw.wait_closed(), "broker kept the socket open after connection.close"
    return method


@pytest.mark.parametrize(
    "header",
    [
        b"AMQP\x00\x00\x08\x00",  # 0-8
        b"AMQP\x01\x01\x00\x0a",  # 0-10
        b"AMQP\x00\x00\x09\x00",  # 0-9
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01",  # a TLS ClientHello on the plain port
    ],
    ids=["amqp-0-8", "amqp-0-10", "amqp-0-9", "http", "tls"],
)
def test_wrong_protocol_header_gets_ours_and_close(
    broker: BrokerProcess, prefix: str, header: bytes
) -> None:
    with RawClient(broker.addr) as raw:
        raw.send(header)
        assert raw.recv_raw(8) == PROTOCOL_HEADER
        assert raw.wait_closed()
    assert_broker_serves(broker.addr, prefix)


def test_connection_start_announces_0_9_1(broker: BrokerProcess) -> None:
    with RawClient(broker.addr) as raw:
        raw.send(PROTOCOL_HEADER)
        start = raw.read_method()
        assert start is not None and isinstance(start[1], commands.Connection.Start)
        assert (start[1].version_major, start[1].version_minor) == (0, 9)
        assert "PLAIN" in start[1].mechanisms.split()


def test_oversized_frame_is_501(broker: BrokerProcess, prefix: str) -> None:
    with RawClient(broker.addr) as raw:
        assert isinstance(raw.handshake(), commands.Connection.OpenOk)
        raw.open_channel(1)
        # a method frame announcing far more than the negotiated frame_max
        raw.send(struct.pack(">BHI", 1, 1, raw.frame_max * 8) + b"\x00" * 64)
        close = expect_connection_close(raw)
        assert close.reply_code == 501
        assert close.reply_text.startswith("FRAME_ERROR")
    assert_broker_serves(broker.addr, prefix)


def test_frame_max_negotiated_down_is_enforced(broker: BrokerProcess, prefix: str) -> None:
    with RawClient(broker.addr) as raw:
        assert isinstance(raw.handshake(frame_max=4096), commands.Connection.OpenOk)
        raw.open_channel(1)
        raw.send_method(1, commands.Queue.Declare(queue=f"{prefix}.q"))
        assert isinstance(raw.read_method()[1], commands.Queue.DeclareOk)  # type: ignore[index]
        raw.publish(1, "", f"{prefix}.q", b"x" * (4096 - 8))  # exactly one full frame: fine
        raw.send_method(1, commands.Basic.Get(queue=f"{prefix}.q", no_ack=True))
        _ch, get_ok = raw.read_method()  # type: ignore[misc]
        assert isinstance(get_ok, commands.Basic.GetOk)
        _ch, hdr = raw.read_frame()  # type: ignore[misc]
        assert hdr.body_size == 4088
        _ch, body = raw.read_frame()  # type: ignore[misc]
        assert len(body.value) == 4088  # delivered within the negotiated frame_max
        raw.publish(1, "", f"{prefix}.q", b"x" * 20000)  # one 20 kB body frame: too big
        close = expect_connection_close(raw)
        assert close.reply_code == 501
    assert_broker_serves(broker.addr, prefix)


GARBAGE = {
    "zeros": b"\x00" * 32,
    "unknown-frame-type": struct.pack(">BHI", 9, 0, 4) + b"abcd\xce",
    "bad-frame-end": struct.pack(">BHI", 8, 0, 0) + b"\x00",
    "seeded-random": random.Random(20240917).randbytes(64),
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_after_handshake_closes_with_frame_error(
    broker: BrokerProcess, prefix: str, garbage: bytes
) -> None:
    with RawClient(broker.addr) as raw:
        assert isinstance(raw.handshake(), commands.Connection.OpenOk)
        raw.send(garbage)
        close = expect_connection_close(raw)
        assert close.reply_code in (501, 505), close
    assert_broker_serves(broker.addr, prefix)


def body_frame(channel: int, data: bytes) -> bytes:
    return struct.pack(">BHI", 3, channel, len(data)) + data + b"\xce"


# (id, open channel 1 first, frame to send, accepted reply codes)
OUT_OF_ORDER: list[tuple[str, bool, Any, tuple[int, ...]]] = [
    ("content-without-publish", True, lambda: body_frame(1, b"stray"), (505,)),
    (
        "method-on-unopened-channel",
        False,
        lambda: pframe.marshal(commands.Queue.Declare(queue="x"), 5),
        (504,),
    ),
    (
        "heartbeat-on-channel-1",
        True,
        lambda: struct.pack(">BHI", 8, 1, 0) + b"\xce",
        (501, 505),  # the spec says 501; RabbitMQ answers 505
    ),
    (
        "second-channel-open",
        True,
        lambda: pframe.marshal(commands.Channel.Open(), 1),
        (504,),
    ),
    (
        "basic-publish-on-channel-0",
        False,
        lambda: pframe.marshal(commands.Basic.Publish(routing_key="x"), 0),
        (503, 504),  # RabbitMQ answers 504
    ),
]


@pytest.mark.parametrize(
    ("name", "setup", "bad", "codes"), OUT_OF_ORDER, ids=[c[0] for c in OUT_OF_ORDER]
)
def test_out_of_order_frames_close_the_connection(
    broker: BrokerProcess, prefix: str, name: str, setup: bool, bad: Any, codes: tuple[int, ...]
) -> None:
    with RawClient(broker.addr) as raw:
        assert isinstance(raw.handshake(), commands.Connection.OpenOk)
        if setup:
            raw.open_channel(1)
        raw.send(bad())
        close = expect_connection_close(raw)
        assert close.reply_code in codes, close
    assert_broker_serves(broker.addr, prefix)


def test_tune_ok_above_server_limits_is_530(broker: BrokerProcess) -> None:
    with RawClient(broker.addr) as raw:
        raw.send(PROTOCOL_HEADER)
        raw.read_method()
        raw.send_method(
            0,
            commands.Connection.StartOk(
                client_properties={}, mechanism="PLAIN", response="\x00guest\x00guest"
            ),
        )
        _ch, tune = raw.read_method()  # type: ignore[misc]
        raw.send_method(
            0,
            commands.Connection.TuneOk(
                channel_max=tune.channel_max, frame_max=tune.frame_max * 2, heartbeat=0
            ),
        )
        close = expect_connection_close(raw)
        assert close.reply_code == 530
        assert "frame_max" in close.reply_text


def test_broker_heartbeats_and_drops_a_silent_client(broker: BrokerProcess) -> None:
    with RawClient(broker.addr) as raw:
        assert isinstance(raw.handshake(heartbeat=1), commands.Connection.OpenOk)
        t0 = time.monotonic()
        beats = 0
        raw.sock.settimeout(0.2)
        while time.monotonic() - t0 < 1.3:
            try:
                f = raw.read_frame()
            except TimeoutError:
                continue
            assert f is not None, "closed before two heartbeat intervals passed"
            if isinstance(f[1], pheartbeat.Heartbeat):
                beats += 1
        assert beats >= 1, "broker sent no heartbeat within 1.3 s of a 1 s interval"
        # We stay silent: after two missed intervals the broker closes the socket.
        assert raw.wait_closed(timeout=5.0)
        assert time.monotonic() - t0 >= 1.5


def test_heartbeat_zero_disables_heartbeats(broker: BrokerProcess) -> None:
    with RawClient(broker.addr) as raw:
        assert isinstance(raw.handshake(heartbeat=0), commands.Connection.OpenOk)
        raw.sock.settimeout(1.2)
        with pytest.raises(TimeoutError):
            raw.read_frame()
        raw.open_channel(1)  # still open and serving


def test_configured_limits(broker_factory: BrokerFactory, prefix: str) -> None:
    b = broker_factory("[limits]\nframe_max = 8192\nchannel_max = 16\nmax_message_size = 65536\n")
    c = blocking(b.addr)
    try:
        assert c._impl.params.frame_max == 8192
        assert c._impl.params.channel_max == 16
        ch = c.channel()
        q = ch.queue_declare(f"{prefix}.q").method.queue
        ch.confirm_delivery()
        body = bytes(range(256)) * 200  # 51200 bytes: many 8 KiB frames, under the max size
        ch.basic_publish("", q, body)
        assert drain_get(ch, q) == [body]
        with pytest.raises(px.ChannelClosedByBroker) as info:
            ch.basic_publish("", q, b"x" * 65537)
        assert info.value.reply_code == 406
        assert c.is_open
    finally:
        c.close()

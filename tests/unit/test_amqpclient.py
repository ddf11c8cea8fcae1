"""The AMQP client that members use to link clusters (runtime/federation/client.py): its sans-IO
protocol fed bytes (handshake, frames cut across reads, content reassembly, confirms), then
the trio client against a real standalone broker in this process."""

from __future__ import annotations

import functools
import random
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from pamqp import commands
from pamqp import frame as pframe
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

import tlscerts
from cpgbroker.errors import ConfigError
from cpgbroker.runtime.federation.client import AmqpClient
from cpgbroker.runtime.federation.protocol import (
    AmqpClientError,
    AmqpUrl,
    CancelReceived,
    ChannelClosed,
    ChannelCloseReceived,
    ClientProtocol,
    Confirmed,
    ConnectionBlocked,
    ConnectionClosed,
    ConnectionCloseReceived,
    ConnectionOpened,
    ConsumerCancelled,
    Delivery,
    MethodReceived,
    ProtocolError,
    PublishSequence,
)
from cpgbroker.wire.framer import PROTOCOL_HEADER, FrameReader

# ------------------------------------------------------------------------------- sans-IO


def frames(data: bytes) -> list[tuple[int, int, bytes]]:
    reader = FrameReader(1 << 20)
    reader.feed(data)
    out = []
    while (f := reader.next_frame()) is not None:
        out.append(f)
    return out


def methods(data: bytes) -> list[Any]:
    """The methods in ``data`` (decoded by pamqp), ignoring content frames."""
    out = []
    for frame_type, channel, payload in frames(data):
        if frame_type == 1:
            whole = struct.pack(">BHI", frame_type, channel, len(payload)) + payload + b"\xce"
            out.append(pframe.unmarshal(whole)[2])
    return out


def server(method: Any, channel: int = 0) -> bytes:
    return pframe.marshal(method, channel)


def content(channel: int, body: bytes, frame_max: int, **props: Any) -> bytes:
    out = pframe.marshal(ContentHeader(0, len(body), commands.Basic.Properties(**props)), channel)
    step = frame_max - 8
    for i in range(0, len(body), step):
        out += pframe.marshal(ContentBody(body[i : i + step]), channel)
    return out


def opened(frame_max: int = 8192, heartbeat: int = 30) -> ClientProtocol:
    """A protocol through the handshake (the broker proposing these limits)."""
    p = ClientProtocol(username="u", password="p", virtual_host="v", heartbeat=60)
    p.initiate()
    p.data_to_send()
    p.receive_data(server(commands.Connection.Start(server_properties={"product": "x"})))
    p.receive_data(
        server(commands.Connection.Tune(channel_max=10, frame_max=frame_max, heartbeat=heartbeat))
    )
    [ev] = p.receive_data(server(commands.Connection.OpenOk()))
    assert isinstance(ev, ConnectionOpened)
    p.data_to_send()
    return p


def test_handshake_plain_login_and_tuning() -> None:
    p = ClientProtocol(
        username="fed user",
        password="pä:ss",
        virtual_host="up/stream",
        heartbeat=20,
        client_properties={"connection_name": "link"},
    )
    p.initiate()
    assert p.data_to_send() == PROTOCOL_HEADER
    start = commands.Connection.Start(
        server_properties={"product": "cpgbroker", "cluster_name": "east"},
        mechanisms="AMQPLAIN PLAIN",
    )
    assert p.receive_data(server(start)) == []
    [start_ok] = methods(p.data_to_send())
    assert isinstance(start_ok, commands.Connection.StartOk)
    assert start_ok.mechanism == "PLAIN"
    assert start_ok.response == "\0fed user\0pä:ss"
    assert start_ok.client_properties["connection_name"] == "link"
    # The broker's lower limits win; 0 (no limit) on one side takes the other's.
    tune = commands.Connection.Tune(channel_max=0, frame_max=16384, heartbeat=60)
    assert p.receive_data(server(tune)) == []
    tune_ok, open_ = methods(p.data_to_send())
    assert (tune_ok.channel_max, tune_ok.frame_max, tune_ok.heartbeat) == (2047, 16384, 20)
    assert open_.virtual_host == "up/stream"
    [ev] = p.receive_data(server(commands.Connection.OpenOk()))
    assert ev == ConnectionOpened({"product": "cpgbroker", "cluster_name": "east"}, 2047, 16384, 20)
    assert p.server_properties["cluster_name"] == "east"


def test_refused_login_is_a_close_answered_with_close_ok() -> None:
    p = ClientProtocol(username="u", password="bad")
    p.initiate()
    p.receive_data(server(commands.Connection.Start()))
    p.data_to_send()
    close = commands.Connection.Close(403, "ACCESS_REFUSED - Login was refused", 0, 0)
    [ev] = p.receive_data(server(close))
    assert ev == ConnectionCloseReceived(403, "ACCESS_REFUSED - Login was refused", 0, 0)
    assert [type(m) for m in methods(p.data_to_send())] == [commands.Connection.CloseOk]
    assert p.closed and p.receive_data(b"anything") == []


def delivery_bytes(frame_max: int) -> tuple[bytes, list[bytes]]:
    """Three deliveries on channel 1 (bodies of 0 bytes, 3 frames and 1 frame) with a
    heartbeat and a method on channel 2 between them."""
    bodies = [b"", bytes(range(256)) * 40, b"last"]
    data = b""
    for tag, body in enumerate(bodies, 1):
        data += server(
            commands.Basic.Deliver(
                consumer_tag="c1", delivery_tag=tag, exchange="x", routing_key=f"k{tag}"
            ),
            1,
        )
        data += content(1, body, frame_max, message_id=f"m{tag}", headers={"n": tag})
        data += b"\x08\x00\x00\x00\x00\x00\x00\xce"
        data += server(commands.Basic.QosOk(), 2)
    return data, bodies


def test_frames_are_cut_the_same_whatever_the_reads() -> None:
    data, bodies = delivery_bytes(4096)
    expected: list[Any] | None = None
    rng = random.Random(7)
    for cuts in ("whole", "bytes", "random"):
        p = opened(frame_max=4096)
        p.open_channel()
        p.open_channel()
        events: list[Any] = []
        if cuts == "whole":
            events += p.receive_data(data)
        elif cuts == "bytes":
            for i in range(len(data)):
                events += p.receive_data(data[i : i + 1])
        else:
            i = 0
            while i < len(data):
                n = rng.randint(1, 5000)
                events += p.receive_data(bytearray(data[i : i + n]))
                i += n
        got = [
            (e.delivery_tag, e.routing_key, e.properties.message_id, e.properties.headers, e.body)
            if isinstance(e, Delivery)
            else type(e.method)
            for e in events
        ]
        if expected is None:
            expected = got
            assert [g[4] for g in got if isinstance(g, tuple)] == bodies
            assert got[1] is commands.Basic.QosOk
            assert got[0][:4] == (1, "k1", "m1", {"n": 1})
        assert got == expected, cuts


def test_a_frame_over_frame_max_or_garbage_is_a_protocol_error() -> None:
    p = opened(frame_max=4096)
    p.open_channel()
    p.data_to_send()
    big = server(
        commands.Basic.Deliver(consumer_tag="c", delivery_tag=1, routing_key="k"), 1
    ) + pframe.marshal(ContentHeader(0, 5000, commands.Basic.Properties()), 1)
    p.receive_data(big)
    with pytest.raises(ProtocolError) as e:
        p.receive_data(pframe.marshal(ContentBody(b"x" * 5000), 1))
    assert e.value.reply_code == 501
    [close] = methods(p.data_to_send())
    assert isinstance(close, commands.Connection.Close) and close.reply_code == 501
    # Any input either yields events or raises ProtocolError, whole or byte by byte.
    rng = random.Random(1)
    for n in range(300):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        if n % 3 == 0:  # a valid frame header on an open channel, then junk
            junk = struct.pack(">BHI", rng.choice((1, 2, 3)), 1, len(junk)) + junk + b"\xce"
        for whole in (True, False):
            p = opened()
            p.open_channel()
            try:
                if whole:
                    p.receive_data(junk)
                else:
                    for i in range(len(junk)):
                        p.receive_data(junk[i : i + 1])
            except ProtocolError:
                assert p.closed


def test_publish_splits_the_body_at_frame_max() -> None:
    p = opened(frame_max=4096)
    ch = p.open_channel()
    p.data_to_send()
    body = bytes(range(256)) * 40  # 10240 bytes: 4088 + 4088 + 2064
    props = commands.Basic.Properties(delivery_mode=2, message_id="m")
    assert p.send_publish(ch, "x", "rk", body, props, mandatory=True) == 0
    out = frames(p.data_to_send())
    assert [f[0] for f in out] == [1, 2, 3, 3, 3]
    assert [len(f[2]) for f in out[2:]] == [4088, 4088, 2064]
    assert all(len(f[2]) + 8 <= 4096 for f in out)
    [publish] = methods(pframe.marshal(commands.Basic.Publish(), 1))  # sanity of the helper
    assert isinstance(publish, commands.Basic.Publish)
    header = ContentHeader()
    header.unmarshal(out[1][2])
    assert header.body_size == len(body) and header.properties.message_id == "m"
    assert b"".join(f[2] for f in out[2:]) == body
    # An empty body is a header and no body frame.
    p.send_publish(ch, "", "q", b"")
    assert [f[0] for f in frames(p.data_to_send())] == [1, 2]
    # A name pamqp refuses queues nothing.
    with pytest.raises(AmqpClientError):
        p.send_publish(ch, "bad\x00name", "q", b"x")
    assert p.data_to_send() == b""


def test_a_delivery_keeps_its_content_header_and_a_publish_may_send_one_as_it_is() -> None:
    """A federation link forwards and pushes content headers byte for byte (model version 8):
    the protocol keeps a delivery's header payload as it came and sends a given one as it is,
    but for the body size, which is the body's."""
    table = struct.pack(">I", 11) + b"\x01fd" + struct.pack(">d", 1.1)
    header = (
        struct.pack(">HHQH", 60, 0, 3, 0x2000 | 0x1000) + table + b"\x02"  # headers, mode 2
    )
    p = opened(frame_max=4096)
    ch = p.open_channel()
    p.data_to_send()
    deliver = server(commands.Basic.Deliver(consumer_tag="c", delivery_tag=1, routing_key="k"), ch)
    head = struct.pack(">BHI", 2, ch, len(header)) + header + b"\xce"
    [d] = p.receive_data(deliver + head + pframe.marshal(ContentBody(b"abc"), ch))
    assert isinstance(d, Delivery) and d.header == header and d.body == b"abc"
    p.send_publish(ch, "x", "rk", b"hello", header=header)
    out = frames(p.data_to_send())
    assert [f[0] for f in out] == [1, 2, 3]
    assert out[1][2] == header[:4] + struct.pack(">Q", 5) + header[12:]
    assert out[2][2] == b"hello"
    with pytest.raises(AmqpClientError):
        p.send_publish(ch, "x", "rk", b"x", header=b"short")
    assert p.data_to_send() == b""


def test_confirms_single_multiple_and_out_of_order() -> None:
    p = opened()
    ch = p.open_channel()
    p.send_method(ch, commands.Confirm.Select())
    assert [p.send_publish(ch, "", "q", b"x") for _ in range(10)] == list(range(1, 11))

    def confirm(tag: int, multiple: bool, ack: bool = True) -> list[tuple[int, list[int], bool]]:
        cls = commands.Basic.Ack if ack else commands.Basic.Nack
        events = p.receive_data(server(cls(delivery_tag=tag, multiple=multiple), ch))
        assert all(isinstance(e, Confirmed) for e in events)
        return [(e.channel, e.sequences, e.ack) for e in events if isinstance(e, Confirmed)]

    assert confirm(3, False) == [(ch, [3], True)]
    assert p.confirm_window(ch) == (1, 11)
    assert confirm(6, True) == [(ch, [1, 2, 4, 5, 6], True)]
    assert p.confirm_window(ch) == (7, 11)
    assert confirm(8, False, ack=False) == [(ch, [8], False)]
    assert confirm(8, False) == []  # confirmed already
    assert confirm(10, True) == [(ch, [7, 9, 10], True)]
    assert p.confirm_window(ch) == (11, 11)
    seq = PublishSequence()
    for _ in range(5):
        seq.publish()
    assert seq.confirm(2, False) == [2] and seq.confirm(1, False) == [1]
    assert (seq.low, seq.outstanding) == (3, 3)
    assert seq.confirm(9, True) == []  # never published


def test_channel_close_cancel_blocked_and_connection_close() -> None:
    p = opened()
    ch = p.open_channel()
    other = p.open_channel()
    p.data_to_send()
    cancel = commands.Basic.Cancel(consumer_tag="c1", nowait=False)
    assert p.receive_data(server(cancel, ch)) == [CancelReceived(ch, "c1")]
    assert p.data_to_send() == b""  # brokers refuse a cancel-ok from a client
    close = commands.Channel.Close(406, "PRECONDITION_FAILED - inequivalent arg", 50, 10)
    [ev] = p.receive_data(server(close, ch))
    assert ev == ChannelCloseReceived(ch, 406, "PRECONDITION_FAILED - inequivalent arg", 50, 10)
    assert isinstance(methods(p.data_to_send())[0], commands.Channel.CloseOk)
    assert p.open_channel() == ch  # the number is free again
    # Our close crossing the broker's: answered, and the number held until our close-ok.
    p.send_method(other, commands.Channel.Close(200, "", 0, 0))
    deliver = server(
        commands.Basic.Deliver(consumer_tag="c", delivery_tag=1, routing_key="k"), other
    )
    discarded = deliver + content(other, b"dropped", 8192)
    assert p.receive_data(discarded) == []
    [crossed] = p.receive_data(server(commands.Channel.Close(404, "NOT_FOUND", 0, 0), other))
    assert isinstance(crossed, ChannelCloseReceived)
    p.data_to_send()
    [answer] = p.receive_data(server(commands.Channel.CloseOk(), other))
    assert isinstance(answer, MethodReceived)
    blocked = p.receive_data(server(commands.Connection.Blocked(reason="low on memory")))
    assert blocked == [ConnectionBlocked("low on memory")]
    [ev] = p.receive_data(server(commands.Connection.Close(320, "CONNECTION_FORCED", 0, 0)))
    assert isinstance(ev, ConnectionCloseReceived) and ev.reply_code == 320
    assert isinstance(methods(p.data_to_send())[-1], commands.Connection.CloseOk)
    with pytest.raises(AmqpClientError):
        p.open_channel()


def test_urls() -> None:
    u = AmqpUrl.parse("amqps://fed%40east:p%2Fw@broker.example:5000/%2F")
    assert (u.host, u.port, u.username, u.password, u.vhost, u.tls) == (
        "broker.example",
        5000,
        "fed@east",
        "p/w",
        "/",
        True,
    )
    assert "p/w" not in str(u) and "p/w" not in repr(u)
    d = AmqpUrl.parse("amqp://h")
    assert (d.port, d.username, d.password, d.vhost) == (5672, "guest", "guest", "/")
    assert AmqpUrl.parse("amqp://[::1]/team").vhost == "team"
    assert AmqpUrl.parse("amqps://h/").port == 5671
    for bad in ("http://h/", "amqp://h:99999/", "amqp://h/a/b"):
        with pytest.raises(ConfigError):
            AmqpUrl.parse(bad)


# ------------------------------------------------------------------------------- real broker


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@asynccontextmanager
async def standalone(
    tmp_path: Path, extra: str = "", listen: str = 'listen = ["127.0.0.1:0"]'
) -> AsyncIterator[tuple[int, trio.CancelScope]]:
    """A standalone broker in this process: its (first plain) port, and the scope that stops
    it."""
    from cpgbroker.runtime.config import settings
    from cpgbroker.runtime.process import main as runtime_main

    toml = tmp_path / "cpgbroker.toml"
    toml.write_text(f"[server]\n{listen}\n{extra}")
    config = settings.load(str(toml))
    scope = trio.CancelScope()

    async def serve(task_status: trio.TaskStatus[list[tuple[str, int]]]) -> None:
        with scope:
            await runtime_main.serve(config, task_status=task_status)

    async with trio.open_nursery() as nursery:
        bound = await nursery.start(serve)
        yield bound[0][1] if bound else 0, scope
        scope.cancel()


def url(port: int, user: str = "guest", password: str = "guest") -> str:
    return f"amqp://{user}:{password}@127.0.0.1:{port}/"


async def test_publish_with_confirms_then_consume_with_acks(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with standalone(tmp_path) as (port, _):
            client = await AmqpClient.connect(url(port), connection_name="test link")
            async with client:
                assert client.server_properties["product"]
                assert client.frame_max == 131072 and client.heartbeat == 60
                ch = await client.channel()
                await ch.exchange_declare("fed.x", "direct")
                assert await ch.queue_declare("fed.q") == ("fed.q", 0, 0)
                await ch.queue_bind("fed.q", "fed.x", "k")
                await ch.confirm_select()
                bodies = [b"%06d" % i + bytes(1018) for i in range(1000)]
                handles = [await ch.publish("fed.x", "k", b) for b in bodies]
                assert await ch.wait_for_confirms() is True
                assert all(h is not None and h.done and h.acked for h in handles)
                # A body larger than frame_max goes out in several frames and comes back whole.
                large = bytes(range(256)) * 1200
                h = await ch.publish("fed.x", "k", large, commands.Basic.Properties(priority=3))
                assert h is not None and await h.wait() is True
                # A mandatory publish no queue takes comes back (counted) and is still acked.
                h = await ch.publish("fed.x", "nowhere", b"x", mandatory=True)
                assert h is not None and await h.wait() is True
                assert ch.returned == 1
                assert (await ch.queue_declare("fed.q", passive=True))[1] == 1001

                rx = await client.channel()
                await rx.basic_qos(50)
                consumer = await rx.consume("fed.q")
                got = []
                async for d in consumer:
                    got.append(d.body)
                    if d.delivery_tag % 10 == 0 or len(got) == 1001:
                        await rx.ack(d.delivery_tag, multiple=True)
                    if len(got) == 1001:
                        assert d.properties.priority == 3 and not d.redelivered
                        break
                assert got == [*bodies, large]
                await rx.cancel(consumer.consumer_tag)
                with pytest.raises(StopAsyncIteration):
                    await consumer.__anext__()
                assert (await ch.queue_declare("fed.q", passive=True))[1:] == (0, 0)
                await rx.close()
                assert not rx.is_open
                assert await ch.queue_delete("fed.q") == 0
            assert not client.is_open
            assert (await client.wait_closed()).reply_code == 200


async def test_a_channel_error_closes_the_channel_not_the_connection(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with (
            standalone(tmp_path) as (port, _),
            await AmqpClient.connect(url(port)) as client,
        ):
            ch = await client.channel()
            await ch.queue_declare("q406")
            with pytest.raises(ChannelClosed) as e:
                await ch.queue_declare("q406", arguments={"x-max-length": 5})
            assert e.value.reply_code == 406 and "inequivalent arg" in e.value.reply_text
            assert not ch.is_open
            with pytest.raises(ChannelClosed):
                await ch.publish("", "q406", b"x")
            again = await client.channel()
            assert again.number == ch.number
            assert await again.queue_declare("q406", passive=True) == ("q406", 0, 0)
            with pytest.raises(ChannelClosed) as e:
                await again.queue_declare("missing", passive=True)
            assert e.value.reply_code == 404


async def test_refused_logins_and_unreachable_urls(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with standalone(tmp_path) as (port, _):
            with pytest.raises(ConnectionClosed) as e:
                await AmqpClient.connect(url(port, password="wrong"))
            assert e.value.reply_code == 403
            with pytest.raises(ConnectionClosed) as e:
                await AmqpClient.connect(f"amqp://guest:guest@127.0.0.1:{port}/nope")
            assert e.value.reply_code == 530
            # Fail over: a dead member first, then one that answers.
            dead = _free_port()
            client = await AmqpClient.connect([url(dead), url(port)], timeout=5)
            async with client:
                assert client.url.port == port
            with pytest.raises(ConnectionClosed) as e:
                await AmqpClient.connect([url(dead), url(dead)], timeout=5)
            assert e.value.reply_code == 0 and "no broker reachable" in str(e.value)


async def test_the_broker_going_away_ends_consumers_with_connection_closed(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with standalone(tmp_path) as (port, broker):
            client = await AmqpClient.connect(url(port))
            with pytest.raises(ConnectionClosed):
                async with client:
                    ch = await client.channel()
                    await ch.queue_declare("gone.q", durable=False)
                    await ch.confirm_select()
                    consumer = await ch.consume("gone.q")
                    h = await ch.publish("", "gone.q", b"first")
                    assert (await consumer.receive()).body == b"first"
                    assert h is not None and await h.wait()
                    broker.cancel()
                    with trio.fail_after(5):
                        await consumer.receive()
            assert not client.is_open
            with pytest.raises(ConnectionClosed):
                await ch.publish("", "gone.q", b"late")


@pytest.mark.slow
async def test_heartbeats_keep_an_idle_connection_open(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with (
            standalone(tmp_path) as (port, _),
            await AmqpClient.connect(url(port), heartbeat=1) as client,
        ):
            assert client.heartbeat == 1
            await trio.sleep(4)
            assert client.is_open
            ch = await client.channel()
            await ch.queue_declare("", exclusive=True, durable=False)


async def test_server_cancel_and_blocked_publishers(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with (
            standalone(tmp_path, "[limits]\nhigh_watermark_bytes = 100000\n") as (port, _),
            await AmqpClient.connect(url(port)) as pub,
            await AmqpClient.connect(url(port)) as drain,
        ):
            # Deleting the queue under a consumer cancels it (basic.cancel from the broker).
            ch = await pub.channel()
            await ch.queue_declare("doomed", durable=False)
            consumer = await (await drain.channel()).consume("doomed")
            await ch.queue_delete("doomed")
            with pytest.raises(ConsumerCancelled) as cancelled:
                await consumer.receive()
            assert cancelled.value.consumer_tag == consumer.consumer_tag
            # Over the memory mark the broker blocks publishers: publish waits.
            await ch.queue_declare("big", durable=False)
            for _ in range(3):
                await ch.publish("", "big", b"x" * 40000)
            while not pub.blocked:
                await trio.sleep(0.01)
            assert pub.blocked_reason == "low on memory"
            published = trio.Event()

            async def publish_after() -> None:
                await ch.publish("", "big", b"after")
                published.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish_after)
                await trio.sleep(0.3)
                assert not published.is_set()
                rx = await drain.channel()
                got = await rx.consume("big")
                for _ in range(3):
                    await rx.ack((await got.receive()).delivery_tag)
                await published.wait()
            assert not pub.blocked
            assert (await got.receive()).body == b"after"


@pytest.mark.slow
async def test_a_silent_broker_is_declared_dead_after_two_intervals() -> None:
    received = bytearray()

    async def silent(stream: trio.SocketStream) -> None:
        # The handshake in one write, heartbeat 1 s; then it reads and never says a word.
        await stream.receive_some(8)
        await stream.send_all(
            server(commands.Connection.Start(server_properties={}))
            + server(commands.Connection.Tune(channel_max=0, frame_max=131072, heartbeat=1))
            + server(commands.Connection.OpenOk())
        )
        while data := await stream.receive_some(4096):
            received.extend(data)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(
                functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1")
            )
            port = listener.socket.getsockname()[1]
            client = await AmqpClient.connect(url(port), heartbeat=5)
            async with client:
                assert client.heartbeat == 1
                start = trio.current_time()
                reason = await client.wait_closed()
                elapsed = trio.current_time() - start
            assert reason.reply_code == 0 and "missed heartbeats" in reason.reply_text
            assert 1.9 < elapsed < 3.5, elapsed
            # Meanwhile we sent a heartbeat every half interval.
            assert received.count(b"\x08\x00\x00\x00\x00\x00\x00\xce") >= 3
            nursery.cancel_scope.cancel()


async def test_amqps(tmp_path: Path) -> None:
    certs = tlscerts.make(tmp_path / "certs")
    tls = f'[tls]\ncertfile = "{certs.server.cert}"\nkeyfile = "{certs.server.key}"\n'
    # The amqps listeners' ports are not reported: pick one.
    port = _free_port()
    listen = f'listen = []\nlisten_tls = ["127.0.0.1:{port}"]'
    with trio.fail_after(30):
        async with standalone(tmp_path, tls, listen):
            secure = f"amqps://guest:guest@127.0.0.1:{port}/"
            context = certs.client_context()
            async with await AmqpClient.connect(secure, ssl_context=context) as client:
                ch = await client.channel()
                await ch.queue_declare("tls.q", durable=False)
                await ch.confirm_select()
                body = bytes(range(256)) * 1000  # several frames, several TLS records
                h = await ch.publish("", "tls.q", body)
                assert h is not None and await h.wait()
                consumer = await ch.consume("tls.q", no_ack=True)
                assert (await consumer.receive()).body == body
            # Our CA is not the system's: the default context refuses the certificate.
            with pytest.raises(ConnectionClosed) as e:
                await AmqpClient.connect(secure)
            assert e.value.reply_code == 0 and "CERTIFICATE_VERIFY_FAILED" in str(e.value)


async def test_a_no_ack_consumer_that_falls_behind_stops_the_reading_not_the_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cpgbroker.runtime.federation import client

    monkeypatch.setattr(client, "NO_ACK_HIGH_WATER", 1 << 20)
    monkeypatch.setattr(client, "NO_ACK_LOW_WATER", 256 << 10)
    bodies = [b"%04d" % i + bytes(20 * 1024) for i in range(200)]  # 4 MiB
    with trio.fail_after(60):
        async with (
            standalone(tmp_path) as (port, _),
            await AmqpClient.connect(url(port)) as pub,
            await AmqpClient.connect(url(port), heartbeat=1) as slow,
        ):
            ch = await pub.channel()
            await ch.queue_declare("slow.q")
            await ch.confirm_select()
            for b in bodies:
                await ch.publish("", "slow.q", b)
            assert await ch.wait_for_confirms()
            rx = await slow.channel()
            consumer = await rx.consume("slow.q", no_ack=True)
            # It takes nothing for three heartbeat intervals: the client holds about the high
            # mark (plus what one read brings), the broker keeps the rest, and the connection
            # is not declared dead for the heartbeats it did not read meanwhile.
            await trio.sleep(3)
            held = slow._reads.bytes
            assert (1 << 20) <= held <= (1 << 20) + 2 * client.RECV_SIZE, held
            assert slow.is_open and slow._reads.paused
            # What waits for the broker never waits behind the consumer: a method on another
            # channel is answered (the reader reads on meanwhile, the consumer still holds
            # what it got) ...
            other = await slow.channel()
            with trio.fail_after(5):
                assert (await other.queue_declare("slow.q", passive=True))[0] == "slow.q"
            got = [(await consumer.receive()).body for _ in range(10)]
            # ... and so is a cancel: the deliveries sent before cancel-ok still come, in order.
            with trio.fail_after(5):
                await rx.cancel(consumer.consumer_tag)
            got += [d.body async for d in consumer]
            assert got == bodies[: len(got)] and len(got) > 10
            # The rest is back in the queue (no-ack deliveries are not requeued: they were
            # sent, and are in ``got``), and the connection reads on.
            assert not slow._reads.paused and slow._reads.bytes == 0
            left = (await other.queue_declare("slow.q", passive=True))[1]
            assert left == len(bodies) - len(got)
            with trio.fail_after(5):
                await slow.close()

"""Behaviour real clients rely on where RabbitMQ and a literal reading of the spec differ (each
checked against RabbitMQ 3.10.8): frame_max tolerance, delete-ok before cancel, the default
exchange, exclusivity, channel_max as a count, update-secret, x-death layout, empty queue names."""

from __future__ import annotations

import asyncio
import struct

import aiormq
import pika
import pika.exceptions as px
import pytest
from clientutil import BrokerProcess, RawClient, blocking
from pamqp import commands, frame, header


def test_body_frame_of_exactly_frame_max_payload_is_tolerated(
    broker: BrokerProcess, prefix: str
) -> None:
    # rabbitpy and amqpstorm cut bodies at frame_max instead of frame_max - 8; RabbitMQ
    # tolerates that 8-byte overshoot (FRAME_SIZE_FUDGE).
    with RawClient(broker.addr) as raw:
        raw.handshake()
        raw.open_channel(1)
        q = f"{prefix}.q"
        raw.send_method(1, commands.Queue.Declare(queue=q))
        assert isinstance(raw.read_method()[1], commands.Queue.DeclareOk)
        body = b"x" * raw.frame_max
        raw.send_method(1, commands.Basic.Publish(exchange="", routing_key=q))
        raw.send(frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), 1))
        raw.send(struct.pack(">BHI", 3, 1, len(body)) + body + b"\xce")
        raw.send_method(1, commands.Queue.Delete(queue=q))
        _ch, m = raw.read_method()
        assert isinstance(m, commands.Queue.DeleteOk) and m.message_count == 1


def test_queue_delete_ok_comes_before_consumer_cancel(broker: BrokerProcess, prefix: str) -> None:
    with RawClient(broker.addr) as raw:
        raw.handshake(capabilities={"consumer_cancel_notify": True})
        raw.open_channel(1)
        q = f"{prefix}.q"
        raw.send_method(1, commands.Queue.Declare(queue=q))
        raw.read_method()
        raw.send_method(1, commands.Basic.Consume(queue=q, consumer_tag="t1"))
        raw.read_method()
        raw.send_method(1, commands.Queue.Delete(queue=q))
        first, second = raw.read_method()[1], raw.read_method()[1]
        assert isinstance(first, commands.Queue.DeleteOk)
        assert isinstance(second, commands.Basic.Cancel) and second.consumer_tag == "t1"


def test_passive_declare_of_default_exchange_is_403(broker: BrokerProcess) -> None:
    c = blocking(broker.addr)
    try:
        with pytest.raises(px.ChannelClosedByBroker) as info:
            c.channel().exchange_declare("", passive=True)
        assert info.value.reply_code == 403
    finally:
        c.close()


def test_exclusive_flag_mismatch_on_redeclare_is_405(broker: BrokerProcess, prefix: str) -> None:
    c = blocking(broker.addr)
    try:
        q = c.channel().queue_declare(f"{prefix}.x", exclusive=True).method.queue
        with pytest.raises(px.ChannelClosedByBroker) as info:
            c.channel().queue_declare(q, exclusive=False)
        assert info.value.reply_code == 405
        c.channel().queue_declare(f"{prefix}.shared")
        with pytest.raises(px.ChannelClosedByBroker) as info:
            c.channel().queue_declare(f"{prefix}.shared", exclusive=True)
        assert info.value.reply_code == 405
    finally:
        c.close()


def test_high_channel_numbers_open(broker: BrokerProcess) -> None:
    with RawClient(broker.addr) as raw:
        raw.handshake()
        raw.open_channel(65535)


def test_empty_queue_name_means_last_declared(broker: BrokerProcess) -> None:
    c = blocking(broker.addr)
    try:
        ch = c.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind("", "amq.fanout")
        ch.confirm_delivery()
        ch.basic_publish("amq.fanout", "", b"x")
        method, _p, body = ch.basic_get("", auto_ack=True)
        assert body == b"x" and method.routing_key == ""
        ch.queue_unbind("", "amq.fanout")
        assert ch.queue_purge("").method.message_count == 0
        assert ch.queue_delete("").method.message_count == 0
        with pytest.raises(px.ChannelClosedByBroker):
            c.channel().queue_declare(q, passive=True)
    finally:
        c.close()


def test_dead_letter_original_expiration_is_in_x_death(broker: BrokerProcess, prefix: str) -> None:
    c = blocking(broker.addr)
    try:
        ch = c.channel()
        ch.confirm_delivery()
        dlq = ch.queue_declare(f"{prefix}.dlq").method.queue
        src = ch.queue_declare(
            f"{prefix}.src",
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq},
        ).method.queue
        ch.basic_publish("", src, b"m", pika.BasicProperties(expiration="60000"))
        method, _p, _b = ch.basic_get(src)
        ch.basic_reject(method.delivery_tag, requeue=False)
        for _ in range(100):
            _m, props, body = ch.basic_get(dlq, auto_ack=True)
            if body is not None:
                break
            c.sleep(0.02)
        [death] = props.headers["x-death"]
        assert death["original-expiration"] == "60000"
        assert "original-expiration" not in props.headers
    finally:
        c.close()


def test_update_secret(broker: BrokerProcess) -> None:
    async def main() -> None:
        conn = await aiormq.connect(broker.url)
        try:
            ok = await conn.update_secret("guest", timeout=5)
            assert isinstance(ok, aiormq.spec.Connection.UpdateSecretOk)
        finally:
            await conn.close()

    asyncio.run(main())

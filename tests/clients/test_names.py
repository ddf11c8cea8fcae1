"""Queue and exchange names as RabbitMQ takes them, through pika against the standalone broker:
'=' and other punctuation, non-ASCII UTF-8, 255 bytes (pamqp's own pattern would refuse every
one of these; the broker does not apply it), and RabbitMQ's 404 for a passive declare of a
missing one."""

from __future__ import annotations

import pika.exceptions as px
import pytest
from clientutil import BrokerProcess, blocking, drain_get, wait_until

SUFFIXES = [
    "a=b",
    "k=v;x=y&z|w",
    "ünïcödé-名前",
    "punct !\"#$%&'()*+,-/:;<>?@[\\]^_`{|}~",
]


def _name(prefix: str, suffix: str) -> str:
    return f"{prefix}.{suffix}"


def _255_bytes(prefix: str) -> str:
    # Mixed widths: two-byte characters take it past pamqp's 127 characters as well.
    stem = f"{prefix}.é="
    pad = 255 - len(stem.encode())
    name = stem + "é" * (pad // 2) + "x" * (pad % 2)
    assert len(name.encode()) == 255
    return name


@pytest.mark.parametrize("suffix", [*SUFFIXES, "255"])
def test_declare_bind_publish_consume_through_odd_names(
    broker: BrokerProcess, prefix: str, suffix: str
) -> None:
    name = _255_bytes(prefix) if suffix == "255" else _name(prefix, suffix)
    c = blocking(broker.addr)
    try:
        ch = c.channel()
        ok = ch.queue_declare(queue=name)
        assert ok.method.queue == name
        ch.exchange_declare(exchange=name, exchange_type="topic")
        ch.queue_bind(queue=name, exchange=name, routing_key="k.=.#")
        ch.confirm_delivery()
        ch.basic_publish(exchange=name, routing_key="k.=.é", body=b"via-exchange")
        ch.basic_publish(exchange="", routing_key=name, body=b"via-default")
        got: list[tuple[str, str, bytes]] = []

        def on_message(chan: object, method: object, props: object, body: bytes) -> None:
            got.append((method.exchange, method.routing_key, body))  # type: ignore[attr-defined]

        tag = ch.basic_consume(queue=name, on_message_callback=on_message, auto_ack=True)
        assert wait_until(lambda: len(got) >= 2, pump=c.sleep), got
        assert got == [(name, "k.=.é", b"via-exchange"), ("", name, b"via-default")]
        ch.basic_cancel(tag)
        assert ch.queue_declare(queue=name, passive=True).method.queue == name
        ch.queue_unbind(queue=name, exchange=name, routing_key="k.=.#")
        ch.basic_publish(exchange="", routing_key=name, body=b"left")
        assert ch.queue_purge(queue=name).method.message_count == 1
        ch.exchange_delete(exchange=name)
        ch.queue_delete(queue=name)
        with pytest.raises(px.ChannelClosedByBroker) as info:
            ch.queue_declare(queue=name, passive=True)
        assert info.value.reply_code == 404
    finally:
        c.close()


def test_exchange_to_exchange_and_get_with_odd_names(broker: BrokerProcess, prefix: str) -> None:
    src, dest, q = (_name(prefix, s) for s in ("src=ü", "dest=ö", "q=ä"))
    c = blocking(broker.addr)
    try:
        ch = c.channel()
        ch.exchange_declare(exchange=src, exchange_type="fanout", auto_delete=True)
        ch.exchange_declare(exchange=dest, exchange_type="fanout", auto_delete=True)
        ch.exchange_bind(destination=dest, source=src)
        ch.queue_declare(queue=q, exclusive=True)
        ch.queue_bind(queue=q, exchange=dest)
        ch.confirm_delivery()
        ch.basic_publish(exchange=src, routing_key="", body=b"e2e")
        assert drain_get(ch, q) == [b"e2e"]
        ch.exchange_unbind(destination=dest, source=src)
    finally:
        c.close()


def test_passive_declare_of_a_missing_queue_with_an_odd_name_is_404(
    broker: BrokerProcess, prefix: str
) -> None:
    name = _name(prefix, "a=b")
    c = blocking(broker.addr)
    try:
        with pytest.raises(px.ChannelClosedByBroker) as info:
            c.channel().queue_declare(queue=name, passive=True)
        assert info.value.reply_code == 404
        assert info.value.reply_text == f"NOT_FOUND - no queue '{name}' in vhost '/'"
        with pytest.raises(px.ChannelClosedByBroker) as info:
            c.channel().exchange_declare(exchange=name, passive=True)
        assert info.value.reply_code == 404
        assert info.value.reply_text == f"NOT_FOUND - no exchange '{name}' in vhost '/'"
        assert c.is_open
    finally:
        c.close()


def test_reserved_prefix_with_an_odd_name_is_still_403(broker: BrokerProcess) -> None:
    c = blocking(broker.addr)
    try:
        with pytest.raises(px.ChannelClosedByBroker) as info:
            c.channel().exchange_declare(exchange="amq.x=é", exchange_type="direct")
        assert info.value.reply_code == 403
        with pytest.raises(px.ChannelClosedByBroker) as info:
            c.channel().queue_declare(queue="amq.q=é")
        assert info.value.reply_code == 403
    finally:
        c.close()

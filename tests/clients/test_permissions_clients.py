"""Per-vhost permissions with a real client: a user limited to ``^app\\.`` gets RabbitMQ's 403
texts as channel closes and keeps its connection."""

from __future__ import annotations

import pika
import pika.exceptions as px
import pytest
from clientutil import BrokerFactory

CONFIG = r"""
vhosts = ["/", "other"]

[[users]]
name = "app"
password = "app"
[[users.permissions]]
vhost = "/"
configure = "^app\\."
write = "^app\\."
read = "^app\\."

[[users]]
name = "guest"
password = "guest"
vhosts = ["/"]
"""


def _connect(port: int, vhost: str = "/") -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1",
            port,
            virtual_host=vhost,
            credentials=pika.PlainCredentials("app", "app"),
            socket_timeout=5,
            connection_attempts=1,
        )
    )


def _refused(perm: str, kind: str, name: str) -> str:
    return f"ACCESS_REFUSED - {perm} access to {kind} '{name}' in vhost '/' refused for user 'app'"


def test_a_user_limited_to_app_names_gets_403_elsewhere_and_keeps_its_connection(
    broker_factory: BrokerFactory,
) -> None:
    b = broker_factory(CONFIG)
    conn = _connect(b.port)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("app.q")
        ch.exchange_declare("app.x", exchange_type="fanout")
        ch.queue_bind("app.q", "app.x")
        ch.basic_publish("app.x", "", b"hello")
        with pytest.raises(px.ChannelClosedByBroker) as info:
            conn.channel().queue_declare("other.q")
        assert info.value.reply_code == 403
        assert info.value.reply_text == _refused("configure", "queue", "other.q")
        # The default exchange is amq.default, which ^app\. does not match.
        ch2 = conn.channel()
        ch2.confirm_delivery()
        with pytest.raises(px.ChannelClosedByBroker) as info:
            ch2.basic_publish("", "app.q", b"denied")
        assert info.value.reply_code == 403
        assert info.value.reply_text == _refused("write", "exchange", "amq.default")
        assert conn.is_open and ch.is_open
        ch3 = conn.channel()
        method, _props, body = ch3.basic_get("app.q", auto_ack=True)
        assert method is not None and body == b"hello"
        assert ch3.queue_declare("app.q", passive=True).method.message_count == 0
    finally:
        conn.close()


def test_a_vhost_without_permissions_is_refused_at_open(broker_factory: BrokerFactory) -> None:
    b = broker_factory(CONFIG)
    with pytest.raises(px.ProbableAccessDeniedError) as info:
        _connect(b.port, "other")
    assert "access to vhost 'other' refused for user 'app'" in str(info.value)

"""Resource limits (``model/limits.py``): RabbitMQ's reply codes and texts, decided by the
model so that every replica refuses at the same event."""

from __future__ import annotations

import pytest
from pamqp import commands as C
from pamqp import frame

from cpgbroker.model import snapshot as S
from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig, User
from cpgbroker.model.events import ClientData, ClientDisconnected
from modelclient import Client, Harness


def _open(h: Harness, conn: int = 1, user: str = "guest") -> Client:
    c = h.connect(conn)
    c.handshake(user=user, password=user)
    c.channel(1)
    return c


def _close_of(c: Client) -> tuple[int, str]:
    ms = c.methods()
    close = [m for m in ms if isinstance(m, C.Channel.Close | C.Connection.Close)]
    assert close, ms
    return close[-1].reply_code, close[-1].reply_text


def test_queue_limit_in_vhost() -> None:
    h = Harness(Broker(BrokerConfig(vhost_max_queues=2)))
    c = _open(h)
    c.rpc(1, C.Queue.Declare(queue="a"))
    c.rpc(1, C.Queue.Declare(queue="b"))
    c.rpc(1, C.Queue.Declare(queue="a"))  # redeclaring an existing queue is fine
    c.send(1, C.Queue.Declare(queue="x"))
    assert _close_of(c) == (
        406,
        "PRECONDITION_FAILED - cannot declare queue 'x': queue limit in vhost '/' (2) is reached",
    )
    assert list(h.broker.topology.vhosts["/"].queues) == ["a", "b"]


def test_exchange_limit_counts_only_declared_exchanges() -> None:
    h = Harness(Broker(BrokerConfig(vhost_max_exchanges=1)))
    c = _open(h)
    c.rpc(1, C.Exchange.Declare(exchange="e1"))
    c.rpc(1, C.Exchange.Declare(exchange="e1"))
    c.send(1, C.Exchange.Declare(exchange="e2"))
    assert _close_of(c) == (
        406,
        "PRECONDITION_FAILED - cannot declare exchange 'e2': exchange limit in vhost '/' (1) "
        "is reached",
    )


def test_binding_limit_counts_queue_and_exchange_bindings() -> None:
    h = Harness(Broker(BrokerConfig(vhost_max_bindings=2)))
    c = _open(h)
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.rpc(1, C.Exchange.Declare(exchange="e"))
    c.rpc(1, C.Queue.Bind(queue="q", exchange="amq.direct", routing_key="k"))
    c.rpc(1, C.Exchange.Bind(destination="e", source="amq.fanout"))
    c.rpc(1, C.Queue.Bind(queue="q", exchange="amq.direct", routing_key="k"))  # idempotent
    c.send(1, C.Queue.Bind(queue="q", exchange="amq.direct", routing_key="k2"))
    assert _close_of(c) == (
        406,
        "PRECONDITION_FAILED - cannot bind to exchange 'amq.direct': binding limit in vhost "
        "'/' (2) is reached",
    )
    # Unbinding frees room.
    c.channel(2)
    c.rpc(2, C.Queue.Unbind(queue="q", exchange="amq.direct", routing_key="k"))
    c.rpc(2, C.Queue.Bind(queue="q", exchange="amq.direct", routing_key="k2"))
    assert h.broker.topology.vhosts["/"].binding_count == 2


def test_vhost_connection_limit() -> None:
    h = Harness(Broker(BrokerConfig(vhost_max_connections=1)))
    _open(h, 1)
    c2 = h.connect(2)
    reply = c2.handshake()
    assert isinstance(reply, C.Connection.Close)
    assert (reply.reply_code, reply.reply_text) == (
        530,
        "NOT_ALLOWED - access to vhost '/' refused for user 'guest': connection limit (1) "
        "is reached",
    )
    # Once the first goes, there is room again.
    h.apply(ClientDisconnected(1))
    c4 = h.connect(4)
    assert isinstance(c4.handshake(), C.Connection.OpenOk)


def test_user_connection_limit() -> None:
    users = (User("u", "u", max_connections=1), User("v", "v"))
    h = Harness(Broker(BrokerConfig(users=users)))
    _open(h, 1, "u")
    _open(h, 2, "v")
    c3 = h.connect(3)
    reply = c3.handshake(user="u", password="u")
    assert isinstance(reply, C.Connection.Close)
    assert (reply.reply_code, reply.reply_text) == (
        530,
        "NOT_ALLOWED - connection refused for user 'u': user connection limit (1) is reached",
    )


def test_user_channel_limit_across_connections() -> None:
    users = (User("u", "u", max_channels=2),)
    h = Harness(Broker(BrokerConfig(users=users)))
    c1 = _open(h, 1, "u")
    c2 = _open(h, 2, "u")
    c2.send(2, C.Channel.Open())
    code, text = _close_of(c2)
    assert (code, text) == (
        530,
        "NOT_ALLOWED - number of channels opened for user 'u' has reached the maximum allowed "
        "user limit of (2)",
    )
    assert not c1.is_closed


def test_channel_max_negotiation_still_applies() -> None:
    h = Harness(Broker(BrokerConfig(channel_max=1)))
    c = _open(h)
    c.send(2, C.Channel.Open())
    assert _close_of(c)[0] == 530


@pytest.mark.parametrize("limit", [None, 0])
def test_none_is_unlimited_and_zero_refuses_all(limit: int | None) -> None:
    h = Harness(Broker(BrokerConfig(vhost_max_queues=limit)))
    c = _open(h)
    c.send(1, C.Queue.Declare(queue="q"))
    ms = c.methods()
    assert any(isinstance(m, C.Queue.DeclareOk) for m in ms) == (limit is None)


def test_limits_hold_on_a_restored_replica() -> None:
    """A replica restored from a snapshot refuses at the same event as the original."""
    cfg = BrokerConfig(vhost_max_queues=2, vhost_max_bindings=1)
    h = Harness(Broker(cfg))
    c = _open(h)
    c.rpc(1, C.Queue.Declare(queue="a"))
    c.rpc(1, C.Queue.Bind(queue="a", exchange="amq.direct", routing_key="k"))
    restored = S.restore(S.snapshot(h.broker), cfg)
    assert restored.topology.vhosts["/"].binding_count == 1
    assert restored.topology.limits == h.broker.topology.limits
    # The same next command on both (the restored one is a shadow: no output): refused on both.
    data = bytes(frame.marshal(C.Queue.Bind(queue="a", exchange="amq.direct", routing_key="z"), 1))
    h.broker.apply(ClientData(1, data))
    restored.apply(ClientData(1, data))
    assert h.broker.connections[1].channels[1].closing
    assert restored.connections[1].channels[1].closing
    assert S.digest(h.broker) == S.digest(restored)


def test_limits_from_the_config_file() -> None:
    from pathlib import Path

    from cpgbroker.errors import ConfigError
    from cpgbroker.runtime.settings import from_dict, load

    shipped = load(str(Path(__file__).resolve().parents[2] / "configs" / "cpgbroker.toml"))
    assert shipped.broker.vhost_max_queues == BrokerConfig().vhost_max_queues
    cfg = from_dict(
        {
            "limits": {"vhost_max_queues": -1, "vhost_max_bindings": 7},
            "users": [{"name": "u", "password": "p", "max_channels": 3}],
        }
    ).broker
    assert cfg.vhost_max_queues is None and cfg.vhost_max_bindings == 7
    assert cfg.vhost_max_exchanges == BrokerConfig().vhost_max_exchanges
    assert cfg.users[0].max_channels == 3 and cfg.users[0].max_connections is None
    with pytest.raises(ConfigError):
        from_dict({"limits": {"vhost_max_queues": -5}})
    with pytest.raises(ConfigError):
        from_dict({"limits": {"vhost_max_queue": 5}})

"""Resource limits (``model/resources/limits.py``): RabbitMQ's reply codes and texts, decided by the
model so that every replica refuses at the same event."""

from __future__ import annotations

import collections
import random
import sys
from types import FrameType
from typing import Any

import attrs
import pytest
from pamqp import commands as C
from pamqp import frame

from cpgbroker.model import entities as E
from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig, User
from cpgbroker.model.events import ClientConnected, ClientData, ClientDisconnected, MemberLeft
from cpgbroker.model.resources import limits as L
from cpgbroker.model.state import snapshot as S
from cpgbroker.wire.framer import PROTOCOL_HEADER
from modelclient import Client, Harness


def vars_of(obj: Any) -> list[Any]:
    return [getattr(obj, f.name) for f in attrs.fields(type(obj))]


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
    from cpgbroker.runtime.config.settings import from_dict, load

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


# ---------------------------------------------------------------------- the O(1) counters


def _recount(b: Broker) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """What the counters must hold, by scanning every connection (as the checks once did)."""
    vhosts: collections.Counter[str] = collections.Counter()
    users: collections.Counter[str] = collections.Counter()
    channels: collections.Counter[str] = collections.Counter()
    for c in b.connections.values():
        if c.vhost:  # past connection.open (closing ones included)
            vhosts[c.vhost] += 1
            users[c.user] += 1
        channels[c.user] += len(c.channels)
    return (
        {k: v for k, v in vhosts.items() if v},
        {k: v for k, v in users.items() if v},
        {k: v for k, v in channels.items() if v},
    )


def _assert_counts(b: Broker) -> None:
    lim = b.topology.limits
    assert (lim.vhost_connections, lim.user_connections, lim.user_channels) == _recount(b)


_USERS = (
    User("u", "u", ("/", "b"), max_connections=4, max_channels=5),
    User("v", "v", ("/", "b")),
    User("w", "w", ("b",), max_channels=3),
)


@pytest.mark.parametrize("seed", range(6))
def test_counters_equal_a_recount_after_random_traffic_and_restore(seed: int) -> None:
    rng = random.Random(seed)
    cfg = BrokerConfig(users=_USERS, vhosts=("/", "b"), vhost_max_connections=6)
    h = Harness(Broker(cfg))
    clients: dict[int, Client] = {}
    next_id = 1
    now = 0
    seen: collections.Counter[str] = collections.Counter(channels=0, **{"vhost b": 0}, closing=0)
    for step in range(400):
        live = [c for c in clients.values() if c.conn in h.broker.connections]
        op = rng.random()
        if op < 0.2 or not live:
            c = h.connect(next_id, member=rng.randrange(3))
            clients[next_id] = c
            next_id += 1
            if rng.random() < 0.85:  # else left half way: not counted
                user = rng.choice(("u", "v", "w"))
                c.handshake(user=user, password=user, vhost=rng.choice(("/", "b")))
        else:
            c = rng.choice(live)
            ch = rng.randrange(1, 5)
            if op < 0.45:
                c.send(ch, C.Channel.Open())  # may be refused, or a second open (504)
            elif op < 0.6:
                c.send(
                    ch, C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)
                )
            elif op < 0.68:  # a channel error: the channel stays until close-ok
                c.send(ch, C.Queue.Declare(queue="nope", passive=True))
            elif op < 0.74:
                c.send(ch, C.Channel.CloseOk())
            elif op < 0.79:
                c.send(
                    0, C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)
                )
            elif op < 0.84:  # a connection error: closing, still counted until dropped
                c.send(0, C.Channel.Open())
            elif op < 0.88:
                c.send(0, C.Connection.CloseOk())
            elif op < 0.93:
                h.apply(ClientDisconnected(c.conn))
            elif op < 0.96:
                h.apply(MemberLeft(rng.randrange(3)))
            else:
                now += rng.choice((1_000, 5_000, 20_000))
                h.tick(now)
        _assert_counts(h.broker)
        lim = h.broker.topology.limits
        seen["channels"] += sum(lim.user_channels.values())
        seen["vhost b"] += lim.vhost_connections.get("b", 0)
        seen["closing"] += sum(
            1 for c in h.broker.connections.values() if c.vhost and c.state == E.CLOSING
        )
        if step % 50 == 49:
            parts = [S.decode(S.encode(p)) for p in S.parts(h.broker, chunk=3)]
            restored = S.restore(parts, cfg)
            _assert_counts(restored)
            assert restored.topology.limits == h.broker.topology.limits
            assert S.digest(restored) == S.digest(h.broker)
    # The traffic reached the states the counters are about.
    assert all(seen.values()), seen


def test_refusals_match_the_counts_after_closes() -> None:
    """Closing connections and channels still count until they are gone, as a scan counted."""
    users = (User("u", "u", max_connections=1, max_channels=1),)
    h = Harness(Broker(BrokerConfig(users=users)))
    c1 = _open(h, 1, "u")
    c1.send(0, C.Channel.Open())  # a connection error: c1 is closing, and still counted
    assert h.broker.topology.limits.user_connections == {"u": 1}
    assert h.broker.topology.limits.user_channels == {}  # released with the connection
    c2 = h.connect(2)
    assert isinstance(c2.handshake(user="u", password="u"), C.Connection.Close)
    c1.send(0, C.Connection.CloseOk())
    assert h.broker.topology.limits.user_connections == {}
    c3 = _open(h, 3, "u")
    c3.send(1, C.Queue.Declare(queue="nope", passive=True))  # channel 1 closing: counted
    c3.send(2, C.Channel.Open())
    assert _close_of(c3)[0] == 530
    _assert_counts(h.broker)


def _handshake_bytes(user: str, vhost: str = "/") -> bytes:
    return b"".join(
        (
            PROTOCOL_HEADER,
            frame.marshal(
                C.Connection.StartOk(
                    client_properties={}, mechanism="PLAIN", response=f"\0{user}\0{user}"
                ),
                0,
            ),
            frame.marshal(C.Connection.TuneOk(channel_max=0, frame_max=131072, heartbeat=0), 0),
            frame.marshal(C.Connection.Open(virtual_host=vhost), 0),
            frame.marshal(C.Channel.Open(), 1),
        )
    )


def _limit_check_lines(b: Broker, conn: int, data: bytes) -> int:
    """Lines run in ``model/resources/limits.py`` while ``b`` applies ``conn``'s handshake (and its
    channel.open)."""
    lines = 0
    target = L.__file__

    def tracer(f: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        if f.f_code.co_filename != target:
            return None
        if event == "line":
            lines += 1
        return tracer

    # ``Limits`` holds no reference to the broker's connections at all: it cannot scan them.
    assert not any(isinstance(v, dict) and v is b.connections for v in vars_of(b.topology.limits))
    b.apply(ClientConnected(conn, 0, "127.0.0.1:1", True))
    sys.settrace(tracer)
    try:
        b.apply(ClientData(conn, data))
    finally:
        sys.settrace(None)
    assert b.connections[conn].vhost and b.connections[conn].channels
    return lines


def test_connection_open_limit_check_is_constant_work() -> None:
    """With 10,000 connections open, connection.open and channel.open run the same lines of
    the limit code as with 10: O(1), not a scan."""
    users = (User("u", "u", max_connections=20_000, max_channels=20_000), User("v", "v"))
    b = Broker(BrokerConfig(users=users, vhost_max_connections=20_000))
    data = _handshake_bytes("u")
    for i in range(1, 11):
        b.apply(ClientConnected(i, 0, "127.0.0.1:1", True))
        b.apply(ClientData(i, data))
    few = _limit_check_lines(b, 11, data)
    for i in range(12, 10_012):
        b.apply(ClientConnected(i, 0, "127.0.0.1:1", True))
        b.apply(ClientData(i, data))
    assert len(b.connections) == 10_011
    assert b.topology.limits.user_connections == {"u": 10_011}
    assert b.topology.limits.user_channels == {"u": 10_011}
    many = _limit_check_lines(b, 20_000, data)
    assert 0 < few == many
    _assert_counts(b)

"""Queue and exchange names are the broker's business, with RabbitMQ's limits and reply codes:
any UTF-8 shortstr (so up to 255 bytes), '=' and other punctuation and non-ASCII included.
pamqp's validate() holds names to a stricter pattern (and 127 characters); the broker keeps
pamqp's other checks but not that one, and encodes the replies that carry names itself."""

from __future__ import annotations

import pytest
from pamqp import commands as C
from pamqp import frame as pframe

from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig, User
from cpgbroker.model.output import basic_return, queue_declare_ok
from cpgbroker.model.state import snapshot as S
from cpgbroker.model.versions import OLDEST
from modelclient import Client, Harness, bodies, marshal_unchecked

ODD_NAMES = [
    "a=b",
    "k=v;x=y&z",
    "ünïcödé-名前",
    "sp ace\ttab!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "emoji-\U0001f407",
]
# 255 bytes: 1 + 127 * 2 (a two-byte character), more than pamqp's 127 characters too.
LONG_UTF8 = "q" + "é" * 127
LONG_ASCII = "x" * 255


def _open() -> tuple[Harness, Client]:
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    return h, c


def _unchecked_publish(c: Client, ch: int, exchange: str, rk: str, body: bytes) -> None:
    data = c.publish_bytes(ch, "", "", body)
    # Replace the publish frame built with placeholder names by one with the real names.
    n, _ch, _m = pframe.unmarshal(data)
    c.send_raw(
        marshal_unchecked(ch, C.Basic.Publish, exchange=exchange, routing_key=rk, mandatory=True)
        + data[n:]
    )


def test_the_name_limits_are_what_the_test_claims() -> None:
    assert len(LONG_UTF8.encode()) == 255 and len(LONG_UTF8) == 128
    for name in (*ODD_NAMES, LONG_UTF8, LONG_ASCII):
        with pytest.raises(ValueError):
            C.Exchange.Declare(exchange=name)  # pamqp refuses every one of them...
    for name in (*ODD_NAMES, LONG_UTF8):
        with pytest.raises(ValueError):
            C.Queue.Declare(queue=name)  # ...and these as queue names too


@pytest.mark.parametrize("name", [*ODD_NAMES, LONG_UTF8, LONG_ASCII])
def test_declare_bind_publish_consume_through_odd_names(name: str) -> None:
    h, c = _open()
    ok = c.rpc_unchecked(1, C.Queue.Declare, queue=name)
    assert isinstance(ok, C.Queue.DeclareOk) and ok.queue == name
    ok = c.rpc_unchecked(1, C.Exchange.Declare, exchange=name, exchange_type="topic")
    assert isinstance(ok, C.Exchange.DeclareOk)
    ok = c.rpc_unchecked(1, C.Queue.Bind, queue=name, exchange=name, routing_key="#")
    assert isinstance(ok, C.Queue.BindOk)
    # Through the named exchange and through the default exchange (routing key = the name).
    _unchecked_publish(c, 1, name, "any.key", b"via-exchange")
    _unchecked_publish(c, 1, "", name, b"via-default")
    c.send_unchecked(1, C.Basic.Consume, queue=name, consumer_tag="t")
    frames = c.recv()
    assert isinstance(frames[0][1], C.Basic.ConsumeOk)
    got = bodies(frames)
    assert [(m.exchange, m.routing_key, body) for m, body in got] == [
        (name, "any.key", b"via-exchange"),
        ("", name, b"via-default"),
    ]
    assert h.broker.vhosts["/"].queues[name].unacked == 2
    # Names survive a state transfer byte for byte.
    restored = S.restore(S.decode(S.encode(p)) for p in S.parts(h.broker))
    assert S.digest(restored) == S.digest(h.broker)
    assert name in restored.vhosts["/"].queues and name in restored.vhosts["/"].exchanges


def test_every_method_that_names_a_queue_or_exchange_takes_odd_names() -> None:
    h, c = _open()
    q, x, x2 = "q=1 é", "x=1 é", "x=2 ü"
    assert isinstance(c.rpc_unchecked(1, C.Queue.Declare, queue=q), C.Queue.DeclareOk)
    for ex in (x, x2):
        reply = c.rpc_unchecked(1, C.Exchange.Declare, exchange=ex, exchange_type="fanout")
        assert isinstance(reply, C.Exchange.DeclareOk)
    pairs = [
        (C.Exchange.Bind, {"destination": x2, "source": x}, C.Exchange.BindOk),
        (C.Queue.Bind, {"queue": q, "exchange": x2}, C.Queue.BindOk),
        (C.Queue.Purge, {"queue": q}, C.Queue.PurgeOk),
        (C.Basic.Get, {"queue": q}, C.Basic.GetEmpty),
        (C.Queue.Unbind, {"queue": q, "exchange": x2}, C.Queue.UnbindOk),
        (C.Exchange.Unbind, {"destination": x2, "source": x}, C.Exchange.UnbindOk),
        (C.Exchange.Declare, {"exchange": x, "passive": True}, C.Exchange.DeclareOk),
        (C.Queue.Declare, {"queue": q, "passive": True}, C.Queue.DeclareOk),
        (C.Exchange.Delete, {"exchange": x}, C.Exchange.DeleteOk),
        (C.Queue.Delete, {"queue": q}, C.Queue.DeleteOk),
    ]
    for cls, kwargs, reply_cls in pairs:
        reply = c.rpc_unchecked(1, cls, **kwargs)
        assert isinstance(reply, reply_cls), (cls, reply)
    assert q not in h.broker.vhosts["/"].queues and x not in h.broker.vhosts["/"].exchanges
    assert not c.is_closed


@pytest.mark.parametrize("name", ["a=b", "ü=ö", LONG_UTF8])
def test_passive_declare_of_a_missing_odd_name_is_404(name: str) -> None:
    _h, c = _open()
    close = c.rpc_unchecked(1, C.Queue.Declare, queue=name, passive=True)
    assert isinstance(close, C.Channel.Close) and close.reply_code == 404
    # RabbitMQ's text, cut to a shortstr's 255 bytes for the long name.
    want = f"NOT_FOUND - no queue '{name}' in vhost '/'".encode()[:255].decode(errors="ignore")
    assert close.reply_text == want
    assert (close.class_id, close.method_id) == (50, 10)
    c.send(1, C.Channel.CloseOk())
    c.channel(2)
    close = c.rpc_unchecked(2, C.Exchange.Declare, exchange=name, passive=True)
    assert isinstance(close, C.Channel.Close) and close.reply_code == 404
    assert close.reply_text.startswith(f"NOT_FOUND - no exchange '{name[:50]}")
    assert not c.is_closed


def test_reserved_prefixes_and_the_default_exchange_keep_their_rules() -> None:
    _h, c = _open()
    close = c.rpc_unchecked(1, C.Exchange.Declare, exchange="amq.x=y", exchange_type="direct")
    assert isinstance(close, C.Channel.Close) and close.reply_code == 403
    assert (
        close.reply_text
        == "ACCESS_REFUSED - exchange name 'amq.x=y' contains reserved prefix 'amq.*'"
    )
    c.send(1, C.Channel.CloseOk())
    c.channel(2)
    close = c.rpc_unchecked(2, C.Queue.Declare, queue="amq.q=é")
    assert isinstance(close, C.Channel.Close) and close.reply_code == 403
    assert (
        close.reply_text == "ACCESS_REFUSED - queue name 'amq.q=é' contains reserved prefix 'amq.*'"
    )
    c.send(2, C.Channel.CloseOk())
    c.channel(3)
    close = c.rpc_unchecked(3, C.Exchange.Delete, exchange="")
    assert isinstance(close, C.Channel.Close) and close.reply_code == 403
    assert not c.is_closed


def test_pamqps_other_validation_still_applies() -> None:
    # At model version 7 (release 0.1.0) pamqp's 127-character limit on the virtual host holds;
    # from 8 it does not (below).
    h = Harness(Broker(version=OLDEST))
    c = h.connect(1)
    c.send_raw(b"AMQP\x00\x00\x09\x01")
    c.rpc(
        0,
        C.Connection.StartOk(client_properties={}, mechanism="PLAIN", response="\0guest\0guest"),
    )
    c.send(0, C.Connection.TuneOk(channel_max=10, frame_max=131072, heartbeat=0))
    close = c.rpc_unchecked(0, C.Connection.Open, virtual_host="v" * 128)
    assert isinstance(close, C.Connection.Close) and close.reply_code == 502
    assert "Max length exceeded for virtual_host" in close.reply_text


@pytest.mark.parametrize("name", ["v" * 128, "é" * 127 + "v"])
def test_a_virtual_host_name_of_up_to_255_bytes_opens_from_model_version_8(name: str) -> None:
    """RabbitMQ takes any short string as a virtual host name in connection.open; pamqp's
    limit (127 characters) holds at model version 7 only."""
    assert len(name.encode()) <= 255
    b = Broker(BrokerConfig(vhosts=("/", name), users=(User("u", "p", ("/", name)),)))
    h = Harness(b)
    c = h.connect(1)
    c.send_raw(b"AMQP\x00\x00\x09\x01")
    c.rpc(0, C.Connection.StartOk(client_properties={}, mechanism="PLAIN", response="\0u\0p"))
    c.send(0, C.Connection.TuneOk(channel_max=10, frame_max=131072, heartbeat=0))
    assert isinstance(c.rpc_unchecked(0, C.Connection.Open, virtual_host=name), C.Connection.OpenOk)
    assert b.connections[1].vhost == name
    # A name no vhost has is refused as RabbitMQ refuses it, whatever its length.
    d = h.connect(2)
    d.send_raw(b"AMQP\x00\x00\x09\x01")
    d.rpc(0, C.Connection.StartOk(client_properties={}, mechanism="PLAIN", response="\0u\0p"))
    d.send(0, C.Connection.TuneOk(channel_max=10, frame_max=131072, heartbeat=0))
    close = d.rpc_unchecked(0, C.Connection.Open, virtual_host="w" * 255)
    assert isinstance(close, C.Connection.Close) and close.reply_code == 530
    assert close.reply_text == f"NOT_ALLOWED - vhost {'w' * 255} not found"[:255]
    # At version 7 the same open is refused by pamqp's limit.
    old = Harness(Broker(b.config, version=OLDEST))
    e = old.connect(1)
    e.send_raw(b"AMQP\x00\x00\x09\x01")
    e.rpc(0, C.Connection.StartOk(client_properties={}, mechanism="PLAIN", response="\0u\0p"))
    e.send(0, C.Connection.TuneOk(channel_max=10, frame_max=131072, heartbeat=0))
    close = e.rpc_unchecked(0, C.Connection.Open, virtual_host=name)
    assert isinstance(close, C.Connection.Close) and close.reply_code == 502


def test_a_name_that_is_not_utf8_is_a_frame_error_as_in_rabbitmq() -> None:
    _h, c = _open()
    good = marshal_unchecked(1, C.Queue.Declare, queue="ab")
    # The queue name's two bytes (after index, ticket and the length octet) become invalid UTF-8.
    payload_at = 7 + 4 + 2 + 1
    bad = good[:payload_at] + b"\xff\xfe" + good[payload_at + 2 :]
    c.send_raw(bad)
    close = c.methods()[-1]
    # RabbitMQ 3.10.8 answers "501 FRAME_ERROR - Malformed UTF-8 in shortstr" (measured).
    assert isinstance(close, C.Connection.Close) and close.reply_code == 501
    assert close.reply_text == "FRAME_ERROR - Malformed UTF-8 in shortstr"
    assert (close.class_id, close.method_id) == (50, 10)


def test_an_unroutable_mandatory_publish_returns_the_odd_exchange_name() -> None:
    _h, c = _open()
    name = "ret=urn é"
    c.rpc_unchecked(1, C.Exchange.Declare, exchange=name, exchange_type="direct")
    _unchecked_publish(c, 1, name, "k=nowhere", b"back")
    got = c.deliveries()
    assert len(got) == 1
    ret, body = got[0]
    assert isinstance(ret, C.Basic.Return)
    assert (ret.reply_code, ret.reply_text, ret.exchange, ret.routing_key, body) == (
        312,
        "NO_ROUTE",
        name,
        "k=nowhere",
        b"back",
    )


def test_dead_letters_reach_an_odd_dead_letter_exchange() -> None:
    h, c = _open()
    dlx, dlq = "dlx=é", "dlq=é"
    c.rpc_unchecked(1, C.Exchange.Declare, exchange=dlx, exchange_type="fanout")
    c.rpc_unchecked(1, C.Queue.Declare, queue=dlq)
    c.rpc_unchecked(1, C.Queue.Bind, queue=dlq, exchange=dlx)
    c.rpc_unchecked(1, C.Queue.Declare, queue="src=1", arguments={"x-dead-letter-exchange": dlx})
    _unchecked_publish(c, 1, "", "src=1", b"m")
    c.rpc_unchecked(1, C.Basic.Get, queue="src=1")
    c.send(1, C.Basic.Reject(delivery_tag=1, requeue=False))
    (entry,) = h.broker.vhosts["/"].queues[dlq].messages
    death = entry.msg.headers()["x-death"][0]
    assert (death["queue"], death["reason"], entry.msg.exchange) == ("src=1", "rejected", dlx)


@pytest.mark.parametrize("name", ["q", "amq.gen-abc_DEF", "a.b:c@d#e,f/g+h i"])
def test_hand_encoded_replies_equal_pamqps_where_pamqp_accepts_the_name(name: str) -> None:
    assert queue_declare_ok(3, name, 7, 2) == pframe.marshal(
        C.Queue.DeclareOk(queue=name, message_count=7, consumer_count=2), 3
    )
    assert basic_return(5, 312, "NO_ROUTE", name, "r.k") == pframe.marshal(
        C.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange=name, routing_key="r.k"),
        5,
    )


@pytest.mark.parametrize("name", ["a=b", LONG_UTF8])
def test_hand_encoded_replies_decode_with_pamqp(name: str) -> None:
    _n, ch, m = pframe.unmarshal(queue_declare_ok(1, name, 0, 0))
    assert ch == 1 and isinstance(m, C.Queue.DeclareOk) and m.queue == name
    _n, ch, m = pframe.unmarshal(basic_return(2, 312, "NO_ROUTE", name, name))
    assert isinstance(m, C.Basic.Return) and (m.exchange, m.routing_key) == (name, name)

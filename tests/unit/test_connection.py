"""Connection handshake, authentication, tuning and connection-level errors."""

from pamqp import commands as C
from pamqp import frame

from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig, User
from cpgbroker.wire.framer import HEARTBEAT_FRAME, PROTOCOL_HEADER
from modelclient import Harness


def test_handshake_announces_capabilities_and_opens():
    h = Harness()
    c = h.connect(1)
    c.send_raw(PROTOCOL_HEADER)
    start = c.methods()[0]
    assert isinstance(start, C.Connection.Start)
    caps = start.server_properties["capabilities"]
    for cap in (
        "publisher_confirms",
        "basic.nack",
        "consumer_cancel_notify",
        "exchange_exchange_bindings",
        "per_consumer_qos",
        "connection.blocked",
        "authentication_failure_close",
    ):
        assert caps[cap] is True, cap
    assert "PLAIN" in start.mechanisms.split() and "AMQPLAIN" in start.mechanisms.split()
    c2 = h.connect(2)
    assert isinstance(c2.handshake(), C.Connection.OpenOk)


def test_protocol_header_split_over_reads():
    h = Harness()
    c = h.connect(1)
    for byte in PROTOCOL_HEADER:
        c.send_raw(bytes([byte]))
    assert isinstance(c.methods()[0], C.Connection.Start)


def test_wrong_protocol_header_gets_ours_and_close():
    h = Harness()
    c = h.connect(1)
    c.send_raw(b"AMQP\x01\x01\x00\x0a")
    assert bytes(h.out[1]) == PROTOCOL_HEADER
    assert c.is_closed
    assert 1 not in h.broker.connections


def test_http_request_is_refused_early():
    h = Harness()
    c = h.connect(1)
    c.send_raw(b"GET ")
    assert c.is_closed


def test_bad_password_is_403_and_closes():
    h = Harness()
    c = h.connect(1)
    reply = c.handshake(password="wrong")
    assert isinstance(reply, C.Connection.Close)
    assert reply.reply_code == 403
    assert reply.reply_text.startswith("ACCESS_REFUSED - Login was refused")
    c.send(0, C.Connection.CloseOk())
    assert c.is_closed


def test_guest_only_from_loopback_but_other_users_anywhere():
    cfg = BrokerConfig(
        users=(User("guest", "guest", ("/",), loopback_only=True), User("app", "s3cret")),
    )
    h = Harness(Broker(cfg))
    remote = h.connect(1, loopback=False)
    assert remote.handshake().reply_code == 403
    app = h.connect(2, loopback=False)
    assert isinstance(app.handshake("app", "s3cret"), C.Connection.OpenOk)


def test_amqplain_login():
    from pamqp import encode

    h = Harness()
    c = h.connect(1)
    c.send_raw(PROTOCOL_HEADER)
    c.methods()
    table = encode.table_integer if False else None  # noqa: F841 - documents intent only
    raw = encode.field_table({"LOGIN": "guest", "PASSWORD": "guest"})[4:]
    reply = c.rpc(
        0, C.Connection.StartOk(client_properties={}, mechanism="AMQPLAIN", response=raw.decode())
    )
    assert isinstance(reply, C.Connection.Tune)


def test_unknown_vhost_is_530():
    h = Harness()
    c = h.connect(1)
    reply = c.handshake(vhost="/nope")
    assert isinstance(reply, C.Connection.Close)
    assert reply.reply_code == 530


def test_tune_ok_above_server_frame_max_is_refused():
    h = Harness()
    c = h.connect(1)
    reply = c.handshake(frame_max=10_000_000)
    assert isinstance(reply, C.Connection.Close) and reply.reply_code == 530


def test_oversized_frame_closes_with_501_without_buffering():
    h = Harness()
    c = h.connect(1)
    c.handshake(frame_max=4096)
    c.channel(1)
    # Only the 7-byte header of a 1 MB frame arrives: rejected before its payload is buffered.
    c.send_raw(b"\x01\x00\x01\x00\x10\x00\x00")
    close = c.methods()[-1]
    assert isinstance(close, C.Connection.Close) and close.reply_code == 501
    assert "frame size" in close.reply_text


def test_bad_frame_end_and_unknown_type_are_frame_errors():
    for data in (b"\x01\x00\x01\x00\x00\x00\x04abcdX", b"\x07\x00\x00\x00\x00\x00\x00\xce"):
        h = Harness()
        c = h.connect(1)
        c.handshake()
        c.send_raw(data)
        close = c.methods()[-1]
        assert isinstance(close, C.Connection.Close) and close.reply_code == 501


def test_method_on_unopened_channel_is_504():
    h = Harness()
    c = h.connect(1)
    c.handshake()
    close = c.rpc(5, C.Queue.Declare(queue="x"))
    assert isinstance(close, C.Connection.Close) and close.reply_code == 504


def test_opening_more_than_channel_max_channels_is_refused():
    # RabbitMQ's reading, which clients rely on: channel_max bounds how many channels are
    # open, not their numbers (aiormq opens channel 65535).
    h = Harness(Broker(BrokerConfig(channel_max=2)))
    c = h.connect(1)
    c.handshake()
    assert isinstance(c.rpc(65535, C.Channel.Open()), C.Channel.OpenOk)
    assert isinstance(c.rpc(7, C.Channel.Open()), C.Channel.OpenOk)
    close = c.rpc(8, C.Channel.Open())
    assert isinstance(close, C.Connection.Close) and close.reply_code == 530


def test_second_channel_open_is_504():
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    close = c.rpc(1, C.Channel.Open())
    assert isinstance(close, C.Connection.Close) and close.reply_code == 504


def test_heartbeats_sent_and_missed_heartbeats_close():
    h = Harness()
    h.tick(1_000)
    c = h.connect(1)
    c.handshake(heartbeat=2)
    h.out.pop(1, None)
    h.tick(2_100)  # half the interval passed without output: we send a heartbeat
    assert bytes(h.out.pop(1)) == HEARTBEAT_FRAME
    c.send_raw(HEARTBEAT_FRAME)  # the client is alive at 2.1 s
    h.tick(6_000)
    assert not c.is_closed
    h.tick(6_200)  # more than 2 x 2 s since the client's last byte
    assert c.is_closed
    assert "missed heartbeats" in h.closed[1]
    assert 1 not in h.broker.connections


def test_handshake_timeout_drops_silent_clients():
    h = Harness()
    c = h.connect(1)
    h.tick(9_000)
    assert not c.is_closed
    h.tick(10_001)
    assert c.is_closed


def test_client_close_requeues_and_releases():
    h = Harness()
    a = h.connect(1)
    a.handshake()
    a.channel(1)
    a.rpc(1, C.Queue.Declare(queue="q"))
    a.publish(1, "", "q", b"m1")
    a.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    assert [b for _, b in a.deliveries()] == [b"m1"]
    reply = a.rpc(0, C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
    assert isinstance(reply, C.Connection.CloseOk)
    assert a.is_closed
    q = h.broker.vhosts["/"].queues["q"]
    assert len(q.messages) == 1 and q.messages[0].redelivered
    assert q.consumers == []


def test_disconnect_deletes_exclusive_queues():
    h = Harness()
    a = h.connect(1)
    a.handshake()
    a.channel(1)
    name = a.rpc(1, C.Queue.Declare(queue="", exclusive=True)).queue
    assert name.startswith("amq.gen-")
    a.disconnect()
    assert name not in h.broker.vhosts["/"].queues


def test_server_named_queues_are_deterministic_and_unique():
    names = []
    for _ in range(2):
        h = Harness()
        c = h.connect(7)
        c.handshake()
        c.channel(1)
        names.append([c.rpc(1, C.Queue.Declare(queue="")).queue for _ in range(3)])
    assert names[0] == names[1]
    assert len(set(names[0])) == 3


def test_close_client_event_sends_connection_forced():
    from cpgbroker.model.events import CloseClient

    h = Harness()
    c = h.connect(1)
    c.handshake()
    h.apply(CloseClient(1, 320, "broker shutdown"))
    close = c.methods()[-1]
    assert isinstance(close, C.Connection.Close) and close.reply_code == 320
    c.send(0, C.Connection.CloseOk())
    assert c.is_closed


def test_connection_method_on_channel_1_is_503():
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    c.send_raw(frame.marshal(C.Connection.Open(), 1))
    close = c.methods()[-1]
    assert isinstance(close, C.Connection.Close) and close.reply_code == 503

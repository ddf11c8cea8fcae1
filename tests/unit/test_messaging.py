"""Routing, delivery, acknowledgement, qos, tx, confirms, TTL, limits and dead-lettering."""

import pytest
from pamqp import commands as C
from pamqp import header as H

from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.routing.exchange import headers_match, topic_match
from modelclient import Client, Harness, bodies


def opened(h: Harness | None = None, conn: int = 1) -> tuple[Harness, Client]:
    h = h or Harness()
    c = h.connect(conn)
    c.handshake()
    c.channel(1)
    return h, c


def consume(c: Client, queue: str, tag: str = "t", **kw: object) -> list[tuple[object, bytes]]:
    c.send(1, C.Basic.Consume(queue=queue, consumer_tag=tag, **kw))
    return c.deliveries()


@pytest.mark.parametrize(
    ("pattern", "key", "hit"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.c", False),
        ("a.#", "a", True),
        ("a.#", "a.b.c", True),
        ("#", "", True),
        ("#.c", "a.b.c", True),
        ("#.c", "c", True),
        ("*", "a.b", False),
        ("a.#.d", "a.b.c.d", True),
        ("a.#.d", "a.d", True),
        ("a.#.#.d", "a.x.d", True),
        ("*.#", "", False),
        ("a.b", "a.b.c", False),
    ],
)
def test_topic_match(pattern: str, key: str, hit: bool) -> None:
    words = key.split(".") if key else []
    assert topic_match(tuple(pattern.split(".")), words) is hit


def test_headers_match_all_any_and_x_keys() -> None:
    hdrs = {"a": 1, "b": "x", "x-c": 3}
    assert headers_match({"x-match": "all", "a": 1, "b": "x"}, hdrs)
    assert not headers_match({"x-match": "all", "a": 1, "b": "y"}, hdrs)
    assert headers_match({"x-match": "any", "a": 2, "b": "x"}, hdrs)
    assert not headers_match({"x-match": "any", "a": 2}, hdrs)
    assert headers_match({"x-match": "all", "a": None}, hdrs)  # void value: presence only
    assert headers_match({"x-match": "all", "x-c": 4}, hdrs)  # x- keys ignored
    assert not headers_match({"x-match": "all-with-x", "x-c": 4}, hdrs)


def test_exchange_types_route_to_the_right_queues() -> None:
    h, c = opened()
    for ex, t in (("d", "direct"), ("f", "fanout"), ("t", "topic"), ("hd", "headers")):
        c.rpc(1, C.Exchange.Declare(exchange=ex, exchange_type=t))
    for q in ("q1", "q2", "q3"):
        c.rpc(1, C.Queue.Declare(queue=q))
    c.rpc(1, C.Queue.Bind(queue="q1", exchange="d", routing_key="k"))
    c.rpc(1, C.Queue.Bind(queue="q1", exchange="f"))
    c.rpc(1, C.Queue.Bind(queue="q2", exchange="f"))
    c.rpc(1, C.Queue.Bind(queue="q3", exchange="t", routing_key="stock.*.nyse"))
    c.rpc(1, C.Queue.Bind(queue="q2", exchange="hd", arguments={"x-match": "any", "a": 1}))
    c.publish(1, "d", "k", b"direct")
    c.publish(1, "d", "other", b"lost")
    c.publish(1, "f", "whatever", b"fan")
    c.publish(1, "t", "stock.ibm.nyse", b"topic")
    c.publish(1, "t", "stock.ibm.lse", b"no")
    c.publish(1, "hd", "", b"hdr", props=C.Basic.Properties(headers={"a": 1}))
    qs = h.broker.vhosts["/"].queues
    assert [e.msg.body for e in qs["q1"].messages] == [b"direct", b"fan"]
    assert [e.msg.body for e in qs["q2"].messages] == [b"fan", b"hdr"]
    assert [e.msg.body for e in qs["q3"].messages] == [b"topic"]


def test_exchange_to_exchange_and_alternate_exchange() -> None:
    h, c = opened()
    c.rpc(1, C.Exchange.Declare(exchange="src", exchange_type="topic"))
    c.rpc(1, C.Exchange.Declare(exchange="dst", exchange_type="fanout"))
    c.rpc(1, C.Exchange.Declare(exchange="ae", exchange_type="fanout"))
    c.rpc(
        1,
        C.Exchange.Declare(
            exchange="main", exchange_type="direct", arguments={"alternate-exchange": "ae"}
        ),
    )
    c.rpc(1, C.Queue.Declare(queue="viae2e"))
    c.rpc(1, C.Queue.Declare(queue="unrouted"))
    c.rpc(1, C.Exchange.Bind(destination="dst", source="src", routing_key="#"))
    c.rpc(1, C.Queue.Bind(queue="viae2e", exchange="dst"))
    c.rpc(1, C.Queue.Bind(queue="unrouted", exchange="ae"))
    c.publish(1, "src", "a.b", b"e2e")
    c.publish(1, "main", "nobody", b"alt")
    qs = h.broker.vhosts["/"].queues
    assert [e.msg.body for e in qs["viae2e"].messages] == [b"e2e"]
    assert [e.msg.body for e in qs["unrouted"].messages] == [b"alt"]


def test_mandatory_unroutable_is_returned() -> None:
    _h, c = opened()
    c.publish(1, "amq.direct", "nowhere", b"bounce", mandatory=True)
    [(ret, body)] = c.deliveries()
    assert isinstance(ret, C.Basic.Return) and ret.reply_code == 312 and body == b"bounce"


def test_immediate_is_540() -> None:
    _h, c = opened()
    from pamqp import frame

    c.send_raw(frame.marshal(C.Basic.Publish(exchange="", routing_key="q", immediate=True), 1))
    close = c.methods()[-1]
    assert isinstance(close, C.Connection.Close) and close.reply_code == 540


def test_publish_to_missing_exchange_closes_only_the_channel() -> None:
    _h, c = opened()
    c.publish(1, "missing", "k", b"x")
    close = c.methods()[-1]
    assert isinstance(close, C.Channel.Close) and close.reply_code == 404
    assert close.reply_text == "NOT_FOUND - no exchange 'missing' in vhost '/'"
    c.send(1, C.Channel.CloseOk())
    assert isinstance(c.channel(1), C.Channel.OpenOk)


def test_large_message_spans_frames_and_is_redelivered_split_to_frame_max() -> None:
    h = Harness()
    c = h.connect(1)
    c.handshake(frame_max=4096)
    c.channel(1)
    c.rpc(1, C.Queue.Declare(queue="big"))
    body = bytes(range(256)) * 100
    c.publish(1, "", "big", body, frame_max=4096)
    [(_m, got)] = consume(c, "big")
    assert got == body
    assert all(
        len(f.value) <= 4088
        for _, f in c.frames
        if hasattr(f, "value") and isinstance(f.value, bytes)
    )


def test_prefetch_limits_unacked_and_ack_releases() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    for i in range(5):
        c.publish(1, "", "q", b"%d" % i)
    c.rpc(1, C.Basic.Qos(prefetch_count=2))
    got = consume(c, "q")
    assert [b for _, b in got] == [b"0", b"1"]
    c.send(1, C.Basic.Ack(delivery_tag=got[0][0].delivery_tag))
    assert [b for _, b in c.deliveries()] == [b"2"]
    c.send(1, C.Basic.Ack(delivery_tag=3, multiple=True))
    assert [b for _, b in c.deliveries()] == [b"3", b"4"]


def test_global_qos_limits_the_channel() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="a"))
    c.rpc(1, C.Queue.Declare(queue="b"))
    for q in ("a", "b"):
        for i in range(3):
            c.publish(1, "", q, q.encode() + b"%d" % i)
    c.rpc(1, C.Basic.Qos(prefetch_count=3, global_=True))
    got = consume(c, "a", "ta") + consume(c, "b", "tb")
    assert len(got) == 3


def test_competing_consumers_round_robin() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.send(1, C.Basic.Consume(queue="q", consumer_tag="x"))
    c.send(1, C.Basic.Consume(queue="q", consumer_tag="y"))
    c.recv()
    for i in range(4):
        c.publish(1, "", "q", b"%d" % i)
    tags = [m.consumer_tag for m, _ in c.deliveries()]
    assert tags == ["x", "y", "x", "y"]


def test_nack_requeue_sets_redelivered_and_reject_drops() -> None:
    h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.publish(1, "", "q", b"a")
    c.publish(1, "", "q", b"b")
    c.rpc(1, C.Basic.Qos(prefetch_count=1))
    [(m, body)] = consume(c, "q")
    assert body == b"a" and not m.redelivered
    c.send(1, C.Basic.Nack(delivery_tag=m.delivery_tag, requeue=True))
    [(m2, body2)] = c.deliveries()
    assert body2 == b"a" and m2.redelivered
    c.send(1, C.Basic.Reject(delivery_tag=m2.delivery_tag, requeue=False))
    [(_m3, body3)] = c.deliveries()
    assert body3 == b"b"
    assert (
        h.broker.vhosts["/"].queues["q"].messages
        == type(h.broker.vhosts["/"].queues["q"].messages)()
    )


def test_unknown_delivery_tag_is_406_channel_error() -> None:
    _h, c = opened()
    c.send(1, C.Basic.Ack(delivery_tag=42))
    close = c.methods()[-1]
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406
    assert "unknown delivery tag 42" in close.reply_text


def test_recover_requeues_unacked() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.publish(1, "", "q", b"a")
    consume(c, "q")
    c.send(1, C.Basic.Recover(requeue=True))
    got = c.recv()
    assert any(isinstance(f, C.Basic.RecoverOk) for _, f in got)
    [(m, body)] = bodies(got)
    assert m.redelivered and body == b"a"


def test_get_and_get_empty() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    assert isinstance(c.rpc(1, C.Basic.Get(queue="q")), C.Basic.GetEmpty)
    c.publish(1, "", "q", b"x")
    c.publish(1, "", "q", b"y")
    c.send(1, C.Basic.Get(queue="q", no_ack=True))
    [(m, body)] = c.deliveries()
    assert isinstance(m, C.Basic.GetOk) and body == b"x" and m.message_count == 1


def test_confirms_are_batched_acks_in_order() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.rpc(1, C.Confirm.Select())
    data = b"".join(c.publish_bytes(1, "", "q", b"%d" % i) for i in range(5))
    c.send_raw(data)
    acks = [m for m in c.methods() if isinstance(m, C.Basic.Ack)]
    assert [(a.delivery_tag, a.multiple) for a in acks] == [(5, True)]
    c.publish(1, "", "q", b"six")
    [ack] = c.methods()
    assert (ack.delivery_tag, ack.multiple) == (6, False)


def test_reject_publish_overflow_nacks_in_confirm_mode() -> None:
    _h, c = opened()
    c.rpc(
        1, C.Queue.Declare(queue="q", arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    )
    c.rpc(1, C.Confirm.Select())
    c.send_raw(c.publish_bytes(1, "", "q", b"1") + c.publish_bytes(1, "", "q", b"2"))
    ms = c.methods()
    assert [(type(m).__name__, m.delivery_tag) for m in ms] == [("Ack", 1), ("Nack", 2)]


def test_drop_head_keeps_newest_and_dead_letters_the_dropped() -> None:
    h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="dead"))
    c.rpc(
        1,
        C.Queue.Declare(
            queue="q",
            arguments={
                "x-max-length": 2,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": "dead",
            },
        ),
    )
    for i in range(4):
        c.publish(1, "", "q", b"%d" % i)
    qs = h.broker.vhosts["/"].queues
    assert [e.msg.body for e in qs["q"].messages] == [b"2", b"3"]
    assert [e.msg.body for e in qs["dead"].messages] == [b"0", b"1"]
    hdrs = qs["dead"].messages[0].msg.headers()
    assert hdrs["x-death"][0]["reason"] == "maxlen"
    assert hdrs["x-death"][0]["queue"] == "q"


def test_ttl_expires_on_ticks_and_dead_letters() -> None:
    h = Harness()
    h.tick(1_000)
    h, c = opened(h)
    c.rpc(1, C.Queue.Declare(queue="dlq"))
    c.rpc(
        1,
        C.Queue.Declare(
            queue="q",
            arguments={
                "x-message-ttl": 500,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": "dlq",
            },
        ),
    )
    c.publish(1, "", "q", b"short", props=C.Basic.Properties(expiration="100"))
    c.publish(1, "", "q", b"queue-ttl")
    qs = h.broker.vhosts["/"].queues
    h.tick(1_050)
    assert len(qs["q"].messages) == 2
    h.tick(1_150)
    assert [e.msg.body for e in qs["q"].messages] == [b"queue-ttl"]
    h.tick(1_600)
    assert not qs["q"].messages
    dead = [e.msg for e in qs["dlq"].messages]
    assert [m.body for m in dead] == [b"short", b"queue-ttl"]
    assert dead[0].headers()["x-death"][0]["reason"] == "expired"
    assert dead[0].headers()["x-death"][0]["original-expiration"] == "100"


def test_invalid_expiration_is_406() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.publish(1, "", "q", b"x", props=C.Basic.Properties(expiration="soon"))
    close = c.methods()[-1]
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406


def test_x_expires_deletes_unused_queue() -> None:
    h = Harness()
    h.tick(0)
    h, c = opened(h)
    c.rpc(1, C.Queue.Declare(queue="tmp", arguments={"x-expires": 1000}))
    h.tick(900)
    assert "tmp" in h.broker.vhosts["/"].queues
    h.tick(1000)
    assert "tmp" not in h.broker.vhosts["/"].queues


def test_queue_delete_notifies_consumers_and_if_unused() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    consume(c, "q", "ct")
    close = c.rpc(1, C.Queue.Delete(queue="q", if_unused=True))
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406
    c.send(1, C.Channel.CloseOk())
    c.channel(1)
    c.send(2, C.Channel.Open())
    c.recv()
    consume_on = C.Basic.Consume(queue="q", consumer_tag="again")
    c.rpc(1, consume_on)
    c.send(2, C.Queue.Delete(queue="q"))
    ms = c.methods()
    assert any(isinstance(m, C.Basic.Cancel) and m.consumer_tag == "again" for m in ms)
    assert any(isinstance(m, C.Queue.DeleteOk) for m in ms)


def test_exclusive_queue_is_locked_to_its_connection() -> None:
    h, a = opened(conn=1)
    _, b = opened(h, conn=2)
    a.rpc(1, C.Queue.Declare(queue="mine", exclusive=True))
    close = b.rpc(1, C.Queue.Declare(queue="mine", passive=True))
    assert isinstance(close, C.Channel.Close) and close.reply_code == 405


def test_redeclare_with_other_properties_is_406() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q", durable=True))
    close = c.rpc(1, C.Queue.Declare(queue="q", durable=False))
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406
    assert "inequivalent arg 'durable'" in close.reply_text


def test_reserved_names_are_refused() -> None:
    _h, c = opened()
    close = c.rpc(1, C.Exchange.Declare(exchange="amq.mine", exchange_type="direct"))
    assert isinstance(close, C.Channel.Close) and close.reply_code == 403
    c.send(1, C.Channel.CloseOk())
    c.channel(1)
    close = c.rpc(1, C.Queue.Declare(queue="amq.q"))
    assert isinstance(close, C.Channel.Close) and close.reply_code == 403


def test_auto_delete_queue_goes_with_last_consumer() -> None:
    h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="ad", auto_delete=True))
    consume(c, "ad", "one")
    c.rpc(1, C.Basic.Cancel(consumer_tag="one"))
    assert "ad" not in h.broker.vhosts["/"].queues


def test_tx_commit_and_rollback() -> None:
    h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.rpc(1, C.Tx.Select())
    c.publish(1, "", "q", b"a")
    q = h.broker.vhosts["/"].queues["q"]
    assert not q.messages
    assert isinstance(c.rpc(1, C.Tx.Commit()), C.Tx.CommitOk)
    assert [e.msg.body for e in q.messages] == [b"a"]
    c.publish(1, "", "q", b"b")
    assert isinstance(c.rpc(1, C.Tx.Rollback()), C.Tx.RollbackOk)
    assert [e.msg.body for e in q.messages] == [b"a"]
    # acks are transactional too
    [(m, _)] = consume(c, "q")
    c.send(1, C.Basic.Ack(delivery_tag=m.delivery_tag))
    assert q.unacked == 1
    c.rpc(1, C.Tx.Commit())
    assert q.unacked == 0


def test_confirm_and_tx_are_exclusive() -> None:
    _h, c = opened()
    c.rpc(1, C.Tx.Select())
    close = c.rpc(1, C.Confirm.Select())
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406


def test_channel_flow_pauses_deliveries() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    consume(c, "q")
    c.rpc(1, C.Channel.Flow(active=False))
    c.publish(1, "", "q", b"held")
    assert c.deliveries() == []
    c.send(1, C.Channel.Flow(active=True))
    assert [b for _, b in c.deliveries()] == [b"held"]


def test_do_output_credit_bounds_allocation() -> None:
    from cpgbroker.model.events import DoOutput, WantOutput

    h, c = opened()
    h.auto_credit = False
    h.apply(DoOutput(1, 2))
    c.rpc(1, C.Queue.Declare(queue="q"))
    for i in range(5):
        c.publish(1, "", "q", b"%d" % i)
    h.effects.clear()
    got = consume(c, "q")
    assert len(got) == 2
    assert any(isinstance(e, WantOutput) for e in h.effects)
    h.apply(DoOutput(1, 10))
    assert len(c.deliveries()) == 3


def test_max_message_size_is_enforced_from_the_header() -> None:
    h = Harness(Broker(BrokerConfig(max_message_size=1000)))
    h, c = opened(h)
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.publish(1, "", "q", b"x" * 2000)
    close = c.methods()[-1]
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406


def test_content_frames_out_of_order_are_505() -> None:
    from pamqp import body as B
    from pamqp import frame

    _h, c = opened()
    c.send_raw(frame.marshal(B.ContentBody(b"stray"), 1))
    close = c.methods()[-1]
    assert isinstance(close, C.Connection.Close) and close.reply_code == 505
    _h2, c2 = opened()
    c2.send_raw(frame.marshal(C.Basic.Publish(exchange="", routing_key="q"), 1))
    c2.send(1, C.Queue.Declare(queue="x"))
    close = c2.methods()[-1]
    assert isinstance(close, C.Connection.Close) and close.reply_code == 505


def test_memory_mark_blocks_publishers() -> None:
    from cpgbroker.model.events import Throttle

    h = Harness(Broker(BrokerConfig(high_watermark_bytes=1000)))
    h, c = opened(h)
    c.rpc(1, C.Queue.Declare(queue="q"))
    c.publish(1, "", "q", b"x" * 600)
    c.publish(1, "", "q", b"x" * 600)
    assert any(isinstance(m, C.Connection.Blocked) for m in c.methods())
    assert any(isinstance(e, Throttle) and e.paused for e in h.effects)
    c.send(1, C.Queue.Purge(queue="q"))
    assert any(isinstance(m, C.Connection.Unblocked) for m in c.methods())
    assert any(isinstance(e, Throttle) and not e.paused for e in h.effects)


def test_member_left_closes_its_connections_and_requeues() -> None:
    from cpgbroker.model.events import MemberLeft

    h = Harness()
    a = h.connect(1, member=1)
    a.handshake()
    a.channel(1)
    b = h.connect(2, member=2)
    b.handshake()
    b.channel(1)
    a.rpc(1, C.Queue.Declare(queue="q"))
    a.publish(1, "", "q", b"m")
    consume(b, "q")
    h.apply(MemberLeft(2))
    assert 2 not in h.broker.connections and 1 in h.broker.connections
    q = h.broker.vhosts["/"].queues["q"]
    assert [(e.msg.body, e.redelivered) for e in q.messages] == [(b"m", True)]


def test_content_header_bytes_are_forwarded_unchanged() -> None:
    _h, c = opened()
    c.rpc(1, C.Queue.Declare(queue="q"))
    props = C.Basic.Properties(
        content_type="text/plain", headers={"k": "v"}, message_id="m1", priority=3
    )
    c.publish(1, "", "q", b"body", props=props)
    consume(c, "q")
    hdr = [f for _, f in c.frames if isinstance(f, H.ContentHeader)][-1]
    assert hdr.properties.content_type == "text/plain"
    assert hdr.properties.headers == {"k": "v"} and hdr.properties.message_id == "m1"

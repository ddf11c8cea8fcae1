"""RabbitMQ's direct reply-to (``amq.rabbitmq.reply-to``) in the model: a requester consumes the
pseudo-queue without acks, publishes with that reply-to, the server sees the reply-to of the
requester's channel and answers through the default exchange; with RabbitMQ's refusals."""

from __future__ import annotations

from typing import Any

from pamqp import commands
from pamqp import header as pheader

from cpgbroker.model.state import snapshot
from modelclient import Client, Harness

REPLY = "amq.rabbitmq.reply-to"


def _client(h: Harness, conn: int) -> Client:
    c = h.connect(conn)
    c.handshake()
    c.channel()
    return c


def _received(c: Client) -> list[tuple[Any, commands.Basic.Properties, bytes]]:
    """(deliver or return, properties, body) of each message received since the last call."""
    out: list[list[Any]] = []
    for _, f in c.recv():
        if isinstance(f, (commands.Basic.Deliver, commands.Basic.Return)):
            out.append([f, None, b""])
        elif isinstance(f, pheader.ContentHeader) and out:
            out[-1][1] = f.properties
        elif hasattr(f, "value") and out and isinstance(f.value, bytes):
            out[-1][2] += f.value
    return [(m, p, b) for m, p, b in out]


def test_a_request_and_its_answer_through_direct_reply_to() -> None:
    h = Harness()
    requester, server = _client(h, 1), _client(h, 2)
    server.rpc(1, commands.Queue.Declare(queue="rpc"))
    server.rpc(1, commands.Basic.Consume(queue="rpc", no_ack=True))
    ok = requester.rpc(1, commands.Basic.Consume(queue=REPLY, no_ack=True))
    assert isinstance(ok, commands.Basic.ConsumeOk)
    props = commands.Basic.Properties(
        reply_to=REPLY, correlation_id="c-1", headers={"k": "v"}, delivery_mode=2
    )
    requester.publish(1, "", "rpc", b"question", props=props)
    ((_, got, body),) = _received(server)
    assert body == b"question"
    # The server sees the requester channel's own address; the rest of the header is intact.
    assert got.reply_to.startswith(REPLY + ".") and len(got.reply_to) > len(REPLY) + 8
    assert (got.correlation_id, got.headers, got.delivery_mode) == ("c-1", {"k": "v"}, 2)
    answer = commands.Basic.Properties(correlation_id="c-1")
    server.publish(1, "", got.reply_to, b"answer", props=answer)
    ((deliver, aprops, abody),) = _received(requester)
    assert isinstance(deliver, commands.Basic.Deliver)
    assert (deliver.consumer_tag, deliver.routing_key, deliver.exchange) == (
        ok.consumer_tag,
        got.reply_to,
        "",
    )
    assert (abody, aprops.correlation_id) == (b"answer", "c-1")
    # A passive declare finds it (RabbitMQ: a live reply consumer); nobody else may consume
    # it, get from it or delete it: for them it is not there.
    declared = server.rpc(1, commands.Queue.Declare(queue=got.reply_to, passive=True))
    assert isinstance(declared, commands.Queue.DeclareOk) and declared.consumer_count == 1
    close = server.rpc(1, commands.Basic.Consume(queue=got.reply_to, no_ack=True))
    assert isinstance(close, commands.Channel.Close) and close.reply_code == 404
    assert close.reply_text == f"NOT_FOUND - no queue '{got.reply_to}' in vhost '/'"
    # Replicas agree, and a snapshot carries the reply consumer.
    restored = snapshot.restore(snapshot.snapshot(h.broker))
    assert snapshot.digest(restored) == snapshot.digest(h.broker)
    # Cancelled, the address is gone: an answer is unroutable (returned when mandatory).
    requester.rpc(1, commands.Basic.Cancel(consumer_tag=ok.consumer_tag))
    server.channel(2)
    server.publish(2, "", got.reply_to, b"late", mandatory=True)
    ((ret, _, late),) = _received(server)
    assert isinstance(ret, commands.Basic.Return) and (ret.reply_code, late) == (312, b"late")
    assert got.reply_to not in h.broker.vhosts["/"].queues


def test_rabbitmqs_refusals() -> None:
    h = Harness()
    c = _client(h, 1)
    # Acks are not for reply consumers.
    close = c.rpc(1, commands.Basic.Consume(queue=REPLY, no_ack=False))
    assert isinstance(close, commands.Channel.Close) and close.reply_code == 406
    assert close.reply_text == "PRECONDITION_FAILED - reply consumer cannot acknowledge"
    c.send(1, commands.Channel.CloseOk())
    # One per channel.
    c.channel(2)
    c.rpc(2, commands.Basic.Consume(queue=REPLY, no_ack=True))
    close = c.rpc(2, commands.Basic.Consume(queue=REPLY, no_ack=True))
    assert close.reply_text == "PRECONDITION_FAILED - reply consumer already set"
    c.send(2, commands.Channel.CloseOk())
    # A publish asking for it on a channel without a reply consumer.
    c.channel(3)
    c.publish(3, "", "anything", b"x", props=commands.Basic.Properties(reply_to=REPLY))
    (close,) = [m for m in c.methods() if isinstance(m, commands.Channel.Close)]
    assert (close.reply_code, close.reply_text) == (
        406,
        "PRECONDITION_FAILED - fast reply consumer does not exist",
    )
    assert (close.class_id, close.method_id) == (60, 40)
    # A reply-to that merely starts like it is left alone.
    c.send(3, commands.Channel.CloseOk())
    c.channel(4)
    c.rpc(4, commands.Queue.Declare(queue="q"))
    other = commands.Basic.Properties(reply_to=REPLY + "x")
    c.publish(4, "", "q", b"y", props=other)
    ok = c.rpc(4, commands.Basic.Get(queue="q", no_ack=True))
    assert isinstance(ok, commands.Basic.GetOk)
    # The channel that failed took its reply queue with it; closing the connection takes
    # those of its open channels.
    assert [n for n in h.broker.vhosts["/"].queues if n.startswith(REPLY)] == []
    c.rpc(4, commands.Basic.Consume(queue=REPLY, no_ack=True))
    before = [n for n in h.broker.vhosts["/"].queues if n.startswith(REPLY)]
    assert len(before) == 1
    c.disconnect()
    assert [n for n in h.broker.vhosts["/"].queues if n.startswith(REPLY)] == []

"""Client input that once broke a replica (found by review): every case must end in the spec's
reply on the offending channel or connection, identically whether this replica owns the
connection (encodes output) or shadows it, and never raise out of ``Broker.apply``."""

from __future__ import annotations

import struct

import pytest
from pamqp import commands as C
from pamqp import header
from test_snapshot import assert_indistinguishable

from cpgbroker.model import snapshot as S
from cpgbroker.wire.framer import frame
from modelclient import Client, Harness


def _raw_publish(ch: int, exchange: str, rk: str, body: bytes) -> bytes:
    """A publish packed by hand: the name is not checked by any client library."""
    exb, rkb = exchange.encode(), rk.encode()
    p = struct.pack(">HHH", 60, 40, 0) + bytes([len(exb)]) + exb + bytes([len(rkb)]) + rkb + b"\0"
    from pamqp import frame as pf

    return (
        frame(1, ch, p)
        + pf.marshal(header.ContentHeader(0, len(body), C.Basic.Properties()), ch)
        + frame(3, ch, body)
    )


def _client(emit: bool) -> tuple[Harness, Client]:
    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    h.broker.set_emit(1, emit)
    return h, c


def test_non_ascii_name_at_the_255_byte_limit_gets_404_on_owner_and_shadow() -> None:
    digests = []
    for emit in (True, False):
        h, c = _client(emit)
        c.send_raw(_raw_publish(1, "é" * 127, "rk", b"x"))
        digests.append(S.digest(h.broker))
        if emit:
            close = [m for m in c.methods() if isinstance(m, C.Channel.Close)]
            assert close and close[0].reply_code == 404
            assert len(close[0].reply_text.encode()) <= 255
    assert digests[0] == digests[1]


def test_alternate_exchange_cycle_is_tried_once_and_the_message_dropped() -> None:
    h, c = _client(True)
    c.send(
        1,
        C.Exchange.Declare(
            exchange="a", exchange_type="fanout", arguments={"alternate-exchange": "b"}
        ),
    )
    c.send(
        1,
        C.Exchange.Declare(
            exchange="b", exchange_type="fanout", arguments={"alternate-exchange": "a"}
        ),
    )
    c.send(1, C.Queue.Declare(queue="q"))
    c.publish(1, "a", "k", b"unroutable")  # a -> b -> a: no queue anywhere
    c.send(1, C.Queue.Bind(queue="q", exchange="b"))
    c.publish(1, "a", "k", b"via-b")
    assert [m.message_count for m in c.methods() if isinstance(m, C.Queue.DeclareOk)] == [0]
    assert len(h.broker.vhosts["/"].queues["q"].messages) == 1


@pytest.mark.parametrize("reuse_tag", [False, True])
def test_deleting_a_queue_under_a_consumer_restores_exactly(reuse_tag: bool) -> None:
    """The consumer's unacked deliveries outlive it; a restored replica must not tie them to a
    later consumer that reuses the tag (it would charge that consumer's prefetch)."""
    h, c = _client(True)
    c.send(1, C.Basic.Qos(prefetch_count=1))
    c.send(1, C.Queue.Declare(queue="q"))
    c.send(1, C.Basic.Consume(queue="q", consumer_tag="t"))
    c.publish(1, "", "q", b"m1")
    c.send(1, C.Queue.Delete(queue="q"))
    if reuse_tag:
        c.send(1, C.Queue.Declare(queue="q2"))
        c.send(1, C.Basic.Consume(queue="q2", consumer_tag="t"))
    restored = S.restore(S.snapshot(h.broker))
    assert_indistinguishable(h.broker, restored)
    assert S.digest(restored) == S.digest(h.broker)

"""The broker's public seams: counting a failed event, the typed records of publishes in
progress and of transactions (and that snapshots still write them in format 2), and the
components the broker composes."""

from __future__ import annotations

from typing import Any

import pytest
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader

from cpgbroker.errors import InvariantError
from cpgbroker.model.broker import Broker
from cpgbroker.model.entities import PendingPublish, TxAck, TxNack, TxPublish
from cpgbroker.model.events import ClientData, Tick
from cpgbroker.model.state import snapshot as S
from modelclient import Client, Harness


def _open(h: Harness | None = None) -> tuple[Harness, Client]:
    h = h or Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    return h, c


def _conn_part(b: Broker) -> Any:
    return next(p for p in S.parts(b) if isinstance(p, list) and p[0] == "conn")


# ---------------------------------------------------------------------- count_failed_event


def test_a_failed_apply_counts_once() -> None:
    b = Broker()
    b.apply(Tick(5))
    assert b.event_seq == 1
    # apply counted event 1 already before it failed: counting it again changes nothing.
    b.count_failed_event(1)
    assert b.event_seq == 1


def test_an_event_that_failed_before_apply_counts_as_applied() -> None:
    b = Broker()
    b.apply(Tick(5))
    b.count_failed_event(2)
    assert b.event_seq == 2
    b.apply(Tick(6))
    assert b.event_seq == 3


@pytest.mark.parametrize("seq", [0, 3, 7, -1])
def test_counting_any_other_event_is_an_invariant_error(seq: int) -> None:
    b = Broker()
    b.apply(Tick(5))
    with pytest.raises(InvariantError):
        b.count_failed_event(seq)
    assert b.event_seq == 1


def test_a_counted_event_is_in_the_digest_like_an_applied_one() -> None:
    applied, failed = Broker(), Broker()
    applied.apply(Tick(0))  # changes nothing but the count
    failed.count_failed_event(1)
    assert S.digest(applied) == S.digest(failed)


# ---------------------------------------------------------------------- typed records


def test_a_publish_in_progress_is_a_typed_record_and_snapshots_in_format_2() -> None:
    h, c = _open()
    c.rpc(1, C.Queue.Declare(queue="q"))
    body = b"x" * 100
    data = c.publish_bytes(1, "", "q", body, mandatory=True, frame_max=60)
    # Everything but the last body frame (frames of 60 - 8 bytes: 52, then 48).
    cut = len(data) - (48 + 8)
    c.send_raw(data[:cut])
    pend = h.broker.connections[1].channels[1].pending
    assert isinstance(pend, PendingPublish)
    assert (pend.exchange, pend.routing_key, pend.mandatory) == ("", "q", True)
    assert pend.info is not None and pend.info.body_size == 100
    assert pend.remaining == 48 and pend.parts is not None and b"".join(pend.parts) == body[:52]
    header = bytes(pheader.ContentHeader(0, 100, C.Basic.Properties()).marshal())
    (chd,) = _conn_part(h.broker)[2]["channels"]
    assert chd["pending"] == ["", "q", True, header, 48, list(pend.parts)]
    restored = S.restore(S.snapshot(h.broker))
    rp = restored.connections[1].channels[1].pending
    assert rp is not None and rp.parts == pend.parts and rp.info is not None
    # Restored or not, the rest of the body completes the same message.
    restored.set_emit(1, True)
    restored.apply(ClientData(1, data[cut:]))
    c.send_raw(data[cut:])
    assert S.digest(restored) == S.digest(h.broker)
    assert [e.msg.body for e in h.broker.vhosts["/"].queues["q"].messages] == [body]


def test_a_single_frame_body_needs_no_parts_list() -> None:
    h, c = _open()
    c.rpc(1, C.Queue.Declare(queue="q"))
    data = c.publish_bytes(1, "", "q", b"abc")
    # Up to the content header: the body is still due.
    n1, _ch, _m = pframe.unmarshal(data)
    n2, _ch, _h = pframe.unmarshal(data[n1:])
    c.send_raw(data[: n1 + n2])
    pend = h.broker.connections[1].channels[1].pending
    assert pend is not None and pend.parts is None and pend.remaining == 3
    (chd,) = _conn_part(h.broker)[2]["channels"]
    assert chd["pending"][4:] == [3, []]
    c.send_raw(data[n1 + n2 :])
    assert h.broker.connections[1].channels[1].pending is None
    assert [e.msg.body for e in h.broker.vhosts["/"].queues["q"].messages] == [b"abc"]


def test_transaction_operations_are_typed_records_and_snapshot_in_format_2() -> None:
    h, c = _open()
    c.rpc(1, C.Queue.Declare(queue="q"))
    for body in (b"1", b"2", b"3"):
        c.publish(1, "", "q", body)
    c.rpc(1, C.Basic.Consume(queue="q", consumer_tag="t"))
    c.recv()
    c.rpc(1, C.Tx.Select())
    c.publish(1, "", "q", b"tx", mandatory=True)
    c.send(1, C.Basic.Ack(delivery_tag=1))
    c.send(1, C.Basic.Nack(delivery_tag=2, multiple=False, requeue=True))
    c.send(1, C.Basic.Reject(delivery_tag=3, requeue=False))
    ops = h.broker.connections[1].channels[1].tx_ops
    assert [type(op) for op in ops] == [TxPublish, TxAck, TxNack, TxNack]
    pub, ack, nack, reject = ops
    assert isinstance(pub, TxPublish) and pub.mandatory and pub.msg.body == b"tx"
    assert isinstance(ack, TxAck) and (ack.tag, ack.multiple) == (1, False)
    assert isinstance(nack, TxNack) and (nack.tag, nack.multiple, nack.requeue) == (2, False, True)
    assert isinstance(reject, TxNack) and (reject.tag, reject.multiple, reject.requeue) == (
        3,
        False,
        False,
    )
    (chd,) = _conn_part(h.broker)[2]["channels"]
    msg = pub.msg
    assert chd["tx_ops"] == [
        [
            "publish",
            [msg.id, "", "q", msg.header, b"tx", msg.delivery_mode, None],
            True,
        ],
        ["ack", 1, False],
        ["nack", 2, False, True],
        ["nack", 3, False, False],
    ]
    restored = S.restore(S.snapshot(h.broker))
    assert [type(op) for op in restored.connections[1].channels[1].tx_ops] == [
        TxPublish,
        TxAck,
        TxNack,
        TxNack,
    ]
    assert S.digest(restored) == S.digest(h.broker)
    # Commit on both: the same state.
    restored.set_emit(1, True)
    commit = pframe.marshal(C.Tx.Commit(), 1)
    restored.apply(ClientData(1, commit))
    assert isinstance(c.rpc(1, C.Tx.Commit()), C.Tx.CommitOk)
    assert S.digest(restored) == S.digest(h.broker)


def test_an_unknown_tx_operation_in_a_snapshot_is_refused() -> None:
    h, c = _open()
    c.rpc(1, C.Tx.Select())
    c.publish(1, "", "nowhere", b"x")
    parts = S.snapshot(h.broker)
    conn = next(p for p in parts if isinstance(p, list) and p[0] == "conn")
    conn[2]["channels"][0]["tx_ops"][0][0] = "bogus"
    with pytest.raises(InvariantError, match="unknown tx operation"):
        S.restore(parts)


# ---------------------------------------------------------------------- composition


def test_components_share_one_view_of_the_state() -> None:
    b = Broker()
    # The dicts the readers were given are the ones their owners write.
    assert b.vhosts is b.topology.vhosts
    assert b.connections is b.protocol.connections
    h, c = _open(Harness(b))
    c.rpc(1, C.Queue.Declare(queue="q", arguments={"x-message-ttl": 10}))
    c.publish(1, "", "q", b"m")
    assert list(b.topology.ttl_queues) == [("/", "q")]
    assert (b.msg_seq, b.queued_bytes) == (b.delivery.msg_seq, b.mark.queued_bytes) == (1, 1)
    h.tick(100)
    assert b.now_ms == b.clock.now_ms == 100
    assert not b.vhosts["/"].queues["q"].messages and not b.topology.ttl_queues


def test_restoring_counters_goes_through_the_public_surface() -> None:
    b = Broker()
    b.restore_counters(
        now_ms=7,
        event_seq=3,
        msg_seq=9,
        queued_bytes=11,
        blocked=True,
        memory_blocked=False,
        disk_alarms=[5],
    )
    assert (b.now_ms, b.event_seq, b.msg_seq, b.queued_bytes, b.blocked) == (7, 3, 9, 11, True)
    assert not b.mark.memory_blocked and list(b.mark.disk_alarms) == [5]

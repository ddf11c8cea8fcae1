"""Runtime components of a member on their own: the confirm gate (held output released in
order once stable), the event log with injected faults, and the standalone sequencer."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from cpgbroker.errors import ClusterError
from cpgbroker.model.events import CONFIRM, CONFIRM_DURABLE, ClientData, Send
from cpgbroker.runtime.amqp.confirms import ConfirmGate
from cpgbroker.runtime.amqp.server import AmqpServer, LocalConn
from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.runtime.member.eventlog import EventLog


class FakeStream:
    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock


class Out:
    """The node's side of a release: records writes and closes."""

    def __init__(self) -> None:
        self.local: dict[int, LocalConn] = {}
        self.done: list[tuple[int, object]] = []

    def write(self, lc: LocalConn, data: bytes) -> None:
        self.done.append((lc.id, data))

    def begin_close(self, lc: LocalConn, reason: str) -> None:
        self.done.append((lc.id, ("close", reason)))


@pytest.fixture
def conn() -> Iterator[LocalConn]:
    a, b = socket.socketpair()
    yield LocalConn(7, FakeStream(a), "x:1")  # type: ignore[arg-type]
    a.close()
    b.close()


def test_the_gate_releases_in_order_up_to_the_stable_event(conn: LocalConn) -> None:
    seq = [10]
    gate = ConfirmGate(lambda: seq[0])
    out = Out()
    out.local[conn.id] = conn
    gate.hold(conn, Send(conn.id, b"ack-10", True))
    seq[0] = 11
    gate.hold(conn, Send(conn.id, b"plain", False))  # behind the confirm, whatever it is
    gate.hold(conn, Send(conn.id, b"ack-11", True))
    gate.hold_close(conn, "closed")
    assert [s for s, _d, _r, _p in conn.held] == [10, 0, 11, 0]
    gate.release(9, out)
    assert out.done == [] and gate.holding
    gate.release(10, out)
    assert out.done == [(7, b"ack-10"), (7, b"plain")]
    gate.release(11, out)
    assert out.done[2:] == [(7, b"ack-11"), (7, ("close", "closed"))]
    assert not gate.holding and conn.held == []


def test_a_durable_confirm_waits_for_every_store_and_holds_what_follows(
    conn: LocalConn,
) -> None:
    seq = [10]
    gate = ConfirmGate(lambda: seq[0])
    out = Out()
    out.local[conn.id] = conn
    gate.hold(conn, Send(conn.id, b"ack-10", CONFIRM_DURABLE))
    seq[0] = 11
    gate.hold(conn, Send(conn.id, b"ack-11", CONFIRM))
    gate.release(11, out, durable=9)  # applied everywhere, not yet on every disk
    assert out.done == []
    gate.release(11, out, durable=10)
    assert out.done == [(7, b"ack-10"), (7, b"ack-11")]
    assert not gate.holding


def test_the_gate_forgets_gone_clients_and_drops_everything_on_suspension(
    conn: LocalConn,
) -> None:
    gate = ConfirmGate(lambda: 5)
    out = Out()
    gate.hold(conn, Send(conn.id, b"ack", True))
    gate.release(5, out)
    assert out.done == [] and not gate.holding, "not local any more: never written"
    out.local[conn.id] = conn
    gate.hold(conn, Send(conn.id, b"ack", True))
    gate.drop()
    assert conn.held == [] and not gate.holding


def test_event_log_records_and_reports_a_full_disk(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path / "e.jsonl"), member=3, incarnation=2)
    assert log.record(1, ClientData(9, b"abc"), 3, 3) is None
    assert log.inject("disk-full", 0, next_seq=2) == {"kind": "disk-full", "at_seq": 2}
    err = log.record(2, ClientData(9, b"d"), 3, 1)
    assert err is not None and "No space" in str(err)
    log.give_up()
    assert log.file is None and log.failed is None and not log.faults
    (rec,) = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert rec["seq"] == 1 and rec["type"] == "data" and rec["size"] == 3
    assert (rec["member"], rec["incarnation"], rec["conn"]) == (3, 2, 9)


def test_an_apply_fault_fires_once() -> None:
    log = EventLog("", member=1, incarnation=1)
    with pytest.raises(ClusterError, match="no \\[cluster\\] event_log"):
        log.inject("disk-full", 5, next_seq=1)
    log.inject("apply-error", 5, next_seq=1)
    assert not log.take_fault("apply-error", 4)
    assert log.take_fault("apply-error", 6) and not log.take_fault("apply-error", 7)


async def test_standalone_node_applies_at_once_and_counts_no_reads_in_flight() -> None:
    node = AmqpServer(ServerConfig())
    assert node.standalone is not None
    broker = node.standalone.broker
    seq = broker.event_seq
    await node.submit(ClientData(12345, b"x"))  # an unknown connection: applied, ignored
    assert broker.event_seq == seq + 1
    assert node.status()["event_seq"] == seq + 1
    await trio.lowlevel.checkpoint()

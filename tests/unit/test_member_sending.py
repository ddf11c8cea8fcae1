"""How a member turns its clients' input and its progress reports into CPG messages: at once
while nothing of its own is in flight, batched while its messages are in flight, and a report
for another member's confirm riding on the consumer's ack rather than going alone. Real
``ClusterNode``s on the in-memory total-order bus."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from pamqp import commands

from cpgbroker.cluster import codec
from cpgbroker.cluster import progress as progress_mod
from cpgbroker.corosync.events import Deliver
from cpgbroker.model.events import ClientData, DoOutput
from cpgbroker.runtime.member import member as member_mod
from nodeharness import (
    Client,
    acks,
    close_sockets,
    open_confirm_channel,
    publish_bytes,
    start,
    until,
)

_close_sockets = close_sockets


def record(cpgs: list[Any], nodeid: int) -> list[list[Any]]:
    """The events of every CPG message ``nodeid`` multicasts from now on, one list each."""
    bus = cpgs[0].bus
    sent: list[list[Any]] = []
    post = bus.post

    def recording(ev: Any) -> None:
        if type(ev) is Deliver and ev.nodeid == nodeid:
            sent.append(codec.decode_batch(ev.data, member_mod.member_id(nodeid, 1000)))
        post(ev)

    bus.post = recording
    return sent


async def consumer(node: Any) -> Client:
    c = await open_confirm_channel(node)
    await c.send(1, commands.Basic.Consume(queue="q", consumer_tag="c1"))
    await node.submit(DoOutput(c.lc.id, 100))  # the writer task's grant (not run here)
    await until(lambda: any(isinstance(m, commands.Basic.ConsumeOk) for m in c.methods()))
    return c


def delivered(c: Client) -> list[Any]:
    return [m for m in c.methods() if isinstance(m, commands.Basic.Deliver)]


async def publish_to_consumer(nursery: trio.Nursery) -> tuple[Any, Client, Client, list[Any]]:
    """Publisher with confirms on member 1, consumer on member 2, one message published: member
    2, what member 2 multicast since before the publish, and the two clients."""
    (a, b, _c), cpgs = await start(nursery, 3)
    publisher = await open_confirm_channel(a)
    cons = await consumer(b)
    sent = record(cpgs, 2)
    await a.submit(ClientData(publisher.lc.id, publish_bytes(b"m1")))
    await until(lambda: len(delivered(cons)) == 1)
    return b, publisher, cons, sent


async def test_input_goes_out_at_once_when_idle_and_is_batched_while_in_flight() -> None:
    async with trio.open_nursery() as nursery:
        (a, _b, _c), cpgs = await start(nursery, 3)
        client = await open_confirm_channel(a)
        sent = record(cpgs, 1)
        # Nothing of member 1's in flight: the publish is multicast before submit returns,
        # without waiting for the sender task.
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        assert len(sent) == 1 and [type(e) for e in sent[0]] == [ClientData]
        # Messages in flight (under load): input waits and leaves as one CPG message.
        cpgs[0].idle = False
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m2")))
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m3")))
        assert len(sent) == 1, "queued for the sender, not multicast one by one"
        await until(lambda: len(sent) == 2)
        assert [type(e) for e in sent[1]] == [ClientData, ClientData]
        await until(lambda: len(acks(client)) == 3)
        assert len(a.broker.vhosts["/"].queues["q"].messages) == 3
        nursery.cancel_scope.cancel()


async def test_the_consumers_member_reports_on_its_ack(monkeypatch: pytest.MonkeyPatch) -> None:
    # Long enough that only the ack can carry the report within this test.
    monkeypatch.setattr(progress_mod, "REPORT_RIDE_WAIT", 30.0)
    async with trio.open_nursery() as nursery:
        b, publisher, cons, sent = await publish_to_consumer(nursery)
        await trio.sleep(0.05)
        # Member 2 handed its client a delivery: its report waits for the client's answer.
        assert acks(publisher) == [], "the confirm waits for member 2's report"
        assert sent == []
        await cons.send(1, commands.Basic.Ack(delivery_tag=1))
        await until(lambda: len(acks(publisher)) == 1)
        assert len(sent) == 1, "one CPG message: the ack with the report"
        assert [type(e) for e in sent[0]] == [ClientData, codec.Progress]
        assert len(b.broker.vhosts["/"].queues["q"].messages) == 0
        nursery.cancel_scope.cancel()


async def test_a_report_goes_alone_when_no_answer_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_mod, "REPORT_RIDE_WAIT", 0.2)
    async with trio.open_nursery() as nursery:
        _b, publisher, _cons, sent = await publish_to_consumer(nursery)
        t0 = trio.current_time()  # just after the delivery, when member 2 began to wait
        # The consumer never acks: after the ride wait the report leaves on its own, and the
        # publisher gets its confirm.
        await until(lambda: len(acks(publisher)) == 1)
        assert trio.current_time() - t0 >= 0.15
        assert [[type(e) for e in m] for m in sent] == [[codec.Progress]]
        nursery.cancel_scope.cancel()


async def test_a_member_without_clients_reports_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_mod, "REPORT_RIDE_WAIT", 30.0)
    async with trio.open_nursery() as nursery:
        (a, _b, _c), cpgs = await start(nursery, 3)
        publisher = await open_confirm_channel(a)
        sent = record(cpgs, 3)
        await a.submit(ClientData(publisher.lc.id, publish_bytes(b"m1")))
        # No local client of member 3 got output: nothing to wait for. (Member 2 has none
        # either: both report at once, and the confirm follows.)
        await until(lambda: len(acks(publisher)) == 1)
        assert [[type(e) for e in m] for m in sent] == [[codec.Progress]]
        nursery.cancel_scope.cancel()

"""Publisher confirms and tx.commit-ok wait until their event is stable (applied by every ready
member), in real ``ClusterNode``s on an in-memory total-order bus whose delivery to
each member can be held back: an event delivered on one side of a partition only must never be
confirmed to a client there. Output after a held confirm keeps its order behind it."""

from __future__ import annotations

import trio
from pamqp import commands

from cpgbroker.model.events import ClientData, Send
from modelclient import Harness
from nodeharness import acks, close_sockets, open_confirm_channel, publish_bytes, start, until

_close_sockets = close_sockets


async def test_confirm_waits_for_every_member_and_keeps_the_connection_order() -> None:
    async with trio.open_nursery() as nursery:
        (a, b, _c), cpgs = await start(nursery, 3)
        client = await open_confirm_channel(a)
        # The two other members do not get the publish (as on the far side of a partition).
        cpgs[1].paused = cpgs[2].paused = True
        seq = a.broker.event_seq
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        # Output without a confirm, after it: must not overtake the held ack.
        await client.send(2, commands.Channel.Open())
        await until(lambda: a.broker.event_seq == seq + 2)
        await trio.sleep(0.05)
        assert a.broker.vhosts["/"].queues["q"].messages, "applied on this member"
        assert acks(client) == []
        assert not any(isinstance(m, commands.Channel.OpenOk) for m in client.methods()[-1:])
        assert [s for s, _d, _r, _p in client.lc.held] == [seq + 1, 0]
        # One member of the two others applies it: a majority, not yet every member. (A
        # majority survives a partition, not the crash of the two members that have it.)
        cpgs[1].resume()
        await until(lambda: b.broker.event_seq >= seq + 1)
        await trio.sleep(0.05)
        assert acks(client) == []
        cpgs[2].resume()
        await until(lambda: bool(acks(client)))
        tail = client.methods()[-2:]
        assert isinstance(tail[0], commands.Basic.Ack) and tail[0].delivery_tag == 1
        assert isinstance(tail[1], commands.Channel.OpenOk)
        assert client.lc.held == [] and not a.confirms.holding
        assert b.broker.event_seq >= seq + 1
        nursery.cancel_scope.cancel()


async def test_held_confirm_is_dropped_on_suspend() -> None:
    async with trio.open_nursery() as nursery:
        (a, _b, _c), cpgs = await start(nursery, 3)
        client = await open_confirm_channel(a)
        cpgs[1].paused = cpgs[2].paused = True
        seq = a.broker.event_seq
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        await until(lambda: a.broker.event_seq == seq + 1)
        assert client.lc.held
        a.suspend("test: quorum lost")
        cpgs[1].resume()
        cpgs[2].resume()
        await trio.sleep(0.1)
        ms = client.methods()
        assert acks(client) == []
        assert isinstance(ms[-1], commands.Connection.Close) and ms[-1].reply_code == 320
        assert client.lc.held == [] and not a.confirms.holding
        nursery.cancel_scope.cancel()


async def test_tx_commit_ok_waits_too() -> None:
    async with trio.open_nursery() as nursery:
        (a, _b), cpgs = await start(nursery, 2)
        client = await open_confirm_channel(a, tx=True)
        cpgs[1].paused = True  # of two members, both must have it
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        await client.send(1, commands.Tx.Commit())
        await trio.sleep(0.05)
        assert not any(isinstance(m, commands.Tx.CommitOk) for m in client.methods())
        cpgs[1].resume()
        await until(lambda: any(isinstance(m, commands.Tx.CommitOk) for m in client.methods()))
        nursery.cancel_scope.cancel()


async def test_a_single_member_confirms_at_once_and_plain_output_is_never_held() -> None:
    async with trio.open_nursery() as nursery:
        (a,), _cpgs = await start(nursery, 1)
        client = await open_confirm_channel(a)
        assert client.lc.held == []
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        await until(lambda: bool(acks(client)))
        assert not a.confirms.holding
        nursery.cancel_scope.cancel()


def test_model_marks_confirm_output_and_counts_shadow_confirms() -> None:
    h = Harness()
    own = h.connect(1)
    own.handshake()
    own.channel(1)
    own.rpc(1, commands.Confirm.Select())
    own.rpc(1, commands.Queue.Declare(queue="q"))
    shadow = h.connect(2)
    shadow.handshake()
    shadow.channel(1)
    shadow.rpc(1, commands.Tx.Select())
    h.broker.set_emit(2, False)
    n = h.broker.shadow_confirms
    h.effects.clear()
    own.publish(1, "", "q", b"x")
    sends = [e for e in h.effects if isinstance(e, Send)]
    assert [s.confirm for s in sends] == [True]
    assert h.broker.shadow_confirms == n, "our own client's confirm: we need no report"
    h.effects.clear()
    own.rpc(1, commands.Queue.Declare(queue="q"))  # plain output: not marked
    assert [s.confirm for s in h.effects if isinstance(s, Send)] == [False]
    shadow.send(1, commands.Tx.Commit())  # a shadow emits no bytes, but the count moves
    assert h.broker.shadow_confirms == n + 1

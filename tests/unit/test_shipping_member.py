"""Hot standby shipping changes (runtime/replication/shipping.py) in real ``ClusterNode``s on the
in-memory total-order bus: the primary's clients are served by its own broker, backups apply its
change batches, a confirm waits until every backup applied the batch that carries it, and when the
primary goes the next member serves what the backups hold."""

from __future__ import annotations

import pytest
import trio
from pamqp import commands

from cpgbroker.cluster import codec
from cpgbroker.corosync.events import ConfChg, Deliver, Member, MemberChange, Reason
from cpgbroker.errors import InvariantError
from cpgbroker.model.events import ClientData, DoOutput, Tick
from cpgbroker.model.shipping import messages
from cpgbroker.model.standby.replica import Replication
from cpgbroker.model.state import snapshot
from cpgbroker.runtime.replication import shipping as shipping_module
from fakecpg import Bus
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

CHANGES = {"mode": "hot-standby", "replication": "changes"}


async def test_backups_apply_batches_and_a_confirm_waits_for_all_of_them() -> None:
    async with trio.open_nursery() as nursery:
        (a, b, c), cpgs = await start(nursery, 3, **CHANGES)
        assert a.replication.shipping is not None and a.replication.shipping.active
        assert b.replication.shipping is not None and not b.replication.shipping.active
        client = await open_confirm_channel(a)
        # The backups' brokers hold no connection: only what the primary changed.
        await until(lambda: "q" in b.broker.vhosts["/"].queues)
        assert not b.broker.connections and not a.broker.connections
        assert len(a.replication.shipping.broker.connections) == 1  # type: ignore[union-attr]
        cpgs[2].paused = True  # one backup does not get the batch yet
        await a.submit(ClientData(client.lc.id, publish_bytes(b"m1")))
        await until(lambda: messages(b.broker) == 1)
        await trio.sleep(0.05)
        assert acks(client) == [], "a confirm waits for every backup"
        cpgs[2].resume()
        await until(lambda: len(acks(client)) == 1)
        assert messages(c.broker) == 1
        # Every member's stream broker is the same, the primary's too.
        await until(lambda: a.broker.event_seq == b.broker.event_seq == c.broker.event_seq)
        digests = {snapshot.digest(n.broker) for n in (a, b, c)}
        assert len(digests) == 1
        nursery.cancel_scope.cancel()


async def test_the_next_member_serves_what_the_backups_hold_when_the_primary_goes() -> None:
    async with trio.open_nursery() as nursery:
        (a, b, c), cpgs = await start(nursery, 3, **CHANGES)
        client = await open_confirm_channel(a)
        for i in range(5):
            await a.submit(ClientData(client.lc.id, publish_bytes(b"m%d" % i)))
        await until(lambda: len(acks(client)) == 5)
        # A consumer with a prefetch of 2 acks its first: m1 and m2 are out with it when the
        # primary dies.
        await client.send(1, commands.Basic.Qos(prefetch_count=2))
        await client.send(1, commands.Basic.Consume(queue="q"))
        await a.submit(DoOutput(client.lc.id, 100))
        await until(lambda: delivered(client) == 2)
        await client.send(1, commands.Basic.Ack(delivery_tag=1))
        await until(lambda: delivered(client) == 3)
        await until(lambda: messages(b.broker) == 4 and messages(c.broker) == 4)
        # The primary's process dies.
        bus = cpgs[0].bus
        bus.subs.remove(cpgs[0])
        bus.post(
            ConfChg(
                b"g",
                tuple(Member(x.local_nodeid, 1000) for x in bus.subs),
                (MemberChange(1, 1000, Reason.PROCDOWN),),
                (),
            )
        )
        await until(lambda: b.replication.shipping is not None and b.replication.shipping.active)
        assert c.replication.shipping is not None and not c.replication.shipping.active
        served = b.replication.shipping.broker
        assert served is not None
        work = served.vhosts["/"].queues["q"]
        # What the consumer held comes back redelivered; what it acked is gone. m3 and m4 come
        # flagged too: the consumer's first delivery (of a message shipped earlier) reserved
        # them (model/changes.py, "Reservations"): the old primary might have delivered them.
        assert [(e.msg.body, e.redelivered) for e in work.messages] == [
            (b"m1", True),
            (b"m2", True),
            (b"m3", True),
            (b"m4", True),
        ]
        # The new primary serves clients and ships to the remaining backup.
        client2 = await open_confirm_channel(b)
        await b.submit(ClientData(client2.lc.id, publish_bytes(b"after")))
        await until(lambda: len(acks(client2)) == 1)
        assert messages(c.broker) == 5
        nursery.cancel_scope.cancel()


async def test_a_batch_gathers_while_ours_is_in_flight_and_what_was_acked_meanwhile_stays() -> None:
    async with trio.open_nursery() as nursery:
        (a, b, c), cpgs = await start(nursery, 3, **CHANGES)
        assert a.replication.shipping is not None
        client = await open_confirm_channel(a)
        # On a connection of its own: a connection's output waits behind its held confirms.
        consumer = await open_confirm_channel(a)
        await consumer.send(1, commands.Basic.Consume(queue="q"))
        await a.submit(DoOutput(consumer.lc.id, 100))
        await until(lambda: a.replication.shipping.shipped == a.replication.shipping.delivered)  # type: ignore[union-attr]
        # Every CPG message the primary multicasts from here on.
        bus = cpgs[0].bus
        sent: list[bytes] = []

        def post(ev: object) -> None:
            if isinstance(ev, Deliver) and ev.nodeid == cpgs[0].local_nodeid:
                sent.append(ev.data)
            Bus.post(bus, ev)

        bus.post = post  # type: ignore[method-assign]
        cpgs[0].paused = True  # the primary's own batches are not delivered back to it yet
        shipped = a.replication.shipping.shipped
        await a.submit(ClientData(client.lc.id, publish_bytes(b"first")))
        await until(lambda: a.replication.shipping.shipped == shipped + 1)  # type: ignore[union-attr]
        # While that batch is in flight the next one gathers: this message is published,
        # delivered and acked before it is cut.
        body = b"s" * 5000
        await a.submit(ClientData(client.lc.id, publish_bytes(body)))
        await until(lambda: delivered(consumer) == 2)
        await consumer.send(1, commands.Basic.Ack(delivery_tag=2, multiple=True))
        await trio.sleep(0.05)
        assert a.replication.shipping.shipped == shipped + 1
        assert acks(client) == [], "no confirm before its batch is delivered everywhere"
        cpgs[0].resume()
        await until(lambda: len(acks(client)) == 2)
        assert a.replication.shipping.shipped == shipped + 2
        assert a.replication.shipping.elided == 1
        assert not any(body in data for data in sent), "the acked message crossed the ring"
        assert any(b"first" in data for data in sent)
        await until(lambda: a.broker.event_seq == b.broker.event_seq == c.broker.event_seq)
        assert messages(b.broker) == messages(c.broker) == 0
        assert len({snapshot.digest(n.broker) for n in (a, b, c)}) == 1
        nursery.cancel_scope.cancel()


async def test_a_message_shipped_earlier_reaches_its_consumer_once_its_delivery_is_stable() -> None:
    """A delivery of a message that joined its queue in an earlier batch waits until the batch
    recording the delivery is stable: until then a member promoted after the primary could hold
    the message but not its delivery, and hand it out again unflagged. A message published and
    delivered in one batch goes out at once (a member lacking that batch never held it)."""
    async with trio.open_nursery() as nursery:
        (a, b, _c), cpgs = await start(nursery, 3, **CHANGES)
        shipping = a.replication.shipping
        assert shipping is not None
        client = await open_confirm_channel(a)
        # A quorum queue: its messages are never reserved ahead (model/changes.py).
        await client.send(
            1,
            commands.Queue.Declare(queue="qq", durable=True, arguments={"x-queue-type": "quorum"}),
        )
        await until(
            lambda: sum(isinstance(m, commands.Queue.DeclareOk) for m in client.methods()) == 2
        )
        await a.submit(ClientData(client.lc.id, publish_bytes(b"waiting", "qq")))
        await until(lambda: len(acks(client)) == 1 and messages(b.broker) == 1)
        cpgs[0].paused = True  # the primary's own batches are not delivered back to it yet
        consumer = await open_confirm_channel(a)
        await consumer.send(1, commands.Basic.Consume(queue="qq"))
        await a.submit(DoOutput(consumer.lc.id, 100))
        await trio.sleep(0.1)
        assert delivered(consumer) == 0, "delivered before a backup knows of the delivery"
        # Behind it on the same connection, though delivered at once to the model.
        await a.submit(ClientData(client.lc.id, publish_bytes(b"fresh", "qq")))
        await trio.sleep(0.05)
        assert delivered(consumer) == 0
        cpgs[0].resume()
        await until(lambda: delivered(consumer) == 2)
        # The backups keep the delivered message in place, flagged as a redelivery would be,
        # with the delivery counted.
        await until(lambda: b.broker.event_seq == a.broker.event_seq)
        q = b.broker.vhosts["/"].queues["qq"]
        kept = list(b.broker.replication.in_order(q))
        assert [(e.redelivered, e.delivery_count) for e in kept] == [(True, 1), (True, 1)]
        # On a connection of its own: a message published and delivered in one batch goes out
        # while that batch is still in flight.
        other = await open_confirm_channel(a)
        await other.send(1, commands.Queue.Declare(queue="q2"))
        await until(
            lambda: sum(isinstance(m, commands.Queue.DeclareOk) for m in other.methods()) == 2
        )
        await other.send(1, commands.Basic.Consume(queue="q2"))
        await a.submit(DoOutput(other.lc.id, 100))
        await until(lambda: shipping.shipped == shipping.delivered)
        cpgs[0].paused = True
        await a.submit(ClientData(client.lc.id, publish_bytes(b"hot", "q2")))
        await until(lambda: delivered(other) == 1)
        assert shipping.shipped - shipping.delivered <= 1
        cpgs[0].resume()
        nursery.cancel_scope.cancel()


async def test_a_backed_up_queue_reserves_what_follows_and_delivers_it_at_once_once_stable() -> (
    None
):
    """A waiting delivery reserves the messages behind it: the backups flag them redelivered
    while they are still queued, and once that batch is stable they go out at once, even while
    the primary's batches are not coming back."""
    async with trio.open_nursery() as nursery:
        (a, b, _c), cpgs = await start(nursery, 3, **CHANGES)
        shipping = a.replication.shipping
        assert shipping is not None
        client = await open_confirm_channel(a)
        for i in range(10):
            await a.submit(ClientData(client.lc.id, publish_bytes(b"m%d" % i)))
        await until(lambda: len(acks(client)) == 10 and messages(b.broker) == 10)
        consumer = await open_confirm_channel(a)
        await consumer.send(1, commands.Basic.Qos(prefetch_count=2))
        await consumer.send(1, commands.Basic.Consume(queue="q"))
        await a.submit(DoOutput(consumer.lc.id, 100))
        await until(lambda: delivered(consumer) == 2)
        await until(lambda: shipping.shipped == shipping.stable)
        q = b.broker.vhosts["/"].queues["q"]
        assert [e.redelivered for e in b.broker.replication.in_order(q)] == [True] * 10
        cpgs[0].paused = True  # nothing of ours comes back from here on
        await consumer.send(1, commands.Basic.Ack(delivery_tag=2, multiple=True))
        await until(lambda: delivered(consumer) == 4)
        await consumer.send(1, commands.Basic.Ack(delivery_tag=4, multiple=True))
        await until(lambda: delivered(consumer) == 6)
        cpgs[0].resume()
        nursery.cancel_scope.cancel()


async def test_a_member_catching_up_from_an_update_from_the_back_does_not_vouch_yet() -> None:
    """An update from the back leaves out what consumers took while it was sent, which the
    others still hold at a checkpoint until the newcomer's replay reaches those takes: the
    newcomer's digest there would differ (and it would be voted out), so it takes no
    checkpoint until it has caught up."""
    async with trio.open_nursery() as nursery:
        (a, _b, c), cpgs = await start(nursery, 3, checkpoint_every=4, **CHANGES)
        bus = cpgs[0].bus
        votes: list[tuple[int, int]] = []

        def post(ev: object) -> None:
            if isinstance(ev, Deliver):
                for e in codec.decode_batch(ev.data, ev.nodeid):
                    if isinstance(e, codec.Checkpoint):
                        votes.append((e.member, e.seq))
            Bus.post(bus, ev)

        bus.post = post  # type: ignore[method-assign]
        client = await open_confirm_channel(a)

        async def publish(n: int) -> None:
            # One at a time: a batch (a stream event) each.
            for _ in range(n):
                want = len(acks(client)) + 1
                await a.submit(ClientData(client.lc.id, publish_bytes(b"m")))
                await until(lambda want=want: len(acks(client)) == want)

        c.broker.replication.catching_up = True
        await publish(10)
        seen = {seq for _m, seq in votes}
        assert seen and all(m != c.member for m, _seq in votes), votes
        c.broker.replication.catching_up = False
        await publish(10)
        assert any(m == c.member and seq not in seen for m, seq in votes), votes
        nursery.cancel_scope.cancel()


async def test_output_waiting_for_a_batch_without_records_still_waits_for_ours_in_flight() -> None:
    """Confirms of publishes that change nothing a backup holds (unroutable ones here, or to
    an exclusive queue) still wait for a batch; while ours is in flight it gathers them."""
    async with trio.open_nursery() as nursery:
        (a, _b, _c), cpgs = await start(nursery, 3, **CHANGES)
        shipping = a.replication.shipping
        assert shipping is not None
        client = await open_confirm_channel(a)
        await until(lambda: shipping.shipped == shipping.delivered)
        cpgs[0].paused = True  # our batches are not delivered back to us yet
        await a.submit(ClientData(client.lc.id, publish_bytes(b"first")))
        await until(lambda: shipping.shipped - shipping.delivered == 1)
        for i in range(10):
            await a.submit(ClientData(client.lc.id, publish_bytes(b"u%d" % i, "nowhere")))
            await trio.sleep(0.01)
        assert shipping.shipped - shipping.delivered == 1
        cpgs[0].resume()
        await until(lambda: len(acks(client)) == 11)
        nursery.cancel_scope.cancel()


async def test_a_batch_nobody_waits_for_lingers_and_what_was_consumed_meanwhile_never_ships(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shipping_module, "LINGER", 1.0)
    async with trio.open_nursery() as nursery:
        (a, b, _c), _cpgs = await start(nursery, 3, **CHANGES)
        shipping = a.replication.shipping
        assert shipping is not None
        # Publisher and consumer without confirms: nobody waits for their batches.
        publisher = await open_confirm_channel(a, confirms=False)
        consumer = await open_confirm_channel(a, confirms=False)
        await consumer.send(1, commands.Basic.Consume(queue="q", consumer_tag="c"))
        await a.submit(DoOutput(consumer.lc.id, 100))

        def settled() -> bool:
            """Every batch cut and back, and nothing left to cut."""
            changes = shipping.broker.changes  # type: ignore[union-attr]
            assert changes is not None
            return shipping.shipped == shipping.delivered and not (
                changes.records or changes.structural
            )

        await until(settled)
        shipped = shipping.shipped
        started = trio.current_time()
        for i in range(3):
            await a.submit(ClientData(publisher.lc.id, publish_bytes(b"m%d" % i)))
        await until(lambda: delivered(consumer) == 3)
        await consumer.send(1, commands.Basic.Ack(delivery_tag=3, multiple=True))
        assert trio.current_time() - started < 1.0
        await trio.sleep(2.0)
        assert shipping.shipped == shipped, "a batch of nothing but what was consumed went out"
        assert shipping.elided == 3
        # Messages nobody consumes ship once their batch lingered: one batch for them all.
        await consumer.send(1, commands.Basic.Cancel(consumer_tag="c"))
        await until(settled)
        shipped = shipping.shipped
        started = trio.current_time()
        for i in range(3):
            await a.submit(ClientData(publisher.lc.id, publish_bytes(b"k%d" % i)))
        await until(lambda: messages(b.broker) == 3)
        assert trio.current_time() - started >= 1.0
        assert shipping.shipped == shipped + 1
        # A publish whose confirm waits is cut at once.
        confirmed = await open_confirm_channel(a)
        started = trio.current_time()
        await a.submit(ClientData(confirmed.lc.id, publish_bytes(b"c")))
        await until(lambda: len(acks(confirmed)) == 1)
        assert trio.current_time() - started < 1.0
        nursery.cancel_scope.cancel()


async def test_a_primary_whose_batch_fails_on_every_member_leaves_unconfirmed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch that every member fails alike (a bug: the cluster goes on without it) leaves
    the primary's serving broker holding what no replica holds: what it would confirm must
    not be confirmed, and the primary must give way rather than stop cutting batches."""
    apply = Replication.apply

    def failing(self: Replication, batch: bytes) -> None:
        if b"poison" in batch:
            raise InvariantError("a batch that does not apply")
        apply(self, batch)

    monkeypatch.setattr(Replication, "apply", failing)
    async with trio.open_nursery() as nursery:
        (a, b, c), _cpgs = await start(nursery, 3, **CHANGES)
        client = await open_confirm_channel(a)
        await a.submit(ClientData(client.lc.id, publish_bytes(b"first")))
        await until(lambda: len(acks(client)) == 1)
        await a.submit(ClientData(client.lc.id, publish_bytes(b"poison")))
        await until(lambda: a.failure is not None)
        # Until its process ends the incarnation, nothing more is confirmed either: not by a
        # later batch, nor by one cut for the output held (a tick's).
        await a.replication.shipping.submit(Tick(a.io.now_ms()))  # type: ignore[union-attr]
        await trio.sleep(0.2)
        assert len(acks(client)) == 1, "a message in a batch no member took was confirmed"
        await a.submit(ClientData(client.lc.id, publish_bytes(b"after")))
        await trio.sleep(0.2)
        assert len(acks(client)) == 1, "a message in a batch no member took was confirmed"
        # The backups went on without it, alike.
        assert b.failure is None and c.failure is None
        assert messages(b.broker) == messages(c.broker) == 1
        nursery.cancel_scope.cancel()


async def test_operators_changes_go_through_the_primary_and_ship() -> None:
    async with trio.open_nursery() as nursery:
        (a, b, _c), _cpgs = await start(nursery, 3, **CHANGES)
        status, _ = await a.desk.request("", "put_vhost", {"name": "v2"}, 5)
        assert status in (200, 201, 204)
        await until(lambda: "v2" in b.broker.vhosts)
        nursery.cancel_scope.cancel()


def delivered(c: Client) -> int:
    return sum(isinstance(m, commands.Basic.Deliver) for m in c.methods())

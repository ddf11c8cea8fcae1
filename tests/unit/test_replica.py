"""Hot standby's state shipping (model/changes.py, model/standby/replica.py): a backup's view, fed
the primary's change batches, promotes to the broker the primary had, with its clients gone."""

from __future__ import annotations

from typing import Any

import pytest
from pamqp import commands as C

from cpgbroker.errors import InvariantError
from cpgbroker.model.broker import Broker
from cpgbroker.model.changes import RELEASED, ChangeLog
from cpgbroker.model.entities import Entry, PriorityMessages, Queue
from cpgbroker.model.events import Changes, ClientDisconnected, Event, Recovered, Tick
from cpgbroker.model.shipping import Shipper, messages, promote
from cpgbroker.model.state import snapshot
from modelclient import Client, Harness
from workload import generate


def in_order(q: Queue, by_id: bool) -> list[Entry]:
    if not by_id:
        return list(q.messages)
    if isinstance(q.messages, PriorityMessages):
        return [e for band in reversed(q.messages.bands) for e in sorted(band, key=msg_id)]
    return sorted(q.messages, key=msg_id)


def msg_id(e: Entry) -> int:
    return e.msg.id


def queues_of(b: Broker, by_id: bool = False) -> dict[tuple[str, str], list[Any]]:
    """Every queue's messages in order, or in publish order (``by_id``, per priority): a
    promoted backup has them in publish order, the primary had them in that order but for
    those a transaction's commit put behind newer ones."""
    return {
        (vh.name, q.name): [
            [e.msg.id, e.redelivered, e.expires_at, e.delivery_count, e.msg.header, e.msg.body]
            for e in in_order(q, by_id)
        ]
        for vh in b.vhosts.values()
        for q in vh.queues.values()
    }


def without_clients(b: Broker) -> Broker:
    """What the primary's broker becomes when it dies: every client gone."""
    copy = snapshot.restore(snapshot.snapshot(b))
    # All at once: a message one closing channel requeues is not delivered to another
    # client of the dead primary (no output credit left), as it would be were they closed
    # one by one while the others still served.
    for c in copy.connections.values():
        c.credit = 0
    for conn in list(copy.connections):
        copy.apply(ClientDisconnected(conn, "primary died"))
    return at_next_tick(copy)


def at_next_tick(b: Broker) -> Broker:
    """Expired messages leave at a tick, or earlier when a consumer is offered them: compare
    brokers once a tick at the same time took them both."""
    b.apply(Tick(b.now_ms))
    return b


def assert_promotes_to(view: Replica, primary: Broker, replicate: str = "all") -> int:
    want = without_clients(primary)
    if primary.changes is not None:
        # Messages the primary reserved (model/changes.py, "Reservations") and still holds
        # come flagged redelivered from a backup: it may have delivered them, for all the
        # backup knows.
        for q, mid in primary.changes.reserved():
            wq = want.vhosts[q.vhost].queues.get(q.name)
            if wq is None or q.deleted:
                continue  # (a queue of that name declared again is another queue)
            for e in wq.messages:
                if e.msg.id == mid:
                    e.redelivered = True
    if replicate == "durable":
        want.topology.drop_transient()
    got = at_next_tick(promoted(view, replicate))
    assert snapshot.definitions(got) == snapshot.definitions(want)
    want_q, got_q = queues_of(want, by_id=True), queues_of(got)
    assert list(got_q) == list(want_q)
    # Messages numbered above the primary's counter were dead-lettered as its clients went
    # (past a quorum queue's delivery limit). The primary's broker does that in its
    # channels' delivery-tag order, which a backup does not know: where they went, a
    # length limit may drop others, so those queues differ by design (docs/architecture.md).
    fresh = primary.msg_seq
    reached = {
        key
        for key in want_q
        if any(r[0] > fresh for r in want_q[key]) or any(r[0] > fresh for r in got_q[key])
    }
    for key, rows in want_q.items():
        if key not in reached:
            assert got_q[key] == rows, key
    return len(reached)


class Replica:
    """A backup's broker, as these tests drive it."""

    def __init__(self) -> None:
        self.broker = Broker()

    def apply(self, batch: bytes) -> None:
        self.broker.apply(Changes(batch))

    @property
    def messages(self) -> int:
        return messages(self.broker)

    def promote(self, replicate: str = "all") -> Broker:
        promote(self.broker, replicate)
        return self.broker

    def digest(self) -> str:
        return snapshot.digest(self.broker)


def promoted(view: Replica, replicate: str = "all") -> Broker:
    """A copy of ``view`` promoted (promotion uses a replica up), taken through a snapshot as
    a member that joined later would have it."""
    b = snapshot.restore(snapshot.snapshot(view.broker))
    promote(b, replicate)
    return b


def replay(log: list[Event], every: int, replicate: str = "all") -> tuple[Broker, Replica]:
    b = Broker()
    b.record_changes(ChangeLog(replicate))
    shipper, view = Shipper(), Replica()
    for i, ev in enumerate(log, 1):
        b.apply(ev)
        if i % every == 0:
            view.apply(shipper.batch(b))
            if i % (every * 7) == 0:
                assert_promotes_to(view, b, replicate)
    view.apply(shipper.batch(b))
    return b, view


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_promote_to_the_primary_without_its_clients(seed: int) -> None:
    log = generate(seed, steps=400)
    b, view = replay(log, every=1 + seed % 5)
    assert_promotes_to(view, b)
    assert view.messages == sum(len(q) for q in queues_of(b).values()) + sum(
        len(ch.unacked) for c in b.connections.values() for ch in c.channels.values()
    )


class ShipsEverything(ChangeLog):
    """A change log that never elides: every message ships, and its release with it."""

    __slots__ = ()

    def released(self, q: Queue, e: Entry) -> None:
        self.unreserve(q, e)
        if self._ships(q, e):
            # Gone from the queue: nothing left to reserve at the cut, as in the real log.
            self._open.pop((q, e.msg.id), None)
            self.records.append((RELEASED, q, e.msg.id))


@pytest.mark.parametrize("seed", range(4))
def test_elided_batches_build_the_replica_that_every_message_would(seed: int) -> None:
    """Batches that leave out what joined a queue and left it since the last batch give,
    after every batch, the replica that batches carrying every message give."""
    log = generate(1000 + seed, steps=400)
    elided = 0
    for every in (1, 3, 8, 40):
        primary, reference = Broker(), Broker()
        primary.record_changes(ChangeLog())
        reference.record_changes(ShipsEverything())
        shipper, reference_shipper = Shipper(), Shipper()
        view, reference_view = Replica(), Replica()
        for i, ev in enumerate(log, 1):
            primary.apply(ev)
            reference.apply(ev)
            if i % every == 0 or i == len(log):
                view.apply(shipper.batch(primary))
                reference_view.apply(reference_shipper.batch(reference))
                assert view.digest() == reference_view.digest(), (every, i)
        assert primary.changes is not None
        elided += primary.changes.elided
        assert_promotes_to(view, primary)
    assert elided > 0


@pytest.mark.parametrize("seed", range(4))
def test_durable_mode_promotes_to_what_a_restart_keeps(seed: int) -> None:
    b, view = replay(generate(100 + seed, steps=300), every=3, replicate="durable")
    assert_promotes_to(view, b, "durable")


class Primary:
    """A primary's broker with one client, shipping a batch to a backup's view on demand."""

    def __init__(self, replicate: str = "all") -> None:
        self.h = Harness()
        self.h.tick(1_000)
        self.h.broker.record_changes(ChangeLog(replicate))
        self.shipper, self.view = Shipper(), Replica()
        self.c = self.client(1)

    def client(self, conn: int) -> Client:
        c = self.h.connect(conn)
        c.handshake()
        c.channel(1)
        return c

    def ship(self) -> bytes:
        batch = self.shipper.batch(self.h.broker)
        self.view.apply(batch)
        return batch


def test_a_batch_carries_definitions_only_when_they_changed() -> None:
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="work", durable=True))
    first = p.ship()
    p.c.publish(1, "", "work", b"x" * 100)
    second = p.ship()
    assert first[17] == 1 and second[17] == 0  # the head's "has definitions" flag
    # The message and its reservation (model/changes.py, "Reservations"), no definitions.
    assert len(second) < 240
    p.c.rpc(1, C.Exchange.Declare(exchange="logs", exchange_type="fanout"))
    assert p.ship()[17] == 1
    # A declare that changes nothing (passive, or the same again) ships nothing new.
    p.c.rpc(1, C.Queue.Declare(queue="work", durable=True))
    assert p.ship()[17] == 0


def test_exclusive_reply_queues_never_cross_the_cluster() -> None:
    p = Primary()
    server = p.client(2)
    server.rpc(1, C.Queue.Declare(queue="rpc"))
    server.send(1, C.Basic.Consume(queue="rpc", no_ack=True))
    reply = p.c.rpc(1, C.Queue.Declare(queue="", exclusive=True, auto_delete=True))
    p.c.send(1, C.Basic.Consume(queue=reply.queue, no_ack=True))
    p.ship()
    sizes = []
    for i in range(20):
        p.c.publish(1, "", "rpc", b"request %d" % i)
        server.publish(1, "", reply.queue, b"r" * 1000)
        sizes.append(len(p.ship()))
    # The 1 KiB replies are not in the batches; each request is (enqueued, then released).
    assert max(sizes) < 200
    assert view_names(p.view.promote()) == [("/", "rpc")]


def acked_before_the_cut(p: Primary, exchange: str, rk: str, body: bytes) -> ChangeLog:
    """Publish ``body``, which the client's one consumer gets, and ack it: elided."""
    p.c.publish(1, exchange, rk, body)
    [(m, _)] = p.c.deliveries()
    p.c.send(1, C.Basic.Ack(delivery_tag=m.delivery_tag))
    log = p.h.broker.changes
    assert log is not None and log.elided == 1
    return log


def test_a_message_acked_before_its_batch_is_cut_never_ships() -> None:
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="work"))
    p.c.send(1, C.Basic.Consume(queue="work"))
    p.ship()
    log = acked_before_the_cut(p, "", "work", b"x" * 1000)
    assert log.bytes == 0
    assert len(p.ship()) < 100  # its body, delivery and ack stayed on the primary
    assert p.view.messages == 0
    # Acked after its batch was cut, a message is in one batch and its ack in the next.
    p.c.publish(1, "", "work", b"y" * 1000)
    assert log.bytes == 1000
    [(second, _)] = p.c.deliveries()
    assert len(p.ship()) > 1000 and p.view.messages == 1
    assert p.view.broker.vhosts["/"].queues["work"].unacked == 1
    p.c.send(1, C.Basic.Ack(delivery_tag=second.delivery_tag))
    assert len(p.ship()) < 100 and p.view.messages == 0
    assert log.elided == 1
    assert_promotes_to(p.view, p.h.broker)


def test_a_message_in_two_queues_ships_once_for_the_queue_still_holding_it() -> None:
    p = Primary()
    p.c.rpc(1, C.Exchange.Declare(exchange="fan", exchange_type="fanout"))
    for name in ("acked", "kept"):
        p.c.rpc(1, C.Queue.Declare(queue=name))
        p.c.rpc(1, C.Queue.Bind(queue=name, exchange="fan"))
    p.c.send(1, C.Basic.Consume(queue="acked"))
    p.ship()
    acked_before_the_cut(p, "fan", "", b"z" * 1000)
    batch = p.ship()
    assert batch.count(b"z" * 1000) == 1
    assert b"acked" not in batch  # nothing of that queue's copy: not even its name
    assert [len(q.messages) for q in p.view.broker.vhosts["/"].queues.values()] == [0, 1]
    assert_promotes_to(p.view, p.h.broker)


def test_a_message_requeued_and_dead_lettered_before_the_cut_ships_where_it_ends() -> None:
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="dlq"))
    p.c.rpc(
        1,
        C.Queue.Declare(
            queue="work",
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"},
        ),
    )
    p.ship()
    p.c.publish(1, "", "work", b"w" * 1000)
    p.c.send(1, C.Basic.Get(queue="work"))
    [(got, _)] = p.c.deliveries()
    p.c.send(1, C.Basic.Nack(delivery_tag=got.delivery_tag, requeue=True))
    p.c.send(1, C.Basic.Get(queue="work"))
    [(again, _)] = p.c.deliveries()
    assert again.redelivered
    p.c.send(1, C.Basic.Reject(delivery_tag=again.delivery_tag, requeue=False))
    batch = p.ship()
    # Gone from work before the cut: only its place in dlq ships, with the body.
    assert batch.count(b"w" * 1000) == 1
    queues = p.view.broker.vhosts["/"].queues
    assert not queues["work"].messages and len(queues["dlq"].messages) == 1
    assert_promotes_to(p.view, p.h.broker)


def view_names(b: Broker) -> list[tuple[str, str]]:
    return [(vh.name, q.name) for vh in b.vhosts.values() for q in vh.queues.values()]


def test_promotion_requeues_what_consumers_held_and_drops_their_auto_delete_queues() -> None:
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="kept", auto_delete=True))  # never consumed
    p.c.rpc(1, C.Queue.Declare(queue="consumed", auto_delete=True))
    p.c.rpc(1, C.Queue.Declare(queue="work", durable=True))
    for i in range(5):
        p.c.publish(1, "", "work", b"m%d" % i)
    p.c.send(1, C.Basic.Qos(prefetch_count=2))
    p.c.send(1, C.Basic.Consume(queue="work"))
    p.c.send(1, C.Basic.Consume(queue="consumed"))
    delivered = [m.delivery_tag for m, _ in p.c.deliveries()]
    assert delivered == [1, 2]
    p.c.send(1, C.Basic.Ack(delivery_tag=1))
    p.ship()
    b = p.view.promote()
    assert view_names(b) == [("/", "kept"), ("/", "work")]
    work = b.vhosts["/"].queues["work"]
    # m0 was acked, which let m2 out; m1 and m2 were out with the consumer: back at the
    # head, redelivered. m3 and m4 were queued when the batch was cut: reserved (the primary
    # might have delivered them before its next batch: model/changes.py, "Reservations").
    assert [(e.msg.body, e.redelivered) for e in work.messages] == [
        (b"m1", True),
        (b"m2", True),
        (b"m3", True),
        (b"m4", True),
    ]
    assert b.queued_bytes == 8 and work.ready_bytes == 8


def test_a_purge_keeps_what_consumers_hold() -> None:
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="work"))
    for i in range(4):
        p.c.publish(1, "", "work", b"m%d" % i)
    p.c.send(1, C.Basic.Get(queue="work"))
    p.c.rpc(1, C.Queue.Purge(queue="work"))
    p.ship()
    assert p.view.messages == 1
    work = p.view.promote().vhosts["/"].queues["work"]
    assert [(e.msg.body, e.redelivered) for e in work.messages] == [(b"m0", True)]


def test_a_deleted_queue_and_its_unacked_messages_leave_the_view() -> None:
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="work"))
    p.c.publish(1, "", "work", b"a")
    p.c.publish(1, "", "work", b"b")
    p.c.send(1, C.Basic.Get(queue="work"))
    p.ship()
    p.c.rpc(1, C.Queue.Delete(queue="work"))
    p.c.send(1, C.Basic.Ack(delivery_tag=1))
    p.c.rpc(1, C.Queue.Declare(queue="work"))
    p.c.publish(1, "", "work", b"c")
    p.ship()
    work = p.view.promote().vhosts["/"].queues["work"]
    assert [e.msg.body for e in work.messages] == [b"c"]


def test_durable_mode_ships_only_persistent_messages_on_durable_queues() -> None:
    p = Primary("durable")
    p.c.rpc(1, C.Queue.Declare(queue="d", durable=True))
    p.c.rpc(1, C.Queue.Declare(queue="t"))
    persistent = C.Basic.Properties(delivery_mode=2)
    p.c.publish(1, "", "d", b"kept", props=persistent)
    p.c.publish(1, "", "d", b"transient")
    p.c.publish(1, "", "t", b"lost", props=persistent)
    p.ship()
    assert p.view.messages == 1
    b = p.view.promote(replicate="durable")
    assert view_names(b) == [("/", "d")]
    assert [e.msg.body for e in b.vhosts["/"].queues["d"].messages] == [b"kept"]


def test_definitions_mode_ships_no_message() -> None:
    p = Primary("definitions")
    p.c.rpc(1, C.Queue.Declare(queue="d", durable=True))
    for _ in range(10):
        p.c.publish(1, "", "d", b"x" * 500)
    assert len(p.ship()) < 1500
    b = p.view.promote()
    assert view_names(b) == [("/", "d")] and not b.vhosts["/"].queues["d"].messages


def test_views_that_applied_the_same_batches_have_the_same_digest() -> None:
    p = Primary()
    other = Replica()
    p.c.rpc(1, C.Queue.Declare(queue="work"))
    for i in range(3):
        p.c.publish(1, "", "work", b"m%d" % i)
        other.apply(p.ship())
    assert other.digest() == p.view.digest()
    p.c.send(1, C.Basic.Get(queue="work"))
    p.ship()
    assert other.digest() != p.view.digest()


@pytest.mark.parametrize("cut", [1, 5, 18, 30, 31])
def test_a_damaged_batch_is_an_invariant_error(cut: int) -> None:
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="work"))
    p.ship()
    p.c.publish(1, "", "work", b"m")
    batch = p.shipper.batch(p.h.broker)
    with pytest.raises(InvariantError):
        Replica().apply(batch[:-cut] if cut < len(batch) else b"\x09" + batch[1:])


@pytest.mark.parametrize("seed", range(8))
def test_an_update_from_the_back_without_what_was_consumed_since_converges(seed: int) -> None:
    """A replica's state update (runtime/update/transfer.py) goes from the back of each queue and
    leaves out what consumers took after its point; the newcomer replays the batches from that
    point and ends with the broker of a member that applied everything."""
    log = generate(200 + seed, steps=400)
    b = Broker()
    b.record_changes(ChangeLog())
    shipper = Shipper()
    batches = []
    for i, ev in enumerate(log, 1):
        b.apply(ev)
        if i % 3 == 0:
            batches.append(shipper.batch(b))
    batches.append(shipper.batch(b))
    cut = len(batches) // 2
    straight = Broker()
    for batch in batches[:cut]:
        straight.apply(Changes(batch))
    # A replica of its own at the update's point: its queue fronts go too.
    at_cut = Broker()
    for batch in batches[:cut]:
        at_cut.apply(Changes(batch))
    # What consumers take after the update's point, as the updater learns it.
    straight.replication.released = []
    for batch in batches[cut:]:
        straight.apply(Changes(batch))
    taken: dict[tuple[str, str], set[int]] = {}
    for vhost, name, mid in straight.replication.released:
        taken.setdefault((vhost, name), set()).add(mid)
    parts = list(
        snapshot.parts(at_cut, chunk=2, gone=lambda q: taken.get((q.vhost, q.name), set()))
    )
    assert all(p[0] != "entries" for p in parts[1:] if isinstance(p, list))
    sent = sum(len(p[3]) for p in parts[1:] if isinstance(p, list) and p[0] == "entries_back")
    assert sent == messages(at_cut) - sum(
        1
        for (vhost, name), ids in taken.items()
        for q in [at_cut.vhosts.get(vhost, None) and at_cut.vhosts[vhost].queues.get(name)]
        if q is not None
        for e in at_cut.replication.in_order(q)
        if e.msg.id in ids
    )
    newcomer = snapshot.restore(parts)
    newcomer.replication.catching_up = True
    for batch in batches[cut:]:
        newcomer.apply(Changes(batch))
    newcomer.replication.catching_up = False
    assert snapshot.digest(newcomer) == snapshot.digest(straight)


def test_records_for_messages_that_are_not_there_are_a_divergence() -> None:
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="work"))
    p.c.publish(1, "", "work", b"m")
    p.ship()
    p.c.send(1, C.Basic.Get(queue="work", no_ack=True))
    batch = p.shipper.batch(p.h.broker)
    lost = snapshot.restore(snapshot.snapshot(p.view.broker))
    lost.vhosts["/"].queues["work"].messages.clear()
    with pytest.raises(InvariantError):
        lost.apply(Changes(batch))
    lost = snapshot.restore(snapshot.snapshot(p.view.broker))
    lost.vhosts["/"].queues["work"].messages.clear()
    lost.replication.catching_up = True
    lost.apply(Changes(batch))


def consuming(
    messages: int, consumers: int, prefetch: int
) -> tuple[Primary, list[Client], list[list[int]]]:
    """A primary whose queue "work" held ``messages`` when ``consumers`` consumers, each
    with ``prefetch``, took what they could (one after the other), shipped: the primary,
    its consumers and the delivery tags each got."""
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="work"))
    for i in range(messages):
        p.c.publish(1, "", "work", b"m%d" % i)
    clients = [p.client(10 + n) for n in range(consumers)]
    for c in clients:
        c.send(1, C.Basic.Qos(prefetch_count=prefetch))
        c.send(1, C.Basic.Consume(queue="work"))
    tags = [[m.delivery_tag for m, _ in c.deliveries()] for c in clients]
    p.ship()
    return p, clients, tags


def test_messages_out_with_consumers_are_unacked_on_a_backup_and_settle_in_any_order() -> None:
    """What the primary's consumers hold is, on a backup, the front of its queue: counted
    unacked as on the primary, settled in whatever order the consumers ack, and still in
    queue order for a snapshot and a promotion."""
    p, consumers, tags = consuming(messages=12, consumers=3, prefetch=3)
    work = p.view.broker.vhosts["/"].queues["work"]
    primary_work = p.h.broker.vhosts["/"].queues["work"]
    assert work.unacked == primary_work.unacked == 9
    assert len(work.messages) == len(primary_work.messages) == 3
    # Acks from the last consumer first, each consumer's newest first: all out of order.
    for c, ts in reversed(list(zip(consumers, tags, strict=True))):
        c.send(1, C.Basic.Ack(delivery_tag=ts[-1]))
    p.ship()
    assert work.unacked == primary_work.unacked
    # A member restored from this replica (a state update) digests alike, and stays alike.
    copy = Replica()
    copy.broker = snapshot.restore(snapshot.snapshot(p.view.broker))
    assert copy.digest() == p.view.digest()
    consumers[1].send(1, C.Basic.Nack(delivery_tag=tags[1][0], requeue=True))
    consumers[0].send(1, C.Basic.Ack(delivery_tag=tags[0][0]))
    copy.apply(p.ship())
    assert copy.digest() == p.view.digest()
    assert_promotes_to(p.view, p.h.broker)
    # Promoted in place too: the front goes back to the head of the queue.
    want = [e.msg.body for e in promoted(p.view).vhosts["/"].queues["work"].messages]
    work = p.view.promote().vhosts["/"].queues["work"]
    assert work.unacked == 0 and len(want) == 12 - 4  # four acked
    assert [e.msg.body for e in work.messages] == want


@pytest.mark.parametrize("seed", range(6))
def test_a_replica_restored_at_any_batch_keeps_digesting_alike(seed: int) -> None:
    """A state update may be taken after any batch: the member restored from it and the
    replica it came from apply the same batches and keep the same digest."""
    log = generate(300 + seed, steps=300)
    b = Broker()
    b.record_changes(ChangeLog())
    shipper, view = Shipper(), Replica()
    copies: list[Replica] = []
    for i, ev in enumerate(log, 1):
        b.apply(ev)
        if i % 2 == 0:
            batch = shipper.batch(b)
            for r in [view, *copies]:
                r.apply(batch)
            if i % 40 == 0:
                copy = Replica()
                copy.broker = snapshot.restore(snapshot.snapshot(view.broker))
                copies.append(copy)
    assert copies
    assert {r.digest() for r in copies} == {view.digest()}


def test_a_promotion_copy_shares_the_messages_and_equals_a_snapshot_copy() -> None:
    """A new primary serves a copy of its replica made in process (``parts(share=True)``):
    the same broker as a snapshot's round trip makes, sharing the (immutable) messages
    instead of parsing every header again."""
    _, view = replay(generate(7, steps=300), every=2)
    shared = snapshot.restore(snapshot.parts(view.broker, share=True))
    copied = snapshot.restore(snapshot.snapshot(view.broker))
    assert snapshot.digest(shared) == snapshot.digest(copied) == view.digest()
    mine = {
        e.msg.id: e.msg for q in queues(view.broker) for e in view.broker.replication.in_order(q)
    }
    theirs = [e.msg for q in queues(shared) for e in q.messages]
    assert theirs and all(m is mine[m.id] for m in theirs)
    assert all(m is not mine[m.id] for q in queues(copied) for m in (e.msg for e in q.messages))
    # The entries are the copy's own: promoting it (which requeues and counts deliveries)
    # leaves the replica as it was.
    before = view.digest()
    promote(shared)
    assert view.digest() == before != snapshot.digest(shared)


def queues(b: Broker) -> list[Queue]:
    return [q for vh in b.vhosts.values() for q in vh.queues.values()]


def test_a_restart_from_the_stores_drops_transient_messages_from_the_fronts_too() -> None:
    """``Recovered`` (the cluster restarted from its stores) drops what is transient: also
    messages that were out with the primary's consumers, in the queues' fronts. The replica
    then holds what a broker restored from its snapshot holds, and a queue declared again
    under a dropped queue's name starts empty."""
    p = Primary()
    p.c.rpc(1, C.Queue.Declare(queue="d", durable=True))
    p.c.rpc(1, C.Queue.Declare(queue="t"))
    persistent = C.Basic.Properties(delivery_mode=2)
    p.c.publish(1, "", "d", b"transient")
    p.c.publish(1, "", "d", b"persistent", props=persistent)
    p.c.publish(1, "", "t", b"in t", props=persistent)
    p.c.send(1, C.Basic.Get(queue="d"))
    p.c.send(1, C.Basic.Get(queue="t"))
    p.ship()
    view = p.view.broker
    copy = snapshot.restore(snapshot.snapshot(view))
    for b in (view, copy):
        b.apply(Recovered())
    assert snapshot.digest(view) == snapshot.digest(copy)
    d = view.vhosts["/"].queues["d"]
    assert [e.msg.body for e in view.replication.in_order(d)] == [b"persistent"]
    assert d.unacked == 0 and view.queued_bytes == len(b"persistent")
    assert list(view.vhosts["/"].queues) == ["d"]
    again = Primary()
    again.c.rpc(1, C.Queue.Declare(queue="t"))
    batch = again.shipper.batch(again.h.broker)
    for b in (view, copy):
        b.apply(Changes(batch))
    t = view.vhosts["/"].queues["t"]
    assert not list(view.replication.in_order(t)) and t.unacked == 0
    assert snapshot.digest(view) == snapshot.digest(copy)


def test_a_restored_replica_rebuilds_its_fronts_and_counts_unacked_as_the_primary() -> None:
    """A member restored from a snapshot (a state update, a restart) has what was out with
    the primary's consumers at the head of each queue; the next delivery from behind them
    makes them the queue's front again, and the counts match the primary's."""
    p, consumers, tags = consuming(messages=10, consumers=2, prefetch=2)
    copy = Replica()
    copy.broker = snapshot.restore(snapshot.snapshot(p.view.broker))
    work = copy.broker.vhosts["/"].queues["work"]
    assert copy.broker.replication.held(work) == 0 and work.unacked == 0
    # The second consumer acks its first: m4 goes out to it, from behind m0-m3.
    consumers[1].send(1, C.Basic.Ack(delivery_tag=tags[1][0]))
    batch = p.shipper.batch(p.h.broker)
    for r in (p.view, copy):
        r.apply(batch)
    primary_work = p.h.broker.vhosts["/"].queues["work"]
    assert copy.broker.replication.held(work) == work.unacked == primary_work.unacked == 4
    assert copy.digest() == p.view.digest()

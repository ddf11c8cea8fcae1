"""The member's store on a simulated disk: what was fsynced survives a crash, and recovery
rebuilds exactly the model the member had there (docs/operations.md, "The store")."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpgbroker.model.broker import Broker
from cpgbroker.model.changes import ChangeLog
from cpgbroker.model.events import (
    Changes,
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    ClusterMembers,
    DiskAlarm,
    DoOutput,
    Event,
    MemberLeft,
    Recovered,
    Tick,
)
from cpgbroker.model.shipping import Shipper
from cpgbroker.model.state import snapshot
from cpgbroker.model.versions import NEWEST
from cpgbroker.store import meta, records
from cpgbroker.store.disk import OsDisk, SimDisk, StoreCorrupt
from cpgbroker.store.store import Recovery, Store, StoreMismatch, StoreSettings
from workload import generate

DIR = "/store"


def _store(disk: SimDisk, snapshot_bytes: int = 1 << 30, group: str = "g") -> Store:
    s = StoreSettings(DIR, fsync="always", segment_bytes=4096, snapshot_bytes=snapshot_bytes)
    return Store(s, group, NEWEST, disk=disk)


def _open(store: Store, next_seq: int = 1) -> list[int]:
    durable: list[int] = []
    store.open(next_seq, durable.append, lambda e: None)
    return durable


def _digests(events: list[Event]) -> list[str]:
    """The digest after each event (index 0: before any)."""
    b = Broker()
    out = [snapshot.digest(b)]
    for ev in events:
        b.apply(ev)
        out.append(snapshot.digest(b))
    return out


def _feed(store: Store, broker: Broker, events: list[Event]) -> None:
    for ev in events:
        broker.apply(ev)
        assert store.record(broker.event_seq, ev, broker) is None


@pytest.mark.parametrize(
    "ev",
    [
        ClientConnected(1 << 40 | 7, 3, "10.0.0.1:5", False),
        ClientData(12, b"\x01\x00\x01AMQP"),
        ClientData(12, b""),
        ClientDisconnected(9, "reset by peer"),
        CloseClient(9, 320, "forced é"),
        Tick(123456789),
        DoOutput(5, 100),
        MemberLeft(77),
        ClusterMembers(("amqp://a/", "amqp://b:5673/")),
        ClusterMembers(()),
        Recovered(),
        DiskAlarm(1 << 30 | 5, True),
        DiskAlarm(3, False),
        Changes(b"\x01batch bytes"),
    ],
)
@pytest.mark.parametrize("failed", [False, True])
def test_every_event_journals_and_reads_back(ev: Event, failed: bool) -> None:
    assert records.decode(records.encode(ev, failed)) == (ev, failed)


def test_recovery_rebuilds_the_model_of_the_last_synced_event() -> None:
    events = generate(3)
    disk = SimDisk()
    store = _store(disk)
    durable = _open(store)
    b = Broker()
    _feed(store, b, events)
    assert store.syncer is not None
    last = store.syncer.barrier()
    assert last == len(events) and durable[-1] == last
    store.close(clean=True, last_seq=last)
    rec = _store(disk).recover(b.config)
    assert rec is not None and rec.clean
    assert rec.seq == len(events)
    assert snapshot.digest(rec.broker) == snapshot.digest(b)


def test_a_member_that_stops_before_applying_anything_says_what_its_store_holds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = generate(4)
    disk = SimDisk()
    store = _store(disk)
    _open(store)
    b = Broker()
    _feed(store, b, events)
    store.close(clean=True, last_seq=b.event_seq)
    # Restarted: it recovers its store, then stops while it waits for the other members,
    # having applied nothing (the member's own model is still the empty one: event 0).
    again = _store(disk)
    rec = again.recover(b.config)
    assert rec is not None and rec.seq == len(events)
    _open(again, rec.seq + 1)
    with caplog.at_level(logging.INFO, "cpgbroker.store"):
        again.close(clean=True, last_seq=0)
    assert f"store closed cleanly at event {len(events)}" in caplog.messages
    m = meta.load(disk, DIR)
    assert m is not None and m.state == meta.CLEAN and m.last_seq == len(events)
    rec = _store(disk).recover(b.config)
    assert rec is not None and rec.clean and rec.seq == len(events)


def test_snapshots_bound_the_journal_and_recovery_starts_from_the_newest() -> None:
    events = generate(5, steps=600)
    disk = SimDisk()
    store = _store(disk, snapshot_bytes=2000)
    _open(store)
    b = Broker()
    _feed(store, b, events)
    assert store.snapshots_taken >= 3
    assert store.syncer is not None
    store.syncer.barrier()
    names = disk.listdir(DIR)
    assert len([n for n in names if n.startswith("snapshot-")]) == 1
    m = meta.load(disk, DIR)
    assert m is not None and m.base_seq > 0
    first_segment = min(int(n[8:28]) for n in names if n.startswith("journal-"))
    assert first_segment == m.base_seq + 1  # older segments were deleted
    rec = _store(disk).recover(b.config)
    assert rec is not None and not rec.clean
    assert rec.records == len(events) - m.base_seq
    assert snapshot.digest(rec.broker) == snapshot.digest(b)


def _crash(
    events: list[Event], seed: int, cut: int, sync_every: int, snap: int = 3000
) -> tuple[SimDisk, Recovery]:
    """Journal ``events[:cut]`` on a simulated disk, fsyncing every ``sync_every`` events (what
    a confirm could have vouched for), then lose power: the syncer thread and everything not
    fsynced are gone. What the store recovers is at least what was synced."""
    disk = SimDisk()
    store = _store(disk, snapshot_bytes=snap)
    _open(store)
    b = Broker()
    synced = 0
    for i, ev in enumerate(events[:cut]):
        _feed(store, b, [ev])
        if i % sync_every == 0:
            assert store.syncer is not None
            synced = store.syncer.barrier()
    assert store.syncer is not None
    store.syncer.barrier()
    disk.crash(random.Random(seed))
    rec = _store(disk).recover(b.config)
    assert rec is not None
    assert synced <= rec.seq <= cut
    return disk, rec


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    crash_at=st.floats(0.05, 1.0),
    sync_every=st.integers(1, 60),
    snap=st.sampled_from([600, 3000, 1 << 30]),
)
def test_a_crash_at_any_point_recovers_a_synced_prefix(
    seed: int, crash_at: float, sync_every: int, snap: int
) -> None:
    events = generate(seed, steps=150)
    digests = _digests(events)
    cut = max(1, int(len(events) * crash_at))
    disk, rec = _crash(events, seed, cut, sync_every, snap)
    assert snapshot.digest(rec.broker) == digests[rec.seq]
    # The recovered store goes on journaling after what it holds.
    store2 = _store(disk)
    again = store2.recover(rec.broker.config)
    assert again is not None
    _open(store2, again.seq + 1)
    b2 = again.broker
    _feed(store2, b2, events[again.seq :])
    assert store2.syncer is not None
    store2.syncer.barrier()
    store2.close(clean=True, last_seq=b2.event_seq)
    final = _store(disk).recover(b2.config)
    assert final is not None and final.clean
    assert snapshot.digest(final.broker) == digests[-1]


def test_corruption_before_the_tail_names_the_file_and_offset() -> None:
    events = generate(8, steps=300)
    disk = SimDisk()
    store = _store(disk)
    _open(store)
    b = Broker()
    _feed(store, b, events)
    assert store.syncer is not None
    store.syncer.barrier()
    store.close(clean=True, last_seq=b.event_seq)
    segs = sorted(n for n in disk.listdir(DIR) if n.startswith("journal-"))
    assert len(segs) >= 2
    victim = f"{DIR}/{segs[0]}"
    data = bytearray(disk.read(victim))
    data[200] ^= 0xFF
    disk.remove(victim)
    f = disk.open_append(victim)
    f.write(bytes(data))
    f.sync()
    f.close()
    with pytest.raises(StoreCorrupt, match=segs[0]):
        _store(disk).recover(b.config)


def test_a_store_of_another_cluster_is_never_recovered() -> None:
    disk = SimDisk()
    store = _store(disk, group="cluster-a")
    _open(store)
    store.close(clean=True, last_seq=0)
    with pytest.raises(StoreMismatch, match="cluster-a"):
        _store(disk, group="cluster-b").recover(Broker().config)


def test_a_store_being_replaced_recovers_nothing_until_its_new_base_is_durable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = generate(11, steps=100)
    disk = SimDisk()
    store = _store(disk)
    _open(store)
    b = Broker()
    _feed(store, b, events[:50])
    # A state update installs the model of a later point: the store is replaced by it.
    installed = Broker()
    for ev in events[:80]:
        installed.apply(ev)
    m = meta.load(disk, DIR)
    assert m is not None and m.state == meta.SERVING
    with caplog.at_level(logging.INFO, "cpgbroker.store"):
        store.replace(installed)  # fork=None: the snapshot is written inline
    assert store.durable == 80 and not store.replacing
    # The event the store held (its base is still the empty state: event 0).
    assert (
        f"replacing the store at {DIR} (epoch 1, holding event 50) with the state of event 80"
        in caplog.messages
    )
    m = meta.load(disk, DIR)
    assert m is not None and m.base_seq == 80
    _feed(store, installed, events[80:])
    assert store.syncer is not None
    store.syncer.barrier()
    rec = _store(disk).recover(installed.config)
    assert rec is not None and rec.seq == len(events)
    assert snapshot.digest(rec.broker) == snapshot.digest(installed)


def test_replacing_state_on_disk_means_nothing_to_recover() -> None:
    disk = SimDisk()
    disk.makedirs(DIR)
    meta.save(disk, DIR, meta.Meta("g", NEWEST, 1, 0, None, meta.REPLACING))
    assert _store(disk).recover(Broker().config) is None


def test_a_store_whose_replacement_never_finished_starts_afresh() -> None:
    events = generate(12, steps=100)
    disk = SimDisk()
    store = _store(disk)
    _open(store)
    b = Broker()
    _feed(store, b, events[:60])
    assert store.syncer is not None
    store.syncer.barrier()
    # The member crashed while a state update replaced its store.
    meta.save(disk, DIR, meta.Meta("g", NEWEST, 1, 0, None, meta.REPLACING))
    again = _store(disk)
    assert again.recover(b.config) is None
    _open(again)  # journals from event 1 again, over nothing
    fresh = Broker()
    _feed(again, fresh, events[:10])
    assert again.syncer is not None
    again.syncer.barrier()
    rec = _store(disk).recover(b.config)
    assert rec is not None and rec.seq == 10
    assert snapshot.digest(rec.broker) == snapshot.digest(fresh)


def test_recovery_from_a_snapshot_on_the_real_file_system(tmp_path: Path) -> None:
    events = generate(21, steps=300)
    settings_ = StoreSettings(str(tmp_path / "s"), segment_bytes=4096, snapshot_bytes=3000)
    store = Store(settings_, "g", NEWEST, disk=OsDisk())
    store.open(1, lambda _s: None, lambda _e: None)
    b = Broker()
    _feed(store, b, events)
    assert store.snapshots_taken >= 2
    store.close(clean=True, last_seq=b.event_seq)
    rec = Store(settings_, "g", NEWEST, disk=OsDisk()).recover(b.config)
    assert rec is not None and rec.clean and rec.seq == len(events)
    assert snapshot.digest(rec.broker) == snapshot.digest(b)


def _with_operators(seed: int) -> list[Event]:
    """A workload with operators' changes and federation links' messages among the clients'
    events: users, vhosts, permissions, policies, upstreams, link states, forwarded batches."""
    import json

    from pamqp import commands
    from pamqp import header as pheader

    from cpgbroker.model.access.permissions import TRUSTED
    from cpgbroker.model.events import AdminCommand, Forward

    def admin(ticket: int, op: str, **args: object) -> AdminCommand:
        return AdminCommand(1, ticket, TRUSTED, op, json.dumps(args).encode())

    header = bytes(pheader.ContentHeader(0, 2, commands.Basic.Properties()).marshal())
    ops: list[Event] = [
        admin(1, "put_vhost", name="v"),
        admin(2, "put_user", name="ann", password_hash="", tags=["monitoring"]),
        admin(3, "put_permissions", vhost="v", user="ann", configure=".*", write=".*", read=""),
        admin(4, "put_policy", vhost="/", name="cap", pattern=".*", definition={"max-length": 3}),
        admin(
            5,
            "put_parameter",
            component="federation-upstream",
            vhost="/",
            name="up",
            value={"uri": "amqp://h/"},
        ),
        admin(6, "put_queue", vhost="/", name="fed.q", durable=True),
        admin(
            7,
            "federation_status",
            vhost="/",
            exchange="",
            upstream="up",
            state={"status": "running"},
        ),
        admin(8, "delete_policy", vhost="/", name="cap"),
    ]
    ops += [
        Forward(
            1, 100 + i, "/", "", "up", (("fed.q", header, b"%02d" % i, b"d%d" % i, i % 3 == 0),)
        )
        for i in range(12)
    ]
    events = generate(seed, steps=120)
    rng = random.Random(seed)
    for ev in ops:  # in their order, at random places among the clients' events
        events.insert(rng.randint(len(events) // 2, len(events)), ev)
    return events


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), crash_at=st.floats(0.3, 1.0))
def test_operators_changes_survive_a_crash_as_far_as_they_were_synced(
    seed: int, crash_at: float
) -> None:
    """Users, policies, upstreams and forwarded messages are journaled like client events: a
    crash that loses what was not fsynced recovers the model of a synced prefix, digest for
    digest (users, permissions, policies, upstreams, links' states and recent digests)."""
    events = _with_operators(seed)
    digests = _digests(events)
    cut = max(1, int(len(events) * crash_at))
    _, rec = _crash(events, seed, cut, sync_every=7)
    assert snapshot.digest(rec.broker) == digests[rec.seq]
    if rec.seq == len(events):
        assert "ann" in rec.broker.users.by_name
        assert rec.broker.federation.all()[0].name == "up"


@pytest.mark.parametrize(("seed", "crash_at"), [(0, 0.3), (1, 0.6), (2, 0.9), (3, 1.0)])
def test_a_replica_of_change_batches_survives_a_crash_as_far_as_it_was_synced(
    seed: int, crash_at: float
) -> None:
    """Hot standby shipping changes: a member's store journals the primary's change batches
    like any event; losing what was not fsynced recovers the replica of a synced prefix,
    digest for digest, and it goes on applying batches."""
    primary = Broker()
    primary.record_changes(ChangeLog())
    shipper = Shipper()
    events: list[Event] = []
    for i, ev in enumerate(generate(seed, steps=200), 1):
        primary.apply(ev)
        if i % 4 == 0:
            events.append(Changes(shipper.batch(primary)))
    digests = _digests(events)
    cut = max(1, int(len(events) * crash_at))
    _, rec = _crash(events, seed, cut, sync_every=5)
    assert snapshot.digest(rec.broker) == digests[rec.seq]
    for ev in events[rec.seq :]:
        rec.broker.apply(ev)
    assert snapshot.digest(rec.broker) == digests[-1]

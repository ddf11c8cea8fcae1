"""Model versions (model/versions.py): members of two releases agree on one version in the
stream, the version moves up at one event only where every member applies it, the model at
the old version snapshots and digests as the old release did, and a store written at one
version is recovered at that version and refused, untouched, outside the range."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cpgbroker.cluster import codec
from cpgbroker.cluster.codec import STATUS_NEW, STATUS_READY, Hello, software_label
from cpgbroker.cluster.membership import (
    NEEDS_UPDATE,
    ApplyToModel,
    BecomeReady,
    Fatal,
    Membership,
    NeedUpdate,
    StartAt,
)
from cpgbroker.model.broker import Broker
from cpgbroker.model.events import AdminCommand, AdminReply, Event
from cpgbroker.model.operators.admin import RAISE_MODEL_VERSION
from cpgbroker.model.state import snapshot
from cpgbroker.model.versions import NEWEST, OLDEST
from cpgbroker.store import meta
from cpgbroker.store.disk import SimDisk
from cpgbroker.store.store import Store, StoreMismatch, StoreSettings
from workload import generate

DIGEST = b"d" * 32
OLD = "cpgbroker 0.1.0"  # what release 0.1.0 announces: no range
NEW = software_label("9.9.9", OLDEST, NEWEST)


def hello(m: int, status: int, version: int, software: str) -> Hello:
    return Hello(m, status, version, DIGEST, f"amqp://m{m}/", software, 1000)


def new_member(me: int, size: int = 3) -> Membership:
    return Membership(me, size, OLDEST, DIGEST, f"amqp://m{me}/", 0, (OLDEST, NEWEST))


def test_the_range_rides_in_the_software_text_and_the_hello_bytes_are_unchanged() -> None:
    h = hello(5, STATUS_NEW, OLDEST, NEW)
    assert codec.software_range(h) == (OLDEST, NEWEST)
    assert codec.software_range(hello(5, STATUS_READY, OLDEST, OLD)) == (OLDEST, OLDEST)
    # One Hello layout for both releases: 0.1.0 decodes ours field by field.
    assert codec.decode_batch(codec.HEADER + codec.encode(h), 5) == [h]


def test_a_new_member_joins_a_cluster_of_the_old_release_at_its_version() -> None:
    view = new_member(4)
    view.on_confchg([1, 2, 3, 4], [4], [])
    view.on_hello(hello(4, STATUS_NEW, OLDEST, NEW))
    acts = view.on_hello(hello(1, STATUS_READY, OLDEST, OLD))
    assert isinstance(acts[0], NeedUpdate)
    assert view.state == NEEDS_UPDATE and view.model_version == OLDEST


def test_a_member_that_cannot_apply_the_clusters_version_is_refused_naming_both() -> None:
    view = Membership(4, 3, NEWEST, DIGEST, "amqp://m4/", 0, (NEWEST, NEWEST))
    view.on_confchg([1, 4], [4], [])
    acts = view.on_hello(hello(1, STATUS_READY, OLDEST, OLD))
    assert len(acts) == 1 and isinstance(acts[0], Fatal)
    text = acts[0].reason
    assert f"runs model version {OLDEST}" in text
    assert f"applies model versions {NEWEST} to {NEWEST}" in text
    assert "upgrade through a release" in text


def test_an_old_release_newcomer_to_a_cluster_that_moved_up_is_not_counted() -> None:
    view = new_member(1, size=1)
    view.on_confchg([1], [1], [])
    view.on_hello(hello(1, STATUS_NEW, OLDEST, NEW))
    assert view.model_version == NEWEST  # a new cluster starts at the newest version
    view.on_confchg([1, 2], [2], [])
    assert view.on_hello(hello(2, STATUS_NEW, OLDEST, OLD)) == []
    assert view.members[2].status is None and view.ready_members == [1]


@pytest.mark.parametrize(
    ("softwares", "version"),
    [((NEW, NEW, NEW), NEWEST), ((NEW, OLD, NEW), OLDEST)],
)
def test_a_new_cluster_starts_at_the_newest_version_all_its_members_apply(
    softwares: tuple[str, ...], version: int
) -> None:
    view = new_member(1)
    view.on_confchg([1, 2, 3], [1, 2, 3], [])
    acts: list[Any] = []
    for m, sw in zip((1, 2, 3), softwares, strict=True):
        acts = view.on_hello(hello(m, STATUS_NEW, OLDEST, sw))
    assert acts[0] == StartAt(version)
    assert isinstance(acts[1], ApplyToModel) and isinstance(acts[2], BecomeReady)


def _ready_cluster(softwares: tuple[str, ...]) -> Membership:
    view = new_member(1)
    view.on_confchg([1, 2, 3], [1, 2, 3], [])
    for m, sw in zip((1, 2, 3), softwares, strict=True):
        view.on_hello(hello(m, STATUS_NEW, OLDEST, sw))
    return view


def test_the_version_moves_up_only_when_every_member_applies_it() -> None:
    mixed = _ready_cluster((NEW, OLD, NEW))
    why = mixed.refuse_version(NEWEST)
    assert why is not None
    assert "member 2 (cpgbroker 0.1.0: model versions 7 to 7)" in why
    assert mixed.upgrade_status() == {
        "model_version": OLDEST,
        "newest_all_apply": OLDEST,
        "releases": [OLD, NEW],
        "pending": False,
    }
    upgraded = _ready_cluster((NEW, NEW, NEW))
    upgraded.model_version = OLDEST  # (as a cluster of 0.1.0 members replaced one by one)
    assert upgraded.refuse_version(NEWEST) is None
    assert upgraded.upgrade_status()["pending"]
    assert "only move up" in (_ready_cluster((NEW, NEW, NEW)).refuse_version(OLDEST) or "")


def _raise(b: Broker, version: int, refused: str | None = None) -> AdminReply:
    args: dict[str, Any] = {"version": version}
    if refused is not None:
        args["refused"] = refused
    effects = b.apply(
        AdminCommand(0, 1, "operator", RAISE_MODEL_VERSION, json.dumps(args).encode())
    )
    replies = [e for e in effects if isinstance(e, AdminReply)]
    assert len(replies) == 1
    return replies[0]


def test_the_model_at_the_old_version_snapshots_as_the_old_release_and_moves_up_at_one_event() -> (
    None
):
    events = generate(11, steps=150)
    old = Broker(version=OLDEST)
    for ev in events:
        old.apply(ev)
    head = snapshot.snapshot(old)[0]
    assert "model_version" not in head  # 0.1.0's bytes
    refused = _raise(old, NEWEST, "member 2 applies 7 to 7")
    assert refused.status == 409 and old.version.current == OLDEST
    before = snapshot.digest(old)
    done = _raise(old, NEWEST)
    assert done.status == 200 and done.body == {"model_version": NEWEST, "was": OLDEST}
    assert old.version.current == NEWEST and snapshot.digest(old) != before
    assert _raise(old, OLDEST).status == 409  # never down
    back = snapshot.restore(snapshot.snapshot(old))
    assert back.version.current == NEWEST
    assert snapshot.digest(back) == snapshot.digest(old)


def _store(disk: SimDisk, version: int) -> Store:
    s = StoreSettings("/store", fsync="always", segment_bytes=4096, snapshot_bytes=1 << 30)
    return Store(s, "g", version, disk=disk)


def test_a_store_of_the_old_version_is_recovered_across_the_switch() -> None:
    events: list[Event] = generate(12, steps=200)
    disk = SimDisk()
    store = _store(disk, OLDEST)
    store.open(1, lambda s: None, lambda e: None)
    b = Broker(version=OLDEST)
    half = len(events) // 2
    for ev in events[:half]:
        b.apply(ev)
        assert store.record(b.event_seq, ev, b) is None
    m = meta.load(disk, "/store")
    assert m is not None and m.model_version == OLDEST
    assert "base_version" not in json.loads(disk.read(meta.path("/store")))  # as 0.1.0 wrote
    # The switch: the metadata says the new version before its event is journaled.
    raise_ev = AdminCommand(0, 1, "operator", RAISE_MODEL_VERSION, b'{"version": %d}' % NEWEST)
    b.apply(raise_ev)
    store.set_model_version(b.version.current)
    m = meta.load(disk, "/store")
    assert m is not None and (m.model_version, m.base_version) == (NEWEST, OLDEST)
    assert store.record(b.event_seq, raise_ev, b) is None
    for ev in events[half:]:
        b.apply(ev)
        assert store.record(b.event_seq, ev, b) is None
    assert store.syncer is not None
    store.syncer.barrier()
    rec = _store(disk, OLDEST).recover(b.config)
    assert rec is not None and rec.broker.version.current == NEWEST
    assert snapshot.digest(rec.broker) == snapshot.digest(b)


def test_a_store_this_software_cannot_apply_is_refused_naming_it_and_left_alone() -> None:
    disk = SimDisk()
    disk.makedirs("/store")
    meta.save(disk, "/store", meta.Meta("g", NEWEST + 1, 1, 0, None, meta.CLEAN, 5))
    before = {n: disk.read(f"/store/{n}") for n in disk.listdir("/store")}
    with pytest.raises(StoreMismatch) as e:
        _store(disk, OLDEST).recover(Broker().config)
    assert f"model version {NEWEST + 1}" in str(e.value)
    assert f"model versions {OLDEST} to {NEWEST}" in str(e.value)
    assert {n: disk.read(f"/store/{n}") for n in disk.listdir("/store")} == before


def test_the_version_does_not_move_while_a_member_that_joined_has_not_announced_itself() -> None:
    view = _ready_cluster((NEW, NEW, NEW))
    view.model_version = OLDEST
    # A fourth member joined: its hello (which release?) is not delivered yet.
    view.on_confchg([1, 2, 3, 4], [4], [])
    why = view.refuse_version(NEWEST)
    assert why is not None and "member(s) 4 joined the group but did not announce" in why
    view.on_hello(hello(4, STATUS_NEW, OLDEST, NEW))
    assert view.refuse_version(NEWEST) is None


def test_a_version_marked_before_a_crash_that_lost_its_switch_is_taken_back() -> None:
    disk = SimDisk()
    store = _store(disk, OLDEST)
    store.open(1, lambda s: None, lambda e: None)
    b = Broker(version=OLDEST)
    for ev in generate(13, steps=50):
        b.apply(ev)
        assert store.record(b.event_seq, ev, b) is None
    assert store.syncer is not None
    store.syncer.barrier()
    # The member marked the store for the switch, then died before journaling it.
    store.set_model_version(NEWEST)
    m = meta.load(disk, "/store")
    assert m is not None and m.model_version == NEWEST
    again = _store(disk, OLDEST)
    rec = again.recover(b.config)
    assert rec is not None and rec.broker.version.current == OLDEST
    again.open(rec.seq + 1, lambda s: None, lambda e: None)
    m = meta.load(disk, "/store")
    # Release 0.1.0 reads this store again.
    assert m is not None and m.model_version == OLDEST

"""The durability trace of a real directory (store/tracedisk.py) and the power cut applied from
it (dev/powercut.py): after a cut the directory holds what the contract of store/disk.py says
survives a power cut, and a store killed mid-flight recovers at least what it reported
durable."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import time
import warnings
from pathlib import Path

import pytest

from cpgbroker.dev.powercut import cut, power_off
from cpgbroker.errors import ConfigError
from cpgbroker.model.broker import Broker
from cpgbroker.model.events import Event
from cpgbroker.model.state import snapshot
from cpgbroker.model.versions import NEWEST
from cpgbroker.runtime.config.digest import config_digest
from cpgbroker.runtime.config.settings import from_dict
from cpgbroker.store.disk import OsDisk
from cpgbroker.store.store import Store, StoreSettings
from cpgbroker.store.tracedisk import TRACE_NAME, TracingDisk
from workload import generate


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != TRACE_NAME}


def _history(d: Path) -> TracingDisk:
    """A directory with one of each thing the contract distinguishes; see the comments."""
    disk = TracingDisk(str(d))
    # Durable on return.
    disk.write_atomic(str(d / "meta"), b"v1")
    # A durable name with 5 synced bytes and an unsynced tail.
    a = disk.open_append(str(d / "a"))
    a.write(b"hello")
    a.sync()
    disk.sync_dir(str(d))
    a.write(b" world")
    # A durable file renamed after the directory's last sync: the rename is undone.
    c = disk.open_append(str(d / "c"))
    c.write(b"cc")
    c.sync()
    c.close()
    disk.sync_dir(str(d))
    disk.rename(str(d / "c"), str(d / "c2"))
    # Synced bytes under a name that is not durable: lost whole.
    b = disk.open_append(str(d / "b"))
    b.write(b"bb")
    b.sync()
    b.close()
    # Created and written, never synced: lost whole too.
    e = disk.open_append(str(d / "e"))
    e.write(b"eee")
    e.close()
    a.close()
    return disk


def test_a_cut_keeping_nothing_unsynced_leaves_what_the_contract_makes_durable(
    tmp_path: Path,
) -> None:
    d = tmp_path / "store"
    disk = _history(d)
    disk.close()
    assert set(_files(d)) == {"meta", "a", "b", "c2", "e"}
    done = cut(d, random.Random(1), "none")
    assert _files(d) == {"meta": b"v1", "a": b"hello", "c": b"cc"}
    assert sorted(done.removed) == ["b", "e"]
    assert done.renames_undone == [("c", "c2")]
    assert done.bytes_dropped == len(b" world")


def test_a_random_cut_keeps_the_synced_bytes_and_a_prefix_of_the_rest(tmp_path: Path) -> None:
    kept = set()
    for seed in range(40):
        d = tmp_path / f"store{seed}"
        _history(d).close()
        cut(d, random.Random(seed), "random", garble=0.0)
        files = _files(d)
        assert set(files) == {"meta", "a", "c"}
        assert files["meta"] == b"v1" and files["c"] == b"cc"
        assert b"hello world".startswith(files["a"]) and len(files["a"]) >= 5
        kept.add(len(files["a"]))
    # None of the tail, all of it and cuts between all happen.
    assert {5, 11} <= kept and len(kept) > 3


def test_garbling_never_touches_synced_bytes(tmp_path: Path) -> None:
    garbled = 0
    for seed in range(40):
        d = tmp_path / f"store{seed}"
        _history(d).close()
        done = cut(d, random.Random(seed), "random", garble=1.0)
        a = (d / "a").read_bytes()
        assert a[:5] == b"hello" and len(a) <= 11
        garbled += done.files["a"][3] > 0
    assert garbled > 10


def test_a_second_cut_changes_nothing_and_later_writes_are_judged_from_the_cut(
    tmp_path: Path,
) -> None:
    d = tmp_path / "store"
    _history(d).close()
    cut(d, random.Random(7), "random")
    after = _files(d)
    again = cut(d, random.Random(8), "random")
    assert _files(d) == after and not again.removed and again.bytes_dropped == 0
    # A restarted process appends to a file the cut left, without syncing: only that is lost.
    disk = TracingDisk(str(d))
    a = disk.open_append(str(d / "a"))
    a.write(b"!unsynced")
    a.close()
    disk.close()
    cut(d, random.Random(9), "none")
    assert _files(d) == after


def test_files_the_trace_never_saw_are_left_alone(tmp_path: Path) -> None:
    d = tmp_path / "store"
    d.mkdir()
    (d / "old").write_bytes(b"from before tracing")
    disk = TracingDisk(str(d))
    f = disk.open_append(str(d / "old"))
    f.write(b", and more")
    f.close()
    n = disk.open_append(str(d / "new"))
    n.write(b"x")
    n.close()
    disk.sync_dir(str(d))
    disk.close()
    cut(d, random.Random(1), "none")
    assert _files(d) == {"old": b"from before tracing, and more", "new": b""}


def test_a_rename_over_an_existing_file_stands(tmp_path: Path) -> None:
    d = tmp_path / "store"
    disk = TracingDisk(str(d))
    for name in ("x", "y"):
        f = disk.open_append(str(d / name))
        f.write(name.encode())
        f.sync()
        f.close()
    disk.sync_dir(str(d))
    disk.rename(str(d / "x"), str(d / "y"))  # y's old bytes are gone: it cannot come back
    disk.close()
    done = cut(d, random.Random(1), "none")
    assert _files(d) == {"y": b"x"} and done.renames_kept == [("x", "y")]


def test_the_store_ignores_the_trace_file(tmp_path: Path) -> None:
    d = tmp_path / "s"
    settings = StoreSettings(str(d), segment_bytes=4096, snapshot_bytes=1 << 30)
    disk = TracingDisk(str(d))
    store = Store(settings, "g", NEWEST, disk=disk)
    assert store.recover(Broker().config) is None
    store.open(1, lambda _s: None, lambda _e: None)  # removes journal and snapshot files only
    b = Broker()
    for ev in generate(3, steps=60):
        b.apply(ev)
        assert store.record(b.event_seq, ev, b) is None
    store.close(clean=True, last_seq=b.event_seq)
    disk.close()
    assert (d / TRACE_NAME).stat().st_size > 0
    rec = Store(settings, "g", NEWEST, disk=OsDisk()).recover(b.config)
    assert rec is not None and rec.clean and rec.seq == b.event_seq


def test_sync_trace_is_a_members_own_setting() -> None:
    plain = {"cluster": {"group": "g"}, "store": {"dir": "/var/lib/x"}}
    traced = {"cluster": {"group": "g"}, "store": {"dir": "/var/lib/x", "sync_trace": True}}
    config = from_dict(traced)
    assert config.store is not None and config.store.sync_trace
    # Not compared between members: one member traced for a test still joins the others.
    assert config_digest(config) == config_digest(from_dict(plain))
    with pytest.raises(ConfigError, match="sync_trace"):
        from_dict({"store": {"dir": "/var/lib/x", "sync_trace": "yes"}})


# -- a store killed mid-flight (a forked process, SIGKILL), then cut


def _fork() -> int:
    # Python 3.12 warns about forking while other threads run (syncer threads of earlier
    # tests may): the child here only runs a store of its own and exits with os._exit.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _serve_and_wait_for_the_kill(settings: StoreSettings, events: list[Event], out: int) -> None:
    """In the forked child: journal ``events``, telling ``out`` each seq reported durable."""
    try:
        disk = TracingDisk(settings.directory)
        store = Store(settings, "g", NEWEST, disk=disk)

        def durable(seq: int) -> None:
            os.write(out, b"%d\n" % seq)

        store.open(1, durable, lambda _e: None)
        b = Broker()
        for i, ev in enumerate(events):
            b.apply(ev)
            store.record(b.event_seq, ev, b)
            if i % 16 == 15:
                time.sleep(0.001)  # the kill lands while records are written and synced
        time.sleep(60)
    finally:
        os._exit(0)


def _unsynced(d: Path) -> bool:
    """Whether a file holds bytes its trace does not say are synced."""
    synced: dict[str, int] = {}
    for line in (d / TRACE_NAME).read_bytes().splitlines():
        rec = json.loads(line)
        if rec[0] in ("N", "S"):
            synced[rec[1]] = 0 if rec[0] == "N" else rec[2]
    return any((d / n).exists() and (d / n).stat().st_size > k for n, k in synced.items())


def _durable_when_killed(settings: StoreSettings, events: list[Event], at: int) -> int:
    """Run a store in a child process until it reported event ``at`` durable, SIGKILL it; the
    last event it reported durable."""
    r, w = os.pipe()
    pid = _fork()
    if pid == 0:
        os.close(r)
        _serve_and_wait_for_the_kill(settings, events, w)
    os.close(w)
    buf, last = b"", 0

    def take(chunk: bytes) -> None:
        nonlocal buf, last
        *lines, buf = (buf + chunk).split(b"\n")
        if lines:
            last = int(lines[-1])

    deadline = time.monotonic() + 30
    try:
        while last < at:
            assert time.monotonic() < deadline, "the child never got there"
            if select.select([r], [], [], 1.0)[0]:
                chunk = os.read(r, 65536)
                assert chunk, "the child died"
                take(chunk)
        # The syncer reports each group just after its fsync: the kill waits until the child,
        # stopped, has written records it has not synced, so that a cut has something to cut.
        rng = random.Random(at)
        for _ in range(500):
            time.sleep(rng.uniform(0.001, 0.01))
            os.kill(pid, signal.SIGSTOP)
            os.waitpid(pid, os.WUNTRACED)
            if _unsynced(Path(settings.directory)):
                break
            os.kill(pid, signal.SIGCONT)
        else:
            pytest.fail("the child never had unsynced records")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    while chunk := os.read(r, 65536):
        take(chunk)
    os.close(r)
    return last


@pytest.mark.parametrize(
    ("seed", "keep"), [(1, "none"), (2, "none"), (3, "random"), (4, "random"), (5, "random")]
)
def test_a_killed_store_cut_recovers_everything_it_reported_durable(
    tmp_path: Path, seed: int, keep: str
) -> None:
    events: list[Event] = list(generate(seed, steps=1500))
    # Synced every 20 ms (the others written at once): a kill finds an unsynced tail. Small
    # segments and snapshots: rolls, snapshots and segment deletions happen before it.
    settings = StoreSettings(
        str(tmp_path / "s"),
        fsync="interval",
        fsync_interval_ms=20,
        segment_bytes=16 * 1024,
        snapshot_bytes=64 * 1024,
    )
    rng = random.Random(seed)
    durable = _durable_when_killed(
        settings, events, rng.randint(len(events) // 5, len(events) // 2)
    )
    done = cut(tmp_path / "s", rng, "none" if keep == "none" else "random")
    rec = Store(settings, "g", NEWEST, disk=OsDisk()).recover(Broker().config)
    assert rec is not None, done.summary()
    assert rec.seq >= durable, (rec.seq, durable, done.summary())
    b = Broker()
    for ev in events[: rec.seq]:
        b.apply(ev)
    assert snapshot.digest(rec.broker) == snapshot.digest(b)
    if keep == "none":
        assert done.bytes_dropped > 0 or done.removed, done.summary()


def test_power_off_kills_a_process_and_its_descendants_at_once(tmp_path: Path) -> None:
    r, w = os.pipe()
    pid = _fork()
    if pid == 0:
        try:
            os.close(r)
            grandchild = _fork()
            if grandchild == 0:
                time.sleep(60)
            else:
                os.write(w, b"%d\n" % grandchild)
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    grandchild = int(os.read(r, 64))
    os.close(r)
    power_off([pid])
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    stat = Path(f"/proc/{grandchild}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX"

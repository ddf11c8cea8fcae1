"""A member's durable store: recovery at start, the journal while serving, snapshots, metadata.

Theory of operation
-------------------
The store records what the member applied, not a separate durable model: every event of the
stream the member applies is appended to the journal (``store/journal.py``) by
:meth:`Store.append`, and a thread (``store/syncer.py``) writes and fsyncs what was appended
since its last fsync in one go (group commit), so the deliver loop never waits for the disk.
Because the model is deterministic, the snapshot the journal starts from plus the journal
replayed in order rebuild exactly the model the member had after its last durable event: the
same digest every replica had there.

* **Durable sequence.** The syncer reports the last event on disk; the member reports it to
  the others with its progress, and a confirm that covers a persistent message on a durable
  queue goes out once every ready member's store holds its event (runtime/member/member.py). Until a
  store that was replaced by a state update holds the snapshot it starts from, it vouches for
  nothing (:attr:`Store.durable` is 0).
* **Snapshots.** When the journal since the base has grown past ``snapshot_bytes``, the
  member forks a child that writes the model as of the last applied event (copy on write; the
  member goes on at once) while the journal starts a new segment at the next event. Once the
  snapshot file is durable, the metadata names it as the base and the segments before it are
  deleted: the journal never grows without bound under a steady load.
* **Recovery** (:meth:`Store.recover`, blocking: the process runs it in a thread) loads the
  base snapshot and replays the journal to its last whole record; a torn tail is cut and
  logged, corruption before it raises ``StoreCorrupt`` naming the file and offset (the member
  then takes a state update instead). The recovered model still has the connections the
  stopped members had: the cluster closes them and drops what a restart drops when it resumes
  (``Recovered``), through the stream, so every later replay does the same.
* **State updates.** A member that takes a state update replaces its store
  (:meth:`Store.replace`): the metadata says ``replacing`` until the snapshot of the installed
  state is durable, so a crash in between recovers nothing rather than a mix of two histories.

A standalone broker with ``[store]`` uses the same store as a member that never has peers
(runtime/process/standalone.py): it journals what it applies, and recovers and restarts alone.

Owns: the store directory, the syncer and its journal writer, the snapshot child in progress,
the metadata. Never decides whether to recover or whose state wins (the cluster's stream does)
and never touches the event loop: the runtime passes callbacks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from cpgbroker.errors import ConfigError
from cpgbroker.model import CLUSTER_WIDE, NEWEST, OLDEST, Broker, BrokerConfig, supports
from cpgbroker.model.events import ClientConnected
from cpgbroker.store import meta, records, snapfile
from cpgbroker.store.disk import Disk, OsDisk, StoreCorrupt, StoreError
from cpgbroker.store.journal import JournalWriter, read_journal
from cpgbroker.store.syncer import Syncer

log = logging.getLogger("cpgbroker.store")

FSYNC_POLICIES = ("always", "interval", "never")
RECOVER_WITH = ("all", "majority")
PROGRESS_EVERY_S = 2.0


class StoreMismatch(StoreError):
    """The store belongs to another cluster or model version: never recovered, never merged."""


MiB = 2**20


def _setting(test: Callable[[Any], bool], why: str) -> Callable[[Any, Any, Any], None]:
    """A validator of a ``[store]`` key, named as in the file: ``test(value)`` or ConfigError."""

    def validate(_settings: Any, field: attrs.Attribute[Any], value: Any) -> None:
        if not test(value):
            raise ConfigError(f"[store] {field.metadata.get('key', field.name)} {why}")

    return validate


_POSITIVE = _setting(lambda v: v >= 1, "must be a positive integer")


@attrs.frozen
class StoreSettings:
    """``[store]`` of cpgbroker.toml: each field is a key (runtime/config/sections.py reads it),
    named in the file as its metadata's ``key`` says, in MiB where it says ``scale``."""

    KEY: ClassVar[str] = "[store] {}"

    # "" (no ``dir`` in the file): no store, the broker keeps its state in memory only.
    directory: str = attrs.field(default="", metadata={"key": "dir"})
    # "always": a durable confirm waits for an fsync of its event on every ready member (one
    # fsync covers everything applied since the previous one). "interval": fsync at most every
    # ``fsync_interval_ms``; confirms still wait for it (fewer fsyncs, more latency).
    # "never": written to the OS, never fsynced; confirms wait only for the write, so what
    # they vouch for survives the processes being killed but not the machines losing power.
    fsync: str = attrs.field(
        default="always",
        validator=_setting(
            lambda v: v in FSYNC_POLICIES, f"must be one of {', '.join(FSYNC_POLICIES)}"
        ),
    )
    fsync_interval_ms: int = attrs.field(default=20, metadata={"scale": 1}, validator=_POSITIVE)
    segment_bytes: int = attrs.field(
        default=64 * MiB, metadata={"key": "segment_mib", "scale": MiB}, validator=_POSITIVE
    )
    # Journal bytes since the last snapshot that trigger the next one.
    snapshot_bytes: int = attrs.field(
        default=256 * MiB, metadata={"key": "snapshot_mib", "scale": MiB}, validator=_POSITIVE
    )
    # Below this much free space on the store's file system the member raises a disk alarm
    # and publishers are blocked cluster-wide (RabbitMQ's disk_free_limit; 0: never).
    free_disk_limit: int = attrs.field(
        default=50 * MiB,
        metadata={"key": "free_disk_limit_mib", "scale": MiB},
        validator=_setting(lambda v: v >= 0, "must be 0 (off) or a positive integer"),
    )
    # A test facility, off in production: record what each fsync made durable in
    # ``sync-trace.log`` in the store directory (store/tracedisk.py), so that a test can put
    # the directory of a killed process into a state a power cut could leave
    # (dev/powercut.py). One short write per fsync. Each member's own: not cluster-wide.
    sync_trace: bool = False
    # Cluster members only (the configuration refuses it without ``[cluster]``).
    # "all": after a whole-cluster stop the cluster resumes once all ``size`` members are back
    # (the freshest store among them); a confirm waits for the stores of the members that
    # serve, however few. "majority": it resumes once a majority of ``size`` is back, and a
    # confirm that waits for the stores also needs a majority of ``size`` serving (RabbitMQ's
    # quorum queues), so the freshest store of any majority holds it.
    recover_with: str = attrs.field(
        default="all",
        metadata=CLUSTER_WIDE,
        validator=_setting(
            lambda v: v in RECOVER_WITH, f"must be one of {', '.join(RECOVER_WITH)}"
        ),
    )


@attrs.define
class Recovery:
    """What :meth:`Store.recover` found."""

    broker: Broker
    seq: int
    epoch: int
    clean: bool
    records: int
    bytes: int
    seconds: float
    torn: Any = None


@attrs.define
class RecoveryProgress:
    """Read by ``status`` while recovery runs in its thread (plain values: no lock needed)."""

    phase: str = "idle"
    snapshot_bytes: int = 0
    journal_bytes: int = 0
    records: int = 0
    bytes_replayed: int = 0
    started: float = 0.0
    finished: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        end = self.finished or time.monotonic()
        elapsed = end - self.started if self.started else 0.0
        total = self.journal_bytes
        left = None
        if self.phase == "replaying" and self.bytes_replayed and total:
            left = round(elapsed * (total - self.bytes_replayed) / self.bytes_replayed, 1)
        return {
            "phase": self.phase,
            "records_replayed": self.records,
            "bytes_replayed": self.bytes_replayed,
            "journal_bytes": total,
            "snapshot_bytes": self.snapshot_bytes,
            "elapsed_s": round(elapsed, 1),
            "seconds_left": left,
        }


class Store:
    def __init__(
        self,
        settings: StoreSettings,
        group: str,
        model_version: int = OLDEST,
        *,
        disk: Disk | None = None,
        fork: Callable[[Callable[[], None], str], int] | None = None,
    ) -> None:
        if settings.fsync not in FSYNC_POLICIES:
            raise StoreError(f"[store] fsync must be one of {', '.join(FSYNC_POLICIES)}")
        self.settings = settings
        self.dir = settings.directory
        self.group = group
        # The model version of what the store holds and journals (model/versions.py), written
        # in its metadata: a release that cannot apply it refuses the store, never misreads it.
        # Raised (set_model_version) before the first event of a newer version is journaled.
        self.model_version = model_version
        # The version of the empty base (no snapshot): see meta.py.
        self.base_version = model_version
        # Whether the base is the empty initial state (not a snapshot, nor a state update's
        # state whose snapshot is still being written).
        self.empty_base = True
        self.disk: Disk = OsDisk() if disk is None else disk
        # Runs a snapshot writer in a forked child and returns its pid; None: write inline
        # (tests on a simulated disk).
        self._fork = fork
        self.epoch = 1
        self.base_seq = 0
        self.snapshot_name: str | None = None
        self.syncer: Syncer | None = None
        # Set from the syncer thread: the last event on disk, and the first write error.
        self._synced = 0
        self.failed: OSError | None = None
        # A store being replaced vouches for nothing until its new base is durable.
        self.replacing = False
        self.journal_bytes = 0  # appended since the base
        # The event the journal takes next.
        self.next_seq = 1
        self.snapshotting: tuple[int, int, str] | None = None  # (pid, seq, file name)
        self.progress = RecoveryProgress()
        # Said in the metadata: the checksum of the settings file kept beside it (meta.py).
        self.settings_tag: str | None = None
        self.snapshots_taken = 0
        self._on_durable: Callable[[int], None] = _ignore
        self._on_error: Callable[[OSError], None] = _ignore_error

    # ------------------------------------------------------------------ recovery

    def recover(self, config: BrokerConfig) -> Recovery | None:
        """The model this store holds, replayed to its last whole record; None when there is
        nothing to recover. Blocking (run it in a thread). Raises ``StoreMismatch`` for a
        store of another cluster or model version and ``StoreCorrupt`` for one that cannot be
        trusted, naming the file and offset."""
        disk = self.disk
        disk.makedirs(self.dir)
        m = meta.load(disk, self.dir)
        if m is None:
            return None
        where = meta.path(self.dir)
        if m.group != self.group:
            raise StoreMismatch(
                f"the store at {self.dir} belongs to cluster group {m.group!r}, this member is "
                f"configured for {self.group!r}: it is never merged into another cluster; move "
                "it aside or point [store] dir elsewhere"
            )
        if not supports(m.model_version):
            raise StoreMismatch(
                f"the store at {self.dir} holds a state at model version {m.model_version}; "
                f"this software applies model versions {OLDEST} to {NEWEST} and cannot replay "
                f"it ({where}). Nothing was changed: start this member with a release that "
                f"applies model version {m.model_version}"
            )
        self.model_version = m.model_version
        self.base_version = m.model_version if m.base_version is None else m.base_version
        self.settings_tag = m.settings
        self.epoch = m.epoch
        if m.state == meta.REPLACING:
            log.warning(
                "the store at %s was being replaced by a state update when the member stopped: "
                "nothing to recover from it",
                self.dir,
            )
            return None
        t0 = time.monotonic()
        p = self.progress
        p.started = t0
        p.phase = "loading-snapshot"
        segments = [n for n in disk.listdir(self.dir) if n.startswith("journal-")]
        p.journal_bytes = sum(disk.size(os.path.join(self.dir, n)) for n in segments)
        if m.snapshot is not None:
            spath = os.path.join(self.dir, m.snapshot)
            if not disk.exists(spath):
                raise StoreCorrupt(
                    f"{spath}: offset 0: the snapshot the store starts from is missing"
                )
            p.snapshot_bytes = disk.size(spath)
            # Streamed: a snapshot of a large state is not held whole beside the model.
            with disk.open_read(spath) as f:
                broker = snapfile.read(f, spath, config)
            if broker.event_seq != m.base_seq:
                raise StoreCorrupt(
                    f"{spath}: holds event {broker.event_seq}, the metadata says {m.base_seq}"
                )
        else:
            if m.base_seq != 0:
                raise StoreCorrupt(f"{where}: base event {m.base_seq} without a snapshot")
            broker = Broker(config, version=self.base_version)
        log.info(
            "recovering from the store at %s: %s from event %d, %.1f MiB of journal (%s)",
            self.dir,
            "snapshot" if m.snapshot else "the empty state",
            m.base_seq,
            p.journal_bytes / 2**20,
            "stopped cleanly" if m.state == meta.CLEAN else "not stopped cleanly",
        )
        p.phase = "replaying"
        # A hot-standby replica's base may come from an update that left out messages
        # consumed while it was sent (model/standby/replica.py): their records are skipped again.
        broker.replication.catch_up(True)
        scan = read_journal(disk, self.dir, m.base_seq)
        next_report = t0 + PROGRESS_EVERY_S
        fail_text = "internal error while processing this connection"
        for seq, payload in scan:
            ev, failed = records.decode(payload)
            if seq != broker.event_seq + 1:
                raise StoreCorrupt(f"{self.dir}: journal event {seq} after {broker.event_seq}")
            if failed:
                broker.count_failed_event(seq)
                broker.fail_event(ev, fail_text)
            else:
                broker.apply(ev)
                if type(ev) is ClientConnected:
                    broker.set_emit(ev.conn, False)  # nobody reads a replay's output
            p.records += 1
            p.bytes_replayed += len(payload) + 16
            if p.records % 4096 == 0 and time.monotonic() >= next_report:
                next_report += PROGRESS_EVERY_S
                left = p.as_dict()["seconds_left"]
                log.info(
                    "recovering: %d records, %.1f of %.1f MiB replayed, about %s s left",
                    p.records,
                    p.bytes_replayed / 2**20,
                    p.journal_bytes / 2**20,
                    left,
                )
        broker.replication.catch_up(False)
        torn = getattr(scan, "torn", None)
        if torn:
            log.warning(
                "the journal's last record was torn (a crash while writing it): cut %s bytes at "
                "offset %s of %s",
                torn[2],
                torn[1],
                torn[0],
            )
        if m.state == meta.CLEAN and broker.event_seq < m.last_seq:
            raise StoreCorrupt(
                f"{self.dir}: stopped cleanly after event {m.last_seq} but the journal ends at "
                f"{broker.event_seq}"
            )
        p.phase = "recovered"
        p.finished = time.monotonic()
        self.base_seq = m.base_seq
        self.snapshot_name = m.snapshot
        self.empty_base = m.snapshot is None
        # What the journal holds now is what was replayed (a torn tail is cut): a version
        # marked before a crash whose switch never reached the journal is taken back, so the
        # release before it can still read this store.
        self.model_version = broker.version.current
        self.journal_bytes = p.journal_bytes
        r = Recovery(
            broker,
            broker.event_seq,
            m.epoch,
            m.state == meta.CLEAN,
            p.records,
            p.bytes_replayed,
            time.monotonic() - t0,
            torn,
        )
        log.info(
            "recovered event %d (epoch %d) from the store: %d records, %.1f MiB replayed in %.1f s",
            r.seq,
            r.epoch,
            r.records,
            r.bytes / 2**20,
            r.seconds,
        )
        return r

    def discard(self, why: str) -> None:
        """Move what is in the store directory aside (it cannot be used): kept for the
        operator to look at, never read again."""
        disk = self.disk
        if not disk.exists(self.dir) or not disk.listdir(self.dir):
            return
        aside = f"{self.dir.rstrip('/')}.discarded-{int(time.time())}"
        disk.rename(self.dir, aside)
        disk.makedirs(self.dir)
        log.error("store moved aside to %s: %s", aside, why)

    # ------------------------------------------------------------------ writing

    def open(
        self,
        next_seq: int,
        on_durable: Callable[[int], None],
        on_error: Callable[[OSError], None],
    ) -> None:
        """Start journaling at event ``next_seq`` (after recovering the store, or on an empty
        store with ``next_seq`` 1). ``on_durable(seq)`` and ``on_error(exc)`` are called from
        the syncer thread."""
        disk = self.disk
        disk.makedirs(self.dir)
        if next_seq == 1:
            # Nothing recovered: whatever files are here (a replacement that never finished,
            # a crash before the metadata was first written) hold nothing to keep.
            self._remove_files()
        self._on_durable = on_durable
        self._synced = next_seq - 1
        self.next_seq = next_seq
        self._start_syncer(next_seq, on_error)
        self._save_meta(meta.SERVING)

    def _start_syncer(self, next_seq: int, on_error: Callable[[OSError], None]) -> None:
        s = self.settings
        writer = JournalWriter(self.disk, self.dir, next_seq, s.segment_bytes)

        def durable(seq: int) -> None:
            self._synced = seq
            self._on_durable(seq)

        def error(exc: OSError) -> None:
            self.failed = exc
            on_error(exc)

        self._on_error = on_error
        self.syncer = Syncer(writer, s.fsync, s.fsync_interval_ms, durable, error)

    @property
    def durable(self) -> int:
        """The last event this store would recover (0 while it is being replaced)."""
        return 0 if self.replacing else self._synced

    def record(self, seq: int, event: Any, broker: Broker, failed: bool = False) -> OSError | None:
        """Journal event ``seq`` (``broker`` has just applied it, or the cluster failed it),
        and snapshot ``broker`` if the journal has grown enough since the last one. Returns
        the store's write error instead, if it has one: it can then vouch for nothing more.
        Per event: an encode and a queue append (the syncer checks the sequence)."""
        if self.failed is not None:
            return self.failed
        self.next_seq = seq + 1
        payload = records.encode(event, failed)
        self.journal_bytes += len(payload) + 16
        syncer = self.syncer
        assert syncer is not None
        syncer.submit(seq, payload)
        if self.journal_bytes >= self.settings.snapshot_bytes and self.snapshotting is None:
            self.snapshot(broker)
        return None

    def replace(self, broker: Broker) -> None:
        """A state update installed ``broker``: it replaces what the store held. The journal
        starts afresh after it; the store vouches for nothing until the snapshot of this
        state is durable."""
        seq = broker.event_seq
        # The event it holds, not its base: a store without a snapshot has base event 0.
        log.info(
            "replacing the store at %s (epoch %d, holding event %d) with the state of event %d",
            self.dir,
            self.epoch,
            self.next_seq - 1,
            seq,
        )
        self.replacing = True
        self.empty_base = False
        self.model_version = self.base_version = broker.version.current
        self._save_meta(meta.REPLACING)
        if self.syncer is not None:
            self.syncer.close()
            self.syncer = None
        self.failed = None
        self._remove_files()
        self.base_seq = seq
        self.snapshot_name = None
        self._synced = seq
        self.journal_bytes = 0
        self.next_seq = seq + 1
        self._start_syncer(seq + 1, self._on_error)
        self.snapshot(broker)

    def _remove_files(self) -> None:
        disk = self.disk
        for n in disk.listdir(self.dir):
            if n.startswith(("journal-", "snapshot-")):
                disk.remove(os.path.join(self.dir, n))

    def snapshot(self, broker: Broker) -> None:
        """Write the model as of now (event ``broker.event_seq``) as the new base."""
        if self.snapshotting is not None:
            return
        seq = broker.event_seq
        name = snapfile.name(seq)
        syncer = self.syncer
        assert syncer is not None
        # Segments after this one start after the snapshot's event: once it is durable, every
        # segment before can go whole.
        syncer.roll()
        self.journal_bytes = 0
        path = os.path.join(self.dir, name)
        if self._fork is None:
            snapfile.write(self.disk, path, broker)
            self.snapshotting = (0, seq, name)
            self.snapshot_done(0, True)
            return
        disk = self.disk
        pid = self._fork(
            lambda: _write_snapshot(disk, path, broker), f"store snapshot at event {seq}"
        )
        self.snapshotting = (pid, seq, name)
        log.info("writing a store snapshot at event %d (child pid %d)", seq, pid)

    def snapshot_done(self, pid: int, ok: bool) -> None:
        """The snapshot child ``pid`` exited: if it wrote its file, that file is the base."""
        cur = self.snapshotting
        if cur is None or cur[0] != pid:
            return
        self.snapshotting = None
        _pid, seq, name = cur
        if not ok:
            log.error("the store snapshot at event %d failed; the journal keeps growing", seq)
            return
        old = self.snapshot_name
        self.base_seq = seq
        self.snapshot_name = name
        self.empty_base = False
        was_replacing = self.replacing
        self.replacing = False
        self.snapshots_taken += 1
        self._save_meta(meta.SERVING)
        disk = self.disk
        if old is not None and old != name:
            disk.remove(os.path.join(self.dir, old))
        if self.syncer is not None:
            # In order with the records: the syncer owns the journal's files.
            self.syncer.delete_through(seq)
        if was_replacing:
            log.info("the store holds the state update's event %d: it vouches again", seq)
            self._on_durable(self._synced)

    def close(self, clean: bool, last_seq: int) -> None:
        """Stop journaling; with ``clean`` (a stop, not a failure) wait for everything to be
        on disk and mark the store clean. ``last_seq``: the last event the member applied,
        which the store must hold."""
        syncer, self.syncer = self.syncer, None
        if syncer is None:
            return
        if clean and self.failed is None:
            syncer.barrier()
        syncer.close()
        if clean and self.failed is None and not self.replacing and self._synced >= last_seq:
            # What the store holds, not what the caller applied: a member stopped before it
            # applied anything after recovery (waiting for the others to come back) passes 0
            # while its store holds every event it recovered.
            held = self._synced
            self._save_meta(meta.CLEAN, held)
            log.info("store closed cleanly at event %d", held)

    def set_model_version(self, version: int) -> None:
        """What this member applies runs model ``version`` from the next event on: said in
        the metadata before any such event is journaled."""
        if version == self.model_version:
            return
        if self.empty_base and self.next_seq == 1:
            # Nothing journaled on the empty base: the cluster starts at this version.
            self.base_version = version
        elif version < self.model_version:
            return  # never down: the journal may hold events of the newer version
        self.model_version = version
        if self.syncer is not None and not self.replacing:
            self._save_meta(meta.SERVING)

    def new_epoch(self) -> int:
        """A forced boot: the history from here is a new one that must win over every store
        that did not see it."""
        self.epoch += 1
        if self.syncer is not None:
            self._save_meta(meta.SERVING)
        return self.epoch

    def _save_meta(self, state: str, last_seq: int = 0) -> None:
        meta.save(
            self.disk,
            self.dir,
            meta.Meta(
                self.group,
                self.model_version,
                self.epoch,
                self.base_seq,
                self.snapshot_name,
                state,
                last_seq,
                # Only where no snapshot says it, and only when it says more (a store of the
                # oldest version keeps release 0.1.0's metadata).
                self.base_version
                if self.empty_base and self.base_version != self.model_version
                else None,
                self.settings_tag,
            ),
        )

    def set_settings_tag(self, tag: str) -> None:
        """The settings file beside the metadata was just replaced: the metadata says which."""
        self.settings_tag = tag
        if self.syncer is not None and not self.replacing:
            self._save_meta(meta.SERVING)

    def disk_low(self) -> bool:
        """Whether the store's file system has less free space than the limit."""
        limit = self.settings.free_disk_limit
        return limit > 0 and self.disk.free_bytes(self.dir) < limit

    def status(self) -> dict[str, Any]:
        syncer = self.syncer
        out: dict[str, Any] = {
            "dir": self.dir,
            "fsync": self.settings.fsync,
            "epoch": self.epoch,
            "base_seq": self.base_seq,
            "durable_seq": self.durable,
            "replacing": self.replacing,
            "journal_bytes": self.journal_bytes,
            "snapshotting": None if self.snapshotting is None else self.snapshotting[1],
            "snapshots": self.snapshots_taken,
            "failed": None if self.failed is None else str(self.failed),
            "recovery": self.progress.as_dict(),
        }
        if syncer is not None:
            out.update(
                fsyncs=syncer.fsyncs,
                bytes_written=syncer.bytes_written,
                records_written=syncer.records_written,
                batches=syncer.batches,
            )
        return out


def _ignore(_seq: int) -> None:
    return None


def _ignore_error(_exc: OSError) -> None:
    return None


def _write_snapshot(disk: Disk, path: str, broker: Broker) -> None:
    # The store's own disk, not a fresh OsDisk: a tracing disk (tracedisk.py) must see the
    # snapshot's sync, rename and directory sync too.
    snapfile.write(disk, path, broker)

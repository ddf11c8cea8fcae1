"""The syncer (store/syncer.py): group commit from its own thread, the three fsync policies,
barriers and close, and failures (reported once, nothing after them reported durable).

No test sleeps to let the thread run: they hold the thread in an fsync (a gate), wait for
what it reports, or drive the interval policy's clock by hand; every wait has a deadline.
"""

from __future__ import annotations

import errno
import random
import threading
from collections.abc import Callable

import pytest

from cpgbroker.store.disk import AppendFile, SimDisk, StoreError
from cpgbroker.store.journal import JournalWriter, read_journal
from cpgbroker.store.syncer import Syncer

DEADLINE = 10.0


class GatedFile:
    def __init__(self, disk: GatedDisk, inner: AppendFile) -> None:
        self._disk = disk
        self._inner = inner

    def write(self, data: bytes) -> None:
        self._inner.write(data)
        self._disk.wrote.set()

    def sync(self) -> None:
        self._disk.in_sync.set()
        assert self._disk.gate.wait(DEADLINE), "the test never opened the gate"
        self._inner.sync()

    def close(self) -> None:
        self._inner.close()

    def tell(self) -> int:
        return self._inner.tell()


class GatedDisk(SimDisk):
    """A SimDisk whose file syncs wait for ``gate`` and that says when files were written."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.in_sync = threading.Event()
        self.wrote = threading.Event()

    def open_append(self, path: str) -> AppendFile:
        return GatedFile(self, super().open_append(path))


class Durable:
    """Records on_durable and on_error calls (made from the syncer thread)."""

    def __init__(self, check: Callable[[int], None] | None = None) -> None:
        self.seqs: list[int] = []
        self.errors: list[OSError] = []
        self.problems: list[str] = []
        self._cond = threading.Condition()
        self._check = check

    def on_durable(self, seq: int) -> None:
        if self._check is not None:
            try:
                self._check(seq)
            except AssertionError as e:
                self.problems.append(f"on_durable({seq}): {e}")
        with self._cond:
            self.seqs.append(seq)
            self._cond.notify_all()

    def on_error(self, exc: OSError) -> None:
        with self._cond:
            self.errors.append(exc)
            self._cond.notify_all()

    def wait_for(self, seq: int) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: bool(self.seqs) and self.seqs[-1] >= seq, DEADLINE)
        assert ok, f"never durable up to {seq}: {self.seqs[-5:]}"

    def wait_error(self) -> OSError:
        with self._cond:
            assert self._cond.wait_for(lambda: bool(self.errors), DEADLINE), "no on_error"
        return self.errors[0]


def payload(seq: int) -> bytes:
    return seq.to_bytes(8, "big") * (1 + seq % 5)


def make(
    disk: SimDisk,
    policy: str = "always",
    interval_ms: int = 20,
    next_seq: int = 1,
    rec: Durable | None = None,
    segment_bytes: int = 4096,
    **kw: object,
) -> tuple[Syncer, Durable]:
    rec = rec or Durable()
    w = JournalWriter(disk, "/j", next_seq, segment_bytes)
    s = Syncer(w, policy, interval_ms, rec.on_durable, rec.on_error, **kw)  # type: ignore[arg-type]
    return s, rec


def journal(disk: SimDisk) -> list[tuple[int, bytes]]:
    return list(read_journal(disk, "/j", 0))


def test_group_commit_one_fsync_for_everything_submitted_during_the_previous() -> None:
    disk = GatedDisk()
    s, rec = make(disk, segment_bytes=1 << 20)
    disk.gate.clear()
    s.submit(1, payload(1))
    assert disk.in_sync.wait(DEADLINE)  # the thread is in the first batch's fsync
    for seq in range(2, 1001):
        s.submit(seq, payload(seq))
    disk.gate.set()
    assert s.barrier(DEADLINE) == 1000
    assert s.fsyncs == 2
    assert rec.seqs == [1, 1000]
    assert (s.records_written, s.durable_seq) == (1000, 1000)
    assert s.batches == 2
    s.close()
    assert journal(disk) == [(q, payload(q)) for q in range(1, 1001)]
    assert not rec.errors


def test_a_batch_stops_growing_at_batch_bytes() -> None:
    disk = GatedDisk()
    s, rec = make(disk, segment_bytes=1 << 20, batch_bytes=200)
    disk.gate.clear()
    s.submit(1, payload(1))
    assert disk.in_sync.wait(DEADLINE)
    for seq in range(2, 101):
        s.submit(seq, payload(seq))
    disk.gate.set()
    assert s.barrier(DEADLINE) == 100
    assert s.batches > 10
    assert rec.seqs == sorted(set(rec.seqs)) and rec.seqs[-1] == 100
    s.close()


@pytest.mark.parametrize("policy", ["always", "interval"])
def test_on_durable_is_monotonic_and_never_ahead_of_the_disk(policy: str) -> None:
    disk = SimDisk()

    def check(seq: int) -> None:
        # Called in the syncer thread: nothing else writes meanwhile. Whatever a power cut now
        # keeps, every record up to seq survives intact.
        for seed in range(3):
            crashed = disk.copy()
            crashed.crash(random.Random(seed))
            got = journal(crashed)
            assert len(got) >= seq, f"crash kept {len(got)}"
            assert got[:seq] == [(q, payload(q)) for q in range(1, seq + 1)]

    rec = Durable(check)
    s, _ = make(disk, policy, interval_ms=1, rec=rec)
    rng = random.Random(5)
    seq = 0
    for _round in range(30):
        for _ in range(rng.randint(1, 20)):
            seq += 1
            s.submit(seq, payload(seq))
        if rng.random() < 0.2:
            s.roll()
    rec.wait_for(seq)
    s.close()
    assert not rec.problems, rec.problems
    assert rec.seqs == sorted(set(rec.seqs))
    assert rec.seqs[-1] == seq


def test_never_reports_written_records_without_fsyncing() -> None:
    disk = GatedDisk()
    s, rec = make(disk, "never")
    for seq in range(1, 51):
        s.submit(seq, payload(seq))
    rec.wait_for(50)
    assert s.fsyncs == 0
    assert len(journal(disk)) == 50  # written to the OS
    assert s.barrier(DEADLINE) == 50  # a barrier fsyncs whatever the policy
    assert s.fsyncs == 1
    s.close()


def test_interval_writes_at_once_and_fsyncs_at_most_every_interval() -> None:
    now = [100.0]
    disk = GatedDisk()
    s, rec = make(disk, "interval", interval_ms=100, clock=lambda: now[0])
    s.submit(1, payload(1))
    assert disk.wrote.wait(DEADLINE)
    # Written at once, but the interval since the syncer started has not passed: no fsync.
    assert s.fsyncs == 0 and rec.seqs == []
    now[0] += 0.5
    s.submit(2, payload(2))
    rec.wait_for(2)  # the interval passed: one fsync covers both
    assert s.fsyncs == 1
    disk.wrote.clear()
    s.submit(3, payload(3))
    assert disk.wrote.wait(DEADLINE)
    assert s.fsyncs == 1 and rec.seqs == [2]
    # Nothing more is submitted: the thread's own timer fsyncs once the interval is over.
    now[0] += 0.5
    rec.wait_for(3)
    assert s.fsyncs == 2
    s.close()


def test_roll_and_delete_through_happen_in_order_with_the_records() -> None:
    disk = SimDisk()
    s, _rec = make(disk)
    for seq in range(1, 11):
        s.submit(seq, payload(seq))
    s.roll()
    for seq in range(11, 21):
        s.submit(seq, payload(seq))
    assert s.barrier(DEADLINE) == 20
    assert [n for n in disk.listdir("/j") if n.startswith("journal-")] == [
        "journal-00000000000000000001.log",
        "journal-00000000000000000011.log",
    ]
    s.delete_through(10)
    s.barrier(DEADLINE)
    assert disk.listdir("/j") == ["journal-00000000000000000011.log"]
    s.close()
    assert list(read_journal(disk, "/j", 10)) == [(q, payload(q)) for q in range(11, 21)]


def test_close_drains_syncs_and_joins() -> None:
    disk = SimDisk()
    s, rec = make(disk, "never", next_seq=7)
    for seq in range(7, 107):
        s.submit(seq, payload(seq))
    s.close()
    assert rec.seqs[-1] == 106
    assert s.fsyncs == 1  # close syncs, whatever the policy
    disk.crash(random.Random(0))
    assert [q for q, _p in read_journal(disk, "/j", 6)] == list(range(7, 107))
    with pytest.raises(StoreError, match="closed"):
        s.submit(107, b"late")
    with pytest.raises(StoreError, match="closed"):
        s.barrier(DEADLINE)
    s.close()  # twice is fine


def test_submit_wants_consecutive_seqs() -> None:
    s, _rec = make(SimDisk(), next_seq=3)
    with pytest.raises(ValueError, match="expected 3"):
        s.submit(4, b"x")
    s.submit(3, b"x")
    s.close()


def test_a_policy_must_be_known() -> None:
    w = JournalWriter(SimDisk(), "/j", 1)
    with pytest.raises(ValueError, match="fsync policy"):
        Syncer(w, "sometimes", 1, lambda s: None, lambda e: None)


@pytest.mark.parametrize(("op", "err"), [("write", errno.ENOSPC), ("sync", errno.EIO)])
def test_a_failure_is_reported_once_and_nothing_after_it_is_durable(op: str, err: int) -> None:
    disk = SimDisk()
    s, rec = make(disk)
    for seq in range(1, 6):
        s.submit(seq, payload(seq))
    assert s.barrier(DEADLINE) == 5
    disk.fail(op, err, times=3)
    for seq in range(6, 11):
        s.submit(seq, payload(seq))
    exc = rec.wait_error()
    assert exc.errno == err
    assert s.failed is exc
    for seq in range(11, 21):
        s.submit(seq, payload(seq))  # dropped, never written
    with pytest.raises(StoreError, match="could not be synced") as e:
        s.barrier(DEADLINE)
    assert e.value.__cause__ is exc
    s.close()
    assert rec.errors == [exc]
    assert rec.seqs == [5] and s.durable_seq == 5
    disk.crash(random.Random(1))
    got = journal(disk)
    assert got[:5] == [(q, payload(q)) for q in range(1, 6)]
    assert all(q <= 10 for q, _p in got)


def test_a_failure_to_create_a_segment_is_reported() -> None:
    disk = SimDisk()
    s, rec = make(disk)
    s.submit(1, b"one")
    s.barrier(DEADLINE)
    disk.fail("open_append", errno.ENOSPC)
    s.roll()
    assert rec.wait_error().errno == errno.ENOSPC
    s.close()
    assert rec.seqs == [1]


def test_a_bug_in_the_thread_is_reported_as_an_io_error() -> None:
    disk = SimDisk()
    s, rec = make(disk)
    s.submit(1, "not bytes")  # type: ignore[arg-type]
    exc = rec.wait_error()
    assert exc.errno == errno.EIO and isinstance(exc.__cause__, TypeError)
    s.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_raising_callback_stops_the_syncer_and_no_barrier_waits_forever() -> None:
    disk = SimDisk()
    rec = Durable()

    def boom(seq: int) -> None:
        raise RuntimeError("callback bug")

    w = JournalWriter(disk, "/j", 1)
    s = Syncer(w, "always", 0, boom, rec.on_error)
    s.submit(1, b"x")
    exc = rec.wait_error()
    assert exc.errno == errno.EIO and isinstance(exc.__cause__, RuntimeError)
    # Queued before or after the thread died: either way the barrier does not hang.
    with pytest.raises(StoreError):
        s.barrier(DEADLINE)
    with pytest.raises(StoreError, match="stopped"):
        s.barrier(DEADLINE)
    s.close(DEADLINE)
    assert rec.errors == [exc]

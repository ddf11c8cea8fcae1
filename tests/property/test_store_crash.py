"""Power cuts at random points of a journal's life (store/journal.py on store/disk.SimDisk).

A run is a random sequence of appends, flushes, syncs, rolls, snapshots (the metadata file
written atomically in the same directory, as the store does, which also makes every name in
it durable) and deletions of the segments a snapshot covers, cut by crashes. After each crash
the journal is read from the snapshot, as recovery does, and:

* the scan never raises: a crash leaves at most a torn tail, never corruption;
* what it returns is a contiguous run from the snapshot on, with the payloads appended;
* it reaches at least the last seq ``sync`` (or a roll) reported durable before the crash;
* the tail it cut stays cut: a second crash right away changes nothing;
* a writer reopened after the last record goes on, and its records read back after the
  next crash by the same rules.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cpgbroker.store.disk import SimDisk
from cpgbroker.store.journal import JournalWriter, read_journal

DIR = "/store"
META = "/store/meta.json"


def payload(epoch: int, seq: int, size: int) -> bytes:
    # Rewritten seqs after a crash get other bytes: a stale record would be caught.
    return random.Random(f"{epoch}/{seq}").randbytes(size)


APPEND = st.tuples(st.just("append"), st.lists(st.integers(0, 48), min_size=1, max_size=6))
# Appends weigh most: a crash tears something only if records were written since the last sync.
OPS = st.one_of(
    APPEND,
    APPEND,
    APPEND,
    st.tuples(st.just("flush")),
    st.tuples(st.just("flush")),
    st.tuples(st.just("sync")),
    st.tuples(st.just("roll")),
    st.tuples(st.just("snapshot"), st.booleans()),
    st.tuples(st.just("delete")),
    # A crash, after writing what is buffered or not (the syncer writes at once, then syncs).
    st.tuples(st.just("crash"), st.integers(0, 2**32 - 1), st.booleans()),
)


class Run:
    def __init__(self, segment_bytes: int, garble: float) -> None:
        self.disk = SimDisk()
        self.segment_bytes = segment_bytes
        self.garble = garble
        self.epoch = 0
        self.snap = 0  # the durable snapshot's seq: recovery reads the journal after it
        self.durable = 0  # the last seq reported durable (or recovered)
        self.payloads: dict[int, bytes] = {}
        self.writer = JournalWriter(self.disk, DIR, 1, segment_bytes)

    def do(self, op: tuple[Any, ...]) -> None:
        w = self.writer
        kind = op[0]
        if kind == "append":
            for size in op[1]:
                seq = w.last_seq + 1
                data = payload(self.epoch, seq, size)
                self.payloads[seq] = data
                w.append(seq, data)
        elif kind == "flush":
            w.flush()
        elif kind == "sync":
            self.durable = max(self.durable, w.sync())
        elif kind == "roll":
            w.roll()
            self.durable = max(self.durable, w.synced_seq)
        elif kind == "snapshot":
            # The store rolls before a snapshot, but its syncer thread may not have done so
            # (nor synced) when the snapshot's metadata is durable: both orders happen.
            if op[1]:
                w.roll()
                self.durable = max(self.durable, w.synced_seq)
            self.snap = w.last_seq
            self.disk.write_atomic(META, str(self.snap).encode())
        elif kind == "delete":
            w.delete_through(self.snap)
        elif kind == "crash":
            if op[2]:
                w.flush()
            self.crash(op[1])
        else:  # pragma: no cover
            raise AssertionError(kind)

    def crash(self, seed: int) -> None:
        self.disk.crash(random.Random(seed), self.garble)
        scan = read_journal(self.disk, DIR, self.snap)
        got = list(scan)
        self.check(got, scan.last_seq)
        # The cut is durable: another power cut at once finds the same records and no tail.
        self.disk.crash(random.Random(seed + 1), self.garble)
        again = read_journal(self.disk, DIR, self.snap)
        assert list(again) == got
        assert again.torn is None and again.last_seq == scan.last_seq
        self.epoch += 1
        self.durable = scan.last_seq
        self.payloads = {s: p for s, p in self.payloads.items() if s <= scan.last_seq}
        self.writer = JournalWriter(self.disk, DIR, scan.last_seq + 1, self.segment_bytes)

    def check(self, got: list[tuple[int, bytes]], last_seq: int) -> None:
        seqs = [s for s, _p in got]
        assert seqs == list(range(self.snap + 1, self.snap + 1 + len(seqs)))
        assert last_seq == (seqs[-1] if seqs else self.snap)
        for seq, data in got:
            assert data == self.payloads[seq], seq
        assert last_seq >= max(self.snap, self.durable), (last_seq, self.snap, self.durable)


@given(
    ops=st.lists(OPS, min_size=8, max_size=60),
    last_crash=st.tuples(st.just("crash"), st.integers(0, 2**32 - 1), st.booleans()),
    segment_bytes=st.sampled_from([25, 100, 400, 2000, 1 << 16]),
    garble=st.sampled_from([0.0, 0.25, 1.0]),
)
@settings(max_examples=1500, deadline=None)
def test_a_crash_leaves_a_readable_prefix_that_the_writer_continues(
    ops: list[tuple[Any, ...]], last_crash: tuple[Any, ...], segment_bytes: int, garble: float
) -> None:
    run = Run(segment_bytes, garble)
    for op in [*ops, last_crash]:
        run.do(op)
    # After the last crash: a few more records, a clean close, everything reads back.
    w = run.writer
    for seq in range(w.last_seq + 1, w.last_seq + 4):
        data = payload(run.epoch, seq, seq % 7)
        run.payloads[seq] = data
        w.append(seq, data)
    w.close()
    scan = read_journal(run.disk, DIR, run.snap)
    got = list(scan)
    assert scan.torn is None
    run.durable = w.synced_seq
    run.check(got, scan.last_seq)
    assert scan.last_seq == w.last_seq

"""The journal: every event a member applied, in order, in append-only segment files.

Layout
------
One directory holds segments named ``journal-{first_seq:020d}.log`` (so sorting names sorts
them by sequence). A segment starts with a 24-byte header, ``MAGIC``, its first sequence
number (big-endian u64) and 8 random bytes (its salt), followed by records::

    length u32 | crc32 u32 | seq u64 | payload (length bytes)

The crc32 covers the segment's salt, then the seq bytes and the payload, which lie next to each
other. The salt is why a client cannot forge a record: a payload is client bytes and may hold
anything, also what looks like a whole record with a good checksum; without the salt, a torn
record followed by such a forged one would look like corruption (and make every member that
crashed there discard its store). The salt is drawn when the segment is created, after the
client bytes it could have been guessed from were sent. Sequence numbers
are consecutive across the whole journal: a record's seq is its predecessor's plus one, and a
segment's first record is the one after the previous segment's last. So a segment's last seq
is the next segment's first seq minus one, without reading it.

Writing (:class:`JournalWriter`)
--------------------------------
``append`` only packs a record header and keeps it and the payload in a list: no syscall, so
it costs the same whether the disk is fast or not. ``flush`` writes everything buffered with
one ``write``; ``sync`` flushes and fsyncs the current segment, and fsyncs the directory once
after a segment was created (a synced file whose name is not durable is lost whole). A segment
is rolled (synced, then a new one started) at a record boundary once it holds
``segment_bytes``, or on request: a segment other than the newest is therefore always whole
and synced, which is what lets recovery tell a crash from corruption.

Recovery (:func:`read_journal`)
-------------------------------
A crash can only damage what was written after the last sync, and only the newest segment
has any: so the newest segment may end in a torn tail (a record cut short, or the last bytes
written garbled), and nothing else may be damaged. The scan cuts such a tail (truncates the
file to the end of the last good record, durably) and reports it in ``torn``; anything else
(a bad record with a valid record after it, a bad record or header in an older segment, a
gap or overlap between segments, a journal that starts after the events needed) is
corruption the member cannot repair itself, and raises ``StoreCorrupt`` naming the file and
byte offset.

Threads: a writer is used by one thread at a time (the syncer's, once it has one); the read
properties are plain ints another thread may read.
"""

from __future__ import annotations

import itertools
import os
import re
import struct
import zlib
from collections.abc import Callable, Generator, Iterator

from cpgbroker.store.disk import AppendFile, Disk, StoreCorrupt, StoreError

MAGIC = b"CPGBJNL2"
HEADER_SIZE = 24
RECORD_HEADER_SIZE = 16
# 64 MiB: recovery reads one segment into memory at a time, and deleting whole segments after
# a snapshot frees space in steps this size.
SEGMENT_BYTES = 64 * 2**20

_HEADER = struct.Struct(">8sQ8s")
_REC = struct.Struct(">IIQ")
_U64 = struct.Struct(">Q")
_U64_MAX = 2**64 - 1
_NAME = re.compile(r"journal-(\d{20})\.log")
_NONZERO = re.compile(rb"[^\x00]")
# Bound once: append runs for every event a member applies.
_pack_record = _REC.pack
_pack_u64 = _U64.pack
_crc32 = zlib.crc32


def segment_name(first_seq: int) -> str:
    return f"journal-{first_seq:020d}.log"


def list_segments(disk: Disk, directory: str) -> list[tuple[int, str]]:
    """``(first_seq, path)`` of every segment in ``directory``, oldest first (none if the
    directory does not exist). Other files (metadata, snapshots) are ignored."""
    if not disk.exists(directory):
        return []
    out = []
    for name in disk.listdir(directory):
        m = _NAME.fullmatch(name)
        if m is not None:
            out.append((int(m.group(1)), os.path.join(directory, name)))
    out.sort()
    return out


class JournalWriter:
    """Appends records to the journal in ``directory``, starting at ``next_seq``.

    Owns the current segment's open file and the records buffered for it; never reads the
    journal (recovery does, before a writer exists). It always starts a new segment at
    ``next_seq``: the caller passes the seq after the last record :func:`read_journal`
    returned (or after the snapshot, if that is newer). Trailing segments that hold no record
    (a crash right after a roll) are removed first; a segment that holds records at or after
    ``next_seq`` raises ``StoreError`` (the caller asked to overwrite history).

    After an ``OSError`` the writer is unusable: what reached the disk is unknown (a partial
    write, or an fsync whose failure may have dropped the dirty pages), so every later
    ``flush``/``sync``/``roll`` raises ``StoreError`` rather than write after a hole.
    """

    def __init__(
        self, disk: Disk, directory: str, next_seq: int, segment_bytes: int = SEGMENT_BYTES
    ) -> None:
        if next_seq < 1:
            raise ValueError(f"next_seq must be at least 1, not {next_seq}")
        if segment_bytes <= HEADER_SIZE:
            raise ValueError(f"segment_bytes must exceed the {HEADER_SIZE}-byte header")
        self._disk = disk
        self._dir = directory
        self._segment_bytes = segment_bytes
        self._next = next_seq
        self._flushed = next_seq - 1
        self._synced = next_seq - 1
        # Buffered record headers and payloads; a cut (index in _buf, first seq) starts a new
        # segment there, decided in append so that flush needs no bookkeeping per record.
        self._buf: list[bytes] = []
        # (index in _buf, first seq of the new segment, its salt).
        self._cuts: list[tuple[int, int, bytes]] = []
        # crc32 of the salt of the segment appended records land in (the crc's seed).
        self._salt_crc = 0
        self._buffered = 0
        # Size of the newest segment counting what is buffered for it.
        self._seg_size = HEADER_SIZE
        self._dirty = False  # bytes written to the current file since its last fsync
        self._dir_dirty = False  # a segment was created (or removed) since the last sync_dir
        self._failed: BaseException | None = None
        self._closed = False
        self.fsyncs = 0
        self.writes = 0
        self.bytes_written = 0

        disk.makedirs(directory)
        segs = list_segments(disk, directory)
        while segs:
            first, path = segs[-1]
            if disk.size(path) > HEADER_SIZE:
                if first >= next_seq:
                    raise StoreError(
                        f"{path}: the journal already holds events from {first}; "
                        f"cannot start writing at {next_seq}"
                    )
                break
            disk.remove(path)  # no record in it: nothing is lost
            self._dir_dirty = True
            segs.pop()
        self._file: AppendFile
        self._path = ""
        self._file_first = next_seq
        self._open(next_seq, os.urandom(8))

    # ---------------------------------------------------------------- properties

    @property
    def directory(self) -> str:
        return self._dir

    @property
    def last_seq(self) -> int:
        """The last seq appended (buffered or not)."""
        return self._next - 1

    @property
    def flushed_seq(self) -> int:
        """The last seq written to the OS (survives the process, not a power cut)."""
        return self._flushed

    @property
    def synced_seq(self) -> int:
        """The last seq durable on disk."""
        return self._synced

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    @property
    def current_segment(self) -> str:
        """Path of the segment file open for writing."""
        return self._path

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def segments(self) -> list[tuple[int, str]]:
        """``(first_seq, path)`` of the segment files on disk, oldest first."""
        return list_segments(self._disk, self._dir)

    # ---------------------------------------------------------------- writing

    def append(self, seq: int, payload: bytes) -> None:
        """Buffer one record (no syscall). ``payload`` is kept by reference until the next
        flush: do not mutate it."""
        if seq != self._next:
            raise ValueError(f"journal append of event {seq}, expected {self._next}")
        size = len(payload) + RECORD_HEADER_SIZE
        buf = self._buf
        if self._seg_size >= self._segment_bytes:
            salt = os.urandom(8)
            self._cuts.append((len(buf), seq, salt))
            self._salt_crc = _crc32(salt)
            self._seg_size = HEADER_SIZE
        buf.append(
            _pack_record(
                size - RECORD_HEADER_SIZE,
                _crc32(payload, _crc32(_pack_u64(seq), self._salt_crc)),
                seq,
            )
        )
        buf.append(payload)
        self._seg_size += size
        self._buffered += size
        self._next = seq + 1

    def flush(self) -> None:
        """Write everything buffered: one ``write`` per segment it lands in."""
        if not self._buf:
            return
        self._check()
        buf, cuts = self._buf, self._cuts
        self._buf, self._cuts, self._buffered = [], [], 0
        try:
            start = 0
            for index, first, salt in cuts:
                self._write(buf, start, index, first - 1)
                self._switch(first, salt)
                start = index
            self._write(buf, start, len(buf), self._next - 1)
        except BaseException as e:
            self._failed = e
            raise

    def sync(self) -> int:
        """Flush, fsync the current segment (and the directory after a new segment); the last
        seq now durable. Blocking."""
        self._check()
        self.flush()
        try:
            self._sync_current()
        except BaseException as e:
            self._failed = e
            raise
        return self._synced

    def roll(self) -> None:
        """Sync the current segment and start a new one at the next seq (nothing to do if the
        current one holds no record yet: it already starts there). Blocking."""
        self._check()
        self.flush()
        if self._flushed < self._file_first:
            return
        try:
            self._switch(self._next, os.urandom(8))
        except BaseException as e:
            self._failed = e
            raise
        self._seg_size = HEADER_SIZE

    def delete_through(self, seq: int) -> list[str]:
        """Remove the segments whose every record is at or before ``seq`` (never the current
        one) and sync the directory; the paths removed. Blocking."""
        self._check()
        removed = []
        segs = self.segments()
        for (_first, path), (nxt, _next_path) in itertools.pairwise(segs):
            if nxt - 1 > seq or path == self._path:
                break
            try:
                self._disk.remove(path)
            except FileNotFoundError:
                continue  # already removed (by whoever else prunes the directory)
            removed.append(path)
        if removed:
            self._disk.sync_dir(self._dir)
        return removed

    def close(self) -> None:
        """Sync what was appended (unless the writer failed) and close the file."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.sync()
        finally:
            self._closed = True
            self._file.close()

    # ---------------------------------------------------------------- internals

    def _check(self) -> None:
        if self._failed is not None:
            raise StoreError(
                f"the journal writer failed earlier ({self._failed!r}): what reached "
                f"{self._path} after event {self._synced} is unknown"
            ) from self._failed
        if self._closed:
            raise StoreError("the journal writer is closed")

    def _write(self, buf: list[bytes], start: int, stop: int, last_seq: int) -> None:
        if start == stop:
            return
        data = b"".join(buf[start:stop])
        self._file.write(data)
        self.writes += 1
        self.bytes_written += len(data)
        self._dirty = True
        self._flushed = last_seq

    def _sync_current(self) -> None:
        if self._dirty:
            self._file.sync()
            self.fsyncs += 1
            self._dirty = False
        if self._dir_dirty:
            self._disk.sync_dir(self._dir)
            self._dir_dirty = False
        self._synced = self._flushed

    def _switch(self, first: int, salt: bytes) -> None:
        # The old segment is whole and durable before the new one exists: recovery relies on
        # every segment but the newest being intact.
        self._sync_current()
        self._file.close()
        self._open(first, salt)

    def _open(self, first: int, salt: bytes) -> None:
        path = os.path.join(self._dir, segment_name(first))
        f = self._disk.open_append(path)
        self._file = f
        self._path = path
        self._file_first = first
        self._dir_dirty = True
        if f.tell() != 0:
            raise StoreError(f"{path}: a new journal segment is not empty")
        f.write(_HEADER.pack(MAGIC, first, salt))
        self._salt_crc = _crc32(salt)
        self.writes += 1
        self.bytes_written += HEADER_SIZE
        self._dirty = True


class JournalScan:
    """The records after ``after_seq``, read lazily: ``for seq, payload in scan``.

    The counters are current while iterating and final once the iteration ended: ``last_seq``
    (the last record returned, or ``after_seq``), ``records`` and ``bytes`` (records returned
    and their size on disk, headers included), ``torn`` (``(path, offset, bytes_cut)`` if a
    torn tail was cut). The tail is cut only when the iteration reaches it.

    ``StoreCorrupt`` may be raised after some records were returned (the scan streams): a
    caller must treat the whole recovery as failed then.
    """

    def __init__(
        self,
        disk: Disk,
        directory: str,
        after_seq: int,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if after_seq < 0:
            raise ValueError(f"after_seq must not be negative, not {after_seq}")
        self._disk = disk
        self.directory = directory
        self.after_seq = after_seq
        self.last_seq = after_seq
        self.records = 0
        self.bytes = 0
        self.torn: tuple[str, int, int] | None = None
        self.segments = list_segments(disk, directory)
        self.done = False
        self._on_progress = on_progress
        self._gen = self._scan()

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return self

    def __next__(self) -> tuple[int, bytes]:
        return next(self._gen)

    def _scan(self) -> Iterator[tuple[int, bytes]]:
        segs = self.segments
        want = self.after_seq + 1
        start = -1
        for i, (first, _path) in enumerate(segs):
            if first > want:
                break
            start = i
        if segs and start < 0:
            first, path = segs[0]
            raise StoreCorrupt(
                f"{path}: offset 0: the journal starts at event {first}, but the events from "
                f"{want} are needed"
            )
        expected = 0
        prev_path, prev_size = "", 0
        for k in range(max(start, 0), len(segs)):
            first, path = segs[k]
            if k > start and first != expected:
                raise StoreCorrupt(
                    f"{prev_path}: offset {prev_size}: the segment ends at event {expected - 1} "
                    f"but the next segment {path} starts at event {first}"
                )
            data = self._disk.read(path)
            expected = yield from self._segment(path, first, data, k == len(segs) - 1)
            prev_path, prev_size = path, len(data)
            if self._on_progress is not None:
                self._on_progress(self.records, self.bytes)
        self.done = True

    def _segment(
        self, path: str, first: int, data: bytes, newest: bool
    ) -> Generator[tuple[int, bytes], None, int]:
        """Yield the segment's records after ``after_seq``; the seq after its last good one."""
        end = len(data)
        if end < HEADER_SIZE:
            self._bad(path, data, 0, 0, first, newest, "incomplete segment header")
            return first
        magic, hfirst, salt = _HEADER.unpack_from(data, 0)
        if magic != MAGIC or hfirst != first:
            self._bad(path, data, 0, 0, first, newest, "bad segment header")
            return first
        after = self.after_seq
        unpack = _REC.unpack_from
        crc32 = zlib.crc32
        seed = crc32(salt)
        view = memoryview(data)
        expected = first
        pos = HEADER_SIZE
        bad = ""
        while pos < end:
            if end - pos < RECORD_HEADER_SIZE:
                bad = "incomplete record header"
                break
            n, crc, seq = unpack(data, pos)
            stop = pos + RECORD_HEADER_SIZE + n
            if stop > end:
                bad = f"record of {n} bytes cut short at {end - pos - RECORD_HEADER_SIZE}"
                break
            if crc32(view[pos + 8 : stop], seed) != crc:
                bad = "checksum mismatch"
                break
            if seq != expected:
                # A whole record with a good checksum in the wrong place: no crash writes that.
                raise StoreCorrupt(
                    f"{path}: offset {pos}: event {seq} where event {expected} was expected"
                )
            if seq > after:
                self.last_seq = seq
                self.records += 1
                self.bytes += stop - pos
                yield seq, data[pos + RECORD_HEADER_SIZE : stop]
            pos = stop
            expected += 1
        if bad:
            self._bad(path, data, pos, pos + 1, expected, newest, bad)
        return expected

    def _bad(
        self,
        path: str,
        data: bytes,
        pos: int,
        search_from: int,
        next_seq: int,
        newest: bool,
        what: str,
    ) -> None:
        """A bad record (or header) at ``pos``: cut it as a torn tail, or raise."""
        if not newest:
            raise StoreCorrupt(
                f"{path}: offset {pos}: {what} (event {next_seq}) in a segment that is not the "
                "newest"
            )
        try:
            # The salt the segment's header says (also when the header itself is what is bad:
            # records that verify against it after a garbled magic are still corruption).
            seed = zlib.crc32(data[16:HEADER_SIZE]) if len(data) >= HEADER_SIZE else None
            found = None if seed is None else _find_record(data, pos, search_from, next_seq, seed)
        except _Undecided:
            raise StoreCorrupt(
                f"{path}: offset {pos}: {what} (event {next_seq}), followed by too much "
                "record-like data to tell a torn write from corruption"
            ) from None
        if found is not None:
            at, seq = found
            raise StoreCorrupt(
                f"{path}: offset {pos}: {what} (event {next_seq}), yet a valid record of event "
                f"{seq} follows at offset {at}: corruption, not a torn write"
            )
        cut = len(data) - pos
        if cut:
            self._disk.truncate(path, pos)
            self.torn = (path, pos, cut)


class _Undecided(Exception):
    """Too much record-like garbage to check it all (see :func:`_find_record`)."""


def _find_record(
    data: bytes, bad: int, start: int, min_seq: int, seed: int
) -> tuple[int, int] | None:
    """The first offset at or after ``start`` holding a whole record with a good checksum
    and a seq that could follow a bad record at ``bad`` (``min_seq`` up to one more per 16
    bytes after ``bad``: records are at least that long), and its seq.

    Candidates are found with ``bytes.find`` on the high bytes every such seq shares, and
    runs of zeros (ext4 can leave a zero-filled tail after a power cut) are skipped at once,
    so an ordinary tail of garbage or zeros costs milliseconds. Only a candidate that passes
    the cheap checks costs a checksum over its claimed length; garbage made to look like
    records (a client's payload can hold anything) could make that quadratic, so past a
    budget (about a second for a 64 MiB segment) this gives up with ``_Undecided`` rather
    than take hours.
    """
    end = len(data)
    if end - start < RECORD_HEADER_SIZE:
        return None
    max_seq = min(min_seq + (end - bad) // RECORD_HEADER_SIZE + 1, _U64_MAX)
    lo, hi = _U64.pack(min_seq), _U64.pack(max_seq)
    k = 0
    while k < 8 and lo[k] == hi[k]:
        k += 1
    prefix = lo[:k]
    view = memoryview(data)
    # About a second of crc32 (3 GB/s here) for a 64 MiB segment: 32 passes over it.
    budget = 32 * (end - start) + (1 << 28)
    # j is where a candidate's seq field starts: 8 bytes into its record, and 8 before the end.
    j = start + 8
    limit = end - 8 + k
    while True:
        j = data.find(prefix, j, limit)
        if j < 0:
            return None
        n, crc, seq = _REC.unpack_from(data, j - 8)
        if min_seq <= seq <= min_seq + (j - 8 - bad) // RECORD_HEADER_SIZE + 1:
            stop = j + 8 + n
            if stop <= end:
                budget -= n
                if budget < 0:
                    raise _Undecided
                if zlib.crc32(view[j:stop], seed) == crc:
                    return j - 8, seq
        elif seq == 0:
            # Seqs are at least 1: a seq field that is not all zeros reaches past this run.
            nz = _NONZERO.search(data, j + 8)
            if nz is None:
                return None
            j = nz.start() - 8
        j += 1


def read_journal(
    disk: Disk,
    directory: str,
    after_seq: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> JournalScan:
    """Scan the journal in ``directory`` for the records after ``after_seq`` (see
    :class:`JournalScan`). ``on_progress(records, bytes)`` is called after each segment.
    Blocking: it reads files, and truncates a torn tail when it reaches it."""
    return JournalScan(disk, directory, after_seq, on_progress)


__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "RECORD_HEADER_SIZE",
    "SEGMENT_BYTES",
    "JournalScan",
    "JournalWriter",
    "list_segments",
    "read_journal",
    "segment_name",
]

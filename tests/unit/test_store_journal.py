"""The journal (store/journal.py) and its file layer (store/disk.py): round trips on the real
OS and on the simulated disk, segments, reopening, and the recovery rules (a torn tail is cut
and reported, corruption before it raises naming the file and offset)."""

from __future__ import annotations

import errno
import itertools
import os
import random
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpgbroker.errors import CpgBrokerError
from cpgbroker.store.disk import Disk, OsDisk, SimDisk, StoreCorrupt, StoreError
from cpgbroker.store.journal import (
    HEADER_SIZE,
    MAGIC,
    RECORD_HEADER_SIZE,
    JournalWriter,
    list_segments,
    read_journal,
    segment_name,
)


def payload(seq: int) -> bytes:
    # Pseudo-random bytes (not a repeated pattern) so that a record cut or garbled anywhere
    # cannot look like another valid record.
    return random.Random(seq).randbytes(5 + seq % 23)


@pytest.fixture(params=["sim", "os"])
def disk_dir(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Disk, str]:
    if request.param == "sim":
        return SimDisk(), "/store/journal"
    return OsDisk(), str(tmp_path / "journal")


def write(disk: Disk, d: str, first: int, last: int, segment_bytes: int = 1 << 20) -> JournalWriter:
    w = JournalWriter(disk, d, first, segment_bytes)
    for seq in range(first, last + 1):
        w.append(seq, payload(seq))
    w.sync()
    return w


def read_all(disk: Disk, d: str, after: int = 0) -> list[tuple[int, bytes]]:
    return list(read_journal(disk, d, after))


def record_offsets(data: bytes) -> Iterator[tuple[int, int]]:
    """(offset, seq) of each whole record of a segment file."""
    pos = HEADER_SIZE
    while pos + RECORD_HEADER_SIZE <= len(data):
        n, _crc, seq = struct.unpack_from(">IIQ", data, pos)
        yield pos, seq
        pos += RECORD_HEADER_SIZE + n


def flip(disk: Disk, path: str, offset: int) -> None:
    data = bytearray(disk.read(path))
    data[offset] ^= 0x55
    disk.write_atomic(path, bytes(data))


def test_store_errors_share_the_root() -> None:
    assert issubclass(StoreCorrupt, StoreError)
    assert issubclass(StoreError, CpgBrokerError)


# ------------------------------------------------------------------------ round trips


def test_round_trip(disk_dir: tuple[Disk, str]) -> None:
    disk, d = disk_dir
    w = write(disk, d, 1, 200)
    assert (w.last_seq, w.flushed_seq, w.synced_seq) == (200, 200, 200)
    w.append(201, b"")  # an empty payload is a record too
    assert w.sync() == 201
    w.close()
    scan = read_journal(disk, d, 0)
    got = list(scan)
    assert got == [(s, payload(s)) for s in range(1, 201)] + [(201, b"")]
    assert (scan.last_seq, scan.records, scan.torn, scan.done) == (201, 201, None, True)
    assert scan.bytes == sum(RECORD_HEADER_SIZE + len(p) for _s, p in got)
    name = segment_name(1)
    assert name == "journal-00000000000000000001.log"
    data = disk.read(os.path.join(d, name))
    assert data[:16] == MAGIC + (1).to_bytes(8, "big")  # then the segment's 8-byte salt
    assert len(data) == HEADER_SIZE + scan.bytes


def test_record_format_is_length_crc_seq_payload() -> None:
    disk = SimDisk()
    write(disk, "/j", 7, 7).close()
    data = disk.read("/j/" + segment_name(7))
    n, crc, seq = struct.unpack_from(">IIQ", data, HEADER_SIZE)
    body = data[HEADER_SIZE + RECORD_HEADER_SIZE :]
    assert (n, seq, body) == (len(payload(7)), 7, payload(7))
    salt = data[16:HEADER_SIZE]
    assert crc == zlib.crc32(salt + seq.to_bytes(8, "big") + body)


def test_a_record_forged_in_a_client_payload_does_not_verify() -> None:
    # A payload is client bytes: one holding what would be a whole record after a torn one
    # must not pass for corruption (the segment's salt is in every checksum).
    disk = SimDisk()
    forged_body = b"forged"
    forged = (
        struct.pack(">IIQ", len(forged_body), zlib.crc32((3).to_bytes(8, "big") + forged_body), 3)
        + forged_body
    )
    w = JournalWriter(disk, "/j", 1)
    w.append(1, b"first")
    w.append(2, b"x" * 40 + forged)
    w.close()
    path = list_segments(disk, "/j")[-1][1]
    data = disk.read(path)
    # Record 2 torn: its length field garbled, so its payload reads as what follows it.
    at = HEADER_SIZE + RECORD_HEADER_SIZE + len(b"first")
    disk.write_atomic(path, data[:at] + b"\xff\xff" + data[at + 2 :])
    scan = read_journal(disk, "/j", 0)
    assert [seq for seq, _p in scan] == [1]
    assert scan.torn is not None


def test_append_buffers_and_flush_is_one_write() -> None:
    disk = SimDisk()
    w = JournalWriter(disk, "/j", 1)
    writes = w.writes  # the new segment's header
    for seq in range(1, 101):
        w.append(seq, payload(seq))
    assert w.writes == writes and w.flushed_seq == 0 and w.buffered_bytes > 0
    assert disk.size(w.current_segment) == HEADER_SIZE
    w.flush()
    assert w.writes == writes + 1 and w.flushed_seq == 100 and w.synced_seq == 0
    assert w.buffered_bytes == 0
    assert w.sync() == 100 and w.fsyncs == 1
    assert w.sync() == 100 and w.fsyncs == 1  # nothing new: no fsync


def test_append_wants_consecutive_seqs() -> None:
    w = JournalWriter(SimDisk(), "/j", 5)
    with pytest.raises(ValueError, match="expected 5"):
        w.append(6, b"x")
    w.append(5, b"x")
    with pytest.raises(ValueError, match="expected 6"):
        w.append(5, b"x")


def test_empty_or_missing_journal_reads_nothing(disk_dir: tuple[Disk, str]) -> None:
    disk, d = disk_dir
    scan = read_journal(disk, d, 42)
    assert list(scan) == [] and scan.last_seq == 42 and scan.torn is None
    JournalWriter(disk, d, 43).close()
    scan = read_journal(disk, d, 42)
    assert list(scan) == [] and scan.last_seq == 42


# ------------------------------------------------------------------------ segments


def test_rollover_and_delete_through(disk_dir: tuple[Disk, str]) -> None:
    disk, d = disk_dir
    w = write(disk, d, 1, 100, segment_bytes=200)
    segs = w.segments()
    assert len(segs) > 5
    # Each segment is rolled at a record boundary once it reached segment_bytes.
    for (first, path), (nxt, _p) in itertools.pairwise(segs):
        data = disk.read(path)
        assert len(data) >= 200
        assert [s for _o, s in record_offsets(data)] == list(range(first, nxt))
    assert read_all(disk, d) == [(s, payload(s)) for s in range(1, 101)]

    cut = segs[3][0] - 1  # the last seq of the third segment
    removed = w.delete_through(cut + 1)  # the fourth is not wholly covered: it stays
    assert removed == [p for _f, p in segs[:3]]
    assert w.segments() == segs[3:]
    assert read_all(disk, d, cut) == [(s, payload(s)) for s in range(cut + 1, 101)]
    with pytest.raises(StoreCorrupt, match=f"starts at event {segs[3][0]}"):
        read_all(disk, d, cut - 1)

    # Never the current segment, whatever seq.
    w.delete_through(10**9)
    assert w.segments() == [segs[-1]]
    assert w.current_segment == segs[-1][1]
    w.close()


def test_roll_starts_a_segment_at_the_next_seq() -> None:
    disk = SimDisk()
    w = write(disk, "/j", 1, 10)
    w.roll()
    w.roll()  # the new segment holds no record yet: nothing to do
    assert [f for f, _p in w.segments()] == [1, 11]
    assert w.synced_seq == 10
    w.append(11, b"eleven")
    w.roll()
    assert [f for f, _p in w.segments()] == [1, 11, 12]
    w.close()
    assert read_all(disk, "/j", 10) == [(11, b"eleven")]


def test_a_roll_inside_one_flush_syncs_the_full_segment_first() -> None:
    disk = SimDisk()
    w = JournalWriter(disk, "/j", 1, segment_bytes=64)
    for seq in range(1, 40):
        w.append(seq, payload(seq))
    w.flush()  # crosses several segment boundaries
    assert len(w.segments()) > 3
    # Every segment but the newest is durable; only the newest waits for the sync.
    last_full = w.segments()[-1][0] - 1
    assert w.synced_seq == last_full
    crashed = disk.copy()
    crashed.crash(random.Random(3))
    assert read_journal(crashed, "/j", 0).__iter__() is not None
    got = read_all(crashed, "/j")
    assert len(got) >= last_full
    assert got == [(s, payload(s)) for s in range(1, len(got) + 1)]
    w.close()


def test_reopen_and_continue(disk_dir: tuple[Disk, str]) -> None:
    disk, d = disk_dir
    write(disk, d, 1, 30, segment_bytes=150).close()
    scan = read_journal(disk, d, 0)
    assert len(list(scan)) == 30
    w = write(disk, d, scan.last_seq + 1, 60, segment_bytes=150)
    w.close()
    assert read_all(disk, d) == [(s, payload(s)) for s in range(1, 61)]
    # A writer that never wrote a record leaves a header-only segment; the next reuses it.
    JournalWriter(disk, d, 61).close()
    n = len(list_segments(disk, d))
    JournalWriter(disk, d, 61).close()
    assert len(list_segments(disk, d)) == n
    write(disk, d, 61, 70).close()
    assert read_all(disk, d) == [(s, payload(s)) for s in range(1, 71)]


def test_reopen_after_a_snapshot_newer_than_the_journal() -> None:
    # The journal was cut behind the snapshot (a crash): the writer starts after the snapshot
    # and a scan from the snapshot never looks at the old segment.
    disk = SimDisk()
    write(disk, "/j", 1, 20).close()
    write(disk, "/j", 101, 110).close()
    assert read_all(disk, "/j", 100) == [(s, payload(s)) for s in range(101, 111)]
    with pytest.raises(StoreCorrupt, match="ends at event 20 but the next segment"):
        read_all(disk, "/j", 10)


def test_reopen_refuses_to_overwrite_records() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 20, segment_bytes=100).close()
    segs = list_segments(disk, "/j")
    with pytest.raises(StoreError, match="already holds events"):
        JournalWriter(disk, "/j", segs[-1][0])
    with pytest.raises(ValueError):
        JournalWriter(disk, "/j", 0)


def test_contiguity_from_after_seq(disk_dir: tuple[Disk, str]) -> None:
    disk, d = disk_dir
    write(disk, d, 1, 60, segment_bytes=120).close()
    for after in (0, 1, 17, 59, 60, 75):
        scan = read_journal(disk, d, after)
        got = list(scan)
        assert got == [(s, payload(s)) for s in range(after + 1, 61)]
        assert scan.last_seq == max(after, 60)


def test_segments_before_the_start_are_not_read() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 60, segment_bytes=120).close()
    segs = list_segments(disk, "/j")
    disk.write_atomic(segs[0][1], b"not a segment at all")
    start = segs[2][0]
    assert read_all(disk, "/j", start - 1) == [(s, payload(s)) for s in range(start, 61)]
    with pytest.raises(StoreCorrupt):
        read_all(disk, "/j", 0)


def test_progress_callback() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 50, segment_bytes=300).close()
    seen: list[tuple[int, int]] = []
    scan = read_journal(disk, "/j", 10, on_progress=lambda r, b: seen.append((r, b)))
    assert len(list(scan)) == 40
    assert len(seen) == len(list_segments(disk, "/j"))
    assert seen[-1] == (scan.records, scan.bytes) == (40, scan.bytes)
    assert [r for r, _b in seen] == sorted(r for r, _b in seen)


# ------------------------------------------------------------------------ torn tails


def newest_and_last_record(disk: Disk, d: str) -> tuple[str, bytes, int]:
    path = list_segments(disk, d)[-1][1]
    data = disk.read(path)
    last_off = max(o for o, _s in record_offsets(data))
    return path, data, last_off


@pytest.mark.parametrize("kind", ["sim", "os"])
def test_torn_tail_at_every_byte_of_the_last_record_is_cut(kind: str, tmp_path: Path) -> None:
    disk: Disk = SimDisk() if kind == "sim" else OsDisk()
    d = "/j" if kind == "sim" else str(tmp_path / "j")
    write(disk, d, 1, 40, segment_bytes=300).close()
    path, data, last_off = newest_and_last_record(disk, d)
    for keep in range(last_off, len(data)):
        disk.write_atomic(path, data[:keep])
        scan = read_journal(disk, d, 0)
        assert [s for s, _p in scan] == list(range(1, 40))
        assert scan.last_seq == 39
        if keep == last_off:
            assert scan.torn is None  # nothing to cut: the file ends at a record boundary
        else:
            assert scan.torn == (path, last_off, keep - last_off)
        assert disk.size(path) == last_off
        again = read_journal(disk, d, 0)
        assert len(list(again)) == 39 and again.torn is None


def test_garbled_tail_at_every_byte_of_the_last_record_is_cut() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 40, segment_bytes=300).close()
    path, data, last_off = newest_and_last_record(disk, "/j")
    for i in range(last_off, len(data)):
        garbled = bytearray(data)
        garbled[i] ^= 0xFF
        disk.write_atomic(path, bytes(garbled))
        scan = read_journal(disk, "/j", 0)
        assert [s for s, _p in scan] == list(range(1, 40)), i
        assert scan.torn == (path, last_off, len(data) - last_off)


def test_torn_segment_header_of_the_newest_segment_is_cut() -> None:
    disk = SimDisk()
    w = write(disk, "/j", 1, 10)
    w.roll()
    w.close()
    path = list_segments(disk, "/j")[-1][1]
    header = disk.read(path)
    assert len(header) == HEADER_SIZE
    for keep in range(HEADER_SIZE):
        disk.write_atomic(path, header[:keep])
        scan = read_journal(disk, "/j", 0)
        assert len(list(scan)) == 10
        assert scan.torn == ((path, 0, keep) if keep else None)
    # A garbled header with nothing valid after it is a torn tail as well.
    disk.write_atomic(path, b"\x00" * HEADER_SIZE + b"\x13" * 9)
    scan = read_journal(disk, "/j", 0)
    assert len(list(scan)) == 10 and scan.torn == (path, 0, HEADER_SIZE + 9)
    # And the writer starts over in that file.
    write(disk, "/j", 11, 12).close()
    assert len(read_all(disk, "/j")) == 12


# ------------------------------------------------------------------------ corruption


def test_bad_checksum_in_the_middle_raises_naming_file_and_offset(
    disk_dir: tuple[Disk, str],
) -> None:
    disk, d = disk_dir
    write(disk, d, 1, 40, segment_bytes=1 << 20).close()
    path, data, _last = newest_and_last_record(disk, d)
    off, seq = list(record_offsets(data))[20]
    flip(disk, path, off + RECORD_HEADER_SIZE + 2)  # a payload byte
    scan = read_journal(disk, d, 0)
    got: list[int] = []
    with pytest.raises(StoreCorrupt) as e:
        got.extend(s for s, _p in scan)
    assert f"{path}: offset {off}: checksum mismatch" in str(e.value)
    assert "follows at offset" in str(e.value)
    assert got == list(range(1, seq))
    assert disk.size(path) == len(data)  # nothing cut


def test_bad_length_in_the_middle_raises() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 40).close()
    path, data, _last = newest_and_last_record(disk, "/j")
    off, _seq = list(record_offsets(data))[5]
    flip(disk, path, off)  # the length's high byte: the record runs past the end
    with pytest.raises(StoreCorrupt, match=f"offset {off}: record of"):
        read_all(disk, "/j")


def test_bad_record_in_an_older_segment_raises_even_at_its_end() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 60, segment_bytes=200).close()
    segs = list_segments(disk, "/j")
    path = segs[1][1]
    data = disk.read(path)
    off, _seq = max(record_offsets(data))
    flip(disk, path, len(data) - 1)
    with pytest.raises(StoreCorrupt, match=f"{path}: offset {off}: .*not the newest"):
        read_all(disk, "/j")
    # Cut short instead of garbled: the same.
    disk.write_atomic(path, data[:-3])
    with pytest.raises(StoreCorrupt, match=f"{path}: offset {off}: record of"):
        read_all(disk, "/j")


def test_missing_middle_segment_raises() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 60, segment_bytes=200).close()
    segs = list_segments(disk, "/j")
    disk.remove(segs[2][1])
    size = disk.size(segs[1][1])
    with pytest.raises(
        StoreCorrupt,
        match=f"{segs[1][1]}: offset {size}: the segment ends at event {segs[2][0] - 1} but "
        f"the next segment {segs[3][1]} starts at event {segs[3][0]}",
    ):
        read_all(disk, "/j")


def test_bad_segment_header_raises() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 60, segment_bytes=200).close()
    segs = list_segments(disk, "/j")
    flip(disk, segs[1][1], 3)
    with pytest.raises(StoreCorrupt, match=f"{segs[1][1]}: offset 0: bad segment header"):
        read_all(disk, "/j")
    # A header naming another first seq than the file name is bad too.
    disk2 = SimDisk()
    write(disk2, "/j", 1, 60, segment_bytes=200).close()
    segs = list_segments(disk2, "/j")
    data = bytearray(disk2.read(segs[1][1]))
    data[8:16] = (segs[1][0] + 1).to_bytes(8, "big")
    disk2.write_atomic(segs[1][1], bytes(data))
    with pytest.raises(StoreCorrupt, match="offset 0: bad segment header"):
        read_all(disk2, "/j")


def test_bad_header_of_the_newest_segment_with_records_after_it_raises() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 20).close()
    path = list_segments(disk, "/j")[-1][1]
    flip(disk, path, 0)
    with pytest.raises(StoreCorrupt, match=r"offset 0: bad segment header .*follows at offset 24"):
        read_all(disk, "/j")


def test_a_whole_record_with_the_wrong_seq_raises() -> None:
    disk = SimDisk()
    write(disk, "/j", 1, 5).close()
    path = list_segments(disk, "/j")[-1][1]
    body = b"stray"
    salt = disk.read(path)[16:HEADER_SIZE]
    rec = struct.pack(">IIQ", len(body), zlib.crc32(salt + (9).to_bytes(8, "big") + body), 9) + body
    disk.write_atomic(path, disk.read(path) + rec)
    with pytest.raises(StoreCorrupt, match="event 9 where event 6 was expected"):
        read_all(disk, "/j")


def test_corruption_is_found_quickly_in_a_big_segment() -> None:
    # The search for a valid record after a bad one looks for the seq's shared high bytes,
    # not at every offset: 4 MiB of zero payloads (every offset a candidate for the prefix of
    # small seqs) still finishes in well under the test timeout.
    disk = SimDisk()
    w = JournalWriter(disk, "/j", 1)
    for seq in range(1, 1025):
        w.append(seq, bytes(4096))
    w.close()
    path = list_segments(disk, "/j")[-1][1]
    flip(disk, path, HEADER_SIZE + RECORD_HEADER_SIZE + 1)
    with pytest.raises(StoreCorrupt, match=f"{path}: offset {HEADER_SIZE}: checksum"):
        read_all(disk, "/j")


# ------------------------------------------------------------------------ failures


def test_a_failed_write_makes_the_writer_unusable() -> None:
    disk = SimDisk()
    w = write(disk, "/j", 1, 5)
    disk.fail("write", errno.ENOSPC)
    w.append(6, b"six")
    with pytest.raises(OSError) as e:
        w.sync()
    assert e.value.errno == errno.ENOSPC
    assert w.synced_seq == 5 and w.failed is e.value
    with pytest.raises(StoreError, match="failed earlier"):
        w.sync()
    w.close()  # closes the file, writes nothing
    assert read_all(disk, "/j") == [(s, payload(s)) for s in range(1, 6)]


def test_a_failed_fsync_makes_the_writer_unusable() -> None:
    disk = SimDisk()
    w = write(disk, "/j", 1, 5)
    disk.fail("sync", errno.EIO)
    w.append(6, b"six")
    with pytest.raises(OSError, match="Input/output error"):
        w.sync()
    assert w.synced_seq == 5 and w.flushed_seq == 6
    with pytest.raises(StoreError):
        w.roll()


# ------------------------------------------------------------------------ disks


def test_os_disk_operations(tmp_path: Path) -> None:
    disk = OsDisk()
    d = str(tmp_path / "a" / "b")
    disk.makedirs(d)
    disk.makedirs(d)
    p = os.path.join(d, "f")
    disk.write_atomic(p, b"one")
    disk.write_atomic(p, b"two!")
    assert disk.read(p) == b"two!" and disk.size(p) == 4
    assert disk.listdir(d) == ["f"]  # no temporary file left
    f = disk.open_append(p)
    assert f.tell() == 4
    f.write(b"more")
    f.sync()
    assert f.tell() == 8
    f.close()
    disk.truncate(p, 3)
    assert disk.read(p) == b"two"
    disk.rename(p, os.path.join(d, "g"))
    disk.sync_dir(d)
    assert disk.listdir(d) == ["g"] and not disk.exists(p)
    disk.remove(os.path.join(d, "g"))
    assert disk.listdir(d) == []
    assert disk.free_bytes(d) > 0


def test_sim_disk_what_survives_a_crash() -> None:
    disk = SimDisk()
    disk.makedirs("/d")
    f = disk.open_append("/d/synced-not-linked")
    f.write(b"data")
    f.sync()
    g = disk.open_append("/d/linked")
    g.write(b"durable")
    g.sync()
    disk.sync_dir("/d")
    g.write(b" and more")
    disk.write_atomic("/d/meta", b"m1")
    disk.write_atomic("/d/old", b"x")
    disk.rename("/d/old", "/d/new")
    disk.remove("/d/meta")
    disk.crash(random.Random(0), garble=0.0)
    # write_atomic synced the directory after "synced-not-linked" was created: it is linked.
    assert disk.listdir("/d") == ["linked", "meta", "old", "synced-not-linked"]
    assert disk.read("/d/meta") == b"m1"
    assert disk.read("/d/linked").startswith(b"durable")
    assert b"durable and more".startswith(disk.read("/d/linked"))
    with pytest.raises(OSError) as e:
        g.write(b"after the crash")
    assert e.value.errno == errno.EBADF

    disk = SimDisk()
    disk.makedirs("/d")
    f = disk.open_append("/d/f")
    f.write(b"x")
    f.sync()
    disk.crash(random.Random(0))
    assert disk.listdir("/d") == []  # its name was never synced


def test_sim_disk_crash_keeps_every_kind_of_prefix() -> None:
    kept = set()
    for seed in range(200):
        disk = SimDisk()
        disk.makedirs("/d")
        f = disk.open_append("/d/f")
        f.write(b"synced")
        f.sync()
        disk.sync_dir("/d")
        f.write(b"0123456789")
        disk.crash(random.Random(seed), garble=0.0)
        data = disk.read("/d/f")
        assert data.startswith(b"synced")
        assert b"0123456789".startswith(data[6:])
        kept.add(len(data) - 6)
    assert {0, 10} <= kept and len(kept) > 5


def test_sim_disk_fail() -> None:
    disk = SimDisk()
    disk.makedirs("/d")
    disk.fail("open_append", errno.EIO)
    with pytest.raises(OSError, match="Input/output"):
        disk.open_append("/d/f")
    f = disk.open_append("/d/f")
    disk.fail("write", errno.ENOSPC, times=2)
    for _ in range(2):
        with pytest.raises(OSError) as e:
            f.write(b"x")
        assert e.value.errno == errno.ENOSPC
    f.write(b"x")
    assert disk.read("/d/f") == b"x"
    disk.fail("write_atomic", errno.ENOSPC)
    with pytest.raises(OSError):
        disk.write_atomic("/d/m", b"m")
    assert not disk.exists("/d/m")
    with pytest.raises(ValueError):
        disk.fail("read", errno.EIO)
    disk.free = 123
    assert disk.free_bytes("/d") == 123
    with pytest.raises(FileNotFoundError):
        disk.read("/d/none")
    with pytest.raises(FileNotFoundError):
        disk.listdir("/none")


def test_sim_disk_renames_directories() -> None:
    disk = SimDisk()
    disk.makedirs("/s/store")
    disk.write_atomic("/s/store/meta", b"m")
    disk.rename("/s/store", "/s/aside")
    disk.makedirs("/s/store")  # syncs /s: the rename is durable too
    disk.crash(random.Random(0))
    assert disk.listdir("/s") == ["aside", "store"]
    assert disk.read("/s/aside/meta") == b"m"


def test_a_zero_filled_tail_is_cut() -> None:
    # ext4 can leave the blocks of an unsynced append zero-filled after a power cut.
    disk = SimDisk()
    write(disk, "/j", 1, 20).close()
    path = list_segments(disk, "/j")[-1][1]
    size = disk.size(path)
    disk.write_atomic(path, disk.read(path) + bytes(8 * 2**20))
    scan = read_journal(disk, "/j", 0)
    assert len(list(scan)) == 20
    assert scan.torn == (path, size, 8 * 2**20)


def test_record_like_garbage_beyond_the_budget_raises() -> None:
    # A tail crafted so that every 16 bytes look like a record of a plausible seq whose length
    # reaches far ahead: checking them all would cost a checksum over megabytes each.
    disk = SimDisk()
    write(disk, "/j", 1, 5).close()
    path = list_segments(disk, "/j")[-1][1]
    size = disk.size(path)
    tail = 4 * 2**20
    unit = struct.pack(">IIQ", tail // 2, 0, 6)
    disk.write_atomic(path, disk.read(path) + unit * (tail // 16))
    with pytest.raises(StoreCorrupt, match=f"offset {size}: .*too much record-like data"):
        read_all(disk, "/j")

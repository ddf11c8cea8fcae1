"""A :class:`~cpgbroker.store.disk.Disk` that says what became durable: the real file system
(:class:`~cpgbroker.store.disk.OsDisk`), plus a trace of every durable fact, for power-cut
tests of real processes (``[store] sync_trace``; cpgbroker/dev/powercut.py reads the trace).

Why a trace: killing a process (SIGKILL) loses nothing it wrote, since the kernel keeps the
written pages; only a power cut loses what was never synced. A test cannot cut the power of
the machine it runs on, so the member writes down, as it goes, what the contract of
store/disk.py made durable, and the test applies that contract to the directory of the killed
process afterwards, as :meth:`~cpgbroker.store.disk.SimDisk.crash` does to a simulated disk.

The trace is ``sync-trace.log`` in the store directory, one JSON array a line, paths relative
to that directory, written with one ``os.write`` on an ``O_APPEND`` descriptor (a line is
whole, in order, and survives SIGKILL; it is never fsynced: the power is only simulated):

``["N", path]``        a file was created empty by ``open_append``: none of its bytes is durable
``["S", path, n]``     the file's first ``n`` bytes are durable (a sync, truncate, write_atomic)
``["D", path, names]`` the directory's entries are durable as listed (sync_dir, write_atomic,
                       makedirs, which also writes ``[]`` for each directory it created)
``["R", src, dst, replaced]`` a rename, durable only once its directory is synced after it
``["X", path]``        a file was removed (its name comes back in a power cut until the
                       directory is synced, but its bytes are gone: see dev/powercut.py)

A line is written after the operation returned and before the caller hears of it: the syncer
reports an event durable (and a confirm can leave) only after its ``S`` line is written. A kill
in between makes the cut drop what that fsync had made durable: harsher than a power cut, and
only to bytes nobody was told were durable. Costs one short write per fsync (group commit:
not per message) and nothing per record written.

Directory listings are taken after the fsync, under a lock every directory change takes (in
this process and in the snapshot child it forks), so a listing holds exactly what that fsync
made durable, and the trace has the listings in the order they were taken.

The store never reads the trace (it lists only ``journal-``, ``snapshot-`` and its metadata
files), nor removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from typing import BinaryIO

from cpgbroker.store.disk import AppendFile, OsDisk

TRACE_NAME = "sync-trace.log"


class _TracedAppendFile:
    def __init__(self, disk: TracingDisk, inner: AppendFile, rel: str) -> None:
        self._disk = disk
        self._inner = inner
        self._rel = rel

    def write(self, data: bytes) -> None:
        self._inner.write(data)

    def sync(self) -> None:
        self._inner.sync()
        # Everything written so far is durable: the file's size is where the next write lands.
        self._disk._emit(["S", self._rel, self._inner.tell()])

    def close(self) -> None:
        self._inner.close()

    def tell(self) -> int:
        return self._inner.tell()


class TracingDisk:
    """:class:`OsDisk` that traces what became durable under ``root`` (the store directory,
    created durably if missing); paths outside it are served untraced."""

    def __init__(self, root: str) -> None:
        self._os = OsDisk()
        self.root = os.path.abspath(root)
        self.trace_path = os.path.join(self.root, TRACE_NAME)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._fd = -1
        created = not os.path.isdir(self.root)
        self._os.makedirs(self.root)
        self._fd = self._open_trace()
        if created:
            self._emit(["D", ".", []])

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            fd, self._fd = self._fd, -1
            os.close(fd)

    # -- the trace

    def _open_trace(self) -> int:
        return os.open(
            self.trace_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
        )

    def _forked(self) -> None:
        # The snapshot child closes every inherited descriptor (runtime/update/transfer.py)
        # and may have been forked while another thread held the lock: it starts its own
        # of both. The old descriptor number is not closed: it may name another file by now.
        pid = os.getpid()
        if pid != self._pid:
            self._pid = pid
            self._lock = threading.Lock()
            self._fd = self._open_trace()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Held around a directory change or sync and its trace line. The thread lock keeps
        this process's threads apart; ``flock`` (per open file description: the parent's and
        the snapshot child's are two) keeps the two processes apart, so that the last
        listing of a directory in the trace is the last one taken."""
        self._forked()
        with self._lock:
            fd = self._fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fd == self._fd:  # else closed by makedirs, which released the lock
                    fcntl.flock(fd, fcntl.LOCK_UN)

    def _emit(self, record: list[object]) -> None:
        self._forked()
        line = json.dumps(record, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())

    def _rel(self, path: str) -> str | None:
        r = os.path.relpath(os.path.abspath(path), self.root)
        if r == os.pardir or r.startswith(os.pardir + os.sep):
            return None
        return r

    def _emit_dir(self, path: str) -> None:
        path = path or "."
        r = self._rel(path)
        if r is not None:
            self._emit(["D", r, sorted(os.listdir(path))])

    # -- Disk

    def makedirs(self, path: str) -> None:
        with self._locked():
            created: list[str] = []
            p = os.path.abspath(path)
            while not os.path.isdir(p) and os.path.dirname(p) != p:
                created.append(p)
                p = os.path.dirname(p)
            self._os.makedirs(path)
            for d in reversed(created):
                if d == self.root:
                    # Made again after the store was moved aside (Store.discard): the trace
                    # went with the old directory; this one gets a trace of its own.
                    old, self._fd = self._fd, self._open_trace()
                    os.close(old)
                r = self._rel(d)
                if r is not None:
                    self._emit(["D", r, []])
                self._emit_dir(os.path.dirname(d))

    def listdir(self, path: str) -> list[str]:
        return self._os.listdir(path)

    def exists(self, path: str) -> bool:
        return self._os.exists(path)

    def read(self, path: str) -> bytes:
        return self._os.read(path)

    def open_read(self, path: str) -> BinaryIO:
        return self._os.open_read(path)

    def size(self, path: str) -> int:
        return self._os.size(path)

    def open_append(self, path: str) -> AppendFile:
        with self._locked():
            existed = os.path.lexists(path)
            f = self._os.open_append(path)
            r = self._rel(path)
            if r is None:
                return f
            if not existed:
                self._emit(["N", r])
            return _TracedAppendFile(self, f, r)

    def write_atomic(self, path: str, data: bytes) -> None:
        with self._locked():
            self._os.write_atomic(path, data)
            r = self._rel(path)
            if r is not None:
                self._emit(["S", r, len(data)])
                self._emit_dir(os.path.dirname(os.path.abspath(path)))

    def rename(self, src: str, dst: str) -> None:
        with self._locked():
            replaced = os.path.lexists(dst)
            self._os.rename(src, dst)
            rs, rd = self._rel(src), self._rel(dst)
            if rs is not None and rd is not None and rs != ".":
                self._emit(["R", rs, rd, replaced])

    def remove(self, path: str) -> None:
        with self._locked():
            self._os.remove(path)
            r = self._rel(path)
            if r is not None:
                self._emit(["X", r])

    def truncate(self, path: str, size: int) -> None:
        with self._locked():
            self._os.truncate(path, size)
            r = self._rel(path)
            if r is not None:
                self._emit(["S", r, size])

    def sync_dir(self, path: str) -> None:
        with self._locked():
            self._os.sync_dir(path)
            self._emit_dir(path)

    def free_bytes(self, path: str) -> int:
        return self._os.free_bytes(path)


__all__ = ["TRACE_NAME", "TracingDisk"]

"""The store's file layer: the real OS (:class:`OsDisk`) or a simulated disk that loses power
(:class:`SimDisk`), behind one small interface (:class:`Disk`, :class:`AppendFile`).

What is durable
---------------
Both implementations keep the same contract, the one POSIX gives on Linux and that LazyFS
(Jepsen) and Pebble's strict MemFS simulate:

* Bytes written to a file are visible to reads at once but durable only once the file is
  synced (:meth:`AppendFile.sync`, fdatasync). :meth:`Disk.truncate` syncs the file it cuts.
* Creating, renaming or removing a name is visible at once but durable only once its
  directory is synced (:meth:`Disk.sync_dir`). A synced file whose directory entry was never
  synced is lost whole in a crash.
* :meth:`Disk.write_atomic` (temporary file, fsync, rename over, fsync the directory) and
  :meth:`Disk.makedirs` (fsyncs the parent of every directory it creates) are durable when
  they return: the metadata file relies on the first, the store directory on the second.

What survives :meth:`SimDisk.crash`
-----------------------------------
Every directory goes back to the entries it had at its last sync (names created since then
vanish, names removed or renamed away since then come back). Every file still reachable keeps
its synced bytes plus a random prefix of what was written after them (nothing, all of it, or a
cut through the middle of a record), and now and then the last few bytes it keeps are garbled:
a page the disk wrote half of. Synced bytes are never touched: a disk that corrupts data it
acknowledged is a different failure (checksums catch it; the journal raises ``StoreCorrupt``).

Not modelled: a failed fsync that a later fsync reports as success after the kernel dropped
the dirty pages (the PostgreSQL "fsyncgate" lesson). The syncer never syncs again after a
failure, so nothing relies on what that later fsync would say.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import os
import posixpath
import random
import threading
from collections import deque
from typing import BinaryIO, Protocol

from cpgbroker.errors import CpgBrokerError


class StoreError(CpgBrokerError):
    """The durable store cannot do what was asked (I/O failed, the store is unusable)."""


class StoreCorrupt(StoreError):
    """Stored data that cannot be trusted; the message names the file and byte offset."""


class AppendFile(Protocol):
    """A file opened for appending. Not thread-safe: one thread uses it at a time."""

    def write(self, data: bytes) -> None:
        """Append all of ``data`` (visible at once, durable after :meth:`sync`)."""

    def sync(self) -> None:
        """Make every byte written so far durable (fdatasync)."""

    def close(self) -> None: ...

    def tell(self) -> int:
        """The file's size: where the next write lands."""


class Disk(Protocol):
    """The file operations the store uses. Paths are ``str``; see the module docstring for
    what each operation makes durable."""

    def makedirs(self, path: str) -> None: ...

    def listdir(self, path: str) -> list[str]:
        """The names in a directory, sorted."""

    def exists(self, path: str) -> bool: ...

    def read(self, path: str) -> bytes: ...

    def open_read(self, path: str) -> BinaryIO:
        """A file to read from the start (big files: read in pieces, not whole)."""
        ...

    def size(self, path: str) -> int: ...

    def open_append(self, path: str) -> AppendFile:
        """Open for appending; the file is created (empty) if missing."""

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data``, durably: after a crash it holds the old content or
        the new, never a mix."""

    def rename(self, src: str, dst: str) -> None:
        """Rename a file or directory, replacing a file at ``dst``."""

    def remove(self, path: str) -> None: ...

    def truncate(self, path: str, size: int) -> None:
        """Cut the file to ``size`` bytes and sync it."""

    def sync_dir(self, path: str) -> None: ...

    def free_bytes(self, path: str) -> int:
        """Bytes an unprivileged writer can still use on the file system holding ``path``."""


# fdatasync skips the inode times an append does not need; it still syncs the size.
_datasync = getattr(os, "fdatasync", os.fsync)


def _write_all(fd: int, data: bytes) -> int:
    """Write all of ``data``; os.write may write less than asked (a signal, a full disk)."""
    total = len(data)
    n = os.write(fd, data)
    if n == total:
        return n
    view = memoryview(data)[n:]
    while view:
        k = os.write(fd, view)
        if k <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[k:]
    return total


class _OsAppendFile:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._pos = os.fstat(self._fd).st_size

    def write(self, data: bytes) -> None:
        # Counted before the write: after a partial write that then failed the position is
        # unknown, and a writer that saw the error must not write again anyway.
        self._pos += len(data)
        _write_all(self._fd, data)

    def sync(self) -> None:
        _datasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def tell(self) -> int:
        return self._pos


class OsDisk:
    """The real file system (Linux semantics; elsewhere ``fsync`` may promise less)."""

    def makedirs(self, path: str) -> None:
        created: list[str] = []
        p = os.path.abspath(path)
        while not os.path.isdir(p):
            created.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        if not created:
            return
        os.makedirs(path, exist_ok=True)
        for d in reversed(created):
            self.sync_dir(os.path.dirname(d))

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb", buffering=1 << 20)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def open_append(self, path: str) -> AppendFile:
        return _OsAppendFile(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        tmp = path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        self.sync_dir(os.path.dirname(path) or ".")

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        os.remove(path)

    def truncate(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def free_bytes(self, path: str) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize


# ---------------------------------------------------------------------------------- SimDisk


class _File:
    """A file's content as reads see it; its first ``synced`` bytes are durable. Files are
    only appended to, cut by a syncing truncate, or written whole by write_atomic, so what is
    durable is always a prefix of what reads see."""

    __slots__ = ("data", "synced")

    def __init__(self, data: bytes = b"", synced: int = 0) -> None:
        self.data = bytearray(data)
        self.synced = synced


class _Dir:
    """A directory's entries as lookups see them, and as they were at its last sync."""

    __slots__ = ("durable", "entries")

    def __init__(self) -> None:
        self.entries: dict[str, _File | _Dir] = {}
        self.durable: dict[str, _File | _Dir] = {}

    def sync(self) -> None:
        self.durable = dict(self.entries)


# Operations SimDisk.fail can make fail.
FAILABLE = frozenset(
    {
        "write",
        "sync",
        "open_append",
        "write_atomic",
        "truncate",
        "sync_dir",
        "rename",
        "remove",
        "makedirs",
    }
)


def _error(code: int, path: str) -> OSError:
    # OSError(errno, ...) constructs the matching subclass (FileNotFoundError for ENOENT, ...).
    return OSError(code, os.strerror(code), path)


class _SimAppendFile:
    def __init__(self, disk: SimDisk, node: _File, path: str) -> None:
        self._disk = disk
        self._node = node
        self._path = path
        self._generation = disk._generation
        self._closed = False

    def _check(self) -> None:
        # A handle from before a crash belongs to a process that died with it.
        if self._closed or self._generation != self._disk._generation:
            raise _error(errno.EBADF, self._path)

    def write(self, data: bytes) -> None:
        with self._disk._lock:
            self._check()
            self._disk._maybe_fail("write", self._path)
            self._node.data += data

    def sync(self) -> None:
        with self._disk._lock:
            self._check()
            self._disk._maybe_fail("sync", self._path)
            self._node.synced = len(self._node.data)

    def close(self) -> None:
        self._closed = True

    def tell(self) -> int:
        with self._disk._lock:
            return len(self._node.data)


class SimDisk:
    """An in-memory disk that can lose power (:meth:`crash`) and fail operations
    (:meth:`fail`); see the module docstring for what survives. Thread-safe (one lock), so a
    test thread may look at it while a syncer thread writes. Relative and absolute paths name
    the same tree."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._root = _Dir()
        self._generation = 0
        self._failures: dict[str, deque[int]] = {}
        # What free_bytes reports; set it to test a full disk's warnings.
        self.free = 1 << 40

    # -- fault injection

    def fail(self, op: str, err: int, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` (one of :data:`FAILABLE`) raise
        ``OSError(err)`` without doing anything."""
        if op not in FAILABLE:
            raise ValueError(f"cannot fail {op!r}: one of {sorted(FAILABLE)}")
        with self._lock:
            self._failures.setdefault(op, deque()).extend([err] * times)

    def crash(self, rng: random.Random, garble: float = 0.25) -> None:
        """Lose power: undo unsynced directory changes, keep a random prefix of each file's
        unsynced bytes and garble the last few of them with probability ``garble``. Open
        handles die (EBADF) and pending :meth:`fail` requests are forgotten."""
        with self._lock:
            self._generation += 1
            self._failures.clear()
            seen: set[int] = set()
            stack = [self._root]
            while stack:
                d = stack.pop()
                d.entries = dict(d.durable)
                # Sorted: the rng draws in the same order whatever order names were added in.
                for name in sorted(d.entries):
                    node = d.entries[name]
                    if id(node) in seen:
                        continue
                    seen.add(id(node))
                    if isinstance(node, _Dir):
                        stack.append(node)
                    else:
                        _lose_unsynced(node, rng, garble)

    def copy(self) -> SimDisk:
        """An independent copy of the disk's content (what is synced and what is not), e.g. to
        crash it while this one goes on."""
        with self._lock:
            other = SimDisk()
            other._root = copy.deepcopy(self._root)
            other.free = self.free
            return other

    def _maybe_fail(self, op: str, path: str) -> None:
        pending = self._failures.get(op)
        if pending:
            raise _error(pending.popleft(), path)

    # -- path resolution

    @staticmethod
    def _parts(path: str) -> list[str]:
        return [p for p in posixpath.normpath(path).split("/") if p and p != "."]

    def _dir(self, parts: list[str], path: str) -> _Dir:
        d = self._root
        for p in parts:
            node = d.entries.get(p)
            if node is None:
                raise _error(errno.ENOENT, path)
            if not isinstance(node, _Dir):
                raise _error(errno.ENOTDIR, path)
            d = node
        return d

    def _parent(self, path: str) -> tuple[_Dir, str]:
        parts = self._parts(path)
        if not parts:
            raise _error(errno.EINVAL, path)
        return self._dir(parts[:-1], path), parts[-1]

    def _node(self, path: str) -> _File | _Dir:
        parts = self._parts(path)
        if not parts:
            return self._root
        d, name = self._dir(parts[:-1], path), parts[-1]
        node = d.entries.get(name)
        if node is None:
            raise _error(errno.ENOENT, path)
        return node

    def _file(self, path: str) -> _File:
        node = self._node(path)
        if isinstance(node, _Dir):
            raise _error(errno.EISDIR, path)
        return node

    # -- Disk

    def makedirs(self, path: str) -> None:
        with self._lock:
            self._maybe_fail("makedirs", path)
            d = self._root
            for p in self._parts(path):
                node = d.entries.get(p)
                if node is None:
                    node = _Dir()
                    d.entries[p] = node
                    d.sync()  # as OsDisk does: the new directory's name is durable
                elif not isinstance(node, _Dir):
                    raise _error(errno.ENOTDIR, path)
                d = node

    def listdir(self, path: str) -> list[str]:
        with self._lock:
            node = self._node(path)
            if not isinstance(node, _Dir):
                raise _error(errno.ENOTDIR, path)
            return sorted(node.entries)

    def exists(self, path: str) -> bool:
        with self._lock:
            try:
                self._node(path)
            except OSError:
                return False
            return True

    def read(self, path: str) -> bytes:
        with self._lock:
            return bytes(self._file(path).data)

    def open_read(self, path: str) -> BinaryIO:
        return io.BytesIO(self.read(path))

    def size(self, path: str) -> int:
        with self._lock:
            return len(self._file(path).data)

    def open_append(self, path: str) -> AppendFile:
        with self._lock:
            self._maybe_fail("open_append", path)
            d, name = self._parent(path)
            node = d.entries.get(name)
            if node is None:
                node = _File()
                d.entries[name] = node
            elif isinstance(node, _Dir):
                raise _error(errno.EISDIR, path)
            return _SimAppendFile(self, node, path)

    def write_atomic(self, path: str, data: bytes) -> None:
        with self._lock:
            self._maybe_fail("write_atomic", path)
            d, name = self._parent(path)
            if isinstance(d.entries.get(name), _Dir):
                raise _error(errno.EISDIR, path)
            d.entries[name] = _File(data, len(data))
            d.sync()

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            self._maybe_fail("rename", src)
            sd, sname = self._parent(src)
            node = sd.entries.get(sname)
            if node is None:
                raise _error(errno.ENOENT, src)
            dd, dname = self._parent(dst)
            old = dd.entries.get(dname)
            if old is node:
                return
            if isinstance(node, _File) and isinstance(old, _Dir):
                raise _error(errno.EISDIR, dst)
            if isinstance(node, _Dir) and isinstance(old, _File):
                raise _error(errno.ENOTDIR, dst)
            if isinstance(old, _Dir) and old.entries:
                raise _error(errno.ENOTEMPTY, dst)
            del sd.entries[sname]
            dd.entries[dname] = node

    def remove(self, path: str) -> None:
        with self._lock:
            self._maybe_fail("remove", path)
            d, name = self._parent(path)
            node = d.entries.get(name)
            if node is None:
                raise _error(errno.ENOENT, path)
            if isinstance(node, _Dir):
                raise _error(errno.EISDIR, path)
            del d.entries[name]

    def truncate(self, path: str, size: int) -> None:
        with self._lock:
            self._maybe_fail("truncate", path)
            f = self._file(path)
            if size <= len(f.data):
                del f.data[size:]
            else:
                f.data.extend(bytes(size - len(f.data)))
            f.synced = len(f.data)

    def sync_dir(self, path: str) -> None:
        with self._lock:
            self._maybe_fail("sync_dir", path)
            node = self._node(path)
            if not isinstance(node, _Dir):
                raise _error(errno.ENOTDIR, path)
            node.sync()

    def free_bytes(self, path: str) -> int:
        with self._lock:
            self._node(path)
            return self.free


def _lose_unsynced(f: _File, rng: random.Random, garble: float) -> None:
    pending = len(f.data) - f.synced
    if pending > 0:
        # Nothing, everything and a cut anywhere are all likely, not just the middle.
        keep = rng.choice((0, pending, rng.randint(0, pending)))
        del f.data[f.synced + keep :]
        if keep and rng.random() < garble:
            n = rng.randint(1, min(keep, 8))
            for i in range(len(f.data) - n, len(f.data)):
                f.data[i] ^= rng.randint(1, 255)
    f.synced = len(f.data)


__all__ = [
    "FAILABLE",
    "AppendFile",
    "Disk",
    "OsDisk",
    "SimDisk",
    "StoreCorrupt",
    "StoreError",
]

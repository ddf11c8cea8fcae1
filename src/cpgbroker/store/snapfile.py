"""Snapshot files: the whole model as it is after one event, the base the journal replays on.

A snapshot holds the model's full state (connections and transient messages too), not only
what survives a restart: the journal after it replays client bytes that may refer to any of
it. What a restart drops is dropped afterwards, by a ``Recovered`` event (model/events.py).

Layout: ``MAGIC``, then the parts of ``model.snapshot.parts`` as length-prefixed encoded
frames, a zero length and the SHA-256 of every frame's bytes. It is written by a forked child
(the model as of the fork, copy on write; the member goes on at once) to a temporary name,
fsynced, and renamed into place with the directory fsynced: a snapshot file is whole or absent.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from typing import IO

from cpgbroker.model import Broker, BrokerConfig, snapshot
from cpgbroker.store.disk import Disk, StoreCorrupt

MAGIC = b"CPGBSNP1"
_LEN = struct.Struct(">I")
# A part is at most a chunk of messages; a length near this is corruption.
MAX_PART = 256 * 1024 * 1024
# Bytes gathered before one write.
WRITE_CHUNK = 1 << 20


def name(seq: int) -> str:
    return f"snapshot-{seq:020d}.snap"


def write(disk: Disk, path: str, broker: Broker) -> int:
    """Write ``broker`` to ``path`` durably (blocking: run in a forked child); its size."""
    tmp = path + ".tmp"
    if disk.exists(tmp):
        disk.remove(tmp)
    h = hashlib.sha256()
    f = disk.open_append(tmp)
    try:
        buf = [MAGIC]
        held = len(MAGIC)
        for part in snapshot.parts(broker):
            data = snapshot.encode(part)
            h.update(data)
            buf.append(_LEN.pack(len(data)))
            buf.append(data)
            held += _LEN.size + len(data)
            if held >= WRITE_CHUNK:
                f.write(b"".join(buf))
                buf, held = [], 0
        buf.append(_LEN.pack(0) + h.digest())
        f.write(b"".join(buf))
        f.sync()
        size = f.tell()
    finally:
        f.close()
    disk.rename(tmp, path)
    disk.sync_dir(os.path.dirname(path) or ".")
    return size


def read(
    f: IO[bytes],
    path: str,
    config: BrokerConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Broker:
    """Restore the broker a snapshot file holds; ``StoreCorrupt`` names the file and offset
    of anything wrong. ``progress(parts, bytes)`` is called now and then."""
    if f.read(len(MAGIC)) != MAGIC:
        raise StoreCorrupt(f"{path}: offset 0: not a snapshot file")
    r = snapshot.Restorer(config)
    h = hashlib.sha256()
    offset = len(MAGIC)
    while True:
        head = f.read(_LEN.size)
        if len(head) != _LEN.size:
            raise StoreCorrupt(f"{path}: offset {offset}: snapshot ends before its checksum")
        (n,) = _LEN.unpack(head)
        if n == 0:
            if f.read(32) != h.digest():
                raise StoreCorrupt(f"{path}: offset {offset}: snapshot checksum mismatch")
            break
        if n > MAX_PART:
            raise StoreCorrupt(f"{path}: offset {offset}: part of {n} bytes")
        data = f.read(n)
        if len(data) != n:
            raise StoreCorrupt(f"{path}: offset {offset}: snapshot part cut short")
        h.update(data)
        try:
            r.feed(snapshot.decode(data))
        except Exception as e:
            raise StoreCorrupt(f"{path}: offset {offset}: {type(e).__name__}: {e}") from e
        offset += _LEN.size + n
        if progress is not None and r.parts % 64 == 0:
            progress(r.parts, offset)
    try:
        return r.finish()
    except Exception as e:
        raise StoreCorrupt(f"{path}: {type(e).__name__}: {e}") from e

"""State transfer to a newcomer over a side TCP connection.

Why a side connection and not CPG: every CPG message reaches every member, so a 1 GiB state
sent over CPG would cost every member (and corosync's one ordered ring) a gigabyte; over TCP it
costs only the updater and the newcomer, and members not involved keep serving at full speed.

Why ``fork``: the snapshot must be the state at exactly one point of the event order, while
the updater keeps applying events and serving its clients. A forked child holds a
copy-on-write image of the model at that point for free; it streams the snapshot parts and
exits, and the parent never pauses longer than the fork itself (page tables: milliseconds for
gigabytes). The child closes every inherited descriptor first (client sockets, the CPG
connection), so the parent's death or its clients' disconnects are never delayed by it, and it
dies with its parent.

Authentication: the updater only ever *connects out*, to the address a newcomer named in an
:class:`~cpgbroker.cluster.codec.UpdateRequest`, and such a request can only come from a member
of the CPG group (corosync's authkey and crypto keep others out of the group). The newcomer
accepts only a connection that presents the random token of its current request, which only
group members have seen. The state itself travels unencrypted: keep ``update_listen`` on the
cluster's private network, as corosync's own ring is.

Stream (after the 8-byte magic and the token): frames of ``u32 length`` + payload. The first
payload is the preamble ``{"updater", "seq", "members"}``, then one payload per snapshot part
(:func:`cpgbroker.model.state.snapshot.parts`, canonical encoding), then a zero-length frame and the
SHA-256 of all part payloads, which the newcomer checks (the model digest, but for a
replica's update from the back of its queues, which leaves out what was consumed meanwhile:
:class:`Released`).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import trio

from cpgbroker.errors import ClusterError, InvariantError
from cpgbroker.model import Broker, snapshot
from cpgbroker.runtime.config.settings import parse_listen

log = logging.getLogger("cpgbroker.update")

MAGIC = b"CPGBUPD1"
TOKEN_BYTES = 16
_LEN = struct.Struct(">I")
# A part is at most a chunk of messages; anything near this is corrupt or hostile.
MAX_PART = 256 * 1024 * 1024
PROGRESS_EVERY_S = 2.0


def _die_with_parent(parent: int) -> None:
    """PR_SET_PDEATHSIG: an updater child never outlives the member that forked it. Set after
    the fork, it misses a parent that died in between (the child would write a snapshot into a
    directory a restarted member may use): so the parent is looked at once it is set."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:
        os._exit(1)


def fork_updater(
    address: str,
    token: bytes,
    broker: Broker,
    members: list[list[Any]],
    updater: int,
    newcomer: int,
    rate_limit: float = 0.0,
    released: int = -1,
) -> int:
    """Fork a child that streams ``broker`` as it is now to the newcomer; returns its pid.
    The parent continues at once. ``released`` (a hot-standby replica's update): the read
    end of a pipe on which the parent writes what consumers took since (:class:`Released`);
    the child then sends each queue from its back and leaves those out."""
    seq = broker.event_seq
    gone = None if released < 0 else Released(released).gone
    return fork_child(
        lambda: push_update(
            address, token, broker, members, updater, newcomer, seq, rate_limit, gone
        ),
        f"state update to member {newcomer}",
        keep=released,
    )


class Released:
    """The child's side of the pipe that says which messages consumers took since the fork:
    frames of ``u16 length`` + ``snapshot.encode([[vhost, queue, [ids]], ...])``, each at most
    ``PIPE_BUF`` bytes so that the parent's non-blocking writes are whole or nothing (a frame
    the parent could not write is lost: the child then sends those messages, and the
    newcomer's replay of the stream removes them, as it removes any consumed later)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.buf = bytearray()
        self.ids: dict[tuple[str, str], set[int]] = {}
        self.open = True

    def gone(self, q: Any) -> set[int]:
        self._drain()
        return self.ids.get((q.vhost, q.name), _NONE)

    def _drain(self) -> None:
        while self.open:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                self.open = False  # the parent is gone (and the child dies with it)
                break
            self.buf += chunk
        buf = self.buf
        while len(buf) >= 2:
            (n,) = _U16.unpack_from(buf)
            if len(buf) < 2 + n:
                break
            for vhost, name, ids in snapshot.decode(bytes(buf[2 : 2 + n])):
                self.ids.setdefault((vhost, name), set()).update(ids)
            del buf[: 2 + n]


_NONE: set[int] = set()
_U16 = struct.Struct(">H")
# Frames on the released pipe stay within PIPE_BUF: atomic non-blocking writes.
RELEASED_FRAME = 4000


def released_frames(released: list[tuple[str, str, int]]) -> list[bytes]:
    """The parent's side of :class:`Released`: what consumers took, in whole frames."""
    by_queue: dict[tuple[str, str], list[int]] = {}
    for vhost, name, mid in released:
        by_queue.setdefault((vhost, name), []).append(mid)
    frames = []
    for (vhost, name), ids in by_queue.items():
        # An id takes at most 22 bytes encoded: chunks that keep every frame small.
        step = max(1, (RELEASED_FRAME - 2 * len(vhost) - 2 * len(name) - 64) // 22)
        for i in range(0, len(ids), step):
            data = snapshot.encode([[vhost, name, ids[i : i + step]]])
            frames.append(_U16.pack(len(data)) + data)
    return frames


def fork_child(work: Callable[[], None], what: str, keep: int = -1) -> int:
    """Run ``work`` in a forked child that sees the model exactly as it is now (copy on
    write) while the parent goes on at once; returns the child's pid. The child closes every
    inherited descriptor but ``keep`` (client sockets, the CPG connection: the parent's death
    or its clients' disconnects are never delayed by it) and dies with its parent."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        gc.disable()  # nothing to collect in a short-lived child; and no finalizer may run
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        _die_with_parent(parent)
        top = os.sysconf("SC_OPEN_MAX")
        if keep >= 3:
            os.closerange(3, keep)
            os.closerange(keep + 1, top)
        else:
            os.closerange(3, top)
        work()
        code = 0
    except BaseException as e:
        log.error("%s failed: %s", what, e)
    finally:
        os._exit(code)


def push_update(
    address: str,
    token: bytes,
    broker: Broker,
    members: list[list[Any]],
    updater: int,
    newcomer: int,
    seq: int,
    rate_limit: float = 0.0,
    gone: Callable[[Any], set[int]] | None = None,
) -> None:
    """Blocking: stream the snapshot to the newcomer (runs in the forked child)."""
    host, port = parse_listen(address)
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as s:
        s.settimeout(120)  # a newcomer that stops reading for this long is gone
        s.sendall(MAGIC + token)

        def frame(data: bytes) -> None:
            if len(data) < 65536:
                s.sendall(_LEN.pack(len(data)) + data)
            else:  # large parts: no copy to prepend four bytes
                s.sendall(_LEN.pack(len(data)))
                s.sendall(data)

        frame(snapshot.encode({"updater": updater, "seq": seq, "members": members}))
        h = hashlib.sha256()
        sent = 0
        nparts = 0
        next_report = t0 + PROGRESS_EVERY_S
        for part in snapshot.parts(broker, gone=gone):
            data = snapshot.encode(part)
            h.update(data)
            frame(data)
            sent += len(data)
            nparts += 1
            if rate_limit > 0:
                ahead = t0 + sent / (rate_limit * 2**20) - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            if time.monotonic() >= next_report:
                next_report += PROGRESS_EVERY_S
                log.info(
                    "state update to member=%s seq=%s: %d parts, %.1f MiB sent",
                    newcomer,
                    seq,
                    nparts,
                    sent / 2**20,
                )
        s.sendall(_LEN.pack(0) + h.digest())
        s.shutdown(socket.SHUT_WR)
        # Wait for the newcomer to close: it has read everything (or died).
        while s.recv(4096):
            pass
    log.info(
        "state update to member=%s seq=%s sent: %d parts, %.1f MiB in %.1f s",
        newcomer,
        seq,
        nparts,
        sent / 2**20,
        time.monotonic() - t0,
    )


class UpdateProgress:
    """What a newcomer knows about the update it receives (for logs and ``status``)."""

    def __init__(self, updater: int) -> None:
        self.updater = updater
        self.seq: int | None = None
        self.parts = 0
        self.bytes = 0
        self.messages = 0
        self.total_messages = 0
        self.total_bytes = 0
        self.started = time.monotonic()

    def as_dict(self) -> dict[str, Any]:
        return {
            "updater": self.updater,
            "seq": self.seq,
            "parts": self.parts,
            "bytes": self.bytes,
            "messages": self.messages,
            "total_messages": self.total_messages,
            "queued_bytes": self.total_bytes,
            "seconds": round(time.monotonic() - self.started, 1),
        }


class _Reader:
    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.stream.receive_some(max(65536, n - len(self.buf)))
            if not chunk:
                raise ClusterError("the updater closed the state transfer early")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


async def read_token(stream: trio.abc.ReceiveStream) -> tuple[_Reader, bytes]:
    r = _Reader(stream)
    with trio.fail_after(10):
        head = await r.exactly(len(MAGIC) + TOKEN_BYTES)
    if head[: len(MAGIC)] != MAGIC:
        raise ClusterError("not a cpgbroker state transfer")
    return r, head[len(MAGIC) :]


async def receive_update(
    r: _Reader, restorer: snapshot.Restorer, progress: UpdateProgress
) -> tuple[Broker, list[list[Any]]]:
    """Read the preamble and every part into ``restorer``; check the digest."""

    async def payload() -> bytes:
        with trio.fail_after(120):
            (n,) = _LEN.unpack(await r.exactly(4))
            if n > MAX_PART:
                raise ClusterError(f"state transfer part of {n} bytes is too large")
            return await r.exactly(n) if n else b""

    try:
        pre = snapshot.decode(await payload())
    except (InvariantError, ValueError, IndexError) as e:
        raise ClusterError(f"state transfer preamble is corrupt: {e}") from e
    if not isinstance(pre, dict) or pre.get("updater") != progress.updater:
        raise ClusterError("state transfer from an unexpected member")
    progress.seq = pre["seq"]
    members = pre["members"]
    h = hashlib.sha256()
    next_report = time.monotonic() + PROGRESS_EVERY_S
    while True:
        data = await payload()
        if not data:
            break
        h.update(data)
        try:
            restorer.feed(snapshot.decode(data))
        except (InvariantError, ValueError, IndexError, KeyError, TypeError) as e:
            raise ClusterError(f"state transfer part {progress.parts + 1} is corrupt: {e}") from e
        progress.parts += 1
        progress.bytes += len(data)
        progress.messages = restorer.messages
        if restorer.head is not None and progress.parts == 1:
            progress.total_messages = restorer.head["messages"]
            progress.total_bytes = restorer.head["queued_bytes"]
        if time.monotonic() >= next_report:
            next_report += PROGRESS_EVERY_S
            log.info(
                "receiving state update from member=%s seq=%s: %d/%d messages, %.1f MiB",
                progress.updater,
                progress.seq,
                progress.messages,
                progress.total_messages,
                progress.bytes / 2**20,
            )
        await trio.lowlevel.checkpoint()  # let the CPG reader buffer what arrives meanwhile
    with trio.fail_after(120):
        expected = await r.exactly(32)
    if h.digest() != expected:
        raise ClusterError("state transfer digest mismatch: the update is corrupt")
    try:
        return restorer.finish(), members
    except (InvariantError, IndexError, KeyError) as e:
        raise ClusterError(f"state transfer is inconsistent: {e}") from e

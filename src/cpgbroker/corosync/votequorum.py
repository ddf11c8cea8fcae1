"""Typed wrapper over corosync's votequorum library: is this node in a quorate partition?

A :class:`Quorum` is one connection to the local corosync's votequorum service with change
tracking on (``votequorum_trackstart(CS_TRACK_CURRENT | CS_TRACK_CHANGES)``): the current state
arrives through :meth:`Quorum.dispatch` right away, then every change. Events, in delivery
order, as frozen objects:

* :class:`NodeListChange` - a new totem ring: its id and node ids. Corosync sends one during
  the synchronisation of every ring, before that ring's :class:`QuorumChange`.
* :class:`QuorumChange` - whether this node's partition is quorate, with every known node's
  state. Sent when a ring's synchronisation completes (so the one after a
  :class:`NodeListChange` is that ring's verdict) and when quorum changes within a ring
  (expected votes changed by an operator).
* :class:`ExpectedVotesChange` - expected votes changed.

The callbacks are C functions (``cffi_build/quorum_binding.c``) that copy each notification
into a record; Python parses the records after ``votequorum_dispatch`` returns, so no callback
can raise into the library or lose a notification.

``cs_error_t`` is common to every corosync library, so failures raise the same classes as the
CPG binding (:func:`cpgbroker.corosync.errors.make_error`; all under
:class:`cpgbroker.errors.CpgError`), naming the votequorum call: a lost corosync is
:class:`~cpgbroker.corosync.errors.CpgConnectionLost`
whichever handle noticed it. No I/O waiting here: see :mod:`cpgbroker.runtime.ring.quorum_trio`.
"""

from __future__ import annotations

import contextlib
import struct
import warnings
from typing import Any, Final, TypeAlias

import attrs

from cpgbroker.corosync.cpg import enter_netns
from cpgbroker.corosync.errors import (
    CpgBadHandle,
    CpgBindingError,
    CpgConnectionLost,
    CsError,
    make_error,
)
from cpgbroker.corosync.events import RingId

try:
    from cpgbroker.corosync._quorum import ffi, lib
except ImportError as _e:  # pragma: no cover - depends on how the package was installed
    raise CpgBindingError(
        "cpgbroker's compiled libvotequorum binding (cpgbroker.corosync._quorum) cannot be "
        f"imported ({_e}). Install the package with `pip install -e .`, which builds it; that "
        "needs gcc and the Debian package libvotequorum-dev."
    ) from _e

# Must match VQB_BINDING_VERSION in cffi_build/quorum_binding.c.
EXPECTED_BINDING_VERSION: Final = 1
if lib.VQB_BINDING_VERSION != EXPECTED_BINDING_VERSION:  # pragma: no cover
    raise CpgBindingError(
        f"cpgbroker.corosync._quorum is binding version {lib.VQB_BINDING_VERSION}, this quorum.py "
        f"expects {EXPECTED_BINDING_VERSION}: rebuild it with `pip install -e .`"
    )

CS_OK: Final[int] = lib.CS_OK
# Node ids in getinfo: 0 asks about the local node.
LOCAL_NODE: Final = 0
NODESTATE_MEMBER: Final[int] = lib.VOTEQUORUM_NODESTATE_MEMBER
NODESTATE_DEAD: Final[int] = lib.VOTEQUORUM_NODESTATE_DEAD
NODESTATE_LEAVING: Final[int] = lib.VOTEQUORUM_NODESTATE_LEAVING
_STATE_NAMES: Final = {
    NODESTATE_MEMBER: "member",
    NODESTATE_DEAD: "dead",
    NODESTATE_LEAVING: "leaving",
}


# ---------------------------------------------------------------------------- events


@attrs.frozen
class QuorumNode:
    """A node votequorum knows about, with its state (member, dead or leaving)."""

    nodeid: int
    state: int

    @property
    def state_name(self) -> str:
        return _STATE_NAMES.get(self.state, f"state-{self.state}")


@attrs.frozen
class QuorumChange:
    """This node's partition is (or is no longer) quorate."""

    quorate: bool
    nodes: tuple[QuorumNode, ...]


@attrs.frozen
class NodeListChange:
    """A new totem ring (the same ring ids as CPG's
    :class:`~cpgbroker.corosync.events.TotemConfChg`)."""

    ring_id: RingId
    members: tuple[int, ...]


@attrs.frozen
class ExpectedVotesChange:
    expected_votes: int


QuorumEvent: TypeAlias = QuorumChange | NodeListChange | ExpectedVotesChange


@attrs.frozen
class QuorumInfo:
    """``votequorum_getinfo`` for one node (the local one by default)."""

    node_id: int
    node_state: int
    node_votes: int
    expected_votes: int
    highest_expected: int
    total_votes: int
    quorum: int
    flags: int

    @property
    def quorate(self) -> bool:
        return bool(self.flags & lib.VOTEQUORUM_INFO_QUORATE)

    @property
    def two_node(self) -> bool:
        """votequorum's two_node mode: a lone node of two stays quorate (it counts on fencing)."""
        return bool(self.flags & lib.VOTEQUORUM_INFO_TWONODE)

    def as_dict(self) -> dict[str, Any]:
        return {
            "quorate": self.quorate,
            "node_votes": self.node_votes,
            "expected_votes": self.expected_votes,
            "total_votes": self.total_votes,
            "quorum": self.quorum,
        }


_HEADER = struct.Struct("=II")
_QUORUM = struct.Struct("=IIII")  # type, quorate, n_nodes, 0
_NODELIST = struct.Struct("=IIQII")  # type, ring nodeid, ring seq, n_nodes, 0
_EXPECTED = struct.Struct("=II8x")  # type, expected votes


def parse_record(rec: bytes) -> QuorumEvent:
    """One raw record of ``quorum_binding.c`` as an event (exposed for the unit tests)."""
    kind = _HEADER.unpack_from(rec)[0]
    if kind == lib.VQB_EV_QUORUM:
        _, quorate, n, _ = _QUORUM.unpack_from(rec)
        flat = struct.unpack_from(f"={2 * n}I", rec, _QUORUM.size)
        nodes = tuple(QuorumNode(flat[i], flat[i + 1]) for i in range(0, 2 * n, 2))
        return QuorumChange(bool(quorate), nodes)
    if kind == lib.VQB_EV_NODELIST:
        _, ring_node, ring_seq, n, _ = _NODELIST.unpack_from(rec)
        members = struct.unpack_from(f"={n}I", rec, _NODELIST.size)
        return NodeListChange(RingId(ring_node, ring_seq), tuple(members))
    if kind == lib.VQB_EV_EXPECTED:
        return ExpectedVotesChange(_EXPECTED.unpack_from(rec)[1])
    raise make_error(lib.CS_ERR_LIBRARY, "votequorum_dispatch", f"unknown record type {kind}")


# ---------------------------------------------------------------------------- the handle


class Quorum:
    """One connection to the local corosync's votequorum service, tracking changes.

    Not thread-safe. ``netns`` opens the connection inside a named network namespace (as
    :class:`cpgbroker.corosync.cpg.Cpg` does). Close it with :meth:`close` or a ``with`` block.
    """

    def __init__(self, *, netns: str | None = None) -> None:
        self._closed = True
        self._handle = 0
        self.netns = netns
        self._queue = ffi.new("vqb_queue *")
        self._pending_error: CsError | None = None
        handle = ffi.new("votequorum_handle_t *")
        with enter_netns(netns):
            rc = lib.vqb_initialize(handle, self._queue)
        if rc != CS_OK:
            detail = None
            if rc == lib.CS_ERR_LIBRARY:
                where = f" in network namespace {netns}" if netns else ""
                detail = (
                    f"corosync is not running{where}, or runs without the votequorum provider "
                    "(quorum { provider: corosync_votequorum })"
                )
            raise make_error(rc, "votequorum_initialize", detail)
        self._handle = int(handle[0])
        self._closed = False
        try:
            fd = ffi.new("int *")
            self._check(lib.votequorum_fd_get(self._handle, fd), "votequorum_fd_get")
            self._fd = int(fd[0])
            self._check(
                lib.votequorum_trackstart(
                    self._handle, 0, lib.CS_TRACK_CURRENT | lib.CS_TRACK_CHANGES
                ),
                "votequorum_trackstart",
            )
        except BaseException:
            self.close()
            raise

    def _check(self, rc: int, operation: str) -> None:
        if rc != CS_OK:
            raise make_error(rc, operation)

    def _live(self, operation: str) -> int:
        if self._closed:
            raise CpgBadHandle(operation, "the votequorum handle is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        """The fd that becomes readable when notifications are ready for :meth:`dispatch`."""
        self._live("votequorum_fd_get")
        return self._fd

    def getinfo(self, nodeid: int = LOCAL_NODE) -> QuorumInfo:
        """``votequorum_getinfo``: votes and quorum as corosync computes them now (a
        synchronous round trip; blocks if corosync hangs)."""
        info = ffi.new("struct votequorum_info *")
        self._check(
            lib.votequorum_getinfo(self._live("votequorum_getinfo"), nodeid, info),
            "votequorum_getinfo",
        )
        return QuorumInfo(
            node_id=int(info.node_id),
            node_state=int(info.node_state),
            node_votes=int(info.node_votes),
            expected_votes=int(info.node_expected_votes),
            highest_expected=int(info.highest_expected),
            total_votes=int(info.total_votes),
            quorum=int(info.quorum),
            flags=int(info.flags),
        )

    def take_pending_error(self) -> CsError | None:
        """An error the last dispatch met after it had returned notifications (reported by the
        next dispatch otherwise): a caller that waits for the fd to become readable again must
        not wait for it, the fd may never be."""
        err, self._pending_error = self._pending_error, None
        return err

    def dispatch(self) -> list[QuorumEvent]:
        """Every notification ready now (CS_DISPATCH_ALL), in order; never blocks.

        As with CPG, an error after some notifications were received is raised on the next
        call, after those were returned. A lost corosync raises ``CpgConnectionLost``.
        """
        err = self.take_pending_error()
        if err is not None:
            raise err
        handle = self._live("votequorum_dispatch")
        q = self._queue
        raw: list[bytes] = []
        rc = lib.vqb_dispatch(handle, q, ffi.cast("void *", id(raw)))
        events = [parse_record(r) for r in raw]
        if q.error != CS_OK:
            error = q.error
            q.error = CS_OK
            self._pending_error = make_error(
                error, "votequorum_dispatch", "a notification could not be stored"
            )
        if rc != CS_OK and rc != lib.CS_ERR_TRY_AGAIN:
            err = (
                CpgConnectionLost("votequorum_dispatch")
                if rc == lib.CS_ERR_LIBRARY
                else make_error(rc, "votequorum_dispatch")
            )
            if not events:
                raise err
            self._pending_error = err
        return events

    def close(self) -> None:
        """Finalize the handle. Idempotent. Returns at once if corosync is gone."""
        if self._closed:
            return
        self._closed = True
        rc = lib.votequorum_finalize(self._handle)
        if rc not in (CS_OK, lib.CS_ERR_LIBRARY, lib.CS_ERR_BAD_HANDLE):
            raise make_error(rc, "votequorum_finalize")

    def abandon(self) -> None:
        """Give up the handle without talking to corosync (after a hang)."""
        self._closed = True

    def __enter__(self) -> Quorum:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(
                f"unclosed votequorum handle {self._handle:#x}", ResourceWarning, stacklevel=1
            )
            with contextlib.suppress(Exception):
                self.close()

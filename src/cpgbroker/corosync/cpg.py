"""Typed wrapper over corosync's CPG (closed process group) library.

A :class:`Cpg` is one connection to the local corosync (one ``cpg_handle_t``) that joins one
group. Messages multicast with :meth:`Cpg.mcast` are delivered to every member of the group,
including the sender, in one agreed total order. :meth:`Cpg.dispatch` returns what corosync
delivered since the last call, in order, as frozen event objects:

* :class:`Deliver` - a message (a private copy; the caller may keep it).
* :class:`ConfChg` - the group's membership changed (with who joined or left, and why).
* :class:`TotemConfChg` - the totem ring below changed (new ring id and node list).
* :class:`PartitionMerge` and :class:`RingChangeSameMembers` - hazards found by
  :class:`MembershipTracker`, placed right after the event that revealed them.

The event types are pure (:mod:`cpgbroker.corosync.events`). The CPG callbacks are C functions (see
``cffi_build/cpg_binding.c``) that copy each event into a per-handle buffer; Python parses that
buffer after ``cpg_dispatch`` returns. So no callback can raise into libcpg or lose an event, and
no Python runs while libcpg holds the dispatch.

Every ``cs_error_t`` maps to its own exception class (see :func:`error_class`). They all derive
from :class:`cpgbroker.errors.CpgError` (:mod:`cpgbroker.corosync.errors`); :class:`CpgTryAgain`
(retry) is distinct from :class:`CpgFatalError` (everything else).

This module does no I/O waiting of its own: see :mod:`cpgbroker.runtime.ring.cpg_trio` for the
trio adapter, which also guards the calls that block forever when corosync hangs.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

from cpgbroker.corosync._cpg import ffi, lib
from cpgbroker.corosync.errors import (
    CS_OK,
    TRY_AGAIN,
    CpgBadHandle,
    CpgConnectionLost,
    CpgExist,
    CpgInvalidParam,
    CpgNameTooLong,
    CpgNetnsError,
    CpgNoMemory,
    CpgNotExist,
    CpgTooBig,
    CsError,
    make_error,
)
from cpgbroker.corosync.events import (
    ConfChg,
    CpgEvent,
    Deliver,
    Member,
    MemberChange,
    MembershipTracker,
    RingId,
    TotemConfChg,
    _reason,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer


CPG_MAX_NAME_LENGTH: Final[int] = lib.CPG_MAX_NAME_LENGTH
CPG_MEMBERS_MAX: Final[int] = lib.CPG_MEMBERS_MAX
# libcpg copies the caller's iovec into a fixed 64-entry array behind its own header.
MAX_IOVEC: Final[int] = lib.CPGB_MAX_IOV
# Our own cap on one message. libcpg fragments anything above max_atomic_msgsize() (about 1 MiB)
# and sends the fragments with one synchronous round trip each; very large messages also stall
# every other sender's traffic on the ring, so the cluster layer should stay far below this.
DEFAULT_MAX_MESSAGE_SIZE: Final = 16 * 1024 * 1024


def tune_malloc(trim_threshold: int = 256 << 20, mmap_threshold: int = 32 << 20) -> bool:
    """Make glibc keep freed memory instead of returning it to the kernel at once.

    Every delivered message is a new bytes object. With glibc's defaults, freeing a batch of
    large ones shrinks the heap and the next batch page-faults its way back (and any block of
    128 KiB or more is a fresh mmap), which costs more than the copy itself. This is a
    process-wide setting, so the binding never applies it by itself: a broker process (or a
    benchmark) calls it once at startup. Returns False if glibc refused.
    """
    return bool(lib.cpgb_tune_malloc(trim_threshold, mmap_threshold))


# ---------------------------------------------------------------------------- netns


@contextlib.contextmanager
def enter_netns(name: str | None) -> Iterator[None]:
    """Run the body with this thread in network namespace ``name`` (``/run/netns/<name>``).

    A CPG connection binds to the namespace of the thread that opens it (corosync's IPC socket
    is an abstract unix socket, which is per network namespace), so one process can hold a
    handle on each node of a dev cluster. Needs CAP_SYS_ADMIN. ``None`` does nothing.
    """
    if name is None:
        yield
        return
    path = name if name.startswith("/") else f"/run/netns/{name}"
    try:
        target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise CpgNetnsError(f"network namespace {name!r} cannot be opened: {e}") from e
    try:
        original = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if lib.cpgb_setns_net(target) != 0:
                err = ffi.errno
                raise CpgNetnsError(
                    f"cannot enter network namespace {name!r}: {os.strerror(err)} "
                    "(needs root with CAP_SYS_ADMIN)"
                )
            try:
                yield
            finally:
                if lib.cpgb_setns_net(original) != 0:  # pragma: no cover - kernel refused
                    raise CpgNetnsError("cannot return to the original network namespace")
        finally:
            os.close(original)
    finally:
        os.close(target)


# ---------------------------------------------------------------------------- the handle

_CONFCHG: Final[int] = lib.CPGB_EV_CONFCHG
_DISPATCH_ALL: Final[int] = lib.CS_DISPATCH_ALL
_DISPATCH_ONE_NONBLOCKING: Final[int] = lib.CS_DISPATCH_ONE_NONBLOCKING
_CONF_HEADER = struct.Struct("=IIIII4x")  # type, name length, n_members, n_left, n_joined
_TOTEM_HEADER = struct.Struct("=IIQI4x")  # type, ring nodeid, ring seq, n_members
_ADDRESS = struct.Struct("=III")


def _parse_confchg(rec: bytes) -> ConfChg:
    _, name_len, n_members, n_left, n_joined = _CONF_HEADER.unpack_from(rec)
    group = rec[24 : 24 + name_len]
    pos = 24 + ((name_len + 3) & ~3)
    entries = [
        _ADDRESS.unpack_from(rec, pos + 12 * i) for i in range(n_members + n_left + n_joined)
    ]
    members = tuple(Member(nodeid, pid) for nodeid, pid, _ in entries[:n_members])
    left = tuple(
        MemberChange(nodeid, pid, _reason(reason))
        for nodeid, pid, reason in entries[n_members : n_members + n_left]
    )
    joined = tuple(
        MemberChange(nodeid, pid, _reason(reason))
        for nodeid, pid, reason in entries[n_members + n_left :]
    )
    return ConfChg(group, members, left, joined)


def _parse_totem(rec: bytes) -> TotemConfChg:
    _, ring_node, ring_seq, n = _TOTEM_HEADER.unpack_from(rec)
    nodes = struct.unpack_from(f"={n}I", rec, 24)
    return TotemConfChg(RingId(ring_node, ring_seq), tuple(nodes))


def group_name(group: bytes | str) -> bytes:
    """A group name as CPG takes it; raises :class:`CpgNameTooLong` above 128 bytes."""
    name = group.encode() if isinstance(group, str) else bytes(group)
    if len(name) > CPG_MAX_NAME_LENGTH:
        raise CpgNameTooLong(
            "cpg_join",
            f"group name is {len(name)} bytes, CPG allows at most {CPG_MAX_NAME_LENGTH}",
            code=lib.CS_ERR_NAME_TOO_LONG,
        )
    if not name:
        raise CpgInvalidParam("cpg_join", "group name is empty", code=lib.CS_ERR_INVALID_PARAM)
    return name


class Cpg:
    """One connection to the local corosync's CPG service, joined to at most one group.

    Not thread-safe: use a handle from one thread at a time (the trio adapter offloads only
    calls that can block, one at a time). ``netns`` opens the connection inside a named network
    namespace (see :func:`enter_netns`). Close it with :meth:`close` or a ``with`` block.
    """

    def __init__(
        self, *, netns: str | None = None, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    ) -> None:
        self._handle = 0
        self._closed = True
        self.netns = netns
        self.max_message_size = max_message_size
        self.pid = os.getpid()
        self.group: bytes | None = None
        self.tracker = MembershipTracker()
        self._queue = ffi.new("cpgb_queue *")
        if lib.cpgb_queue_init(self._queue, ffi.cast("void *", id(Deliver))) != 0:
            raise CpgNoMemory("cpg_model_initialize", code=lib.CS_ERR_NO_MEMORY)
        self._iov = ffi.new("struct iovec[]", MAX_IOVEC)
        self._sent_out = ffi.new("unsigned int *")
        self._pending_error: CsError | None = None
        self._nodeid: int | None = None
        handle = ffi.new("cpg_handle_t *")
        with enter_netns(netns):
            rc = lib.cpgb_initialize(handle, self._queue)
        if rc != CS_OK:
            lib.cpgb_queue_free(self._queue)
            detail = None
            if rc == lib.CS_ERR_LIBRARY:
                where = f" in network namespace {netns}" if netns else ""
                detail = f"corosync is not running{where} (or refuses this connection)"
            raise make_error(rc, "cpg_model_initialize", detail)
        self._handle = int(handle[0])
        self._closed = False
        try:
            fd = ffi.new("int *")
            self._check(lib.cpg_fd_get(self._handle, fd), "cpg_fd_get")
            self._fd = int(fd[0])
            size = ffi.new("uint32_t *")
            self._check(
                lib.cpg_max_atomic_msgsize_get(self._handle, size), "cpg_max_atomic_msgsize_get"
            )
            self._max_atomic = int(size[0])
        except BaseException:
            self.close()
            raise

    # -- plumbing

    def _check(self, rc: int, operation: str, detail: str | None = None) -> None:
        if rc != CS_OK:
            raise make_error(rc, operation, detail)

    def _live(self, operation: str) -> int:
        if self._closed:
            raise CpgBadHandle(operation, "the handle is closed")
        return self._handle

    @property
    def handle(self) -> int:
        """The raw ``cpg_handle_t``."""
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        """The fd that becomes readable when events are ready for :meth:`dispatch`."""
        self._live("cpg_fd_get")
        return self._fd

    def max_atomic_msgsize(self) -> int:
        """Largest message corosync sends unfragmented (larger ones are split by libcpg)."""
        self._live("cpg_max_atomic_msgsize_get")
        return self._max_atomic

    # -- requests (each is a synchronous round trip to corosync)

    def local_nodeid(self) -> int:
        """This node's corosync node id (cached after the first call)."""
        if self._nodeid is None:
            value = ffi.new("unsigned int *")
            self._check(lib.cpg_local_get(self._live("cpg_local_get"), value), "cpg_local_get")
            self._nodeid = int(value[0])
        return self._nodeid

    def join(self, group: bytes | str, *, try_again_for: float = 5.0) -> None:
        """Join ``group``; its first :class:`ConfChg` then arrives through :meth:`dispatch`.

        Corosync answers TRY_AGAIN while a previous membership of this pid in the group is
        still being torn down (a quick leave and rejoin); that is retried for
        ``try_again_for`` seconds before :class:`CpgTryAgain` is raised.
        """
        name = group_name(group)
        handle = self._live("cpg_join")
        if self.group is not None:
            raise CpgExist(
                "cpg_join",
                f"this handle already joined {self.group!r}; corosync allows one group per handle",
                code=lib.CS_ERR_EXIST,
            )
        cname = self._cpg_name(name)
        deadline = time.monotonic() + try_again_for
        while True:
            rc = lib.cpg_join(handle, cname)
            if rc != TRY_AGAIN or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        self._check(rc, "cpg_join")
        self.group = name

    def leave(self) -> None:
        """Leave the joined group; the confirming :class:`ConfChg` arrives via dispatch."""
        handle = self._live("cpg_leave")
        if self.group is None:
            raise CpgNotExist("cpg_leave", "not joined to a group", code=lib.CS_ERR_NOT_EXIST)
        self._check(lib.cpg_leave(handle, self._cpg_name(self.group)), "cpg_leave")
        self.group = None

    def membership(self, group: bytes | str | None = None) -> tuple[Member, ...]:
        """Current members of ``group`` (default: the joined one), as corosync sees them now."""
        handle = self._live("cpg_membership_get")
        if group is None:
            if self.group is None:
                raise CpgNotExist(
                    "cpg_membership_get", "not joined and no group given", code=lib.CS_ERR_NOT_EXIST
                )
            name = self.group
        else:
            name = group_name(group)
        members = ffi.new("struct cpg_address[]", CPG_MEMBERS_MAX)
        count = ffi.new("int *", CPG_MEMBERS_MAX)
        self._check(
            lib.cpg_membership_get(handle, self._cpg_name(name), members, count),
            "cpg_membership_get",
        )
        return tuple(Member(int(m.nodeid), int(m.pid)) for m in members[0 : count[0]])

    def flow_control_enabled(self) -> bool:
        """Corosync's own flow-control flag (in practice it stays off; see the docs)."""
        state = ffi.new("cpg_flow_control_state_t *")
        self._check(
            lib.cpg_flow_control_state_get(self._live("cpg_flow_control_state_get"), state),
            "cpg_flow_control_state_get",
        )
        return bool(state[0] == lib.CPG_FLOW_CONTROL_ENABLED)

    @staticmethod
    def _cpg_name(name: bytes) -> Any:
        cname = ffi.new("struct cpg_name *")
        cname.length = len(name)
        ffi.memmove(cname.value, name, len(name))
        return cname

    # -- sending

    def mcast(self, *buffers: Buffer) -> None:
        """Multicast one message (the concatenation of ``buffers``) to the joined group.

        Agreed order: every member delivers it at the same place in the stream, the sender
        included. Buffers are passed to corosync without copying. Raises :class:`CpgTryAgain`
        when corosync's queues are full (retry the same call later) and :class:`CpgTooBig`
        above ``max_message_size``.
        """
        if self.group is None:
            self._live("cpg_mcast_joined")
            raise CpgNotExist(
                "cpg_mcast_joined",
                "not joined to a group (corosync would drop the message silently)",
                code=lib.CS_ERR_NOT_EXIST,
            )
        if len(buffers) == 1:
            data = buffers[0]
            # cffi hands a bytes object's own storage to a char* argument: no copy.
            ptr: Any = data if type(data) is bytes else ffi.from_buffer(data)
            size = len(ptr)
            if size > self.max_message_size:
                self.check_size(size)
            rc = lib.cpgb_mcast1(self._handle, ptr, size)
        else:
            rc = self._mcast_iov(buffers)
        if rc != CS_OK:
            raise make_error(rc, "cpg_mcast_joined")

    def mcast_many(self, messages: Sequence[Buffer]) -> int:
        """Multicast several messages, each one buffer, in one call; return how many went out.

        Cheaper than one :meth:`mcast` per message: one Python call for the lot, and corosync
        is woken once for the burst. Fewer than ``len(messages)`` sent means corosync answered
        TRY_AGAIN for the next one: retry from there later. Other errors raise, with the count
        already sent in the exception's ``sent`` attribute.
        """
        if self.group is None:
            self._live("cpg_mcast_joined")
            raise CpgNotExist(
                "cpg_mcast_joined",
                "not joined to a group (corosync would drop the message silently)",
                code=lib.CS_ERR_NOT_EXIST,
            )
        if not messages:
            return 0
        views = [ffi.from_buffer(m) for m in messages]
        lens = [len(v) for v in views]
        if max(lens) > self.max_message_size:
            self.check_size(max(lens))
        # The char* array points into each buffer itself (no copy); views keeps them alive.
        rc = lib.cpgb_mcast_many(
            self._handle,
            ffi.new("char *[]", views),
            ffi.new("size_t[]", lens),
            len(views),
            self._sent_out,
        )
        sent = int(self._sent_out[0])
        if rc != CS_OK and rc != TRY_AGAIN:
            err = make_error(rc, "cpg_mcast_joined")
            err.sent = sent
            raise err
        return sent

    def _mcast_iov(self, buffers: tuple[Buffer, ...]) -> int:
        if not 0 < len(buffers) <= MAX_IOVEC:
            raise CpgInvalidParam(
                "cpg_mcast_joined",
                f"{len(buffers)} buffers; one message takes 1 to {MAX_IOVEC}",
                code=lib.CS_ERR_INVALID_PARAM,
            )
        iov = self._iov
        keep = []  # the cdata views must outlive the call
        total = 0
        for i, data in enumerate(buffers):
            view = ffi.from_buffer(data)
            keep.append(view)
            iov[i].iov_base = view
            iov[i].iov_len = len(view)
            total += len(view)
        self.check_size(total)
        rc: int = lib.cpg_mcast_joined(self._handle, lib.CPG_TYPE_AGREED, iov, len(buffers))
        del keep
        return rc

    def check_size(self, size: int) -> None:
        """Raise :class:`CpgTooBig` if a message of ``size`` bytes is over this handle's limit."""
        if size > self.max_message_size:
            raise CpgTooBig(
                "cpg_mcast_joined",
                f"message is {size} bytes, the limit of this handle is {self.max_message_size} "
                "(max_message_size)",
                code=lib.CS_ERR_TOO_BIG,
            )

    # -- receiving

    def dispatch(self) -> list[CpgEvent]:
        """Everything corosync has ready now (CS_DISPATCH_ALL), in delivery order; never blocks.

        An error after some events were received is raised on the next call, after those
        events were returned, so nothing delivered before a failure is lost.
        """
        return self._dispatch(_DISPATCH_ALL, "cpg_dispatch")

    def dispatch_one(self) -> list[CpgEvent]:
        """At most one corosync event (CS_DISPATCH_ONE_NONBLOCKING); ``[]`` if none is ready.

        One event can still yield two items: a configuration change and the hazard it reveals.
        """
        return self._dispatch(_DISPATCH_ONE_NONBLOCKING, "cpg_dispatch")

    def _dispatch(self, flags: int, operation: str) -> list[CpgEvent]:
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise err
        handle = self._live(operation)
        q = self._queue
        events: list[Any] = []
        # The C side appends the events to this list (passed by address, see cpg_binding.c).
        rc = lib.cpgb_dispatch(handle, flags, q, ffi.cast("void *", id(events)))
        if q.specials:
            events = self._expand(events)
        if q.error != CS_OK:
            # A callback could not store an event (out of memory). What it did store is
            # returned now; the stream cannot continue without a gap, so the next call fails.
            error = q.error
            q.error = CS_OK
            self._pending_error = make_error(
                error, operation, "an event could not be stored; events after it were lost"
            )
        if rc != CS_OK and not (rc == TRY_AGAIN and flags == _DISPATCH_ONE_NONBLOCKING):
            err = (
                CpgConnectionLost(operation)
                if rc == lib.CS_ERR_LIBRARY
                else make_error(rc, operation)
            )
            if not events:
                raise err
            self._pending_error = err
        return events

    def _expand(self, raw: list[Any]) -> list[CpgEvent]:
        """Replace the raw configuration records in a dispatch's list by parsed events."""
        events: list[CpgEvent] = []
        for item in raw:
            if type(item) is not bytes:
                events.append(item)
                continue
            event: ConfChg | TotemConfChg
            if _CONF_HEADER.unpack_from(item)[0] == _CONFCHG:
                event = _parse_confchg(item)
            else:
                event = _parse_totem(item)
            events.append(event)
            events.extend(self.tracker.feed(event))
        return events

    def is_own(self, event: Deliver) -> bool:
        """Whether this handle sent ``event`` (needs :meth:`local_nodeid` answered once)."""
        return event.pid == self.pid and event.nodeid == self.local_nodeid()

    # -- closing

    def close(self) -> None:
        """Finalize the handle (this also leaves the group). Idempotent.

        Blocks until corosync answers; if corosync is stopped that is forever, which is why
        the trio adapter runs it in a thread with a timeout. If corosync is gone it returns
        at once.
        """
        if self._closed:
            return
        self._closed = True
        self.group = None
        rc = lib.cpg_finalize(self._handle)
        lib.cpgb_queue_free(self._queue)
        # After a lost connection libcpg still frees the handle but reports the broken IPC.
        if rc not in (CS_OK, lib.CS_ERR_LIBRARY, lib.CS_ERR_BAD_HANDLE):
            raise make_error(rc, "cpg_finalize")

    def abandon(self) -> None:
        """Give up the handle without talking to corosync (after a hang).

        The C event buffer is deliberately not freed: a call still blocked in another thread
        may yet dispatch into it.
        """
        self._closed = True
        self.group = None

    def __enter__(self) -> Cpg:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed CPG handle {self._handle:#x}", ResourceWarning, stacklevel=1)
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"group={self.group!r}"
        return f"<Cpg handle={self._handle:#x} {state}>"

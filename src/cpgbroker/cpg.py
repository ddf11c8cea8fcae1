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

The CPG callbacks are C functions (see ``cffi_build/cpg_binding.c``) that copy each event into a
per-handle buffer; Python parses that buffer after ``cpg_dispatch`` returns. So no callback can
raise into libcpg or lose an event, and no Python runs while libcpg holds the dispatch.

Every ``cs_error_t`` maps to its own exception class (see :func:`error_class`). They all derive
from :class:`cpgbroker.errors.CpgError`; :class:`CpgTryAgain` (retry) is distinct from
:class:`CpgFatalError` (everything else).

This module does no I/O waiting of its own: see :mod:`cpgbroker.runtime.cpg_trio` for the trio
adapter, which also guards the calls that block forever when corosync hangs.
"""

from __future__ import annotations

import contextlib
import enum
import os
import struct
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeAlias

import attrs

from cpgbroker import errors

if TYPE_CHECKING:
    from typing_extensions import Buffer


class CpgBindingError(errors.CpgError, ImportError):
    """The compiled module ``cpgbroker._cpg`` is missing or was built from other sources."""


try:
    from cpgbroker._cpg import ffi, lib
except ImportError as _e:  # pragma: no cover - depends on how the package was installed
    raise CpgBindingError(
        f"cpgbroker's compiled libcpg binding (cpgbroker._cpg) cannot be imported ({_e}). "
        "Install the package with `pip install -e .`, which builds it; that needs gcc and the "
        "Debian packages libcpg-dev and libcorosync-common-dev."
    ) from _e

# Must match CPGB_BINDING_VERSION in cffi_build/cpg_binding.c: a module compiled from older
# sources would parse the event buffer with the wrong layout.
EXPECTED_BINDING_VERSION: Final = 2
if lib.CPGB_BINDING_VERSION != EXPECTED_BINDING_VERSION:  # pragma: no cover
    raise CpgBindingError(
        f"cpgbroker._cpg is binding version {lib.CPGB_BINDING_VERSION}, this cpg.py expects "
        f"{EXPECTED_BINDING_VERSION}: rebuild it with `pip install -e .`"
    )

CPG_MAX_NAME_LENGTH: Final[int] = lib.CPG_MAX_NAME_LENGTH
CPG_MEMBERS_MAX: Final[int] = lib.CPG_MEMBERS_MAX
# libcpg copies the caller's iovec into a fixed 64-entry array behind its own header.
MAX_IOVEC: Final[int] = lib.CPGB_MAX_IOV
# Our own cap on one message. libcpg fragments anything above max_atomic_msgsize() (about 1 MiB)
# and sends the fragments with one synchronous round trip each; very large messages also stall
# every other sender's traffic on the ring, so the cluster layer should stay far below this.
DEFAULT_MAX_MESSAGE_SIZE: Final = 16 * 1024 * 1024


# ---------------------------------------------------------------------------- errors


def strerror(code: int) -> str:
    """corosync's own name for a ``cs_error_t`` value (``cs_strerror``)."""
    return str(ffi.string(lib.cs_strerror(code)).decode("ascii", "replace"))


class CsError(errors.CpgError):
    """A CPG call failed with a ``cs_error_t``; each value has its own subclass.

    ``operation`` names the libcpg call, ``code`` is the numeric value and ``strerror`` is
    ``cs_strerror``'s text for it.
    """

    code: ClassVar[int] = -1
    # Messages of a :meth:`Cpg.mcast_many` batch that went out before the error.
    sent: int = 0
    # What the error usually means, used when the raiser has nothing more specific to say.
    hint: ClassVar[str] = ""
    # True when the handle can no longer be used (the local corosync is gone).
    handle_dead: ClassVar[bool] = False

    def __init__(self, operation: str, detail: str | None = None, *, code: int | None = None):
        self.operation = operation
        self.cs_code = type(self).code if code is None else code
        self.strerror = strerror(self.cs_code)
        self.detail = detail if detail is not None else type(self).hint
        text = f"{operation}: {self.strerror} ({self.cs_code})"
        super().__init__(f"{text}: {self.detail}" if self.detail else text)


class CpgTryAgain(CsError):
    """CS_ERR_TRY_AGAIN: a transient condition (full IPC ring, busy group); retry later."""

    hint = "corosync is busy; retry the same call"


class CpgFatalError(CsError):
    """Every ``cs_error_t`` except TRY_AGAIN: retrying the same call unchanged will not help."""


class CpgLibraryError(CpgFatalError):
    """CS_ERR_LIBRARY: corosync is not running, not reachable, or the connection to it broke."""

    hint = "corosync is not running or not reachable from this network namespace"
    handle_dead = True


class CpgConnectionLost(CpgLibraryError):
    """The local corosync died or closed our connection: this process must stop using CPG."""

    hint = "lost the connection to the local corosync (it died or was shut down)"


class CpgVersionError(CpgFatalError):
    """CS_ERR_VERSION."""


class CpgInitError(CpgFatalError):
    """CS_ERR_INIT."""


class CpgTimeout(CpgFatalError):
    """CS_ERR_TIMEOUT."""


class CpgInvalidParam(CpgFatalError):
    """CS_ERR_INVALID_PARAM."""


class CpgNoMemory(CpgFatalError):
    """CS_ERR_NO_MEMORY."""


class CpgBadHandle(CpgFatalError):
    """CS_ERR_BAD_HANDLE: the handle was finalized (or never valid)."""

    hint = "the handle is closed"
    handle_dead = True


class CpgBusy(CpgFatalError):
    """CS_ERR_BUSY."""


class CpgAccessError(CpgFatalError):
    """CS_ERR_ACCESS: this user may not use corosync's IPC."""

    hint = "this user may not connect to corosync (run as root or add a uidgid entry)"


class CpgNotExist(CpgFatalError):
    """CS_ERR_NOT_EXIST: e.g. sending or leaving without having joined a group."""


class CpgNameTooLong(CpgFatalError):
    """CS_ERR_NAME_TOO_LONG: a group name longer than CPG_MAX_NAME_LENGTH bytes."""


class CpgExist(CpgFatalError):
    """CS_ERR_EXIST: e.g. joining a group this process or handle already joined."""


class CpgNoSpace(CpgFatalError):
    """CS_ERR_NO_SPACE."""


class CpgInterrupt(CpgFatalError):
    """CS_ERR_INTERRUPT."""


class CpgNameNotFound(CpgFatalError):
    """CS_ERR_NAME_NOT_FOUND."""


class CpgNoResources(CpgFatalError):
    """CS_ERR_NO_RESOURCES."""


class CpgNotSupported(CpgFatalError):
    """CS_ERR_NOT_SUPPORTED."""


class CpgBadOperation(CpgFatalError):
    """CS_ERR_BAD_OPERATION."""


class CpgFailedOperation(CpgFatalError):
    """CS_ERR_FAILED_OPERATION."""


class CpgMessageError(CpgFatalError):
    """CS_ERR_MESSAGE_ERROR."""


class CpgQueueFull(CpgFatalError):
    """CS_ERR_QUEUE_FULL."""


class CpgQueueNotAvailable(CpgFatalError):
    """CS_ERR_QUEUE_NOT_AVAILABLE."""


class CpgBadFlags(CpgFatalError):
    """CS_ERR_BAD_FLAGS."""


class CpgTooBig(CpgFatalError):
    """CS_ERR_TOO_BIG: a message larger than the handle's limit."""


class CpgNoSections(CpgFatalError):
    """CS_ERR_NO_SECTIONS."""


class CpgContextNotFound(CpgFatalError):
    """CS_ERR_CONTEXT_NOT_FOUND."""


class CpgTooManyGroups(CpgFatalError):
    """CS_ERR_TOO_MANY_GROUPS."""


class CpgSecurity(CpgFatalError):
    """CS_ERR_SECURITY."""


class CpgUnknownError(CpgFatalError):
    """A ``cs_error_t`` value this binding does not know (a newer corosync)."""


_ERROR_CLASSES: Final[dict[int, type[CsError]]] = {
    lib.CS_ERR_LIBRARY: CpgLibraryError,
    lib.CS_ERR_VERSION: CpgVersionError,
    lib.CS_ERR_INIT: CpgInitError,
    lib.CS_ERR_TIMEOUT: CpgTimeout,
    lib.CS_ERR_TRY_AGAIN: CpgTryAgain,
    lib.CS_ERR_INVALID_PARAM: CpgInvalidParam,
    lib.CS_ERR_NO_MEMORY: CpgNoMemory,
    lib.CS_ERR_BAD_HANDLE: CpgBadHandle,
    lib.CS_ERR_BUSY: CpgBusy,
    lib.CS_ERR_ACCESS: CpgAccessError,
    lib.CS_ERR_NOT_EXIST: CpgNotExist,
    lib.CS_ERR_NAME_TOO_LONG: CpgNameTooLong,
    lib.CS_ERR_EXIST: CpgExist,
    lib.CS_ERR_NO_SPACE: CpgNoSpace,
    lib.CS_ERR_INTERRUPT: CpgInterrupt,
    lib.CS_ERR_NAME_NOT_FOUND: CpgNameNotFound,
    lib.CS_ERR_NO_RESOURCES: CpgNoResources,
    lib.CS_ERR_NOT_SUPPORTED: CpgNotSupported,
    lib.CS_ERR_BAD_OPERATION: CpgBadOperation,
    lib.CS_ERR_FAILED_OPERATION: CpgFailedOperation,
    lib.CS_ERR_MESSAGE_ERROR: CpgMessageError,
    lib.CS_ERR_QUEUE_FULL: CpgQueueFull,
    lib.CS_ERR_QUEUE_NOT_AVAILABLE: CpgQueueNotAvailable,
    lib.CS_ERR_BAD_FLAGS: CpgBadFlags,
    lib.CS_ERR_TOO_BIG: CpgTooBig,
    lib.CS_ERR_NO_SECTIONS: CpgNoSections,
    lib.CS_ERR_CONTEXT_NOT_FOUND: CpgContextNotFound,
    lib.CS_ERR_TOO_MANY_GROUPS: CpgTooManyGroups,
    lib.CS_ERR_SECURITY: CpgSecurity,
}
for _code, _cls in _ERROR_CLASSES.items():
    _cls.code = _code
CpgConnectionLost.code = lib.CS_ERR_LIBRARY
CS_OK: Final[int] = lib.CS_OK
_TRY_AGAIN: Final[int] = lib.CS_ERR_TRY_AGAIN


def error_class(code: int) -> type[CsError]:
    """The exception class for a ``cs_error_t`` value."""
    return _ERROR_CLASSES.get(code, CpgUnknownError)


def make_error(code: int, operation: str, detail: str | None = None) -> CsError:
    """The exception instance for a failed call (``code`` must not be CS_OK)."""
    cls = error_class(code)
    return cls(operation, detail, code=code)


class CpgNetnsError(errors.CpgError):
    """A network namespace given for a handle does not exist or cannot be entered."""


class CpgHungError(CpgFatalError):
    """A call that needs an answer from corosync got none in time: corosync hangs.

    Raised by the trio adapter's guarded calls. The handle must be abandoned: the blocked call
    may still return at any time, and finalizing would block the same way.
    """

    code = lib.CS_ERR_TIMEOUT
    hint = "corosync did not answer in time (stopped or hung)"
    handle_dead = True


# ---------------------------------------------------------------------------- events


class Reason(enum.IntEnum):
    """Why a member joined or left a group (``cpg_reason_t``)."""

    UNDEFINED = 0
    JOIN = 1
    LEAVE = 2
    NODEDOWN = 3
    NODEUP = 4
    PROCDOWN = 5


def _reason(value: int) -> Reason:
    try:
        return Reason(value)
    except ValueError:
        return Reason.UNDEFINED


@attrs.frozen
class Member:
    """A group member: a process on a node. Corosync identifies members by this pair."""

    nodeid: int
    pid: int


@attrs.frozen
class MemberChange:
    """A member that joined or left, with corosync's reason."""

    nodeid: int
    pid: int
    reason: Reason

    @property
    def member(self) -> Member:
        return Member(self.nodeid, self.pid)


@attrs.frozen
class RingId:
    """A totem ring id: the representative node and a sequence number that only grows."""

    nodeid: int
    seq: int


@attrs.frozen
class Deliver:
    """A message multicast to ``group`` by member (``nodeid``, ``pid``)."""

    group: bytes
    nodeid: int
    pid: int
    data: bytes


@attrs.frozen
class ConfChg:
    """The membership of ``group`` changed; ``members`` is the full new list."""

    group: bytes
    members: tuple[Member, ...]
    left: tuple[MemberChange, ...]
    joined: tuple[MemberChange, ...]


@attrs.frozen
class TotemConfChg:
    """The totem ring changed: its id and the node ids in it (not only group members)."""

    ring_id: RingId
    members: tuple[int, ...]


@attrs.frozen
class PartitionMerge:
    """Members came back into ``group`` through a ring merge (reason NODEUP).

    ``rejoined`` were seen leaving with NODEDOWN earlier: they lived on in another partition,
    and neither side received what the other multicast meanwhile. ``merged`` were never seen
    before (for example a process that joined in a partition formed before this node merged);
    their history is just as unknown. Either way the group's state may have diverged; what to
    do about it is the cluster layer's decision.
    """

    group: bytes
    rejoined: tuple[Member, ...]
    merged: tuple[Member, ...]


@attrs.frozen
class RingChangeSameMembers:
    """The totem ring was re-formed with exactly the same nodes (for example after a token
    loss under CPU starvation): no member change is reported, but a reconfiguration happened."""

    ring_id: RingId
    previous: RingId
    members: tuple[int, ...]


HazardEvent: TypeAlias = PartitionMerge | RingChangeSameMembers
CpgEvent: TypeAlias = Deliver | ConfChg | TotemConfChg | PartitionMerge | RingChangeSameMembers


class MembershipTracker:
    """Watches one handle's configuration events and reports the hazards they reveal.

    Pure logic, no I/O: feed it every :class:`ConfChg` and :class:`TotemConfChg` in delivery
    order; it returns the hazard events each one reveals (usually none).
    """

    def __init__(self) -> None:
        # Per group: members that left with NODEDOWN, i.e. may still be alive elsewhere.
        self._departed: dict[bytes, set[Member]] = {}
        self.ring_id: RingId | None = None
        self.ring_members: tuple[int, ...] = ()

    def feed(self, event: ConfChg | TotemConfChg) -> list[HazardEvent]:
        if isinstance(event, TotemConfChg):
            return self._totem(event)
        return self._confchg(event)

    def _totem(self, event: TotemConfChg) -> list[HazardEvent]:
        previous, previous_members = self.ring_id, self.ring_members
        self.ring_id, self.ring_members = event.ring_id, event.members
        if (
            previous is not None
            and event.ring_id != previous
            and sorted(event.members) == sorted(previous_members)
        ):
            return [RingChangeSameMembers(event.ring_id, previous, event.members)]
        return []

    def _confchg(self, event: ConfChg) -> list[HazardEvent]:
        departed = self._departed.setdefault(event.group, set())
        for change in event.left:
            if change.reason == Reason.NODEDOWN:
                departed.add(change.member)
            else:
                # LEAVE and PROCDOWN: the process itself is gone from the group for good.
                departed.discard(change.member)
        rejoined: list[Member] = []
        merged: list[Member] = []
        for change in event.joined:
            member = change.member
            if change.reason == Reason.NODEUP:
                (rejoined if member in departed else merged).append(member)
            # A fresh cpg_join (reason JOIN) starts a new history even for a pid seen before.
            departed.discard(member)
        if rejoined or merged:
            return [PartitionMerge(event.group, tuple(rejoined), tuple(merged))]
        return []


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
            if rc != _TRY_AGAIN or time.monotonic() >= deadline:
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
        if rc != CS_OK and rc != _TRY_AGAIN:
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
        if rc != CS_OK and not (rc == _TRY_AGAIN and flags == _DISPATCH_ONE_NONBLOCKING):
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

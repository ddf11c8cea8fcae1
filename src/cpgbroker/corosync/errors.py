"""Errors of our corosync wrappers (CPG and votequorum), shared by both.

Every ``cs_error_t`` maps to its own exception class (see :func:`error_class`). They all derive
from :class:`cpgbroker.errors.CpgError`; :class:`CpgTryAgain` (retry) is distinct from
:class:`CpgFatalError` (everything else). This module also loads the compiled libcpg binding
and checks its version, since the error texts come from ``cs_strerror``.
"""

from __future__ import annotations

from typing import ClassVar, Final

from cpgbroker import errors


class CpgBindingError(errors.CpgError, ImportError):
    """The compiled module ``cpgbroker._cpg`` is missing or was built from other sources."""


try:
    from cpgbroker.corosync._cpg import ffi, lib
except ImportError as _e:  # pragma: no cover - depends on how the package was installed
    raise CpgBindingError(
        f"cpgbroker's compiled libcpg binding (cpgbroker.corosync._cpg) cannot be imported ({_e}). "
        "Install the package with `pip install -e .`, which builds it; that needs gcc and the "
        "Debian packages libcpg-dev and libcorosync-common-dev."
    ) from _e

# Must match CPGB_BINDING_VERSION in cffi_build/cpg_binding.c: a module compiled from older
# sources would parse the event buffer with the wrong layout.
EXPECTED_BINDING_VERSION: Final = 2
if lib.CPGB_BINDING_VERSION != EXPECTED_BINDING_VERSION:  # pragma: no cover
    raise CpgBindingError(
        f"cpgbroker.corosync._cpg is binding version {lib.CPGB_BINDING_VERSION}, this package "
        f"expects {EXPECTED_BINDING_VERSION}: rebuild it with `pip install -e .`"
    )

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
# The retry code, for callers that compare raw return codes.
TRY_AGAIN: Final[int] = lib.CS_ERR_TRY_AGAIN


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

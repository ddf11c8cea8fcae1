"""Telling systemd how the broker is doing: the ``sd_notify`` protocol, by hand.

The protocol is documented and stable (sd_notify(3)): one datagram of newline-separated
``KEY=VALUE`` lines sent to the ``AF_UNIX`` socket named in ``$NOTIFY_SOCKET``; a name
starting with ``@`` is in the abstract namespace (the ``@`` stands for a NUL byte). systemd
learns the sender from the kernel (``SO_PASSCRED``), so nothing else goes with the datagram.
python-systemd implements it too, but it builds against libsystemd's headers: a build
dependency for a dozen lines.

What the broker says (``configs/systemd/cpgbroker.service``, ``Type=notify``):

* ``STATUS=...`` along the way (waiting for quorum, recovering the store, waiting for the
  other members, serving): ``systemctl status`` shows the last one;
* ``READY=1`` once, when it first serves clients: the unit counts as started only then, so
  units ordered after it start when clients can connect;
* ``WATCHDOG=1`` every half of ``$WATCHDOG_USEC`` while the member is healthy, from the same
  places that feed its own watchdog process (``runtime/member/watchdog.py``): a hung member is then
  also restarted by systemd;
* ``STOPPING=1`` when a graceful shutdown starts.

Outside systemd (no ``$NOTIFY_SOCKET``) every call does nothing. A notification that fails
never stops the broker: the first failure is logged and the broker goes on (systemd then acts
as if it had not been told: no readiness, or a watchdog restart, which is what should happen to
a broker that cannot reach it).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, MutableMapping

import trio

log = logging.getLogger("cpgbroker.systemd")

# A datagram to systemd's socket waits only while its queue is full (systemd busy). Waiting a
# little is better than dropping READY=1 (systemd would then never consider the broker
# started), and short enough not to starve the event loop the call is made from.
SEND_TIMEOUT = 0.5

# How often the progress shown in ``systemctl status`` is refreshed (a cheap look at the
# member, no model work).
STATUS_PERIOD = 1.0

# The variables systemd passes; removed from the environment once read, so that child
# processes (the watchdog process, forked updaters and snapshot writers) cannot speak for the
# broker: under ``NotifyAccess=main`` systemd would ignore them and log a warning.
_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Sends notifications to systemd's socket.

    Owns: the socket's address, what it already said (ready, stopping, the last status) and
    whether it logged a failure. Safe to call from the event loop and the watchdog feeder
    thread at once (each notification is one ``sendto``)."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self._address: str | None = None
        self._failed = False
        self._ready = False
        self._stopping = False
        self._status: str | None = None
        self.watchdog_period: float | None = (
            None if watchdog_usec is None else watchdog_usec / 2 / 1_000_000
        )
        """Seconds between two ``WATCHDOG=1`` (half systemd's ``WatchdogSec``, as
        sd_watchdog_enabled(3) advises); None: systemd does not watch this process."""
        if not address:
            self.watchdog_period = None
            return
        self._address = "\0" + address[1:] if address.startswith("@") else address

    @classmethod
    def from_env(
        cls, environ: MutableMapping[str, str] | None = None, pid: int | None = None
    ) -> Notifier:
        """The notifier systemd asked for in ``environ`` (default: this process's
        environment, from which its variables are then removed). The watchdog applies only
        if ``$WATCHDOG_PID`` is unset or names this process (``pid``, default ours)."""
        env = os.environ if environ is None else environ
        values = {k: env.pop(k, None) for k in _VARIABLES}
        usec = _positive_int(values["WATCHDOG_USEC"])
        watchdog_pid = values["WATCHDOG_PID"]
        if watchdog_pid and _positive_int(watchdog_pid) != (os.getpid() if pid is None else pid):
            usec = None  # systemd watches another process (we were started by it, say)
        return cls(values["NOTIFY_SOCKET"], usec)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def ready(self, status: str) -> None:
        """``READY=1`` the first time (with the status line), a status update afterwards."""
        if self._ready:
            self.status(status)
            return
        self._ready = True
        self._status = status
        self._send(f"READY=1\nSTATUS={status}")

    def status(self, text: str) -> None:
        """A status line for ``systemctl status``; a repeat of the last one is not sent."""
        if text != self._status:
            self._status = text
            self._send(f"STATUS={text}")

    def watchdog(self) -> None:
        """A sign of life for systemd's watchdog (nothing if systemd does not watch us)."""
        if self.watchdog_period is not None:
            self._send("WATCHDOG=1")

    def stopping(self, status: str = "stopping: closing client connections") -> None:
        """``STOPPING=1``, once: a graceful shutdown has started."""
        if not self._stopping:
            self._stopping = True
            self._status = status
            self._send(f"STOPPING=1\nSTATUS={status}")

    def _send(self, message: str) -> None:
        if self._address is None:
            return
        # A socket per notification, as libsystemd's sd_notify does: a few a minute cost
        # nothing, and no descriptor is held open for forked children to inherit.
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(SEND_TIMEOUT)
                sock.sendto(message.encode("utf-8", "replace"), self._address)
        except OSError as e:  # includes the timeout
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        if not self._failed:
            self._failed = True
            log.warning("cannot notify systemd at %r: %s", self._address, e)


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(text or "")
    except ValueError:
        return None
    return value if value > 0 else None


async def keep_alive(notifier: Notifier) -> None:
    """Feed systemd's watchdog from the event loop (a broker with no other feeder: the
    standalone one). Never returns; returns at once if systemd does not watch us."""
    period = notifier.watchdog_period
    if period is None:
        return
    while True:
        notifier.watchdog()
        await trio.sleep(period)


async def report_status(notifier: Notifier, line: Callable[[], str]) -> None:
    """Keep ``STATUS=`` up to date with ``line()`` (only changes are sent). Never returns."""
    if not notifier.enabled:
        return
    while True:
        notifier.status(line())
        await trio.sleep(STATUS_PERIOD)


def member_line(
    phase: str, state: str | None, members: list[int], size: int, me: int | None
) -> str:
    """What ``systemctl status`` shows of a cluster member: its process ``phase``
    (``MemberProcess.phase``), its incarnation's ``state`` (None: no incarnation), the
    members it sees and the configured ``size``."""
    if phase == "ready" and state == "ready" and me is not None and me in members:
        ordered = sorted(members)
        return f"serving, member {ordered.index(me) + 1} of {len(ordered)} (id {me})"
    if phase == "waiting-for-quorum":
        return "waiting for quorum"
    if phase == "recovering":
        return "recovering the store"
    if phase in ("suspended", "stopped"):
        return f"{phase}, not serving"
    if state in ("needs-update", "updating"):
        return "receiving the state from a serving member"
    if state == "catching-up":
        return "catching up with the other members"
    if state == "joining" and len(members) < size:
        return f"waiting for {size} members (have {len(members)})"
    return f"{state or phase}, not serving yet"

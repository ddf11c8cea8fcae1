"""The updater side of a state update: a member that delivers an update request naming it forks
a child that streams the model as it is at the request's point (``runtime/update/transfer.py``) and
goes on serving. docs/architecture.md, "State update".

Owns: the transfers in progress (pid -> info), shared across incarnations with the member
process, which reaps them (a child can outlive the incarnation that forked it). Never decides
whether to serve a request: the member does, from the stream.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import time
from typing import Any

import attrs

from cpgbroker.cluster.codec import STATUS_READY, UpdateRequest
from cpgbroker.cluster.membership import READY, Membership
from cpgbroker.model import Broker
from cpgbroker.runtime.update import transfer as update

log = logging.getLogger("cpgbroker.member")

# The pipe that tells a child sending from the back what was consumed (Linux's
# F_SETPIPE_SZ; the default is 64 KiB): room for the releases of a busy second.
F_SETPIPE_SZ = 1031
RELEASED_PIPE_BYTES = 2**20


def close_released(info: dict[str, Any]) -> None:
    """Close the write end of a transfer's released pipe, if it has one."""
    w = info.pop("released", None)
    if w is not None:
        with contextlib.suppress(OSError):
            os.close(w)


@attrs.frozen
class DeferredUpdate:
    """An update request a stalled member serves when its replay reaches the request's point,
    with the membership as it was at that point."""

    request: UpdateRequest
    members: list[list[Any]]


class Updater:
    def __init__(
        self,
        me: int,
        incarnation: int,
        rate_limit: float,
        updates: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        self.me = me
        self.incarnation = incarnation
        self.rate_limit = rate_limit
        self.updates: dict[int, dict[str, Any]] = {} if updates is None else updates

    def gives(self, e: UpdateRequest, membership: Membership, version: int, stopping: bool) -> bool:
        """Whether this member sends the update ``e`` asks of it: it is ready and named the
        updater, and the newcomer can apply the model ``version`` of our state."""
        me = membership.members.get(self.me)
        newcomer = membership.members.get(e.member)
        if (
            e.updater != self.me
            or membership.state != READY
            or me is None
            or me.status != STATUS_READY
            or newcomer is None
            # A newcomer whose hello was refused, or whose release cannot apply the model
            # version of our state (the cluster moved up after it heard a serving member's
            # older hello), never gets a state it would apply by other rules.
            or newcomer.status is None
            or not newcomer.versions[0] <= version <= newcomer.versions[1]
            # A stopping member's model ends before the request's point: the newcomer asks
            # another member once this one has left.
            or stopping
        ):
            if newcomer is not None and e.updater == self.me and newcomer.status is not None:
                log.warning(
                    "no state update for member %s (%s): this state runs model version %d",
                    e.member,
                    newcomer.software or "unknown software",
                    version,
                )
            return False
        return True

    def fork(
        self, e: UpdateRequest, members: list[list[Any]], broker: Broker, lifo: bool = False
    ) -> None:
        """Stream ``broker`` as it is now, with the membership ``members``, to the newcomer.
        ``lifo`` (a hot-standby replica): each queue from its back, leaving out what consumers
        take meanwhile, which :meth:`feed` tells the child."""
        r = w = -1
        if lifo:
            r, w = os.pipe()
            with contextlib.suppress(OSError):
                fcntl.fcntl(w, F_SETPIPE_SZ, RELEASED_PIPE_BYTES)
            os.set_blocking(w, False)
        try:
            pid = update.fork_updater(
                e.address, e.token, broker, members, self.me, e.member, self.rate_limit, r
            )
        finally:
            if r >= 0:
                os.close(r)
        self.updates[pid] = {
            "incarnation": self.incarnation,
            "newcomer": e.member,
            "pid": pid,
            "seq": broker.event_seq,
            "started": time.monotonic(),
        }
        if w >= 0:
            self.updates[pid]["released"] = w
        log.info(
            "sending a state update to member=%s seq=%s (child pid %s)",
            e.member,
            broker.event_seq,
            pid,
        )

    @property
    def feeding(self) -> bool:
        """A child sends from the back of the queues and wants to know what was consumed."""
        return any("released" in u for u in self.updates.values())

    def feed(self, released: list[tuple[str, str, int]]) -> None:
        """Tell every child sending from the back what consumers took (lossy: a frame the
        pipe has no room for is dropped; that message is then sent, and removed again by the
        newcomer's replay)."""
        frames = update.released_frames(released)
        for info in self.updates.values():
            w = info.get("released")
            if w is None:
                continue
            for frame in frames:
                try:
                    os.write(w, frame)
                except BlockingIOError:
                    break
                except OSError:
                    close_released(info)  # the child is gone
                    break

    def end(self) -> None:
        """This incarnation is over: its transfers are useless (each newcomer asks another
        member once we have left), so end them; the member process reaps them."""
        for pid in self.updates:
            if self.updates[pid].get("incarnation") == self.incarnation:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def status(self) -> list[dict[str, Any]]:
        return [
            {"newcomer": u["newcomer"], "seq": u["seq"], "pid": u["pid"]}
            for u in self.updates.values()
        ]

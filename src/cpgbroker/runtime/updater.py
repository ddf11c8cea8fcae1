"""The updater side of a state update: a member that delivers an update request naming it forks
a child that streams the model as it is at the request's point (``runtime/update.py``) and
goes on serving. docs/architecture.md, "State update".

Owns: the transfers in progress (pid -> info), shared across incarnations with the member
process, which reaps them (a child can outlive the incarnation that forked it). Never decides
whether to serve a request: the member does, from the stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

import attrs

from cpgbroker.cluster.codec import UpdateRequest
from cpgbroker.model.broker import Broker
from cpgbroker.runtime import update

log = logging.getLogger("cpgbroker.member")


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

    def fork(self, e: UpdateRequest, members: list[list[Any]], broker: Broker) -> None:
        """Stream ``broker`` as it is now, with the membership ``members``, to the newcomer."""
        pid = update.fork_updater(
            e.address, e.token, broker, members, self.me, e.member, self.rate_limit
        )
        self.updates[pid] = {
            "incarnation": self.incarnation,
            "newcomer": e.member,
            "pid": pid,
            "seq": broker.event_seq,
            "started": time.monotonic(),
        }
        log.info(
            "sending a state update to member=%s seq=%s (child pid %s)",
            e.member,
            broker.event_seq,
            pid,
        )

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

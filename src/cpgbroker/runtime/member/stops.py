"""Stop requests (``cpgbroker cluster stop``, ``cpgbroker member stop ID``): a member
multicasts ``StopRequest(member, target)`` (target 0: every member); every member it names
stops applying events where it is delivered, so a cluster stop leaves every member at the same
event with the same state (docs/architecture.md, "Stop requests and the watchdog").

A member that stops drops its clients' further input (also what was queued and not yet
multicast), records the stop point and its digest in the event log, and sends a last progress
report; the member then lets the confirms before the stop point out and tells its clients to
go (``ClusterNode.finish_stop``).

Owns: where each request took effect (for the member that asked: its operator's answer), and
whether and where this member stopped. Never applies events or touches clients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from cpgbroker.cluster import codec
from cpgbroker.cluster.codec import StopRequest
from cpgbroker.errors import ClusterError
from cpgbroker.model import Broker, snapshot
from cpgbroker.runtime.member.eventlog import EventLog
from cpgbroker.runtime.ring.multicast import Multicaster

log = logging.getLogger("cpgbroker.member")

# How long a stopping member waits for the others' last progress reports, so that confirms
# for events before the stop point still reach its clients.
STOP_SETTLE = 3.0


class Stops:
    def __init__(self, me: int, multicast: Multicaster, events: EventLog) -> None:
        self.me = me
        self._multicast = multicast
        self._events = events
        # The event seq this member stopped at, and who asked ("cluster" or "member").
        self.halted: int | None = None
        self.scope = ""
        self.requested = trio.Event()
        # (asking member, target) -> the event seq where the request took effect.
        self.points: dict[tuple[int, int], int] = {}
        self._seen = trio.Event()

    async def request(self, target: int, ready: list[int], timeout: float = 10.0) -> int:
        """Ask ``target`` (0: every member) to stop; the event seq where the request took
        effect, once it is delivered back here."""
        if target and target not in ready:
            raise ClusterError(f"no serving member {target} in the cluster")
        key = (self.me, target)
        self.points.pop(key, None)
        self._multicast.send_control(codec.encode(StopRequest(self.me, target)))
        with trio.fail_after(timeout):
            while key not in self.points:
                await self._seen.wait()
        return self.points[key]

    def on_request(self, e: StopRequest, broker: Broker, report: Callable[[], bytes]) -> None:
        """A request delivered after ``broker``'s last event; ``report``: our progress
        report. If it names this member, it stops here."""
        seq = broker.event_seq
        self.points[(e.member, e.target)] = seq
        self._seen.set()
        self._seen = trio.Event()
        if e.target not in (0, self.me):
            log.info("member %s asked member %s to stop", e.member, e.target)
            return
        if self.halted is not None:
            return
        self.halted = seq
        self.scope = "cluster" if e.target == 0 else "member"
        # Client events queued but not yet multicast would follow the stop point.
        self._multicast.halt()
        digest = snapshot.digest_bytes(broker).hex()
        log.warning(
            "stop requested by member %s: %s stop at event %s digest=%s",
            e.member,
            self.scope,
            seq,
            digest[:16],
        )
        self._events.write(
            {"type": "stop", "seq": seq, "scope": self.scope, "by": e.member, "digest": digest}
        )
        # Our last report: confirms up to the stop point become stable on the others.
        self._multicast.send_control(report())
        self.requested.set()

    def client_text(self) -> str:
        """Why this member's clients are told to go."""
        return "cluster shutdown" if self.scope == "cluster" else "member stopped by an operator"

    def close_text(self) -> str:
        """What the clients' connection.close 320 says: a member stop sends them to the
        others; a cluster stop stops every member, so there is no other to name."""
        text = self.client_text()
        return text if self.scope == "cluster" else f"{text}: use another member"

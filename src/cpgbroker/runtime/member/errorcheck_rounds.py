"""This member's error-check rounds, executed (docs/architecture.md, "Error-check rounds"):
the runtime side of :mod:`cpgbroker.cluster.errorcheck_stall` (pure), which decides.

Theory of operation
-------------------
* The coordinator reports an error the stream does not explain (an exception applying event
  ``S``, a failed event log write) with :meth:`ErrorChecks.local_error`: the member stalls at
  ``S``, records ``{"type": "error"}`` and multicasts its outcome.
* Every ``ErrorCheck`` delivered goes to :meth:`ErrorChecks.on_error_check`: answers are
  multicast, decided rounds settled (:meth:`ErrorChecks.settle`). After each applied event
  the coordinator pays the answers owed for it (:meth:`ErrorChecks.pay_owed`); members that
  leave may decide rounds that waited for them (:meth:`ErrorChecks.members_left`).
* Settling records ``{"type": "error-check"}`` and takes this member's way forward: leave
  (``ClusterError``), resynchronise, or take the majority's way past the failed event and
  replay what was kept meanwhile.

The coordinator checks ``stall.stalled`` itself on its hot path (one attribute load) and
keeps events there with ``stall.hold``.

Owns: the :class:`~cpgbroker.cluster.errorcheck_stall.Stall`. Never applies events or touches
clients or the model: what that takes is given as callables (``fail_event``, ``recorded``,
``replay``, ``resync``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cpgbroker.cluster import codec
from cpgbroker.cluster.codec import ErrorCheck
from cpgbroker.cluster.errorcheck_stall import Answer, Leave, Proceed, Resync, Stall
from cpgbroker.cluster.errorcheck_vote import Round
from cpgbroker.cluster.membership import Membership
from cpgbroker.errors import ClusterError
from cpgbroker.runtime.member.eventlog import EventLog
from cpgbroker.runtime.member.stops import Stops
from cpgbroker.runtime.update.taking import Newcomer

log = logging.getLogger("cpgbroker.member")


class ErrorChecks:
    def __init__(
        self,
        me: int,
        membership: Membership,
        send: Callable[[bytes], None],
        eventlog: EventLog,
        stops: Stops,
        newcomer: Newcomer,
        stall: Stall,
        *,
        fail_event: Callable[[Any, int], None],
        recorded: Callable[[], None],
        replay: Callable[[Any, int], None],
        resync: Callable[[str, str], None],
    ) -> None:
        """``fail_event(event, sender)``: close the failed event's connection as every member
        that failed it alike does, then go on as after an applied event; ``recorded()``: go
        on as after an event recorded (the event log is given up); ``replay(event, sender)``:
        one kept item, in order; ``resync(rejoin, leave)``: this member's state cannot be
        trusted. ``stall`` is the member's stream's (``runtime/member/stream.py``), which
        reads from it what this member vouches for."""
        self.me = me
        self.stall = stall
        self._membership = membership
        self._send = send
        self._eventlog = eventlog
        self._stops = stops
        self._newcomer = newcomer
        self._fail_event = fail_event
        self._recorded = recorded
        self._replay = replay
        self._resync = resync

    def _answer(self, answers: list[Answer]) -> None:
        for a in answers:
            self._send(codec.encode(ErrorCheck(self.me, a.seq, a.outcome)))

    def local_error(self, seq: int, outcome: str, detail: str, e: Any, sender: int) -> None:
        """This member failed to apply (or record) event ``seq`` and the stream does not say
        why: stop applying here and let the cluster decide (cluster/errorcheck_vote.py).

        ``outcome`` is what members vote on: the kind and the exception class or errno name,
        never the message (which may hold addresses or paths that differ between members
        failing alike); ``detail`` goes to the logs."""
        if self.me not in self._membership.ready_members:
            # Not serving yet (catching up after an update): nobody relies on this member.
            raise ClusterError(f"failed at event {seq} while catching up: {outcome}: {detail}")
        log.error(
            "error at event %s: %s (%s); holding until the error-check round decides",
            seq,
            outcome,
            detail,
        )
        answer = self.stall.fail(seq, outcome, e, sender)
        self._eventlog.write(
            {"type": "error", "seq": seq, "outcome": outcome, "detail": detail[:500]}
        )
        self._answer([answer])

    def on_error_check(self, e: ErrorCheck) -> None:
        actions = self.stall.on_error_check(e, self._membership.ready_members, self._stops.halted)
        for a in actions:
            if isinstance(a, Answer):
                self._answer([a])
            else:
                self.settle(a.round)

    def pay_owed(self, seq: int) -> None:
        """This member has applied event ``seq``: the answers it owed up to it."""
        self._answer(self.stall.pay_owed(seq))

    def members_left(self, left: list[int]) -> None:
        for d in self.stall.members_left(left):
            self.settle(d.round)

    def settle(self, r: Round) -> None:
        """A decided error-check round: record it, then take this member's way forward."""
        self._eventlog.write({"type": "error-check", **r.as_dict()})
        (log.info if not r.losers else log.error)(
            "error-check round decided seq=%s decision=%r outcomes=%s leaving=%s",
            r.seq,
            r.decision,
            dict(r.outcomes),
            list(r.losers),
        )
        halted = self._stops.halted is not None
        for a in self.stall.settle(r, halted, self._newcomer.installed_from):
            if type(a) is Leave:
                raise ClusterError(a.reason)
            if type(a) is Resync:
                # Nothing else is wrong with it: it takes a fresh state update in this
                # process, as a member merged back on the smaller side does.
                self._resync(
                    f"{a.reason}; rejoining through a state update",
                    f"{a.reason}; leaving: start it again to take a fresh update",
                )
                return
            assert type(a) is Proceed
            # The majority failed here alike: take the same way forward as all of them.
            if a.outcome.startswith("apply-error"):
                self._fail_event(a.event, a.sender)
            else:
                log.error("event log disabled after a failed write: %s", a.outcome)
                self._eventlog.give_up()
                self._recorded()
            self.replay_kept()

    def replay_kept(self) -> None:
        """Apply what was delivered while this member waited for a round, in order, until it
        is held again or nothing is left."""
        stall, stops, replay = self.stall, self._stops, self._replay
        while stops.halted is None and (item := stall.next_kept()) is not None:
            replay(*item)

    def status(self) -> dict[str, Any]:
        return self.stall.status()

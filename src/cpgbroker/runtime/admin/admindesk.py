"""This member's side of operators' changes (model/operators/admin.py): it numbers each request,
submits it as an ``AdminCommand`` event, and hands the model's answer back to the request
that waits for it, once the change is as safe as a publisher confirm: applied by every
ready member and, with stores, in every store (the same N-1 guarantee). Until then an HTTP
client that got 201 could see the change vanish with this member.

Owns: the tickets in flight and the answers that wait for stability. One per incarnation of
a member (its tickets die with it: their requests time out) and one standalone.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from cpgbroker.model.events import AdminCommand, AdminReply, Event

Answer = tuple[int, Any]


class _Wait:
    __slots__ = ("answer", "done", "seq")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.answer: Answer = (503, {"error": "unavailable", "reason": "no answer"})
        self.seq = 0


class Pending:
    """An event sent through the desk whose answer has not been taken yet."""

    __slots__ = ("ticket", "wait")

    def __init__(self, ticket: int, wait: _Wait) -> None:
        self.ticket = ticket
        self.wait = wait


class AdminDesk:
    def __init__(
        self,
        member: int,
        submit: Callable[[Event], Awaitable[None]],
        event_seq: Callable[[], int],
        settled: Callable[[], int] | None = None,
    ) -> None:
        self.member = member
        self._submit = submit
        # The event being applied when an answer comes (its seq is what must be stable).
        self._event_seq = event_seq
        # The highest event applied everywhere it must be (None: at once, standalone).
        self._settled = settled
        self._tickets = itertools.count(1)
        self._waiting: dict[int, _Wait] = {}
        # Answered, waiting for their event to be settled.
        self.unsettled: list[_Wait] = []

    async def request(self, user: str, op: str, args: dict[str, Any], timeout: float) -> Answer:
        """Submit ``op`` and wait for its answer (``trio.TooSlowError`` after ``timeout``)."""
        # Key order kept: a definitions import is applied in its document's order.
        data = json.dumps(args).encode()
        return await self.submit(
            lambda ticket: AdminCommand(self.member, ticket, user, op, data), timeout
        )

    async def submit(self, make: Callable[[int], Event], timeout: float) -> Answer:
        """Submit the event ``make(ticket)`` (one the model answers with an ``AdminReply``
        naming this member and that ticket: an admin command, a federation link's messages)
        and wait for the answer, once settled."""
        return await self.answer(await self.send(make), timeout)

    async def send(self, make: Callable[[int], Event]) -> Pending:
        """Submit the event ``make(ticket)`` (events sent one after another are applied in
        that order) without waiting for its answer: :meth:`answer` waits for it, and
        :meth:`forget` drops it when nobody will."""
        ticket = next(self._tickets)
        wait = self._waiting[ticket] = _Wait()
        try:
            await self._submit(make(ticket))
        except BaseException:
            self._waiting.pop(ticket, None)
            raise
        return Pending(ticket, wait)

    async def answer(self, pending: Pending, timeout: float) -> Answer:
        """The answer to a sent event, once settled (``trio.TooSlowError`` after ``timeout``)."""
        try:
            with trio.fail_after(timeout):
                await pending.wait.done.wait()
        finally:
            self.forget(pending)
        return pending.wait.answer

    def forget(self, pending: Pending) -> None:
        self._waiting.pop(pending.ticket, None)
        if pending.wait in self.unsettled:
            self.unsettled.remove(pending.wait)

    def answered(self, reply: AdminReply) -> None:
        """An ``AdminReply`` effect (client I/O passes them here): ours, if it names this
        member and a ticket still waiting."""
        if reply.member != self.member:
            return
        wait = self._waiting.get(reply.ticket)
        if wait is None:
            return
        wait.answer = (reply.status, reply.body)
        wait.seq = self._event_seq()
        if self._settled is None or self._settled() >= wait.seq:
            wait.done.set()
        else:
            self.unsettled.append(wait)

    def settle(self, seq: int) -> None:
        """Events up to ``seq`` are settled: their answers go out."""
        keep = []
        for wait in self.unsettled:
            if wait.seq <= seq:
                wait.done.set()
            else:
                keep.append(wait)
        self.unsettled = keep

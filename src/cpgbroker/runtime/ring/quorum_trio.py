"""trio adapter for :class:`cpgbroker.corosync.votequorum.Quorum`: a reader task and the
quorum view.

``async with open_quorum(netns=...) as q:`` connects (with change tracking on) and runs a task
that waits on the votequorum fd with :func:`trio.lowlevel.wait_readable`, dispatches, feeds
every notification to ``q.view`` (:class:`cpgbroker.cluster.quorum.QuorumView`) and wakes
whoever waits in :meth:`TrioQuorum.wait_change`. Listeners registered with
:meth:`TrioQuorum.on_loss` are called synchronously, in the reader task, the moment a
notification says the partition is inquorate: quorum loss takes effect without waiting for
anything else (in particular not for the CPG stream).

``getinfo`` is a synchronous round trip that blocks if corosync hangs: it runs in a worker
thread bounded by ``call_timeout`` (the handle is abandoned on timeout, as the CPG adapter does).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

import trio

from cpgbroker import errors
from cpgbroker.cluster.quorum import QuorumView
from cpgbroker.corosync.errors import CpgConnectionLost, CpgHungError
from cpgbroker.corosync.votequorum import (
    ExpectedVotesChange,
    NodeListChange,
    Quorum,
    QuorumChange,
    QuorumInfo,
)
from cpgbroker.runtime.ring.cpg_trio import hung_up

log = logging.getLogger("cpgbroker.quorum")

DEFAULT_CALL_TIMEOUT: Final = 10.0


class TrioQuorum:
    """A votequorum handle driven by trio. Create it with :func:`open_quorum`."""

    def __init__(self, quorum: Quorum, *, call_timeout: float = DEFAULT_CALL_TIMEOUT) -> None:
        self.quorum = quorum
        self.call_timeout = call_timeout
        self.view = QuorumView()
        self.info: QuorumInfo | None = None
        self.expected_votes: int | None = None
        self.failure: errors.CpgError | None = None
        self._changed = trio.Event()
        self._loss_listeners: list[Callable[[str], None]] = []
        self._info_wanted = trio.Event()

    @property
    def quorate(self) -> bool:
        return self.failure is None and self.view.quorate

    def on_loss(self, fn: Callable[[str], None]) -> Callable[[], None]:
        """Call ``fn(reason)`` at once when quorum is lost; returns the unregister function."""
        self._loss_listeners.append(fn)
        return lambda: self._loss_listeners.remove(fn) if fn in self._loss_listeners else None

    def _notify_loss(self, reason: str) -> None:
        for fn in list(self._loss_listeners):
            fn(reason)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_change(self) -> None:
        """Until the next notification (or a failure, which is then raised)."""
        if self.failure is not None:
            raise self.failure
        await self._changed.wait()
        if self.failure is not None:
            raise self.failure

    async def wait_quorate(self) -> None:
        while not self.quorate:
            await self.wait_change()

    def _fail(self, error: errors.CpgError) -> None:
        if self.failure is None:
            self.failure = error
        self._notify_loss(f"lost the votequorum service: {error}")
        self._wake()

    async def _pump(self) -> None:
        q = self.quorum
        fd = q.fileno()
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                batch = q.dispatch()
            except errors.CpgError as e:
                self._fail(e)
                return
            if not batch:
                if hung_up(fd):
                    self._fail(CpgConnectionLost("votequorum_dispatch"))
                    return
                continue
            for ev in batch:
                if type(ev) is NodeListChange:
                    self.view.on_nodelist((ev.ring_id.nodeid, ev.ring_id.seq))
                    log.debug("ring %s nodes %s", ev.ring_id, ev.members)
                elif type(ev) is QuorumChange:
                    was = self.view.quorate
                    self.view.on_quorum(ev.quorate)
                    if was != ev.quorate:
                        (log.info if ev.quorate else log.warning)(
                            "partition is %s (ring %s, nodes %s)",
                            "quorate" if ev.quorate else "NOT quorate",
                            self.view.ring,
                            [(n.nodeid, n.state_name) for n in ev.nodes],
                        )
                    if not ev.quorate:
                        self._notify_loss("this node lost quorum (its partition has too few votes)")
                elif type(ev) is ExpectedVotesChange:
                    self.expected_votes = ev.expected_votes
            pending = q.take_pending_error()
            if pending is not None:
                # A notification may have been dropped (it could not be stored): what we know
                # of quorum can no longer be trusted.
                self._fail(pending)
                return
            self._info_wanted.set()
            self._wake()

    async def _refresh_info(self) -> None:
        """Keep :attr:`info` (votes, expected votes) current for the status endpoint."""
        while True:
            await self._info_wanted.wait()
            self._info_wanted = trio.Event()
            try:
                self.info = await self.call(self.quorum.getinfo)
            except errors.CpgError as e:
                self._fail(e)
                return

    async def call(self, fn: Callable[..., Any], *args: object) -> Any:
        """A blocking votequorum call in a worker thread, at most ``call_timeout`` seconds."""
        if self.failure is not None:
            raise self.failure
        result: list[Any] = []

        def run() -> None:
            result.append(fn(*args))

        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.call_timeout) as scope:
                await trio.to_thread.run_sync(run, abandon_on_cancel=True)
        if scope.cancelled_caught:
            error = CpgHungError(
                getattr(fn, "__name__", "votequorum call"),
                f"corosync did not answer within {self.call_timeout} s (stopped or hung)",
            )
            self.quorum.abandon()
            self._fail(error)
            raise error
        return result[0]

    def status(self) -> dict[str, Any]:
        """Quorum as the status endpoint shows it."""
        out: dict[str, Any] = {"quorate": self.quorate}
        if self.info is not None:
            out.update(
                {
                    "votes": self.info.total_votes,
                    "expected_votes": self.info.expected_votes,
                    "quorum": self.info.quorum,
                    "node_votes": self.info.node_votes,
                }
            )
        if self.view.ring is not None:
            out["ring"] = f"{self.view.ring[0]}.{self.view.ring[1]}"
        if self.failure is not None:
            out["error"] = str(self.failure)
        return out


@asynccontextmanager
async def open_quorum(
    *, netns: str | None = None, call_timeout: float = DEFAULT_CALL_TIMEOUT
) -> AsyncIterator[TrioQuorum]:
    """Connect to the local corosync's votequorum and track it while the block runs."""

    def connect() -> Quorum:
        return Quorum(netns=netns)

    with trio.CancelScope(shield=True):
        with trio.move_on_after(call_timeout) as scope:
            q = await trio.to_thread.run_sync(connect, abandon_on_cancel=True)
    if scope.cancelled_caught:
        raise CpgHungError(
            "votequorum_initialize", f"corosync did not answer within {call_timeout} s"
        )
    adapter = TrioQuorum(q, call_timeout=call_timeout)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(adapter._pump)
            nursery.start_soon(adapter._refresh_info)
            try:
                yield adapter
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if not q.closed:
            with trio.CancelScope(shield=True), trio.move_on_after(call_timeout) as cscope:
                await trio.to_thread.run_sync(q.close, abandon_on_cancel=True)
            if cscope.cancelled_caught:
                q.abandon()

"""The newcomer side of a state update (docs/architecture.md, "State update"; the transfer
itself is ``runtime/update/transfer.py``).

1. The newcomer multicasts ``UpdateRequest(newcomer, updater, address, token)`` naming the
   highest-id ready member it knows. Where that request is delivered is the update point:
   from there on it keeps every stream item delivered (:attr:`Newcomer.buffer`).
2. The updater connects to ``address`` and streams the model as it was at that point; the
   newcomer restores it part by part while the stream keeps flowing into the buffer, checks
   the digest, and hands the model and the updater's membership view to the member.
3. The member replays the buffer (:meth:`Newcomer.catch_up`) and announces itself ready.

The updater leaving before the transfer completes, a broken or corrupt transfer: the buffer is
dropped and another member is asked.

Owns: the outstanding request, the buffer, the transfer in progress and its statistics.
Never applies events: the member replays the buffer through the callable it passes, and
installs the model through the one it gave.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import trio

from cpgbroker.cluster import codec
from cpgbroker.cluster.codec import UpdateRequest
from cpgbroker.cluster.membership import Membership
from cpgbroker.errors import ClusterError
from cpgbroker.model import Broker, BrokerConfig, snapshot
from cpgbroker.runtime.update import transfer as update

log = logging.getLogger("cpgbroker.member")

# How many buffered items the catch-up replays between two scheduling points (the CPG reader
# appends to the buffer meanwhile).
REPLAY_SLICE = 256


class Newcomer:
    def __init__(
        self,
        me: int,
        membership: Membership,
        broker_config: BrokerConfig,
        send: Callable[[bytes], None],
        install: Callable[[Broker, list[list[Any]]], None],
    ) -> None:
        self.me = me
        self._membership = membership
        self._broker_config = broker_config
        self._send = send
        self._install = install
        # Where updaters connect: the state-update listener's address.
        self.address = ""
        self.attempt: UpdateRequest | None = None  # our outstanding request
        self._request_delivered = trio.Event()
        # Stream items delivered after our request: (event, sender), or (CPG item, None).
        self.buffer: collections.deque[tuple[Any, int | None]] | None = None
        self.installed = False
        # (seq, updater) of the state installed, for error-check rounds that cross it.
        self.installed_from: tuple[int, int] | None = None
        self._installed_evt = trio.Event()
        self._excluded: dict[int, None] = {}  # updaters that failed us (order kept)
        self._receive_scope: trio.CancelScope | None = None
        self.progress: update.UpdateProgress | None = None
        self.attempts = 0
        self.replayed = 0

    def request(self) -> None:
        """Ask a serving member for the state at the point where this request is delivered.
        The highest-id serving member is asked (the lowest is the clock master); members that
        failed an earlier attempt only when nobody else is left."""
        ready = [m for m in self._membership.ready_members if m != self.me]
        candidates = [m for m in ready if m not in self._excluded] or ready
        self.buffer = None
        self._request_delivered = trio.Event()
        if not candidates:
            self.attempt = None
            log.warning("no serving member to take a state update from yet; waiting")
            return
        self.attempts += 1
        self.attempt = UpdateRequest(
            self.me, candidates[-1], self.address, os.urandom(update.TOKEN_BYTES)
        )
        log.info(
            "requesting a state update from member=%s (attempt %d)",
            candidates[-1],
            self.attempts,
        )
        self._send(codec.encode(self.attempt))

    def retry(self, reason: str, exclude: int | None) -> None:
        log.warning("state update failed: %s; asking another member", reason)
        if exclude is not None:
            self._excluded[exclude] = None
        if self._receive_scope is not None:
            self._receive_scope.cancel()
        self.progress = None
        self.request()

    def members_left(self, left: list[int]) -> None:
        a = self.attempt
        if a is not None and not self.installed and a.updater in left:
            self.retry(f"updater {a.updater} left the cluster", exclude=a.updater)

    def on_request(self, e: UpdateRequest) -> None:
        """Our own request, delivered: the update point, if it is the current attempt."""
        a = self.attempt
        if a is None or e.token != a.token or self.installed:
            return  # a superseded attempt
        if e.updater not in self._membership.members:
            self.retry(f"member {e.updater} left before the request", None)
            return
        # The update point: from here on, the stream is kept for replay.
        self.buffer = collections.deque()
        self._request_delivered.set()

    async def handler(self, stream: trio.SocketStream) -> None:
        """An updater connects: check the token, restore while the stream keeps flowing into
        the buffer, then install and catch up."""
        async with stream:
            try:
                reader, token = await update.read_token(stream)
            except (ClusterError, trio.TooSlowError, trio.BrokenResourceError, OSError) as e:
                log.warning("rejected a state transfer connection: %s", e)
                return
            a = self.attempt
            if a is None or token != a.token or self.installed:
                log.warning("rejected a state transfer connection with an unknown token")
                return
            progress = self.progress = update.UpdateProgress(a.updater)
            restorer = snapshot.Restorer(self._broker_config)
            with trio.CancelScope() as scope:
                self._receive_scope = scope
                try:
                    broker, members = await update.receive_update(reader, restorer, progress)
                    # The state is the one at our request's delivery; install once that
                    # point has been delivered here too (the buffer starts there).
                    await self._request_delivered.wait()
                # Whatever breaks a transfer (connection, corrupt data, decode errors), the
                # remedy is the same: ask again, elsewhere.
                except Exception as e:
                    if self.attempt is a:
                        self.retry(f"transfer from member {a.updater}: {e}", a.updater)
                    return
                finally:
                    self._receive_scope = None
            if scope.cancelled_caught or self.attempt is not a:
                return
            self._installed(broker, members, progress)

    def _installed(
        self, broker: Broker, members: list[list[Any]], p: update.UpdateProgress
    ) -> None:
        self.installed_from = (broker.event_seq, p.updater)
        self._install(broker, members)
        self.installed = True
        self.attempt = None
        log.info(
            "state update installed seq=%s messages=%d parts=%d %.1f MiB in %.1f s; "
            "replaying %d events delivered since",
            broker.event_seq,
            p.messages,
            p.parts,
            p.bytes / 2**20,
            time.monotonic() - p.started,
            len(self.buffer or ()),
        )
        self._installed_evt.set()

    async def catch_up(self, replay: Callable[[Any, int | None], None]) -> None:
        """Once installed, replay what was delivered after the update point."""
        await self._installed_evt.wait()
        buf = self.buffer
        assert buf is not None
        n = 0
        while buf:
            e, sender = buf.popleft()
            replay(e, sender)
            n += 1
            if n % REPLAY_SLICE == 0:
                await trio.lowlevel.checkpoint()  # the CPG reader appends meanwhile
        # No checkpoint between the empty test and this: nothing can slip in between.
        self.buffer = None
        self.replayed = n
        log.info("caught up after replaying %d events; announcing ready", n)

    def activity(self) -> int:
        """Grows while an update makes progress (the ready timeout does not cut it short)."""
        p = self.progress
        return (p.bytes if p is not None else 0) + self.replayed + len(self.buffer or ())

    def status(self) -> dict[str, Any] | None:
        if self.progress is None:
            return None
        return {
            **self.progress.as_dict(),
            "attempts": self.attempts,
            "installed": self.installed,
            "buffered_events": len(self.buffer or ()),
        }

"""Digest checkpoints of a member: every ``checkpoint_every`` events it digests its model,
multicasts the digest and acts on the cluster's verdict (the vote is ``cluster/checkpoint.py``).

A large state is digested in a forked child (copy on write: the state of exactly that point)
while the member goes on applying events: digesting a million messages takes seconds, and
done inline it would stall the member, and through flow control and confirms the cluster.

Owns: the vote, the forked digests in progress. Never applies events: the member hands it the
model at the checkpoint's event, and sends what it returns through the callable it gives.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
from collections.abc import Callable

import trio

from cpgbroker.cluster import codec
from cpgbroker.cluster.checkpoint import Checkpoints, Verdict
from cpgbroker.cluster.codec import Checkpoint
from cpgbroker.errors import ClusterError
from cpgbroker.model import Broker, snapshot
from cpgbroker.runtime.member.eventlog import EventLog
from cpgbroker.runtime.update import transfer as update

log = logging.getLogger("cpgbroker.member")

# From this many queued and unacked messages on, checkpoint digests are computed in a forked
# child (a fork costs a few ms; a digest about 10 us per message).
DIGEST_FORK_MESSAGES = 2_000


class Checkpointer:
    def __init__(
        self,
        me: int,
        every: int,
        send: Callable[[bytes], None],
        events: EventLog,
        active: Callable[[], bool],
    ) -> None:
        self.me = me
        # Checkpoints are voted on at the same events everywhere (part of the config digest).
        self.every = every
        self._send = send
        self._events = events
        # Whether the member still vouches for its state (not suspended, not stopped).
        self._active = active
        self.votes = Checkpoints()
        # Forked digests in progress: (seq, read end of the pipe, child pid).
        self._digesting: collections.deque[tuple[int, int, int]] = collections.deque()
        self._digest_wake = trio.Event()
        self.digest_fork_messages = DIGEST_FORK_MESSAGES
        self.forked_digests = 0

    @property
    def last(self) -> Verdict | None:
        return self.votes.last

    @property
    def digesting(self) -> int:
        """Forked digests not collected yet."""
        return len(self._digesting)

    def take(self, seq: int, broker: Broker) -> None:
        """Digest ``broker`` as it is after event ``seq`` and vote on it."""
        if _messages(broker) >= self.digest_fork_messages:
            r, w = os.pipe()
            try:
                pid = update.fork_child(
                    lambda: _write_all(w, snapshot.digest_bytes(broker)),
                    f"checkpoint digest at event {seq}",
                    keep=w,
                )
            except OSError as e:  # no memory or processes left for a child: digest here
                log.warning("cannot fork for the checkpoint digest (%s): digesting inline", e)
                os.close(r)
            else:
                self.forked_digests += 1
                self._digesting.append((seq, r, pid))
                self._digest_wake.set()
                return
            finally:
                os.close(w)
        self._done(seq, snapshot.digest_bytes(broker))

    def _done(self, seq: int, digest: bytes) -> None:
        if not self._active():
            return
        self._send(codec.encode(Checkpoint(self.me, seq, digest)))
        if self._events.file is not None:
            self._events.write({"type": "checkpoint", "seq": seq, "digest": digest.hex()})

    async def collect_digests(self) -> None:
        """Take the digests of forked checkpoint children, in checkpoint order."""
        while True:
            while not self._digesting:
                self._digest_wake = trio.Event()
                await self._digest_wake.wait()
            seq, r, pid = self._digesting[0]
            data = b""
            try:
                while len(data) < 32:
                    await trio.lowlevel.wait_readable(r)
                    chunk = os.read(r, 32 - len(data))
                    if not chunk:
                        break
                    data += chunk
            finally:
                os.close(r)
                self._digesting.popleft()
            while os.waitpid(pid, os.WNOHANG)[0] == 0:
                await trio.sleep(0.001)  # it exits right after writing
            if len(data) != 32:
                # The child failed (its log says why): this member cannot vouch for its state.
                raise ClusterError(f"the checkpoint digest at event {seq} could not be computed")
            self._done(seq, data)

    # -- the vote
    def on_checkpoint(self, e: Checkpoint, ready: list[int]) -> None:
        verdict = self.votes.record(e.seq, e.member, e.digest, ready)
        if verdict is not None:
            self._on_verdict(verdict)

    def members_changed(self, ready: list[int]) -> None:
        for verdict in self.votes.members_changed(ready):
            self._on_verdict(verdict)

    def _on_verdict(self, v: Verdict) -> None:
        if self._events.file is not None:
            self._events.write(
                {
                    "type": "verdict",
                    "seq": v.seq,
                    "agreed": v.agreed,
                    "losers": list(v.losers),
                    "digests": {str(m): d.hex() for m, d in v.digests},
                }
            )
        if v.agreed:
            log.debug("checkpoint agreed seq=%s digest=%s", v.seq, v.winner.hex()[:16])
            return
        log.error(
            "REPLICAS DIVERGED seq=%s digests=%s losers=%s",
            v.seq,
            {m: d.hex()[:16] for m, d in v.digests},
            list(v.losers),
        )
        if self.me in v.losers:
            raise ClusterError(
                f"this member's state differs from the majority at event {v.seq}: leaving"
            )

    def close(self) -> None:
        """End the digest children of an ended incarnation."""
        while self._digesting:
            _seq, r, pid = self._digesting.popleft()
            os.close(r)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _messages(broker: Broker) -> int:
    return sum(
        len(q.messages) + q.unacked for vh in broker.vhosts.values() for q in vh.queues.values()
    )


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]

"""How a member's events become CPG messages: its clients' events (the sequencer its
:class:`~cpgbroker.runtime.amqp.server.AmqpServer` is given), its control messages and its progress
reports.

* A local client's connect, bytes, disconnect and do-output grants are encoded
  (``cluster/codec.py``). While none of the member's own CPG messages is in flight (a low rate)
  the event is multicast at once from the task that produced it (``send_nowait``: no sender
  wake-up, one scheduling round less per message). Otherwise it is queued, and the sender task
  packs queued events into CPG messages of up to ``MAX_BATCH_BYTES`` (Nagle's rule: batching
  happens exactly when there is load to batch; the CPG adapter bounds our messages in flight).
* Control messages (progress, checkpoints, hellos, update requests, error checks, stop
  requests) have a queue of their own, never held back by cluster flow control, which itself
  waits for other members' progress reports: held back behind client traffic, those reports
  would never come (a deadlock).
* Cluster flow control: while the slowest ready member lags more than ``max_lag`` events,
  client traffic waits (our own reports still go out).
* A progress report that confirms wait for rides on the next client message, or goes alone
  when its pacing (``cluster/progress.py``) says so.

Owns: the queues, the sender task's state, whether client traffic is dropped (a stop request)
or nothing may go out directly (the member stopped serving). Never applies events: it reads
the lag and our report through the callables it is given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from cpgbroker.cluster import codec
from cpgbroker.cluster.progress import PeerProgress
from cpgbroker.corosync.cpg import MAX_IOVEC
from cpgbroker.model.events import ClientData, Event
from cpgbroker.runtime.ring.cpg_trio import TrioCpg

log = logging.getLogger("cpgbroker.member")

# Largest CPG message we build from queued events (below the 1 MiB atomic size, so libcpg
# never fragments; large enough to amortise the per-message cost over many frames).
MAX_BATCH_BYTES = 512 * 1024
# While client traffic is held back for a slow member, how often the lag is looked at again
# when no progress report arrives.
LAG_RECHECK = 0.05


class Multicaster:
    # Events take effect when CPG delivers them back (the node counts reads in flight).
    deferred = True

    def __init__(
        self,
        cpg: TrioCpg,
        progress: PeerProgress,
        lag: Callable[[], int],
        report: Callable[[], bytes],
    ) -> None:
        self.cpg = cpg
        self._progress = progress
        self._lag = lag
        # Our progress report as of now, encoded.
        self._report = report
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._ctl: list[bytes] = []
        self._wake = trio.Event()
        # The sender task is between taking a batch and handing it to CPG: nothing may
        # overtake it on the direct path (``_send_direct``).
        self._sending = False
        # A stop request stopped the member: its clients' further events are dropped.
        self.halted = False
        # The member stopped serving (suspended or failed): nothing goes out directly.
        self.silenced = False
        self.lag_waits = 0
        self._progress_changed = trio.Event()

    # ------------------------------------------------------------------ client events

    async def submit(self, ev: Event) -> None:
        """Multicast instead of apply: the event takes effect when CPG delivers it."""
        self.submit_nowait(ev)

    def submit_nowait(self, ev: Event) -> None:
        """:meth:`submit` without a checkpoint (it never waits): events submitted one after
        another go out in that order."""
        if self.halted:
            # Stopped at a point of the stream: nothing of this member's clients may follow it
            # (their publishes would be applied by the members serving on, unconfirmed).
            return
        data = codec.encode_data(ev.conn, ev.data) if type(ev) is ClientData else codec.encode(ev)
        # Nagle's rule: with nothing of ours in flight (a low rate) the event goes out now,
        # from this task; while our messages are in flight (load) it waits in the queue and
        # the sender batches it with whatever else arrives meanwhile.
        if not (self.cpg.idle and self._send_direct(data, client=True)):
            self._out.append(data)
            self._out_bytes += len(data)
            self._wake.set()

    def halt(self) -> None:
        """A stop request: client events queued but not yet multicast would follow the stop
        point; they and all later ones are dropped."""
        self.halted = True
        self._out.clear()
        self._out_bytes = 0

    @property
    def queued(self) -> int:
        """Client events waiting for the sender."""
        return len(self._out)

    @property
    def queued_bytes(self) -> int:
        """Bytes of client events waiting for the sender."""
        return self._out_bytes

    def _send_direct(self, data: bytes | None, client: bool) -> bool:
        """Multicast ``data`` in this scheduling turn, if nothing queued or being sent would
        be overtaken and it needs no waiting; a wanted progress report rides along (``data``
        None: the report alone).

        At low rates a CPG message costs mostly scheduling: waking the sender task is one
        more round of trio's run loop (an epoll call and the loop's own work) per message.
        """
        if self._out or self._ctl or self._sending or self.silenced:
            return False
        if client and self._lag() > self._progress.max_lag:
            return False  # the sender holds client traffic back until the slowest catches up
        bufs = [] if data is None else [data]
        report = self._progress.report_wanted
        if report:
            bufs.append(self._report())
        if not bufs or not self.cpg.send_nowait(codec.HEADER, *bufs):
            return False
        if report:
            self._progress.report_gone(time.monotonic())
        return True

    # ------------------------------------------------------------------ control and reports

    def send_control(self, data: bytes) -> None:
        """Queue a control message: never held back by flow control."""
        self._ctl.append(data)
        self._wake.set()

    def report_soon(self, answer_expected: bool) -> None:
        """Confirms for another member's client wait for our progress report: send it now if
        nothing else can carry it, else let it ride (``answer_expected``: a local client was
        just handed output, and its answer probably follows)."""
        progress = self._progress
        if progress.report_wanted:
            return  # the waiting report is taken when it leaves: it covers these events too
        if progress.want_report(time.monotonic(), answer_expected) and self._send_direct(
            None, False
        ):
            # Straight from the delivery loop when nothing is queued: the report leaves in the
            # turn that applied the events it vouches for.
            return
        self._wake.set()

    def _take_report(self) -> bytes:
        """The report, for a message the sender is about to multicast."""
        self._progress.report_gone(time.monotonic())
        return self._report()

    def progress_changed(self) -> None:
        """A member reported progress: whoever waits for the lag or stability looks again."""
        self._progress_changed.set()

    async def wait_progress(self, timeout: float = float("inf")) -> None:
        """Until the next progress report, at most ``timeout`` seconds."""
        self._progress_changed = trio.Event()
        with trio.move_on_after(timeout):
            await self._progress_changed.wait()

    async def _flush_control(self) -> None:
        while self._ctl:
            take, size = 0, 2
            for data in self._ctl:
                if take and size + len(data) > MAX_BATCH_BYTES:
                    break
                size += len(data)
                take += 1
            batch = self._ctl[:take]
            del self._ctl[:take]
            was, self._sending = self._sending, True
            try:
                await self.cpg.send(codec.HEADER + b"".join(batch))
            finally:
                self._sending = was

    # ------------------------------------------------------------------ the sender task

    async def sender(self) -> None:
        progress = self._progress
        while True:
            if self._ctl:
                await self._flush_control()
            if not self._out:
                if progress.report_wanted:
                    # No client batch to ride on: a message of its own, at most one per
                    # REPORT_INTERVAL (a newer report replaces a waiting one).
                    wait = progress.report_wait(time.monotonic())
                    if wait > 0:
                        self._wake = trio.Event()
                        with trio.move_on_after(wait):
                            await self._wake.wait()
                        continue
                    self._ctl.append(self._take_report())
                    continue
                if not self._ctl:
                    self._wake = trio.Event()
                    await self._wake.wait()
                continue
            # Take queued events up to the batch size, in order.
            out = self._out
            take = 0
            size = 2
            for data in out:
                if take and size + len(data) > MAX_BATCH_BYTES:
                    break
                size += len(data)
                take += 1
            self._sending = True
            try:
                await self._wait_for_slow_members()
                batch = out[:take]
                del out[:take]
                self._out_bytes -= size - 2
                if progress.report_wanted:
                    batch.append(self._take_report())  # rides along: no message of its own
                if len(batch) < MAX_IOVEC:  # the binding gathers up to MAX_IOVEC buffers
                    await self.cpg.send(codec.HEADER, *batch)  # gathered by the kernel, no copy
                else:
                    await self.cpg.send(codec.HEADER + b"".join(batch))
            finally:
                self._sending = False

    async def _wait_for_slow_members(self) -> None:
        max_lag = self._progress.max_lag
        if self._lag() <= max_lag:
            return
        self.lag_waits += 1
        log.warning("holding back client traffic: a member is %d events behind", self._lag())
        while self._lag() > max_lag:
            if self._progress.report_wanted:
                self._ctl.append(self._take_report())
            await self._flush_control()  # our own reports must get out, or nobody moves
            await self.wait_progress(LAG_RECHECK)

"""The member watchdog: a small separate process that kills its member when the member stops
processing events.

A member that hangs (stuck in a loop, deadlocked, stopped by a signal, swapping to death)
stays in the CPG group: corosync keeps it a member and buffers the stream for it, the others
hold back client traffic once it lags (``[cluster] max_lag``) and wait for its progress
reports before they confirm anything. Only a process outside the hung one can end that, so a
child process is spawned at start-up that the member feeds through a pipe while it keeps up
with the stream; when the feeding stops for ``timeout`` seconds, the watchdog SIGKILLs the
member. The others then see it leave (corosync reports the process gone) and carry on; its
clients fail over.

The watchdog itself exits when its member does: the pipe reaches EOF, or its parent changes.
It is a plain loop without trio: it must keep running whatever state the member is in.

Slow events are not hangs
-------------------------
Every member applies the same events, so an event that takes long to apply (a client's 2,000
exchange.delete in one read, say) takes long on *every* member, and none of their event
loops runs meanwhile. If only the event loop fed the watchdog, every member's watchdog would
kill its member in the same event and leave no member. A member slow in an event every member
is slow in is not hung; a member that stopped while the others moved on is.

So the member marks the event it is applying (:class:`ApplyMark`: one attribute store before
and one after each event, no system call), and a thread of the member (:class:`BusyFeeder`,
not the event loop) looks every ``timeout / 5`` seconds. It feeds the watchdog when the rule
of :class:`BusyRule` says so:

* the member is inside an event (the mark is set), and
* the thread running the event loop used at least :data:`MIN_CPU_SHARE` of the time since the
  last look (its own CPU clock: the feeder's own CPU time does not count), and
* this event has been applying for less than ``max_apply`` seconds (``[cluster]
  max_apply_seconds``) since the thread first saw it.

Outside an event the feeding stays with the event loop (``MemberProcess.feed_watchdog``), as
before. A process stopped by a signal (the feeder thread stops too), swapping (waiting for
pages, not running) or deadlocked in an event makes no CPU progress and is killed after
``timeout``; a member looping in one event forever is killed ``max_apply + timeout`` seconds
after it started it. A member slow *alone* is not helped by anything here beyond its own
watchdog: the others wait for its progress before confirming, and hold client traffic back
once it lags by ``max_lag`` events, as for any slow member.

One limit: the feeder needs the GIL. Applying an event is Python code, which lets other
threads run every few milliseconds; a single C call that holds the GIL for ``timeout`` seconds
is taken for a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

log = logging.getLogger("cpgbroker.member")

# The share of wall time the event loop's thread must have run on a CPU since the feeder's
# last look for a long event to count as progress. A healthy member on a loaded host gets far
# more; a stopped, swapping or blocked one gets next to nothing (page faults and wake-ups).
MIN_CPU_SHARE = 0.1


def spawn(timeout: float) -> subprocess.Popen[bytes]:
    """Start the watchdog for this process; feed it with :func:`feed`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpgbroker.runtime.member.watchdog", str(os.getpid()), str(timeout)],
        stdin=subprocess.PIPE,
        stdout=None,
        stderr=None,
        # Not in the member's process group: a signal meant for the member (a test's SIGSTOP,
        # a terminal's ^Z) does not stop its watchdog too.
        start_new_session=True,
    )
    assert proc.stdin is not None
    os.set_blocking(proc.stdin.fileno(), False)  # feeding must never block the member
    return proc


def feed(proc: subprocess.Popen[bytes]) -> None:
    """One sign of life. Never blocks: if the pipe is full, the watchdog has plenty."""
    assert proc.stdin is not None
    with contextlib.suppress(BlockingIOError, BrokenPipeError):
        os.write(proc.stdin.fileno(), b".")


class ApplyMark:
    """The event of the stream the member is applying now: its seq, 0 between events. The
    member sets it around each event (the hot path pays two attribute stores); the feeder
    thread only reads it."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0


# What the feeder makes of one look (:meth:`BusyRule.look`).
IDLE = "idle"  # between events: the event loop feeds for itself
BUSY = "busy"  # inside an event and running: feed
STILL = "still"  # inside an event but not running (stopped, swapping, blocked): no feeding
TOO_LONG = "too-long"  # inside one event for longer than max_apply: no feeding


@attrs.define
class BusyRule:
    """The feeder's decision, a pure function of what it sees at each look: the mark, the
    monotonic time and the event loop thread's CPU time (both in seconds)."""

    max_apply: float
    last_now: float
    last_cpu: float
    # The event seen inside at the last look (0: none), and when it was first seen.
    seen: int = 0
    since: float = 0.0

    def look(self, seq: int, now: float, cpu: float) -> str:
        elapsed, used = now - self.last_now, cpu - self.last_cpu
        self.last_now, self.last_cpu = now, cpu
        if seq == 0 or self.max_apply <= 0:
            self.seen = 0
            return IDLE
        if seq != self.seen:
            self.seen, self.since = seq, now
        if now - self.since >= self.max_apply:
            return TOO_LONG
        if used < MIN_CPU_SHARE * elapsed:
            return STILL
        return BUSY


def _loop_cpu_clock() -> Any:
    """A function returning the CPU time of the calling thread (the event loop's), readable
    from another thread."""
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):  # no per-thread clocks here: the whole process's
        return time.process_time
    return lambda: time.clock_gettime(clock)


class BusyFeeder:
    """The thread that feeds the watchdog while the member is inside a long event (see the
    module docstring). Start it from the event loop's thread: it watches that thread's CPU
    clock.

    ``feed`` gives one sign of life to whatever watches the member: its watchdog process
    (:func:`feed`) and, under systemd, systemd's watchdog too.

    Owns: the thread and its :class:`BusyRule`. Never touches the member: it reads the mark."""

    def __init__(
        self, feed: Callable[[], None], mark: ApplyMark, period: float, max_apply: float
    ) -> None:
        self._feed = feed
        self._mark = mark
        self._period = period
        self._max_apply = max_apply
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        cpu = _loop_cpu_clock()
        rule = BusyRule(self._max_apply, time.monotonic(), cpu())
        self._thread = threading.Thread(
            target=self._run, args=(rule, cpu), name="watchdog-feeder", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._period + 1)

    def _run(self, rule: BusyRule, cpu: Any) -> None:
        mark = self._mark
        prev, told = 0, (0, IDLE)
        while not self._stop.wait(self._period):
            seq = mark.seq
            verdict = rule.look(seq, time.monotonic(), cpu())
            if verdict == BUSY:
                self._feed()
            # Once per long event and verdict (events seen at one look only are short: the
            # look just fell inside one): an operator sees why the member does not answer.
            if seq == prev != 0 and verdict in (BUSY, TOO_LONG) and told != (seq, verdict):
                told = (seq, verdict)
                if verdict == BUSY:
                    log.warning(
                        "event %s has been applying for %.1f s; the watchdog is fed while it "
                        "makes progress (at most %g s)",
                        seq,
                        time.monotonic() - rule.since,
                        self._max_apply,
                    )
                else:
                    log.error(
                        "event %s has been applying for more than %g s ([cluster] "
                        "max_apply_seconds): the watchdog is no longer fed",
                        seq,
                        self._max_apply,
                    )
            prev = seq


def run(member_pid: int, timeout: float) -> int:
    fd = sys.stdin.fileno()
    last = time.monotonic()
    while True:
        readable, _, _ = select.select([fd], [], [], min(1.0, timeout))
        now = time.monotonic()
        if readable:
            if not os.read(fd, 4096):
                return 0  # the member exited (closed its end)
            last = now
        if os.getppid() != member_pid:
            return 0  # the member is gone; something else holds the pipe open
        if now - last >= timeout:
            print(
                f"watchdog: member pid {member_pid} made no progress for {now - last:.1f} s "
                f"(limit {timeout:g} s): killing it so that it cannot hold the cluster back",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(member_pid, signal.SIGKILL)
            return 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the member decides when we go, not ^C
    sys.exit(run(int(sys.argv[1]), float(sys.argv[2])))

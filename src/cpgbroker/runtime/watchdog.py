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
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time


def spawn(timeout: float) -> subprocess.Popen[bytes]:
    """Start the watchdog for this process; feed it with :func:`feed`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpgbroker.runtime.watchdog", str(os.getpid()), str(timeout)],
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

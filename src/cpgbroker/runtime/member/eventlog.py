"""A member's event log (``[cluster] event_log``: one JSON object per line, read by the audit
job and by tests; docs/operations.md, "Event log") and the faults a test may inject
(``[cluster] fault_injection``, ``POST /faults``).

A failed write is not raised: it is kept (:attr:`EventLog.failed`) and the member acts on it
after the event being recorded, in an error-check round (the others may have recorded it).

Owns: the log file, the first failed write, the injected faults. Never applies events or
decides anything: the member asks it whether a fault is due and what failed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from typing import IO, Any

from cpgbroker.errors import ClusterError
from cpgbroker.model import EVENT_TYPES

log = logging.getLogger("cpgbroker.member")

# The kinds of fault a test can inject: fail while applying event N, find the disk full when
# recording event N and after, or take ``seconds`` of CPU time to apply event N (an event
# every member is slow in, when injected on every member: see runtime/member/watchdog.py).
FAULT_KINDS = ("apply-error", "disk-full", "slow-apply")
# The longest slow-apply a test may ask for.
SLOW_APPLY_MAX = 600.0

# Event log record types of model events (other event classes log under their class name).
TYPE_NAMES = {t.cls.__name__: t.name for t in EVENT_TYPES}


class InjectedFault(Exception):
    """A failure a test asked for (``POST /faults``): stands for an unexpected exception."""


class EventLog:
    def __init__(self, path: str, member: int, incarnation: int) -> None:
        # Every incarnation of this process has the same member id and appends to the same
        # event log, its sequence numbers starting again at its update point: the log tells
        # them apart by this number (the audit checks each incarnation's own stream).
        self.member = member
        self.incarnation = incarnation
        self.file: IO[str] | None = None
        if path:
            self.file = open(path, "a", buffering=1 << 16)  # noqa: SIM115
        # A write failed: why. The member checks it after every event.
        self.failed: OSError | None = None
        # Injected faults, kind -> the event seq they fire at (tests only). The member tests
        # ``faults`` before asking anything else, so the hot path pays one truth test.
        self.faults: dict[str, int] = {}
        # How long the injected slow-apply takes.
        self.slow_seconds = 0.0

    def write(self, rec: dict[str, Any]) -> None:
        if self.file is not None and self.failed is None:
            rec.setdefault("member", self.member)
            rec.setdefault("incarnation", self.incarnation)
            rec.setdefault("t_ns", time.time_ns())
            try:
                self.file.write(json.dumps(rec, separators=(",", ":")) + "\n")
            except OSError as e:
                # Acted on after the event being applied (an error-check round): the others
                # may have recorded it.
                self.failed = e

    def event(
        self, seq: int, kind: str, sender: int, conn: int | None, size: int, **extra: Any
    ) -> None:
        """Record stream event ``seq`` (the event log must be open)."""
        rec: dict[str, Any] = {
            "seq": seq,
            "t_ns": time.time_ns(),
            "member": self.member,
            "sender": sender,
            "type": kind,
        }
        if conn is not None:
            rec["conn"] = conn
        if size:
            rec["size"] = size
        rec.update(extra)
        self.write(rec)

    def record(self, seq: int, e: Any, sender: int, size: int) -> OSError | None:
        """Record applied model event ``seq`` (``size``: its client bytes, if any); what
        failed, if the record could not be written."""
        if self.faults and self.fault_due("disk-full", seq):
            self.failed = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        else:
            name = type(e).__name__
            self.event(seq, TYPE_NAMES.get(name, name), sender, getattr(e, "conn", None), size)
        return self.failed

    def fault_due(self, kind: str, seq: int) -> bool:
        """Whether an injected fault of ``kind`` fires at event ``seq``."""
        at = self.faults.get(kind)
        return at is not None and seq >= at

    def take_fault(self, kind: str, seq: int) -> bool:
        """A one-shot fault of ``kind`` fires at event ``seq``: True once."""
        if self.fault_due(kind, seq):
            del self.faults[kind]
            return True
        return False

    def before_apply(self, seq: int) -> None:
        """Called before applying event ``seq`` while faults are injected: raise the injected
        apply-error, or spend the injected slow-apply's time (on the CPU, as a slow event
        does: a sleep would look like a hung member to the watchdog)."""
        if self.take_fault("apply-error", seq):
            raise InjectedFault("injected failure")
        if self.take_fault("slow-apply", seq):
            log.warning("injected slow apply of event %s: %g s", seq, self.slow_seconds)
            # Measured in this thread's CPU time, as a costly event is: the same computation
            # on every member, however busy each machine is.
            end = time.thread_time() + self.slow_seconds
            while time.thread_time() < end:
                pass

    def inject(self, kind: str, at_seq: int, next_seq: int, seconds: float = 0.0) -> dict[str, Any]:
        """Fail at event ``at_seq``, or at ``next_seq`` (the next event) if that is passed;
        ``seconds``: how long a slow-apply takes."""
        if kind not in FAULT_KINDS:
            raise ClusterError(f"unknown fault kind {kind!r} (known: {', '.join(FAULT_KINDS)})")
        if kind == "disk-full" and self.file is None:
            raise ClusterError("this member records nothing per event (no [cluster] event_log)")
        if kind == "slow-apply" and not 0 < seconds <= SLOW_APPLY_MAX:
            raise ClusterError(f"a slow-apply takes 0 < seconds <= {SLOW_APPLY_MAX:g}")
        at_seq = max(at_seq, next_seq)
        self.faults[kind] = at_seq
        out: dict[str, Any] = {"kind": kind, "at_seq": at_seq}
        if kind == "slow-apply":
            self.slow_seconds = out["seconds"] = seconds
        log.warning("fault injected kind=%s at_seq=%s", kind, at_seq)
        return out

    def give_up(self) -> None:
        """The cluster decided that a failed write is everyone's: the log is closed, and the
        member goes on without it."""
        self.close()
        self.faults.pop("disk-full", None)
        self.failed = None

    def flush(self) -> None:
        """Hand what is buffered to the OS (the member does every tick, so a kill -9 loses at
        most one tick's records)."""
        if self.file is not None and self.failed is None:
            try:
                self.file.flush()
            except OSError as e:
                self.failed = e

    def close(self) -> None:
        f, self.file = self.file, None
        if f is not None:
            with contextlib.suppress(OSError):  # a full disk: what it could not flush is lost
                f.close()

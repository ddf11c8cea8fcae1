"""Applying one event of the stream, and what follows each applied event.

:class:`Applier` applies an event the member routed to the model: it asks the replication
mode whether the stream broker takes it, applies it (marking it for the watchdog, sampling how
long it takes), hands the effects to the clients' side, adopts a model version the event
raised, and then records it (the store's journal, the event log), sends this member's progress
report when one is due and takes a digest checkpoint when one is due. An exception while
applying, or a failed write, is not this member's to judge: it goes to the error-check rounds
(``runtime/member/errorcheck_rounds.py``), which decide with the cluster.

It owns the sample of apply times and shares the watchdog's mark of the event being applied.
"""

from __future__ import annotations

import errno
import time
from typing import Any

from cpgbroker.model import RAISE_MODEL_VERSION
from cpgbroker.model.events import AdminCommand, Changes, ClientConnected, ClientData
from cpgbroker.runtime.amqp.server import AmqpServer
from cpgbroker.runtime.member.applytimes import APPLY_SAMPLE, ApplyTimes
from cpgbroker.runtime.member.checkpoints import Checkpointer
from cpgbroker.runtime.member.errorcheck_rounds import ErrorChecks
from cpgbroker.runtime.member.eventlog import EventLog
from cpgbroker.runtime.member.stream import Service, Stream
from cpgbroker.runtime.member.watchdog import ApplyMark
from cpgbroker.runtime.replication.modes import Replication
from cpgbroker.runtime.ring.multicast import Multicaster
from cpgbroker.runtime.update.giving import Updater


class Applier:
    """Applies the stream's events to the stream broker, and records and reports them."""

    def __init__(
        self,
        stream: Stream,
        service: Service,
        *,
        replication: Replication,
        io: AmqpServer,
        eventlog: EventLog,
        updater: Updater,
        multicast: Multicaster,
        checkpoints: Checkpointer,
        errorchecks: ErrorChecks,
        mark: ApplyMark,
    ) -> None:
        self.me = stream.me
        self._stream = stream
        self._service = service
        self._replication = replication
        self._io = io
        self._eventlog = eventlog
        self._updater = updater
        self._multicast = multicast
        self._checkpoints = checkpoints
        self._errorchecks = errorchecks
        # The event being applied, for the watchdog's feeder thread (runtime/member/watchdog.py).
        self.mark = mark
        # A sample of how long events take to apply (runtime/member/applytimes.py).
        self.times = ApplyTimes()

    def apply(self, e: Any, sender: int) -> None:
        """Apply one event of the stream. An exception here is an error the stream does not
        explain (the same event applies cleanly elsewhere, or everywhere fails alike): the
        cluster decides in an error-check round."""
        raising = type(e) is AdminCommand and e.op == RAISE_MODEL_VERSION
        replication = self._replication
        stream = self._stream
        if not replication.takes(e, sender, stream.membership):
            return
        broker = stream.broker
        seq = broker.event_seq + 1
        mark = self.mark
        mark.seq = seq
        try:
            events = self._eventlog
            if events.faults:
                events.before_apply(seq)
            # A suspended member's model is about to be discarded: nothing more reaches
            # clients.
            if self._service.suspended is None:
                if seq & (APPLY_SAMPLE - 1):
                    self._io.execute(broker.apply(e))
                else:
                    started = time.perf_counter()
                    effects = broker.apply(e)
                    self.times.observe(time.perf_counter() - started)
                    self._io.execute(effects)
        except Exception as exc:
            mark.seq = 0
            # Counted as applied either way: the members that continue agree on the count.
            broker.count_failed_event(seq)
            self._errorchecks.local_error(
                seq, f"apply-error: {type(exc).__name__}", str(exc), e, sender
            )
            return
        mark.seq = 0
        # (Shipping changes, a change batch carries the primary's version:
        # model/standby/replica.py.)
        if (
            raising or type(e) is Changes
        ) and broker.version.current != stream.membership.model_version:
            stream.set_version(broker.version.current)
        if type(e) is ClientConnected and e.member != self.me:
            broker.set_emit(e.conn, False)
        else:
            replication.applied(broker, sender, self._updater)
        self.after_apply(e, sender)

    def after_apply(self, e: Any, sender: int, failed: bool = False) -> None:
        """Record an applied (or, ``failed``, a failed) event, then report and digest."""
        if self._service.suspended is not None:
            # Not applied (see apply): nothing to log, report or digest.
            return
        stream = self._stream
        store = stream.store
        if store is not None:
            seq = stream.broker.event_seq
            err = store.record(seq, e, stream.broker, failed)
            if err is not None:
                # The store could not write (or fsync) an event: it can no longer vouch for
                # what this member applies. Whether the member may go on is the cluster's call
                # (a disk that fails alone makes its member leave).
                name = errno.errorcode.get(err.errno or 0, "EIO")
                self._errorchecks.local_error(seq, f"store-write: {name}", str(err), e, sender)
                return
        events = self._eventlog
        if events.file is not None:
            seq = stream.broker.event_seq
            err = events.record(seq, e, sender, len(e.data) if type(e) is ClientData else 0)
            if err is not None:
                # This member could not record the event: the others may have. Whether it
                # may go on is the cluster's call.
                name = errno.errorcode.get(err.errno or 0, "EIO")
                self._errorchecks.local_error(seq, f"store-write: {name}", str(err), e, sender)
                return
        self.report_and_digest()

    def report_and_digest(self) -> None:
        """After an event: what a round owes, our progress report and a digest checkpoint,
        each when due."""
        stream = self._stream
        seq = stream.broker.event_seq
        if stream.stall.owed:
            self._errorchecks.pay_owed(seq)
        if seq % stream.progress.every == 0:
            self._multicast.send_control(stream.progress_report(seq))
        checkpoints = self._checkpoints
        if seq % checkpoints.every == 0 and not stream.broker.replication.catching_up:
            # (A replica's state update from the back left out what consumers took while it
            # was sent, which the others still hold at checkpoints until the replay reaches
            # those takes: a newcomer vouches for its state once it has caught up.)
            checkpoints.take(seq, stream.broker)

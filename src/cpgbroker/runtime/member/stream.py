"""The member's place in the stream: the broker it applies events to, and how far it stands.

:class:`Stream` owns the broker the stream's events are applied to. It is the one thing every
other part of the member reads that changes under them: the broker is swapped when a newcomer
installs the state of its update point (:meth:`Stream.install`) and when a kept state is
resumed (:meth:`Stream.resume`), so the others ask the stream for it rather than keep one.
With it go the numbers that say how far this member and the others stand: the event applied
(before a failed one an error-check round holds), the event every ready member applied (what
held confirms wait for), the event this member's store holds, the event every store holds, the
lag that pushes back on publishers, and this member's progress report.

:class:`Service` owns whether this member serves: ready, suspended for good in this
incarnation, or failing (it must leave). Both are built before the member, by the process wing
(``runtime/process/assembly.py``), so that the other wings' parts can read them without a
reference to the member.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import attrs
import trio

from cpgbroker.cluster import codec
from cpgbroker.cluster.codec import Progress
from cpgbroker.cluster.errorcheck_stall import Stall
from cpgbroker.cluster.membership import Membership
from cpgbroker.cluster.progress import PeerProgress
from cpgbroker.model import Broker
from cpgbroker.model.events import AdminCommand
from cpgbroker.store.store import Store

log = logging.getLogger("cpgbroker.member")


@attrs.define(eq=False)
class Service:
    """Whether this member serves in this incarnation."""

    ready: trio.Event = attrs.Factory(trio.Event)
    # Set when this member stopped serving for good in this incarnation (quorum lost, or
    # merged back on the smaller side): why, for logs, clients and status.
    suspended: str | None = None
    # Set when this member must leave the cluster: why.
    failure: str | None = None

    @property
    def serving(self) -> bool:
        return self.ready.is_set() and self.suspended is None

    @property
    def stopped(self) -> bool:
        """Suspended or failing: nothing more of this incarnation reaches clients."""
        return self.suspended is not None or self.failure is not None


class Stream:
    """The broker the stream is applied to, and the numbers of how far every member stands."""

    def __init__(
        self,
        me: int,
        broker: Broker,
        membership: Membership,
        progress: PeerProgress,
        store: Store | None,
        store_quorum: int,
    ) -> None:
        self.me = me
        self.broker = broker
        broker.set_local_member(me)
        self.membership = membership
        self.progress = progress
        # This member's durable store (None: memory only). It journals every applied event.
        self.store = store
        # ``[store] recover_with = "majority"``: that many stores hold an event before the
        # confirms that wait for the stores go out (0: every ready member's).
        self.store_quorum = store_quorum
        # This member's side of error-check rounds: what it applied is what it vouches for.
        self.stall = Stall(me)

    # ------------------------------------------------------------------ the broker

    def event_seq(self) -> int:
        return self.broker.event_seq

    def install(
        self, broker: Broker, members: list[list[Any]], installed: Callable[[Broker], None]
    ) -> None:
        """A newcomer installs the state of its update point; ``installed`` is the replication
        mode's part, before the store replaces what it held."""
        self.broker = broker
        self.membership.model_version = broker.version.current
        broker.set_local_member(self.me)
        installed(broker)
        if self.store is not None:
            # Whatever the store held (older, or as fresh as the resumed member's state) is
            # replaced by what the cluster serves.
            self.store.replace(broker)
        self.membership.adopt(members)
        self.progress.estimate(self.membership.ready_members, broker.event_seq)

    def resume(self, broker: Broker) -> None:
        """Apply the stream to a kept state from here."""
        self.broker = broker
        broker.set_local_member(self.me)

    def set_version(self, version: int) -> None:
        """This member's state runs model ``version`` from here on."""
        before = self.broker.version.current
        self.broker.version.adopt(version)
        self.membership.model_version = version
        if self.store is not None:
            # Before the events of the new version are journaled: a release that cannot
            # apply them never recovers this store.
            self.store.set_model_version(version)
        if version != before:
            log.info(
                "model version %d (was %d) from event %d", version, before, self.broker.event_seq
            )

    def epoch(self) -> int:
        """The history epoch of this member's state (see cluster/membership.py)."""
        return 1 if self.store is None else self.store.epoch

    # ------------------------------------------------------------------ how far members stand

    def lag(self) -> int:
        """How many events the slowest ready member is behind this one, in applying them or
        in writing them to its store (a disk slower than the publishers pushes back too)."""
        seq = self.broker.event_seq
        lag = self.progress.lag(seq, self.membership.ready_members)
        if self.store is not None:
            lag = max(lag, seq - self.durable_seq())
        return lag

    def applied_seq(self) -> int:
        """The last event this member vouches for (before a failed one it is stalled at)."""
        return self.stall.applied(self.broker.event_seq)

    def stable_seq(self) -> int:
        """The highest event every ready member (this one included) is known to have
        applied: confirms for events up to it may go out."""
        return self.progress.stable(self.applied_seq(), self.membership.ready_members)

    def durable_seq(self) -> int:
        """The last event this member's store holds (all it applied, without a store)."""
        applied = self.applied_seq()
        store = self.store
        return applied if store is None else min(applied, store.durable)

    def durable_stable_seq(self) -> int:
        """The highest event every ready member's store is known to hold: confirms of
        persistent messages on durable queues up to it may go out."""
        return self.progress.durable_stable(
            self.durable_seq(), self.membership.ready_members, self.store_quorum
        )

    def stable_marks(
        self, stable: Callable[[int, int | None], tuple[int, int | None]]
    ) -> tuple[int, int | None]:
        """What held output waits for that every ready member applied, and (None: no store)
        stored: events, or (shipping changes) our batches, as the replication mode's
        ``stable`` says."""
        durable = None if self.store is None else self.durable_stable_seq()
        return stable(self.stable_seq(), durable)

    def report(self) -> bytes:
        """Our progress report as of now (at least the events that asked for it)."""
        return self.progress_report(self.applied_seq())

    def progress_report(self, seq: int) -> bytes:
        durable = self.durable_seq()
        self.progress.durable_reported = durable
        return codec.encode(Progress(self.me, seq, durable))


def admin_settled(
    stream: Stream, stable: Callable[[int, int | None], tuple[int, int | None]]
) -> int:
    """The highest event (or batch) whose changes an operator may be told are done."""
    applied, stored = stream.stable_marks(stable)
    return applied if stored is None else stored


def version_verdict(membership: Membership, e: AdminCommand) -> AdminCommand:
    """The operator's ``cluster upgrade-finish`` carries, from here on (the store journals it
    so, and a restart replays it so), whether every member applies the version it asks for:
    the membership at this point of the stream decides, alike on every member."""
    try:
        args = json.loads(e.args)
    except ValueError:
        return e  # the model answers 400
    if not isinstance(args, dict) or isinstance(args.get("refused"), str):
        return e
    version = args.get("version")
    if not isinstance(version, int):
        return e
    refused = membership.refuse_version(version)
    if refused is None:
        return e
    args["refused"] = refused
    return attrs.evolve(e, args=json.dumps(args).encode())

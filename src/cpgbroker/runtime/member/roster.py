"""Who is in the cluster, and what a change of it means for this member.

:class:`Roster` takes the stream's membership items (hellos, configuration changes, partition
merges) and carries out what ``cluster/membership.py`` decides of them (``_act``): say hello,
become ready, apply a membership event to the model, ask for a state update, resume a kept
state, start at the agreed model version, or leave. It owns the state a previous incarnation
kept (or the process recovered from its store) until it is resumed or given up, and the
partition merge verdicts (``cluster/merge.py``). It also lets the replication mode change roles
where the membership says the primary changed (``check_role``).

It applies nothing itself: a membership event for the model goes to the member's ``apply``
callable, and a state that can no longer be trusted to its ``resync`` callable, so that the
member keeps the order of things.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cpgbroker import __version__
from cpgbroker.cluster import codec
from cpgbroker.cluster.codec import STATUS_NAMES, STATUS_READY, Hello, software_label
from cpgbroker.cluster.membership import (
    NEEDS_UPDATE,
    READY,
    ApplyToModel,
    BecomeReady,
    Fatal,
    NeedUpdate,
    ResumeState,
    SendHello,
    StartAt,
    member_id,
)
from cpgbroker.cluster.merge import Partitions
from cpgbroker.corosync.events import ConfChg, PartitionMerge
from cpgbroker.errors import ClusterError
from cpgbroker.model import NEWEST, OLDEST, Broker
from cpgbroker.model.events import MemberLeft, Recovered, Tick
from cpgbroker.runtime.member.checkpoints import Checkpointer
from cpgbroker.runtime.member.errorcheck_rounds import ErrorChecks
from cpgbroker.runtime.member.eventlog import EventLog
from cpgbroker.runtime.member.stops import Stops
from cpgbroker.runtime.member.stream import Service, Stream
from cpgbroker.runtime.replication.modes import Replication
from cpgbroker.runtime.replication.standby import primary_of
from cpgbroker.runtime.ring.multicast import Multicaster
from cpgbroker.runtime.update.taking import Newcomer

log = logging.getLogger("cpgbroker.member")

# What this member announces in its hello: its release and the model versions it applies.
SOFTWARE = software_label(__version__, OLDEST, NEWEST)


class Roster:
    """This member's side of the membership: hellos, joins and leaves, merges, resuming."""

    def __init__(
        self,
        stream: Stream,
        service: Service,
        *,
        multicast: Multicaster,
        replication: Replication,
        newcomer: Newcomer,
        checkpoints: Checkpointer,
        errorchecks: ErrorChecks,
        stops: Stops,
        eventlog: EventLog,
        now_ms: Callable[[], int],
        kept: tuple[Broker, int] | None,
        restarted: bool,
        forced: bool,
        apply: Callable[[Any, int], None],
        resync: Callable[[str, str], None],
    ) -> None:
        """``apply(event, sender)``: apply a membership event to the model, as the member
        applies the stream's; ``resync(rejoin, leave)``: this member's state cannot be
        trusted."""
        self.me = stream.me
        self._stream = stream
        self._service = service
        self._membership = stream.membership
        self._multicast = multicast
        self._replication = replication
        self._newcomer = newcomer
        self._checkpoints = checkpoints
        self._errorchecks = errorchecks
        self._stops = stops
        self._eventlog = eventlog
        self._now_ms = now_ms
        self._apply = apply
        self._resync = resync
        # The model a previous incarnation held when quorum was lost, or the process recovered
        # from its store, with its history epoch: offered in our hellos, resumed only if no
        # member serves (the whole cluster lost quorum or stopped).
        self.kept = kept
        # The kept model was recovered from the store after the process (re)started: resuming
        # it drops what a broker restart drops (``Recovered``).
        self.restarted = restarted
        # A forced boot (``--force-boot``) does not wait for the other members' stores.
        self.forced = forced
        self.partitions = Partitions()

    def on_hello(self, e: Hello, sender: int) -> None:
        membership = self._membership
        was = membership.members.get(e.member)
        newly_ready = e.status == STATUS_READY and (was is None or was.status != STATUS_READY)
        self.act(membership.on_hello(e))
        if newly_ready:
            # A member that just caught up through an update: count its lag from here.
            self._stream.progress.newly_ready(e.member, self._stream.broker.event_seq)
        if self._eventlog.file is not None:
            self._eventlog.event(
                self._stream.broker.event_seq,
                "hello",
                sender,
                None,
                0,
                status=STATUS_NAMES.get(e.status, "?"),
            )
        if membership.state == NEEDS_UPDATE and self._newcomer.attempt is None:
            self._newcomer.request()
        self.check_role()

    def on_confchg(self, ev: ConfChg) -> None:
        members, joined, left = self.partitions.view(ev)
        self._stream.progress.forget(left)
        for m in ev.left:
            log.warning(
                "member left member=%s node=%s pid=%s reason=%s",
                member_id(m.nodeid, m.pid),
                m.nodeid,
                m.pid,
                m.reason.name,
            )
        for m in ev.joined:
            log.info("member joined node=%s pid=%s", m.nodeid, m.pid)
        membership = self._membership
        self.act(membership.on_confchg(members, joined, left))
        self._newcomer.members_left(left)
        if left and membership.state == READY:
            self._checkpoints.members_changed(membership.ready_members)
            self._errorchecks.members_left(left)
        self.check_role()
        # (After the quorum gate: a ring change reaches here only once known quorate.)
        self._kept_in_cluster()

    def on_ring_reformed(self) -> None:
        """The ring re-formed with the same members and no one left or joined the group (a
        member cut off would have seen the others leave and come back, and lost the merge
        before this): nobody moved on without us, as a membership change that keeps us
        would say (runtime/member/lease.py)."""
        self._kept_in_cluster()

    def _kept_in_cluster(self) -> None:
        """The ring's verdict keeps this member in the cluster: a lapsed lease is renewed."""
        if not self._service.stopped:
            self._replication.membership_changed(self._primary_here)

    def check_role(self) -> None:
        """The replication mode may change roles here (shipping changes: become primary when
        the stream says so, at the same point on every member, or stop serving)."""
        if self._service.stopped:
            return
        self._replication.check_role(self._primary_here, self._stream.broker)

    def _primary_here(self) -> bool:
        """Whether the stream makes this member the hot-standby primary now."""
        membership = self._membership
        primary = primary_of(membership)
        return (
            membership.state == READY
            and self._service.ready.is_set()
            and self._stops.halted is None
            and primary is not None
            and primary.member == self.me
        )

    def on_partition_merge(self, ev: PartitionMerge) -> None:
        """Two sides of a partition merged: neither saw what the other applied meanwhile.
        The side with more members keeps serving (on a tie, the side holding the lowest member
        id); the other side's members leave, and until they are gone nothing they send is
        applied. Both sides reach the same verdict: each knows both sides' members."""
        wins, others = self.partitions.on_merge(ev, self._membership.members)
        if wins:
            log.error(
                "partition healed: members %s come back from another partition with diverged "
                "state; ignoring them until they leave",
                others,
            )
            self._membership.forget(others)
            return
        self.lose_merge(others)

    def lose_merge(self, others: list[int]) -> None:
        reason = (
            "this member was partitioned from the cluster and merged back on the smaller side: "
            "it missed events the others applied, so its state cannot be trusted"
        )
        # With quorum it has not served since the split; it resynchronises instead.
        self._resync(
            f"{reason}; rejoining through a state update (other side: {others})",
            f"{reason}; leaving (other side: {others})",
        )

    def act(self, actions: list[Any]) -> None:
        """Carry out what the membership decided."""
        stream, membership = self._stream, self._membership
        for a in actions:
            t = type(a)
            if t is SendHello:
                kept = self.kept
                self._multicast.send_control(
                    codec.encode(
                        Hello(
                            self.me,
                            a.status,
                            membership.model_version,
                            membership.config_digest,
                            membership.url,
                            SOFTWARE,
                            self._now_ms(),
                            0 if kept is None else kept[1],
                            0 if kept is None else kept[0].event_seq,
                        )
                    )
                )
            elif t is BecomeReady:
                # Every member becomes ready at this same event: that is where each of them
                # stands until it reports more (a member that never reports is then seen to lag).
                stream.progress.estimate(membership.ready_members, stream.broker.event_seq)
                log.info(
                    "cluster ready members=%d clock_master=%s",
                    len(membership.members),
                    membership.clock_master,
                )
                self._service.ready.set()
                self.check_role()
            elif t is ApplyToModel:
                if self._stops.halted is not None:
                    continue
                store = stream.store
                if store is not None and store.next_seq != stream.broker.event_seq + 1:
                    # Starting from a state the store does not hold (a fresh start while the
                    # store kept a discarded state): it holds this one from here.
                    store.replace(stream.broker)
                if stream.stall.stalled is not None:
                    stream.stall.hold(a.event, 0)
                    continue
                self._apply(a.event, 0)
            elif t is NeedUpdate:
                log.info("%s", a.reason)
                self.kept = None
                self._newcomer.request()
            elif t is ResumeState:
                self._resume(a.start_ms)
            elif t is StartAt:
                # The empty state every starting member holds: it starts at the version they
                # agreed, before the first event.
                stream.set_version(a.version)
            elif t is Fatal:
                raise ClusterError(a.reason)

    def _resume(self, start_ms: int) -> None:
        """Serve again with the state kept when the whole cluster lost quorum.

        Its connections are all from before the split (no client event precedes this point),
        so each of their members is treated as gone: connections closed, unacked messages
        requeued. Nobody else has a model yet: they take updates after this point.
        """
        assert self.kept is not None
        broker, epoch = self.kept
        self.kept = None
        self._stream.resume(broker)
        stale = sorted({codec.split_conn(c)[0] for c in broker.connections})
        log.warning(
            "resuming the state %s: epoch %s, event %s, closing the connections of %d former "
            "members",
            "recovered from the store" if self.restarted else "kept since quorum was lost",
            epoch,
            broker.event_seq,
            len(stale),
        )
        store = self._stream.store
        if self.forced and store is not None:
            # The history goes on from here without the members that did not come: a new
            # epoch, so that it wins over their stores even where they hold more events.
            epoch = store.new_epoch()
            log.warning(
                "FORCED BOOT: serving from this member's store alone (now epoch %d, event %d); "
                "the other members' stores will be replaced by state updates when they join, "
                "even if they held confirmed messages this one lacks",
                epoch,
                broker.event_seq,
            )
        self.act([ApplyToModel(MemberLeft(m)) for m in stale])
        if self.restarted:
            # After a restart, what AMQP does not keep across one goes (the unacked messages
            # of the closed connections are back in their queues, marked redelivered).
            self.act([ApplyToModel(Recovered())])
        self.act([ApplyToModel(Tick(max(start_ms, broker.now_ms)))])

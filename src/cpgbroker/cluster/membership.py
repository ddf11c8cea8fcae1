"""Cluster membership as every member sees it in the CPG stream (pure: no I/O).

Theory of operation
-------------------
Every member feeds this class the same ordered stream: CPG configuration changes and the
``Hello`` events members multicast. Decisions are made *at* a point of that stream, so every
member makes the same decision at the same point.

* On joining, a member multicasts ``Hello(status=new)``. Members already serving answer every
  join with ``Hello(status=ready)``.
* Start-up: members that are all new become ready together at the event where the last of at
  least ``size`` members' hellos is delivered. They all start from the empty initial state and
  no client event precedes that point, so their states are equal. Cluster time starts there at
  the latest clock any hello carried (a ``Tick`` applied before any client event).
* A newcomer that hears a ready member's hello needs a state update (``NeedUpdate``); one that
  hears an incompatible hello (another model version or configuration) is refused (``Fatal``).
  The update carries the updater's view of the membership at the update point
  (:meth:`Membership.export`), which the newcomer adopts (:meth:`Membership.adopt`) before it
  replays the events delivered after that point; once caught up it says ``Hello(ready)``, and
  every member (the newcomer too) counts it as serving from where that hello is delivered.
* After the whole cluster lost quorum, or every member stopped, nobody serves, so nobody moved
  on: members rejoin as new members and say in their hello which state they kept in memory or
  recovered from their store (:class:`Hello` ``recover_*``). At the start-up point the member
  holding the freshest state (latest history epoch, then most events, then lowest id) resumes
  serving with it (``ResumeState``) and every other member
  takes a state update from it; without any kept state they start empty as at first start-up.
* A member leaving (CPG confchg) becomes ``MemberLeft`` for the model, so every replica closes
  its clients' shadow connections at that point, followed by the new member list.
* The clock master, which multicasts cluster time, is the ready member with the lowest member
  id. CPG membership does not say who is eldest, and a newcomer could not know before its
  update; the lowest id is a choice every member computes alike, and a successor takes over the
  moment the master's departure is delivered.
"""

from __future__ import annotations

from typing import Any

import attrs

from cpgbroker.cluster.codec import STATUS_NEW, STATUS_READY, Hello, software_range
from cpgbroker.model.events import ClusterMembers, MemberLeft, Tick

JOINING = "joining"
READY = "ready"
NEEDS_UPDATE = "needs-update"
FAILED = "failed"


@attrs.frozen
class SendHello:
    status: int


@attrs.frozen
class BecomeReady:
    """This member starts serving clients now."""


@attrs.frozen
class ApplyToModel:
    event: Any


@attrs.frozen
class NeedUpdate:
    """The cluster already serves: this member must receive a state update before serving."""

    reason: str


@attrs.frozen
class Fatal:
    reason: str


@attrs.frozen
class StartAt:
    """The members starting a cluster afresh start their empty state at model ``version``."""

    version: int


@attrs.frozen
class ResumeState:
    """This member resumes the state it kept when quorum was lost (then :class:`BecomeReady`);
    cluster time goes on from ``start_ms`` at the earliest."""

    start_ms: int


Action = SendHello | BecomeReady | ApplyToModel | NeedUpdate | Fatal | ResumeState | StartAt


def member_id(nodeid: int, pid: int) -> int:
    """Unique among live members: corosync identifies a group member by (nodeid, pid)."""
    return (nodeid << 22) | (pid & 0x3FFFFF)


@attrs.define(eq=False)
class MemberInfo:
    member: int
    status: int | None = None
    url: str = ""
    software: str = ""
    now_ms: int = 0
    recover_epoch: int = 0
    recover_seq: int = 0
    # The model versions it applies (lowest, highest): from its hello (codec.software_range).
    versions: tuple[int, int] = (0, 0)
    # The model version of its state, as its last hello said.
    model_version: int = 0


class Membership:
    def __init__(
        self,
        me: int,
        size: int,
        model_version: int,
        config_digest: bytes,
        url: str,
        recover_quorum: int = 0,
        supported: tuple[int, int] | None = None,
    ) -> None:
        self.me = me
        self.size = size
        # When some member offers kept state, this many members suffice to decide whose is
        # resumed (``[store] recover_with = "majority"``); 0: ``size``.
        self.recover_quorum = recover_quorum
        # The model version of this member's state: the cluster's once ready; before, that of
        # the state it kept, or (none kept) the lowest it applies, which is what it announces,
        # so that members of a release applying only that version accept it.
        self.model_version = model_version
        # The model versions this software applies (model/versions.py).
        self.supported = supported or (model_version, model_version)
        self.config_digest = config_digest
        self.url = url
        self.state = JOINING
        # Current CPG members: the members that started the cluster in id order, then the
        # others in the order the stream revealed them, except that a member that becomes ready
        # after the others goes to the end (the same on every ready member).
        self.members: dict[int, MemberInfo] = {}
        self.joined = False

    # -- queries
    @property
    def ready_members(self) -> list[int]:
        return sorted(m for m, i in self.members.items() if i.status == STATUS_READY)

    @property
    def clock_master(self) -> int | None:
        ready = self.ready_members
        return ready[0] if ready else None

    def export(self) -> list[list[Any]]:
        """This view of the members (what a newcomer adopts with its state update)."""
        return [
            [i.member, -1 if i.status is None else i.status, i.url, i.software, i.now_ms]
            for i in self.members.values()
        ]

    def adopt(self, rows: list[list[Any]]) -> None:
        """Take over an updater's view at the update point: from there on this member follows
        the stream exactly as the members that were there from the start."""
        v = self.model_version  # the updater's state's, installed before
        self.members = {}
        for r in rows:
            info = MemberInfo(r[0], None if r[1] < 0 else r[1], r[2], r[3], r[4])
            # The rows keep their format (a release before 0.2.0 reads them): the versions a
            # member applies come from its software, as from its hello.
            info.versions = software_range(Hello(r[0], 0, v, b"", r[2], r[3]))
            info.model_version = v
            self.members[r[0]] = info
        self.members.setdefault(self.me, MemberInfo(self.me, STATUS_NEW, self.url))
        self.members[self.me].versions = self.supported
        self.members[self.me].model_version = v
        self.joined = True
        self.state = READY

    def forget(self, members: list[int]) -> None:
        """Members that came back from the other side of a partition we won: not members
        (they are ignored until CPG reports them gone)."""
        for m in members:
            self.members.pop(m, None)

    def urls(self) -> tuple[str, ...]:
        return tuple(
            self.members[m].url
            for m in sorted(self.members)
            if self.members[m].url and self.members[m].status == STATUS_READY
        )

    # -- stream input
    def on_confchg(self, members: list[int], joined: list[int], left: list[int]) -> list[Action]:
        actions: list[Action] = []
        if not self.joined:
            if self.me not in joined:
                return actions
            self.joined = True
        for m in left:
            info = self.members.pop(m, None)
            if info is not None and self.state == READY and info.status == STATUS_READY:
                actions.append(ApplyToModel(MemberLeft(m)))
        for m in list(self.members):
            if m not in members:
                del self.members[m]
        for m in members:
            self.members.setdefault(m, MemberInfo(m))
        if left and self.state == READY:
            actions.append(ApplyToModel(ClusterMembers(self.urls())))
        if self.state == READY:
            if joined:
                # Tell the newcomers this cluster already serves.
                actions.append(SendHello(STATUS_READY))
        elif self.state == JOINING:
            # Hellos sent before this configuration were not seen by members that just
            # joined: every joining member announces itself again, and readiness is decided
            # only on announcements made in this configuration, which all members see at the
            # same points of the stream.
            for info in self.members.values():
                if info.status != STATUS_READY:
                    info.status = None
            actions.append(SendHello(STATUS_NEW))
        return actions

    def on_hello(self, h: Hello) -> list[Action]:
        info = self.members.get(h.member)
        if info is None or not self.joined:
            return []  # from a member that already left, or before our own join
        versions = software_range(h)
        if h.member != self.me and (
            h.config_digest != self.config_digest or not self._compatible(h, versions)
        ):
            if self.state == JOINING and h.status == STATUS_READY:
                self.state = FAILED
                return [Fatal(self._refusal(h))]
            # An incompatible newcomer: it refuses itself; never count it as a member.
            info.status = None
            return []
        info.versions = versions
        info.model_version = h.model_version
        if self.state == JOINING and h.status == STATUS_READY and h.member != self.me:
            # The cluster's version: this member's from its state update on.
            self.model_version = h.model_version
        info.url = h.url
        info.software = h.software
        info.now_ms = h.now_ms
        info.recover_epoch = h.recover_epoch
        info.recover_seq = h.recover_seq
        if self.state == READY:
            if h.status == STATUS_READY and info.status != STATUS_READY:
                # A member that caught up through a state update starts serving here: its URL
                # joins the list clients fail over to, at the same point on every member. It
                # moves to the end of the order, so the ready members stand in the order they
                # became ready: the first is the one that has served longest (the hot-standby
                # primary, runtime/replication/standby.py), and one that comes back never displaces
                # it.
                info.status = STATUS_READY
                self.members[h.member] = self.members.pop(h.member)
                acts: list[Action] = [ApplyToModel(ClusterMembers(self.urls()))]
                if h.member == self.me:
                    acts.append(BecomeReady())
                return acts
            if info.status is None:
                info.status = h.status
            return []
        if h.member == self.me:
            if info.status is None:
                info.status = h.status
            return self._maybe_ready() if self.state == JOINING else []
        if h.status == STATUS_READY:
            info.status = STATUS_READY
            if self.state == JOINING:
                self.state = NEEDS_UPDATE
                return [
                    NeedUpdate(
                        f"member {h.member} already serves clients; this member has no state "
                        "and needs a state update"
                    )
                ]
            return []
        if info.status is None:
            info.status = STATUS_NEW
        return self._maybe_ready() if self.state == JOINING else []

    def _compatible(self, h: Hello, versions: tuple[int, int]) -> bool:
        """Whether the sender of ``h`` and this member can share one model version."""
        lo, hi = versions
        if self.state == READY:
            # A newcomer applies what the cluster runs, or refuses itself. A serving member's
            # hello sent before the cluster moved up may arrive after: its range still holds.
            return lo <= self.model_version <= hi
        if h.status == STATUS_READY:
            return self.supported[0] <= h.model_version <= self.supported[1]
        # Members starting (or restarting) together: some version both apply.
        return max(lo, self.supported[0]) <= min(hi, self.supported[1])

    def _refusal(self, h: Hello) -> str:
        """Why this member cannot join the cluster that ``h``'s sender serves."""
        if h.config_digest != self.config_digest:
            return (
                "the running cluster has a different configuration (users, vhosts, limits or "
                "cluster name); a member must run the same configuration as the cluster it joins"
            )
        lo, hi = self.supported
        v = h.model_version
        what = (
            f"start this member with a release that applies model version {v} (its software "
            f"says: {h.software})"
            if v > hi
            else "this release no longer applies that version: upgrade through a release that "
            f"applies both model versions {v} and {lo} first"
        )
        return (
            f"the running cluster runs model version {v}; this member's software applies model "
            f"versions {lo} to {hi}: {what}"
        )

    def refuse_version(self, version: int) -> str | None:
        """Why the cluster cannot move to model ``version`` now (None: it can): every member
        that announced itself must apply it. Decided at a point of the stream, so alike on
        every member (the operator's ``cluster upgrade-finish``, model/operators/admin.py)."""
        if version < self.model_version:
            return (
                f"the cluster runs model version {self.model_version}: model versions only move up"
            )
        unannounced = [i.member for i in self.members.values() if i.status is None]
        if unannounced:
            # Joined but not (yet, or not acceptably) announced: its release is unknown, and
            # it may have heard a serving member's hello of the version we would leave.
            return (
                f"member(s) {', '.join(map(str, unannounced))} joined the group but did not "
                "announce a release this cluster accepts yet; try again once every member "
                "serves (cpgbroker status)"
            )
        behind = [
            f"member {i.member} ({i.software or 'unknown software'}: model versions "
            f"{i.versions[0]} to {i.versions[1]})"
            for i in self.members.values()
            if not i.versions[0] <= version <= i.versions[1]
        ]
        if behind:
            return (
                f"not every member applies model version {version}: "
                + ", ".join(behind)
                + "; upgrade those members first"
            )
        return None

    def upgrade_status(self) -> dict[str, Any]:
        """Where the cluster stands in an upgrade: the model version it runs, the newest every
        member applies (``cluster upgrade-finish`` moves it there), and the releases its
        members run (more than one: members are being replaced)."""
        known = [i for i in self.members.values() if i.status is not None]
        newest = min((i.versions[1] for i in known), default=self.model_version)
        return {
            "model_version": self.model_version,
            "newest_all_apply": newest,
            "releases": sorted({i.software for i in known if i.software}),
            "pending": newest > self.model_version,
        }

    def _maybe_ready(self) -> list[Action]:
        need = self.size
        if self.recover_quorum and any(i.recover_epoch for i in self.members.values()):
            need = min(need, self.recover_quorum)
        if len(self.members) < need:
            return []
        if any(i.status != STATUS_NEW for i in self.members.values()):
            return []
        start = max(i.now_ms for i in self.members.values())
        best = max(self.members.values(), key=lambda i: (i.recover_epoch, i.recover_seq, -i.member))
        if best.recover_epoch:
            # Every member lost quorum or stopped, so none moved on; resume the freshest state
            # kept in memory or recovered from a store.
            best.status = STATUS_READY
            resumed = best.model_version
            if not self.supported[0] <= resumed <= self.supported[1]:
                self.state = FAILED
                return [
                    Fatal(
                        f"member {best.member} resumes the freshest kept state, at model version "
                        f"{resumed}; this member's software applies model versions "
                        f"{self.supported[0]} to {self.supported[1]}: start it with a release "
                        f"that applies model version {resumed}"
                    )
                ]
            self.model_version = resumed
            if best.member == self.me:
                self.state = READY
                return [
                    ResumeState(start),
                    BecomeReady(),
                    ApplyToModel(ClusterMembers(self.urls())),
                ]
            self.state = NEEDS_UPDATE
            mine = self.members[self.me]
            kept = f"its own kept state (epoch {mine.recover_epoch}, event {mine.recover_seq})"
            if not mine.recover_epoch:
                own = "it has no kept state"
            elif (mine.recover_epoch, mine.recover_seq) == (best.recover_epoch, best.recover_seq):
                # Not older: the same point of the same history; of equals, the lowest id resumes.
                own = (
                    f"{kept} is just as fresh (of equals the lowest member id resumes) and is "
                    "replaced"
                )
            elif mine.recover_epoch < best.recover_epoch:
                # It may hold more events, but of a history a forced boot left behind.
                own = f"{kept} is of an earlier history epoch and is replaced"
            else:
                own = f"{kept} is older and is replaced"
            return [
                NeedUpdate(
                    f"member {best.member} resumes the freshest kept state (epoch "
                    f"{best.recover_epoch}, event {best.recover_seq}); this member takes a state "
                    f"update from it: {own}"
                )
            ]
        # A new cluster runs the newest model version all its members apply (a cluster of a
        # new release starts with all its behaviour; one with an older member, at its version).
        newest = min(i.versions[1] for i in self.members.values())
        if newest < max(i.versions[0] for i in self.members.values()):
            self.state = FAILED
            return [
                Fatal(
                    "the members starting this cluster share no model version: "
                    + ", ".join(
                        f"member {i.member} applies {i.versions[0]} to {i.versions[1]}"
                        for i in self.members.values()
                    )
                )
            ]
        self.model_version = newest
        for i in self.members.values():
            i.status = STATUS_READY
        # Members that joined at different moments saw the others revealed in different
        # orders; the members that start a cluster together stand in id order (the same on
        # every member), so its first hot-standby primary is the lowest id.
        self.members = dict(sorted(self.members.items()))
        self.state = READY
        return [
            StartAt(newest),
            ApplyToModel(Tick(start)),
            BecomeReady(),
            ApplyToModel(ClusterMembers(self.urls())),
        ]

"""Every kind of model event, described once: the numbers it travels under and since when.

A model event (what :meth:`~cpgbroker.model.broker.Broker.apply` takes) is written in two
formats: multicast in a CPG batch (``cluster/codec.py``) and journaled in a member's store
(``store/records.py``). Both codecs take the type numbers from this table, the event log its
record names, and ``tests/unit/test_eventtypes.py`` walks every type through both: a kind of
event added here is in both formats or the test says which it lacks.

The numbers are frozen: a journal or a CPG batch of an older release is read with them (and
release 0.1.0's members read ours), so the two tables keep their historical numbering, which
differs (``DiskAlarm`` is 7 on the wire and 10 in the journal). ``since`` is the model version
that introduced the kind: a kind newer than a cluster's effective version is never multicast
or journaled there (a member of an older release could not read it).
"""

from __future__ import annotations

import attrs

from cpgbroker.model.events import (
    AdminCommand,
    Changes,
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    ClusterMembers,
    DiskAlarm,
    DoOutput,
    Forward,
    MemberLeft,
    Recovered,
    Tick,
)
from cpgbroker.model.versions import OLDEST


@attrs.frozen
class EventType:
    cls: type
    # The event log's record type (runtime/member/eventlog.py, docs/audit.md).
    name: str
    # Its type byte in the store's journal (store/records.py).
    journal: int
    # Its type byte in a CPG batch (cluster/codec.py); None: never multicast, each member
    # applies it on its own at the same point of the stream (membership changes, a restart).
    cpg: int | None
    # The model version that introduced it.
    since: int = OLDEST


EVENT_TYPES: tuple[EventType, ...] = (
    EventType(ClientData, "data", journal=1, cpg=1),
    EventType(ClientConnected, "connect", journal=2, cpg=2),
    EventType(ClientDisconnected, "disconnect", journal=3, cpg=3),
    EventType(DoOutput, "do-output", journal=4, cpg=4),
    EventType(CloseClient, "close-client", journal=5, cpg=5),
    EventType(Tick, "tick", journal=6, cpg=6),
    EventType(MemberLeft, "member-left", journal=7, cpg=None),
    EventType(ClusterMembers, "members", journal=8, cpg=None),
    EventType(Recovered, "recovered", journal=9, cpg=None),
    EventType(DiskAlarm, "disk-alarm", journal=10, cpg=7),
    EventType(AdminCommand, "admin", journal=11, cpg=16),
    EventType(Forward, "forward", journal=12, cpg=17),
    EventType(Changes, "changes", journal=13, cpg=18),
)

BY_CLASS: dict[type, EventType] = {t.cls: t for t in EVENT_TYPES}


def journal_type(cls: type) -> int:
    return BY_CLASS[cls].journal


def cpg_type(cls: type) -> int:
    number = BY_CLASS[cls].cpg
    if number is None:
        raise ValueError(f"{cls.__name__} is never multicast")
    return number

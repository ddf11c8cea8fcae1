"""The membership hazard detector: partition-then-merge and ring changes without member change."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cpgbroker.corosync.events import (
    ConfChg,
    Member,
    MemberChange,
    MembershipTracker,
    PartitionMerge,
    Reason,
    RingChangeSameMembers,
    RingId,
    TotemConfChg,
)

G = b"group"
A, B, C = Member(1, 100), Member(2, 200), Member(3, 300)


def conf(members: list[Member], left=(), joined=()) -> ConfChg:  # type: ignore[no-untyped-def]
    return ConfChg(
        G,
        tuple(members),
        tuple(MemberChange(m.nodeid, m.pid, r) for m, r in left),
        tuple(MemberChange(m.nodeid, m.pid, r) for m, r in joined),
    )


def ring(seq: int, *nodes: int) -> TotemConfChg:
    return TotemConfChg(RingId(1, seq), nodes)


def test_member_lost_to_nodedown_and_back_through_nodeup_is_a_partition_merge() -> None:
    t = MembershipTracker()
    assert t.feed(conf([A, B, C], joined=[(A, Reason.JOIN)])) == []
    assert t.feed(conf([A, C], left=[(B, Reason.NODEDOWN)])) == []
    hazards = t.feed(conf([A, B, C], joined=[(B, Reason.NODEUP)]))
    assert hazards == [PartitionMerge(G, rejoined=(B,), merged=())]


def test_the_isolated_side_sees_everyone_else_leave_and_return() -> None:
    t = MembershipTracker()
    t.feed(conf([A, B, C], joined=[(B, Reason.JOIN)]))
    t.feed(conf([B, C], left=[(A, Reason.NODEDOWN)]))
    t.feed(conf([B], left=[(C, Reason.NODEDOWN)]))
    assert t.feed(conf([A, B], joined=[(A, Reason.NODEUP)])) == [PartitionMerge(G, (A,), ())]
    assert t.feed(conf([A, B, C], joined=[(C, Reason.NODEUP)])) == [PartitionMerge(G, (C,), ())]


def test_a_fresh_join_after_a_crash_is_not_a_merge() -> None:
    t = MembershipTracker()
    t.feed(conf([A, B], joined=[(A, Reason.JOIN)]))
    t.feed(conf([A], left=[(B, Reason.NODEDOWN)]))
    # Same nodeid and pid (e.g. one process with a handle per node) but a new cpg_join.
    assert t.feed(conf([A, B], joined=[(B, Reason.JOIN)])) == []
    # ... and that join starts a new history: a later NODEUP of it is an unknown merge.
    t.feed(conf([A], left=[(B, Reason.LEAVE)]))
    assert t.feed(conf([A, B], joined=[(B, Reason.NODEUP)])) == [PartitionMerge(G, (), (B,))]


def test_a_member_never_seen_that_arrives_by_nodeup_is_reported_as_merged() -> None:
    t = MembershipTracker()
    t.feed(conf([A], joined=[(A, Reason.JOIN)]))
    assert t.feed(conf([A, C], joined=[(C, Reason.NODEUP)])) == [PartitionMerge(G, (), (C,))]


def test_groups_are_tracked_separately() -> None:
    t = MembershipTracker()
    t.feed(ConfChg(b"one", (A,), (MemberChange(2, 200, Reason.NODEDOWN),), ()))
    other = ConfChg(b"two", (A, B), (), (MemberChange(2, 200, Reason.NODEUP),))
    assert t.feed(other) == [PartitionMerge(b"two", (), (B,))]


def test_ring_change_with_the_same_members_is_reported() -> None:
    t = MembershipTracker()
    assert t.feed(ring(4, 1, 2, 3)) == []  # the initial configuration
    assert t.feed(ring(8, 3, 2, 1)) == [
        RingChangeSameMembers(RingId(1, 8), RingId(1, 4), (3, 2, 1))
    ]


def test_ordinary_ring_changes_are_not_hazards() -> None:
    t = MembershipTracker()
    assert t.feed(ring(4, 1, 2, 3)) == []
    assert t.feed(ring(4, 1, 2, 3)) == []  # same ring repeated
    assert t.feed(ring(8, 1, 2)) == []  # a node left
    assert t.feed(ring(12, 1, 2, 3)) == []  # and came back
    assert t.ring_id == RingId(1, 12) and t.ring_members == (1, 2, 3)


@given(st.lists(st.tuples(st.integers(1, 50), st.frozensets(st.integers(1, 4), min_size=1))))
def test_ring_hazard_iff_new_ring_with_unchanged_node_set(
    rings: list[tuple[int, frozenset[int]]],
) -> None:
    t = MembershipTracker()
    previous: tuple[int, frozenset[int]] | None = None
    for seq, nodes in rings:
        hazards = t.feed(ring(seq, *sorted(nodes)))
        expected = previous is not None and previous[0] != seq and previous[1] == nodes
        assert (hazards != []) == expected
        previous = (seq, nodes)


REASONS = st.sampled_from(list(Reason))


@given(
    st.lists(
        st.tuples(st.sampled_from([A, B, C]), st.sampled_from(["left", "joined"]), REASONS),
        max_size=40,
    )
)
def test_merge_reported_exactly_for_nodeup_joins(
    steps: list[tuple[Member, str, Reason]],
) -> None:
    t = MembershipTracker()
    down: set[Member] = set()
    for member, kind, reason in steps:
        if kind == "left":
            hazards = t.feed(conf([], left=[(member, reason)]))
            assert hazards == []
            if reason == Reason.NODEDOWN:
                down.add(member)
            else:
                down.discard(member)
            continue
        hazards = t.feed(conf([member], joined=[(member, reason)]))
        if reason == Reason.NODEUP:
            rejoined = (member,) if member in down else ()
            merged = () if member in down else (member,)
            assert hazards == [PartitionMerge(G, rejoined, merged)]
        else:
            assert hazards == []
        down.discard(member)

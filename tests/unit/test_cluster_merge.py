"""Partition merge verdicts (cluster/merge.py, pure): the larger side wins, a tie goes to the
side with the lowest member id, and the winners shun the losers until they leave."""

from __future__ import annotations

from cpgbroker.cluster.membership import member_id
from cpgbroker.cluster.merge import Partitions, merge_verdict
from cpgbroker.corosync.events import ConfChg, Member, MemberChange, PartitionMerge, Reason


def m(n: int) -> int:
    return member_id(n, 1000)


def merge(*nodes: int) -> PartitionMerge:
    return PartitionMerge(b"g", tuple(Member(n, 1000) for n in nodes), ())


def test_the_larger_side_wins_and_a_tie_goes_to_the_lowest_member() -> None:
    assert merge_verdict(merge(3), [m(1), m(2), m(3)]) == (True, [m(3)])
    assert merge_verdict(merge(1, 2), [m(1), m(2), m(3)]) == (False, [m(1), m(2)])
    assert merge_verdict(merge(2), [m(1), m(2)]) == (True, [m(2)])
    assert merge_verdict(merge(1), [m(1), m(2)]) == (False, [m(1)])
    # Both sides reach the same verdict.
    assert merge_verdict(merge(1), [m(1), m(2)])[0] != merge_verdict(merge(2), [m(1), m(2)])[0]


def test_the_winners_shun_the_losers_until_they_leave() -> None:
    p = Partitions()
    assert p.on_merge(merge(3), [m(1), m(2), m(3)]) == (True, [m(3)])
    assert p.shunned == {m(3)}
    change = ConfChg(
        b"g",
        (Member(1, 1000), Member(2, 1000), Member(3, 1000), Member(4, 1000)),
        (),
        (MemberChange(4, 1000, Reason.JOIN),),
    )
    assert p.view(change) == ([m(1), m(2), m(4)], [m(4)], [])
    gone = ConfChg(
        b"g", (Member(1, 1000), Member(2, 1000)), (MemberChange(3, 1000, Reason.LEAVE),), ()
    )
    assert p.view(gone) == ([m(1), m(2)], [], [m(3)])
    assert p.shunned == set()
    # A loser shuns nobody.
    assert Partitions().on_merge(merge(1, 2), [m(1), m(2), m(3)])[0] is False

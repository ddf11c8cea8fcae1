"""One member's side of error-check rounds (cluster/errorcheck_stall.py, pure): stalling at a failed
event, answering and owing answers, and settling decided rounds."""

from __future__ import annotations

from cpgbroker.cluster.codec import OK, ErrorCheck
from cpgbroker.cluster.errorcheck_stall import Answer, Decided, Leave, Proceed, Resync, Stall
from cpgbroker.cluster.errorcheck_vote import Round

ME, A, B = 1, 2, 3
READY = [ME, A, B]


def test_a_stalled_member_vouches_for_the_event_before_and_keeps_what_follows() -> None:
    s = Stall(ME)
    assert s.applied(10) == 10
    assert s.fail(11, "apply-error: KeyError", "ev11", A) == Answer(11, "apply-error: KeyError")
    assert s.applied(11) == 10
    s.hold("ev12", A)
    s.hold("ev13", B)
    assert s.next_kept() is None, "nothing is applied while stalled"
    assert s.status()["held_at"] == 11


def test_answers_ok_at_once_or_owes_them_until_replayed() -> None:
    s = Stall(ME)
    s.fail(20, "store-write: ENOSPC", "ev20", A)
    # A later round (the others failed at 25): this member has not applied 25 yet.
    assert s.on_error_check(ErrorCheck(A, 25, "apply-error: X"), READY, None) == []
    assert s.owed == [25]
    # An earlier round: it applied that event, so it answers at once.
    assert s.on_error_check(ErrorCheck(B, 15, "apply-error: Y"), READY, None) == [Answer(15, OK)]
    assert s.pay_owed(24) == []
    assert s.pay_owed(25) == [Answer(25, OK)] and s.owed == []


def test_a_stopped_member_does_not_answer_for_events_after_its_stop_point() -> None:
    s = Stall(ME)
    assert s.on_error_check(ErrorCheck(A, 30, "apply-error: X"), READY, halted=29) == []
    assert not s.votes.pending


def test_a_round_decided_against_this_member_makes_it_leave() -> None:
    s = Stall(ME)
    s.fail(40, "apply-error: X", "ev40", A)
    assert s.on_error_check(ErrorCheck(ME, 40, "apply-error: X"), READY, None) == []
    assert s.on_error_check(ErrorCheck(A, 40, OK), READY, None) == []
    (decided,) = s.on_error_check(ErrorCheck(B, 40, OK), READY, None)
    assert isinstance(decided, Decided) and decided.round.losers == (ME,)
    assert list(s.rounds) == [decided.round]
    (leave,) = s.settle(decided.round, False, None)
    assert isinstance(leave, Leave) and "lost to the majority" in leave.reason


def test_the_majority_failing_alike_lets_the_stalled_member_proceed_and_replay() -> None:
    s = Stall(ME)
    s.fail(50, "apply-error: X", "ev50", A)
    s.hold("ev51", B)
    s.on_error_check(ErrorCheck(ME, 50, "apply-error: X"), READY, None)
    s.on_error_check(ErrorCheck(A, 50, "apply-error: X"), READY, None)
    (decided,) = s.on_error_check(ErrorCheck(B, 50, OK), READY, None)
    assert isinstance(decided, Decided)
    assert s.settle(decided.round, False, None) == [Proceed("apply-error: X", "ev50", A)]
    assert s.stalled is None
    assert s.next_kept() == ("ev51", B) and s.next_kept() is None


def test_a_member_not_asked_resyncs_unless_its_state_came_from_a_failing_updater() -> None:
    failed = Round(60, ((A, "apply-error: X"), (B, "apply-error: X")), "apply-error: X", (), ())
    (r,) = Stall(ME).settle(failed, False, None)
    assert isinstance(r, Resync) and "catching up" in r.reason
    # Its state is from before the event: it applied the failed event itself.
    assert isinstance(Stall(ME).settle(failed, False, (59, A))[0], Resync)
    # From an updater that had failed the event alike (after it): nothing to do.
    assert Stall(ME).settle(failed, False, (61, A)) == []
    # A stopped member does not serve on: nothing to do either.
    assert Stall(ME).settle(failed, True, None) == []


def test_a_voter_that_leaves_no_longer_counts() -> None:
    s = Stall(ME)
    assert s.on_error_check(ErrorCheck(A, 70, "apply-error: X"), READY, None) == [Answer(70, OK)]
    assert s.on_error_check(ErrorCheck(ME, 70, OK), READY, None) == []
    (decided,) = s.members_left([B])
    assert decided.round.gone == (B,) and decided.round.seq == 70


def test_ten_thousand_rounds_keep_the_bookkeeping_bounded_and_status_shows_the_newest() -> None:
    """A client that makes rounds happen again and again must not grow the members' memory:
    decided rounds are kept in a window of ROUNDS_KEPT, answers only while a round is open."""
    import tracemalloc

    from cpgbroker.cluster.errorcheck_stall import ROUNDS_SHOWN
    from cpgbroker.cluster.errorcheck_vote import ROUNDS_KEPT

    s = Stall(ME)

    def rounds(first: int, n: int) -> None:
        for seq in range(first, first + n):
            assert s.on_error_check(ErrorCheck(A, seq, "apply-error: X"), READY, None) == [
                Answer(seq, OK)
            ]
            s.on_error_check(ErrorCheck(ME, seq, OK), READY, None)
            (d,) = s.on_error_check(ErrorCheck(B, seq, OK), READY, None)
            assert isinstance(d, Decided) and d.round.losers == (A,)

    rounds(1, 1_000)
    # Only what the cluster logic allocates: other threads of the test process (a pool left
    # by an earlier test) allocate meanwhile too, and flaked this on a loaded machine.
    mine = [tracemalloc.Filter(True, "*/cpgbroker/cluster/*")]
    tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(mine)
    rounds(1_001, 9_000)
    after = tracemalloc.take_snapshot().filter_traces(mine)
    grown = sum(st.size_diff for st in after.compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes more after 9,000 more rounds"
    assert len(s.votes.decided) == ROUNDS_KEPT and not s.votes.pending and not s.owed
    decided = s.status()["decided"]
    assert len(decided) == ROUNDS_SHOWN
    assert [r["seq"] for r in decided] == list(range(10_001 - ROUNDS_SHOWN, 10_001))
    assert s.rounds[-1].seq == 10_000


def test_a_late_outcome_for_a_decided_round_opens_nothing() -> None:
    """A member that became ready while a round was open answers it after the last voter:
    that must not open a round for the same event that nobody answers any more."""
    from cpgbroker.cluster.errorcheck_vote import ROUNDS_KEPT

    s = Stall(ME)
    s.on_error_check(ErrorCheck(A, 80, "apply-error: X"), READY, None)
    s.on_error_check(ErrorCheck(ME, 80, OK), READY, None)
    (d,) = s.on_error_check(ErrorCheck(B, 80, OK), READY, None)
    assert isinstance(d, Decided)
    late = 4
    assert s.on_error_check(ErrorCheck(late, 80, OK), [*READY, late], None) == []
    assert not s.votes.pending
    # Also once the round has left the window of decided rounds.
    for seq in range(100, 100 + ROUNDS_KEPT):
        for m in (A, ME, B):
            s.on_error_check(ErrorCheck(m, seq, OK), READY, None)
    assert d.round not in s.votes.decided
    assert s.on_error_check(ErrorCheck(late, 80, OK), [*READY, late], None) == []
    assert not s.votes.pending

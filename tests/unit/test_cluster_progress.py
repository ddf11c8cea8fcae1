"""Peer progress (cluster/progress.py, pure): lag counts estimates, stability counts only what
members reported, and the pacing of this member's own reports."""

from __future__ import annotations

import pytest

from cpgbroker.cluster import progress as progress_mod
from cpgbroker.cluster.progress import PeerProgress

ME, A, B = 10, 20, 30


def test_lag_is_the_slowest_ready_member_and_counts_estimates() -> None:
    p = PeerProgress(ME, max_lag=1000)
    assert p.lag(100, [ME]) == 0, "alone: nobody lags"
    p.estimate([ME, A, B], 40)  # everyone became ready at event 40
    assert p.lag(100, [ME, A, B]) == 60
    p.on_report(A, 90)
    assert p.lag(100, [ME, A, B]) == 60, "B still stands where it became ready"
    p.on_report(B, 95)
    assert p.lag(100, [ME, A, B]) == 10
    # A member not known at all is counted as up to date (it has not been seen to lag).
    assert p.lag(100, [ME, 99]) == 0


def test_stability_counts_reports_only_and_includes_this_member() -> None:
    p = PeerProgress(ME, max_lag=1000)
    assert p.stable(50, []) == 0
    p.estimate([ME, A], 40)
    assert p.stable(50, [ME, A]) == 0, "an estimate is not a fact"
    p.on_report(A, 45)
    assert p.stable(50, [ME, A]) == 45
    assert p.stable(42, [ME, A]) == 42, "nor beyond what this member applied"
    p.forget([A])
    assert p.stable(50, [ME]) == 50 and A not in p.peer


def test_a_member_caught_up_through_an_update_counts_from_its_ready_point() -> None:
    p = PeerProgress(ME, max_lag=1000)
    p.on_report(A, 70)
    p.newly_ready(A, 60)
    assert p.peer[A] == 70, "never backwards"
    p.newly_ready(B, 60)
    assert p.peer[B] == 60


def test_report_interval_follows_max_lag() -> None:
    assert PeerProgress(ME, max_lag=100_000).every == progress_mod.PROGRESS_EVERY
    assert PeerProgress(ME, max_lag=100).every == 25
    assert PeerProgress(ME, max_lag=2).every == 1


def test_report_pacing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_mod, "REPORT_INTERVAL", 0.01)
    monkeypatch.setattr(progress_mod, "REPORT_RIDE_WAIT", 0.05)
    p = PeerProgress(ME, max_lag=1000)
    # Nothing to ride on, none sent lately: it may leave at once.
    assert p.want_report(1.0, answer_expected=False) and p.report_wanted
    p.report_gone(1.0)
    assert not p.report_wanted and p.reported_at == 1.0
    # Another one right after: it waits out the interval.
    assert not p.want_report(1.002, answer_expected=False)
    assert p.report_wait(1.002) == pytest.approx(0.008)
    p.report_gone(1.01)
    # A local client was handed output: wait for its answer to ride on.
    assert not p.want_report(2.0, answer_expected=True)
    assert p.report_wait(2.0) == pytest.approx(0.05)
    assert p.report_wait(2.06) < 0, "no answer came: it leaves alone"


def test_durable_reports_give_the_durable_stable_sequence_and_count_in_the_lag() -> None:
    p = PeerProgress(ME, max_lag=100)
    p.on_report(A, 500, 420)
    p.on_report(B, 480, 480)
    ready = [ME, A, B]
    assert p.stable(510, ready) == 480
    assert p.durable_stable(505, ready) == 420
    # A store that falls behind holds back client traffic like a member that does.
    assert p.lag(510, ready) == 90
    # A store being replaced (durable 0) vouches for nothing, but is not a slow disk.
    p.on_report(A, 505, 0)
    assert p.durable_stable(505, ready) == 0
    assert p.lag(510, ready) == 30
    # A member without a store vouches for what it applied.
    p.on_report(A, 507)
    assert p.durable_stable(510, ready) == 480


def test_with_a_store_quorum_durable_confirms_need_that_many_ready_members() -> None:
    p = PeerProgress(ME, max_lag=100)
    p.on_report(A, 500, 500)
    assert p.durable_stable(500, [ME, A], quorum=2) == 500
    assert p.durable_stable(500, [ME], quorum=2) == 0  # alone: no majority of stores
    assert p.durable_stable(500, [ME]) == 500  # "all": the stores of those serving


def test_a_store_reports_once_for_confirms_that_wait_for_it() -> None:
    p = PeerProgress(ME, max_lag=100_000)
    # A confirm that waits for the stores, at event 50, not yet on our disk: no report now...
    assert not p.confirms_moved(shadow=1, shadow_durable=1, seq=50, durable=49)
    p.durable_reported = 40  # our last report (a store that never reported is due at once)
    assert not p.durable_report_due(49)
    # ... but once the store holds it.
    assert p.durable_report_due(50)
    p.durable_reported = 50
    # A plain confirm needs the report of what we applied at once.
    assert p.confirms_moved(shadow=2, shadow_durable=1, seq=51, durable=50)
    # A durable one the store already holds: at once too.
    assert p.confirms_moved(shadow=3, shadow_durable=2, seq=52, durable=52)

"""The watchdog keeps a member alive while it is inside a long event and makes progress
(runtime/member/watchdog.py, "Slow events are not hangs"): the feeder's rule as a pure function,
then stand-in members (processes with a real watchdog) that are slow, blocked, or slow for too long
inside one event; and the slow-apply fault that tests inject on every member."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from cpgbroker.errors import ClusterError
from cpgbroker.runtime.member.eventlog import EventLog
from cpgbroker.runtime.member.watchdog import BUSY, IDLE, MIN_CPU_SHARE, STILL, TOO_LONG, BusyRule

# ---------------------------------------------------------------------- the rule (pure)


def test_between_events_the_event_loop_feeds_for_itself() -> None:
    rule = BusyRule(max_apply=60, last_now=0.0, last_cpu=0.0)
    assert rule.look(0, 1.0, 1.0) == IDLE, "no event being applied: the thread never feeds"


def test_inside_an_event_that_makes_cpu_progress_it_feeds() -> None:
    rule = BusyRule(max_apply=60, last_now=0.0, last_cpu=0.0)
    assert rule.look(7, 1.0, 0.9) == BUSY
    assert rule.look(7, 2.0, 1.2) == BUSY, "a loaded host: 30% of a CPU is progress"
    # Another event at the next look: the member moves through the stream.
    assert rule.look(8, 3.0, 2.0) == BUSY


def test_inside_an_event_without_cpu_progress_it_stops_feeding() -> None:
    """Stopped, swapping or blocked: the event loop's thread hardly runs."""
    rule = BusyRule(max_apply=60, last_now=0.0, last_cpu=0.0)
    assert rule.look(7, 1.0, 1.0) == BUSY
    assert rule.look(7, 2.0, 1.0 + MIN_CPU_SHARE / 2) == STILL
    assert rule.look(7, 3.0, 2.0) == BUSY, "it runs again: fed again"


def test_one_event_is_fed_for_at_most_max_apply_seconds_from_when_it_was_first_seen() -> None:
    rule = BusyRule(max_apply=10, last_now=0.0, last_cpu=0.0)
    cpu = 0.0
    verdicts = []
    for t in range(1, 15):
        cpu += 1.0
        verdicts.append(rule.look(7, float(t), cpu))
    # First seen at t=1: fed up to t=10, not from t=11 (10 s after) on.
    assert verdicts[:10] == [BUSY] * 10 and set(verdicts[10:]) == {TOO_LONG}
    # The next event starts its own bound.
    assert rule.look(8, 15.0, cpu + 1) == BUSY


def test_an_event_seen_again_after_an_idle_look_starts_afresh() -> None:
    rule = BusyRule(max_apply=2, last_now=0.0, last_cpu=0.0)
    assert rule.look(7, 1.0, 1.0) == BUSY
    assert rule.look(0, 2.0, 2.0) == IDLE
    assert rule.look(7, 3.0, 3.0) == BUSY


def test_max_apply_zero_leaves_the_feeding_to_the_event_loop() -> None:
    rule = BusyRule(max_apply=0, last_now=0.0, last_cpu=0.0)
    assert rule.look(7, 1.0, 1.0) == IDLE


# ---------------------------------------------------------------------- stand-in members

# A stand-in member: spawns its watchdog (timeout 1 s), feeds it from its "event loop" for a
# moment, then enters event 42 (the mark set, the loop no longer feeding) and does WHAT for
# SECONDS, then says "done".
MEMBER = """
import time, sys
from cpgbroker.runtime.member import watchdog
what, seconds, max_apply = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
w = watchdog.spawn(1.0)
mark = watchdog.ApplyMark()
feeder = watchdog.BusyFeeder(lambda: watchdog.feed(w), mark, 0.2, max_apply)
feeder.start()
for _ in range(3):
    watchdog.feed(w); time.sleep(0.2)
mark.seq = 42
end = time.monotonic() + seconds
while time.monotonic() < end:
    if what == "sleep":
        time.sleep(0.05)
mark.seq = 0
watchdog.feed(w)
print("done", flush=True)
feeder.stop()
"""


def run_member(what: str, seconds: float, max_apply: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", MEMBER, what, str(seconds), str(max_apply)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_member_busy_in_one_event_for_longer_than_the_timeout_is_kept_alive() -> None:
    proc = run_member("spin", 4.0, 60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert "made no progress" not in proc.stderr


def test_a_member_blocked_in_one_event_is_still_killed() -> None:
    t0 = time.monotonic()
    proc = run_member("sleep", 20.0, 60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert time.monotonic() - t0 < 10
    assert "made no progress" in proc.stderr


def test_a_member_busy_in_one_event_for_longer_than_max_apply_is_killed() -> None:
    t0 = time.monotonic()
    proc = run_member("spin", 30.0, 2.0)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # max_apply (2 s) and the timeout (1 s), give or take a look or two.
    assert 2.5 < time.monotonic() - t0 < 15
    assert "max_apply_seconds" in proc.stderr


# ---------------------------------------------------------------------- the slow-apply fault


def test_slow_apply_spends_its_time_in_the_event_it_names_once() -> None:
    events = EventLog("", 1, 1)
    assert events.inject("slow-apply", 5, 3, seconds=0.3) == {
        "kind": "slow-apply",
        "at_seq": 5,
        "seconds": 0.3,
    }
    t0 = time.process_time()
    events.before_apply(4)
    assert time.process_time() - t0 < 0.1
    events.before_apply(5)
    assert time.process_time() - t0 >= 0.25, "spent on the CPU, not asleep"
    assert not events.faults
    t1 = time.monotonic()
    events.before_apply(6)
    assert time.monotonic() - t1 < 0.1


@pytest.mark.parametrize("seconds", [0.0, -1.0, 601.0])
def test_slow_apply_needs_a_sensible_duration(seconds: float) -> None:
    with pytest.raises(ClusterError, match="seconds"):
        EventLog("", 1, 1).inject("slow-apply", 5, 3, seconds=seconds)

"""Failure windows from the fault log and whole-cluster restarts, and how a restart is
described (pure Python; no Spark session)."""

from __future__ import annotations

from cpgbroker.audit.delivery import FailureWindow, failure_windows, restart_windows
from cpgbroker.audit.restarts import Restart

S = 1_000_000_000
NEVER = 1 << 62


def test_kills_end_at_once_stops_and_partitions_last_until_their_node_is_back() -> None:
    faults = [
        {"t_ns": 50 * S, "action": "resume", "node": 2},
        {"t_ns": 10 * S, "action": "kill", "node": 3},
        {"t_ns": 40 * S, "action": "stop", "node": 2},
        {"t_ns": 45 * S, "action": "resume", "node": 1},  # another node: not the end
        {"t_ns": 60 * S, "action": "partition", "node": 1},
        {"t_ns": 70 * S, "action": "heal", "node": 1},
        {"t_ns": 80 * S, "action": "start", "node": 3},  # brings back; opens no window
        {"t_ns": 90 * S, "action": "partition", "node": 2},  # never healed
    ]
    assert failure_windows(faults, 5 * S) == [
        FailureWindow(10 * S, 15 * S, "kill", 3),
        FailureWindow(40 * S, 55 * S, "stop", 2),
        FailureWindow(60 * S, 75 * S, "partition", 1),
        FailureWindow(90 * S, NEVER, "partition", 2),
    ]


def test_no_disruptive_fault_no_window() -> None:
    assert failure_windows([{"t_ns": S, "action": "heal", "node": 1}], S) == []
    assert failure_windows([], S) == []


def _restart(**kw: object) -> Restart:
    base: dict[str, object] = {
        "era": 1,
        "t_ns": 100 * S,
        "seq": 4022,
        "recovered_seq": 4019,
        "member": 12608986,
        "incarnation": 1,
        "replicas": ("12608986", "4220373"),
        "previous_last_seq": 4030,
        "previous_last_record_ns": 95 * S,
        "state_applied_ns": 94 * S,
        "last_fault_ns": 97 * S,
    }
    base.update(kw)
    return Restart(**base)  # type: ignore[arg-type]


def test_a_restart_is_down_from_its_last_sign_of_life_and_says_what_it_forgot() -> None:
    r = _restart()
    assert r.down_from_ns == 97 * S and r.down_s == 3.0 and r.rolled_back == 11
    assert r.describe() == (
        "whole-cluster restart at 1970-01-01T00:01:40.000Z: down for 3.0 s, recovered event "
        "4019 from member 12608986's store (the members before it had logged up to event "
        "4030: 11 events after the recovered one were in no store)"
    )
    # The logs end before the recovered event (SIGKILL lost their tails), no fault log.
    r = _restart(previous_last_seq=3684, last_fault_ns=None)
    assert r.down_from_ns == 95 * S and r.rolled_back == 0
    assert "the logs before it end at event 3684" in r.describe()
    # Nothing before it was logged at all.
    r = _restart(previous_last_seq=None, previous_last_record_ns=None, last_fault_ns=None)
    assert r.down_from_ns is None and r.down_s is None
    assert "down since an unknown time" in r.describe()
    assert "left no event in their logs" in r.describe()
    assert r.as_dict()["summary"] == r.describe()


def test_a_restart_is_a_failure_window_from_when_the_cluster_was_down() -> None:
    assert restart_windows([_restart()], 5 * S) == [
        FailureWindow(97 * S, 105 * S, "cluster-restart", 0)
    ]
    unknown = _restart(previous_last_record_ns=None, last_fault_ns=None)
    assert restart_windows([unknown], 5 * S) == [
        FailureWindow(100 * S, 105 * S, "cluster-restart", 0)
    ]

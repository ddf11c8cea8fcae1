"""Failure windows from the fault log (pure Python; no Spark session)."""

from __future__ import annotations

from cpgbroker.audit.delivery import FailureWindow, failure_windows

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

"""The watchdog on a real 3-node corosync cluster: an event every member is slow in is not a
hang (no member is killed, the cluster serves on), a member stopped alone is still killed by
its own watchdog, also in the middle of such an event (runtime/member/watchdog.py, "Slow events are
not hangs").

The slow event is the ``slow-apply`` fault, injected through every member's status endpoint at
the same event: each member spends ``seconds`` on the CPU applying it, its event loop blocked,
as under a client's expensive command. The watchdog timeout is 3 s, the slow event 8 s.
(A member hung alone outside any event: test_error_check_live.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import pytest
from brokerclients import ConfirmingPublisher, assert_serves, drain_queue, load_until, wait_state

from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

CONFIG = "watchdog_timeout = 3\nfault_injection = true\n"
TIMEOUT = 3.0
SLOW = 8.0


def seq_of(bs: BrokerSet, node: int) -> int:
    s = bs.status(node)
    assert s is not None
    return int(s["event_seq"])


def slow_event_on_every_member(bs: BrokerSet, seconds: float) -> int:
    """Inject a slow-apply at the same event on every member, a little ahead of the stream;
    that event's seq."""
    at = max(seq_of(bs, n) for n in (1, 2, 3)) + 300
    for n in (1, 2, 3):
        code, answer = bs.control(
            n, "/faults", {"kind": "slow-apply", "at_seq": at, "seconds": seconds}
        )
        assert code == 200, answer
        assert answer == {"kind": "slow-apply", "at_seq": at, "seconds": seconds}
    return at


def wait_exit(bs: BrokerSet, node: int, timeout: float) -> int:
    try:
        return bs.procs[node].wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"broker {node} still runs:\n{bs.tail(node, 30)}") from None


def test_an_event_every_member_is_slow_in_kills_no_member(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(extra_config=CONFIG)
    s = bs.status(1)
    assert s is not None
    assert s["watchdog"]["timeout"] == TIMEOUT and s["watchdog"]["max_apply_seconds"] == 300
    pub = ConfirmingPublisher(bs, [1, 2], "load")
    pub.start()
    load_until(pub, 100, timeout=60.0)
    at = slow_event_on_every_member(bs, SLOW)
    for n in (1, 2, 3):
        bs.wait_log(n, f"injected slow apply of event {at}", 30)
    t0 = time.monotonic()
    # Every member is inside the event, its event loop blocked for longer than the watchdog
    # timeout; their feeder threads keep the watchdogs fed.
    for n in (1, 2, 3):
        bs.wait_log(n, f"event {at} has been applying for", 2 * TIMEOUT)
    for n in (1, 2, 3):
        wait_state(bs, n, lambda s: int(s["event_seq"]) > at, timeout=SLOW + 30)
    assert time.monotonic() - t0 > SLOW - 2 * TIMEOUT, "the event was not slow"
    for n in (1, 2, 3):
        assert bs.procs[n].poll() is None, f"broker {n} died:\n{bs.tail(n, 30)}"
        log = bs.log_path(n).read_text(errors="replace")
        assert "made no progress" not in log and "leaving the cluster" not in log
        s = wait_state(bs, n, lambda s: len(s["members"]) == 3)
        assert "injected_faults" not in s
    # The clients are served on: the publisher's confirms resume, every member serves.
    load_until(pub, 200, timeout=60.0)
    confirmed = pub.stop()
    assert not pub.closes, pub.closes
    bs.converged([1, 2, 3])
    assert_serves(bs, 3, 2, "after", 20)
    missing = set(confirmed) - set(drain_queue(bs, 3, "load"))
    assert not missing, f"{len(missing)} confirmed messages lost"


def test_a_member_stopped_alone_inside_a_slow_event_is_still_killed(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(extra_config=CONFIG)
    hung = wait_state(bs, 3, lambda s: s["state"] == "ready")["member"]
    pub = ConfirmingPublisher(bs, [1], "load")
    pub.start()
    load_until(pub, 100, timeout=60.0)
    at = slow_event_on_every_member(bs, SLOW)
    bs.wait_log(3, f"injected slow apply of event {at}", 30)
    t0 = time.monotonic()
    # Hung while the others are slow in the same event: it makes no progress, they do.
    os.kill(bs.procs[3].pid, signal.SIGSTOP)
    assert wait_exit(bs, 3, timeout=TIMEOUT + 10) == -signal.SIGKILL
    assert time.monotonic() - t0 < TIMEOUT + 5
    assert "made no progress" in bs.tail(3, 40)
    # The others finish the event, see it leave and go on confirming.
    for n in (1, 2):
        wait_state(
            bs,
            n,
            lambda s: int(s["event_seq"]) > at and hung not in [m["member"] for m in s["members"]],
            timeout=SLOW + 30,
        )
        assert bs.procs[n].poll() is None, bs.tail(n, 30)
    load_until(pub, 200, timeout=60.0)
    confirmed = pub.stop()
    bs.converged([1, 2])
    missing = set(confirmed) - set(drain_queue(bs, 2, "load"))
    assert not missing, f"{len(missing)} confirmed messages lost"

"""Error-check rounds, stop requests and the watchdog on a real 3-node corosync cluster in
network namespaces, with real pika clients under load.

Faults are injected through the members' status endpoint (``[cluster] fault_injection``): a
member fails while applying a chosen event, or finds its disk full when recording it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from brokerclients import ConfirmingPublisher, assert_serves, drain_queue, load_until, wait_state

from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

FAULTS = "fault_injection = true\n"


def seq_of(bs: BrokerSet, node: int) -> int:
    s = bs.status(node)
    assert s is not None
    return int(s["event_seq"])


def member_of(bs: BrokerSet, node: int) -> int:
    s = bs.status(node)
    assert s is not None
    return int(s["member"])


def wait_exit(bs: BrokerSet, node: int, timeout: float = 30.0) -> int:
    proc = bs.procs[node]
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"broker {node} still runs:\n{bs.tail(node, 30)}") from None


def inject(bs: BrokerSet, node: int, kind: str, at_seq: int) -> None:
    code, answer = bs.control(node, "/faults", {"kind": kind, "at_seq": at_seq})
    assert code == 200, answer
    assert answer["at_seq"] == at_seq


def stop_records(bs: BrokerSet, node: int) -> list[dict[str, Any]]:
    lines = bs.event_log_path(node).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "stop"]


@pytest.mark.parametrize("kind", ["apply-error", "disk-full"])
def test_an_error_on_one_member_under_load_makes_it_leave(
    broker_set: Callable[..., BrokerSet], kind: str
) -> None:
    bs = broker_set(extra_config=FAULTS)
    leaving = member_of(bs, 3)
    # Its clients fail over to member 1.
    pub = ConfirmingPublisher(bs, [3, 1], "load")
    pub.start()
    load_until(pub, 200)
    at = seq_of(bs, 3) + 300
    inject(bs, 3, kind, at)
    assert wait_exit(bs, 3) == 3, "a member that lost the round exits with status 3"
    assert "lost to the majority" in bs.tail(3, 40)
    load_until(pub, 200)  # on member 1 now
    confirmed = pub.stop()
    # The round: member 3 alone had the error; it left, the two others agree.
    for node in (1, 2):
        s = wait_state(bs, node, lambda s: bool(s["error_checks"]["decided"]))
        (r,) = s["error_checks"]["decided"]
        assert r["seq"] == at and r["decision"] == "ok" and r["leaving"] == [leaving]
        assert r["outcomes"][str(leaving)].startswith(
            "apply-error: InjectedFault" if kind == "apply-error" else "store-write: ENOSPC"
        )
        assert [m["member"] for m in s["members"]] != [] and leaving not in [
            m["member"] for m in s["members"]
        ]
    bs.converged([1, 2])
    assert (3, 320) in {(n, c) for n, c, _t in pub.closes}, pub.closes
    got = drain_queue(bs, 1, "load")
    missing = set(confirmed) - set(got)
    assert not missing, f"{len(missing)} confirmed messages lost, e.g. {sorted(missing)[:5]}"


def test_the_same_error_on_two_of_three_makes_the_odd_member_leave(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(extra_config=FAULTS)
    odd = member_of(bs, 3)
    pub = ConfirmingPublisher(bs, [2, 1], "load")
    pub.start()
    load_until(pub, 200)
    at = max(seq_of(bs, n) for n in (1, 2, 3)) + 400
    inject(bs, 1, "apply-error", at)
    inject(bs, 2, "apply-error", at)
    assert wait_exit(bs, 3) == 3
    assert "lost to the majority" in bs.tail(3, 40)
    load_until(pub, 200)
    confirmed = pub.stop()
    for node in (1, 2):
        (r,) = wait_state(bs, node, lambda s: bool(s["error_checks"]["decided"]))["error_checks"][
            "decided"
        ]
        assert r["seq"] == at and r["leaving"] == [odd]
        assert r["decision"].startswith("apply-error") and r["outcomes"][str(odd)] == "ok"
    bs.converged([1, 2])
    assert_serves(bs, 1, 2, "after", 20)
    got = drain_queue(bs, 2, "load")
    missing = set(confirmed) - set(got)
    assert not missing, f"{len(missing)} confirmed messages lost, e.g. {sorted(missing)[:5]}"


def test_cluster_stop_under_load_stops_every_member_at_the_same_event(
    brokers: BrokerSet,
) -> None:
    pubs = [ConfirmingPublisher(brokers, [n], "load", name=f"p{n}") for n in (1, 2, 3)]
    for p in pubs:
        p.start()
    for p in pubs:
        load_until(p, 100)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpgbroker",
            "cluster",
            "stop",
            *brokers.cli_args(2),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("stopping the cluster at event ")
    at = int(out.stdout.split()[5])
    codes = [wait_exit(brokers, n) for n in (1, 2, 3)]
    assert codes == [0, 0, 0], [brokers.tail(n) for n in (1, 2, 3)]
    for p in pubs:
        p.stop()
        # Told why: connection.close 320 "cluster shutdown", and not sent to another member
        # (every member stops).
        assert any(c == 320 and "cluster shutdown" in t for _n, c, t in p.closes), p.closes
        assert not any("another member" in t for _n, _c, t in p.closes), p.closes
    stops = [stop_records(brokers, n) for n in (1, 2, 3)]
    assert all(len(s) == 1 for s in stops), stops
    assert {s[0]["seq"] for s in stops} == {at}
    assert len({s[0]["digest"] for s in stops}) == 1, "same state at the stop point"
    assert {s[0]["scope"] for s in stops} == {"cluster"}


def test_member_stop_stops_one_member_and_the_others_serve_on(brokers: BrokerSet) -> None:
    target = member_of(brokers, 3)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpgbroker",
            "member",
            "stop",
            str(target),
            *brokers.cli_args(1),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"stopping member {target} at event ")
    assert wait_exit(brokers, 3) == 0
    s = wait_state(brokers, 1, lambda s: len(s["members"]) == 2)
    assert target not in [m["member"] for m in s["members"]]
    assert_serves(brokers, 1, 2, "after", 20)
    # A stop for a member that is not there is refused with the reason.
    code, answer = brokers.control(1, "/stop", {"member": 12345})
    assert code == 400 and "no serving member 12345" in answer["error"]


def test_fault_injection_is_refused_unless_configured(brokers: BrokerSet) -> None:
    code, answer = brokers.control(1, "/faults", {"kind": "apply-error", "at_seq": 10**9})
    assert code == 403 and "fault_injection" in answer["error"]


def test_watchdog_kills_a_hung_member_and_the_others_continue(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(extra_config="watchdog_timeout = 2\n")
    hung = member_of(bs, 3)
    s = bs.status(3)
    assert s is not None and s["watchdog"]["timeout"] == 2
    pub = ConfirmingPublisher(bs, [1], "load")
    pub.start()
    load_until(pub, 100)
    t0 = time.monotonic()
    os.kill(bs.procs[3].pid, signal.SIGSTOP)  # hung: alive, a CPG member, doing nothing
    assert wait_exit(bs, 3, timeout=20) == -signal.SIGKILL
    killed_after = time.monotonic() - t0
    assert killed_after < 2 + 5, killed_after
    # The others see it leave and go on confirming.
    wait_state(bs, 1, lambda s: hung not in [m["member"] for m in s["members"]])
    load_until(pub, 200)
    confirmed = pub.stop()
    bs.converged([1, 2])
    missing = set(confirmed) - set(drain_queue(bs, 2, "load"))
    assert not missing

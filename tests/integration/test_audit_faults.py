"""The audit checks a hot-standby fault run for unflagged duplicates: the fault loop
(``cpgbroker.dev.faultloop``) freezes the primary's corosync of a hot-standby cluster shipping
changes under a deep queue, its clients record their histories, and ``cpgbroker audit``, run
as an operator runs it on the members' event logs, the histories and the fault log, passes
every check, ``redelivered_flag`` first among them, having seen the duplicates the loop
counted: what the cut-off primary handed out and the new primary handed out again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from brokerclients import run_audit

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster
from cpgbroker.dev.faultloop import (
    DEEP_QUEUE,
    STANDBY_CHANGES,
    STOP_PRIMARY_COROSYNC,
    frozen_primary,
    run_fault_loop,
)
from prereq import require_spark

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.slow]

# Change batches are few next to client events (one per CPG round trip under load): with the
# default 10,000 a short run reaches no digest checkpoint, and replica consistency would be
# skipped rather than checked.
CHECKPOINT_EVERY = 500


def test_a_frozen_primarys_duplicates_audit_green(
    broker_set: Callable[..., BrokerSet], cluster: DevCluster, tmp_path: Path
) -> None:
    require_spark()
    bs = broker_set(
        store=True,
        fsync="always",
        cluster_options=STANDBY_CHANGES,
        extra_config=DEEP_QUEUE,
        checkpoint_every=CHECKPOINT_EVERY,
    )
    histories = tmp_path / "histories"
    started = time.time_ns()
    result = run_fault_loop(
        cluster,
        bs,
        frozen_primary(history_dir=str(histories)),
    )
    # The members flush their event logs as they stop.
    bs.stop_all()
    summary = {k: v for k, v in result.items() if k not in ("log_marks", "members")}
    print("fault loop:", json.dumps(summary, indent=1))  # shown by pytest when the test fails
    assert result["all_ready"] and result["digests_equal"], summary
    (fault,) = result["faults"]
    assert fault["kind"] == STOP_PRIMARY_COROSYNC and "skipped" not in fault, fault
    # Without duplicates there is nothing for the redelivered-flag check to judge.
    assert result["duplicates"] > 0, f"nothing exercised: the loop saw no duplicate: {summary}"

    proc, verdict = run_audit(bs, histories, started, tmp_path, timeout=900)
    checks = verdict["checks"]
    print("audit:", json.dumps({"checks": checks, "performance": verdict.get("performance")}))
    assert proc.returncode == 0, (proc.stderr[-3000:], json.dumps(checks, indent=1))
    assert verdict["ok"], verdict["failed"]
    assert {name: c["status"] for name, c in checks.items()} == dict.fromkeys(checks, "pass")
    assert checks["redelivered_flag"]["count"] == 0 and result["unflagged_duplicates"] == 0
    assert checks["lost"]["count"] == 0 and result["lost"] == 0
    assert checks["duplicated"]["count"] == 0
    # The freeze (a stop, then its resume) is the failure window the duplicates fall in.
    assert checks["duplicated"]["failure_windows"] >= 1
    assert checks["replica_consistency"]["compared"] >= 1
    assert len(checks["total_order"]["members"]) >= 3
    # The audit saw what the loop saw: every message, and each repeated delivery of one.
    perf = verdict["performance"]
    assert perf["confirmed"] == result["confirmed"], (perf, summary)
    assert perf["delivered"] == result["received"], (perf, summary)
    repeats = perf["deliveries"] - perf["delivered"]
    assert repeats == result["duplicates"] > 0, (perf, summary)

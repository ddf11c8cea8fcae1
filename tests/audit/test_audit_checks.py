"""The audit job on small generated runs (``histgen``): a clean run passes; each injected
violation is found exactly (which check, how many, which message or sequence number) and
nothing else is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import histgen
import pytest
from histgen import Run

pytestmark = pytest.mark.spark


def audit(spark: Any, tmp_path: Path, run: Run, *, report: bool = False) -> dict[str, Any]:
    from cpgbroker.audit import AuditConfig, run_audit

    d = run.write(tmp_path / "run")
    cfg = AuditConfig(
        out=str(tmp_path / "out"),
        events=[str(d)],
        history=[str(d)],
        faults=[str(d)],
        progress=False,
        report=report,
    )
    return run_audit(spark, cfg)


def failing(verdict: dict[str, Any]) -> set[str]:
    return {name for name, c in verdict["checks"].items() if c["status"] == "fail"}


def examples(verdict: dict[str, Any], check: str) -> list[tuple[str, int]]:
    return [(e["producer"], e["seq"]) for e in verdict["checks"][check]["examples"]]


@pytest.fixture(scope="module")
def clean() -> Run:
    return histgen.clean_run()


@pytest.fixture(scope="module")
def failover() -> Run:
    return histgen.clean_run(failover=True)


def test_clean_run_passes(spark: Any, tmp_path: Path, clean: Run) -> None:
    v = audit(spark, tmp_path, clean)
    assert v["ok"] and v["status"] == "pass", failing(v)
    assert set(v["checks"]) == {
        "replica_consistency",
        "total_order",
        "lost",
        "duplicated",
        "unexpected",
        "order",
        "redelivered_flag",
    }
    assert all(c["status"] == "pass" for c in v["checks"].values())
    rc = v["checks"]["replica_consistency"]
    assert rc["checkpoints"] == rc["compared"] > 5
    to = v["checks"]["total_order"]
    assert len(to["members"]) == 3 and to["overlap_all_members"][0] == 1
    perf = v["performance"]
    assert perf["published"] == perf["confirmed"] == perf["delivered"] == 120
    assert perf["deliveries"] == 120
    assert perf["latency_ms"]["p50"] == pytest.approx(1.0)
    assert perf["failover"] == []
    on_disk = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert on_disk["ok"] is True


def test_run_with_a_killed_member_passes_and_reports_its_failover(
    spark: Any, tmp_path: Path, failover: Run
) -> None:
    v = audit(spark, tmp_path, failover, report=True)
    assert v["ok"], (failing(v), v["checks"])
    # The killed member's partial last line is reported and ignored.
    problems = v["inputs"]["events"]["reported"]
    assert [(p["kind"], Path(p["file"]).parent.name) for p in problems] == [("partial-tail", "n3")]
    assert problems[0]["line"] == len(failover.events[3]) + 1
    # Three messages were held by the consumer on the dead member and delivered again.
    perf = v["performance"]
    assert perf["delivered"] == 120 and perf["deliveries"] == 120 + histgen.UNACKED_AT_KILL
    assert [(f["client"], f["action"], f["node"]) for f in perf["failover"]] == [
        ("consumer-1", "kill", 3)
    ]
    assert perf["failover"][0]["reconnect_gap_ms"] == pytest.approx(
        histgen.RECONNECT_AFTER / histgen.MS
    )
    assert perf["failover"][0]["resume_gap_ms"] > perf["failover"][0]["reconnect_gap_ms"]
    members = v["checks"]["total_order"]["members"]
    assert members[str(histgen.MEMBER[3])]["last_seq"] < members[str(histgen.MEMBER[1])]["last_seq"]
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4 and "kill" in html
    assert "http://" not in html and "https://" not in html  # self-contained
    tables = tmp_path / "out" / "tables"
    for name in (
        "messages",
        "violations",
        "throughput",
        "member_seconds",
        "checkpoints",
        "sessions",
        "failover",
    ):
        assert list((tables / name).glob("*.parquet")), name
    assert not (tables / "_staging").exists()


def test_a_lost_message_is_found_and_nothing_else(spark: Any, tmp_path: Path, clean: Run) -> None:
    run = clean.copy()
    key = histgen.lose(run)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"lost"}
    assert v["checks"]["lost"]["count"] == 1
    assert examples(v, "lost") == [key]


def test_a_duplicate_is_found_and_nothing_else(spark: Any, tmp_path: Path, clean: Run) -> None:
    run = clean.copy()
    key = histgen.duplicate(run)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"duplicated"}
    assert v["checks"]["duplicated"]["count"] == 1
    assert examples(v, "duplicated") == [key]
    assert "acked it" in v["checks"]["duplicated"]["examples"][0]["detail"]


def test_an_unexpected_delivery_is_found_and_nothing_else(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    run = clean.copy()
    key = histgen.unexpected(run)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"unexpected"}
    assert examples(v, "unexpected") == [key]


def test_a_divergent_digest_is_found_and_nothing_else(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    run = clean.copy()
    seq = histgen.diverge_digest(run, node=2)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"replica_consistency"}
    rc = v["checks"]["replica_consistency"]
    assert rc["divergent"] == 1
    first = rc["first_divergence"]
    assert first["seq"] == seq
    groups = sorted((set(g) for g in first["members_by_digest"].values()), key=len)
    assert groups == [{str(histgen.MEMBER[2])}, {str(histgen.MEMBER[n]) for n in (1, 3)}]
    assert first["last_agreed_checkpoint"] < seq
    assert {e["seq"] for e in first["events_around"]} <= set(range(seq - 6, seq + 1))
    assert len(first["events_around"]) > 0


def test_a_reordered_stream_is_found_and_nothing_else(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    run = clean.copy()
    a, b = histgen.reorder_stream(run, node=3, at=30)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"total_order"}
    to = v["checks"]["total_order"]
    assert to["first_divergence"]["seq"] == a
    # Both sequence numbers, as every member logged them.
    assert to["divergent_records"] == 2 * 3
    assert {(e["seq"], e["member"]) for e in to["examples"]} == {
        (s, str(histgen.MEMBER[n])) for s in (a, b) for n in histgen.NODES
    }
    assert to["gaps"] == to["duplicates"] == 0
    around = to["first_divergence"]["events_around"]
    assert {e["seq"] for e in around} == set(range(a - 3, a + 4))


def test_an_out_of_order_delivery_is_found_and_nothing_else(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    run = clean.copy()
    key = histgen.reorder_deliveries(run)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"order"}
    assert examples(v, "order") == [key]


def test_a_missing_redelivered_flag_is_found_and_nothing_else(
    spark: Any, tmp_path: Path, failover: Run
) -> None:
    run = failover.copy()
    key = histgen.drop_redelivered_flag(run)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"redelivered_flag"}
    assert examples(v, "redelivered_flag") == [key]
    assert "not flagged redelivered" in v["checks"]["redelivered_flag"]["examples"][0]["detail"]


def test_a_spurious_redelivered_flag_is_found_and_nothing_else(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    run = clean.copy()
    key = histgen.spurious_redelivered_flag(run)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"redelivered_flag"}
    assert examples(v, "redelivered_flag") == [key]


def test_a_member_that_rejoined_in_the_same_process_is_audited_as_a_new_replica(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    """After losing quorum a member rejoins with the same member id, its sequence numbers
    resuming at its update point: each incarnation is a stream of its own, without gaps."""
    run = clean.copy()
    first = histgen.rejoin(run, node=2)
    v = audit(spark, tmp_path, run)
    assert v["ok"], failing(v)
    members = v["checks"]["total_order"]["members"]
    old, new = str(histgen.MEMBER[2]), f"{histgen.MEMBER[2]}#2"
    assert members[old]["last_seq"] == first - 31 and members[old]["gaps"] == 0
    assert members[new]["first_seq"] == first and members[new]["gaps"] == 0
    assert v["checks"]["replica_consistency"]["compared"] > 0


def test_a_gap_in_one_replica_stream_is_found(spark: Any, tmp_path: Path, clean: Run) -> None:
    """The same log without the incarnation mark: one stream that skipped 30 events."""
    run = clean.copy()
    histgen.rejoin(run, node=2, mark=False)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"total_order"}
    to = v["checks"]["total_order"]
    assert to["gaps"] == 30 and to["members"][str(histgen.MEMBER[2])]["gaps"] == 30
    assert to["divergent_records"] == 0


def _duplicate_time(run: Run, key: tuple[str, int], to: str = "consumer-1") -> int:
    return next(r["t_ns"] for r in run.deliveries(to) if (r["producer"], r["seq"]) == key)


def test_a_duplicate_inside_a_failure_window_is_excused_and_outside_it_is_not(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    """The window alone decides: the earlier delivery was acked on a live connection."""
    run = clean.copy()
    key = histgen.duplicate(run)
    t = _duplicate_time(run, key)
    # Node 2 hung 2 s before the duplicate and came back 1 s before it: within the window.
    run.faults += [
        {"t_ns": t - 2_000 * histgen.MS, "action": "stop", "node": 2},
        {"t_ns": t - 1_000 * histgen.MS, "action": "resume", "node": 2},
    ]
    v = audit(spark, tmp_path / "inside", run)
    assert v["ok"], failing(v)
    assert v["checks"]["duplicated"]["failure_windows"] == 1

    from cpgbroker.audit import AuditConfig, run_audit

    # The same run with a 0.5 s settling time: the window closed before the duplicate.
    d = run.write(tmp_path / "outside" / "run")
    cfg = AuditConfig(
        out=str(tmp_path / "outside" / "out"),
        events=[str(d)],
        history=[str(d)],
        faults=[str(d)],
        progress=False,
        report=False,
        failure_window_s=0.5,
    )
    v = run_audit(spark, cfg)
    assert failing(v) == {"duplicated"}
    assert examples(v, "duplicated") == [key]

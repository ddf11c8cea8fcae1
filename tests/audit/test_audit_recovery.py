"""The audit job on a generated run with a whole-cluster restart (``histgen.recovery_run``):
every member killed at once, the cluster back from member 2's store. A clean recovery passes
and the restart is reported; a confirmed persistent message on a durable queue that does not
come back is lost, named; a transient one may vanish."""

from __future__ import annotations

from html import escape as html_escape
from pathlib import Path
from typing import Any

import histgen
import pytest
from histgen import Run
from test_audit_checks import audit, examples, failing

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def recovery() -> Run:
    return histgen.recovery_run()


def _checkpoint_seqs(run: Run, members: dict[int, int]) -> set[int]:
    ids = set(members.values())
    return {
        r["seq"]
        for recs in run.events.values()
        for r in recs
        if r["type"] == "checkpoint" and r["member"] in ids
    }


def test_a_clean_recovery_passes_and_the_restart_is_reported(
    spark: Any, tmp_path: Path, recovery: Run
) -> None:
    run = recovery
    meta = run.meta
    # What makes this run hard: the sequence numbers after the recovered event name other
    # events (and other states) before and after the restart.
    shared = _checkpoint_seqs(run, histgen.MEMBER) & _checkpoint_seqs(run, histgen.NEW_MEMBER)
    assert shared and min(shared) > meta["recovered_seq"]

    v = audit(spark, tmp_path, run, report=True)
    assert v["ok"], (failing(v), v["checks"])
    [r] = v["restarts"]
    assert r["era"] == 1
    assert r["member"] == histgen.NEW_MEMBER[histgen.RESUMED_NODE]
    assert r["recovered_seq"] == meta["recovered_seq"]
    assert r["previous_last_seq"] == meta["previous_last_seq"]
    assert r["rolled_back"] == meta["previous_last_seq"] - meta["recovered_seq"] > 0
    assert 0 <= r["t_ns"] - meta["t_back"] < histgen.MS  # as member 2 logged it
    assert r["down_from_ns"] == meta["down_from"]  # the last kill: the logs end before it
    assert r["down_s"] == pytest.approx(histgen.DOWN / 1e9, abs=1e-3)
    assert sorted(r["replicas"]) == sorted(str(m) for m in histgen.NEW_MEMBER.values())
    assert r["summary"].startswith("whole-cluster restart at ")
    assert f"down for 3.0 s, recovered event {meta['recovered_seq']} from member" in r["summary"]

    to = v["checks"]["total_order"]
    assert [(e["era"], sorted(e["replicas"])) for e in to["eras"]] == [
        (0, sorted(str(m) for m in histgen.MEMBER.values())),
        (1, sorted(str(m) for m in histgen.NEW_MEMBER.values())),
    ]
    assert to["members"][str(r["member"])]["first_seq"] == meta["recovered_seq"] + 1
    assert to["divergent_records"] == to["gaps"] == to["duplicates"] == 0
    rc = v["checks"]["replica_consistency"]
    assert rc["divergent"] == 0 and rc["compared"] > 10

    # The transient message waiting in the queue at the kill is gone: allowed.
    assert v["checks"]["lost"]["dropped_by_restart"] == len(meta["transient_dropped"]) == 1
    # Every client lost its connection when the cluster went down and came back after it.
    gaps = [g for g in v["performance"]["failover"] if g["action"] == "cluster-restart"]
    assert sorted(g["client"] for g in gaps) == sorted([*histgen.PRODUCERS, *histgen.CONSUMERS])
    assert all(g["reconnect_gap_ms"] > histgen.DOWN / histgen.MS for g in gaps), gaps
    assert all(g["resume_gap_ms"] >= g["reconnect_gap_ms"] for g in gaps), gaps
    # The kill -9 left node 3's log torn where the new process appended: reported.
    assert [p["kind"] for p in v["inputs"]["events"]["reported"]] == ["torn-line"]
    html = (tmp_path / "out" / "report.html").read_text()
    assert "Whole-cluster restarts" in html and html_escape(r["summary"]) in html


@pytest.mark.parametrize("where", ["queued", "held"])
def test_a_confirmed_persistent_message_lost_across_the_restart_is_found(
    spark: Any, tmp_path: Path, recovery: Run, where: str
) -> None:
    """``queued``: never delivered; ``held``: delivered before the kill, never acked, and never
    delivered again."""
    run = recovery.copy()
    key = tuple(run.meta[where][0])
    histgen.drop_after_restart(run, key)  # type: ignore[arg-type]
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"lost"}
    assert examples(v, "lost") == [key]
    detail = v["checks"]["lost"]["examples"][0]["detail"]
    assert "published before the whole-cluster restart" in detail
    assert "(persistent, durable queue)" in detail
    if where == "held":
        assert "never acknowledged" in detail


@pytest.mark.parametrize("field", ["persistent", "durable"])
def test_a_transient_message_lost_across_the_restart_passes(
    spark: Any, tmp_path: Path, recovery: Run, field: str
) -> None:
    """Not persistent, or for a queue that is not durable: a restart may drop it."""
    run = recovery.copy()
    key = tuple(run.meta["queued"][0])
    histgen.publish_record(run, key)[field] = False  # type: ignore[arg-type]
    histgen.drop_after_restart(run, key)  # type: ignore[arg-type]
    v = audit(spark, tmp_path, run)
    assert v["ok"], (failing(v), v["checks"]["lost"])
    assert v["checks"]["lost"]["dropped_by_restart"] == 2


def test_a_history_that_did_not_record_persistence_cannot_excuse_a_loss(
    spark: Any, tmp_path: Path, recovery: Run
) -> None:
    """Histories of an older recorder: every message is taken as one a restart must keep, so
    the transient message the restart dropped counts as lost."""
    run = recovery.copy()
    histgen.forget_persistence(run)
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"lost"}
    assert examples(v, "lost") == [tuple(k) for k in run.meta["transient_dropped"]]
    assert "persistence not recorded" in v["checks"]["lost"]["examples"][0]["detail"]


def test_only_a_delivery_the_restart_forgot_may_come_back_unflagged(
    spark: Any, tmp_path: Path, recovery: Run
) -> None:
    """The forgotten delivery (after the recovered event) comes back unflagged in the clean
    run; a held message delivered before the recovered event must come back flagged."""
    run = recovery.copy()
    key = tuple(run.meta["held"][0])
    assert key != tuple(run.meta["forgotten"])
    again = [
        r
        for r in run.history["consumer-1"]
        if r["op"] == "deliver" and (r["producer"], r["seq"]) == key and r["redelivered"]
    ]
    again[0]["redelivered"] = False
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"redelivered_flag"}
    assert examples(v, "redelivered_flag") == [key]


def test_a_divergence_after_the_restart_is_found_in_its_era(
    spark: Any, tmp_path: Path, recovery: Run
) -> None:
    run = recovery.copy()
    node = 3
    cps = [
        r
        for r in run.events[node]
        if r["type"] == "checkpoint" and r["member"] == histgen.NEW_MEMBER[node]
    ]
    cps[3]["digest"] = "0" * 64
    v = audit(spark, tmp_path, run)
    assert failing(v) == {"replica_consistency"}
    first = v["checks"]["replica_consistency"]["first_divergence"]
    assert (first["era"], first["seq"]) == (1, cps[3]["seq"])
    assert first["last_agreed_checkpoint"] > run.meta["recovered_seq"]
    assert v["checks"]["replica_consistency"]["examples"][0]["detail"].startswith("era 1: ")

"""Truncated and malformed inputs, and the command line's exit status and output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import histgen
import pytest
from histgen import Run

pytestmark = pytest.mark.spark


def config(tmp_path: Path, d: Path, **kw: Any) -> Any:
    from cpgbroker.audit import AuditConfig

    return AuditConfig(
        out=str(tmp_path / "out"),
        events=[str(d)],
        history=[str(d)],
        faults=[str(d)],
        progress=False,
        report=False,
        **kw,
    )


@pytest.fixture(scope="module")
def clean() -> Run:
    return histgen.clean_run(messages=40)


def test_a_corrupt_line_in_the_middle_is_an_error_naming_file_and_line(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    from cpgbroker.audit import InputError, run_audit

    run = clean.copy()
    run.raw_lines[2] = {17: '{"seq": 16, "t_ns": oops}'}
    d = run.write(tmp_path / "run")
    with pytest.raises(InputError) as e:
        run_audit(spark, config(tmp_path, d))
    # Line 18: the 17 records before it, then the bad one.
    assert f"{d / 'n2' / 'broker.events.jsonl'}:18:" in str(e.value)
    assert "oops" in str(e.value)


def test_a_record_missing_a_required_field_is_malformed(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    from cpgbroker.audit import InputError, run_audit

    run = clean.copy()
    del run.history["consumer-0"][3]["producer"]
    d = run.write(tmp_path / "run")
    with pytest.raises(InputError, match=r"consumer-0\.history\.jsonl:4: malformed history"):
        run_audit(spark, config(tmp_path, d))


def test_partial_tails_are_reported_and_ignored(spark: Any, tmp_path: Path, clean: Run) -> None:
    from cpgbroker.audit import run_audit

    run = clean.copy()
    run.partial_tail[1] = '{"seq":999,"t_ns":17'
    d = run.write(tmp_path / "run")
    # A client killed mid-write too.
    hist = d / "clients" / "producer-0.history.jsonl"
    hist.write_text(hist.read_text() + '{"op":"publish","client":"prod')
    v = run_audit(spark, config(tmp_path, d))
    assert v["ok"], v["failed"]
    ev = v["inputs"]["events"]
    assert ev["problems"] == {"partial-tail": 1}
    assert ev["reported"][0]["line"] == len(run.events[1]) + 1
    hi = v["inputs"]["history"]
    assert [(p["kind"], p["file"], p["line"]) for p in hi["reported"]] == [
        ("partial-tail", str(hist), len(run.history["producer-0"]) + 1)
    ]


def test_a_torn_line_from_a_restarted_writer_is_reported_and_its_record_kept(
    spark: Any, tmp_path: Path, clean: Run
) -> None:
    """A member killed mid-line and started again appends to the same file: the partial record
    and the new process's first record share a line."""
    from cpgbroker.audit import run_audit

    run = clean.copy()
    newcomer = (3 << 22) | 999
    hello = {"seq": 0, "t_ns": histgen.T0 + 1, "member": newcomer, "sender": newcomer,
             "type": "hello", "status": "needs-update"}  # fmt: skip
    run.raw_lines[3] = {len(run.events[3]): '{"seq":77,"t_ns":1750' + json.dumps(hello)}
    run.events[3].append({**hello, "t_ns": histgen.T0 + 2})  # and a whole line after it
    d = run.write(tmp_path / "run")
    v = run_audit(spark, config(tmp_path, d, keep_staging=True))
    assert v["ok"], v["failed"]
    reported = v["inputs"]["events"]["reported"]
    assert [(p["kind"], p["line"]) for p in reported] == [("torn-line", len(run.events[3]))]
    staged = spark.read.parquet(f"{v['outputs']['tables']}/_staging/events")
    assert staged.where(f"member = {newcomer}").count() == 2


def test_a_missing_input_path_is_an_error(spark: Any, tmp_path: Path) -> None:
    from cpgbroker.audit import AuditConfig, InputError, run_audit

    cfg = AuditConfig(out=str(tmp_path / "out"), history=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(InputError, match=r"nope\.jsonl"):
        run_audit(spark, cfg)


def test_only_histories_skips_the_event_checks(spark: Any, tmp_path: Path, clean: Run) -> None:
    from cpgbroker.audit import AuditConfig, run_audit

    d = clean.write(tmp_path / "run")
    cfg = AuditConfig(out=str(tmp_path / "out"), history=[str(d / "clients")], progress=False)
    v = run_audit(spark, cfg)
    assert v["ok"]
    statuses = {name: c["status"] for name, c in v["checks"].items()}
    assert statuses.pop("replica_consistency") == statuses.pop("total_order") == "skipped"
    assert set(statuses.values()) == {"pass"}
    assert v["checks"]["total_order"]["reason"] == "no member event log was given"


def test_command_line_exit_status_and_json(
    spark: Any, tmp_path: Path, clean: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 on a pass, 1 on a violation (with the verdict on stdout), 2 when the input cannot be
    trusted. In-process: the command line reuses the test session and leaves it running."""
    from cpgbroker.audit.cli import main

    bad = clean.copy()
    key = histgen.lose(bad)
    d = bad.write(tmp_path / "lost")
    out = tmp_path / "out-lost"
    assert main([str(d), "--out", str(out), "--quiet", "--no-report"]) == 1
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["failed"] == ["lost"]
    assert [(e["producer"], e["seq"]) for e in verdict["checks"]["lost"]["examples"]] == [key]
    assert json.loads((out / "verdict.json").read_text()) == verdict

    corrupt = clean.copy()
    corrupt.raw_lines[1] = {5: "garbage"}
    d = corrupt.write(tmp_path / "corrupt")
    assert main([str(d), "--out", str(tmp_path / "out-corrupt"), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "error"
    assert "broker.events.jsonl:6:" in captured.err

    # Without --quiet a person gets the verdict in a few lines on stderr.
    assert main([str(clean.write(tmp_path / "clean")), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    summary = err[err.index("audit: PASS") :].splitlines()
    assert summary[1:8] == [
        f"  {name:<20} pass"
        for name in (
            "replica_consistency",
            "total_order",
            "lost",
            "duplicated",
            "unexpected",
            "order",
            "redelivered_flag",
        )
    ]
    assert summary[8].startswith("  messages: 40 published, 40 confirmed, 40 delivered")
    assert summary[-1] == f"  report: {tmp_path / 'o' / 'report.html'}"

    assert main(["--out", str(tmp_path / "x")]) == 2  # nothing to audit
    assert spark.range(1).count() == 1  # still running

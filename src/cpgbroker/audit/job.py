"""The audit job: stage the inputs, run every check, write the tables, the verdict and the
report. :func:`run_audit` is the library entry point; ``cpgbroker audit`` (``cli.py``) wraps it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cpgbroker.audit import delivery, events, ingest, perf, restarts
from cpgbroker.audit.common import EXAMPLES, NS_PER_S, empty_violations, rows
from cpgbroker.audit.progress import Progress

DELIVERY_CHECKS = ("lost", "duplicated", "unexpected", "order", "redelivered_flag")
STEPS = 12
TABLES = (
    "violations",
    "messages",
    "sessions",
    "checkpoints",
    "member_seconds",
    "throughput",
    "failover",
)
NO_EVENTS = "no member event log was given"
NO_HISTORY = "no client history was given"


@attrs.frozen
class AuditConfig:
    """What to audit and where the results go.

    ``events``, ``history``, ``faults``: paths (local or any Hadoop file system URI): a
    directory is read recursively for ``*.events.jsonl`` / ``*.history.jsonl`` /
    ``*faults.jsonl``; a file or a glob is read as given. ``out``: local directory for
    ``verdict.json`` and ``report.html``. ``tables``: where the Parquet tables go (default
    ``<out>/tables``). ``failure_window_s``: how long after a fault (or after its member came
    back, for a stop or partition) redeliveries and duplicates are expected.
    """

    out: str
    events: Sequence[str] = ()
    history: Sequence[str] = ()
    faults: Sequence[str] = ()
    tables: str | None = None
    failure_window_s: float = 10.0
    report: bool = True
    keep_staging: bool = False
    progress: bool = True

    @property
    def tables_path(self) -> str:
        if self.tables:
            return self.tables.rstrip("/")
        return str(Path(self.out).resolve() / "tables")


def _delete(spark: SparkSession, path: str) -> None:
    jvm: Any = spark.sparkContext._jvm
    jsc: Any = spark.sparkContext._jsc
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    hpath.getFileSystem(jsc.hadoopConfiguration()).delete(hpath, True)


def _summarise_violations(spark: SparkSession, path: str) -> dict[str, dict[str, Any]]:
    """Count per kind and the first examples of each (by time), from the written table."""
    table = spark.read.parquet(path)
    counts = {r["kind"]: int(r["count"]) for r in table.groupBy("kind").count().collect()}
    k = F.row_number().over(Window.partitionBy("kind").orderBy("t_ns", "seq", "member"))
    examples: dict[str, list[dict[str, Any]]] = {}
    for r in rows(table.select("*", k.alias("k")).where(F.col("k") <= EXAMPLES).drop("k")):
        examples.setdefault(r["kind"], []).append({c: v for c, v in r.items() if c != "kind"})
    return {kind: {"count": n, "examples": examples.get(kind, [])} for kind, n in counts.items()}


def run_audit(spark: SparkSession, cfg: AuditConfig) -> dict[str, Any]:
    """Audit a cluster run; return the verdict (also written to ``<out>/verdict.json``).

    Raises :class:`~cpgbroker.audit.ingest.InputError` for an input that cannot be trusted
    (a corrupt line in the middle of a file, a path that does not exist)."""
    staging = f"{cfg.tables_path}/_staging"
    try:
        return _audit(spark, cfg, staging)
    finally:
        if not cfg.keep_staging:
            _delete(spark, staging)


def _audit(spark: SparkSession, cfg: AuditConfig, staging: str) -> dict[str, Any]:
    started = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tables = cfg.tables_path
    settle_ns = int(cfg.failure_window_s * NS_PER_S)
    progress = Progress(spark.sparkContext, STEPS, enabled=cfg.progress)

    # A reused --out must not show the tables of an earlier run next to this one's (a table
    # whose input this run lacks would otherwise survive).
    for name in TABLES:
        _delete(spark, f"{tables}/{name}")
    staged: dict[str, ingest.Staged | None] = {}
    for kind, paths in (("events", cfg.events), ("history", cfg.history), ("faults", cfg.faults)):
        with progress.step(f"read {kind}"):
            staged[kind] = (
                ingest.stage(spark, kind, list(paths), f"{staging}/{kind}") if paths else None
            )
            st = staged[kind]
            if st is not None:
                progress.note(f"  {kind}: {st.records} records in {len(st.files)} files")
    ev_st, hi_st, fa_st = staged["events"], staged["history"], staged["faults"]
    if not any(st is not None and st.records for st in (ev_st, hi_st)):
        # Passing on nothing would prove nothing: a wrong directory or file name is an error.
        raise ingest.InputError(
            "found no event log (*.events.jsonl) and no client history (*.history.jsonl) "
            f"records in {sorted({*cfg.events, *cfg.history})}"
        )
    fault_rows: list[dict[str, Any]] = []
    if fa_st is not None and fa_st.records:
        fault_rows = rows(
            delivery.load(spark, fa_st.path)
            .select("t_ns", "action", "node", "url", "member")
            .orderBy("t_ns"),
            limit=delivery.MAX_FAULTS,
        )
    windows = delivery.failure_windows(fault_rows, settle_ns)

    checks: dict[str, dict[str, Any]] = {}
    found: list[DataFrame] = []
    member_seconds: list[dict[str, Any]] = []
    ev = events.load(spark, ev_st.path) if ev_st is not None and ev_st.records else None
    restart_list: list[restarts.Restart] = []
    with progress.step("replica consistency"):
        if ev is None:
            checks["replica_consistency"] = {"status": "skipped", "reason": NO_EVENTS}
        else:
            # Whole-cluster restarts cut the run into eras, compared each on its own.
            ev, restart_list = restarts.with_eras(spark, ev, fault_rows)
            for r in restart_list:
                progress.note(f"  {r.describe()}")
            checks["replica_consistency"], bad = events.replica_consistency(spark, ev, tables)
            found.extend([bad] if bad is not None else [])
    with progress.step("total order and member lag"):
        if ev is None:
            checks["total_order"] = {"status": "skipped", "reason": NO_EVENTS}
        else:
            checks["total_order"], member_seconds, bad = events.total_order(spark, ev, tables)
            found.extend([bad] if bad is not None else [])

    hist = delivery.load(spark, hi_st.path) if hi_st is not None and hi_st.records else None
    context: dict[str, Any] = {}
    with progress.step("messages"):
        if hist is not None:
            delivery.messages(hist, tables)
    with progress.step("client sessions"):
        if hist is not None:
            delivery.sessions(hist, tables)
    all_windows = windows + delivery.restart_windows(restart_list, settle_ns)
    with progress.step("delivery checks"):
        if hist is not None:
            result, bad_list = delivery.checks(
                spark, hist, tables, all_windows, settle_ns, restart_list
            )
            context = result["context"]
            found.extend(bad_list)

    with progress.step("violations table"):
        table = empty_violations(spark)
        for df in found:
            table = table.unionByName(df)
        table.write.mode("overwrite").parquet(f"{tables}/violations")
        by_kind = _summarise_violations(spark, f"{tables}/violations")
    for name in DELIVERY_CHECKS:
        v = by_kind.get(name, {"count": 0, "examples": []})
        checks[name] = {
            "status": "skipped" if hist is None else ("fail" if v["count"] else "pass"),
            **v,
            **({"reason": NO_HISTORY} if hist is None else {}),
        }
    # The check and the kind of violation it writes.
    for name, kind in (
        ("replica_consistency", "replica_divergence"),
        ("total_order", "total_order"),
    ):
        if kind in by_kind:
            checks[name]["examples"] = by_kind[kind]["examples"]
    checks["duplicated"]["failure_windows"] = context.get("failure_windows", len(all_windows))
    if restart_list:
        # Confirmed messages a restart may drop (transient, or for a non-durable queue).
        checks["lost"]["dropped_by_restart"] = context.get("dropped_by_restart", 0)
    checks["redelivered_flag"]["first_disturbance_ns"] = context.get("first_disturbance_ns")

    performance: dict[str, Any] = {}
    series: list[dict[str, Any]] = []
    with progress.step("throughput and latency"):
        if hist is not None:
            performance.update(perf.throughput(spark, tables))
            series = perf.plot_series(spark, tables)
    with progress.step("failover gaps"):
        performance["failover"] = (
            perf.failover(spark, hist, tables, fault_rows, windows, restart_list, settle_ns)
            if hist is not None
            else []
        )

    starts = [s.t_min for s in staged.values() if s is not None and s.t_min is not None]
    ends = [s.t_max for s in staged.values() if s is not None and s.t_max is not None]
    failed = [n for n, c in checks.items() if c["status"] == "fail"]
    verdict: dict[str, Any] = {
        "ok": not failed,
        "status": "fail" if failed else "pass",
        "failed": failed,
        "error": None,
        "checks": checks,
        # Whole-cluster restarts found in the event logs (docs/audit.md, "Whole-cluster
        # restarts").
        "restarts": [r.as_dict() for r in restart_list],
        "inputs": {
            **{k: (s.summary() if s is not None else None) for k, s in staged.items()},
            "t_start_ns": min(starts) if starts else None,
            "t_end_ns": max(ends) if ends else None,
            "failure_window_s": cfg.failure_window_s,
        },
        "performance": performance,
        "spark": {"master": spark.sparkContext.master, "version": spark.version},
        "outputs": {
            "verdict": str(out / "verdict.json"),
            "report": str(out / "report.html") if cfg.report else None,
            "tables": tables,
        },
    }
    with progress.step("report"):
        verdict["timings_s"] = {**progress.timings, "total": round(time.monotonic() - started, 3)}
        if cfg.report:
            from cpgbroker.audit import report

            (out / "report.html").write_text(
                report.render(verdict, series, member_seconds, fault_rows)
            )
    (out / "verdict.json").write_text(json.dumps(verdict, indent=2) + "\n")
    return verdict


def error_verdict(cfg: AuditConfig, error: str) -> dict[str, Any]:
    """The verdict of an audit that could not run to the end (written like any other)."""
    out = Path(cfg.out)
    verdict = {"ok": False, "status": "error", "failed": [], "error": error, "checks": {}}
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "verdict.json").write_text(json.dumps(verdict, indent=2) + "\n")
    except OSError:
        pass  # the error may be this very directory; the verdict also goes to stdout
    return verdict

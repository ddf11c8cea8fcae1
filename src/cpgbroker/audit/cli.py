"""``cpgbroker audit``: the command line of the audit job.

Exit status: 0 when every check passed, 1 when one found a violation, 2 when the audit could
not run (a corrupt input, a missing path, no Spark).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_PASS, EXIT_VIOLATION, EXIT_ERROR = 0, 1, 2


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def summary(verdict: dict[str, Any]) -> str:
    """The verdict in a few lines for a person (the JSON on stdout is for programs)."""
    lines = [f"audit: {verdict['status'].upper()}"]
    for name, check in verdict.get("checks", {}).items():
        extra = f", {check['count']} found" if check.get("count") else ""
        if check.get("reason"):
            extra += f" ({check['reason']})"
        lines.append(f"  {name:<20} {check['status']}{extra}")
    perf = verdict.get("performance", {})
    if perf.get("published") is not None:
        lat = perf.get("latency_ms") or {}
        lines.append(
            f"  messages: {perf['published']} published, {perf.get('confirmed')} confirmed, "
            f"{perf.get('delivered')} delivered ({perf.get('deliveries')} deliveries); "
            f"latency p50 {_ms(lat.get('p50'))}, p99 {_ms(lat.get('p99'))}"
        )
    for r in verdict.get("restarts", []):
        lines.append(f"  {r['summary']}")
    for gap in perf.get("failover", []):
        what = gap["action"] if gap["node"] is None else f"{gap['action']} of node {gap['node']}"
        lines.append(
            f"  failover: {gap['client']} after {what}: "
            f"reconnected in {_ms(gap['reconnect_gap_ms'])}, resumed in {_ms(gap['resume_gap_ms'])}"
        )
    outputs = verdict.get("outputs", {})
    if outputs.get("report"):
        lines.append(f"  report: {outputs['report']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpgbroker audit",
        description=(
            "Audit a cluster run from the members' event logs, the clients' histories and the "
            "fault-injection log (a PySpark job). Prints the verdict as JSON."
        ),
    )
    p.add_argument(
        "run_dir",
        nargs="*",
        help="directories holding a run's *.events.jsonl, *.history.jsonl and faults.jsonl "
        "(searched recursively), e.g. a dev cluster's state directory",
    )
    p.add_argument("--events", action="append", default=[], help="event log file, glob or dir")
    p.add_argument("--history", action="append", default=[], help="history file, glob or dir")
    p.add_argument("--faults", action="append", default=[], help="fault log file, glob or dir")
    p.add_argument("--out", default="audit-out", help="directory for verdict.json, report.html")
    p.add_argument("--tables", help="where the Parquet tables go (default OUT/tables; any URI)")
    p.add_argument(
        "--failure-window",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long after a fault (or its end) redeliveries are expected (default 10)",
    )
    p.add_argument(
        "--master", help="Spark master (default: standard Spark settings, else local[*])"
    )
    p.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting, e.g. spark.driver.memory=4g (repeatable)",
    )
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.add_argument("--keep-staging", action="store_true", help="keep the parsed inputs (Parquet)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    conf: dict[str, str] = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"cpgbroker audit: --conf wants KEY=VALUE, not {item!r}", file=sys.stderr)
            return EXIT_ERROR
        conf[key] = value
    events = [*args.events, *args.run_dir]
    history = [*args.history, *args.run_dir]
    faults = [*args.faults, *args.run_dir]
    if not (events or history):
        print(
            "cpgbroker audit: nothing to audit: give a run directory, --events or --history",
            file=sys.stderr,
        )
        return EXIT_ERROR
    try:
        from pyspark.sql import SparkSession

        if not args.no_report:
            import matplotlib  # noqa: F401 - the report needs it: fail before any work is done

        from cpgbroker.audit import AuditConfig, InputError, get_session, run_audit
        from cpgbroker.audit.job import error_verdict
    except ImportError as e:
        print(
            f"cpgbroker audit: needs the audit extra (pip install 'cpgbroker[audit]') and Java "
            f"17+: {e}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    cfg = AuditConfig(
        out=args.out,
        events=events,
        history=history,
        faults=faults,
        tables=args.tables,
        failure_window_s=args.failure_window,
        report=not args.no_report,
        keep_staging=args.keep_staging,
        progress=not args.quiet,
    )
    # Called from a program that already has a session: use it, and leave it running.
    ours = SparkSession.getActiveSession() is None
    try:
        spark = get_session(args.master, conf)
    except Exception as e:  # Java missing, a bad master URL: pyspark's own exception types vary
        print(f"cpgbroker audit: cannot start Spark: {e}", file=sys.stderr)
        return EXIT_ERROR
    try:
        try:
            verdict = run_audit(spark, cfg)
        except Exception as e:
            # Exit 1 means "a check found a violation": anything that stopped the audit itself
            # (a corrupt input, an unwritable --out, a Spark failure) is an error, status 2.
            text = str(e) if isinstance(e, InputError) else f"{type(e).__name__}: {e}"
            verdict = error_verdict(cfg, text)
            print(json.dumps(verdict, indent=2))
            print(f"cpgbroker audit: {text}", file=sys.stderr)
            return EXIT_ERROR
    finally:
        if ours:
            spark.stop()
    print(json.dumps(verdict, indent=2))
    if not args.quiet:
        print(summary(verdict), file=sys.stderr)
    if not verdict["ok"]:
        print(f"cpgbroker audit: FAILED: {', '.join(verdict['failed'])}", file=sys.stderr)
        return EXIT_VIOLATION
    return EXIT_PASS

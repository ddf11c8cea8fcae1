"""Scale benchmark of ``cpgbroker audit``: generate a clean run of N client-history rows (and
the three members' event logs of the same run), audit it with the real command line, and print
JSON with the job's runtime and peak memory.

    python bench/audit_bench.py --rows 1000000
    python bench/audit_bench.py --rows 1000000 --rows 10000000 --rows 100000000   # linearity

Each message makes four history rows (publish, confirm, deliver, ack) and, per member,
``--events-per-message`` event-log rows (plus a digest checkpoint every 10,000 events), so
``--rows 100000000`` is 25 million messages, 100 million history rows and 75 million event rows.
Generation runs in its own Spark process (local[2], writing JSON lines like the real writers);
the audit runs as ``python -m cpgbroker audit --master local[2]`` in another, whose whole process
tree (the Python driver and its JVM) is sampled for resident memory every 0.2 s. Runtime is the
audit's wall time (JVM start included) and the job's own total. Disk: about 230 bytes per
history row for inputs and staging; ``--workdir`` chooses where (default: a temporary
directory, removed afterwards unless ``--keep``).

Never run two benchmarks at once on a 2-core machine: the numbers would measure each other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

NS = 1_000_000_000
T0 = 1_750_000_000 * NS
CHECKPOINT_EVERY = 10_000


def generate(out: Path, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """Write the run (runs inside the generator subprocess, which has Spark)."""
    from pyspark.sql import functions as F

    from cpgbroker.audit.session import get_session

    spark = get_session(
        args.master, {"spark.ui.showConsoleProgress": "false"}, app_name="audit-bench-gen"
    )
    members = args.members
    P, C = args.producers, args.consumers
    messages = rows // 4
    step = NS // args.rate  # ns between two publishes
    parts = max(2, messages // 1_000_000)
    member_id = F.element_at(
        F.array(*[F.lit((m << 22) | (100 + m)) for m in range(1, members + 1)]), F.col("m") + 1
    )

    def url(m: Any) -> Any:
        return F.concat(F.lit("amqp://127.0.0.1:"), (m + 5701).cast("string"), F.lit("/"))

    i = F.col("id")
    p, seq = i % P, (i / P).cast("long")
    c = seq % C
    k = (seq / C).cast("long") * P + p
    t = F.lit(T0) + i * step

    def rec(**fields: Any) -> Any:
        cols = {
            "op": None, "client": None, "n": None, "t_ns": None, "session": F.lit(1),
            "member": None, "producer": None, "seq": None, "queue": None, "confirms": None,
            "outcome": None, "consumer": None, "redelivered": None,
        }  # fmt: skip
        cols.update(fields)
        types = {"n": "long", "t_ns": "long", "session": "long", "seq": "long",
                 "confirms": "boolean", "redelivered": "boolean"}  # fmt: skip
        return F.struct(
            *[
                (F.lit(None) if v is None else v).cast(types.get(name, "string")).alias(name)
                for name, v in cols.items()
            ]
        )

    producer = F.concat(F.lit("p"), p.cast("string"))
    pclient = F.concat(F.lit("producer-"), p.cast("string"))
    cclient = F.concat(F.lit("consumer-"), c.cast("string"))
    msgs = spark.range(0, messages, numPartitions=parts).withColumn("m", p % members)
    history = msgs.select(
        F.explode(
            F.array(
                rec(
                    op=F.lit("publish"),
                    client=pclient,
                    n=1 + 2 * seq,
                    t_ns=t,
                    member=url(F.col("m")),
                    producer=producer,
                    seq=seq,
                    queue=F.lit("q"),
                    confirms=F.lit(True),
                ),
                rec(
                    op=F.lit("confirm"),
                    client=pclient,
                    n=2 + 2 * seq,
                    t_ns=t + 2_000_000,
                    producer=producer,
                    seq=seq,
                    outcome=F.lit("ack"),
                ),
                rec(
                    op=F.lit("deliver"),
                    client=cclient,
                    n=1 + 2 * k,
                    t_ns=t + 3_000_000,
                    member=url((c + 1) % members),
                    producer=producer,
                    seq=seq,
                    queue=F.lit("q"),
                    consumer=cclient,
                    redelivered=F.lit(False),
                ),
                rec(
                    op=F.lit("ack"),
                    client=cclient,
                    n=2 + 2 * k,
                    t_ns=t + 3_500_000,
                    producer=producer,
                    seq=seq,
                    queue=F.lit("q"),
                    consumer=cclient,
                ),
            )
        ).alias("r")
    )
    conns = spark.createDataFrame(
        [(f"producer-{x}", x % members) for x in range(P)]
        + [(f"consumer-{x}", (x + 1) % members) for x in range(C)],
        "client string, m int",
    ).select(
        rec(op=F.lit("connect"), client=F.col("client"), n=F.lit(0), t_ns=F.lit(T0 - NS),
            member=url(F.col("m"))).alias("r")
    )  # fmt: skip
    _write_json(history.unionByName(conns), out / "history", "history")

    epm = args.events_per_message
    n_events = messages * epm
    estep = max(1, step // epm)
    ev = spark.range(1, n_events + 1, numPartitions=parts).select(
        F.col("id").alias("seq"), F.explode(F.sequence(F.lit(0), F.lit(members - 1))).alias("m")
    )
    events = ev.select(
        F.struct(
            F.col("seq"),
            (F.lit(T0) + (F.col("seq") - 1) * estep + F.col("m") * 20_000).alias("t_ns"),
            member_id.alias("member"),
            (F.lit(1 << 22) + F.col("seq") % members).alias("sender"),
            F.lit("data").alias("type"),
            (F.lit(1000) + F.col("seq") % 16).alias("conn"),
            F.lit(100).alias("size"),
        ).alias("r")
    )
    cps = spark.range(1, n_events // CHECKPOINT_EVERY + 1).select(
        (F.col("id") * CHECKPOINT_EVERY).alias("seq"),
        F.explode(F.sequence(F.lit(0), F.lit(members - 1))).alias("m"),
    )
    checkpoints = cps.select(
        F.struct(
            F.lit("checkpoint").alias("type"),
            F.col("seq"),
            F.sha2(F.col("seq").cast("string"), 256).alias("digest"),
            member_id.alias("member"),
            (F.lit(T0) + F.col("seq") * estep + 1).alias("t_ns"),
        ).alias("r")
    )
    _write_json(events, out / "events", "events")
    _write_json(checkpoints, out / "checkpoints", "events")
    spark.stop()
    return {
        "messages": messages,
        "history_rows": messages * 4 + P + C,
        "event_rows": n_events * members + (n_events // CHECKPOINT_EVERY) * members,
    }


def _write_json(df: Any, where: Path, kind: str) -> None:
    from pyspark.sql import functions as F

    df.select(F.to_json("r").alias("value")).write.mode("overwrite").text(str(where))
    # Named like the writers' files, so a directory is found by `cpgbroker audit`.
    for f in where.glob("part-*.txt"):
        f.rename(f.with_name(f.name.removesuffix(".txt") + f".{kind}.jsonl"))


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass  # the process ended between the listing and the read
    return total


def audit(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = work / "out"
    cmd = [
        sys.executable, "-m", "cpgbroker", "audit", "--out", str(out), "--master", args.master,
        "--events", str(work / "events"), "--events", str(work / "checkpoints"),
        "--history", str(work / "history"), "--no-report",
    ]  # fmt: skip
    for c in args.conf:
        cmd += ["--conf", c]
    peak = 0
    t = time.monotonic()
    with open(work / "audit.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.2):
                peak = max(peak, _tree_rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        done.set()
        sampler.join()
    wall = time.monotonic() - t
    verdict = json.loads((out / "verdict.json").read_text())
    return {
        "exit": rc,
        "ok": verdict.get("ok"),
        "wall_s": round(wall, 1),
        "job_s": verdict.get("timings_s", {}).get("total"),
        "steps_s": {k: v for k, v in verdict.get("timings_s", {}).items() if k != "total"},
        "peak_rss_mb": round(peak / 2**20),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, action="append", help="history rows (repeatable)")
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--consumers", type=int, default=8)
    ap.add_argument("--events-per-message", type=int, default=1)
    ap.add_argument("--rate", type=int, default=20_000, help="messages per second in the run")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--conf", action="append", default=[], help="Spark KEY=VALUE for the audit")
    ap.add_argument("--workdir", type=Path, help="where inputs and outputs go")
    ap.add_argument("--keep", action="store_true", help="keep the generated run")
    ap.add_argument("--generate-only", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = args.rows or [1_000_000]
    if args.generate_only:  # the generator subprocess
        print(json.dumps(generate(args.generate_only, sizes[0], args)))
        return 0
    results = []
    base = args.workdir or Path(tempfile.mkdtemp(prefix="audit-bench-"))
    try:
        for rows in sizes:
            work = base / f"rows-{rows}"
            work.mkdir(parents=True, exist_ok=True)
            t = time.monotonic()
            gen = subprocess.run(
                [sys.executable, __file__, "--generate-only", str(work), "--rows", str(rows),
                 "--members", str(args.members), "--producers", str(args.producers),
                 "--consumers", str(args.consumers), "--rate", str(args.rate),
                 "--events-per-message", str(args.events_per_message),
                 "--master", args.master],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            info = json.loads(gen.stdout.strip().splitlines()[-1])
            info["generate_s"] = round(time.monotonic() - t, 1)
            info["input_bytes"] = sum(
                f.stat().st_size for f in work.rglob("*.jsonl") if f.is_file()
            )
            info.update(audit(work, args))
            info["rows"] = rows
            info["history_rows_per_s"] = round(rows / info["job_s"]) if info["job_s"] else None
            results.append(info)
            print(json.dumps(info), file=sys.stderr, flush=True)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "master": args.master, "conf": args.conf},
        "runs": results,
    }
    if len(results) >= 2:
        a, b = results[0], results[-1]
        out["scaling"] = {
            "rows_ratio": round(b["rows"] / a["rows"], 2),
            "job_time_ratio": round(b["job_s"] / a["job_s"], 2),
            "seconds_per_million_rows": [round(r["job_s"] / (r["rows"] / 1e6), 2) for r in results],
        }
    print(json.dumps(out, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

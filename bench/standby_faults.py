"""A fault loop against a 3-member cluster under confirmed, acked load; prints JSON and a table.

    python bench/standby_faults.py                          # 5 runs of 100 s, hot standby
                                                            # shipping changes
    python bench/standby_faults.py --runs 1 --seconds 60
    python bench/standby_faults.py --replication bytes      # hot standby shipping bytes
    python bench/standby_faults.py --mode active-active
    python bench/standby_faults.py --faults stop_primary_corosync --interval 10
    python bench/standby_faults.py --consume-rate 1500 --queue-flow 0   # a deep queue
    python bench/standby_faults.py --runs 1 --seconds 30 --audit audit-runs  # and audit it
    python bench/standby_faults.py --broker rabbitmq        # a RabbitMQ quorum queue instead

A 3-node dev cluster (corosync in namespaces, token ``--token`` ms), a fresh broker set of
3 members per run with stores (``fsync = "always"``) and ``[cluster] mode`` and
``replication`` as asked. Each run (``cpgbroker.dev.faultloop``): ``--producers`` producers
and ``--consumers`` consumers, one connection each, all in this process, every one given all
three URLs, with persistent ``--size``-byte messages on one durable queue, publisher confirms
(at most ``--window`` unconfirmed per producer) and manual acks (prefetch ``--prefetch``); a
producer never republishes (each message carries its run, producer and sequence number).
One fault every ``--interval`` seconds for ``--seconds``, the kinds in turn: SIGKILL of the
primary's broker (started again 3 s later), SIGSTOP of the primary's corosync for 4 s, a
5 s partition of the primary's node, SIGKILL of a backup's corosync (started again 2 s
later, its broker too if it died with it). In active-active mode "the primary" is the member
most clients are on. Then everything is healed, every member must become ready, and the
consumers drain the queue.

What a primary cut off (frozen corosync, partition) duplicates is what it hands its consumers
meanwhile of the messages its backups already hold, so the figure grows with the queue: with
the default queue flow (``[limits] queue_flow_messages``, 1,000 ready messages) and consumers
that keep up, the queue stands shallow. ``--consume-rate`` (deliveries per second per consumer
while publishing) below the producers' rate and ``--queue-flow 0`` let it stand deep,
as behind slow consumers.

``--broker rabbitmq``: the same clients, load and schedule against a 3-node RabbitMQ cluster
(Debian's ``rabbitmq-server``) and one quorum queue, one RabbitMQ node in each of the dev
cluster's node namespaces (``cpgbroker.dev.rabbitnodes``; fresh nodes per run), reached on
127.0.0.1 as our members are. "The primary" is the queue's Raft leader. The faults: SIGKILL of
the leader's node (started again 3 s later); SIGSTOP of the leader's node itself for 4 s
(RabbitMQ has no membership daemon of its own to freeze); a 5 s partition of the leader's
node namespace (its clients still reach it, as in our partition); SIGKILL of a follower's node
(started again 2 s later). ``--mode``, ``--replication``, ``--fsync``, ``--queue-flow`` and
``--audit`` are ours only; RabbitMQ runs with its defaults (a quorum queue fsyncs its log).
Run the brokers one after the other in one sitting to compare them: the machine is shared.

Reported per run: confirmed; lost (confirmed, never received); duplicates; duplicates
without the redelivered flag (a message delivered again as if for the first time: AMQP never
allows it); the longest time no consumer received anything and no producer got a confirm
(while publishing); whether every member became ready and their digests agree; each fault
with the primary at that moment and the duplicates that followed it; the members' log lines
where roles changed. Root only (namespaces). Never run two benchmarks at once on a 2-core
machine: the numbers would measure each other.

``--audit DIR``: the members also write their event logs, every client records its history
under ``DIR/runN/histories``, and after each run ``cpgbroker audit`` checks it as an operator
would run it (the members' event logs, the histories and the run's part of the dev cluster's
fault log, copied to ``DIR/runN/faults.jsonl``; verdict and report in ``DIR/runN/audit``). The
run's JSON gets ``audit``: the verdict's status, each check's status and count of violations,
and the repeated deliveries the audit saw (which should be the run's ``duplicates``); the
table a column with the verdict. The members then also digest their state every 2,000
events (for the audit's replica consistency check). The audit (Spark, ``local[2]``) runs after
the brokers have stopped, so it measures nothing of the run, but it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster
from cpgbroker.dev.faultloop import FAULT_KINDS, FaultLoopOptions, run_fault_loop, table
from cpgbroker.dev.rabbitnodes import RabbitFaultLoop, RabbitNodes

# What the summary keeps of each run (the full result, faults and log lines included, is
# printed as the run ends).
SUMMARY_KEYS = (
    "confirmed",
    "nacked",
    "lost",
    "duplicates",
    "unflagged_duplicates",
    "redelivered",
    "longest_consumer_gap_s",
    "longest_confirm_gap_s",
    "published",
    "received",
    "all_ready",
    "digests_equal",
)
# The audit of a 100 s run (a few million history records) takes minutes on 2 cores.
AUDIT_TIMEOUT_S = 3600.0
# Members digest their state every this many events when audited: hot standby shipping changes
# logs one event per change batch (about 100 a second under this load), so the default
# (10,000) would leave a run with a checkpoint or none, and replica consistency unchecked.
AUDIT_CHECKPOINT_EVERY = 2000


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def audit(bs: BrokerSet, run_dir: Path, started_ns: int) -> dict[str, Any]:
    """Run ``cpgbroker audit`` on one run (its brokers stopped, so their event logs are
    complete), as an operator would: the members' event logs, the clients' histories and the
    fault log from ``started_ns`` on (the dev cluster's log holds every run's faults). What
    the run's JSON keeps of the verdict."""
    faults = run_dir / "faults.jsonl"
    lines = (bs.dc.base / "faults.jsonl").read_text().splitlines()
    faults.write_text(
        "".join(line + "\n" for line in lines if json.loads(line)["t_ns"] >= started_ns)
    )
    out = run_dir / "audit"
    cmd = [sys.executable, "-m", "cpgbroker", "audit", "--out", str(out), "--master", "local[2]"]
    cmd += ["--conf", "spark.sql.shuffle.partitions=4", "--history", str(run_dir / "histories")]
    cmd += ["--faults", str(faults)]
    for n in sorted(bs.ports):
        cmd += ["--events", str(bs.event_log_path(n))]
    t = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=AUDIT_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"no verdict within {AUDIT_TIMEOUT_S:.0f} s"}
    result: dict[str, Any] = {"exit": proc.returncode, "audit_s": round(time.monotonic() - t, 1)}
    try:
        verdict: dict[str, Any] = json.loads((out / "verdict.json").read_text())
    except (OSError, ValueError):
        # No verdict written (Spark would not start, say): what it said instead.
        return {**result, "status": "error", "error": proc.stderr[-2000:]}
    checks: dict[str, Any] = verdict.get("checks", {})
    perf: dict[str, Any] = verdict.get("performance", {})
    result.update(
        {
            "status": verdict.get("status"),
            "failed": verdict.get("failed", []),
            "error": verdict.get("error"),
            "checks": {name: c.get("status") for name, c in checks.items()},
            "violations": {name: c["count"] for name, c in checks.items() if c.get("count")},
            "failure_windows": checks.get("duplicated", {}).get("failure_windows"),
            # Deliveries beyond the first of each message: the audit's count of the run's
            # duplicates, to set beside the loop's own.
            "repeat_deliveries": (
                perf["deliveries"] - perf["delivered"]
                if perf.get("deliveries") is not None and perf.get("delivered") is not None
                else None
            ),
            "out": str(out),
        }
    )
    return result


def loop_options(args: argparse.Namespace, history_dir: Path | None) -> FaultLoopOptions:
    return FaultLoopOptions(
        seconds=args.seconds,
        interval=args.interval,
        faults=tuple(args.faults.split(",")),
        producers=args.producers,
        consumers=args.consumers,
        body_size=args.size,
        confirm_window=args.window,
        prefetch=args.prefetch,
        backlog=args.backlog,
        consume_rate=args.consume_rate,
        history_dir=None if history_dir is None else str(history_dir),
    )


def label(args: argparse.Namespace, version: str | None = None) -> str:
    """What the table calls the brokers of a run."""
    if args.broker == "rabbitmq":
        return f"RabbitMQ {version or ''} quorum queue".replace("  ", " ")
    if args.mode == "hot-standby":
        return f"cpgbroker hot standby ({args.replication})"
    return "cpgbroker active-active"


def rabbit_run(dc: DevCluster, i: int, args: argparse.Namespace) -> dict[str, Any]:
    rn = RabbitNodes(dc)
    try:
        rn.start_all()
        version = rn.version()
        t = time.monotonic()
        out = trio.run(RabbitFaultLoop(dc, rn, loop_options(args, None), log=log).run)
        out["run_s"] = round(time.monotonic() - t, 1)
        out["version"] = version
        out["label"] = label(args, version)
        out["logs"] = {str(n): str(rn.log_path(n)) for n in rn.nodes}
    finally:
        rn.stop_all()
    return out


def one_run(dc: DevCluster, i: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.broker == "rabbitmq":
        return rabbit_run(dc, i, args)
    options = f'mode = "{args.mode}"'
    if args.mode == "hot-standby":
        options += f'\nreplication = "{args.replication}"'
    run_dir = Path(args.audit, f"run{i}") if args.audit else None
    bs = BrokerSet(
        dc,
        group=f"faults-{os.getpid() % 100000}-{i}",
        name=f"broker-r{i}",
        # The audit reads the members' event logs; without it they would only cost.
        event_log=run_dir is not None,
        checkpoint_every=None if run_dir is None else AUDIT_CHECKPOINT_EVERY,
        store=True,
        fsync=args.fsync,
        cluster_options=options,
        extra_config=""
        if args.queue_flow is None
        else f"\n[limits]\nqueue_flow_messages = {args.queue_flow}\n",
    )
    try:
        bs.start_all(timeout=90)
        opt = loop_options(args, None if run_dir is None else run_dir / "histories")
        started_ns = time.time_ns()
        t = time.monotonic()
        out = run_fault_loop(dc, bs, opt, log=log)
        out["run_s"] = round(time.monotonic() - t, 1)
        out["label"] = label(args)
        out["logs"] = {str(n): str(bs.log_path(n)) for n in (1, 2, 3)}
    finally:
        bs.stop_all()
    if run_dir is not None:
        log(f"auditing run {i} into {run_dir}")
        out["audit"] = audit(bs, run_dir, started_ns)
        log(f"audit of run {i}: {out['audit'].get('status')} {out['audit'].get('failed') or ''}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=100.0, help="length of each run's load")
    ap.add_argument("--interval", type=float, default=8.0, help="seconds between faults")
    ap.add_argument(
        "--faults",
        default=",".join(FAULT_KINDS),
        help=f"fault kinds in turn, comma-separated (of {', '.join(FAULT_KINDS)})",
    )
    ap.add_argument(
        "--broker",
        choices=("cpgbroker", "rabbitmq"),
        default="cpgbroker",
        help="the brokers under test: ours, or a 3-node RabbitMQ cluster with a quorum queue",
    )
    ap.add_argument("--mode", choices=("hot-standby", "active-active"), default="hot-standby")
    ap.add_argument("--replication", choices=("changes", "bytes"), default="changes")
    ap.add_argument("--fsync", default="always", help='[store] fsync (default "always")')
    ap.add_argument("--token", type=int, default=1000, help="corosync token (ms)")
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--consumers", type=int, default=3)
    ap.add_argument("--size", type=int, default=512, help="message body bytes")
    ap.add_argument("--window", type=int, default=64, help="unconfirmed publishes per producer")
    ap.add_argument("--prefetch", type=int, default=100)
    ap.add_argument(
        "--backlog",
        type=int,
        default=0,
        help="confirmed messages queued before the consumers start (a standing queue)",
    )
    ap.add_argument(
        "--consume-rate",
        type=float,
        default=None,
        help="deliveries per second each consumer takes at most while publishing",
    )
    ap.add_argument(
        "--queue-flow",
        type=int,
        default=None,
        help="[limits] queue_flow_messages (0: off, so a queue may stand deep under consumers)",
    )
    ap.add_argument(
        "--audit",
        metavar="DIR",
        help="record the clients' histories and the members' event logs, and audit each run "
        "(cpgbroker audit) into DIR/runN",
    )
    ap.add_argument(
        "--keep-logs",
        metavar="DIR",
        help="copy each run's member logs into DIR (the cluster's own go with it)",
    )
    args = ap.parse_args()
    if args.broker == "rabbitmq" and args.audit:
        ap.error("--audit needs our members' event logs: not with --broker rabbitmq")
    rows: list[dict[str, Any]] = []
    dc = DevCluster(3, prefix=f"sfbench-{os.getpid() % 100000}", token_ms=args.token)
    with dc:
        for i in range(1, args.runs + 1):
            log(f"run {i}/{args.runs}: {label(args)}, {args.seconds:g} s")
            # Each run starts from a whole cluster: a run that left a member broken would
            # otherwise hand its faults to the next.
            dc.repair(timeout=60)
            out = one_run(dc, i, args)
            out["run"] = i
            rows.append(out)
            print(json.dumps(out, indent=2), flush=True)
            if args.keep_logs:
                # The cluster's directory goes with it: copy the logs out before the end.
                keep = os.path.join(args.keep_logs, f"run{i}")
                os.makedirs(keep, exist_ok=True)
                for n, path in out["logs"].items():
                    dst_path = os.path.join(keep, f"member{n}.log")
                    with open(path, "rb") as src, open(dst_path, "wb") as dst:
                        dst.write(src.read())
                log(f"logs of run {i} kept in {keep}")
    rabbit = args.broker == "rabbitmq"
    summary = {
        "broker": rows[0].get("label") if rows else label(args),
        "mode": None if rabbit else args.mode,
        "replication": args.replication if args.mode == "hot-standby" and not rabbit else None,
        "seconds": args.seconds,
        "interval_s": args.interval,
        "faults": args.faults.split(","),
        "corosync_token_ms": args.token,
        "window": args.window,
        "backlog": args.backlog,
        "consume_rate": args.consume_rate,
        "queue_flow_messages": None if rabbit else args.queue_flow,
        "runs": [
            {
                "run": r["run"],
                **{k: r[k] for k in SUMMARY_KEYS},
                **(
                    {"audit": {k: r["audit"].get(k) for k in ("status", "checks", "violations")}}
                    if "audit" in r
                    else {}
                ),
            }
            for r in rows
        ],
    }
    print(json.dumps(summary, indent=2))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

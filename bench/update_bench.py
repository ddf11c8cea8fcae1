"""State update of a newcomer while the cluster serves; prints JSON.

    python bench/update_bench.py [--messages 1000000] [--size 100] [--seconds 40]

Needs root (a 3-node corosync cluster in network namespaces, see ``cpgbroker devcluster``).
Steps: fill a queue with ``--messages`` confirmed messages; start a steady confirmed
publisher on member 1 and a consumer on member 2 (the shared ``amqp_load.py``, per-second
rates); after a third of the run, kill member 3's broker and start it again, so it joins
through a state update of the whole queue. Reported: the update's duration, size and rate,
the newcomer's peak memory, and the old members' throughput during the update as a fraction
of before it. Never run two benchmarks at once on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOAD = ROOT.parent / "shared" / "bench" / "amqp_load.py"
CPGB = [sys.executable, "-m", "cpgbroker"]


def installed_transfer(log: str) -> dict[str, Any] | None:
    """What the last state update a member's log reports installing transferred."""
    inst = re.findall(
        r"state update installed seq=\d+ messages=(\d+) parts=(\d+) ([\d.]+) MiB in ([\d.]+) s",
        log,
    )
    if not inst:
        return None
    messages, parts, mib, seconds = inst[-1]
    return {
        "messages": int(messages),
        "parts": int(parts),
        "mib": float(mib),
        "seconds": float(seconds),
    }


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument(
        "--rate", type=float, default=0, help="steady load msg/s (0: as fast as it goes)"
    )
    ap.add_argument("--prefix", default="ubench")
    ap.add_argument("--base-port", type=int, default=5951)
    ap.add_argument("--load", default=str(LOAD), help="path of amqp_load.py")
    args = ap.parse_args()

    from cpgbroker.dev.brokers import BrokerSet
    from cpgbroker.dev.cluster import DevCluster

    subprocess.run([*CPGB, "devcluster", "down", "--prefix", args.prefix], capture_output=True)
    sh(
        *CPGB,
        "devcluster",
        "up",
        "--nodes",
        "3",
        "--with-brokers",
        "--prefix",
        args.prefix,
        "--base-port",
        str(args.base_port),
    )
    out: dict[str, Any] = {"messages": args.messages, "size": args.size}
    try:
        state_dir = json.loads(
            sh(*CPGB, "devcluster", "status", "--prefix", args.prefix, "--json")
        )["state_dir"]
        dc = DevCluster.load(args.prefix, str(Path(state_dir).parent))
        bs = BrokerSet.load(dc)
        assert bs is not None
        url = bs.url
        t = time.monotonic()
        per = args.messages // 2
        subprocess.run(
            [
                sys.executable,
                args.load,
                "--url",
                url(1),
                "--url",
                url(2),
                "--producers",
                "2",
                "--consumers",
                "0",
                "--count",
                str(per),
                "--confirm",
                "--size",
                str(args.size),
                "--queue",
                "big",
                "--drain-timeout",
                "5",
            ],
            check=False,
            capture_output=True,
        )
        out["fill_seconds"] = round(time.monotonic() - t, 1)
        out["queued"] = bs.status(1)["queues"]["/:big"]["ready"]  # type: ignore[index]

        load = subprocess.Popen(
            [
                sys.executable,
                args.load,
                "--url",
                url(1),
                "--url",
                url(2),
                "--producers",
                "1",
                "--consumers",
                "1",
                "--seconds",
                str(args.seconds),
                "--confirm",
                "--size",
                "1024",
                "--queue",
                "live",
                "--progress",
                *(["--rate", str(args.rate)] if args.rate else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        t0 = time.time()
        time.sleep(args.seconds / 3)
        bs.kill(3)
        time.sleep(1)
        t_join = time.time()
        bs.start(3)
        peak = 0
        while True:
            s = bs.status(3)
            pid = bs.pid(3)
            if pid:
                try:
                    m = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
                    peak = max(peak, int(m.group(1)) if m else 0)
                except OSError:
                    pass
            if s is not None and s.get("state") == "ready":
                break
            assert time.time() - t_join < 600, "newcomer not ready in 600 s"
            time.sleep(0.1)
        t_ready = time.time()
        report = json.loads(load.communicate()[0])
        log = bs.log_path(3).read_text(errors="replace")
        out["update"] = {
            "join_to_ready_seconds": round(t_ready - t_join, 2),
            "transfer": installed_transfer(log),
            "newcomer_peak_rss_mib": round(peak / 1024, 1),
            "progress_log_lines": len(re.findall("receiving state update", log)),
        }
        prog = report.get("progress", [])
        before = [p["recv_rate"] for p in prog if 2 <= p["t"] < (t_join - t0) - 1]
        during = [p["recv_rate"] for p in prog if (t_join - t0) + 1 <= p["t"] < (t_ready - t0)]
        avg = lambda xs: round(sum(xs) / len(xs)) if xs else None  # noqa: E731
        out["old_members"] = {
            "msg_per_s_before": avg(before),
            "msg_per_s_during_update": avg(during),
            "fraction": round(avg(during) / avg(before), 2) if before and during else None,
            "min_second_during": min(during) if during else None,
            "load_ok": report.get("ok"),
            "lost": report.get("lost"),
        }
        # Digesting a million messages on demand takes longer than a status request may, so
        # agreement is read from the members' own digest checkpoints after the join.
        deadline = time.time() + 120
        out["checkpoint_agreed"] = None
        while time.time() < deadline:
            cps = [(bs.status(n) or {}).get("checkpoint") for n in (1, 2, 3)]
            if all(cps) and len({(c["seq"], c["digest"]) for c in cps}) == 1 and cps[0]["agreed"]:
                out["checkpoint_agreed"] = cps[0]["seq"]
                break
            time.sleep(1)
    except Exception as e:  # still print what was measured
        out["error"] = repr(e)
    finally:
        subprocess.run([*CPGB, "devcluster", "down", "--prefix", args.prefix], capture_output=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Upgrading a cluster of release 0.1.0 to the current code; prints JSON.

    python bench/upgrade_bench.py                          # rolling upgrade under load
    python bench/upgrade_bench.py --seconds 20 --mode hot-standby
    python bench/upgrade_bench.py --full-stop 1000000      # upgrade after a full stop

A 3-member dev cluster (corosync in namespaces, root only), every member with a store (fsync
always), started on release 0.1.0 as tests/upgrade/releases.toml names it, built from this
repository's history (``cpgbroker.dev.releases``).

Rolling (default):

* **Longest wait of a client.** A probe client publishes a persistent 1 KiB message with a
  confirm every 5 ms, given every member's URL with the member about to go first; the longest
  time between two of its confirms is measured around each step, while the shared load
  generator keeps a moderate load (``--rate``) on the cluster: first a *failover* (SIGKILL of
  the member, restarted on the same release), then each member in turn *upgraded* (stopped
  cleanly, started on the current code), then ``cluster upgrade-finish``.
* **Throughput**, 1 KiB persistent messages with confirms, 4 producers and 4 consumers spread
  over the members that serve (hot standby: the primary; the shared ``amqp_load.py`` does not
  follow a new primary, so there is no background load there), ``--seconds`` each: every
  member on 0.1.0, one and two members upgraded (mixed), all upgraded at model version 7, and
  at 8 after ``upgrade-finish``. ``mixed_vs_unmixed`` is the mixed clusters' rate over the
  all-0.1.0 one.

``--full-stop N``: N persistent 1 KiB messages published with confirms on 0.1.0, every member
killed with SIGKILL, the stores copied aside; then the time until a client is served (the
queue reports N messages and hands one out), first with the members started again on 0.1.0
(the same version recovering its own store), then, from the copies, on the current code (the
upgrade).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from cpgbroker import __version__
from cpgbroker.dev import releases
from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster
from cpgbroker.runtime.federation.client import AmqpClient, AmqpClientError

ROOT = Path(__file__).resolve().parents[1]
OLD = "0.1.0"
QUEUE = "upgrade_bench"
PROBE = "upgrade_bench_probe"
BODY = b"p" * 1024


def old_python() -> str:
    for r in releases.load(ROOT / releases.RELEASES_FILE):
        if r.version == OLD:
            return str(releases.build(r, ROOT))
    raise SystemExit(f"release {OLD} is not in {releases.RELEASES_FILE}")


def serving(bs: BrokerSet) -> list[int]:
    """The members that take clients: every member, or (hot standby) the primary alone."""
    p = primary(bs)
    s = bs.status(p)
    return [p] if s is not None and s.get("role") == "primary" else [1, 2, 3]


def load(shared: Path, bs: BrokerSet, seconds: float) -> dict[str, Any]:
    """The shared load generator against the members that serve; its report's rates."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(shared / "bench" / "amqp_load.py")]
    for n in serving(bs):
        cmd += ["--url", bs.url(n)]
    cmd += ["--queue", QUEUE, "--size", "1024", "--confirm", "--persistent", "--durable"]
    cmd += ["--producers", "4", "--consumers", "4", "--seconds", str(seconds)]
    cmd += ["--json-out", out, "--drain-timeout", "60"]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    try:
        r: dict[str, Any] = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        return {"error": "the load generator wrote no report"}
    keys = ("publish_rate", "confirmed", "lost", "duplicates", "publish_latency_ms")
    return {k: r.get(k) for k in keys if k in r}


async def probe_gap(bs: BrokerSet, first: int, action: Any, after: float) -> float:
    """The longest time between two confirms of a probe client connected to ``first`` (the
    others as its failover list), from just before ``action`` (run in a thread) until
    ``after`` seconds after it."""
    urls = [bs.url(first)] + [bs.url(n) for n in (1, 2, 3) if n != first]
    confirms: list[float] = []
    done = trio.Event()

    async def client() -> None:
        while not done.is_set():
            try:
                conn = await AmqpClient.connect(urls, timeout=5.0, heartbeat=10)
                async with conn:
                    ch = await conn.channel()
                    await ch.queue_declare(PROBE, durable=True)
                    await ch.confirm_select()
                    while not done.is_set():
                        c = await ch.publish("", PROBE, BODY)
                        if c is not None and await c.wait():
                            confirms.append(trio.current_time())
                        await trio.sleep(0.005)
            except (AmqpClientError, OSError, trio.TooSlowError):
                await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        while len(confirms) < 20:
            await trio.sleep(0.05)
        start = trio.current_time()
        await trio.to_thread.run_sync(action)
        await trio.sleep(after)
        done.set()
        nursery.cancel_scope.cancel()
    times = [start, *[t for t in confirms if t > start]]
    return round(max(b - a for a, b in itertools.pairwise(times)), 3)


def primary(bs: BrokerSet) -> int:
    """The member clients are served by (active-active: member 3, as any)."""
    for n in (1, 2, 3):
        s = bs.status(n)
        if s is not None and s.get("role") == "primary":
            return n
    return 3


def finish(bs: BrokerSet, node: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "cpgbroker", "cluster", "upgrade-finish", *bs.cli_args(node)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return (out.stdout + out.stderr).strip()


def rolling(args: argparse.Namespace, old: str) -> dict[str, Any]:
    options = 'mode = "hot-standby"\nreplication = "changes"' if args.mode == "hot-standby" else ""
    dc = DevCluster(3, prefix=f"upbench-{os.getpid() % 100000}", token_ms=args.token)
    out: dict[str, Any] = {"mode": args.mode, "from": OLD, "to": __version__}
    with dc:
        bs = BrokerSet(dc, event_log=False, store=True, python=old, cluster_options=options)
        bs.start_all()
        try:
            rates: dict[str, Any] = {"all_0.1.0": load(args.shared, bs, args.seconds)}
            gaps: dict[str, float] = {}

            def kill_restart(n: int, python: str, kill: bool) -> Any:
                def act() -> None:
                    if kill:
                        bs.kill(n)
                    else:
                        bs.stop(n)
                    bs.set_python(n, python)
                    bs.start(n)
                    bs.wait_ready([n], timeout=120)

                return act

            def background() -> subprocess.Popen[bytes] | None:
                if args.mode == "hot-standby":
                    return None  # (the shared generator does not follow a new primary)
                cmd = [sys.executable, str(args.shared / "bench" / "amqp_load.py")]
                for n in (1, 2, 3):
                    cmd += ["--url", bs.url(n)]
                cmd += ["--queue", QUEUE, "--size", "1024", "--confirm", "--persistent"]
                cmd += ["--durable", "--producers", "1", "--consumers", "1"]
                cmd += ["--rate", str(args.rate), "--seconds", "600"]
                # Its own process group: the generator runs its clients as child processes.
                return subprocess.Popen(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )

            def stop(p: subprocess.Popen[bytes] | None) -> None:
                if p is None:
                    return
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
                p.wait()

            bg = background()
            try:
                time.sleep(2)
                # The member whose loss clients feel: hot standby, the primary.
                victim = primary(bs)
                gaps[f"failover_member_{victim}"] = trio.run(
                    probe_gap, bs, victim, kill_restart(victim, old, True), args.after
                )
                # Hot standby: the backups first, the primary last (its clients move once).
                first = primary(bs)
                for i, n in enumerate([m for m in (1, 2, 3) if m != first] + [first]):
                    gaps[f"upgrade_member_{n}"] = trio.run(
                        probe_gap, bs, n, kill_restart(n, sys.executable, False), args.after
                    )
                    if i < 2:
                        stop(bg)
                        rates[f"mixed_{i + 1}_upgraded"] = load(args.shared, bs, args.seconds)
                        bg = background()
                        time.sleep(2)
            finally:
                stop(bg)
            rates["all_upgraded_model_7"] = load(args.shared, bs, args.seconds)
            out["upgrade_finish"] = finish(bs, primary(bs))
            rates["all_upgraded_model_8"] = load(args.shared, bs, args.seconds)
            out["throughput"] = rates
            out["longest_client_wait_s"] = gaps
            unmixed = rates["all_0.1.0"].get("publish_rate") or 0
            out["mixed_vs_unmixed"] = {
                k: round((rates[k].get("publish_rate") or 0) / unmixed, 3) if unmixed else None
                for k in ("mixed_1_upgraded", "mixed_2_upgraded", "all_upgraded_model_7")
            }
            out["digest_agreed"] = bool(bs.converged([1, 2, 3], timeout=60))
        finally:
            bs.stop_all()
    return out


def full_stop(args: argparse.Namespace, old: str) -> dict[str, Any]:
    from recovery_bench import publish, wait_served  # the same fill and the same check

    n = args.full_stop
    dc = DevCluster(3, prefix=f"upbench-{os.getpid() % 100000}", token_ms=3000)
    out: dict[str, Any] = {"messages": n, "size": 1024, "from": OLD, "to": __version__}
    aside = Path(tempfile.mkdtemp(prefix="upbench-stores-"))
    with dc:
        mark = max(2 * n * 1100, 512 * 2**20)
        bs = BrokerSet(
            dc,
            event_log=False,
            store=True,
            python=old,
            extra_config=f"\n[limits]\nhigh_watermark_bytes = {mark}\n",
        )
        bs.start_all()
        urls = [bs.url(i) for i in (1, 2, 3)]
        try:
            out["publish"] = publish(args.shared, urls[0], n, None)
            for i in (1, 2, 3):
                bs.kill(i)
            for i in (1, 2, 3):
                shutil.copytree(bs.store_path(i), aside / str(i))
            out["store_mib"] = round(
                sum(f.stat().st_size for f in (aside / "1").glob("*")) / 2**20, 1
            )
            for label, python in (("same_version_0.1.0", old), ("upgrade_to_current", None)):
                if python is None:
                    for i in (1, 2, 3):
                        bs.kill(i)
                        shutil.rmtree(bs.store_path(i))
                        shutil.copytree(aside / str(i), bs.store_path(i))
                        bs.set_python(i, sys.executable)
                t0 = time.monotonic()
                for i in (1, 2, 3):
                    bs.start(i)
                wait_served(urls, n, 1800)
                served = round(time.monotonic() - t0, 1)
                bs.wait_ready([1, 2, 3], timeout=1800)
                out[label] = {
                    "seconds_until_served": served,
                    "seconds_until_all_members_ready": round(time.monotonic() - t0, 1),
                }
            out["upgrade_vs_same_version"] = round(
                out["upgrade_to_current"]["seconds_until_served"]
                / max(out["same_version_0.1.0"]["seconds_until_served"], 0.1),
                2,
            )
        finally:
            bs.stop_all()
            shutil.rmtree(aside, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["active-active", "hot-standby"], default="active-active")
    ap.add_argument("--seconds", type=float, default=15.0, help="each throughput measurement")
    ap.add_argument("--rate", type=int, default=2000, help="background msg/s during the steps")
    ap.add_argument("--after", type=float, default=6.0, help="seconds probed after each step")
    ap.add_argument("--token", type=int, default=1000, help="corosync token (ms)")
    ap.add_argument("--full-stop", type=int, default=0, metavar="N", help="messages stored")
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    old = old_python()
    result = full_stop(args, old) if args.full_stop else rolling(args, old)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

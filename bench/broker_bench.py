"""Broker throughput and latency, side by side with RabbitMQ in one run; prints JSON.

    python bench/broker_bench.py                      # standalone cpgbroker only
    python bench/broker_bench.py --rabbitmq           # + RabbitMQ single node, same configs
    python bench/broker_bench.py --cluster            # 3-member cluster (root: namespaces)
    python bench/broker_bench.py --cluster --rabbitmq # + RabbitMQ 3-node quorum queues
    python bench/broker_bench.py --cluster --realtime --only q_rate1000_1K_confirm --repeat 5
    python bench/broker_bench.py --cluster --store --rabbitmq   # durable: stores on, persistent
                                                                 # messages on a durable queue
    python bench/broker_bench.py --cluster --tls --only q_1p1c_1K_confirm  # amqp and amqps
    python bench/broker_bench.py --cluster --tls --rabbitmq --only q_1p1c_1K_confirm
                                  # + RabbitMQ 3-node quorum over amqp and amqps (one cluster)
    python bench/broker_bench.py --cluster --plaintext-ring --only q_1p1c_1K_confirm
                                  # corosync without crypto_cipher/crypto_hash
    python bench/broker_bench.py --cluster --hot-standby --rabbitmq
                                  # [cluster] mode = "hot-standby": every client on the primary
    python bench/broker_bench.py --cluster --hot-standby --changes --rabbitmq
                                  # ... shipping state changes to the backups

Load comes from the shared ``amqp_load.py`` (its raw client costs ~20 us per message, so the
broker is what is measured); RabbitMQ nodes from the shared ``rabbitmq_baseline.sh`` (private
nodes under /tmp, stopped afterwards; with ``--tls``, ``rabbitmq_cluster.sh`` here, whose nodes
also listen for amqps). Each configuration reports consume msg/s, latency
percentiles, broker CPU per message (all broker processes; for a cluster also each member's,
``member_us_per_msg``, from /proc), and the ratio to RabbitMQ.
Never run two benchmarks at once on a 2-core machine: the numbers would measure each other.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reply_codes import start_cpgbroker

ROOT = Path(__file__).resolve().parents[1]

STANDALONE = {
    "a_1p1c_1K_noconf": ["--size", "1024"],
    "b_1p1c_1K_confirm": ["--size", "1024", "--confirm"],
    "b_1p1c_64B_confirm": ["--size", "64", "--confirm"],
    "d_4p4c_1K_confirm": ["--size", "1024", "--confirm", "--producers", "4", "--consumers", "4"],
    "e_rate1000_1K_confirm": ["--size", "1024", "--confirm", "--rate", "1000"],
}
CLUSTER = {
    "q_1p1c_1K_confirm": ["--size", "1024", "--confirm"],
    "q_1p1c_64B_confirm": ["--size", "64", "--confirm"],
    "q_4p4c_1K_confirm": ["--size", "1024", "--confirm", "--producers", "4", "--consumers", "4"],
    "q_rate1000_1K_confirm": ["--size", "1024", "--confirm", "--rate", "1000"],
    "q_1p1c_64K_confirm": ["--size", "65536", "--confirm", "--inflight", "64"],
}


def load(
    shared: Path,
    urls: list[str],
    pids: list[int],
    args: list[str],
    secs: float,
    cafile: str | None = None,
) -> dict[str, Any]:
    """One run of the shared load generator; over amqps:// URLs (trusting ``cafile``) through
    our TLS wrapper of it, ``amqps_load.py``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    if cafile is None:
        cmd = [sys.executable, str(shared / "bench" / "amqp_load.py"), "--json-out", out]
    else:
        wrapper = Path(__file__).with_name("amqps_load.py")
        cmd = [sys.executable, str(wrapper), "--cafile", cafile, "--shared", str(shared)]
        cmd += ["--json-out", out]
    cmd += [a for u in urls for a in ("--url", u)]
    cmd += [a for p in pids for a in ("--broker-pid", str(p))]
    cmd += ["--seconds", str(secs), "--queue", "bench_q", *args]
    subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=False
    )
    try:
        return dict(json.loads(Path(out).read_text()))
    finally:
        os.unlink(out)


def cpu_seconds(pids: list[int]) -> list[float]:
    """Each process's user+system CPU seconds so far (/proc/<pid>/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out.append((int(fields[11]) + int(fields[12])) / tick)
    return out


def summary(r: dict[str, Any]) -> dict[str, Any]:
    cpu = r.get("cpu", {})
    lat = r.get("latency_ms") or {}
    return {
        "ok": r.get("ok"),
        "consume_msg_s": r.get("consume_rate"),
        "p50_ms": lat.get("p50"),
        "p99_ms": lat.get("p99"),
        "broker_us_per_msg": cpu.get("broker_us_per_msg"),
        "broker_cores": cpu.get("broker_cores"),
        "client_us_per_msg": cpu.get("client_us_per_msg"),
        # Whole machine: on 2 cores a cluster run is bounded by brokers + corosyncs + client.
        "machine_busy_cores": cpu.get("machine_busy_cores"),
    }


def run_ours_standalone(shared: Path, secs: float) -> dict[str, Any]:
    proc, where = start_cpgbroker()
    url = f"amqp://guest:guest@{where}/"
    out = {}
    try:
        for name, args in STANDALONE.items():
            out[name] = summary(load(shared, [url], [proc.pid], args, secs))
            print(f"cpgbroker {name}: {out[name]}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(10)
    return out


# Where a member's CPU goes, by the innermost frame that belongs to one of these.
CATEGORIES = (
    ("cpg", ("cpgbroker/cpg.py", "cpgbroker/runtime/ring/cpg_trio.py", "_cpg")),
    ("decode_encode", ("cpgbroker/wire/", "pamqp/", "cpgbroker/cluster/codec.py")),
    ("model", ("cpgbroker/model/",)),
    ("cluster_logic", ("cpgbroker/cluster/", "cpgbroker/runtime/member/member.py")),
    ("io_runtime", ("trio/", "cpgbroker/runtime/amqp/server.py", "socket", "selectors")),
)


def profile_shares(raw: Path) -> dict[str, float]:
    """Collapsed stacks from py-spy -> share of samples per category (innermost match wins)."""
    counts: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        cat = "other"
        for frame in reversed(frames):
            hit = next((c for c, keys in CATEGORIES if any(k in frame for k in keys)), None)
            if hit:
                cat = hit
                break
        counts[cat] = counts.get(cat, 0) + int(n)
        total += int(n)
    return {c: round(v / total, 3) for c, v in sorted(counts.items())} if total else {}


def _pyspy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def profile_members(pids: list[int], seconds: float) -> list[subprocess.Popen[bytes]]:
    procs = []
    for pid in pids:
        out = Path(tempfile.gettempdir()) / f"cpgb-profile-{pid}.txt"
        procs.append(
            subprocess.Popen(
                [
                    _pyspy() or "py-spy",
                    "record",
                    "--pid",
                    str(pid),
                    "--duration",
                    str(int(seconds)),
                    "--rate",
                    "100",
                    "--format",
                    "raw",
                    "--output",
                    str(out),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return procs


def cpg_sent(brokers: Any) -> dict[int, int]:
    """CPG messages each member multicast so far (its status)."""
    return {
        n: int(((brokers.status(n) or {}).get("cpg") or {}).get("sent") or 0) for n in (1, 2, 3)
    }


def elided(brokers: Any) -> int:
    """Messages the members' serving brokers never shipped so far (hot standby shipping
    changes: acked before their batch was cut)."""
    return sum(
        int(((brokers.status(n) or {}).get("batches") or {}).get("elided") or 0) for n in (1, 2, 3)
    )


def store_counters(brokers: Any) -> dict[int, dict[str, Any]]:
    out = {}
    for n in (1, 2, 3):
        s = brokers.status(n) or {}
        out[n] = s.get("store") or {}
    return out


def store_rates(
    before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]], r: dict[str, Any]
) -> dict[str, Any]:
    """What the stores did during one run: fsyncs per second per member, and bytes written
    per message body byte (per member: every member writes every message)."""
    secs = r.get("consume_elapsed_s") or 0
    msgs = r.get("sent") or 0
    size = r.get("size") or 0
    fsyncs = [after[n].get("fsyncs", 0) - before[n].get("fsyncs", 0) for n in (1, 2, 3)]
    written = [
        after[n].get("bytes_written", 0) - before[n].get("bytes_written", 0) for n in (1, 2, 3)
    ]
    return {
        # What the store holds at the end (snapshot plus journal since it): bounded under a
        # steady load, because snapshots let older segments go.
        "journal_mib_since_snapshot_at_end": [
            round((after[n].get("journal_bytes") or 0) / 2**20, 1) for n in (1, 2, 3)
        ],
        "snapshots": [after[n].get("snapshots") for n in (1, 2, 3)],
        "fsyncs_per_s_per_member": [round(f / secs) if secs else None for f in fsyncs],
        "bytes_written_per_body_byte": [
            round(w / (msgs * size), 2) if msgs and size else None for w in written
        ],
    }


def run_ours_cluster(
    shared: Path,
    secs: float,
    realtime: bool = False,
    names: list[str] | None = None,
    repeat: int = 1,
    store: bool = False,
    tls: bool = False,
    plaintext_ring: bool = False,
    hot_standby: bool = False,
    changes: bool = False,
) -> dict[str, Any]:
    from cpgbroker.dev.brokers import BrokerSet
    from cpgbroker.dev.cluster import DevCluster

    template = plaintext_template() if plaintext_ring else None
    dc = DevCluster(
        3,
        prefix=f"bench-{os.getpid() % 100000}",
        token_ms=3000,
        realtime=realtime,
        template=template,
    )
    out: dict[str, Any] = {}
    certs = Path(tempfile.mkdtemp(prefix="cpgb-bench-tls-")) if tls else None
    # Lands in [cluster] (no [store] section comes before it: main() refuses --store with it).
    extra = "allow_plaintext_ring = true\n" if plaintext_ring else ""
    if certs is not None:
        extra += tls_config(certs)
    with dc:  # up on enter, down on exit
        brokers = BrokerSet(
            dc,
            event_log=False,
            store=store,
            tls=tls,
            extra_config=extra,
            cluster_options=(
                'mode = "hot-standby"' + ('\nreplication = "changes"' if changes else "")
                if hot_standby
                else ""
            ),
        )
        brokers.start_all()
        urls = [brokers.url(n) for n in (1, 2, 3)]
        pids = [brokers.procs[n].pid for n in (1, 2, 3)]
        # Each member's corosync: it spends about as much CPU per message as a member does.
        ring_pids = [p for p in (dc.node(n).pid for n in (1, 2, 3)) if p is not None]
        roles = {n: "active" for n in (1, 2, 3)}
        if hot_standby:
            # Every client on the primary (a backup turns them away).
            st = brokers.status(1)
            assert st is not None and st["mode"] == "hot-standby", st
            primary_port = st["primary_url"].rsplit(":", 1)[1].strip("/")
            roles = {
                n: "primary" if brokers.url(n).endswith(f":{primary_port}/") else "backup"
                for n in (1, 2, 3)
            }
            urls = [brokers.url(n) for n in (1, 2, 3) if roles[n] == "primary"]
            out["roles"] = {f"member{n}": r for n, r in roles.items()}
        try:
            order = names or list(CLUSTER)
            for name in order:
                args = CLUSTER[name]
                if store:
                    # Persistent messages on a durable queue: what the stores must keep (a
                    # RabbitMQ quorum queue writes every message to its log).
                    args = [*args, "--persistent"]
                before = store_counters(brokers) if store else {}
                profilers = []
                # The first configuration measured is profiled (py-spy slows what it samples).
                if name == order[0] and _pyspy():
                    profilers = profile_members(pids, secs - 2)
                cpu_before = cpu_seconds(pids)
                ring_before = cpu_seconds(ring_pids)
                mcasts_before = cpg_sent(brokers)
                elided_before = elided(brokers)
                raw = [load(shared, urls, pids, args, secs) for _ in range(repeat)]
                cpu_after = cpu_seconds(pids)
                ring_after = cpu_seconds(ring_pids)
                mcasts_after = cpg_sent(brokers)
                elided_after = elided(brokers)
                runs = [summary(r) for r in raw]
                out[name] = median_run(runs)
                received = sum(int(r.get("received") or 0) for r in raw)
                if received:
                    out[name]["member_us_per_msg"] = {
                        f"member{n} ({roles[n]})": round((b - a) * 1e6 / received, 1)
                        for n, a, b in zip((1, 2, 3), cpu_before, cpu_after, strict=True)
                    }
                    out[name]["corosync_us_per_msg"] = [
                        round((b - a) * 1e6 / received, 1)
                        for a, b in zip(ring_before, ring_after, strict=True)
                    ]
                    # CPG messages each member multicast per AMQP message (batches of client
                    # bytes or changes, progress reports, clock ticks).
                    out[name]["cpg_sent_per_msg"] = {
                        f"member{n} ({roles[n]})": round(
                            (mcasts_after[n] - mcasts_before[n]) / received, 3
                        )
                        for n in (1, 2, 3)
                    }
                    if elided_after:
                        # The share of messages acked before their batch was cut, which never
                        # crossed the ring (model/changes.py, "Elision").
                        out[name]["elided_share"] = round(
                            (elided_after - elided_before) / received, 3
                        )
                if store:
                    # Over every repeat: the counters are cumulative.
                    total = {
                        "consume_elapsed_s": sum(r.get("consume_elapsed_s") or 0 for r in raw),
                        "sent": sum(r.get("sent") or 0 for r in raw),
                        "size": raw[-1].get("size"),
                    }
                    out[name]["store"] = store_rates(before, store_counters(brokers), total)
                for p in profilers:
                    p.wait(60)
                if profilers:
                    out[name]["cpu_share_per_member"] = {
                        f"member{i + 1}": profile_shares(
                            Path(tempfile.gettempdir()) / f"cpgb-profile-{pid}.txt"
                        )
                        for i, pid in enumerate(pids)
                    }
                print(f"cpgbroker cluster {name}: {out[name]}", file=sys.stderr)
                if certs is not None:
                    # The same load over amqps, on the same cluster, right after.
                    tls_urls = [brokers.tls_url(n) for n in (1, 2, 3)]
                    ca = str(certs / "ca.pem")
                    out.setdefault("tls_negotiated", negotiated(brokers.tls_ports[1], ca))
                    runs = [
                        summary(load(shared, tls_urls, pids, args, secs, ca)) for _ in range(repeat)
                    ]
                    out[f"{name}_tls"] = median_run(runs)
                    print(f"cpgbroker cluster {name}_tls: {out[name + '_tls']}", file=sys.stderr)
            out["converged_digest"] = brokers.converged([1, 2, 3], timeout=60)
        finally:
            brokers.stop_all()
    return out


def plaintext_template() -> Path:
    """A copy of the dev cluster's corosync.conf template without ring encryption."""
    text = (ROOT / "configs" / "corosync.conf.in").read_text()
    plain = re.sub(r"crypto_cipher: \S+", "crypto_cipher: none", text)
    plain = re.sub(r"crypto_hash: \S+", "crypto_hash: none", plain)
    assert plain != text, "the template's crypto settings were not found"
    fd, name = tempfile.mkstemp(prefix="cpgb-bench-corosync-", suffix=".conf.in")
    os.write(fd, plain.encode())
    os.close(fd)
    return Path(name)


def tls_config(directory: Path) -> str:
    """Test certificates (trustme, from the test extra) in ``directory``: the ``[tls]`` section
    of the members (RabbitMQ's defaults otherwise: no client certificates). ``cert.pem`` and
    ``key.pem`` are the same certificate for RabbitMQ's ssl_options."""
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server.private_key_and_cert_chain_pem.write_to_path(str(directory / "server.pem"))
    server.private_key_pem.write_to_path(str(directory / "key.pem"))
    (directory / "cert.pem").write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    return f'\n[tls]\ncertfile = "{directory / "server.pem"}"\n'


def negotiated(port: int, cafile: str) -> str:
    """The TLS version and cipher a default client context gets from ``port`` (both brokers
    are measured with what they negotiate with the same client)."""
    import socket
    import ssl

    ctx = ssl.create_default_context(cafile=cafile)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        cipher = s.cipher()
        return f"{s.version()} {cipher[0] if cipher else '?'}"


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """With ``--repeat``: the run with the median p99 (the lower middle one of an even count),
    plus every run's p99 and rate; one run is reported as it is."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r.get("p99_ms") or 0.0)
    return {
        **ordered[(len(ordered) - 1) // 2],
        "runs_p99_ms": [r.get("p99_ms") for r in runs],
        "runs_msg_s": [r.get("consume_msg_s") for r in runs],
    }


def run_rabbitmq(shared: Path, phase: str, secs: float, names: list[str]) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="rmq-bench-"))
    env = dict(
        os.environ,
        REPS="1",
        SECS=str(int(secs)),
        RATE_SECS=str(int(secs)),
        RMQ_BENCH_BASE=str(base),
        BENCH_PORT="5790",
    )
    script = shared / "bench" / "rabbitmq_baseline.sh"
    subprocess.run(["bash", str(script), "install"], env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["bash", str(script), phase], env=env, check=False, stdout=subprocess.DEVNULL)
    out = {}
    for name in names:
        f = base / "results" / phase / f"{name}__r1.json"
        if f.exists():
            out[name] = summary(json.loads(f.read_text()))
    return out


def run_rabbitmq_tls(shared: Path, secs: float, names: list[str], repeat: int) -> dict[str, Any]:
    """RabbitMQ 3-node quorum queues over amqp and then amqps, each configuration in turn on
    the same cluster (``rabbitmq_cluster.sh``: the shared baseline script has no TLS)."""
    base = Path(tempfile.mkdtemp(prefix="rmq-bench-tls-"))
    certs = base / "certs"
    certs.mkdir()
    tls_config(certs)
    script = Path(__file__).with_name("rabbitmq_cluster.sh")
    env = dict(os.environ, RMQ_TLS_BASE=str(base))
    out: dict[str, Any] = {}
    try:
        subprocess.run(["bash", str(script), "start", str(certs)], env=env, check=True, timeout=900)
        pids = [int((base / f"r{n}" / "beam.pid").read_text()) for n in (1, 2, 3)]
        urls = [f"amqp://guest:guest@127.0.0.1:{5700 + n}/" for n in (1, 2, 3)]
        tls_urls = [f"amqps://guest:guest@127.0.0.1:{5710 + n}/" for n in (1, 2, 3)]
        ca = str(certs / "ca.pem")
        out["tls_negotiated"] = negotiated(5711, ca)
        for name in names:
            args = [*CLUSTER[name], "--queue-type", "quorum"]
            for key, u, c in ((name, urls, None), (f"{name}_tls", tls_urls, ca)):
                runs = [summary(load(shared, u, pids, args, secs, c)) for _ in range(repeat)]
                out[key] = median_run(runs)
                print(f"rabbitmq cluster {key}: {out[key]}", file=sys.stderr)
    finally:
        subprocess.run(["bash", str(script), "stop"], env=env, check=False, timeout=300)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", action="store_true", help="3-member cluster instead of standalone")
    ap.add_argument("--rabbitmq", action="store_true", help="also measure RabbitMQ")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument(
        "--realtime",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="corosyncs at their default real-time priority (devcluster up --realtime)",
    )
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    ap.add_argument(
        "--store",
        action="store_true",
        help="with --cluster: every member has a durable store (fsync always) and the load "
        "publishes persistent messages to a durable queue",
    )
    ap.add_argument(
        "--only",
        help=f"with --cluster: these configurations only (comma-separated: {', '.join(CLUSTER)})",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --cluster: run each configuration this often on the same cluster and report "
        "the run with the median p99 (RabbitMQ still runs once)",
    )
    ap.add_argument(
        "--tls",
        action="store_true",
        help="with --cluster: run each configuration over amqp and then over amqps (TLS 1.2+, "
        "test certificates; reported as NAME_tls) on the same cluster",
    )
    ap.add_argument(
        "--hot-standby",
        action="store_true",
        help='with --cluster: [cluster] mode = "hot-standby", the load on the primary only',
    )
    ap.add_argument(
        "--changes",
        action="store_true",
        help='with --hot-standby: [cluster] replication = "changes" (backups apply the '
        "primary's state changes, not its clients' bytes)",
    )
    ap.add_argument(
        "--plaintext-ring",
        action="store_true",
        help="with --cluster: corosync without ring encryption (crypto_cipher/crypto_hash "
        "none; the members allow it), to measure what the encryption costs",
    )
    args = ap.parse_args()
    if args.tls and not args.cluster:
        ap.error("--tls needs --cluster")
    if args.changes and not args.hot_standby:
        ap.error("--changes needs --hot-standby")
    if args.plaintext_ring and (not args.cluster or args.store):
        ap.error("--plaintext-ring needs --cluster, and not --store")
    started = time.time()
    if args.cluster:
        names = args.only.split(",") if args.only else list(CLUSTER)
        unknown = [n for n in names if n not in CLUSTER]
        if unknown:
            ap.error(f"unknown configuration(s): {', '.join(unknown)}")
        ours = run_ours_cluster(
            args.shared,
            args.seconds,
            args.realtime,
            names,
            max(1, args.repeat),
            args.store,
            args.tls,
            args.plaintext_ring,
            args.hot_standby,
            args.changes,
        )
    else:
        ours = run_ours_standalone(args.shared, args.seconds)
        names = list(STANDALONE)
    result: dict[str, Any] = {
        "mode": "cluster" if args.cluster else "standalone",
        "corosync_realtime": args.realtime,
        "store": args.store,
        "tls": args.tls,
        "ring_encryption": not args.plaintext_ring,
        "cluster_mode": "hot-standby" if args.hot_standby else "active-active",
        "replication": "changes" if args.changes else "bytes",
        "cpgbroker": ours,
    }
    if args.rabbitmq:
        if args.tls:
            rmq = run_rabbitmq_tls(args.shared, args.seconds, names, max(1, args.repeat))
        else:
            rmq = run_rabbitmq(
                args.shared, "cluster" if args.cluster else "single", args.seconds, names
            )
        result["rabbitmq"] = rmq
        ratios = {}
        for name in [n + t for n in names for t in (("", "_tls") if args.tls else ("",))]:
            a, b = ours.get(name), rmq.get(name)
            if a and b and a.get("consume_msg_s") and b.get("consume_msg_s"):
                ratios[name] = {
                    "throughput_x": round(a["consume_msg_s"] / b["consume_msg_s"], 2),
                    "p99_ms": [a.get("p99_ms"), b.get("p99_ms")],
                    "cpu_us_per_msg": [a.get("broker_us_per_msg"), b.get("broker_us_per_msg")],
                }
        result["ratio_vs_rabbitmq"] = ratios
    result["seconds_total"] = round(time.time() - started, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

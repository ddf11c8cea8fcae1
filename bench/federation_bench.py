"""Federated throughput between two clusters on one machine, against the same clusters' local
throughput, with RabbitMQ's federation plugin in the same run; prints JSON.

    python bench/federation_bench.py                  # cpgbroker, then RabbitMQ (two 3-node
                                                      # clusters, quorum queue); 50,000 msgs a run
    python bench/federation_bench.py --quick          # 5,000 msgs, cpgbroker only: < 1 minute
    python bench/federation_bench.py --quick --rabbitmq        # ... and RabbitMQ (+1 minute)
    python bench/federation_bench.py --rabbitmq-nodes 1        # RabbitMQ as two single nodes
                                                               # (durable classic queue)
    python bench/federation_bench.py --no-rabbitmq --ack-modes no-ack --repeat 3

Setup, the same for both brokers: two clusters, "up" and "down", each with a topic exchange
``fed``; on down a durable queue ``fed_q`` bound to ``fed`` with ``#`` (RabbitMQ: a quorum queue
on a 3-node cluster, a durable classic queue on a single node); down's ``fed`` federated from
up (an upstream parameter naming all of up's members, the ack-mode measured, and a policy
``federation-upstream-set: all``). cpgbroker: two 3-member dev clusters (corosync in
namespaces, token 3000 ms, one broker per node on 127.0.0.1, no stores unless ``--store``),
each with its own ``[federation] server_id``; its upstream parameter and policy go through
down's management API. RabbitMQ 3.10.8 (Debian's package): private nodes under a temporary
directory with their own epmd and cookie (as ``rabbitmq_cluster.sh``), ``rabbitmq_federation``
enabled on down's nodes, set up with ``rabbitmqctl``.

Measured with the shared ``amqp_load.py`` (raw client, ~20 us per message; every body carries
its send time, so latency is publish to delivery on one clock), 1 KiB bodies, publishers with
confirms, consumers acknowledging each message:

* ``local``: the publishers on down's members -> the consumers on down (exchange ``fed``, queue
  ``fed_q``): what the downstream cluster itself takes;
* ``federated_<ack-mode>``: the publishers on up's members -> the link -> the consumers on down.

``msg_s`` is messages consumed / time from the first publish to the last delivery; ``publish_msg_s``
is what up (or down, locally) accepted: a publish rate well above ``msg_s`` means the backlog
waited upstream, i.e. the link (or down) was the limit. Broker CPU is per message, summed over each
cluster's broker processes (corosync not included; ``machine_busy_cores`` counts everything);
``*_peak_cores`` is each process's busiest second. For cpgbroker, ``runner`` names the down member
that ran the link. The flat-out runs' latency is mostly queueing; after each measurement one run
at a fixed 1,000 msg/s (``--latency-rate``) gives the latency at a moderate load.

Everything started here (dev clusters, brokers, RabbitMQ nodes, epmd) is stopped at the end, on
error and on SIGTERM/SIGINT as well. Root only (namespaces). Never run two benchmarks at once
on a 2-core machine: the numbers would measure each other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SBIN = Path("/usr/lib/rabbitmq/bin")

EXCHANGE = "fed"
# Down's exchange whose local publishes a pushing link sends to up's ``fed`` (``--push``): no
# local bindings, so nothing is pulled back down the same link.
PUSH_EXCHANGE = "fed_push"
QUEUE = "fed_q"
HZ = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ measuring


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of one process so far; 0 once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / HZ


class CpuSampler:
    """Samples the CPU time of some processes every 0.25 s while a run lasts: their total, and
    each one's busiest second (in cores), which says whether one process (a link's runner) was
    the limit whatever the run's start-up and drain cost."""

    STEP = 0.25

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: list[list[float]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append([time.monotonic(), *(proc_cpu(p) for p in self.pids)])
            if self.done.wait(self.STEP):
                self.samples.append([time.monotonic(), *(proc_cpu(p) for p in self.pids)])
                return

    def __enter__(self) -> CpuSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def used(self) -> dict[int, float]:
        first, last = self.samples[0], self.samples[-1]
        return {p: last[i + 1] - first[i + 1] for i, p in enumerate(self.pids)}

    def peak_cores(self) -> dict[int, float]:
        """Per process, the most CPU it used in any window of ~1 s."""
        span = max(1, min(round(1.0 / self.STEP), len(self.samples) - 1))
        peaks = dict.fromkeys(self.pids, 0.0)
        for a, b in zip(self.samples, self.samples[span:], strict=False):
            dt = b[0] - a[0]
            for i, p in enumerate(self.pids):
                peaks[p] = max(peaks[p], (b[i + 1] - a[i + 1]) / dt)
        return peaks


class Load:
    """What every measurement shares: the load generator and its settings."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.shared: Path = args.shared
        self.messages: int = args.messages
        self.producers: int = args.producers
        self.consumers: int = args.consumers
        self.size: int = args.size
        self.persistent: bool = args.store
        self.latency_rate: float = args.latency_rate
        self.latency_secs: float = 3.0 if args.quick else 10.0

    def run(
        self,
        producer_urls: list[str],
        consumer_urls: list[str],
        groups: dict[str, list[int]],
        messages: int | None = None,
        extra: dict[str, list[int]] | None = None,
        rate: float | None = None,
        exchange: str = EXCHANGE,
    ) -> dict[str, Any]:
        """One run of ``amqp_load.py``: producer i on ``producer_urls[i % n]``, consumer j on
        ``consumer_urls[j % n]``, publishing to ``fed`` with routing key ``fed_q``, the queue
        declared and purged beforehand (by the caller). ``groups`` names broker pids whose CPU is
        reported per group (per message, and each one's busiest second); ``extra``, other pids
        whose busiest second is reported (corosync's)."""
        count = max(1, (messages or self.messages) // self.producers)
        prod = [producer_urls[i % len(producer_urls)] for i in range(self.producers)]
        cons = [consumer_urls[j % len(consumer_urls)] for j in range(self.consumers)]
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, str(self.shared / "bench" / "amqp_load.py"), "--json-out", out]
        cmd += [a for u in prod + cons for a in ("--url", u)]
        # Consumer j connects to url[(j + offset) % n]: the consumer URLs come after the
        # producers' (amqp_load's admin connection goes to url[0] and, with --no-declare
        # --no-purge, does nothing there).
        cmd += ["--consumer-url-offset", str(len(prod))]
        pids = [p for ps in groups.values() for p in ps]
        cmd += [a for p in pids for a in ("--broker-pid", str(p))]
        cmd += ["--producers", str(self.producers), "--consumers", str(self.consumers)]
        cmd += ["--count", str(count), "--size", str(self.size), "--confirm"]
        cmd += ["--exchange", exchange, "--queue", QUEUE, "--no-declare", "--no-purge"]
        cmd += ["--progress"]
        if self.persistent:
            cmd += ["--persistent"]
        if rate:
            cmd += ["--rate", str(rate)]
        watched = pids + [p for ps in (extra or {}).values() for p in ps]
        try:
            with CpuSampler(watched) as cpu:
                subprocess.run(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=900,
                    check=False,
                )
            r = dict(json.loads(Path(out).read_text()))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(out)
        used, peak = cpu.used(), cpu.peak_cores()
        return summary(
            r,
            {g: [used[p] for p in ps] for g, ps in groups.items()},
            {g: [peak[p] for p in ps] for g, ps in {**groups, **(extra or {})}.items()},
        )


def summary(
    r: dict[str, Any], cpu: dict[str, list[float]], peak: dict[str, list[float]]
) -> dict[str, Any]:
    lat = r.get("latency_ms") or {}
    c = r.get("cpu") or {}
    received = r.get("received") or 0
    secs = r.get("consume_elapsed_s") or 0.0
    out: dict[str, Any] = {
        "ok": r.get("ok"),
        "sent": r.get("sent"),
        "received": received,
        # received / (last delivery - first publish): end to end
        "msg_s": r.get("consume_rate"),
        "p50_ms": lat.get("p50"),
        "p99_ms": lat.get("p99"),
        "publish_msg_s": r.get("publish_rate"),
        "confirm_msg_s": r.get("confirm_rate"),
        "publish_elapsed_s": r.get("publish_elapsed_s"),
        "consume_elapsed_s": secs,
        "machine_busy_cores": c.get("machine_busy_cores"),
        "client_cores": c.get("client_cores"),
    }
    for group, used in cpu.items():
        out[f"{group}_broker_us_per_msg"] = (
            round(sum(used) / received * 1e6, 1) if received else None
        )
        out[f"{group}_broker_us_per_msg_each"] = [
            round(u / received * 1e6, 1) if received else None for u in used
        ]
    for group, cores in peak.items():
        name = group if group.endswith("corosync") else f"{group}_broker"
        out[f"{name}_peak_cores"] = [round(c, 2) for c in cores]
    if r.get("errors"):
        out["errors"] = r["errors"][:5]
    if r.get("check", {}).get("duplicates"):
        out["duplicates"] = r["check"]["duplicates"]
    progress = r.get("progress") or []
    if progress:
        # Per second: [published, consumed] msg/s, to see where the backlog built up.
        out["per_second"] = [[p["pub_rate"], p["recv_rate"]] for p in progress]
    return out


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one measurement: the one with the median rate, and every rate."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r.get("msg_s") or 0.0)
    return {**ordered[(len(ordered) - 1) // 2], "runs_msg_s": [r.get("msg_s") for r in runs]}


# ------------------------------------------------------------------ AMQP helpers (pika)


@contextlib.contextmanager
def channel(url: str) -> Iterator[Any]:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        yield conn.channel()
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def declare(url: str, queue_args: dict[str, Any] | None = None) -> None:
    """``fed`` (topic, durable); with ``queue_args``, also the durable ``fed_q`` bound with
    ``#``."""
    with channel(url) as ch:
        ch.exchange_declare(EXCHANGE, "topic", durable=True)
        if queue_args is not None:
            ch.queue_declare(QUEUE, durable=True, arguments=queue_args)
            ch.queue_bind(QUEUE, EXCHANGE, "#")


def purge(url: str) -> None:
    with channel(url) as ch:
        ch.queue_purge(QUEUE)


def delete_queues(url: str, names: list[str]) -> None:
    with channel(url) as ch:
        for name in names:
            ch.queue_delete(name)


def wait_flowing(
    up_url: str, down_url: str, timeout: float = 60.0, exchange: str = EXCHANGE
) -> float:
    """Publish probes (24 zero bytes: the load generator counts them as foreign, never as its
    own) to up's ``fed`` until one arrives in down's ``fed_q``: the link is up and its
    binding reached the upstream. Then down's queue is purged. Seconds it took."""
    t0 = time.monotonic()
    with channel(up_url) as pub, channel(down_url) as sub:
        while True:
            pub.basic_publish(exchange, QUEUE, bytes(24))
            for _ in range(5):
                method, _props, _body = sub.basic_get(QUEUE, auto_ack=True)
                if method is not None:
                    took = time.monotonic() - t0
                    time.sleep(1.0)  # probes still on the way
                    sub.queue_purge(QUEUE)
                    return round(took, 2)
                time.sleep(0.1)
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"nothing crossed the link after {timeout:.0f} s")


def measure(
    load: Load,
    what: str,
    producer_urls: list[str],
    consumer_urls: list[str],
    groups: dict[str, list[int]],
    repeat: int,
    label: str,
    extra: dict[str, list[int]] | None = None,
    exchange: str = EXCHANGE,
) -> dict[str, Any]:
    runs = []
    for _ in range(repeat):
        purge(consumer_urls[0])
        runs.append(load.run(producer_urls, consumer_urls, groups, extra=extra, exchange=exchange))
        brief = {k: runs[-1].get(k) for k in ("ok", "msg_s", "p50_ms", "p99_ms", "publish_msg_s")}
        print(f"{label} {what}: {brief}", file=sys.stderr)
    out = median_run(runs)
    if load.latency_rate:
        # Latency at a fixed, moderate rate (the flat-out runs' latency is mostly queueing).
        purge(consumer_urls[0])
        count = int(load.latency_rate * load.latency_secs)
        r = load.run(
            producer_urls, consumer_urls, groups, count, extra, load.latency_rate, exchange
        )
        key = f"at_{load.latency_rate:g}_msg_s"
        out[key] = {k: r.get(k) for k in ("ok", "msg_s", "p50_ms", "p99_ms", "received")}
        print(f"{label} {what} {key}: {out[key]}", file=sys.stderr)
    return out


# ------------------------------------------------------------------ cpgbroker


def http(base: str, secret: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request to a member's management API, with the admin secret as Bearer token."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    return status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw.decode()


def run_cpgbroker(args: argparse.Namespace, load: Load) -> dict[str, Any]:
    from cpgbroker.dev.brokers import BrokerSet
    from cpgbroker.dev.cluster import DevCluster
    from cpgbroker.runtime.admin import secret as admin_secret

    tag = os.getpid() % 100000
    sets: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for role in ("up", "down"):
            dc = DevCluster(3, prefix=f"fed{role}-{tag}", token_ms=3000)
            stack.callback(dc.down)  # runs last: removes whatever is left of the cluster
            dc.up()
            bs = BrokerSet(
                dc,
                event_log=False,
                store=args.store,
                extra_config=f'\n[federation]\nserver_id = "bench-{role}"\n',
            )
            stack.callback(bs.stop_all)
            bs.start_all()
            sets[role] = bs
        up, down = sets["up"], sets["down"]
        up_urls = [up.url(n) for n in (1, 2, 3)]
        down_urls = [down.url(n) for n in (1, 2, 3)]
        # Consumers on down's member 2 (then 3, 1), as broker_bench puts them.
        down_consumers = [down_urls[(j + 1) % 3] for j in range(3)]
        pids = {
            "up": [up.procs[n].pid for n in (1, 2, 3)],
            "down": [down.procs[n].pid for n in (1, 2, 3)],
        }
        corosyncs = {f"{r}_corosync": [sets[r].dc.node(n).pid for n in (1, 2, 3)] for r in sets}
        base = {r: f"http://127.0.0.1:{sets[r].ports[1][1]}" for r in sets}
        secret = {r: admin_secret.read_secret(sets[r].secret_path()) for r in sets}

        def api(role: str, method: str, path: str, body: Any = None) -> Any:
            status, answer = http(base[role], secret[role], method, path, body)
            if status >= 300:
                raise RuntimeError(f"{method} {path} on {role}: {status} {answer}")
            return answer

        declare(up_urls[0])
        declare(down_urls[0], {})
        out: dict[str, Any] = {
            "nodes": "two 3-member cpgbroker dev clusters (3 corosync nodes each, in namespaces)",
            "queue": "durable, replicated on down's 3 members"
            + (" with stores (fsync always)" if args.store else " (no stores)"),
        }
        load.run(down_urls, down_consumers, {}, messages=max(1000, load.messages // 10))  # warm
        out["local"] = measure(
            load, "local", down_urls, down_consumers, pids, args.repeat, "cpgbroker", corosyncs
        )

        policy = {
            "pattern": f"^{EXCHANGE}$",
            "apply-to": "exchanges",
            "definition": {"federation-upstream-set": "all"},
        }
        api("down", "PUT", "/api/policies/%2F/fed", policy)
        for mode in args.ack_modes:
            name = f"up-{mode}"
            value = {"uri": up_urls, "ack-mode": mode, "reconnect-delay": 1}
            api("down", "PUT", f"/api/parameters/federation-upstream/%2F/{name}", {"value": value})
            try:
                took = wait_flowing(up_urls[0], down_urls[0])
            except RuntimeError as e:
                links = api("down", "GET", "/api/federation-links")
                raise RuntimeError(f"{e}; federation links: {links}") from None
            res = measure(
                load,
                f"federated {mode}",
                up_urls,
                down_consumers,
                pids,
                args.repeat,
                "cpgbroker",
                corosyncs,
            )
            links = api("down", "GET", "/api/federation-links")
            link: dict[str, Any] = next((x for x in links if x.get("upstream") == name), {})
            res["link_ready_after_s"] = took
            res["link"] = {k: link.get(k) for k in ("node", "status", "uri", "forwarded")}
            # The runner: the member whose AMQP port its node name ends with.
            for n in (1, 2, 3):
                if str(link.get("node", "")).endswith(f":{down.ports[n][0]}"):
                    res["runner"] = {
                        "member": n,
                        "peak_cores": res["down_broker_peak_cores"][n - 1],
                    }
            out[f"federated_{mode}"] = res
            api("down", "DELETE", f"/api/parameters/federation-upstream/%2F/{name}")
            wait_until(
                lambda: not api("down", "GET", "/api/federation-links"), "the link to stop", 30
            )
            queues = api("up", "GET", "/api/queues")
            left = [q["name"] for q in queues if q["name"].startswith("federation:")]
            delete_queues(up_urls[0], left)
        if args.push:
            out["pushed_on_confirm"] = measure_push(args, load, sets, api, pids, corosyncs)
        out["converged_digest_down"] = down.converged([1, 2, 3], timeout=60)
    return out


def measure_push(
    args: argparse.Namespace,
    load: Load,
    sets: dict[str, Any],
    api: Callable[..., Any],
    pids: dict[str, list[int]],
    corosyncs: dict[str, list[int]],
) -> dict[str, Any]:
    """The other direction: down's publishers -> down's ``fed_push`` -> a pushing link -> up's
    ``fed`` -> the consumers on up's ``fed_q`` (every message confirmed to its publisher once
    all of down has it in the push queue; removed there once up confirmed it)."""
    up, down = sets["up"], sets["down"]
    up_urls = [up.url(n) for n in (1, 2, 3)]
    down_urls = [down.url(n) for n in (1, 2, 3)]
    declare(up_urls[0], {})
    # The pull measurements' policy would federate down's fed from this upstream too (it
    # names the set of all upstreams), and pull the pushed messages back down.
    api("down", "DELETE", "/api/policies/%2F/fed")
    with channel(down_urls[0]) as ch:
        ch.exchange_declare(PUSH_EXCHANGE, "topic", durable=True)
    policy = {
        "pattern": f"^{PUSH_EXCHANGE}$",
        "apply-to": "exchanges",
        "definition": {"federation-upstream": "up-push"},
    }
    api("down", "PUT", "/api/policies/%2F/fed-push", policy)
    value = {"uri": up_urls, "exchange": EXCHANGE, "push": True, "reconnect-delay": 1}
    api("down", "PUT", "/api/parameters/federation-upstream/%2F/up-push", {"value": value})
    took = wait_flowing(down_urls[0], up_urls[0], exchange=PUSH_EXCHANGE)
    up_consumers = [up_urls[(j + 1) % 3] for j in range(3)]
    res = measure(
        load,
        "pushed on-confirm",
        down_urls,
        up_consumers,
        pids,
        args.repeat,
        "cpgbroker",
        corosyncs,
        PUSH_EXCHANGE,
    )
    res["link_ready_after_s"] = took
    links = api("down", "GET", "/api/federation-links")
    res["link"] = next(
        (
            {k: x.get(k) for k in ("node", "status", "pushed")}
            for x in links
            if x["upstream"] == "up-push"
        ),
        {},
    )
    return res


def wait_until(probe: Callable[[], Any], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"after {timeout:.0f} s, still waiting for {what}")
        time.sleep(0.2)


# ------------------------------------------------------------------ RabbitMQ


class RabbitNodes:
    """Private RabbitMQ nodes under ``base``: their own epmd (on ``epmd_port``), cookie, config,
    plugins and data, the node handling of ``rabbitmq_cluster.sh``; stopped by pid."""

    def __init__(self, base: Path, epmd_port: int) -> None:
        self.base = base
        self.epmd_port = epmd_port
        self.epmd: subprocess.Popen[bytes] | None = None
        self.nodes: dict[str, tuple[int, str]] = {}  # name -> (amqp port, plugins file)
        self.procs: list[subprocess.Popen[bytes]] = []
        (base / "home").mkdir(parents=True)
        cookie = base / "home" / ".erlang.cookie"
        cookie.write_text(os.urandom(10).hex())
        cookie.chmod(0o400)
        (base / "rabbitmq-env.conf").write_text("")

    def env(self, name: str) -> dict[str, str]:
        port, plugins = self.nodes[name]
        d = self.base / name
        return dict(
            os.environ,
            HOME=str(self.base / "home"),
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_CRASH_DUMP=str(d / "erl_crash.dump"),
            RABBITMQ_CONF_ENV_FILE=str(self.base / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(d / "rabbitmq"),
            RABBITMQ_ENABLED_PLUGINS_FILE=plugins,
            RABBITMQ_NODENAME=f"{name}@localhost",
            RABBITMQ_NODE_PORT=str(port),
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_DIST_PORT=str(port + 20000),
            RABBITMQ_MNESIA_BASE=str(d / "mnesia"),
            RABBITMQ_LOG_BASE=str(d / "log"),
            RABBITMQ_PID_FILE=str(d / "beam.pid"),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )

    def ctl(self, name: str, *argv: str, tool: str = "rabbitmqctl") -> str:
        r = subprocess.run(
            [str(SBIN / tool), "-n", f"{name}@localhost", "-q", *argv],
            env=self.env(name),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(argv)} on {name}: {r.stderr.strip()[-500:]}")
        return r.stdout

    def start_epmd(self) -> None:
        self.epmd = subprocess.Popen(
            ["epmd", "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        env = dict(os.environ, ERL_EPMD_PORT=str(self.epmd_port))
        for _ in range(100):
            probe = ["epmd", "-port", str(self.epmd_port), "-names"]
            if subprocess.run(probe, env=env, capture_output=True, check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"epmd did not come up on port {self.epmd_port}")

    def launch(self, name: str, port: int, plugins: str) -> None:
        """Start a node (without waiting for it)."""
        self.nodes[name] = (port, plugins)
        d = self.base / name
        (d / "mnesia").mkdir(parents=True)
        (d / "log").mkdir()
        with open(d / "log" / "stdout", "wb") as log:
            proc = subprocess.Popen(
                ["setsid", str(SBIN / "rabbitmq-server")],
                env=self.env(name),
                cwd=d,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.procs.append(proc)

    def wait_up(self, name: str) -> None:
        self.ctl(name, "wait", "--timeout", "300", str(self.base / name / "beam.pid"))
        self.ctl(name, "await_startup", "--timeout", "300")

    def pid(self, name: str) -> int:
        return int((self.base / name / "beam.pid").read_text())

    def stop_all(self) -> None:
        for name in reversed(list(self.nodes)):
            pidfile = self.base / name / "beam.pid"
            if not pidfile.exists():
                continue
            pid = self.pid(name)
            with contextlib.suppress(Exception):
                self.ctl(name, "stop")
            for _ in range(60):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.5)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if self.epmd is not None:
            self.epmd.terminate()
            self.epmd.wait(10)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_rabbitmq(args: argparse.Namespace, load: Load) -> dict[str, Any]:
    size = args.rabbitmq_nodes
    ports = {"up": args.rabbitmq_port, "down": args.rabbitmq_port + 10}
    names = {r: [f"fed{r}{i}" for i in range(1, size + 1)] for r in ports}
    busy = [
        p
        for r in ports
        for i in range(size)
        for p in (ports[r] + i, ports[r] + i + 20000)
        if not port_free(p)
    ]
    if busy:
        raise RuntimeError(f"ports {busy} on 127.0.0.1 are in use: choose --rabbitmq-port")
    base = Path(tempfile.mkdtemp(prefix="rmq-fed-bench-"))
    (base / "enabled_plugins.up").write_text("[].\n")
    (base / "enabled_plugins.down").write_text("[rabbitmq_federation].\n")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, True)
        rmq = RabbitNodes(base, args.epmd_port)
        stack.callback(rmq.stop_all)
        rmq.start_epmd()
        for role in ports:
            for i, name in enumerate(names[role]):
                rmq.launch(name, ports[role] + i, str(base / f"enabled_plugins.{role}"))
        for role in ports:
            for name in names[role]:
                rmq.wait_up(name)
            first = names[role][0]
            for name in names[role][1:]:
                rmq.ctl(name, "stop_app")
                rmq.ctl(name, "join_cluster", f"{first}@localhost")
                rmq.ctl(name, "start_app")
        print(f"rabbitmq: {2 * size} nodes up", file=sys.stderr)
        url = {
            r: [f"amqp://guest:guest@127.0.0.1:{ports[r] + i}/" for i in range(size)] for r in ports
        }
        up_urls, down_urls = url["up"], url["down"]
        down_consumers = [down_urls[(j + 1) % size] for j in range(size)]
        pids = {r: [rmq.pid(n) for n in names[r]] for r in ports}
        quorum = size >= 3
        declare(up_urls[0])
        declare(down_urls[0], {"x-queue-type": "quorum"} if quorum else {})
        down1 = names["down"][0]
        out: dict[str, Any] = {
            "version": rabbitmq_version(),
            "nodes": ("two 3-node RabbitMQ clusters" if quorum else "two single RabbitMQ nodes"),
            "queue": "quorum queue on down (3 replicas)" if quorum else "durable classic queue",
            "upstream_queue": "classic, on one up node (the federation plugin declares it)",
        }
        load.run(down_urls, down_consumers, {}, messages=max(1000, load.messages // 10))  # warm
        out["local"] = measure(
            load, "local", down_urls, down_consumers, pids, args.repeat, "rabbitmq"
        )
        policy = json.dumps({"federation-upstream-set": "all"})
        rmq.ctl(down1, "set_policy", "--apply-to", "exchanges", "fed", f"^{EXCHANGE}$", policy)
        for mode in args.ack_modes:
            name = f"up-{mode}"
            # Without a trailing slash: in RabbitMQ's URIs "amqp://host/" names the vhost "".
            uris = [u.rstrip("/") for u in up_urls]
            value = json.dumps({"uri": uris, "ack-mode": mode, "reconnect-delay": 1})
            rmq.ctl(down1, "set_parameter", "federation-upstream", name, value)
            try:
                took = wait_flowing(up_urls[0], down_urls[0])
            except RuntimeError as e:
                status = rmq.ctl(down1, "federation_status")
                raise RuntimeError(f"{e}; federation_status: {status.strip()}") from None
            res = measure(
                load, f"federated {mode}", up_urls, down_consumers, pids, args.repeat, "rabbitmq"
            )
            res["link_ready_after_s"] = took
            with contextlib.suppress(Exception):
                status = json.loads(rmq.ctl(down1, "federation_status", "--formatter", "json"))
                res["link"] = [{k: v for k, v in s.items() if k != "timestamp"} for s in status]
            out[f"federated_{mode}"] = res
            rmq.ctl(down1, "clear_parameter", "federation-upstream", name)
            time.sleep(2)
            listed = rmq.ctl(names["up"][0], "list_queues", "name", "--no-table-headers")
            left = [q.strip() for q in listed.splitlines() if q.startswith("federation:")]
            delete_queues(up_urls[0], left)
    return out


def rabbitmq_version() -> str:
    r = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"],
        capture_output=True,
        text=True,
        check=False,
    )
    return r.stdout.strip() or "unknown"


# ------------------------------------------------------------------ main


def ratios(result: dict[str, Any], modes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for who in ("cpgbroker", "rabbitmq"):
        r = result.get(who) or {}
        local = (r.get("local") or {}).get("msg_s")
        for mode in modes:
            fed = (r.get(f"federated_{mode}") or {}).get("msg_s")
            if local and fed:
                out[f"{who}_federated_{mode}_to_local"] = round(fed / local, 2)
    ours, theirs = result.get("cpgbroker") or {}, result.get("rabbitmq") or {}
    for key in ["local", *(f"federated_{m}" for m in modes)]:
        a, b = (ours.get(key) or {}).get("msg_s"), (theirs.get(key) or {}).get("msg_s")
        if a and b:
            out[f"cpgbroker_to_rabbitmq_{key}"] = round(a / b, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5,000 messages a run, no RabbitMQ")
    ap.add_argument("--messages", type=int, help="messages per run (default 50,000)")
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--size", type=int, default=1024, help="body bytes (default 1024)")
    ap.add_argument(
        "--ack-modes",
        type=lambda s: s.split(","),
        default=["on-confirm", "no-ack"],
        help="upstream ack-modes to measure, comma-separated (default on-confirm,no-ack)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per measurement (median kept)")
    ap.add_argument(
        "--latency-rate",
        type=float,
        default=1000.0,
        help="after each measurement, one run at this total rate (10 s; --quick 3 s) for "
        "latency; 0: none (default 1000 msg/s)",
    )
    ap.add_argument(
        "--rabbitmq",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure RabbitMQ (default: yes, but not with --quick)",
    )
    ap.add_argument("--cpgbroker", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--push",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cpgbroker: also measure a pushing link, down's publishers to up's consumers "
        "(RabbitMQ's federation only pulls)",
    )
    ap.add_argument(
        "--rabbitmq-nodes",
        type=int,
        choices=(1, 3),
        default=3,
        help="RabbitMQ nodes per cluster: 3 (quorum queue) or 1 (durable classic queue)",
    )
    ap.add_argument(
        "--rabbitmq-port",
        type=int,
        default=5761,
        help="AMQP port of up's first RabbitMQ node (down's: +10; dist ports +20000)",
    )
    ap.add_argument("--epmd-port", type=int, default=4393)
    ap.add_argument(
        "--store",
        action="store_true",
        help="cpgbroker members with durable stores (fsync always), persistent messages",
    )
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    args = ap.parse_args()
    if args.messages is None:
        args.messages = 5000 if args.quick else 50000
    if args.rabbitmq is None:
        args.rabbitmq = not args.quick
    bad = [m for m in args.ack_modes if m not in ("on-confirm", "on-publish", "no-ack")]
    if bad:
        ap.error(f"unknown ack-mode(s): {', '.join(bad)}")
    if args.rabbitmq and not (SBIN / "rabbitmq-server").exists():
        ap.error("RabbitMQ is not installed (Debian's rabbitmq-server); use --no-rabbitmq")
    # SIGTERM unwinds like Ctrl-C: every cluster and node started so far is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started = time.time()
    load = Load(args)
    result: dict[str, Any] = {
        "setup": {
            "messages_per_run": load.producers * max(1, args.messages // load.producers),
            "body_bytes": args.size,
            "producers": args.producers,
            "consumers": args.consumers,
            "confirms": True,
            "consumer_acks": "each",
            "ack_modes": args.ack_modes,
            "link_options": "reconnect-delay 1 s, prefetch-count the default (1,000)",
            "topology": f"topic exchange {EXCHANGE!r} on both clusters; durable queue "
            f"{QUEUE!r} on down bound with '#'; down's {EXCHANGE!r} federated from up "
            "(upstream URIs: all of up's nodes; policy federation-upstream-set all)",
            "local": "publishers on down's members -> consumers on down",
            "federated": "publishers on up's members -> link -> consumers on down",
            "msg_s": "messages consumed / (last delivery - first publish)",
            "repeat": args.repeat,
            "latency_runs": (
                f"one run at {args.latency_rate:g} msg/s for {load.latency_secs:g} s after each "
                "measurement (at_<rate>_msg_s)"
                if args.latency_rate
                else "none"
            ),
            "cores": os.cpu_count(),
        },
    }
    if args.cpgbroker:
        result["cpgbroker"] = run_cpgbroker(args, load)
    if args.rabbitmq:
        result["rabbitmq"] = run_rabbitmq(args, load)
    result["ratios"] = ratios(result, args.ack_modes)
    result["seconds_total"] = round(time.time() - started, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

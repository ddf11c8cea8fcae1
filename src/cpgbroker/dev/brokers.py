"""One broker per node of a :class:`~cpgbroker.dev.cluster.DevCluster`: a local cluster of
cpgbroker members for development, tests and the demo.

Each broker process runs in the host's network namespace, so its AMQP port and status
endpoint are on loopback where clients on this machine reach them, while its CPG handle is
opened inside its node's namespace (``[cluster] netns``) and so talks to that node's corosync.
Killing a node therefore looks to the others exactly like a machine failure.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cpgbroker.dev.cluster import DevCluster, DevClusterError
from cpgbroker.errors import ConfigError
from cpgbroker.runtime.admin import adminclient
from cpgbroker.runtime.admin import secret as admin_secret

PROCESS = "broker"


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where outgoing connections get theirs)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports, below the kernel's ephemeral range: a port the
    kernel handed out (bind to port 0) can be taken as the local port of any outgoing
    connection (a client, another test) before the broker binds it, and the broker then fails
    with "Address already in use". The probe sockets stay open until all are chosen."""
    low = _ephemeral_low()
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randrange(10000, max(low, 10001))))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class BrokerSet:
    def __init__(
        self,
        dc: DevCluster,
        *,
        group: str | None = None,
        ports: dict[int, tuple[int, int]] | None = None,
        extra_config: str = "",
        python: str = sys.executable,
        pythons: dict[int, str] | None = None,
        event_log: bool = True,
        name: str = PROCESS,
        checkpoint_every: int | None = None,
        store: bool = False,
        fsync: str = "always",
        store_options: str = "",
        tls: bool = False,
        cluster_options: str = "",
        local: bool = False,
    ) -> None:
        self.dc = dc
        # More ``[cluster]`` lines (TOML), e.g. ``mode = "hot-standby"``.
        self.cluster_options = cluster_options
        # Give each member a durable store (``store_path``), with this fsync policy.
        self.store = store
        self.fsync = fsync
        # More ``[store]`` lines (TOML), e.g. ``free_disk_limit_mib = 0``.
        self.store_options = store_options
        # Names this set's processes and files in each node directory, so that several sets
        # (several clusters of brokers) can share one corosync cluster.
        self.name = name
        self.group = group or f"cpgbroker-{dc.prefix}"
        self.python = python
        # nodeid -> the interpreter that member runs on instead of ``python``: an earlier
        # release's (cpgbroker.dev.releases), for clusters of mixed releases in upgrade tests.
        self.pythons: dict[int, str] = dict(pythons or {})
        self.extra_config = extra_config
        self.event_log = event_log
        # None: the broker's default.
        self.checkpoint_every = checkpoint_every
        # nodeid -> (amqp port, status port) on 127.0.0.1
        if ports is None:
            free = free_ports(2 * len(dc.nodes))
            ports = {n.nodeid: (free[2 * i], free[2 * i + 1]) for i, n in enumerate(dc.nodes)}
        self.ports = ports
        # An amqps listener per member too (``tls_url``); the ``[tls]`` section (certificates)
        # comes with ``extra_config``.
        self.tls_ports: dict[int, int] = {}
        if tls:
            used = {p for pair in ports.values() for p in pair}
            spare = [p for p in free_ports(3 * len(dc.nodes)) if p not in used]
            self.tls_ports = {n.nodeid: spare[i] for i, n in enumerate(dc.nodes)}
        # A member-local listener per member too (``local_url``: ``[cluster] local_listen``).
        self.local_ports: dict[int, int] = {}
        if local:
            used = {p for pair in ports.values() for p in pair} | set(self.tls_ports.values())
            spare = [p for p in free_ports(4 * len(dc.nodes)) if p not in used]
            self.local_ports = {n.nodeid: spare[i] for i, n in enumerate(dc.nodes)}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    # -- persistence (for `cpgbroker devcluster` commands run as separate processes)
    @property
    def state_file(self) -> Path:
        return self.dc.base / f"{self.name}.json"

    def save(self) -> None:
        self.state_file.write_text(
            json.dumps(
                {
                    "group": self.group,
                    "name": self.name,
                    "ports": {str(n): list(p) for n, p in self.ports.items()},
                    "checkpoint_every": self.checkpoint_every,
                    "store": self.store,
                    "fsync": self.fsync,
                }
            )
        )

    @classmethod
    def load(cls, dc: DevCluster, name: str = PROCESS) -> BrokerSet | None:
        path = dc.base / f"{name}.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        ports = {int(n): (int(p[0]), int(p[1])) for n, p in data["ports"].items()}
        return cls(
            dc,
            group=data["group"],
            ports=ports,
            name=data["name"],
            checkpoint_every=data.get("checkpoint_every"),
            store=bool(data.get("store", False)),
            fsync=str(data.get("fsync", "always")),
        )

    def pid(self, nodeid: int) -> int | None:
        proc = self.procs.get(nodeid)
        if proc is not None:
            return proc.pid
        return self.dc.node(nodeid).processes.get(self.name)

    # -- addresses
    def url(self, nodeid: int) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.ports[nodeid][0]}/"

    def local_url(self, nodeid: int) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.local_ports[nodeid]}/"

    def tls_url(self, nodeid: int) -> str:
        return f"amqps://guest:guest@127.0.0.1:{self.tls_ports[nodeid]}/"

    def admin(self, nodeid: int) -> str:
        return f"http://127.0.0.1:{self.ports[nodeid][1]}/status"

    def secret_path(self) -> Path:
        """The admin secret every member of this set shares (the first to start writes it):
        ``cpgbroker status --secret-file`` takes it."""
        return self.dc.base / f"{self.name}.admin.secret"

    def cli_args(self, nodeid: int) -> list[str]:
        """The ``cpgbroker status / cluster stop / member stop`` options that reach a member."""
        return ["--url", self.admin(nodeid), "--secret-file", str(self.secret_path())]

    def admin_target(self, nodeid: int) -> adminclient.AdminTarget:
        return adminclient.AdminTarget(
            f"http://127.0.0.1:{self.ports[nodeid][1]}",
            admin_secret.read_secret(self.secret_path()),
        )

    def log_path(self, nodeid: int) -> Path:
        return Path(self.dc.node(nodeid).dir) / f"{self.name}.log"

    def wait_log(self, nodeid: int, text: str, timeout: float = 10.0) -> str:
        """The member's log once it holds ``text``.

        A member logs what it did after the peer has seen it (a refused TLS handshake reaches
        the client before the line reaches the file), so a check right after the client's
        error must wait for the line rather than read the file once.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                log = self.log_path(nodeid).read_text(errors="replace")
            except OSError:
                log = ""
            if text in log:
                return log
            if time.monotonic() > deadline:
                raise DevClusterError(
                    f"{text!r} never logged by member {nodeid}:\n{self.tail(nodeid, 30)}"
                )
            time.sleep(0.05)

    def event_log_path(self, nodeid: int) -> Path:
        return Path(self.dc.node(nodeid).dir) / f"{self.name}.events.jsonl"

    def store_path(self, nodeid: int) -> Path:
        return Path(self.dc.node(nodeid).dir) / f"{self.name}.store"

    def config_path(self, nodeid: int) -> Path:
        return Path(self.dc.node(nodeid).dir) / f"{self.name}.toml"

    # -- lifecycle
    def write_config(self, nodeid: int) -> Path:
        amqp, admin = self.ports[nodeid]
        lines = [
            "[server]",
            f'listen = ["127.0.0.1:{amqp}"]',
            f'admin = "127.0.0.1:{admin}"',
            f'admin_secret_file = "{self.secret_path()}"',
            "shutdown_grace = 2.0",
        ]
        if nodeid in self.tls_ports:
            lines.append(f'listen_tls = ["127.0.0.1:{self.tls_ports[nodeid]}"]')
        lines += [
            "",
            "[cluster]",
            f'group = "{self.group}"',
            f"size = {self.dc.size}",
            f'url = "amqp://127.0.0.1:{amqp}/"',
            f'netns = "{self.dc.netns(nodeid)}"',
            "ready_timeout = 60",
        ]
        if self.event_log:
            lines.append(f'event_log = "{self.event_log_path(nodeid)}"')
        if self.checkpoint_every is not None:
            lines.append(f"checkpoint_every = {self.checkpoint_every}")
        if nodeid in self.local_ports:
            lines.append(f'local_listen = ["127.0.0.1:{self.local_ports[nodeid]}"]')
        if self.cluster_options:
            lines.append(self.cluster_options)
        if self.store:
            lines += [
                "",
                "[store]",
                f'dir = "{self.store_path(nodeid)}"',
                f'fsync = "{self.fsync}"',
            ]
            if self.store_options:
                lines.append(self.store_options)
        path = self.config_path(nodeid)
        path.write_text("\n".join(lines) + "\n" + self.extra_config)
        return path

    def set_python(self, nodeid: int, python: str | None) -> None:
        """Run the member on ``python`` from its next start on (None: ``self.python`` again):
        how an upgrade test swaps one member's release while the others keep running."""
        if python is None:
            self.pythons.pop(nodeid, None)
        else:
            self.pythons[nodeid] = python

    def python_of(self, nodeid: int) -> str:
        """The interpreter the member starts on."""
        return self.pythons.get(nodeid, self.python)

    def start(self, nodeid: int, *, force_boot: bool = False) -> subprocess.Popen[bytes]:
        cfg = self.write_config(nodeid)
        env = dict(os.environ)
        with open(self.log_path(nodeid), "ab") as log:
            proc = subprocess.Popen(
                [self.python_of(nodeid), "-m", "cpgbroker", "start", "--config", str(cfg)]
                + (["--force-boot"] if force_boot else []),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.procs[nodeid] = proc
        # Recorded with the node so that `devcluster down` (and crash cleanup) kills it too.
        self.dc.adopt_process(nodeid, self.name, proc)
        return proc

    def start_all(self, timeout: float = 60.0) -> None:
        for n in self.dc.nodes:
            self.start(n.nodeid)
        self.wait_ready([n.nodeid for n in self.dc.nodes], timeout)

    def wait_ready(self, nodes: list[int], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        pending = list(nodes)
        while pending:
            for n in list(pending):
                proc = self.procs.get(n)
                if proc is not None and proc.poll() is not None:
                    raise DevClusterError(
                        f"broker on node {n} exited with {proc.returncode}; last log lines:\n"
                        + self.tail(n)
                    )
                s = self.status(n)
                if s is not None and s.get("state") == "ready":
                    pending.remove(n)
            if pending and time.monotonic() > deadline:
                raise DevClusterError(
                    f"brokers on nodes {pending} not ready after {timeout:.0f} s:\n"
                    + "\n".join(self.tail(n) for n in pending)
                )
            if pending:
                time.sleep(0.1)

    def kill(self, nodeid: int) -> None:
        """SIGKILL the broker (its corosync keeps running): a crashed broker process."""
        proc = self.procs.get(nodeid)
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            return
        pid = self.pid(nodeid)
        if pid is None:
            raise DevClusterError(f"node {nodeid} runs no broker")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def stop(self, nodeid: int, timeout: float = 10.0) -> int | None:
        """Stop the broker gracefully (SIGTERM: its clients get 320, its event log is flushed);
        SIGKILL after ``timeout``. Returns the exit status when this process started it."""
        proc = self.procs.get(nodeid)
        if proc is None:
            # Started by another command: only its pid is known.
            pid = self.pid(nodeid)
            if pid is None:
                raise DevClusterError(f"node {nodeid} runs no broker")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                if not self.dc.wait_dead([pid], timeout):
                    os.kill(pid, signal.SIGKILL)
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return proc.returncode

    def stop_all(self) -> None:
        for n in list(self.procs):
            self.stop(n)

    # -- observation
    def status(self, nodeid: int, digest: bool = False) -> dict[str, Any] | None:
        try:
            http, data = adminclient.request(
                self.admin_target(nodeid),
                "GET",
                "/status" + ("?digest=1" if digest else ""),
                timeout=5,
            )
        except (OSError, ValueError, ConfigError):
            # Not up yet (no endpoint, or no secret written yet), or gone.
            return None
        return data if http == 200 else None

    def control(self, nodeid: int, path: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST a control request (``/stop``, ``/faults``) to a member's status endpoint; the
        HTTP status and the JSON answer."""
        return adminclient.request(self.admin_target(nodeid), "POST", path, args)

    def converged(self, nodes: list[int], timeout: float = 20.0) -> str:
        """Wait until ``nodes`` applied the same events and hold the same state; the digest.

        Ticks keep arriving, so members are asked at the same moment (one thread each) and
        asked again until a sample catches them all at the same event.
        """
        deadline = time.monotonic() + timeout
        last: list[Any] = []
        with concurrent.futures.ThreadPoolExecutor(len(nodes)) as pool:
            while True:
                stats = list(pool.map(lambda n: self.status(n, digest=True), nodes))
                last = [None if s is None else (s["event_seq"], s["digest"]) for s in stats]
                if all(x is not None for x in last) and len(set(last)) == 1:
                    return str(last[0][1])
                if time.monotonic() > deadline:
                    raise DevClusterError(f"members {nodes} did not converge: {last}")
                time.sleep(0.05)

    def tail(self, nodeid: int, lines: int = 15) -> str:
        try:
            text = self.log_path(nodeid).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

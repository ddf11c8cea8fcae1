"""A 3-node RabbitMQ cluster on a dev cluster's nodes, and the fault loop against it.

What the same clients, load and fault schedule do to a RabbitMQ quorum queue, next to what they
do to our own members (:mod:`cpgbroker.dev.faultloop`): one sitting, one machine.

Theory of operation
-------------------
:class:`RabbitNodes` runs one RabbitMQ node (Debian's ``rabbitmq-server``, 3.10.8 where this
was written) inside each node namespace of a running :class:`~cpgbroker.dev.cluster.DevCluster`,
so that the dev cluster's partition and heal (:meth:`DevCluster.partition`) cut a RabbitMQ node
off as they cut a corosync off:

* Node ``i`` is ``r<i>@<node address>`` (a long name: the address is its own host name, so no
  resolver is needed), with its own epmd inside the namespace, Erlang distribution on the
  node's veth (port ``dist_port``), AMQP on ``amqp_port`` in the namespace, and config, data,
  logs and Erlang cookie under ``<cluster dir>/<name>``. Nodes 2 and 3 join node 1
  (``rabbitmqctl join_cluster``); RabbitMQ's defaults otherwise (``net_ticktime`` 60 s,
  ``cluster_partition_handling = ignore``).
* Clients reach each node on 127.0.0.1 (``url``), as they reach our members: a ``socat`` in the
  host's namespace listens there and hands each connection over a Unix socket (file-system
  sockets cross namespaces) to a ``socat`` inside the node's namespace, which connects to the
  node's AMQP port on the namespace's loopback. So a partition cuts the node off from the
  other nodes but not from its clients, as a partition of our primary's corosync does.
* Every process is started in a session of its own and recorded with its node
  (:meth:`DevCluster.adopt_process`), so the cluster's teardown ends it too; :meth:`stop_all`
  stops the nodes (SIGTERM: RabbitMQ's own orderly shutdown) and the helpers by pid.

:class:`RabbitFaultLoop` is the fault loop with the brokers swapped: the queue is a quorum
queue (``x-queue-type: quorum``, 3 replicas), and "the primary" is the queue's Raft leader
(``rabbitmqctl list_queues name leader``, asked of the first node that answers). The fault
kinds, as close to ours as RabbitMQ allows:

* ``kill_primary_broker``: SIGKILL the leader's node (its whole process group: the Erlang VM
  and its helpers), started again ``broker_restart_after_s`` later;
* ``stop_primary_corosync``: RabbitMQ has no separate membership daemon to freeze, so the
  leader's node itself is frozen: SIGSTOP of its process group for ``stop_for_s``, then
  SIGCONT;
* ``partition_primary``: the leader's node namespace is cut off the dev cluster's network for
  ``partition_for_s`` (its clients still reach it, see above);
* ``kill_backup_corosync``: SIGKILL a follower's node (the followers in turn), started again
  ``corosync_restart_after_s`` later.

The end is the loop's: publishing stops, every fault is undone, every node must answer
``rabbitmqctl await_startup``, the consumers drain. RabbitMQ members have no digest to compare:
the result's ``digest`` is None and ``converge_error`` says so; ``members`` shows each node's
role for the queue and what the leader holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cpgbroker.dev.brokers import free_ports
from cpgbroker.dev.cluster import DevCluster, DevClusterError
from cpgbroker.dev.faultloop import FaultLoop, FaultLoopOptions
from cpgbroker.dev.netns import find_tool, pid_alive, proc_state

RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
EPMD_PORT = 4369
AMQP_PORT = 5672
DIST_PORT = 25672


def rabbitmq_missing() -> str | None:
    """Why RabbitMQ nodes cannot run here, or None when they can."""
    for tool in ("rabbitmq-server", "rabbitmqctl"):
        if not (RABBITMQ_BIN / tool).exists():
            return f"{RABBITMQ_BIN / tool} is missing: apt-get install rabbitmq-server"
    for tool in ("epmd", "socat"):
        if find_tool(tool) is None:
            return f"{tool} is not installed (apt-get install {tool})"
    return None


class RabbitNodes:
    """One RabbitMQ node per node of a running dev cluster, clustered (module docstring)::

    rn = RabbitNodes(dc)
    rn.start_all()
    ...  # clients on rn.url(1), rn.url(2), rn.url(3)
    rn.stop_all()
    """

    def __init__(
        self,
        dc: DevCluster,
        *,
        name: str = "rabbitmq",
        epmd_port: int = EPMD_PORT,
        amqp_port: int = AMQP_PORT,
        dist_port: int = DIST_PORT,
    ) -> None:
        problem = rabbitmq_missing()
        if problem is not None:
            raise DevClusterError(problem)
        self.dc = dc
        self.name = name
        self.base = dc.base / name
        self.epmd_port = epmd_port
        self.amqp_port = amqp_port
        self.dist_port = dist_port
        self.nodes = [n.nodeid for n in dc.nodes]
        # nodeid -> the port its clients reach it on, at 127.0.0.1 (the host-side forwarder).
        free = free_ports(len(self.nodes))
        self.ports: dict[int, int] = {n: free[i] for i, n in enumerate(self.nodes)}
        # nodeid -> the node's rabbitmq-server (the session leader of its processes).
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        # The helpers (epmd, forwarders), by (nodeid, role).
        self.helpers: dict[tuple[int, str], subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------------ naming

    def node_name(self, nodeid: int) -> str:
        return f"r{nodeid}@{self.dc.address(nodeid)}"

    def node_of_name(self, name: str | None) -> int | None:
        for n in self.nodes:
            if name == self.node_name(n):
                return n
        return None

    def url(self, nodeid: int) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.ports[nodeid]}/"

    def dir(self, nodeid: int) -> Path:
        return self.base / f"r{nodeid}"

    def log_path(self, nodeid: int) -> Path:
        """The node's console output (its own log is under ``dir(nodeid)/log``)."""
        return self.dir(nodeid) / "log" / "stdout"

    def _socket(self, nodeid: int) -> Path:
        return self.dir(nodeid) / "amqp.sock"

    def _env(self, nodeid: int) -> dict[str, str]:
        d = self.dir(nodeid)
        return {
            **os.environ,
            # The Erlang cookie is $HOME/.erlang.cookie: this cluster's own.
            "HOME": str(self.base / "home"),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_CRASH_DUMP": str(d / "erl_crash.dump"),
            "RABBITMQ_USE_LONGNAME": "true",
            "RABBITMQ_NODENAME": self.node_name(nodeid),
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PID_FILE": str(d / "beam.pid"),
        }

    # ------------------------------------------------------------------ tools

    def ctl(
        self, nodeid: int, args: Sequence[str], *, tool: str = "rabbitmqctl", timeout: float = 60.0
    ) -> str:
        """Run ``rabbitmqctl`` (or another RabbitMQ CLI tool) inside ``nodeid``'s namespace
        against its node; its output (a failure is a :class:`DevClusterError`)."""
        argv = [str(RABBITMQ_BIN / tool), "-n", self.node_name(nodeid), "-q", *args]
        try:
            res = subprocess.run(
                self.dc.exec_argv(nodeid, argv),
                env=self._env(nodeid),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise DevClusterError(f"{tool} {' '.join(args)} on node {nodeid}: no answer") from e
        if res.returncode != 0:
            raise DevClusterError(
                f"{tool} {' '.join(args)} on node {nodeid} failed (exit {res.returncode}): "
                f"{(res.stderr or res.stdout).strip()[-500:]}"
            )
        return res.stdout

    def _spawn(
        self, nodeid: int, role: str, argv: Sequence[str], *, inside: bool = True
    ) -> subprocess.Popen[bytes]:
        log_dir = self.dir(nodeid) / "log"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"{role}.log", "ab") as log:
            proc = subprocess.Popen(
                self.dc.exec_argv(nodeid, argv) if inside else list(argv),
                env=self._env(nodeid),
                cwd=self.dir(nodeid),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.dc.adopt_process(nodeid, f"{self.name}-{role}", proc)
        return proc

    # ------------------------------------------------------------------ life cycle

    def _prepare(self) -> None:
        home = self.base / "home"
        home.mkdir(parents=True, exist_ok=True)
        (self.base / "rabbitmq-env.conf").write_text("")
        (self.base / "enabled_plugins").write_text("[].\n")
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(10))
            cookie.chmod(0o400)
        for n in self.nodes:
            d = self.dir(n)
            shutil.rmtree(d / "mnesia", ignore_errors=True)
            (d / "mnesia").mkdir(parents=True, exist_ok=True)
            (d / "log").mkdir(parents=True, exist_ok=True)
            (d / "rabbitmq.conf").write_text(f"listeners.tcp.default = {self.amqp_port}\n")

    def _start_helpers(self, nodeid: int) -> None:
        epmd = find_tool("epmd") or "epmd"
        socat = find_tool("socat") or "socat"
        sock = self._socket(nodeid)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        self.helpers[(nodeid, "epmd")] = self._spawn(
            nodeid, "epmd", [epmd, "-port", str(self.epmd_port)]
        )
        self.helpers[(nodeid, "fwd-in")] = self._spawn(
            nodeid,
            "fwd-in",
            [socat, f"UNIX-LISTEN:{sock},fork", f"TCP:127.0.0.1:{self.amqp_port}"],
        )
        self.helpers[(nodeid, "fwd-out")] = self._spawn(
            nodeid,
            "fwd-out",
            [
                socat,
                f"TCP-LISTEN:{self.ports[nodeid]},bind=127.0.0.1,fork,reuseaddr",
                f"UNIX-CONNECT:{sock}",
            ],
            inside=False,
        )

    def start(self, nodeid: int) -> subprocess.Popen[bytes]:
        """Start ``nodeid``'s node (its data kept: a restart rejoins the cluster); no wait."""
        # A pid file left by a killed node would name a dead process to `rabbitmqctl wait`.
        with contextlib.suppress(FileNotFoundError):
            (self.dir(nodeid) / "beam.pid").unlink()
        proc = self._spawn(nodeid, "server", [str(RABBITMQ_BIN / "rabbitmq-server")])
        self.procs[nodeid] = proc
        return proc

    def wait_ready(self, nodes: Sequence[int], timeout: float = 120.0) -> None:
        """Wait until every node in ``nodes`` runs its application."""
        deadline = time.monotonic() + timeout
        for n in nodes:
            left = max(1.0, deadline - time.monotonic())
            proc = self.procs.get(n)
            if proc is None or proc.poll() is not None:
                raise DevClusterError(f"RabbitMQ node {n} is not running")
            self.ctl(n, ["wait", "--timeout", str(int(left)), str(self.dir(n) / "beam.pid")],
                     timeout=left + 10)  # fmt: skip
            self.ctl(n, ["await_startup", "--timeout", str(int(left))], timeout=left + 10)

    def start_all(self, timeout: float = 180.0) -> None:
        """Fresh nodes on every dev cluster node, clustered (node 1 first, the others join)."""
        self._prepare()
        for n in self.nodes:
            self._start_helpers(n)
        try:
            for n in self.nodes:
                self.start(n)
            self.wait_ready(self.nodes, timeout)
            first = self.nodes[0]
            for n in self.nodes[1:]:
                self.ctl(n, ["stop_app"])
                self.ctl(n, ["join_cluster", self.node_name(first)])
                self.ctl(n, ["start_app"])
            self.wait_ready(self.nodes, timeout)
        except BaseException:
            self.stop_all()
            raise

    def alive(self, nodeid: int) -> bool:
        proc = self.procs.get(nodeid)
        return proc is not None and proc.poll() is None

    def _signal(self, nodeid: int, sig: signal.Signals) -> None:
        proc = self.procs.get(nodeid)
        if proc is None or proc.poll() is not None:
            raise DevClusterError(f"RabbitMQ node {nodeid} is not running")
        # Its own session: the server script, the Erlang VM and its helper processes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def kill(self, nodeid: int) -> None:
        """SIGKILL the node (every process of its session)."""
        self._signal(nodeid, signal.SIGKILL)
        proc = self.procs[nodeid]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    def stop(self, nodeid: int) -> None:
        """SIGSTOP the node: it hangs, its sockets stay open."""
        self._signal(nodeid, signal.SIGSTOP)

    def resume(self, nodeid: int) -> None:
        """SIGCONT a stopped node."""
        self._signal(nodeid, signal.SIGCONT)

    def stopped(self, nodeid: int) -> bool:
        beam = self._beam_pid(nodeid)
        return beam is not None and proc_state(beam) == "T"

    def _beam_pid(self, nodeid: int) -> int | None:
        try:
            pid = int((self.dir(nodeid) / "beam.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def stop_all(self, timeout: float = 30.0) -> None:
        """Stop every node (SIGTERM, after SIGCONT; SIGKILL after ``timeout``) and helper."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for n, proc in self.procs.items():
            # What the session left (an Erlang helper, say).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(DevClusterError):
                self.dc.stop_process(n, f"{self.name}-server", timeout=1.0)
        for (n, role), proc in self.helpers.items():
            # A forwarder's children (one per connection) are in its session.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            with contextlib.suppress(DevClusterError):
                self.dc.stop_process(n, f"{self.name}-{role}", timeout=1.0)
        self.procs.clear()
        self.helpers.clear()

    # ------------------------------------------------------------------ observation

    def version(self) -> str | None:
        for n in self.nodes:
            with contextlib.suppress(DevClusterError):
                return self.ctl(n, ["version"], timeout=20).strip() or None
        return None

    def queue_info(self, queue: str, *, timeout: float = 15.0) -> dict[str, Any] | None:
        """The quorum queue ``queue`` as the first node that answers shows it: ``leader`` and
        ``online`` as node ids, ``members``, ``messages`` (None: no node answered, or no
        such queue)."""
        for n in self.nodes:
            if not self.alive(n) or self.stopped(n):
                continue
            try:
                out = self.ctl(
                    n,
                    ["list_queues", "name", "leader", "members", "online", "messages",
                     "--formatter", "json"],
                    timeout=timeout,
                )  # fmt: skip
                rows = json.loads(out or "[]")
            except (DevClusterError, ValueError):
                continue
            for row in rows:
                if row.get("name") == queue:
                    return {
                        "asked": n,
                        "leader": self.node_of_name(row.get("leader")),
                        "members": [self.node_of_name(m) for m in row.get("members") or []],
                        "online": [self.node_of_name(m) for m in row.get("online") or []],
                        "messages": row.get("messages"),
                    }
            return None
        return None


class RabbitFaultLoop(FaultLoop):
    """The fault loop against :class:`RabbitNodes` and a quorum queue (module docstring)::

    rn = RabbitNodes(dc); rn.start_all()
    result = await RabbitFaultLoop(dc, rn, FaultLoopOptions(seconds=60)).run()
    """

    broker = "rabbitmq"
    queue_arguments: dict[str, Any] | None = {"x-queue-type": "quorum"}

    def __init__(
        self,
        dc: DevCluster,
        rabbit: RabbitNodes,
        options: FaultLoopOptions | None = None,
        *,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.rabbit = rabbit
        self._setup(dc, rabbit.ports, options, log)
        self._mode = "quorum-queue"

    def url(self, node: int) -> str:
        return self.rabbit.url(node)

    def statuses(self) -> dict[int, dict[str, Any] | None]:
        return {}

    def survey(self) -> tuple[int | None, dict[str, Any] | None]:
        """The queue's leader, and the queue as the node asked shows it."""
        info = self.rabbit.queue_info(self.queue)
        return (None if info is None else info["leader"]), info

    def kill_broker(self, node: int) -> None:
        self.dc.record_fault("kill-broker", node, url=self.url(node))
        self.rabbit.kill(node)

    def start_broker(self, node: int) -> None:
        self.dc.record_fault("start-broker", node, url=self.url(node))
        self.rabbit.start(node)

    def freeze(self, node: int) -> None:
        self.dc.record_fault("stop-broker", node, url=self.url(node))
        self.rabbit.stop(node)

    def thaw(self, node: int) -> None:
        self.dc.record_fault("resume-broker", node, url=self.url(node))
        self.rabbit.resume(node)

    def kill_backup(self, node: int) -> None:
        self.kill_broker(node)

    def restart_backup(self, node: int) -> dict[str, Any]:
        self.start_broker(node)
        return {}

    def restart_dead_brokers(self) -> list[dict[str, Any]]:
        done = []
        for n in self.nodes:
            if self.rabbit.alive(n):
                continue
            proc = self.rabbit.procs.get(n)
            self.start_broker(n)
            done.append({"node": n, "exit": None if proc is None else proc.returncode})
        return done

    def unfreeze(self) -> None:
        super().unfreeze()
        for n in self.nodes:
            with contextlib.suppress(Exception):
                if self.rabbit.alive(n) and self.rabbit.stopped(n):
                    self.rabbit.resume(n)

    def wait_ready(self) -> None:
        self.rabbit.wait_ready(self.nodes, timeout=self.opt.ready_timeout_s)

    def final_state(self) -> tuple[str | None, str | None, dict[str, Any]]:
        info = self.rabbit.queue_info(self.queue) or {}
        members: dict[str, Any] = {}
        for n in self.nodes:
            role = None
            if n == info.get("leader"):
                role = "leader"
            elif n in (info.get("members") or []):
                role = "follower"
            members[str(n)] = {
                "state": "running" if self.rabbit.alive(n) else "down",
                "role": role,
                "online": n in (info.get("online") or []),
                "queue_messages": info.get("messages") if role == "leader" else None,
            }
        return None, "not applicable: RabbitMQ members have no state digest", members

    def log_marks(self) -> list[dict[str, Any]]:
        return []

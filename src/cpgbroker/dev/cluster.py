"""A real N-node corosync cluster on one machine: the library API behind ``cpgbroker devcluster``.

Every node is a network namespace ``<prefix>-n<i>`` holding one veth interface with the address
``10.213.<subnet>.<i>``; the other ends of the veths sit on a bridge in a hub namespace
``<prefix>-hub`` (built by :mod:`cpgbroker.dev.netns`). Addresses exist only inside namespaces
this module created and the namespaces have no default route, so nothing touches the host's
interfaces or routes (and corosync's reverse-DNS lookups at startup fail at once instead of
leaving the machine).

One corosync runs per node namespace with its own config, state dir, log file and a private
``/run`` (corosync's pid file path is compiled in, and a second instance on the same ``/run``
refuses to start). The cluster's description is persisted as JSON in
``<state-dir>/<prefix>/state.json`` so that ``status`` and ``down`` work from a later invocation,
and ``down`` also sweeps namespaces by prefix so it cleans up after a crash even without that
file. Extra processes (a broker per node, later) can be attached to a node with
:meth:`DevCluster.spawn`; they are torn down with the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from cpgbroker.dev import netns
from cpgbroker.dev.corosynctools import (
    default_template,
    parse_quorumtool,
    remove_shm_leftovers,
    render_config,
    write_authkey,
)
from cpgbroker.dev.netns import DevClusterError as DevClusterError
from cpgbroker.dev.netns import find_tool, list_netns, pid_alive, proc_state

DEFAULT_STATE_DIR = Path("/tmp/cpgbroker-devcluster")
DEFAULT_PREFIX = "cpgdev"
DEFAULT_TOKEN_MS = 1000
# Prefixes of clusters made by the test fixture carry the pytest process's pid, so a later run can
# tell leftovers of a crashed run (pid gone) from a cluster another run is still using.
TEST_PREFIX_RE = re.compile(r"^cpgt-(\d+)-[0-9a-f]+$")
# Namespace names are file names under /run/netns; keep them short and shell-safe.
PREFIX_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
MAX_NODES = 16


@attrs.define
class Node:
    """One node of a dev cluster as persisted in the state file."""

    nodeid: int
    netns: str
    address: str
    dir: str
    pid: int | None = None
    stopped: bool = False
    partitioned: bool = False
    # Every corosync pid this node ever had: their /dev/shm files are removed at teardown.
    pids_seen: list[int] = attrs.Factory(list)
    # Extra managed processes on this node, by name (e.g. "broker"): torn down with the cluster.
    processes: dict[str, int] = attrs.Factory(dict)


@attrs.frozen
class NodeStatus:
    """What ``status`` reports for one node."""

    nodeid: int
    netns: str
    address: str
    pid: int | None
    process: str  # "running", "stopped" (SIGSTOP) or "dead"
    partitioned: bool
    quorate: bool
    total_votes: int | None
    expected_votes: int | None
    ring_id: str | None
    members: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.nodeid,
            "netns": self.netns,
            "address": self.address,
            "pid": self.pid,
            "process": self.process,
            "partitioned": self.partitioned,
            "quorate": self.quorate,
            "total_votes": self.total_votes,
            "expected_votes": self.expected_votes,
            "ring_id": self.ring_id,
            "members": list(self.members),
        }


def check_environment() -> str | None:
    """Why a dev cluster cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "devcluster needs root: it creates network namespaces (run it with sudo)"
    for tool, package in (
        ("ip", "iproute2"),
        ("corosync", "corosync"),
        ("corosync-quorumtool", "corosync"),
        ("mount", "mount"),
    ):
        if find_tool(tool) is None:
            extra = " libcpg-dev libcorosync-common-dev" if package == "corosync" else ""
            return (
                f"{tool} is not installed: apt-get install --no-install-recommends {package}{extra}"
            )
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces (/proc/self/ns/net is missing)"
    return None


class DevCluster:
    """An N-node corosync cluster in network namespaces on this machine.

    ``DevCluster(3).up()`` builds and starts it and waits until every node is quorate with 3
    votes; ``down()`` removes every process, namespace, /dev/shm file and directory it made.
    ``DevCluster.load(prefix)`` re-attaches to a cluster started by another process.
    """

    def __init__(
        self,
        nodes: int = 3,
        *,
        prefix: str = DEFAULT_PREFIX,
        token_ms: int = DEFAULT_TOKEN_MS,
        state_dir: Path | str = DEFAULT_STATE_DIR,
        template: Path | str | None = None,
        owner_pid: int | None = None,
        realtime: bool = False,
    ) -> None:
        if not PREFIX_RE.match(prefix):
            raise DevClusterError(
                f"bad prefix {prefix!r}: use 1-24 characters a-z, 0-9 and '-', "
                "starting with a letter"
            )
        if not 1 <= nodes <= MAX_NODES:
            raise DevClusterError(f"--nodes must be between 1 and {MAX_NODES}, not {nodes}")
        if not 100 <= token_ms <= 60000:
            raise DevClusterError(f"--token must be between 100 and 60000 ms, not {token_ms}")
        self.prefix = prefix
        self.token_ms = token_ms
        # Real-time scheduling for the corosyncs (their own default) only when asked: several
        # of them share a few cores with the brokers here, and at RT priority they preempt the
        # brokers whenever traffic keeps the token rotating (docs/performance.md). On real
        # nodes each corosync has its machine and keeps its default.
        self.realtime = realtime
        self.state_root = Path(state_dir)
        self.base = self.state_root / prefix
        self.template = Path(template) if template is not None else None
        self.owner_pid = owner_pid
        # Nodes whose corosync.conf was written elsewhere (a deployment's, `cluster init`):
        # used as is instead of the template (not saved: for the process that calls up()).
        self.corosync_configs: dict[int, Path] = {}
        self.subnet = self._pick_subnet()
        self.hub_netns = f"{prefix}-hub"
        self.nodes: list[Node] = [
            Node(
                nodeid=i,
                netns=f"{prefix}-n{i}",
                address=f"10.213.{self.subnet}.{i}",
                dir=str(self.base / f"n{i}"),
            )
            for i in range(1, nodes + 1)
        ]
        # Popen objects of processes this instance started, so that they can be reaped.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------------ persistence

    @property
    def state_file(self) -> Path:
        return self.base / "state.json"

    def _save(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        data = {
            "prefix": self.prefix,
            "token_ms": self.token_ms,
            "realtime": self.realtime,
            "subnet": self.subnet,
            "owner_pid": self.owner_pid,
            "nodes": [attrs.asdict(n) for n in self.nodes],
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def load(
        cls, prefix: str = DEFAULT_PREFIX, state_dir: Path | str = DEFAULT_STATE_DIR
    ) -> DevCluster:
        """Re-attach to a cluster started earlier (by this or another process)."""
        path = Path(state_dir) / prefix / "state.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DevClusterError(
                f"no dev cluster {prefix!r} (no {path}); start one with `cpgbroker devcluster up`"
            ) from None
        except (OSError, ValueError) as e:
            raise DevClusterError(f"cannot read {path}: {e}") from e
        self = cls(
            len(data["nodes"]),
            prefix=data["prefix"],
            token_ms=data["token_ms"],
            state_dir=state_dir,
            owner_pid=data.get("owner_pid"),
            # (State files from before the option existed describe real-time corosyncs.)
            realtime=data.get("realtime", True),
        )
        self.subnet = data["subnet"]
        self.nodes = [Node(**n) for n in data["nodes"]]
        return self

    def _pick_subnet(self) -> int:
        # Addresses only exist inside this cluster's namespaces, so two clusters could share a
        # subnet; distinct ones keep captures and logs of side-by-side clusters unambiguous.
        used = set()
        with contextlib.suppress(OSError):
            for state in self.state_root.glob("*/state.json"):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    used.add(int(json.loads(state.read_text())["subnet"]))
        start = zlib.crc32(self.prefix.encode()) % 250
        for k in range(250):
            candidate = 1 + (start + k) % 250
            if candidate not in used:
                return candidate
        return 1 + start

    # ------------------------------------------------------------------ accessors

    def node(self, nodeid: int) -> Node:
        if not 1 <= nodeid <= len(self.nodes):
            raise DevClusterError(f"no node {nodeid}: this cluster has nodes 1..{len(self.nodes)}")
        return self.nodes[nodeid - 1]

    def netns(self, nodeid: int) -> str:
        """Name of the network namespace of a node (for ``ip netns exec`` or setns)."""
        return self.node(nodeid).netns

    def address(self, nodeid: int) -> str:
        return self.node(nodeid).address

    @property
    def size(self) -> int:
        return len(self.nodes)

    def healthy_nodes(self) -> list[int]:
        """Nodes with a running, not stopped, not partitioned corosync."""
        return [
            n.nodeid
            for n in self.nodes
            if n.pid is not None and self._alive(n.pid) and not n.stopped and not n.partitioned
        ]

    # ------------------------------------------------------------------ lifecycle

    def up(self, timeout: float = 30.0) -> None:
        """Create the namespaces, start one corosync per node, wait for full quorum."""
        problem = check_environment()
        if problem:
            raise DevClusterError(problem)
        ours = [ns for ns in list_netns() if self._owns_netns(ns)]
        if ours or self.state_file.exists():
            raise DevClusterError(
                f"dev cluster {self.prefix!r} already exists; run `cpgbroker devcluster down"
                f" --prefix {self.prefix}` first"
            )
        template_path = self.template or default_template()
        try:
            template = template_path.read_text()
        except OSError as e:
            raise DevClusterError(f"cannot read template {template_path}: {e}") from e
        # Persist before creating anything, so `down` can clean up if we die half-way.
        self._save()
        try:
            self._create_network()
            if not self.authkey.exists():
                write_authkey(self.authkey)
            for node in self.nodes:
                self._write_config(node, template)
            for node in self.nodes:
                self._start_corosync(node)
            self._save()
            self.wait_quorate(timeout=timeout)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Remove every process, namespace, /dev/shm file and directory of this cluster."""
        pids: set[int] = set()
        victims: list[int] = []
        for node in self.nodes:
            pids.update(node.pids_seen)
            victims.extend(node.processes.values())
            if node.pid is not None:
                victims.append(node.pid)
        # Anything still inside our namespaces (processes started by `exec`, crashed runs).
        namespaces = [ns for ns in list_netns() if self._owns_netns(ns)]
        for ns in namespaces:
            for pid in netns.netns_pids(ns):
                if pid in (os.getpid(), os.getppid()):
                    continue
                victims.append(pid)
                if netns.proc_comm(pid) == "corosync":
                    pids.add(pid)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a SIGSTOPped process cannot act on SIGTERM
                os.kill(pid, signal.SIGTERM)
        self.wait_dead(victims, timeout=3.0)
        for pid in victims:
            if self._alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.wait_dead(victims, timeout=5.0)
        for ns in namespaces:
            netns.delete_netns(ns)
        remove_shm_leftovers(pids)
        shutil.rmtree(self.base, ignore_errors=True)
        for node in self.nodes:
            node.pid = None
            node.processes.clear()

    def __enter__(self) -> DevCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _owns_netns(self, ns: str) -> bool:
        node_ns = re.escape(self.prefix) + r"-n\d+"
        return ns == self.hub_netns or re.fullmatch(node_ns, ns) is not None

    @property
    def authkey(self) -> Path:
        """The corosync key every node of this cluster shares."""
        return self.base / "authkey"

    def _create_network(self) -> None:
        netns.add_hub(self.hub_netns)
        for node in self.nodes:
            netns.add_member(self.hub_netns, node.netns, node.address, self._port(node.nodeid))

    @staticmethod
    def _port(nodeid: int) -> str:
        """The bridge port in the hub that a node's link is plugged into."""
        return f"p{nodeid}"

    def _write_config(self, node: Node, template: str) -> None:
        d = Path(node.dir)
        for sub in ("run", "state"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        given = self.corosync_configs.get(node.nodeid)
        if given is not None:
            (d / "corosync.conf").write_text(given.read_text())
            return
        text = render_config(
            template,
            cluster_name=self.prefix,
            token_ms=self.token_ms,
            addresses=[n.address for n in self.nodes],
            logfile=str(d / "corosync.log"),
            state_dir=str(d / "state"),
            keyfile=str(self.authkey),
            realtime=self.realtime,
        )
        (d / "corosync.conf").write_text(text)

    def _start_corosync(self, node: Node) -> None:
        ip = find_tool("ip") or "ip"
        corosync = find_tool("corosync")
        if corosync is None:
            raise DevClusterError("corosync is not installed: apt-get install corosync")
        d = Path(node.dir)
        # `ip netns exec` gives the command a private mount namespace, so binding the node's own
        # directory over /run (for corosync's fixed pid file) is invisible everywhere else.
        script = 'mount --bind "$1" /run && exec "$2" -f -c "$3"'
        with open(d / "stdout.log", "ab") as log:
            proc = subprocess.Popen(
                [ip, "netns", "exec", node.netns, "sh", "-c", script, "sh",
                 str(d / "run"), corosync, str(d / "corosync.conf")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        # ip exec()s sh and sh exec()s corosync, so this pid is corosync's own.
        self._children[proc.pid] = proc
        node.pid = proc.pid
        node.stopped = False
        node.pids_seen.append(proc.pid)

    # ------------------------------------------------------------------ process helpers

    def _alive(self, pid: int) -> bool:
        child = self._children.get(pid)
        if child is not None:
            # poll() also reaps our own children, so they never linger as zombies.
            return child.poll() is None
        return pid_alive(pid)

    def wait_dead(self, pids: Iterable[int], timeout: float) -> bool:
        """Whether every process of ``pids`` ended within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        pending = [p for p in pids if self._alive(p)]
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            pending = [p for p in pending if self._alive(p)]
        return not pending

    def record_fault(self, action: str, nodeid: int, **extra: Any) -> None:
        """Append one line to ``faults.jsonl``: the fault-injection log ``cpgbroker audit``
        reads (when each node was killed, stopped, partitioned, restarted)."""
        rec = {"t_ns": time.time_ns(), "action": action, "node": nodeid, **extra}
        self.base.mkdir(parents=True, exist_ok=True)
        with open(self.base / "faults.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _corosync_pid(self, nodeid: int) -> int:
        node = self.node(nodeid)
        if node.pid is None or not self._alive(node.pid):
            raise DevClusterError(f"corosync on node {nodeid} is not running")
        return node.pid

    def kill(self, nodeid: int) -> None:
        """SIGKILL a node's corosync (a crash: the others see NODEDOWN after the token)."""
        pid = self._corosync_pid(nodeid)
        node = self.node(nodeid)
        self.record_fault("kill", nodeid)
        os.kill(pid, signal.SIGKILL)
        if not self.wait_dead([pid], timeout=5.0):
            raise DevClusterError(f"corosync {pid} on node {nodeid} survived SIGKILL")
        node.pid = None
        node.stopped = False
        remove_shm_leftovers([pid])
        self._save()

    def stop(self, nodeid: int) -> None:
        """SIGSTOP a node's corosync (a hang: longer than the token looks like a partition)."""
        pid = self._corosync_pid(nodeid)
        self.record_fault("stop", nodeid)
        os.kill(pid, signal.SIGSTOP)
        self.node(nodeid).stopped = True
        self._save()

    def resume(self, nodeid: int) -> None:
        """SIGCONT a stopped corosync."""
        pid = self._corosync_pid(nodeid)
        self.record_fault("resume", nodeid)
        os.kill(pid, signal.SIGCONT)
        self.node(nodeid).stopped = False
        self._save()

    def start(self, nodeid: int) -> None:
        """Start a node's corosync again after :meth:`kill` (does not wait for quorum)."""
        node = self.node(nodeid)
        if node.pid is not None and self._alive(node.pid):
            raise DevClusterError(f"corosync on node {nodeid} is already running")
        self.record_fault("start", nodeid)
        self._start_corosync(node)
        self._save()

    def restart(self, nodeid: int, *, wait: bool = True, timeout: float = 30.0) -> None:
        """Stop (gracefully if possible) and start a node's corosync; wait until it rejoined."""
        node = self.node(nodeid)
        self.record_fault("restart", nodeid)
        if node.pid is not None and self._alive(node.pid):
            pid = node.pid
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
            if not self.wait_dead([pid], timeout=5.0):
                os.kill(pid, signal.SIGKILL)
                self.wait_dead([pid], timeout=5.0)
            remove_shm_leftovers([pid])
            node.pid = None
        self.start(nodeid)
        if wait:
            self.wait_quorate(timeout=timeout)

    def partition(self, nodeid: int) -> None:
        """Cut a node's link: its port leaves the bridge, corosync itself keeps running."""
        self.record_fault("partition", nodeid)
        netns.cut_link(self.hub_netns, self._port(nodeid))
        self.node(nodeid).partitioned = True
        self._save()

    def heal(self, nodeid: int) -> None:
        """Reconnect a partitioned node's link."""
        self.record_fault("heal", nodeid)
        netns.join_link(self.hub_netns, self._port(nodeid))
        self.node(nodeid).partitioned = False
        self._save()

    def repair(self, timeout: float = 30.0) -> None:
        """Undo every kill, stop and partition and wait until all nodes are quorate again."""
        changed = False
        for node in self.nodes:
            if node.partitioned:
                self.heal(node.nodeid)
                changed = True
            if node.pid is not None and self._alive(node.pid):
                if node.stopped or proc_state(node.pid) == "T":
                    self.resume(node.nodeid)
                    changed = True
            else:
                self.start(node.nodeid)
                changed = True
        if changed or len(self.healthy_nodes()) != self.size:
            self.wait_quorate(timeout=timeout)

    # ------------------------------------------------------------------ running things inside

    def exec_argv(self, nodeid: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside a node's network namespace."""
        return netns.exec_argv(self.netns(nodeid), argv)

    def run_in(
        self, nodeid: int, argv: Sequence[str], **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` inside a node's namespace (keyword arguments pass through)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.exec_argv(nodeid, argv), check=False, **kwargs)

    def popen_in(self, nodeid: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` inside a node's namespace; the caller owns the process."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.exec_argv(nodeid, argv), **kwargs)

    def spawn(self, nodeid: int, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start a managed process in a node (output to ``<node dir>/<name>.log``).

        Managed processes are recorded in the state file and killed by :meth:`down` and
        :meth:`stop_process`; this is where a broker per node plugs in.
        """
        node = self.node(nodeid)
        if name in node.processes and self._alive(node.processes[name]):
            raise DevClusterError(f"node {nodeid} already runs a process named {name!r}")
        with open(Path(node.dir) / f"{name}.log", "ab") as log:
            proc = self.popen_in(
                nodeid, argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.adopt_process(nodeid, name, proc)
        return proc

    def adopt_process(self, nodeid: int, name: str, proc: subprocess.Popen[Any] | int) -> None:
        """Manage a process the caller started as part of a node (for example a broker in the
        host's namespace with only its CPG handle inside the node's).

        It is recorded in the state file, so :meth:`down` (also from another invocation, or
        the crash cleanup) terminates it with the cluster. A broker whose node is killed stops
        by itself: its corosync connection is gone.
        """
        node = self.node(nodeid)
        if isinstance(proc, subprocess.Popen):
            self._children[proc.pid] = proc
            pid = proc.pid
        else:
            pid = proc
        node.processes[name] = pid
        self._save()

    def stop_process(self, nodeid: int, name: str, timeout: float = 5.0) -> None:
        """SIGTERM (then SIGKILL) a managed process."""
        node = self.node(nodeid)
        pid = node.processes.pop(name, None)
        if pid is not None and self._alive(pid):
            os.kill(pid, signal.SIGTERM)
            if not self.wait_dead([pid], timeout):
                os.kill(pid, signal.SIGKILL)
                self.wait_dead([pid], 5.0)
        self._save()

    # ------------------------------------------------------------------ status

    def node_status(self, nodeid: int) -> NodeStatus:
        node = self.node(nodeid)
        process = "dead"
        if node.pid is not None and self._alive(node.pid):
            process = "stopped" if proc_state(node.pid) == "T" else "running"
        info: dict[str, Any] = {}
        if process == "running":
            # A hung corosync makes the tool hang too, hence the short timeout.
            qt = find_tool("corosync-quorumtool") or "corosync-quorumtool"
            with contextlib.suppress(subprocess.TimeoutExpired):
                res = self.run_in(
                    nodeid, [qt, "-s", "-p"], capture_output=True, text=True, timeout=3.0
                )
                # Exit 0: quorate; 2: running but not quorate; anything else: not answering.
                if res.returncode in (0, 2):
                    info = parse_quorumtool(res.stdout)
        return NodeStatus(
            nodeid=node.nodeid,
            netns=node.netns,
            address=node.address,
            pid=node.pid if process != "dead" else None,
            process=process,
            partitioned=node.partitioned,
            quorate=bool(info.get("quorate", False)),
            total_votes=info.get("total_votes"),
            expected_votes=info.get("expected_votes"),
            ring_id=info.get("ring_id"),
            members=tuple(info.get("members", ())),
        )

    def status(self) -> list[NodeStatus]:
        return [self.node_status(n.nodeid) for n in self.nodes]

    def wait_quorate(
        self,
        nodes: Iterable[int] | None = None,
        votes: int | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Wait until each given node (default: every healthy one) is quorate with ``votes``.

        ``votes`` defaults to the number of healthy nodes, so after ``up`` this means "every
        node sees all N", not just one: staggered nodes form singleton rings first.
        """
        want = list(nodes) if nodes is not None else self.healthy_nodes()
        need = votes if votes is not None else len(self.healthy_nodes())
        deadline = time.monotonic() + timeout
        last: list[NodeStatus] = []
        while True:
            last = [self.node_status(n) for n in want]
            if all(s.quorate and s.total_votes == need for s in last):
                return
            for s in last:
                if s.process == "dead":
                    raise DevClusterError(
                        f"corosync on node {s.nodeid} is not running; its log:\n"
                        + self.log_tail(s.nodeid)
                    )
            if time.monotonic() > deadline:
                summary = ", ".join(
                    f"n{s.nodeid}: {s.process}, quorate={s.quorate}, votes={s.total_votes}"
                    for s in last
                )
                raise DevClusterError(
                    f"nodes {want} not quorate with {need} votes after {timeout} s ({summary})"
                )
            time.sleep(0.1)

    def log_tail(self, nodeid: int, lines: int = 15) -> str:
        d = Path(self.node(nodeid).dir)
        out: list[str] = []
        for name in ("stdout.log", "corosync.log"):
            with contextlib.suppress(OSError):
                text = (d / name).read_text(errors="replace").splitlines()
                out.extend(f"  {name}: {t}" for t in text[-lines:])
        return "\n".join(out) or "  (no log output)"


def new_test_prefix() -> str:
    """A prefix for a cluster owned by this process (see :func:`cleanup_stale_test_clusters`)."""
    return f"cpgt-{os.getpid()}-{secrets.token_hex(2)}"


def cleanup_stale_test_clusters(state_dir: Path | str = DEFAULT_STATE_DIR) -> list[str]:
    """Tear down test clusters whose owning process is gone (a crashed or killed test run)."""
    prefixes: set[str] = set()
    for ns in list_netns():
        m = re.fullmatch(r"(cpgt-\d+-[0-9a-f]+)-(?:hub|n\d+)", ns)
        if m:
            prefixes.add(m.group(1))
    with contextlib.suppress(OSError):
        for d in Path(state_dir).iterdir():
            if TEST_PREFIX_RE.match(d.name):
                prefixes.add(d.name)
    removed = []
    for prefix in sorted(prefixes):
        m = TEST_PREFIX_RE.match(prefix)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            cluster = DevCluster.load(prefix, state_dir)
        except (DevClusterError, KeyError, TypeError):
            cluster = DevCluster(1, prefix=prefix, state_dir=state_dir)
        cluster.down()
        removed.append(prefix)
    return removed


@contextlib.contextmanager
def running_cluster(
    nodes: int = 3,
    *,
    token_ms: int = DEFAULT_TOKEN_MS,
    state_dir: Path | str = DEFAULT_STATE_DIR,
    timeout: float = 30.0,
    realtime: bool = False,
) -> Iterator[DevCluster]:
    """A test cluster with a unique, owner-tagged prefix, always torn down on exit."""
    cluster = DevCluster(
        nodes,
        prefix=new_test_prefix(),
        token_ms=token_ms,
        state_dir=state_dir,
        owner_pid=os.getpid(),
        realtime=realtime,
    )
    cluster.up(timeout=timeout)
    try:
        yield cluster
    finally:
        cluster.down()

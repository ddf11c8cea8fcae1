"""A real N-node corosync cluster on one machine: ``cpgbroker devcluster`` and its library API.

Every node is a network namespace ``<prefix>-n<i>`` holding one veth interface with the address
``10.213.<subnet>.<i>``; the other ends of the veths sit on a bridge in a hub namespace
``<prefix>-hub``. Addresses exist only inside namespaces this module created and the namespaces
have no default route, so nothing touches the host's interfaces or routes (and corosync's
reverse-DNS lookups at startup fail at once instead of leaving the machine).

One corosync runs per node namespace with its own config, state dir, log file and a private
``/run`` (corosync's pid file path is compiled in, and a second instance on the same ``/run``
refuses to start). The cluster's description is persisted as JSON in
``<state-dir>/<prefix>/state.json`` so that ``status`` and ``down`` work from a later invocation,
and ``down`` also sweeps namespaces by prefix so it cleans up after a crash even without that
file. Extra processes (a broker per node, later) can be attached to a node with
:meth:`DevCluster.spawn`; they are torn down with the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from cpgbroker.errors import CpgBrokerError

DEFAULT_STATE_DIR = Path("/tmp/cpgbroker-devcluster")
DEFAULT_PREFIX = "cpgdev"
DEFAULT_TOKEN_MS = 1000
# Prefixes of clusters made by the test fixture carry the pytest process's pid, so a later run can
# tell leftovers of a crashed run (pid gone) from a cluster another run is still using.
TEST_PREFIX_RE = re.compile(r"^cpgt-(\d+)-[0-9a-f]+$")
# Namespace names are file names under /run/netns; keep them short and shell-safe.
PREFIX_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
MAX_NODES = 16
# corosync and its tools live in /usr/sbin, which is not on every user's PATH.
_TOOL_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"]
)
_NODE_IFACE = "veth0"
_BRIDGE = "br0"
_SHM = Path("/dev/shm")


class DevClusterError(CpgBrokerError):
    """The development cluster could not be created, queried or changed; the text says why."""


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


def find_tool(name: str) -> str | None:
    """Absolute path of a system tool, also looking in the sbin directories."""
    return shutil.which(name, path=_TOOL_PATH)


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


def default_template() -> Path:
    """The corosync.conf template shipped in the source tree's ``configs/``."""
    env = os.environ.get("CPGBROKER_COROSYNC_TEMPLATE")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for base in (here.parents[3], Path.cwd()):
        candidate = base / "configs" / "corosync.conf.in"
        if candidate.is_file():
            return candidate
    raise DevClusterError(
        "configs/corosync.conf.in not found next to the source tree; pass --template or set "
        "CPGBROKER_COROSYNC_TEMPLATE"
    )


def render_config(
    template: str,
    *,
    cluster_name: str,
    token_ms: int,
    addresses: Sequence[str],
    logfile: str,
    state_dir: str,
    realtime: bool = False,
) -> str:
    """Fill in the corosync.conf template; every ``@NAME@`` field must be known."""
    nodelist = "\n".join(
        f"    node {{\n        nodeid: {i}\n        name: n{i}\n        ring0_addr: {addr}\n    }}"
        for i, addr in enumerate(addresses, start=1)
    )
    fields = {
        "CLUSTER_NAME": cluster_name,
        "TOKEN": str(token_ms),
        "NODELIST": nodelist,
        "LOGFILE": logfile,
        "STATE_DIR": state_dir,
        "SCHED_RR": "yes" if realtime else "no",
    }

    def substitute(m: re.Match[str]) -> str:
        try:
            return fields[m.group(1)]
        except KeyError:
            raise DevClusterError(f"unknown field @{m.group(1)}@ in the template") from None

    return re.sub(r"@([A-Z_]+)@", substitute, template)


def _proc_state(pid: int) -> str | None:
    """Kernel state letter of a corosync process (R, S, T, Z, ...), or None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    state = stat[stat.rindex(")") + 2 :].split(" ", 1)[0]
    return state if comm else None


def _pid_alive(pid: int) -> bool:
    state = _proc_state(pid)
    return state is not None and state not in ("Z", "X")


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    try:
        res = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as e:
        raise DevClusterError(f"{argv[0]} is not installed") from e
    except subprocess.TimeoutExpired as e:
        raise DevClusterError(f"{' '.join(argv)} did not finish within {timeout} s") from e
    if check and res.returncode != 0:
        raise DevClusterError(
            f"{' '.join(argv)} failed (exit {res.returncode}): {res.stderr.strip()}"
        )
    return res.stdout


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    ip = find_tool("ip")
    if ip is None:
        return []
    out = _run([ip, "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    ip = find_tool("ip")
    if ip is None:
        return []
    out = _run([ip, "netns", "pids", netns], check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def remove_shm_leftovers(pids: Iterable[int]) -> list[str]:
    """Delete libqb's /dev/shm files of dead corosyncs (blackbox and per-client IPC rings)."""
    removed = []
    for pid in pids:
        if _pid_alive(pid):
            continue
        for pattern in (f"qb-corosync-{pid}-*", f"qb-{pid}-*"):
            for path in _SHM.glob(pattern):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed.append(path.name)
    return removed


def parse_quorumtool(text: str) -> dict[str, Any]:
    """The fields we use from ``corosync-quorumtool -s -p`` output."""
    info: dict[str, Any] = {"members": []}
    in_members = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        key, sep, value = line.partition(":")
        if sep and not in_members:
            key = key.strip()
            value = value.strip()
            if key == "Quorate":
                info["quorate"] = value.lower().startswith("yes")
            elif key == "Total votes":
                info["total_votes"] = int(value.split()[0])
            elif key == "Expected votes":
                info["expected_votes"] = int(value.split()[0])
            elif key == "Ring ID":
                info["ring_id"] = value
        if line.startswith("Nodeid") and "Votes" in line:
            in_members = True
            continue
        if in_members:
            first = line.split()[0]
            if first.isdigit():
                info["members"].append(int(first))
    return info


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
            for pid in netns_pids(ns):
                if pid in (os.getpid(), os.getppid()):
                    continue
                victims.append(pid)
                if _proc_comm(pid) == "corosync":
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
        ip = find_tool("ip") or "ip"
        for ns in namespaces:
            _run([ip, "netns", "del", ns], check=False)
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

    def _create_network(self) -> None:
        ip = find_tool("ip") or "ip"
        try:
            _run([ip, "netns", "add", self.hub_netns])
        except DevClusterError as e:
            raise DevClusterError(
                f"cannot create network namespace {self.hub_netns} (needs root with "
                f"CAP_SYS_ADMIN): {e}"
            ) from e
        _run([ip, "-n", self.hub_netns, "link", "set", "lo", "up"])
        _run([ip, "-n", self.hub_netns, "link", "add", _BRIDGE, "type", "bridge"])
        _run([ip, "-n", self.hub_netns, "link", "set", _BRIDGE, "up"])
        for node in self.nodes:
            port = f"p{node.nodeid}"
            _run([ip, "netns", "add", node.netns])
            _run([ip, "-n", node.netns, "link", "set", "lo", "up"])
            # Both ends are created directly inside their namespaces: no interface ever exists,
            # even briefly, in the namespace this tool runs in.
            _run(
                [ip, "-n", node.netns, "link", "add", _NODE_IFACE, "type", "veth", "peer",
                 "name", port, "netns", self.hub_netns]
            )  # fmt: skip
            _run([ip, "-n", self.hub_netns, "link", "set", port, "master", _BRIDGE, "up"])
            _run([ip, "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", _NODE_IFACE])
            _run([ip, "-n", node.netns, "link", "set", _NODE_IFACE, "up"])

    def _write_config(self, node: Node, template: str) -> None:
        d = Path(node.dir)
        for sub in ("run", "state"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        text = render_config(
            template,
            cluster_name=self.prefix,
            token_ms=self.token_ms,
            addresses=[n.address for n in self.nodes],
            logfile=str(d / "corosync.log"),
            state_dir=str(d / "state"),
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
        return _pid_alive(pid)

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
        ip = find_tool("ip") or "ip"
        self.record_fault("partition", nodeid)
        _run([ip, "-n", self.hub_netns, "link", "set", f"p{nodeid}", "nomaster"])
        self.node(nodeid).partitioned = True
        self._save()

    def heal(self, nodeid: int) -> None:
        """Reconnect a partitioned node's link."""
        ip = find_tool("ip") or "ip"
        self.record_fault("heal", nodeid)
        _run([ip, "-n", self.hub_netns, "link", "set", f"p{nodeid}", "master", _BRIDGE])
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
                if node.stopped or _proc_state(node.pid) == "T":
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
        return [find_tool("ip") or "ip", "netns", "exec", self.netns(nodeid), *argv]

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
            process = "stopped" if _proc_state(node.pid) == "T" else "running"
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


def _proc_comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


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
        if m is None or _pid_alive(int(m.group(1))):
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


# ---------------------------------------------------------------------- command line


def _print_status(cluster: DevCluster, statuses: list[NodeStatus]) -> None:
    print(
        f"cluster {cluster.prefix}: {cluster.size} nodes, 10.213.{cluster.subnet}.0/24, "
        f"token {cluster.token_ms} ms, state {cluster.base}"
    )
    print(f"{'node':<5} {'netns':<20} {'address':<15} {'corosync':<16} {'quorate':<8} votes")
    for s in statuses:
        proc = f"{s.process} {s.pid}" if s.pid else s.process
        if s.partitioned:
            proc += " (cut)"
        votes = f"{s.total_votes}/{s.expected_votes}" if s.total_votes is not None else "-"
        quorate = "yes" if s.quorate else "no"
        print(f"n{s.nodeid:<4} {s.netns:<20} {s.address:<15} {proc:<16} {quorate:<8} {votes}")


def _check_ports(base: int, nodes: int, wait: float = 10.0) -> None:
    """Fail early, and clearly, if a broker port is taken (waiting a little: the brokers of a
    cluster that was just taken down may still be closing their listeners)."""
    import socket

    deadline = time.monotonic() + wait
    for port in [base + i for i in range(nodes)] + [base + 10000 + i for i in range(nodes)]:
        while True:
            with socket.socket() as s:
                # As the broker's listeners do: TIME_WAIT leftovers must not count as in use.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise DevClusterError(
                            f"port {port} on 127.0.0.1 is in use; choose other ports with "
                            "--base-port"
                        ) from None
            time.sleep(0.2)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--prefix",
        default=DEFAULT_PREFIX,
        help=f"name prefix of the cluster's namespaces (default {DEFAULT_PREFIX})",
    )
    common.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"where cluster state, configs and logs live (default {DEFAULT_STATE_DIR})",
    )
    parser = argparse.ArgumentParser(
        prog="cpgbroker devcluster",
        description="A local N-node corosync cluster in network namespaces (needs root).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", parents=[common], help="create and start the cluster")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--token", type=int, default=DEFAULT_TOKEN_MS, help="totem token timeout in ms")
    up.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for quorum")
    up.add_argument(
        "--realtime",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run corosync at its default real-time priority (sched_rr: yes). Off by default: "
        "all nodes share this machine's cores, and real-time corosyncs preempt the brokers "
        "(without it corosync runs at nice -10)",
    )
    up.add_argument("--template", type=Path, help="corosync.conf template")
    up.add_argument(
        "--with-brokers",
        action="store_true",
        help="also start one cpgbroker member per node, reachable on 127.0.0.1",
    )
    up.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="EVENTS",
        help="the brokers' digest checkpoint interval ([cluster] checkpoint_every; default "
        "10000): lower for short runs, so that an audit checks the replicas",
    )
    up.add_argument(
        "--base-port",
        type=int,
        default=5701,
        help="AMQP port of node 1's broker (node N: base+N-1; status endpoints base+10000+N-1)",
    )
    status = sub.add_parser("status", parents=[common], help="show each node and its quorum")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("down", parents=[common], help="stop and remove everything")
    for name, text in (
        ("kill", "SIGKILL a node's corosync (its broker, if any, then stops by itself)"),
        ("kill-broker", "SIGKILL only the broker process on a node"),
        (
            "start-broker",
            "start a node's broker again: it joins the serving cluster through a state update",
        ),
        ("stop-broker", "stop a node's broker gracefully (its clients get 320)"),
        ("stop", "SIGSTOP a node's corosync"),
        ("resume", "SIGCONT a node's corosync"),
        ("restart", "restart a node's corosync and wait until it rejoined"),
        ("partition", "cut a node's network link"),
        ("heal", "reconnect a node's network link"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("node", type=int)
    ex = sub.add_parser("exec", parents=[common], help="run a command inside a node's namespace")
    ex.add_argument("node", type=int)
    ex.add_argument("argv", nargs="*", help="the command; put it after -- if it has options")
    return parser


def main(argv: list[str]) -> int:
    """``cpgbroker devcluster ...``; errors are printed as one line, never as a traceback."""
    command: list[str] = []
    if argv and argv[0] == "exec" and "--" in argv:
        # Everything after -- is the command, whatever options it has.
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    if args.command == "exec":
        args.argv = list(args.argv) + command
    try:
        return _main(args)
    except DevClusterError as e:
        print(f"cpgbroker devcluster: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cpgbroker devcluster: interrupted", file=sys.stderr)
        return 130


def _main(args: argparse.Namespace) -> int:
    if args.command == "up":
        cluster = DevCluster(
            args.nodes,
            prefix=args.prefix,
            token_ms=args.token,
            state_dir=args.state_dir,
            template=args.template,
            realtime=args.realtime,
        )
        t0 = time.monotonic()
        if args.with_brokers:
            _check_ports(args.base_port, args.nodes)
        cluster.up(timeout=args.timeout)
        print(
            f"dev cluster {cluster.prefix} up: {cluster.size} nodes quorate after "
            f"{time.monotonic() - t0:.1f} s"
        )
        _print_status(cluster, cluster.status())
        if args.with_brokers:
            from cpgbroker.dev.brokers import BrokerSet

            ports = {
                n.nodeid: (args.base_port + n.nodeid - 1, args.base_port + 10000 + n.nodeid - 1)
                for n in cluster.nodes
            }
            brokers = BrokerSet(cluster, ports=ports, checkpoint_every=args.checkpoint_every)
            try:
                brokers.start_all(timeout=60)
            except BaseException:
                cluster.down()
                raise
            brokers.save()
            print(f"brokers ready after {time.monotonic() - t0:.1f} s; AMQP URLs:")
            for n in cluster.nodes:
                print(f"  {brokers.url(n.nodeid)}    status: {brokers.admin(n.nodeid)}")
        return 0
    if args.command == "down":
        try:
            cluster = DevCluster.load(args.prefix, args.state_dir)
        except DevClusterError:
            # No state file (e.g. a crashed `up`): still sweep namespaces with this prefix.
            cluster = DevCluster(1, prefix=args.prefix, state_dir=args.state_dir)
        problem = check_environment()
        if problem:
            raise DevClusterError(problem)
        cluster.down()
        print(f"dev cluster {args.prefix} removed")
        return 0
    cluster = DevCluster.load(args.prefix, args.state_dir)
    from cpgbroker.dev.brokers import BrokerSet

    dev_brokers = BrokerSet.load(cluster)
    if args.command == "status":
        statuses = cluster.status()
        broker_status = (
            {n.nodeid: dev_brokers.status(n.nodeid) for n in cluster.nodes} if dev_brokers else {}
        )
        if args.json:
            nodes = [s.to_json() for s in statuses]
            if dev_brokers is not None:
                for entry in nodes:
                    nid = int(entry["node"])
                    entry["broker"] = {
                        "url": dev_brokers.url(nid),
                        "status_url": dev_brokers.admin(nid),
                        "status": broker_status.get(nid),
                    }
            print(
                json.dumps(
                    {
                        "prefix": cluster.prefix,
                        "subnet": f"10.213.{cluster.subnet}.0/24",
                        "token_ms": cluster.token_ms,
                        "state_dir": str(cluster.base),
                        "nodes": nodes,
                    },
                    indent=2,
                )
            )
        else:
            _print_status(cluster, statuses)
            if dev_brokers is not None:
                print(f"{'node':<5} {'broker':<36} {'state':<10} {'events':>8}  connections")
                for n in cluster.nodes:
                    st = broker_status.get(n.nodeid)
                    url = dev_brokers.url(n.nodeid)
                    if st is None:
                        print(f"n{n.nodeid:<4} {url:<36} {'down':<10}")
                        continue
                    conns = st.get("connections", {})
                    print(
                        f"n{n.nodeid:<4} {url:<36} {st.get('state', '?'):<10} "
                        f"{st.get('event_seq', 0):>8}  {conns.get('local', 0)} local, "
                        f"{conns.get('shadow', 0)} shadow"
                    )
        return 0
    if args.command == "kill-broker":
        if dev_brokers is None:
            raise DevClusterError("this dev cluster runs no brokers (up --with-brokers)")
        cluster.record_fault("kill-broker", args.node, url=dev_brokers.url(args.node))
        dev_brokers.kill(args.node)
        return 0
    if args.command == "stop-broker":
        if dev_brokers is None:
            raise DevClusterError("this dev cluster runs no brokers (up --with-brokers)")
        # An orderly shutdown, not a fault: nothing goes to the fault log.
        dev_brokers.stop(args.node)
        return 0
    if args.command == "start-broker":
        if dev_brokers is None:
            raise DevClusterError("this dev cluster runs no brokers (up --with-brokers)")
        if dev_brokers.status(args.node) is not None:
            raise DevClusterError(f"the broker on node {args.node} is already running")
        cluster.record_fault("start-broker", args.node, url=dev_brokers.url(args.node))
        dev_brokers.start(args.node)
        dev_brokers.save()
        dev_brokers.wait_ready([args.node], timeout=600)
        print(f"broker on node {args.node} joined: {dev_brokers.url(args.node)}")
        return 0
    if args.command == "exec":
        cmd = list(args.argv)
        if not cmd:
            raise DevClusterError("exec needs a command, e.g. exec 1 -- corosync-cpgtool")
        return cluster.run_in(args.node, cmd).returncode
    action = {
        "kill": cluster.kill,
        "stop": cluster.stop,
        "resume": cluster.resume,
        "restart": cluster.restart,
        "partition": cluster.partition,
        "heal": cluster.heal,
    }[args.command]
    action(args.node)
    return 0

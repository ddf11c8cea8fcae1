"""Linux network namespaces for a dev cluster: the star network, its links and its processes.

A dev cluster's network is a star: a hub namespace holds a bridge, and every member namespace
holds one veth interface whose peer is a port of that bridge. This module owns the ``ip``
commands that build it (:func:`add_hub`, :func:`add_member`), cut and reconnect a member's link
(:func:`cut_link`, :func:`join_link`: the partition and heal primitives), list and delete
namespaces, and run commands inside one (:func:`exec_argv`). It also reads ``/proc`` for the
state of processes, which is how every dev tool tells a live process from a dead one.

It knows nothing of corosync or brokers (:mod:`cpgbroker.dev.cluster` and
:mod:`cpgbroker.dev.brokers` use it) and never touches the host's own interfaces or routes:
both ends of every veth are created directly inside their namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from cpgbroker.errors import CpgBrokerError

# corosync and its tools live in /usr/sbin, which is not on every user's PATH.
_TOOL_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"]
)
MEMBER_IFACE = "veth0"
BRIDGE = "br0"


class DevClusterError(CpgBrokerError):
    """The development cluster could not be created, queried or changed; the text says why."""


def find_tool(name: str) -> str | None:
    """Absolute path of a system tool, also looking in the sbin directories."""
    return shutil.which(name, path=_TOOL_PATH)


def _ip() -> str:
    return find_tool("ip") or "ip"


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    """Run a tool to completion and return its output; a failure is a :class:`DevClusterError`
    carrying the tool's stderr (``check=False``: the output whatever the exit status)."""
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


# ---------------------------------------------------------------------- namespaces


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    ip = find_tool("ip")
    if ip is None:
        return []
    out = run([ip, "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    """Processes running inside a namespace (``ip netns pids``)."""
    ip = find_tool("ip")
    if ip is None:
        return []
    out = run([ip, "netns", "pids", netns], check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def delete_netns(netns: str) -> None:
    """Remove a namespace (and with it its interfaces); no error if it is already gone."""
    run([_ip(), "netns", "del", netns], check=False)


def add_hub(hub: str) -> None:
    """Create the hub namespace with its bridge; the first namespace a cluster makes."""
    ip = _ip()
    try:
        run([ip, "netns", "add", hub])
    except DevClusterError as e:
        raise DevClusterError(
            f"cannot create network namespace {hub} (needs root with CAP_SYS_ADMIN): {e}"
        ) from e
    run([ip, "-n", hub, "link", "set", "lo", "up"])
    run([ip, "-n", hub, "link", "add", BRIDGE, "type", "bridge"])
    run([ip, "-n", hub, "link", "set", BRIDGE, "up"])


def add_member(hub: str, netns: str, address: str, port: str) -> None:
    """Create a member namespace with the interface ``veth0`` at ``address``/24, whose peer is
    the bridge port ``port`` in ``hub``."""
    ip = _ip()
    run([ip, "netns", "add", netns])
    run([ip, "-n", netns, "link", "set", "lo", "up"])
    # Both ends are created directly inside their namespaces: no interface ever exists, even
    # briefly, in the namespace this tool runs in.
    run(
        [ip, "-n", netns, "link", "add", MEMBER_IFACE, "type", "veth", "peer",
         "name", port, "netns", hub]
    )  # fmt: skip
    run([ip, "-n", hub, "link", "set", port, "master", BRIDGE, "up"])
    run([ip, "-n", netns, "addr", "add", f"{address}/24", "dev", MEMBER_IFACE])
    run([ip, "-n", netns, "link", "set", MEMBER_IFACE, "up"])


def cut_link(hub: str, port: str) -> None:
    """Take a member's port off the bridge: a partition (the member's side stays up)."""
    run([_ip(), "-n", hub, "link", "set", port, "nomaster"])


def join_link(hub: str, port: str) -> None:
    """Put a member's port back on the bridge: the partition heals."""
    run([_ip(), "-n", hub, "link", "set", port, "master", BRIDGE])


def exec_argv(netns: str, argv: Sequence[str]) -> list[str]:
    """The argv that runs ``argv`` inside a network namespace (``ip netns exec``)."""
    return [_ip(), "netns", "exec", netns, *argv]


# ---------------------------------------------------------------------- processes


def proc_state(pid: int) -> str | None:
    """Kernel state letter of a process (R, S, T, Z, ...), or None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    state = stat[stat.rindex(")") + 2 :].split(" ", 1)[0]
    return state if comm else None


def pid_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    state = proc_state(pid)
    return state is not None and state not in ("Z", "X")


def proc_comm(pid: int) -> str | None:
    """A process's command name, or None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None

"""corosync's side of a dev cluster node: its configuration, its quorum tool's output and the
files it leaves behind.

Pure text in and out except :func:`default_template` (finds the shipped template) and
:func:`remove_shm_leftovers` (deletes libqb's ``/dev/shm`` files of dead corosyncs); the
processes themselves are :class:`cpgbroker.dev.cluster.DevCluster`'s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from cpgbroker.dev.netns import DevClusterError, pid_alive

_SHM = Path("/dev/shm")


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
    keyfile: str = "",
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
        "KEYFILE": keyfile,
        "SCHED_RR": "yes" if realtime else "no",
    }

    def substitute(m: re.Match[str]) -> str:
        try:
            return fields[m.group(1)]
        except KeyError:
            raise DevClusterError(f"unknown field @{m.group(1)}@ in the template") from None

    return re.sub(r"@([A-Z_]+)@", substitute, template)


def write_authkey(path: Path) -> None:
    """A random corosync authkey (what ``corosync-keygen`` writes: 256 bytes), readable by its
    owner only, as corosync wants."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(256))


def remove_shm_leftovers(pids: Iterable[int]) -> list[str]:
    """Delete libqb's /dev/shm files of dead corosyncs (blackbox and per-client IPC rings)."""
    removed = []
    for pid in pids:
        if pid_alive(pid):
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

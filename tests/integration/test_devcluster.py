"""The dev cluster tool: CLI round trip, two clusters side by side, partitions, crash cleanup."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cpgbroker.dev.cluster import DevCluster, cleanup_stale_test_clusters, new_test_prefix
from cpgbroker.dev.netns import list_netns

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cpgbroker.cli", "devcluster", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def assert_gone(prefix: str, pids: list[int], state: Path) -> None:
    assert [ns for ns in list_netns() if ns.startswith(prefix + "-")] == []
    assert wait_dead(pids) == []
    for pid in pids:
        assert glob.glob(f"/dev/shm/qb-*{pid}-*") == []
    assert not state.exists()


def test_cli_cluster_runs_beside_another_and_goes_away(cluster: DevCluster, tmp_path: Path) -> None:
    prefix = new_test_prefix()
    state_dir = tmp_path / "state"
    common = ["--prefix", prefix, "--state-dir", str(state_dir)]
    try:
        up = cli("up", "--nodes", "2", "--token", "1000", *common)
        assert up.returncode == 0, up.stderr
        assert "quorate" in up.stdout

        status = cli("status", "--json", *common)
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        nodes = info["nodes"]
        assert [n["node"] for n in nodes] == [1, 2]
        assert all(n["quorate"] and n["total_votes"] == 2 for n in nodes)
        assert info["subnet"] != f"10.213.{cluster.subnet}.0/24"
        # The nodes share this machine's cores with their brokers: corosync is not real-time
        # but ten nice levels above them.
        for n in nodes:
            assert os.sched_getscheduler(n["pid"]) == os.SCHED_OTHER
            assert os.getpriority(os.PRIO_PROCESS, n["pid"]) == -10
        text = cli("status", *common)
        assert text.returncode == 0 and f"{prefix}-n2" in text.stdout

        # The session's cluster is untouched by the second one.
        assert all(s.quorate and s.total_votes == 3 for s in cluster.status())

        ran = cli("exec", "1", *common, "--", "corosync-cpgtool")
        assert ran.returncode == 0, ran.stderr

        # Another process attaches through the state file and adds a managed process.
        attached = DevCluster.load(prefix, state_dir)
        sleeper = attached.spawn(2, "sleeper", ["sleep", "600"])
        pids = [n["pid"] for n in nodes] + [sleeper.pid]
    finally:
        down = cli("down", *common)
    assert down.returncode == 0, down.stderr
    sleeper.wait(timeout=10)
    assert_gone(prefix, pids, state_dir / prefix)

    missing = cli("status", *common)
    assert missing.returncode == 1
    assert "no dev cluster" in missing.stderr and "Traceback" not in missing.stderr


def test_realtime_corosync_on_request(cluster_support: None, tmp_path: Path) -> None:
    prefix = new_test_prefix()
    common = ["--prefix", prefix, "--state-dir", str(tmp_path / "state")]
    try:
        up = cli("up", "--nodes", "1", "--realtime", *common)
        assert up.returncode == 0, up.stderr
        status = cli("status", "--json", *common)
        assert status.returncode == 0, status.stderr
        (node,) = json.loads(status.stdout)["nodes"]
        # corosync's own default (sched_rr: yes): round-robin real-time scheduling.
        assert os.sched_getscheduler(node["pid"]) == os.SCHED_RR
    finally:
        down = cli("down", *common)
    assert down.returncode == 0, down.stderr


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    bad = cli("up", "--nodes", "2", "--prefix", "Bad_Prefix", "--state-dir", str(tmp_path))
    assert bad.returncode == 1
    assert bad.stderr.startswith("cpgbroker devcluster: error: bad prefix")
    assert "Traceback" not in bad.stderr


def test_partition_and_heal(cluster: DevCluster) -> None:
    cluster.partition(3)
    # The majority stays quorate; the cut node is alone and loses quorum.
    cluster.wait_quorate(nodes=[1, 2], votes=2, timeout=30)
    # Node 3 forms its one-node ring on its own timers, not when the others do.
    deadline = time.monotonic() + 15
    isolated = cluster.node_status(3)
    while isolated.total_votes != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        isolated = cluster.node_status(3)
    assert isolated.process == "running" and isolated.partitioned
    assert not isolated.quorate and isolated.total_votes == 1
    cluster.heal(3)
    cluster.wait_quorate(timeout=30)
    assert all(s.total_votes == 3 for s in cluster.status())


def test_leftovers_of_a_crashed_run_are_removed(cluster_support: None, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, sys, time
            from cpgbroker.dev.cluster import DevCluster, new_test_prefix
            c = DevCluster(1, prefix=new_test_prefix(), state_dir={str(state_dir)!r},
                           owner_pid=os.getpid())
            c.up()
            print(c.prefix, c.nodes[0].pid, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        prefix, pid = child.stdout.readline().split()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert any(ns.startswith(prefix + "-") for ns in list_netns())
    assert alive(int(pid))

    removed = cleanup_stale_test_clusters(state_dir)
    assert removed == [prefix]
    assert_gone(prefix, [int(pid)], state_dir / prefix)


def test_clusters_of_live_owners_are_left_alone(cluster: DevCluster) -> None:
    # Our own session cluster belongs to a live process (this one): never swept.
    assert cluster.prefix not in cleanup_stale_test_clusters()
    assert os.path.exists(f"/run/netns/{cluster.netns(1)}")

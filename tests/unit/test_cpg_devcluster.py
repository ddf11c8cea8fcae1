"""Pure parts of the dev cluster tools: config rendering, parsing, checks, CLI error handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpgbroker.dev import cli as devcli
from cpgbroker.dev import cluster as devcluster
from cpgbroker.dev.cluster import DevCluster, DevClusterError
from cpgbroker.dev.corosynctools import default_template, parse_quorumtool, render_config

QUORUMTOOL_OUTPUT = """\
Quorum information
------------------
Date:             Sun Nov 22 09:03:42 2026
Quorum provider:  corosync_votequorum
Nodes:            3
Node ID:          1
Ring ID:          1.d
Quorate:          Yes

Votequorum information
----------------------
Expected votes:   3
Highest expected: 3
Total votes:      3
Quorum:           2
Flags:            Quorate

Membership information
----------------------
    Nodeid      Votes    Qdevice Name
         1          1         NR n1 (local)
         2          1         NR n2
         3          1         NR n3
"""


def test_config_from_the_shipped_template() -> None:
    text = render_config(
        default_template().read_text(),
        cluster_name="t1",
        token_ms=1000,
        addresses=["10.213.9.1", "10.213.9.2"],
        logfile="/x/n1/corosync.log",
        state_dir="/x/n1/state",
        keyfile="/x/authkey",
    )
    assert "@" not in text
    for needle in (
        "cluster_name: t1",
        "token: 1000",
        "token_coefficient: 0",
        "blackbox: off",
        "ring0_addr: 10.213.9.2",
        "nodeid: 2",
        "logfile: /x/n1/corosync.log",
        "state_dir: /x/n1/state",
        # All nodes share this machine's cores: corosync at nice -10, not real-time.
        "\n    sched_rr: no\n",
        "priority: -10",
        # Encrypted as in production: members refuse a plaintext ring that is not loopback.
        "crypto_cipher: aes256",
        "crypto_hash: sha256",
        "keyfile: /x/authkey",
    ):
        assert needle in text
    assert "\n    sched_rr: yes\n" not in text
    assert text.count("node {") == 2
    # devcluster up --realtime: corosync's own default.
    rt = render_config(
        default_template().read_text(),
        cluster_name="t1",
        token_ms=1000,
        addresses=["10.213.9.1"],
        logfile="/x",
        state_dir="/y",
        realtime=True,
    )
    assert "\n    sched_rr: yes\n" in rt and "\n    sched_rr: no\n" not in rt


def test_unknown_template_field_is_an_error() -> None:
    with pytest.raises(DevClusterError, match="@SURPRISE@"):
        render_config(
            "x @SURPRISE@", cluster_name="c", token_ms=1, addresses=[], logfile="", state_dir=""
        )


def test_quorumtool_output_is_parsed() -> None:
    info = parse_quorumtool(QUORUMTOOL_OUTPUT)
    assert info == {
        "quorate": True,
        "total_votes": 3,
        "expected_votes": 3,
        "ring_id": "1.d",
        "members": [1, 2, 3],
    }
    lost_text = QUORUMTOOL_OUTPUT.replace("Yes", "No").replace("votes:      3", "votes:      1")
    lost = parse_quorumtool(lost_text)
    assert lost["quorate"] is False and lost["total_votes"] == 1


def test_environment_problems_are_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devcluster.os, "geteuid", lambda: 1000)
    assert "needs root" in (devcluster.check_environment() or "")
    monkeypatch.setattr(devcluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        devcluster, "find_tool", lambda name: None if name == "corosync" else f"/usr/bin/{name}"
    )
    problem = devcluster.check_environment() or ""
    assert "corosync is not installed" in problem and "apt-get install" in problem


def test_cli_reports_missing_root_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(devcluster.os, "geteuid", lambda: 1000)
    rc = devcli.main(["up", "--nodes", "2", "--prefix", "unit", "--state-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("cpgbroker devcluster: error: devcluster needs root")
    assert err.count("\n") == 1
    assert not (tmp_path / "unit").exists()


def test_cli_status_of_unknown_cluster(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert devcli.main(["status", "--prefix", "nope", "--state-dir", str(tmp_path)]) == 1
    assert "no dev cluster 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefix": "Has_Upper"}, "bad prefix"),
        ({"prefix": "x" * 25}, "bad prefix"),
        ({"nodes": 0}, "--nodes"),
        ({"nodes": 17}, "--nodes"),
        ({"token_ms": 50}, "--token"),
    ],
)
def test_bad_parameters(kwargs: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(DevClusterError, match=message):
        DevCluster(state_dir=tmp_path, **kwargs)  # type: ignore[arg-type]


def test_layout_and_state_round_trip(tmp_path: Path) -> None:
    c = DevCluster(3, prefix="lay", state_dir=tmp_path)
    assert [n.netns for n in c.nodes] == ["lay-n1", "lay-n2", "lay-n3"]
    assert c.hub_netns == "lay-hub"
    assert c.address(2) == f"10.213.{c.subnet}.2" and 1 <= c.subnet <= 250
    c.nodes[1].processes["broker"] = 4242
    c._save()
    again = DevCluster.load("lay", tmp_path)
    assert again.nodes == c.nodes and again.subnet == c.subnet
    assert json.loads((tmp_path / "lay" / "state.json").read_text())["prefix"] == "lay"
    # A second cluster next to it gets another subnet.
    other = DevCluster(3, prefix="lay2", state_dir=tmp_path)
    assert other.subnet != c.subnet
    with pytest.raises(DevClusterError, match="no node 4"):
        c.node(4)


def test_cpgbroker_cli_dispatches_devcluster(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from cpgbroker.cli import main

    assert main(["devcluster", "status", "--prefix", "nope", "--state-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("cpgbroker devcluster: error: no dev cluster 'nope'")

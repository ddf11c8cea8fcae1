"""The Vagrant 3-node cluster's files: ``vagrant validate`` accepts the Vagrantfile (no
hypervisor needed), and the provisioning script is sound shell. The script itself is run for
real by tests/integration/test_deploy_machines.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from prereq import unavailable

REPO = Path(__file__).resolve().parents[2]


def vagrant() -> str:
    found = shutil.which("vagrant")
    if found is None:
        unavailable("vagrant is not installed (scripts/setup.sh installs Debian's package)")
    assert found is not None
    return found


def validate(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [vagrant(), "validate", "--ignore-provider"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(directory), "VAGRANT_CHECKPOINT_DISABLE": "1"},
    )


def copy_of_vagrant_dir(tmp_path: Path) -> Path:
    # A copy: validating writes .vagrant/ (and the cluster's seed) next to the Vagrantfile.
    d = tmp_path / "project" / "vagrant"
    shutil.copytree(REPO / "vagrant", d, ignore=shutil.ignore_patterns(".vagrant"))
    return d


def test_the_vagrantfile_validates_for_three_nodes(tmp_path: Path) -> None:
    d = copy_of_vagrant_dir(tmp_path)
    out = validate(d)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "validated successfully" in out.stdout
    for node in ("n1", "n2", "n3"):
        assert f"==> {node}:" in out.stdout
    seed = d / ".vagrant" / "cpgbroker-seed"
    assert len(seed.read_bytes()) == 64 and seed.stat().st_mode & 0o777 == 0o600


def test_a_broken_vagrantfile_is_caught(tmp_path: Path) -> None:
    d = copy_of_vagrant_dir(tmp_path)
    text = (d / "Vagrantfile").read_text()
    (d / "Vagrantfile").write_text(
        text.replace("node.vm.hostname = name", "node.vm.hostnam = name")
    )
    out = validate(d)
    assert out.returncode != 0 and "hostnam" in out.stdout + out.stderr


def test_the_provisioning_script_parses_and_needs_its_arguments() -> None:
    script = REPO / "vagrant" / "provision.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "usage: provision.sh NODE NODES SEED_FILE" in out.stderr

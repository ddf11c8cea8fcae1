"""``cpgbroker cluster init``: the files a real deployment runs from."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cpgbroker.errors import ConfigError
from cpgbroker.model import auth
from cpgbroker.model.config import User
from cpgbroker.runtime import settings
from prereq import unavailable

NODES = ["--node", "n1=10.0.0.11", "--node", "n2=10.0.0.12", "--node", "n3=10.0.0.13"]


def init(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cpgbroker", "cluster", "init", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_three_nodes_get_an_encrypted_ring_a_shared_key_and_their_own_member_config(
    tmp_path: Path,
) -> None:
    out = init(*NODES, "--out", str(tmp_path / "c"))
    assert out.returncode == 0, out.stderr
    c = tmp_path / "c"
    conf = (c / "corosync.conf").read_text()
    for needle in (
        "transport: knet",
        "crypto_cipher: aes256",
        "crypto_hash: sha256",
        "keyfile: /etc/corosync/authkey",
        "provider: corosync_votequorum",
        "ring0_addr: 10.0.0.13",
        "uid: cpgbroker",
    ):
        assert needle in conf
    assert conf.count("nodeid:") == 3
    assert stat.S_IMODE((c / "authkey").stat().st_mode) == 0o400
    assert len((c / "authkey").read_bytes()) == 256
    password = (c / "admin.password").read_text().strip()
    assert stat.S_IMODE((c / "admin.password").stat().st_mode) == 0o600
    configs = {n: settings.load(str(c / n / "cpgbroker.toml")) for n in ("n1", "n2", "n3")}
    for name, cfg in configs.items():
        assert cfg.cluster is not None and cfg.cluster.size == 3
        assert cfg.cluster.url == f"amqp://10.0.0.1{name[1]}:5672/"
        assert cfg.listen == (f"10.0.0.1{name[1]}:5672",)
        assert cfg.admin_listen == "127.0.0.1:15672"
        assert cfg.admin_secret_file == "/var/lib/cpgbroker/admin.secret"
        assert cfg.store is not None
        assert not cfg.cluster.allow_plaintext_ring
        (user,) = cfg.broker.users
        assert user.name == "admin" and not user.password and user.password_hash
        assert auth.password_ok(user, password)
        assert not auth.password_ok(user, password + "x")
        assert password not in (c / name / "cpgbroker.toml").read_text()
    # Members compare configurations when they join: everything shared must be equal.
    assert len({cfg.broker for cfg in configs.values()}) == 1


def test_a_second_run_never_replaces_a_clusters_key(tmp_path: Path) -> None:
    assert init(*NODES, "--out", str(tmp_path)).returncode == 0
    key = (tmp_path / "authkey").read_bytes()
    again = init(*NODES, "--out", str(tmp_path))
    assert again.returncode == 1 and "would replace" in again.stderr
    assert (tmp_path / "authkey").read_bytes() == key


def test_one_seed_gives_identical_shared_files_on_separately_provisioned_machines(
    tmp_path: Path,
) -> None:
    seed = tmp_path / "seed"
    seed.write_bytes(b"s" * 64)
    for d in ("a", "b"):
        assert init(*NODES, "--out", str(tmp_path / d), "--seed-file", str(seed)).returncode == 0
    for f in ("corosync.conf", "authkey", "admin.password", "n2/cpgbroker.toml"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert init(*NODES, "--out", str(tmp_path / "r")).returncode == 0
    assert (tmp_path / "r" / "authkey").read_bytes() != (tmp_path / "a" / "authkey").read_bytes()
    seed.write_bytes(b"short")
    short = init(*NODES, "--out", str(tmp_path / "s"), "--seed-file", str(seed))
    assert short.returncode == 1 and "fewer than 32 bytes" in short.stderr


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--node", "n1=10.0.0.1", "--node", "n2=10.0.0.2"], "two nodes"),
        (["--node", "n1=10.0.0.1", "--node", "n1=10.0.0.2", "--node", "n3=10.0.0.3"], "same name"),
        (["--node", "n1=10.0.0.1", "--node", "n2=10.0.0.1", "--node", "n3=10.0.0.3"], "address"),
        (["--node", "n1:10.0.0.1"], "NAME=ADDRESS"),
        (["--node", "n1=node1.example"], "not an IP address"),
    ],
)
def test_bad_node_lists_are_refused_before_anything_is_written(
    tmp_path: Path, args: list[str], why: str
) -> None:
    out = init(*args, "--out", str(tmp_path / "c"))
    assert out.returncode == 1 and why in out.stderr, out.stderr
    assert not (tmp_path / "c").exists()


def test_the_prefix_moves_every_path_and_corosync_accepts_the_file(tmp_path: Path) -> None:
    from cpgbroker.deploy import init as deploy

    root = tmp_path / "m1"
    opts = deploy.InitOptions(
        nodes=(deploy.NodeSpec("n1", "127.0.0.1"),),  # corosync -t wants a local address
        prefix=str(root),
        service_user="root",
    )
    deploy.write(opts, tmp_path / "out")
    conf = (tmp_path / "out" / "corosync.conf").read_text()
    toml = (tmp_path / "out" / "n1" / "cpgbroker.toml").read_text()
    assert f"keyfile: {root}/etc/corosync/authkey" in conf
    assert f'dir = "{root}/var/lib/cpgbroker/store"' in toml
    assert " /etc/" not in conf and '"/var/' not in toml
    corosync = shutil.which("corosync") or "/usr/sbin/corosync"
    if not Path(corosync).exists():
        unavailable("corosync is not installed (scripts/setup.sh installs it)")
    for d in ("etc/corosync", "var/log/corosync", "var/lib/corosync"):
        (root / d).mkdir(parents=True)
    shutil.copy(tmp_path / "out" / "authkey", root / "etc" / "corosync" / "authkey")
    checked = subprocess.run(
        [corosync, "-t", "-c", str(tmp_path / "out" / "corosync.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_written_user_is_the_model_user_the_broker_checks() -> None:
    from cpgbroker.deploy import init as deploy

    with pytest.raises(ConfigError, match="at least one"):
        deploy.write(deploy.InitOptions(nodes=()), Path("/nonexistent"))
    h = auth.hash_password("pw", b"salt")
    assert auth.password_ok(User("u", "", password_hash=h), "pw")

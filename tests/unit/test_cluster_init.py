"""``cpgbroker cluster init``: the files a real deployment runs from."""

from __future__ import annotations

import shutil
import ssl
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import trustme

from cpgbroker.errors import ConfigError
from cpgbroker.model.access import auth
from cpgbroker.model.config import User
from cpgbroker.runtime.config import settings
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
        assert cfg.broker.cluster_name == "cpgbroker"  # one name, answered by every member
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


def handshake(cert: Path, key: Path, ca: Path, host: str) -> None:
    """A TLS handshake in memory between a server with ``cert``/``key`` and a client that
    trusts ``ca`` and dials ``host`` (name or IP checked as clients check it); raises
    ssl.SSLError when the client refuses the server."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(ca))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname=host)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {c: False, s: False}
    for _ in range(10):
        for side in (c, s):
            if not done[side]:
                try:
                    side.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("the handshake did not finish")


def test_tls_gives_each_member_a_certificate_from_a_private_ca_and_amqps_urls(
    tmp_path: Path,
) -> None:
    out = init(*NODES, "--out", str(tmp_path / "c"), "--tls")
    assert out.returncode == 0, out.stderr
    assert "clients verify the members with" in out.stdout and "keep it off" in out.stdout
    c = tmp_path / "c"
    assert stat.S_IMODE((c / "ca.key").stat().st_mode) == 0o600
    for n in ("n1", "n2", "n3"):
        tls = c / n / "tls"
        assert stat.S_IMODE((tls / "key.pem").stat().st_mode) == 0o600
        assert (tls / "ca.pem").read_bytes() == (c / "ca.pem").read_bytes()
        address = f"10.0.0.1{n[1]}"
        # Clients dial the node's address; the CLI reaches the admin endpoint on loopback.
        for host in (address, "127.0.0.1", n):
            handshake(tls / "cert.pem", tls / "key.pem", c / "ca.pem", host)
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(tls / "cert.pem", tls / "key.pem", c / "ca.pem", "10.0.0.99")
        text = (c / n / "cpgbroker.toml").read_text()
        data = tomllib.loads(text)
        assert data["server"]["listen"] == ["127.0.0.1:5672"]
        assert data["server"]["listen_tls"] == [f"{address}:5671"]
        assert data["server"]["admin_tls"] is True
        assert data["cluster"]["url"] == f"amqps://{address}:5671/"
        assert data["tls"] == {
            "certfile": "/etc/cpgbroker/tls/cert.pem",
            "keyfile": "/etc/cpgbroker/tls/key.pem",
            "cacertfile": "/etc/cpgbroker/tls/ca.pem",
        }
        # As installed, the member starts with it: the same checks as `cpgbroker start`.
        for key in data["tls"]:
            data["tls"][key] = str(tls / Path(data["tls"][key]).name)
        cfg = settings.from_dict(data)
        assert cfg.admin_tls and cfg.tls is not None and cfg.listen_tls == (f"{address}:5671",)
    # Another cluster's CA does not vouch for these members.
    assert init(*NODES, "--out", str(tmp_path / "d"), "--tls").returncode == 0
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(c / "n1/tls/cert.pem", c / "n1/tls/key.pem", tmp_path / "d/ca.pem", "10.0.0.11")


def test_the_state_update_port_is_fixed_and_the_event_log_kept_with_the_state(
    tmp_path: Path,
) -> None:
    assert init(*NODES, "--out", str(tmp_path / "c"), "--update-port", "25999").returncode == 0
    cfg = settings.load(str(tmp_path / "c" / "n2" / "cpgbroker.toml"))
    assert cfg.cluster is not None
    assert cfg.cluster.update_listen == "10.0.0.12:25999"
    # The unit's StateDirectory, as docs/operations.md says (not a log that rotation cuts).
    assert cfg.cluster.event_log == "/var/lib/cpgbroker/broker.events.jsonl"
    clash = init(*NODES, "--out", str(tmp_path / "d"), "--update-port", "5672")
    assert clash.returncode == 1 and "share port 5672" in clash.stderr


def test_one_seed_gives_every_machine_the_same_ca_and_member_keys(tmp_path: Path) -> None:
    seed = tmp_path / "seed"
    seed.write_bytes(b"t" * 64)
    for d in ("a", "b"):
        done = init(*NODES, "--out", str(tmp_path / d), "--seed-file", str(seed), "--tls")
        assert done.returncode == 0, done.stderr
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "ca.key").read_bytes() == (b / "ca.key").read_bytes()
    assert (a / "n3/tls/key.pem").read_bytes() == (b / "n3/tls/key.pem").read_bytes()
    # Signed separately, yet either machine's CA certificate verifies the other's members.
    handshake(a / "n3/tls/cert.pem", a / "n3/tls/key.pem", b / "ca.pem", "10.0.0.13")
    handshake(b / "n1/tls/cert.pem", b / "n1/tls/key.pem", a / "ca.pem", "10.0.0.11")


def test_an_operators_ca_signs_the_members_and_renews_them(tmp_path: Path) -> None:
    ca = trustme.CA(organization_name="operator")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.private_key_pem.write_to_path(str(tmp_path / "ca.key"))
    ca_args = ["--ca-cert", str(tmp_path / "ca.pem"), "--ca-key", str(tmp_path / "ca.key")]
    out = init(*NODES, "--out", str(tmp_path / "c"), "--tls", *ca_args)
    assert out.returncode == 0, out.stderr
    c = tmp_path / "c"
    assert not (c / "ca.key").exists()  # the operator's key stays where it was
    assert (c / "ca.pem").read_bytes() == (tmp_path / "ca.pem").read_bytes()
    handshake(c / "n2/tls/cert.pem", c / "n2/tls/key.pem", tmp_path / "ca.pem", "10.0.0.12")
    # A rolling change of certificates: new ones for a node, from the same CA.
    certs = [sys.executable, "-m", "cpgbroker", "cluster", "certs", "--node", "n2=10.0.0.12"]
    renew = subprocess.run(
        [*certs, "--out", str(tmp_path / "r"), *ca_args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert renew.returncode == 0, renew.stderr
    r = tmp_path / "r"
    assert sorted(p.name for p in (r / "n2" / "tls").iterdir()) == ["ca.pem", "cert.pem", "key.pem"]
    assert not (r / "authkey").exists() and not (r / "n2" / "cpgbroker.toml").exists()
    assert (r / "n2/tls/cert.pem").read_bytes() != (c / "n2/tls/cert.pem").read_bytes()
    handshake(r / "n2/tls/cert.pem", r / "n2/tls/key.pem", tmp_path / "ca.pem", "10.0.0.12")
    # A key that is not the CA's is refused before anything is written.
    other = trustme.CA()
    other.private_key_pem.write_to_path(str(tmp_path / "other.key"))
    bad = init(
        *NODES,
        "--out",
        str(tmp_path / "x"),
        "--tls",
        "--ca-cert",
        str(tmp_path / "ca.pem"),
        "--ca-key",
        str(tmp_path / "other.key"),
    )
    assert bad.returncode == 1 and "does not belong" in bad.stderr
    assert not (tmp_path / "x").exists()
    alone = init(*NODES, "--out", str(tmp_path / "y"), *ca_args)
    assert alone.returncode == 1 and "are for --tls" in alone.stderr

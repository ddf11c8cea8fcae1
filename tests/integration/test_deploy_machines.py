"""A real three-machine deployment, with network namespaces standing in for the machines.

Each "machine" is provisioned by ``vagrant/provision.sh`` — the script the Vagrantfile runs on
each VM — minus package installation, into a directory of its own (its ``/``): the files
``cpgbroker cluster init`` writes (encrypted corosync.conf, authkey, the member's toml), the
systemd unit. corosync runs from the installed corosync.conf, and each member is started with
the systemd unit's own ``ExecStart`` line, inside its machine's namespace, as systemd would.
The cluster is deployed with TLS (``cluster init --tls``, a private CA): pika and aio-pika
reach the members over amqps, trusting the generated CA, with the amqps URLs the members hand
out for failover; a client trusting another CA is refused; ``cpgbroker status`` works against
the https admin endpoints with no extra flags; one member's certificate is changed with a
restart while the others serve; and a node with another authkey is kept out.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pika
import pytest
import trustme

from cpgbroker.corosync.cpg import enter_netns
from cpgbroker.dev.cluster import DevCluster, new_test_prefix

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROVISION = REPO / "vagrant" / "provision.sh"
UNIT = REPO / "configs" / "systemd" / "cpgbroker.service"


def exec_start() -> list[str]:
    """The unit's ExecStart command line."""
    for line in UNIT.read_text().splitlines():
        if line.startswith("ExecStart="):
            return shlex.split(line.removeprefix("ExecStart="))
    raise AssertionError(f"{UNIT} has no ExecStart")


class Machines:
    def __init__(self, dc: DevCluster, base: Path) -> None:
        self.dc = dc
        self.base = base
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def root(self, n: int) -> Path:
        return self.base / f"m{n}"

    def under_root(self, n: int, argv: list[str]) -> list[str]:
        # Every absolute path of the machine is under its root directory.
        return [f"{self.root(n)}{a}" if a.startswith("/") else a for a in argv]

    def start(self, n: int) -> None:
        cmd = self.under_root(n, exec_start())
        log = open(self.root(n) / "broker.log", "ab")  # noqa: SIM115 - the process keeps it
        self.procs[n] = subprocess.Popen(
            ["ip", "netns", "exec", self.dc.node(n).netns, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def cli(self, n: int, *args: str) -> subprocess.CompletedProcess[str]:
        """``cpgbroker ARGS --config /etc/cpgbroker/cpgbroker.toml`` on machine ``n``: the CLI
        finds the admin address and secret through the member's configuration."""
        cpgbroker = f"{self.root(n)}/usr/local/bin/cpgbroker"
        config = f"{self.root(n)}/etc/cpgbroker/cpgbroker.toml"
        return subprocess.run(
            ["ip", "netns", "exec", self.dc.node(n).netns, cpgbroker, *args, "--config", config],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def status(self, n: int) -> dict[str, object] | None:
        out = self.cli(n, "status", "--json")
        return json.loads(out.stdout) if out.returncode == 0 else None

    def wait_ready(self, nodes: list[int], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for n in nodes:
            while (s := self.status(n)) is None or s.get("state") != "ready":
                proc = self.procs[n]
                assert proc.poll() is None, self.log(n)
                assert time.monotonic() < deadline, f"machine {n} not ready:\n{self.log(n)}"
                time.sleep(0.3)

    def wait_corosync(self, n: int, timeout: float = 20) -> None:
        """Until machine ``n``'s corosync answers on its IPC."""
        deadline = time.monotonic() + timeout
        ask = ["ip", "netns", "exec", self.dc.node(n).netns, "corosync-cmapctl", "totem.version"]
        while subprocess.run(ask, capture_output=True, timeout=10).returncode != 0:
            assert time.monotonic() < deadline, f"corosync of machine {n} does not answer"
            time.sleep(0.2)

    def log(self, n: int) -> str:
        return (self.root(n) / "broker.log").read_text(errors="replace")[-3000:]

    def password(self) -> str:
        return (self.root(1) / "etc" / "cpgbroker" / "admin.password").read_text().strip()

    def ca(self) -> Path:
        """The cluster's CA certificate as installed on machine 1 (what clients trust)."""
        return self.root(1) / "etc" / "cpgbroker" / "tls" / "ca.pem"

    def context(self, ca: Path | None = None) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(ca or self.ca()))

    def params(
        self, urls: list[str], ctx: ssl.SSLContext | None = None
    ) -> list[pika.ConnectionParameters]:
        """pika's parameters for amqps ``urls`` (host and port from each), in order."""
        ctx = ctx or self.context()
        creds = pika.PlainCredentials("admin", self.password())
        out = []
        for url in urls:
            assert url.startswith("amqps://"), url
            host, port = url.removeprefix("amqps://").rstrip("/").rsplit(":", 1)
            out.append(
                pika.ConnectionParameters(
                    host,
                    int(port),
                    credentials=creds,
                    connection_attempts=1,
                    ssl_options=pika.SSLOptions(ctx, server_hostname=host),
                )
            )
        return out

    def urls(self) -> list[str]:
        """Every member's amqps URL, as the generated configurations give them."""
        return [f"amqps://{n.address}:5671/" for n in self.dc.nodes]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)


@pytest.fixture
def machines(cluster_support: None, tmp_path: Path) -> Iterator[Machines]:
    dc = DevCluster(3, prefix=new_test_prefix(), token_ms=1000, owner_pid=os.getpid())
    m = Machines(dc, tmp_path)
    seed = tmp_path / "seed"
    seed.write_bytes(os.urandom(64))
    node_list = ",".join(f"n{n.nodeid}={n.address}" for n in dc.nodes)
    for n in dc.nodes:
        env = {
            **os.environ,
            "CPGBROKER_PREFIX": str(m.root(n.nodeid)),
            "CPGBROKER_SKIP_PACKAGES": "1",
            "CPGBROKER_BIN": str(Path(sys.executable).with_name("cpgbroker")),
            # The brokers run as root here (no systemd to switch users).
            "CPGBROKER_SERVICE_USER": "root",
            "CPGBROKER_TLS": "1",
        }
        done = subprocess.run(
            ["bash", str(PROVISION), f"n{n.nodeid}", node_list, str(seed)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        dc.corosync_configs[n.nodeid] = m.root(n.nodeid) / "etc" / "corosync" / "corosync.conf"
    dc.up()
    try:
        yield m
    finally:
        m.stop_all()
        dc.down()


async def aio_pika_fails_over(urls: list[str], password: str, ctx: ssl.SSLContext) -> list[str]:
    """aio-pika over amqps: each URL in turn until one serves (the first member is dead);
    publishes with confirms and reads back. Which URLs refused, and what came back."""
    refused = []
    for url in urls:
        host_port = url.removeprefix("amqps://").rstrip("/")
        try:
            conn = await aio_pika.connect(
                f"amqps://admin:{password}@{host_port}/", ssl_context=ctx, timeout=5
            )
        except (TimeoutError, OSError):
            refused.append(url)
            continue
        async with conn:
            ch = await conn.channel(publisher_confirms=True)
            q = await ch.declare_queue("", exclusive=True)
            for i in range(20):
                await ch.default_exchange.publish(aio_pika.Message(b"aio %d" % i), q.name)
            got = []
            for _ in range(20):
                m = await q.get(no_ack=True, timeout=5)
                assert m is not None
                got.append(m.body.decode())
            assert got == [f"aio {i}" for i in range(20)]
        return refused
    raise AssertionError(f"aio-pika found no member serving among {urls}")


def test_three_provisioned_machines_serve_amqps_with_failover_and_keep_out_another_key(
    machines: Machines, tmp_path: Path
) -> None:
    m = machines
    for n in (1, 2, 3):
        installed = m.root(n)
        assert (installed / "etc/systemd/system/cpgbroker.service").read_text() == UNIT.read_text()
        conf = (installed / "etc/corosync/corosync.conf").read_text()
        assert "crypto_cipher: aes256" in conf and f"keyfile: {installed}/etc/corosync" in conf
        toml = (installed / "etc/cpgbroker/cpgbroker.toml").read_text()
        assert "admin_tls = true" in toml
        key = installed / "etc/cpgbroker/tls/key.pem"
        assert key.stat().st_mode & 0o777 == 0o640
        m.start(n)
    # `cpgbroker status --config ...` (no flags) over the members' https admin endpoints.
    m.wait_ready([1, 2, 3])
    for n in (1, 2, 3):
        assert "corosync ring encrypted cipher=aes256 hash=sha256" in m.log(n)
        secret = m.root(n) / "var/lib/cpgbroker/admin.secret"
        assert secret.stat().st_mode & 0o777 == 0o600
    status = m.status(2)
    assert status is not None and len(status["members"]) == 3  # type: ignore[arg-type]

    # The client runs on machine 1's network; it trusts the cluster's CA.
    with enter_netns(m.dc.node(1).netns):
        # Trusting another CA, a client refuses every member.
        other = trustme.CA()
        other.cert_pem.write_to_path(str(tmp_path / "other-ca.pem"))
        with pytest.raises((pika.exceptions.AMQPConnectionError, ssl.SSLError)):
            pika.BlockingConnection(m.params(m.urls()[1:2], m.context(tmp_path / "other-ca.pem")))
        # The member says so, at the level of a refused login.
        deadline = time.monotonic() + 10
        while not any(
            "level=warning" in line and "tls handshake failed" in line
            for line in m.log(2).splitlines()
        ):
            assert time.monotonic() < deadline, m.log(2)
            time.sleep(0.1)
        conn = pika.BlockingConnection(m.params(m.urls()))
        # The failover list each member hands out: every member's amqps URL.
        props = conn._impl.server_properties
        members = props["cluster_members"].split()
        assert sorted(members) == sorted(m.urls()), members
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("orders", durable=True)
        for i in range(200):
            ch.basic_publish(
                "", "orders", f"order {i}".encode(), pika.BasicProperties(delivery_mode=2)
            )
        # kill -9 the member the client is connected to (the first URL's).
        m.procs[1].kill()
        m.procs[1].wait(10)
        with pytest.raises(pika.exceptions.AMQPError):
            for _ in range(50):
                conn.process_data_events(0.1)
        # Machine 1 refuses: on to the next member of the list the cluster handed out.
        conn = pika.BlockingConnection(m.params(members))
        ch = conn.channel()
        got = []
        for _ in range(200):
            method, _props, body = ch.basic_get("orders", auto_ack=True)
            assert method is not None, f"only {len(got)} of 200 confirmed messages"
            got.append(body.decode())
        assert got == [f"order {i}" for i in range(200)]
        conn.close()
        refused = asyncio.run(aio_pika_fails_over(m.urls(), m.password(), m.context()))
        assert refused == [m.urls()[0]]

    # A rolling change of certificates: machine 2 gets a new one from the cluster's CA (its
    # key stays on the machine that ran `cluster init`), installed, and the member restarted
    # while machine 3 serves; then machine 2 serves with the new certificate.
    init_dir = m.root(1) / "var/lib/cpgbroker-init"
    ca_args = ["--ca-cert", str(init_dir / "ca.pem"), "--ca-key", str(init_dir / "ca.key")]
    node2 = ["--node", f"n2={m.dc.node(2).address}", "--out", str(tmp_path / "renew")]
    renew = subprocess.run(
        [str(m.root(1) / "usr/local/bin/cpgbroker"), "cluster", "certs", *ca_args, *node2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert renew.returncode == 0, renew.stderr
    new_cert = (tmp_path / "renew/n2/tls/cert.pem").read_text()
    tls2 = m.root(2) / "etc/cpgbroker/tls"
    assert (tls2 / "cert.pem").read_text() != new_cert
    (tls2 / "cert.pem").write_text(new_cert)
    (tls2 / "key.pem").write_bytes((tmp_path / "renew/n2/tls/key.pem").read_bytes())
    m.procs[2].send_signal(signal.SIGTERM)
    assert m.procs[2].wait(30) == 0
    m.start(2)
    m.wait_ready([2])
    with enter_netns(m.dc.node(1).netns):
        address = m.dc.node(2).address
        raw = ssl.get_server_certificate((address, 5671), ca_certs=str(m.ca()))
        assert ssl.PEM_cert_to_DER_cert(raw) == ssl.PEM_cert_to_DER_cert(new_cert)
        conn = pika.BlockingConnection(m.params(m.urls()[1:2]))
        assert conn.channel().queue_declare("orders", passive=True).method.message_count == 0
        conn.close()

    # Machine 3 with another authkey: corosync cannot read the ring, so its member never
    # joins and never serves, and the others do not see it.
    m.procs[3].send_signal(signal.SIGTERM)
    assert m.procs[3].wait(30) == 0
    m.dc.kill(3)
    key = m.root(3) / "etc/corosync/authkey"
    key.chmod(0o600)
    key.write_bytes(os.urandom(256))
    key.chmod(0o400)
    m.dc.restart(3, wait=False)
    m.wait_corosync(3)  # as systemd orders cpgbroker.service after corosync.service
    m.start(3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s3 = m.status(3)
        assert s3 is None or s3.get("state") != "ready", s3
        assert m.procs[3].poll() is None, m.log(3)
        time.sleep(0.5)
    s2 = m.status(2)
    assert s2 is not None and s2["state"] == "ready"
    assert len(s2["members"]) == 1  # type: ignore[arg-type]  # machine 1's member was killed
    with enter_netns(m.dc.node(1).netns), pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(m.params(m.urls()[2:3]))
    assert "ready" not in (m.status(3) or {}).get("state", "")

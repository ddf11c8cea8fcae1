"""``cpgbroker cluster init``: every file a three-machine (or N-machine) deployment needs, made
once, on one machine, then copied to each node (or made on each node from one shared seed).

For ``--node n1=10.0.0.11 --node n2=... --out DIR`` it writes:

* ``DIR/corosync.conf`` — the same on every node: knet, ``crypto_cipher aes256`` and
  ``crypto_hash sha256`` with ``keyfile``, votequorum, the nodelist, and ``uidgid`` so that the
  ``cpgbroker`` user (the systemd unit's) may use corosync's IPC;
* ``DIR/authkey`` — corosync's key (256 random bytes, 0400), the same on every node;
* ``DIR/<node>/cpgbroker.toml`` — each member's configuration: its listeners, its URL for
  failover, the group and size, a store, an event log, the admin endpoint on loopback with its
  secret file, and one AMQP user whose password is stored only as a salted hash;
* ``DIR/<user>.password`` — that user's password (0600), for the operator's clients.

Every path written into the files is a production path (``/etc/corosync``, ``/var/lib/...``)
under ``--prefix`` (default none), so that a test can deploy three "machines" into three
directories of one host.

Key material comes from ``os.urandom``, or, with ``--seed-file``, is derived from that file's
contents, so that machines provisioned separately (a Vagrant box each) from the same seed write
byte-identical shared files without copying anything between them.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
import re
import tempfile
import tomllib
from pathlib import Path

import attrs

from cpgbroker.deploy import certs
from cpgbroker.errors import ConfigError
from cpgbroker.model import auth
from cpgbroker.runtime.config import settings

# corosync-keygen writes 256 bytes (2048 bits); corosync accepts 1024 bits to 4096 bytes.
AUTHKEY_BYTES = 256
# What the systemd unit runs the broker as (provisioning creates it).
SERVICE_USER = "cpgbroker"
# The state-update port members open to each other (docs/operations.md, "Ports").
UPDATE_PORT = 25672
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@attrs.frozen
class NodeSpec:
    name: str
    address: str


@attrs.frozen
class InitOptions:
    nodes: tuple[NodeSpec, ...]
    cluster_name: str = "cpgbroker"
    group: str = "cpgbroker"
    prefix: str = ""
    amqp_port: int = 5672
    admin_port: int = 15672
    user: str = "admin"
    # corosync's token (ms): failure detection takes about 2.2 x this. corosync's default.
    token_ms: int = 3000
    seed: bytes | None = None
    # The user the broker runs as (the systemd unit's); corosync must allow it IPC.
    service_user: str = SERVICE_USER
    # Where a member receives a state update when it (re)joins: fixed, so that a firewall
    # between the machines can open it (RabbitMQ's inter-node port, for the operator's habit).
    update_port: int = UPDATE_PORT
    # amqps: clients on the network use TLS only (plain AMQP stays on loopback, for the
    # machine's own tools), the admin endpoint is https, the failover lists hand out amqps URLs.
    tls: bool = False
    amqps_port: int = 5671
    # The operator's CA (PEM certificate and key) to sign the members' certificates with;
    # None: a private CA of the cluster's own, written beside the other files.
    ca_cert: bytes | None = None
    ca_key: bytes | None = None


def parse_node(text: str) -> NodeSpec:
    name, sep, address = text.partition("=")
    if not sep or not _NODE_NAME.match(name):
        raise ConfigError(f"--node takes NAME=ADDRESS (e.g. n1=10.0.0.11), not {text!r}")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise ConfigError(f"--node {name}: {address!r} is not an IP address") from None
    return NodeSpec(name, address)


def _check(opts: InitOptions) -> None:
    if len(opts.nodes) < 1:
        raise ConfigError("cluster init needs at least one --node")
    if len(opts.nodes) == 2:
        # votequorum's two_node mode relies on fencing, which members refuse (process.py).
        raise ConfigError(
            "two nodes cannot keep quorum after a split without fencing: use 1, 3 or more"
        )
    names = [n.name for n in opts.nodes]
    addresses = [n.address for n in opts.nodes]
    for label, values in (("name", names), ("address", addresses)):
        dup = sorted({v for v in values if values.count(v) > 1})
        if dup:
            raise ConfigError(f"two nodes have the same {label}: {', '.join(dup)}")
    if not opts.group or len(opts.group.encode()) > 127:
        raise ConfigError("the CPG group name must be 1 to 127 bytes")
    if not re.match(r"^[A-Za-z0-9_.-]{1,32}$", opts.cluster_name):
        raise ConfigError("the cluster name must be 1-32 letters, digits, '.', '_' or '-'")
    ports = {
        "--amqp-port": opts.amqp_port,
        "--admin-port": opts.admin_port,
        "--update-port": opts.update_port,
    }
    if opts.tls:
        ports["--amqps-port"] = opts.amqps_port
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            raise ConfigError(f"{flag} must be a port number (1-65535), not {port}")
    same = sorted({p for p in ports.values() if list(ports.values()).count(p) > 1})
    if same:
        raise ConfigError(f"two services would share port {same[0]}")
    if (opts.ca_cert is None) != (opts.ca_key is None):
        raise ConfigError("--ca-cert and --ca-key go together")
    if opts.ca_cert is not None and not opts.tls:
        raise ConfigError("--ca-cert and --ca-key are for --tls")


class _Keys:
    """Key material: random, or derived from a seed (SHAKE-256 with a label per use)."""

    def __init__(self, seed: bytes | None) -> None:
        self.seed = seed

    def bytes(self, label: str, n: int) -> bytes:
        if self.seed is None:
            return os.urandom(n)
        return hashlib.shake_256(
            b"cpgbroker-cluster-init\0" + label.encode() + b"\0" + self.seed
        ).digest(n)


def _p(prefix: str, path: str) -> str:
    return f"{prefix.rstrip('/')}{path}" if prefix else path


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def corosync_conf(opts: InitOptions) -> str:
    nodelist = "\n".join(
        f"    node {{\n        nodeid: {i}\n        name: {n.name}\n"
        f"        ring0_addr: {n.address}\n    }}"
        for i, n in enumerate(opts.nodes, start=1)
    )
    pre = opts.prefix
    return f"""# corosync.conf for the cpgbroker cluster {opts.cluster_name!r}, written by
# `cpgbroker cluster init`. The same file on every node; see docs/operations.md.

totem {{
    version: 2
    cluster_name: {opts.cluster_name}
    transport: knet
    # Every client's bytes, PLAIN passwords included, cross this ring: encrypt and
    # authenticate it. Only holders of the authkey can join the group or read its traffic.
    crypto_cipher: aes256
    crypto_hash: sha256
    keyfile: {_p(pre, "/etc/corosync/authkey")}
    # A failed node is detected after about token + consensus (consensus = 1.2 x token).
    token: {opts.token_ms}
}}

nodelist {{
{nodelist}
}}

quorum {{
    provider: corosync_votequorum
}}

# The broker runs as this user (the systemd unit): corosync lets it use CPG and votequorum.
uidgid {{
    uid: {opts.service_user}
    gid: {opts.service_user}
}}

logging {{
    to_logfile: yes
    logfile: {_p(pre, "/var/log/corosync/corosync.log")}
    to_syslog: yes
    timestamp: on
}}

system {{
    state_dir: {_p(pre, "/var/lib/corosync")}
}}
"""


# Where each machine keeps its TLS files (the unit's ConfigurationDirectory: read-only for
# the broker, the key readable by its group only).
TLS_DIR = "/etc/cpgbroker/tls"


def member_toml(opts: InitOptions, node: NodeSpec, password_hash: str) -> str:
    pre = opts.prefix
    host = _url_host(node.address)
    if opts.tls:
        tls_dir = _p(pre, TLS_DIR)
        server = f"""# Plain AMQP for this machine's own tools; the network's clients use amqps.
listen = ["127.0.0.1:{opts.amqp_port}"]
listen_tls = ["{host}:{opts.amqps_port}"]
# Only local users reach it, and only with the secret (0600, written at first start). Over
# https with the certificate below, which is valid for 127.0.0.1 too.
admin = "127.0.0.1:{opts.admin_port}"
admin_tls = true"""
        url = f"amqps://{host}:{opts.amqps_port}/"
        tls = f"""
# This member's certificate (valid for {node.address}, {node.name}, 127.0.0.1 and localhost)
# and the cluster's CA, which clients verify it with. `cpgbroker status` verifies the admin
# endpoint against cacertfile too. Each member has its own certificate and key: [tls] may
# differ between members (it is not compared when they join).
[tls]
certfile = "{tls_dir}/cert.pem"
keyfile = "{tls_dir}/key.pem"
cacertfile = "{tls_dir}/ca.pem"
"""
    else:
        server = f"""listen = ["{host}:{opts.amqp_port}"]
# Only local users reach it, and only with the secret (0600, written at first start).
admin = "127.0.0.1:{opts.admin_port}\""""
        url = f"amqp://{host}:{opts.amqp_port}/"
        tls = ""
    return f"""# cpgbroker member {node.name} of cluster {opts.cluster_name!r}, written by
# `cpgbroker cluster init`. configs/cpgbroker.toml documents every key.
vhosts = ["/"]

[server]
{server}
admin_secret_file = "{_p(pre, "/var/lib/cpgbroker/admin.secret")}"

[log]
level = "info"

# The AMQP user; its password is in {opts.user}.password where `cluster init` ran, never here.
[[users]]
name = "{opts.user}"
password_hash = "{password_hash}"
hashing_algorithm = "{auth.DEFAULT_ALGORITHM}"
vhosts = ["/"]
tags = ["administrator"]

[cluster]
# What clients, the management API and /metrics call the cluster (the same on every member).
name = "{opts.cluster_name}"
group = "{opts.group}"
size = {len(opts.nodes)}
# Handed to clients for failover (connection.start's cluster_members, amq.failover).
url = "{url}"
# Where this member receives the state when it (re)joins: open it between the members.
update_listen = "{host}:{opts.update_port}"
# The delivered event stream, for `cpgbroker audit`: state, kept with the store (the unit's
# StateDirectory), not a log that rotation may cut.
event_log = "{_p(pre, "/var/lib/cpgbroker/broker.events.jsonl")}"

[store]
dir = "{_p(pre, "/var/lib/cpgbroker/store")}"
{tls}"""


@attrs.frozen
class InitResult:
    files: tuple[Path, ...]
    password_file: Path


def _tls_files(opts: InitOptions, keys: _Keys, out: Path) -> dict[Path, tuple[bytes, int]]:
    """The CA certificate (for clients), the private CA's key when we made one, and each
    member's certificate and key, with a copy of the CA certificate beside them (what one
    machine installs under /etc/cpgbroker/tls)."""
    if opts.ca_cert is not None and opts.ca_key is not None:
        issuer = certs.load_ca(opts.ca_cert, opts.ca_key)
        files: dict[Path, tuple[bytes, int]] = {}
    else:
        issuer = certs.private_ca(opts.cluster_name, keys.bytes)
        # It signs certificates that every client of the cluster trusts: keep it off the
        # machines once the members have theirs.
        files = {out / "ca.key": (issuer.key_pem, 0o600)}
    files[out / "ca.pem"] = (issuer.cert_pem, 0o644)
    for node in opts.nodes:
        member = certs.member_cert(issuer, node.name, [node.address, "127.0.0.1"], keys.bytes)
        files[out / node.name / "tls" / "cert.pem"] = (member.cert_pem, 0o644)
        files[out / node.name / "tls" / "key.pem"] = (member.key_pem, 0o600)
        files[out / node.name / "tls" / "ca.pem"] = (issuer.cert_pem, 0o644)
    return files


def _check_loads(
    text: str, node: NodeSpec, planned: dict[Path, tuple[bytes, int]], out: Path
) -> None:
    """What we write must load: the same checks as `cpgbroker start`. The [tls] files are
    checked as they will be installed (the key matches the certificate), from a scratch copy,
    since their production paths do not exist here."""
    data = tomllib.loads(text)
    with tempfile.TemporaryDirectory() as scratch:
        if "tls" in data:
            for key, name in (
                ("certfile", "cert.pem"),
                ("keyfile", "key.pem"),
                ("cacertfile", "ca.pem"),
            ):
                path = Path(scratch) / name
                path.write_bytes(planned[out / node.name / "tls" / name][0])
                data["tls"][key] = str(path)
        settings.from_dict(data)


def write(opts: InitOptions, out: Path) -> InitResult:
    """Write every file under ``out`` (created; existing files of ours are refused, so a second
    run never silently replaces a cluster's key)."""
    _check(opts)
    keys = _Keys(opts.seed)
    authkey = keys.bytes("authkey", AUTHKEY_BYTES)
    password = base64.urlsafe_b64encode(keys.bytes(f"password:{opts.user}", 18)).decode()
    # One hash for every member: members compare their configurations when they join.
    password_hash = auth.hash_password(password, keys.bytes(f"salt:{opts.user}", auth.SALT_BYTES))
    planned: dict[Path, tuple[bytes, int]] = {
        out / "corosync.conf": (corosync_conf(opts).encode(), 0o644),
        out / "authkey": (authkey, 0o400),
        out / f"{opts.user}.password": (password.encode() + b"\n", 0o600),
    }
    if opts.tls:
        planned.update(_tls_files(opts, keys, out))
    for node in opts.nodes:
        text = member_toml(opts, node, password_hash)
        _check_loads(text, node, planned, out)
        planned[out / node.name / "cpgbroker.toml"] = (text.encode(), 0o644)
    _write_files("cluster init", planned)
    return InitResult(tuple(planned), out / f"{opts.user}.password")


def write_certs(opts: InitOptions, out: Path) -> tuple[Path, ...]:
    """``cluster certs``: new member certificates from the cluster's CA (``opts.ca_cert``,
    ``opts.ca_key``), for a rolling change of certificates; nothing else is written."""
    if opts.ca_cert is None or opts.ca_key is None:
        raise ConfigError("cluster certs needs the CA: --ca-cert and --ca-key")
    _check(opts)
    planned = _tls_files(opts, _Keys(opts.seed), out)
    _write_files("cluster certs", planned)
    return tuple(planned)


def _write_files(command: str, planned: dict[Path, tuple[bytes, int]]) -> None:
    existing = [str(p) for p in planned if p.exists()]
    if existing:
        raise ConfigError(
            f"{command} would replace {', '.join(existing)}: choose an empty --out directory"
        )
    for path, (data, mode) in planned.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

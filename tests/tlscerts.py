"""Test certificates for the TLS tests, made by trustme (no hand-written X.509): one CA that
signs the server's and the clients' certificates, a second CA nobody trusts, and expired
certificates. Files are PEM, written into a directory the test owns."""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

import attrs
import trustme

# Subjects are fixed so the distinguished names are known: "CN=<name>,OU=clients,O=cpgbroker
# tests" (RFC 4514 order, as RabbitMQ's ssl_cert_login_from = distinguished_name gives it).
ORG = "cpgbroker tests"
UNIT = "clients"


def client_dn(cn: str) -> str:
    return f"CN={cn},OU={UNIT},O={ORG}"


@attrs.frozen
class Pair:
    """A certificate (with its chain) and its private key, as files."""

    cert: str
    key: str


@attrs.frozen
class Certs:
    dir: Path
    ca: str  # the CA that signs everything below (the broker's and clients' trust)
    other_ca: str  # a CA nobody trusts
    server: Pair  # for 127.0.0.1 and localhost
    expired_server: Pair
    other_server: Pair  # signed by other_ca
    ca_obj: trustme.CA
    other_obj: trustme.CA

    def client(self, cn: str, *, expired: bool = False, untrusted: bool = False) -> Pair:
        """A client certificate with common name ``cn`` (written on first use)."""
        tag = ("expired-" if expired else "") + ("untrusted-" if untrusted else "")
        path = self.dir / f"client-{tag}{cn}"
        if not (path.with_suffix(".pem")).exists():
            ca = self.other_obj if untrusted else self.ca_obj
            leaf = ca.issue_cert(
                common_name=cn,
                organization_name=ORG,
                organization_unit_name=UNIT,
                **_expired() if expired else {},
            )
            _write(leaf, path)
        return Pair(str(path.with_suffix(".pem")), str(path.with_suffix(".key")))

    def client_context(
        self, ca: str | None = None, client: Pair | None = None, *, check_hostname: bool = True
    ) -> ssl.SSLContext:
        """What a client uses: trusts ``ca`` (default: ours), presents ``client`` if given."""
        ctx = ssl.create_default_context(cafile=ca or self.ca)
        ctx.check_hostname = check_hostname
        if client is not None:
            ctx.load_cert_chain(client.cert, client.key)
        return ctx


def _expired() -> dict[str, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return {
        "not_before": now - datetime.timedelta(days=30),
        "not_after": now - datetime.timedelta(days=1),
    }


def _write(leaf: trustme.LeafCert, path: Path) -> Pair:
    cert, key = path.with_suffix(".pem"), path.with_suffix(".key")
    # The leaf first, then its chain (trustme's CA is self-signed: the chain is the leaf).
    cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    return Pair(str(cert), str(key))


def make(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name=ORG)
    other = trustme.CA(organization_name="someone else")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    other.cert_pem.write_to_path(str(directory / "other-ca.pem"))
    return Certs(
        dir=directory,
        ca=str(directory / "ca.pem"),
        other_ca=str(directory / "other-ca.pem"),
        server=_write(ca.issue_cert("127.0.0.1", "localhost"), directory / "server"),
        expired_server=_write(
            ca.issue_cert("127.0.0.1", "localhost", **_expired()), directory / "expired-server"
        ),
        other_server=_write(other.issue_cert("127.0.0.1", "localhost"), directory / "other"),
        ca_obj=ca,
        other_obj=other,
    )


def tls_table(certs: Certs, server: Pair | None = None, **extra: object) -> str:
    """A ``[tls]`` section (TOML) for ``server`` (default: the good server certificate)."""
    s = server or certs.server
    lines = [
        "[tls]",
        f'certfile = "{s.cert}"',
        f'keyfile = "{s.key}"',
        f'cacertfile = "{certs.ca}"',
    ]
    for k, v in extra.items():
        lines.append(f"{k} = {_toml(v)}")
    return "\n".join(lines) + "\n"


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)

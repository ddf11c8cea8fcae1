"""The certificates ``cpgbroker cluster init --tls`` writes: a private CA (or the operator's),
and for each member a key and a certificate valid for every address clients and the CLI use.

X.509 is built with ``cryptography`` (the library the Python ecosystem's own TLS tooling uses),
never by hand. Keys are ECDSA P-256: every client library we serve (OpenSSL, Java's JSSE, Go's
crypto/tls, Node's) accepts it, and it is small and fast to handshake with.

With a seed (``--seed-file``), every key derives from it, so that machines provisioned
separately from one seed hold the same CA key and each member the same key pair. Certificates
are still signed afresh on each machine (ECDSA signatures are randomised, and the validity
starts at the time of signing), so the PEM files differ byte for byte between machines; any
machine's ``ca.pem`` is the same CA (same name, same key) and verifies every member.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Callable

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cpgbroker.errors import ConfigError

# The private CA lives long (renewing it means handing every client a new one); member
# certificates for two years, renewed by a rolling change (docs/operations.md).
CA_DAYS = 3650
MEMBER_DAYS = 730
# Machines' clocks differ a little: a certificate valid from "now" on one machine must
# already be valid on the others.
BACKDATE = datetime.timedelta(hours=1)
_CURVE = ec.SECP256R1()
# P-256's group order: a derived private scalar must lie in [1, n-1].
_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551

# Key material by label: (label, n) -> n bytes (random, or derived from the seed).
KeyBytes = Callable[[str, int], bytes]


@attrs.frozen
class Issuer:
    """A CA that signs member certificates."""

    cert: x509.Certificate
    # Ours are EC; an operator's CA is often RSA.
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)


@attrs.frozen
class MemberCert:
    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """A CA signs certificates (and revocation lists); a member's key signs TLS handshakes
    (ECDHE with an ECDSA key: digital signature only)."""
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _private_key(key_bytes: KeyBytes, label: str) -> ec.EllipticCurvePrivateKey:
    # 48 bytes reduced modulo n - 1: the bias is 2^-128, far below anything measurable.
    scalar = int.from_bytes(key_bytes(f"tls-key:{label}", 48), "big") % (_ORDER - 1) + 1
    return ec.derive_private_key(scalar, _CURVE)


def _serial(key_bytes: KeyBytes, label: str) -> int:
    # RFC 5280: positive, at most 20 bytes; 64 bits of entropy as CA/Browser forum asks.
    return int.from_bytes(key_bytes(f"tls-serial:{label}", 16), "big") >> 1 or 1


def private_ca(
    cluster_name: str, key_bytes: KeyBytes, now: datetime.datetime | None = None
) -> Issuer:
    """A CA of the cluster's own, only for its members' certificates."""
    now = now or datetime.datetime.now(datetime.UTC)
    key = _private_key(key_bytes, "ca")
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cpgbroker"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"cpgbroker cluster {cluster_name} CA"),
        ]
    )
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(_serial(key_bytes, "ca"))
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        # It signs end-entity certificates only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issuer(cert, key)


def load_ca(cert_pem: bytes, key_pem: bytes) -> Issuer:
    """The operator's CA (``--ca-cert``, ``--ca-key``): checked to be a CA whose key matches."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"cannot read the CA (PEM certificate, unencrypted PEM key): {e}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ConfigError("the CA key must be an RSA or EC key")
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise ConfigError("the CA key does not belong to the CA certificate")
    try:
        basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        basic = None
    if basic is None or not basic.ca:
        raise ConfigError("the CA certificate is not a CA (basicConstraints CA:TRUE missing)")
    return Issuer(cert, key)


def member_cert(
    issuer: Issuer,
    node_name: str,
    addresses: list[str],
    key_bytes: KeyBytes,
    now: datetime.datetime | None = None,
) -> MemberCert:
    """A member's server certificate: valid for its name and for ``addresses`` (the node's
    address that clients dial, and loopback, where the CLI reaches the admin endpoint)."""
    now = now or datetime.datetime.now(datetime.UTC)
    key = _private_key(key_bytes, f"member:{node_name}")
    names: list[x509.GeneralName] = [x509.DNSName(node_name), x509.DNSName("localhost")]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in dict.fromkeys(addresses)]
    public = key.public_key()
    ca_public = issuer.key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_name)]))
        .issuer_name(issuer.cert.subject)
        .public_key(public)
        # Derived from the signing time too: a renewal (the same seed, later) gets another.
        .serial_number(_serial(key_bytes, f"member:{node_name}:{now.isoformat()}"))
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=MEMBER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False
        )
        .sign(issuer.key, hashes.SHA256())
    )
    return MemberCert(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

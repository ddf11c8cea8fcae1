"""``[tls]`` and ``listen_tls``: RabbitMQ's ssl_options keys and defaults, clear errors for
what is wrong, the server context they make, and the user a client certificate names."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest

import tlscerts
from cpgbroker.errors import ConfigError
from cpgbroker.runtime.config.settings import from_dict
from cpgbroker.runtime.config.tls import TlsConfig, cert_identity, parse_tls, server_context


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tlscerts.Certs:
    return tlscerts.make(tmp_path_factory.mktemp("certs"))


def table(certs: tlscerts.Certs, **kw: Any) -> dict[str, Any]:
    return {"certfile": certs.server.cert, "keyfile": certs.server.key, **kw}


def test_rabbitmqs_defaults(certs: tlscerts.Certs) -> None:
    cfg = parse_tls(table(certs))
    assert cfg == TlsConfig(certs.server.cert, certs.server.key)
    assert cfg.verify == "verify_none" and not cfg.fail_if_no_peer_cert
    assert cfg.min_version == "tlsv1.2" and cfg.cert_login_from == "distinguished_name"
    ctx = server_context(cfg)
    assert ctx.verify_mode == ssl.CERT_NONE
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2


@pytest.mark.parametrize(("fail", "mode"), [(False, ssl.CERT_OPTIONAL), (True, ssl.CERT_REQUIRED)])
def test_verify_peer_asks_for_a_certificate(
    certs: tlscerts.Certs, fail: bool, mode: ssl.VerifyMode
) -> None:
    cfg = parse_tls(
        table(certs, cacertfile=certs.ca, verify="verify_peer", fail_if_no_peer_cert=fail)
    )
    assert cfg is not None
    assert server_context(cfg).verify_mode == mode


def test_no_table_no_tls() -> None:
    assert parse_tls(None) is None and parse_tls({}) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"certfile": None}, "needs certfile"),
        ({"certfile": "/nonexistent/server.pem"}, "certfile '/nonexistent/server.pem' does not"),
        ({"keyfile": "/nonexistent/key.pem"}, "keyfile '/nonexistent/key.pem' does not"),
        ({"cacertfile": "/nonexistent/ca.pem"}, "cacertfile '/nonexistent/ca.pem' does not"),
        ({"certfile": 5}, "certfile must be a file name"),
        ({"verify": "verify_maybe"}, "verify must be one of verify_peer, verify_none"),
        ({"fail_if_no_peer_cert": "yes"}, "fail_if_no_peer_cert must be true or false"),
        ({"fail_if_no_peer_cert": True}, 'needs verify = "verify_peer"'),
        ({"verify": "verify_peer"}, "needs cacertfile"),
        ({"min_version": "tlsv1.1"}, "min_version must be one of tlsv1.2, tlsv1.3"),
        ({"cert_login_from": "subject_alternative_name"}, "cert_login_from must be one of"),
        ({"handshake_timeout": 0}, "handshake_timeout must be a positive number"),
        ({"ciphers": ["x"]}, r"unknown \[tls\] key\(s\): ciphers"),
    ],
)
def test_bad_settings_are_refused_clearly(
    certs: tlscerts.Certs, change: dict[str, Any], message: str
) -> None:
    t = table(certs)
    for k, v in change.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    with pytest.raises(ConfigError, match=message):
        parse_tls(t)


def test_a_key_that_does_not_match_or_a_file_that_is_no_pem_is_refused(
    certs: tlscerts.Certs, tmp_path: Path
) -> None:
    other = certs.client("someone")
    with pytest.raises(ConfigError, match="cannot load certfile"):
        parse_tls({"certfile": certs.server.cert, "keyfile": other.key})
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="cannot load cacertfile"):
        parse_tls(table(certs, cacertfile=str(junk)))
    with pytest.raises(ConfigError, match="must be a table"):
        parse_tls("certfile")


def test_listen_tls_in_the_server_section(certs: tlscerts.Certs) -> None:
    cfg = from_dict({"server": {"listen_tls": ["127.0.0.1:5671"]}, "tls": table(certs)})
    assert cfg.listen_tls == ("127.0.0.1:5671",)
    assert cfg.tls is not None and cfg.tls.certfile == certs.server.cert
    assert cfg.listen == ("127.0.0.1:5672",)  # the plain listener stays
    # By default no amqps listener; [tls] alone opens none.
    assert from_dict({}).listen_tls == () and from_dict({}).tls is None
    assert from_dict({"tls": table(certs)}).listen_tls == ()
    with pytest.raises(ConfigError, match=r"listen_tls needs a \[tls\] section"):
        from_dict({"server": {"listen_tls": ["127.0.0.1:5671"]}})
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        from_dict({"server": {"listen_tls": ["5671"]}, "tls": table(certs)})


def test_the_distinguished_name_is_rabbitmqs_rfc4514_form(certs: tlscerts.Certs) -> None:
    cert = ssl._ssl._test_decode_cert(certs.client("alice").cert)  # type: ignore[attr-defined]
    assert cert_identity(cert, "distinguished_name") == "CN=alice,OU=clients,O=cpgbroker tests"
    assert cert_identity(cert, "common_name") == "alice"


def test_names_are_escaped_as_rabbitmq_escapes_them() -> None:
    subject = (
        (("countryName", "NL"),),
        (("organizationName", "Acme, Inc."),),
        (("commonName", " #bob+1 "), ("userId", "b<>")),
        (("2.5.4.99", "x;y"),),
        (("commonName", "café"),),
    )
    cert = {"subject": subject}
    assert (
        cert_identity(cert, "distinguished_name")
        == "CN=caf\\C3\\A9,2.5.4.99=x\\;y,CN=\\ #bob\\+1\\ +UID=b\\<\\>,O=Acme\\, Inc.,C=NL"
    )
    # Several CNs: joined with "," and not escaped (RabbitMQ's common_name mode).
    assert cert_identity(cert, "common_name") == " #bob+1 ,café"


def test_no_verified_certificate_names_no_one() -> None:
    # getpeercert() is empty when the certificate was not verified (verify_none).
    assert cert_identity({}, "distinguished_name") == ""
    assert cert_identity(None, "common_name") == ""
    assert cert_identity({"subject": ((("organizationName", "x"),),)}, "common_name") == ""

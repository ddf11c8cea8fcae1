"""TLS for client listeners (amqps), configured the way RabbitMQ's ``ssl_options`` are.

``[tls]`` in ``cpgbroker.toml`` becomes a :class:`TlsConfig` (:func:`parse_tls`), and
:func:`server_context` turns that into the ``ssl.SSLContext`` a listener wraps its sockets in.
The names and defaults are RabbitMQ's, so an operator's ``rabbitmq.conf`` maps key by key
(``docs/operations.md``): ``verify`` is ``verify_none`` unless set, ``fail_if_no_peer_cert``
false.

:func:`cert_identity` names the user a verified client certificate stands for (the EXTERNAL
SASL mechanism, RabbitMQ's ``rabbitmq_auth_mechanism_ssl``). Only the member that accepted the
socket ever looks at the certificate: it decides the name once and the name travels in the
``ClientConnected`` event, so every replica of the model gives the same login answer.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Literal

import attrs

from cpgbroker.errors import ConfigError

Verify = Literal["verify_peer", "verify_none"]
MinVersion = Literal["tlsv1.2", "tlsv1.3"]
CertLoginFrom = Literal["distinguished_name", "common_name"]

_VERIFY = ("verify_peer", "verify_none")
_VERSIONS: dict[str, ssl.TLSVersion] = {
    "tlsv1.2": ssl.TLSVersion.TLSv1_2,
    "tlsv1.3": ssl.TLSVersion.TLSv1_3,
}
_LOGIN_FROM = ("distinguished_name", "common_name")
_KEYS = (
    "certfile",
    "keyfile",
    "cacertfile",
    "verify",
    "fail_if_no_peer_cert",
    "min_version",
    "cert_login_from",
    "handshake_timeout",
)


@attrs.frozen
class TlsConfig:
    """``[tls]``: the server's certificate and how clients' certificates are checked."""

    # PEM: the server's certificate (chain), and its private key ("" = in ``certfile``).
    certfile: str
    keyfile: str = ""
    # PEM: the CAs whose client certificates are trusted ("" = none; needed by verify_peer).
    cacertfile: str = ""
    # RabbitMQ's ``ssl_options.verify``: verify_peer asks clients for a certificate and
    # refuses one that does not verify; verify_none (RabbitMQ's default) asks for none.
    verify: Verify = "verify_none"
    # With verify_peer: refuse a client that presents no certificate at all.
    fail_if_no_peer_cert: bool = False
    # The oldest protocol version accepted; older TLS versions have known weaknesses.
    min_version: MinVersion = "tlsv1.2"
    # RabbitMQ's ``ssl_cert_login_from``: which part of a client certificate names the user
    # of an EXTERNAL login. RabbitMQ's default is the whole subject DN.
    cert_login_from: CertLoginFrom = "distinguished_name"
    # Seconds a client has to finish the TLS handshake (RabbitMQ's ssl_handshake_timeout,
    # 5 s): a client that connects and says nothing must not hold a connection for long.
    handshake_timeout: float = 5.0


def parse_tls(table: Any) -> TlsConfig | None:
    """The ``[tls]`` table (None or empty: no TLS). Checks every key, that the files exist,
    and that they load (the key matches the certificate), so a bad setting stops
    ``cpgbroker start`` with a clear message instead of failing the first client."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError("[tls] must be a table of keys (certfile, keyfile, ...)")
    if not table:
        return None
    unknown = sorted(k for k in table if k not in _KEYS)
    if unknown:
        raise ConfigError(f"unknown [tls] key(s): {', '.join(unknown)}")
    if "certfile" not in table:
        raise ConfigError("[tls] needs certfile (the server's certificate, PEM)")
    files = {}
    for key in ("certfile", "keyfile", "cacertfile"):
        v = table.get(key, "")
        if not isinstance(v, str):
            raise ConfigError(f"[tls] {key} must be a file name")
        if v and not Path(v).is_file():
            raise ConfigError(f"[tls] {key} {v!r} does not exist or is not a file")
        files[key] = v
    if not files["certfile"]:
        raise ConfigError("[tls] certfile must name the server's certificate (PEM)")
    verify = table.get("verify", "verify_none")
    if verify not in _VERIFY:
        raise ConfigError(f"[tls] verify must be one of {', '.join(_VERIFY)}, not {verify!r}")
    fail = table.get("fail_if_no_peer_cert", False)
    if not isinstance(fail, bool):
        raise ConfigError("[tls] fail_if_no_peer_cert must be true or false")
    if fail and verify != "verify_peer":
        # Erlang's ssl refuses this combination too: nothing asks the client for a certificate.
        raise ConfigError('[tls] fail_if_no_peer_cert = true needs verify = "verify_peer"')
    if verify == "verify_peer" and not files["cacertfile"]:
        raise ConfigError(
            '[tls] verify = "verify_peer" needs cacertfile (the CAs that sign client certificates)'
        )
    version = table.get("min_version", "tlsv1.2")
    if version not in _VERSIONS:
        raise ConfigError(
            f"[tls] min_version must be one of {', '.join(_VERSIONS)}, not {version!r}"
        )
    login_from = table.get("cert_login_from", "distinguished_name")
    if login_from not in _LOGIN_FROM:
        raise ConfigError(
            f"[tls] cert_login_from must be one of {', '.join(_LOGIN_FROM)}, not {login_from!r}"
        )
    timeout = table.get("handshake_timeout", 5.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError("[tls] handshake_timeout must be a positive number of seconds")
    cfg = TlsConfig(
        certfile=files["certfile"],
        keyfile=files["keyfile"],
        cacertfile=files["cacertfile"],
        verify=verify,
        fail_if_no_peer_cert=fail,
        min_version=version,
        cert_login_from=login_from,
        handshake_timeout=float(timeout),
    )
    server_context(cfg)
    return cfg


def server_context(cfg: TlsConfig) -> ssl.SSLContext:
    """The server side of a TLS listener (AMQP or HTTP) for ``cfg``. Raises ConfigError when
    a file does not load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[cfg.min_version]
    try:
        ctx.load_cert_chain(cfg.certfile, cfg.keyfile or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"[tls] cannot load certfile {cfg.certfile!r}"
            + (f" with keyfile {cfg.keyfile!r}" if cfg.keyfile else "")
            + f" (PEM certificate and its private key expected): {e}"
        ) from None
    if cfg.cacertfile:
        try:
            ctx.load_verify_locations(cafile=cfg.cacertfile)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"[tls] cannot load cacertfile {cfg.cacertfile!r} (PEM certificates): {e}"
            ) from None
    if cfg.verify == "verify_peer":
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.fail_if_no_peer_cert else ssl.CERT_OPTIONAL
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


# RabbitMQ's names for subject attributes (rabbit_cert_info's format_rdn); Python's ssl module
# gives OpenSSL's long names. An attribute missing here keeps the name OpenSSL gave it.
_SHORT = {
    "surname": "SN",
    "givenName": "GIVENNAME",
    "initials": "INITIALS",
    "generationQualifier": "GENERATIONQUALIFIER",
    "commonName": "CN",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "title": "TITLE",
    "countryName": "C",
    "serialNumber": "SERIALNUMBER",
    "pseudonym": "PSEUDONYM",
    "domainComponent": "DC",
    "emailAddress": "EMAILADDRESS",
    "streetAddress": "STREET",
    "userId": "UID",
}


def cert_identity(peercert: dict[str, Any] | None, login_from: CertLoginFrom) -> str:
    """The user name a *verified* client certificate stands for, as RabbitMQ's
    ``ssl_cert_login_from`` takes it; "" when there is no verified certificate or it has no
    such name. ``peercert`` is ``SSLSocket.getpeercert()``: empty unless the certificate was
    verified, so an unverified certificate never names anyone."""
    if not peercert:
        return ""
    subject: tuple[tuple[tuple[str, str], ...], ...] = peercert.get("subject", ())
    if login_from == "common_name":
        # Several CNs are joined with "," as RabbitMQ does (unescaped).
        return ",".join(v for rdn in subject for k, v in rdn if k == "commonName")
    # RFC 4514 order (most specific first, the reverse of the certificate's), multi-valued
    # RDNs joined with "+", values escaped as RabbitMQ escapes them.
    return ",".join(
        "+".join(f"{_SHORT.get(k, k)}={_escape(v)}" for k, v in rdn) for rdn in reversed(subject)
    )


def _escape(value: str) -> str:
    """RabbitMQ's RFC 4514 escaping (rabbit_cert_info:escape_rdn_value): a leading space or
    '#', a trailing space and ``"+,;<>\\`` get a backslash; bytes outside printable ASCII
    (UTF-8 bytes of other characters too) become ``\\XX``."""
    data = value.encode()
    last = len(data) - 1
    out = []
    for i, b in enumerate(data):
        c = chr(b)
        if (i == 0 and c in " #") or (i == last and c == " ") or c in '"+,;<>\\':
            out.append("\\" + c)
        elif b < 32 or b >= 126:
            out.append(f"\\{b:02X}")
        else:
            out.append(c)
    return "".join(out)

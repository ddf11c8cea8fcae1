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

import contextlib
import os
import ssl
from pathlib import Path
from typing import Any, Literal

import attrs
import trio

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
    # No client-initiated renegotiation (TLS 1.2): a handshake in the middle of a connection
    # could make a write wait for a read (TlsStream never does), and is a cheap way to make a
    # server spend CPU.
    ctx.options |= ssl.OP_NO_RENEGOTIATION
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


# -- the TLS stream of an amqps connection

# Plaintext asked of OpenSSL per SSL_read: a TLS record holds at most 16 KiB.
_RECORD = 16384
# Bytes asked of the kernel per socket read when the caller sets no limit.
_RAW = 256 * 1024


class TlsStream(trio.abc.HalfCloseableStream):
    """The server side of TLS over one accepted TCP socket, leaner than ``trio.SSLStream``.

    OpenSSL works between two memory BIOs (``ssl.SSLObject``), and the socket is read and
    written directly, non-blocking, one system call each way as on the plain TCP path: a read
    takes every record the kernel holds and decrypts them in a few C calls; a write encrypts
    the whole buffer into the outgoing BIO and hands the ciphertext to the socket in one
    ``write``. trio.SSLStream does the same work through a generic retry loop, a conflict
    detector and several awaits per call, which on a 1 KiB confirm load cost about as much as
    the encryption itself (docs/performance.md, "TLS and ring encryption").

    SSL_write into a memory BIO always completes, so OpenSSL's rule that a write it could not
    finish be retried with the same buffer never applies: what the socket does not take is
    *ciphertext*, kept in order in ``_out`` and sent before anything encrypted later. That is
    what lets :meth:`send_nowait` (the server's direct-write fast path) work for TLS too.

    One reader task and one writer task may use it at once (a connection's reader and writer).
    TLS has no half close: :meth:`send_eof` does nothing; the client learns of the end when the
    connection closes (after our close_notify, best effort).
    """

    def __init__(self, transport: trio.SocketStream, context: ssl.SSLContext) -> None:
        self.transport = transport
        self.socket = transport.socket
        self._fd = transport.socket.fileno()
        self._in = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._outgoing, server_side=True)
        # Ciphertext the socket has not taken yet, in order.
        self._out = bytearray()
        self._handshake_done = False
        self._handshake_lock = trio.Lock()
        # A task is inside send_all: it sends ``_out`` to the end, waiting if it must.
        self._sending = False
        # close_notify came: the end of the stream.
        self._eof = False
        self._closed = False

    @property
    def unsent(self) -> int:
        """Bytes of ciphertext waiting for the socket (``send_all(b"")`` sends them)."""
        return len(self._out)

    def getpeercert(self) -> dict[str, Any] | None:
        """The client's certificate once the handshake is done: empty unless it verified."""
        return self._obj.getpeercert()

    def version(self) -> str | None:
        return self._obj.version()

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the TLS stream is closed")

    async def do_handshake(self) -> None:
        """The TLS handshake, once. A failure raises BrokenResourceError whose ``__cause__``
        is the ``ssl.SSLError`` (its reason and verify message go to the log)."""
        async with self._handshake_lock:
            if self._handshake_done:
                return
            while True:
                self._check_open()
                try:
                    self._obj.do_handshake()
                except ssl.SSLWantReadError:
                    # Our flight first: the client answers only once it has it.
                    self._take()
                    await self._flush()
                    if not await self._fill():
                        raise trio.BrokenResourceError(
                            "connection closed during the handshake"
                        ) from None
                    continue
                except ssl.SSLError as e:
                    # Best effort: the alert tells the client why (unknown CA, no certificate).
                    self._take()
                    self._push()
                    raise trio.BrokenResourceError(str(e)) from e
                break
            self._handshake_done = True
            # The last flight (TLS 1.3 session tickets).
            self._take()
            await self._flush()

    # -- reading
    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Up to ``max_bytes`` of plaintext: every whole record already received, so that a
        burst makes one event, as a plain read would. b"" once the client closed with
        close_notify; a close without it (the data may have been cut) or a TLS error raises
        BrokenResourceError, as trio.SSLStream does."""
        if not self._handshake_done:
            await self.do_handshake()
        limit = _RAW if max_bytes is None else max_bytes
        if limit < 1:
            raise ValueError("max_bytes must be >= 1")
        obj = self._obj
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self._check_open()
            chunks: list[bytes] = []
            got = 0
            if not self._eof:
                try:
                    while got < limit:
                        chunk = obj.read(min(limit - got, _RECORD))
                        if not chunk:
                            self._eof = True  # close_notify
                            break
                        chunks.append(chunk)
                        got += len(chunk)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError as e:
                    raise trio.BrokenResourceError(str(e)) from e
                if self._outgoing.pending:
                    # Reading made output (an alert, a TLS 1.3 key update): it goes in order
                    # with ours; a sender in progress sends it, or the next one does.
                    self._take()
                    if not self._sending:
                        self._push()
            if chunks or self._eof:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._in.eof:
                raise trio.BrokenResourceError("the connection closed without close_notify")
            if not await self._fill():
                # The next read says whether close_notify came before the end.
                self._in.write_eof()

    async def _fill(self) -> bool:
        """Move what the socket holds into the incoming BIO, waiting until there is something;
        False at the end of the socket's stream."""
        while True:
            try:
                data = os.read(self._fd, _RAW)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._fd)
                self._check_open()
                continue
            except OSError as e:
                raise trio.BrokenResourceError(str(e)) from e
            if not data:
                return False
            self._in.write(data)
            return True

    # -- writing
    def send_nowait(self, data: bytes) -> bool:
        """Encrypt ``data`` and give the socket what it takes now, never waiting: the
        server's direct write. Call it only when no plaintext of this connection waits to be
        sent before ``data``. True: the stream has it (what the socket did not take waits in
        :attr:`unsent`, for a ``send_all``); False: not now (handshake not done, closed)."""
        if not self._handshake_done or self._closed:
            return False
        try:
            self._obj.write(data)
        except ssl.SSLError:
            return False
        self._take()
        if not self._sending:
            self._push()
        return True

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt ``data`` (may be empty: then only what is unsent goes) and wait until the
        socket took it and everything before it."""
        if not self._handshake_done:
            await self.do_handshake()
        self._check_open()
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this TLS stream")
        await trio.lowlevel.checkpoint_if_cancelled()
        self._sending = True
        try:
            if data:
                try:
                    self._obj.write(data)
                except ssl.SSLError as e:
                    raise trio.BrokenResourceError(str(e)) from e
                self._take()
            if not await self._flush():
                await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        if self._out:
            await trio.lowlevel.wait_writable(self._fd)
        else:
            await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        """Nothing: TLS has no half close (close_notify ends both directions)."""
        await trio.lowlevel.checkpoint()

    def _take(self) -> None:
        if self._outgoing.pending:
            self._out += self._outgoing.read()

    def _push(self) -> None:
        """What the socket takes now of ``_out``; an error is left for the next send_all."""
        out = self._out
        if out:
            try:
                n = os.write(self._fd, out)
            except OSError:
                return
            del out[:n]

    async def _flush(self) -> bool:
        """Until the socket took all of ``_out`` (including what other tasks add meanwhile);
        whether it waited."""
        out = self._out
        waited = False
        while out:
            self._check_open()
            try:
                n = os.write(self._fd, out)
            except BlockingIOError:
                waited = True
                await trio.lowlevel.wait_writable(self._fd)
                continue
            except OSError as e:
                raise trio.BrokenResourceError(str(e)) from e
            del out[:n]
        return waited

    async def aclose(self) -> None:
        """close_notify (best effort: only what the socket takes at once; a client that reads
        nothing must not hold the close), then close the socket. Tasks waiting on it get
        ClosedResourceError."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        try:
            if self._handshake_done:
                # Want-read: ours is written; we do not wait for the client's.
                with contextlib.suppress(ssl.SSLError):
                    self._obj.unwrap()
                self._take()
                self._push()
        finally:
            await self.transport.aclose()


class TlsListener(trio.abc.Listener[TlsStream]):
    """An amqps listener: TCP accepts, each socket wrapped in a :class:`TlsStream` whose
    handshake is left to the caller (the server does it under a timeout)."""

    def __init__(self, transport_listener: trio.SocketListener, context: ssl.SSLContext) -> None:
        self.transport_listener = transport_listener
        self._context = context

    async def accept(self) -> TlsStream:
        return TlsStream(await self.transport_listener.accept(), self._context)

    async def aclose(self) -> None:
        await self.transport_listener.aclose()

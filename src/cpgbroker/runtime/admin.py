"""A minimal HTTP endpoint for operators: ``GET /status[?digest=1]`` -> JSON for ``cpgbroker
status`` (membership, connection counts, queue depths, the event sequence, the last digest
checkpoint, quorum, error-check rounds), and on cluster members the control requests of
``cpgbroker cluster stop`` / ``member stop`` (``POST /stop``) and, when a test configuration
enables it, ``POST /faults``.

It trusts no one: every request, the status read included and on loopback too, must carry
``Authorization: Bearer <admin secret>`` (runtime/secret.py: generated at first start, 0600,
read by the CLI; or ``[server] admin_token``). Without it the answer is 401, with a wrong one
403, and the refusal is logged with the peer's address, never with what it sent.
"""

from __future__ import annotations

import hmac
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from cpgbroker.runtime import secret as admin_secret
from cpgbroker.runtime.settings import ServerConfig, parse_listen

log = logging.getLogger("cpgbroker.admin")

# Requests are one short line plus headers (and a small JSON body); anything bigger is not
# for us.
MAX_REQUEST = 8192

# POST path, JSON body -> (HTTP status, JSON answer)
Control = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
_REASONS = {
    200: "OK",
    202: "Accepted",
    401: "Unauthorized",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    500: "Internal Server Error",
}
# A control request waits for its multicast to come back (``ClusterNode.request_stop``: 10 s).
REQUEST_TIMEOUT = 20


def json_int(args: dict[str, Any], key: str, default: int) -> int:
    """A non-negative integer argument of a control request (JSON numbers only)."""
    v = args.get(key, default)
    if v is None:
        return default
    if type(v) is not int or not 0 <= v < 1 << 63:
        raise ValueError(f"{key} must be a non-negative integer, not {v!r}")
    return v


def _split_request(request: bytes) -> tuple[list[str], bytes, dict[str, str]]:
    head, _, body = request.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    headers = {}
    for h in lines[1:]:
        name, _, value = h.partition(":")
        headers[name.strip().lower()] = value.strip()
    return lines[0].split(), body, headers


def load_secret(config: ServerConfig) -> str:
    """The secret this member's admin endpoint requires: ``[server] admin_token`` if set,
    else the secret file's, generated now if this is the first start."""
    if config.admin_token:
        return config.admin_token
    path = admin_secret.secret_path(config.admin_secret_file)
    value, created = admin_secret.load_or_create(path)
    if created:
        log.info("admin secret generated path=%s", path)
    return value


def admin_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """https for the admin endpoint (``[server] admin_tls``): the [tls] certificate, but no
    client certificate asked for: callers prove themselves with the secret, and the CLI has
    no certificate of its own."""
    if not config.admin_tls or config.tls is None:
        return None
    from cpgbroker.runtime import tls

    context = tls.server_context(config.tls)
    context.verify_mode = ssl.CERT_NONE
    return context


def refusal(secret: str, authorization: str) -> tuple[int, str] | None:
    """Why a request may not proceed (HTTP status, reason), or None if it may."""
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return 401, (
            "this endpoint needs Authorization: Bearer <admin secret> (the cpgbroker CLI reads "
            "it from the member's [server] admin_secret_file)"
        )
    # Compared as bytes: compare_digest refuses non-ASCII str, and a header may hold anything.
    if hmac.compare_digest(given.strip().encode(errors="replace"), secret.encode()):
        return None
    return 403, "the admin secret does not match this member's"


async def serve_admin(
    addr: str,
    status: Callable[[bool], dict[str, Any]],
    control: Control | None = None,
    secret: str = "",
    *,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    if not secret:
        # No default that opens the endpoint: the caller must have loaded or made a secret.
        raise ValueError("serve_admin needs the admin secret")
    host, port = parse_listen(addr)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    log.info(
        "status endpoint host=%s port=%s tls=%s",
        bound[0],
        bound[1],
        "yes" if ssl_context else "no",
    )

    async def handle(tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp
        try:
            peer = tcp.socket.getpeername()[0]
        except OSError:
            peer = "?"
        try:
            with trio.move_on_after(REQUEST_TIMEOUT):
                if ssl_context is not None:
                    stream = trio.SSLStream(tcp, ssl_context, server_side=True)
                    await stream.do_handshake()
                request = b""
                while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    request += chunk
                line, payload, headers = _split_request(request)
                declared = headers.get("content-length", "")
                length = int(declared) if declared.isdigit() else 0
                while len(payload) < min(length, MAX_REQUEST):
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    payload += chunk
                payload = payload[:length]
                path, _, query = line[1].partition("?") if len(line) >= 2 else ("", "", "")
                answer: Any
                method = line[0] if line else ""
                refused = refusal(secret, headers.get("authorization", ""))
                if refused is not None:
                    http, answer = refused[0], {"error": refused[1]}
                    log.warning(
                        "admin request refused peer=%s method=%s path=%s status=%d",
                        peer,
                        method or "-",
                        path or "-",
                        http,
                    )
                elif method == "GET" and path in ("/", "/status"):
                    # ?digest=1 adds the current model digest (costs a full snapshot).
                    http, answer = 200, status("digest=1" in query)
                elif method == "POST" and control is not None:
                    try:
                        args = json.loads(payload or b"{}")
                        if not isinstance(args, dict):
                            raise ValueError("not a JSON object")
                    except (ValueError, RecursionError) as e:
                        http, answer = 400, {"error": f"the body is not a JSON object: {e}"}
                    else:
                        try:
                            http, answer = await control(path, args)
                        except Exception as e:
                            # Whatever a request does wrong, the member goes on serving.
                            log.exception("control request %s failed", path)
                            http, answer = 500, {"error": f"{type(e).__name__}: {e}"}
                else:
                    http, answer = 404, {"error": "GET /status, or POST /stop on a member"}
                body = json.dumps(answer, indent=2, default=str).encode()
                code = f"{http} {_REASONS.get(http, 'Error')}"
                challenge = 'WWW-Authenticate: Bearer realm="cpgbroker"\r\n' if http == 401 else ""
                await stream.send_all(
                    f"HTTP/1.0 {code}\r\nContent-Type: application/json\r\n{challenge}"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
        except trio.BrokenResourceError as e:
            # trio wraps TLS failures (a client that does not trust our certificate, or that
            # speaks plain HTTP to an https endpoint): worth a line, not a traceback.
            if isinstance(e.__cause__, ssl.SSLError):
                why = e.__cause__.reason or e.__cause__
                log.info("admin TLS handshake failed peer=%s reason=%s", peer, why)
        except trio.ClosedResourceError:
            pass
        finally:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()

    task_status.started((str(bound[0]), int(bound[1])))
    await trio.serve_listeners(handle, listeners)

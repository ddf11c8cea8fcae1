"""A minimal HTTP endpoint for operators: ``GET /status[?digest=1]`` -> JSON for ``cpgbroker
status`` (membership, connection counts, queue depths, the event sequence, the last digest
checkpoint, quorum, error-check rounds), and on cluster members the control requests of
``cpgbroker cluster stop`` / ``member stop`` (``POST /stop``) and, when a test configuration
enables it, ``POST /faults``.

``GET /status`` is open to whoever reaches the address the operator configures (loopback in
the examples). Control requests can stop the cluster: with ``[server] admin_token`` set they
must carry ``Authorization: Bearer <token>``; without it they are accepted only when the
endpoint listens on a loopback address (then only local users reach it).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from cpgbroker.runtime.settings import parse_listen

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


def control_refusal(bound_host: str, token: str, authorization: str) -> tuple[int, str] | None:
    """Why a control request may not proceed (HTTP status, reason), or None if it may."""
    if token:
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token):
            return None
        return 401, "control requests need Authorization: Bearer <[server] admin_token>"
    try:
        loopback = ipaddress.ip_address(bound_host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return 403, (
        "this status endpoint is not on loopback: set [server] admin_token to accept control "
        "requests on it"
    )


async def serve_admin(
    addr: str,
    status: Callable[[bool], dict[str, Any]],
    control: Control | None = None,
    token: str = "",
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    host, port = parse_listen(addr)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    log.info("status endpoint host=%s port=%s", bound[0], bound[1])

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(REQUEST_TIMEOUT):
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
                if line and line[0] == "GET" and path in ("/", "/status"):
                    # ?digest=1 adds the current model digest (costs a full snapshot).
                    http, answer = 200, status("digest=1" in query)
                elif (
                    line
                    and line[0] == "POST"
                    and control is not None
                    and (
                        refusal := control_refusal(
                            str(bound[0]), token, headers.get("authorization", "")
                        )
                    )
                ):
                    http, answer = refusal[0], {"error": refusal[1]}
                elif line and line[0] == "POST" and control is not None:
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
                await stream.send_all(
                    f"HTTP/1.0 {code}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    task_status.started((str(bound[0]), int(bound[1])))
    await trio.serve_listeners(handle, listeners)

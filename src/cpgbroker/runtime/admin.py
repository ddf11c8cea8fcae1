"""A minimal HTTP status endpoint (``GET /status[?digest=1]`` -> JSON) for ``cpgbroker status``.

Read-only and bound to the address the operator configures (loopback by default in the
examples): it reports membership, connection counts, queue depths, the event sequence and the
last digest checkpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import trio

from cpgbroker.config import parse_listen

log = logging.getLogger("cpgbroker.admin")

# Requests are one short line plus headers; anything bigger is not for us.
MAX_REQUEST = 8192


async def serve_admin(
    addr: str,
    status: Callable[[bool], dict[str, Any]],
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    host, port = parse_listen(addr)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    log.info("status endpoint host=%s port=%s", bound[0], bound[1])

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(5):
                request = b""
                while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    request += chunk
                line = request.split(b"\r\n", 1)[0].decode(errors="replace").split()
                path, _, query = line[1].partition("?") if len(line) >= 2 else ("", "", "")
                if line and line[0] == "GET" and path in ("/", "/status"):
                    # ?digest=1 adds the current model digest (costs a full snapshot).
                    body = json.dumps(status("digest=1" in query), indent=2, default=str).encode()
                    code = "200 OK"
                else:
                    body = b'{"error": "only GET /status"}'
                    code = "404 Not Found"
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

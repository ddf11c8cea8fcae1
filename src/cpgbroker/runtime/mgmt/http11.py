"""HTTP/1.1 for the admin endpoint: h11 (the sans-IO protocol machine) over a trio stream.

Theory of operation
-------------------
:func:`serve_connection` owns one accepted stream: it feeds what it reads to an
``h11.Connection``, turns each complete request (head and body) into a :class:`Request`, awaits
the route's :class:`Response` and writes it, then starts over on the same connection while the
client keeps it alive (h11 decides: HTTP/1.0 and ``Connection: close`` end it). It knows
nothing of routes, secrets or the broker: the caller gives it one ``handler``.

Limits are per request, so that a client which sends nothing, or too much, cannot hold a
connection or the member's memory: the head is capped by h11's ``max_incomplete_event_size``,
the body by ``max_body`` (413), and reading a whole request, or waiting for the next one on a
kept-alive connection, by a deadline. A malformed request gets 400 and the connection closes
(h11 cannot find the next request's start after a protocol error).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

import attrs
import h11
import trio

# A request head (request line and headers) larger than this is refused: ours carry a few
# short headers; 64 KiB leaves room for long cookies or tokens some tools send anyway.
MAX_HEAD = 64 * 1024
# Bodies up to this size are read: enough for a definitions import of a large setup (the
# JSON of tens of thousands of queues), small enough that a member does not hold much for it.
MAX_BODY = 16 * 1024 * 1024
# Reading one request, from its first byte to its last (a control request's answer may take
# longer: the handler is not under this deadline).
READ_TIMEOUT = 20.0
# How long a kept-alive connection may wait for its next request.
IDLE_TIMEOUT = 60.0
# Writing one response.
WRITE_TIMEOUT = 20.0
RECV_SIZE = 65536

log = logging.getLogger("cpgbroker.admin")

_REASONS = {
    200: b"OK",
    201: b"Created",
    301: b"Moved Permanently",
    202: b"Accepted",
    204: b"No Content",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    409: b"Conflict",
    413: b"Payload Too Large",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


@attrs.frozen
class Request:
    method: str
    # The target as sent, split at "?": percent-escapes are the router's to decode (a vhost
    # named "/" comes as "%2F" and must not split the path).
    path: str
    query: str
    # Lower-case names; a repeated header's values joined with ", " (RFC 9110).
    headers: dict[str, str]
    body: bytes
    peer: str


@attrs.frozen
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Awaitable[Response]]


class _BadRequest(Exception):
    """The request cannot be read: the status to answer (400 or 413) and why."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


def _request(event: h11.Request, body: bytes, peer: str) -> Request:
    headers: dict[str, str] = {}
    for name, value in event.headers:
        key = name.decode("ascii", "replace")
        text = value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    path, _, query = event.target.decode("ascii", "replace").partition("?")
    return Request(event.method.decode("ascii", "replace"), path, query, headers, body, peer)


async def _next_event(conn: h11.Connection, stream: trio.abc.Stream) -> h11.Event:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            assert not isinstance(event, type), event
            return event
        data = await stream.receive_some(RECV_SIZE)
        # b"" tells h11 the peer closed: it then yields ConnectionClosed (or raises if a
        # request was cut off).
        conn.receive_data(bytes(data))


async def _read_request(conn: h11.Connection, stream: trio.abc.Stream, peer: str) -> Request | None:
    """The next whole request, or None when the client closed between requests."""
    event = await _next_event(conn, stream)
    if isinstance(event, h11.ConnectionClosed):
        return None
    if not isinstance(event, h11.Request):
        raise _BadRequest(400, f"unexpected {type(event).__name__}")
    # h11 has checked that a Content-Length is digits.
    declared = dict(event.headers).get(b"content-length")
    if declared is not None and int(declared) > MAX_BODY:
        raise _BadRequest(413, f"the body is larger than {MAX_BODY} bytes")
    parts: list[bytes] = []
    size = 0
    while True:
        part = await _next_event(conn, stream)
        if isinstance(part, h11.Data):
            size += len(part.data)
            if size > MAX_BODY:  # chunked bodies declare no length
                raise _BadRequest(413, f"the body is larger than {MAX_BODY} bytes")
            parts.append(bytes(part.data))
        elif isinstance(part, h11.EndOfMessage):
            return _request(event, b"".join(parts), peer)
        else:
            raise _BadRequest(400, f"unexpected {type(part).__name__}")


def _response_bytes(conn: h11.Connection, response: Response, head_only: bool = False) -> bytes:
    headers = [
        ("Content-Type", response.content_type),
        ("Content-Length", str(len(response.body))),
        ("Cache-Control", "no-cache"),
        *response.headers,
    ]
    head = conn.send(
        h11.Response(
            status_code=response.status,
            headers=headers,
            reason=_REASONS.get(response.status, b"Error"),
        )
    )
    # A HEAD answer declares the body's length and sends none (h11 holds it to that).
    data = conn.send(h11.Data(data=response.body)) if response.body and not head_only else b""
    end = conn.send(h11.EndOfMessage())
    return (head or b"") + (data or b"") + (end or b"")


async def serve_connection(stream: trio.abc.Stream, handler: Handler, peer: str) -> None:
    """Requests on ``stream`` until the client or h11 ends the connection, or a deadline
    passes. The caller closes the stream."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    # The first request must come whole within READ_TIMEOUT of the connection's start; a
    # kept-alive connection may first idle for IDLE_TIMEOUT.
    deadline = READ_TIMEOUT
    while True:
        request: Request | None = None
        with trio.move_on_after(deadline):
            try:
                request = await _read_request(conn, stream, peer)
            except h11.RemoteProtocolError as e:
                await _refuse(conn, stream, e.error_status_hint, str(e))
                return
            except _BadRequest as e:
                await _refuse(conn, stream, e.status, str(e))
                return
        if request is None:  # closed by the client, or the deadline passed
            return
        deadline = IDLE_TIMEOUT + READ_TIMEOUT
        try:
            response = await handler(request)
        except Exception as e:
            # A bug in one route answers 500; the member goes on serving.
            log.exception("admin request failed method=%s path=%s", request.method, request.path)
            reason = f"{type(e).__name__}: {e}"
            body = json.dumps({"error": "internal_server_error", "reason": reason}).encode()
            response = Response(500, body)
        with trio.move_on_after(WRITE_TIMEOUT) as writing:
            await stream.send_all(_response_bytes(conn, response, request.method == "HEAD"))
        if writing.cancelled_caught or conn.our_state is not h11.DONE:
            return
        if conn.their_state is not h11.DONE:
            return  # the client did not finish its request body (h11 keeps it unread)
        try:
            conn.start_next_cycle()
        except h11.LocalProtocolError:
            return  # HTTP/1.0 or "Connection: close": h11 ends it here


async def _refuse(conn: h11.Connection, stream: trio.abc.Stream, status: int, why: str) -> None:
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return
    body = json.dumps({"error": "bad_request", "reason": why}).encode()
    status = status if status in (400, 413, 431) else 400
    response = Response(status, body, headers=(("Connection", "close"),))
    with trio.move_on_after(WRITE_TIMEOUT):
        with contextlib.suppress(h11.LocalProtocolError):
            await stream.send_all(_response_bytes(conn, response))

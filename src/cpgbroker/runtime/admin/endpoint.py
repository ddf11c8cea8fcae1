"""The admin endpoint (``[server] admin``): a member's HTTP interface for operators and their
tools, served over h11 (runtime/mgmt/http11.py) with keep-alive.

* ``GET /status[?digest=1]`` -> JSON for ``cpgbroker status`` (membership, connection counts,
  queue depths, the event sequence, the last digest checkpoint, quorum, error-check rounds),
  and on cluster members the control requests of ``cpgbroker cluster stop`` / ``member stop``
  (``POST /stop``) and, when a test configuration enables it, ``POST /faults``. These trust
  no one: every request, the status read included and on loopback too, must carry
  ``Authorization: Bearer <admin secret>`` (runtime/admin/secret.py: generated at first start,
  0600, read by the CLI; or ``[server] admin_token``). Without it the answer is 401, with a
  wrong one 403, and the refusal is logged with the peer's address, never with what it sent.
* ``GET /api/...``: RabbitMQ's management HTTP API, the read side (runtime/mgmt/reads.py), and
  ``GET /metrics`` in Prometheus' text format (runtime/mgmt/metrics.py). As RabbitMQ's, they take
  HTTP Basic logins of broker users with a management tag, and the admin secret as a Bearer
  token too (operators' tools). Refusals are logged with the user and the peer, never the
  password.
* ``GET /dashboard/``: the web dashboard (runtime/mgmt/dashboard.py), static files that read
  ``/api`` with the login the user types.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from cpgbroker.model import Broker, User
from cpgbroker.runtime.admin import secret as admin_secret
from cpgbroker.runtime.config.settings import ServerConfig, parse_listen
from cpgbroker.runtime.mgmt import dashboard, metrics, reads, views, writes
from cpgbroker.runtime.mgmt.http11 import Request, Response, serve_connection

log = logging.getLogger("cpgbroker.admin")

# POST path, JSON body -> (HTTP status, JSON answer)
Control = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
# An operator's change (user, op, arguments, timeout) -> the model's answer
# (runtime/admin/admindesk.py).
Command = Callable[[str, str, dict[str, Any], float], Awaitable[tuple[int, Any]]]
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
    from cpgbroker.runtime.config import tls

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


def _json(status: int, answer: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps(answer, indent=2, default=str).encode(), headers=headers)


def _loopback(peer: str) -> bool:
    try:
        return ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except ValueError:
        return False


class AdminRoutes:
    """What the endpoint answers, request by request (the HTTP layer is http11's).

    ``replica`` gives the member's model (None while it has none to show): with it, the
    endpoint also serves ``/api`` and ``/metrics``; ``users`` are who may log in there (the
    configuration's, until users become replicated state)."""

    def __init__(
        self,
        status: Callable[[bool], dict[str, Any]],
        control: Control | None,
        secret: str,
        replica: Callable[[], Broker | None] | None = None,
        users: tuple[User, ...] = (),
        command: Command | None = None,
        cluster_name: str = "",
    ) -> None:
        self.status = status
        self.command = command
        self.control = control
        self.secret = secret
        self.replica = replica
        self.users = users
        # The configuration's (the same on every member), known before any replica is.
        self.cluster_name = cluster_name
        self.host = socket.gethostname()
        self.api = reads.ManagementApi()
        self.registry = metrics.registry_for(self.view)

    def view(self) -> views.ClusterView:
        broker = None if self.replica is None else self.replica()
        return views.cluster_view(self.status(False), broker, self.host, self.cluster_name)

    def _refused(self, req: Request, status: int, user: str = "", why: str = "") -> None:
        extra = f" user={user!r} reason={why!r}" if user or why else ""
        log.warning(
            "admin request refused peer=%s method=%s path=%s status=%d%s",
            req.peer,
            req.method or "-",
            req.path or "-",
            status,
            extra,
        )

    async def handle(self, req: Request) -> Response:
        page = dashboard.page(req.method, req.path)
        if page is not None:
            # No login for the dashboard's files: they hold no data, and the page's script
            # asks /api below with the user's login.
            return page
        if self.replica is not None and (
            req.path == "/metrics" or reads.split_path(req.path) is not None
        ):
            return await self._management(req)
        refused = refusal(self.secret, req.headers.get("authorization", ""))
        if refused is not None:
            self._refused(req, refused[0])
            challenge = (("WWW-Authenticate", 'Bearer realm="cpgbroker"'),)
            return _json(refused[0], {"error": refused[1]}, challenge if refused[0] == 401 else ())
        if req.method == "GET" and req.path in ("/", "/status"):
            # ?digest=1 adds the current model digest (costs a full snapshot).
            return _json(200, self.status("digest=1" in req.query))
        if req.method == "POST" and self.control is not None:
            try:
                args = json.loads(req.body or b"{}")
                if not isinstance(args, dict):
                    raise ValueError("not a JSON object")
            except (ValueError, RecursionError) as e:
                return _json(400, {"error": f"the body is not a JSON object: {e}"})
            try:
                with trio.fail_after(REQUEST_TIMEOUT):
                    http, answer = await self.control(req.path, args)
            except Exception as e:
                # Whatever a request does wrong, the member goes on serving.
                log.exception("control request %s failed", req.path)
                return _json(500, {"error": f"{type(e).__name__}: {e}"})
            return _json(http, answer)
        return _json(404, {"error": "GET /status, or POST /stop on a member"})

    async def _management(self, req: Request) -> Response:
        parts = reads.split_path(req.path)
        view = self.view()
        # Who may log in is the replica's (users are replicated state); before this member
        # has one, the configuration's.
        users = tuple(view.broker.users.by_name.values()) if view.broker is not None else self.users
        writing = req.method not in ("GET", "HEAD")
        need = (
            views.MONITOR_TAGS
            if parts is None
            else views.MGMT_TAGS
            if writing
            else reads.needed_tags(parts)
        )
        who = reads.authenticate(
            req.headers.get("authorization", ""), users, self.secret, _loopback(req.peer), need
        )
        if isinstance(who, reads.Refusal):
            self._refused(req, who.status, who.user, who.why)
            return _json(who.status, who.body, who.headers)
        if parts is None:
            return Response(200, metrics.render(self.registry), metrics.CONTENT_TYPE)
        if writing:
            return await self._write(req, parts, view, who)
        answer = self.api.get(parts, view, who, req.query)
        return _json(answer.status, answer.body)

    async def _write(
        self, req: Request, parts: list[str], view: views.ClusterView, who: views.Identity
    ) -> Response:
        """A change: checked and shaped by mgmt.writes, applied by every member in the event
        order, answered once it is as safe as a durable confirm (runtime/admin/admindesk.py)."""
        if self.command is None or view.broker is None:
            return _json(503, {"error": "unavailable", "reason": "this member does not serve"})
        wanted = writes.command_for(
            req.method, parts, req.body or b"", req.query, req.headers, who, view
        )
        if isinstance(wanted, reads.Answer):
            if wanted.status in (401, 403):
                reason = wanted.body.get("reason", "") if isinstance(wanted.body, dict) else ""
                self._refused(req, wanted.status, who.name, reason)
            return _json(wanted.status, wanted.body)
        commands = wanted if isinstance(wanted, list) else [wanted]
        if commands and commands[0].op == "import_definitions":
            # (The body parsed as a JSON object already, or there would be no commands.)
            skipped = writes.not_imported(json.loads(req.body or b"{}"))
            if skipped:
                log.warning(
                    "definitions import leaves out what cpgbroker does not have: %s",
                    ", ".join(f"{n} {k}" for k, n in skipped.items()),
                )
        status: int = 204
        body: Any = None
        for cmd in commands:
            try:
                status, body = await self.command(cmd.user, cmd.op, cmd.args, REQUEST_TIMEOUT)
            except trio.TooSlowError:
                return _json(
                    503, {"error": "timeout", "reason": "the change was not applied in time"}
                )
            if status >= 300:
                self._refused_change(req, who, cmd, status, body)
                break
        shaped = writes.response_for(commands[-1], status, body)
        return Response(shaped.status, shaped.body, headers=shaped.headers)

    def _refused_change(
        self,
        req: Request,
        who: views.Identity,
        cmd: writes.Command,
        status: int,
        body: Any,
    ) -> None:
        if status in (401, 403):
            # A refused admin call is logged (never with what it carried: it may hold a hash).
            reason = body.get("reason", "") if isinstance(body, dict) else ""
            self._refused(req, status, who.name, f"{cmd.op}: {reason}")


async def serve_admin(
    addr: str,
    status: Callable[[bool], dict[str, Any]],
    control: Control | None = None,
    secret: str = "",
    *,
    ssl_context: ssl.SSLContext | None = None,
    replica: Callable[[], Broker | None] | None = None,
    users: tuple[User, ...] = (),
    command: Command | None = None,
    cluster_name: str = "",
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    if not secret:
        # No default that opens the endpoint: the caller must have loaded or made a secret.
        raise ValueError("serve_admin needs the admin secret")
    routes = AdminRoutes(status, control, secret, replica, users, command, cluster_name)
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
            if ssl_context is not None:
                stream = trio.SSLStream(tcp, ssl_context, server_side=True)
                with trio.move_on_after(REQUEST_TIMEOUT) as handshake:
                    await stream.do_handshake()
                if handshake.cancelled_caught:
                    return
            await serve_connection(stream, routes.handle, peer)
        except trio.BrokenResourceError as e:
            # trio wraps TLS failures (a client that does not trust our certificate, or that
            # speaks plain HTTP to an https endpoint): worth a line, not a traceback.
            if isinstance(e.__cause__, ssl.SSLError):
                why = e.__cause__.reason or e.__cause__
                # Refused, as a request without the secret is: at the same level.
                log.warning("admin TLS handshake failed peer=%s reason=%s", peer, why)
        except trio.ClosedResourceError:
            pass
        finally:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()

    task_status.started((str(bound[0]), int(bound[1])))
    await trio.serve_listeners(handle, listeners)

"""Operators' changes, applied in the event order: the management API's writes and
``cpgbroker ctl``.

Theory of operation
-------------------
A member that an operator asks for a change (``PUT /api/users/x``, ``cpgbroker ctl
set_policy ...``) authenticates them, checks their tags, hashes any password, and multicasts
an :class:`~cpgbroker.model.events.AdminCommand`; every member applies it here at the same
point of the order and produces the same :class:`~cpgbroker.model.events.AdminReply`, which
only the asking member acts on (it answers the HTTP request once the change is stable). So
users, vhosts, permissions and policies are replicated state like queues: in snapshots, the
digest, the store and state updates; the configuration only seeds them.

Every op takes its arguments as a JSON object and answers an HTTP status and RabbitMQ's JSON
body. A malformed request is a 400 on every replica alike; nothing a request says raises out of
:meth:`Admin.apply` but a bug.

Changes to queues, exchanges, bindings and messages go through the very handlers AMQP clients
reach, on a *management connection*: a connection object that exists only for the one event
(never in the broker's connections, never snapshotted), of the asking user in the named vhost,
that emits nothing. So an HTTP declare gets the checks, limits, permissions and texts a client's
declare gets, as in RabbitMQ (whose management plugin declares through an AMQP channel too), and
its errors map to RabbitMQ's HTTP answers (:func:`amqp_answer`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import urllib.parse
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from pamqp import commands
from pamqp import header as pheader

from cpgbroker.errors import AMQPError, CpgBrokerError, ReplyCode
from cpgbroker.model import auth
from cpgbroker.model import entities as E
from cpgbroker.model.config import Permission, Policy, User
from cpgbroker.model.connection import Connections
from cpgbroker.model.consumers import Consumers
from cpgbroker.model.delivery import Delivery
from cpgbroker.model.events import AdminCommand, AdminReply, Forward
from cpgbroker.model.federation import UPSTREAM, Federation, upstream_from_value
from cpgbroker.model.output import Output
from cpgbroker.model.permissions import READ, TRUSTED, WRITE, Permissions, compile_pattern
from cpgbroker.model.policies import Policies, escaped_term, validate
from cpgbroker.model.topology import FAILOVER_EXCHANGE, PEER_EXCHANGE, PREDECLARED, Topology
from cpgbroker.model.users import Users
from cpgbroker.wire.fastpath import parse_content_header
from cpgbroker.wire.framer import FrameReader

R = ReplyCode
Answer = tuple[int, Any]

# RabbitMQ's reason for a connection closed through the management API (its default when the
# request carries no X-Reason header).
CLOSED_VIA_MANAGEMENT = "Closed via management plugin"
GET_ACKMODES = (
    "ack_requeue_true",
    "ack_requeue_false",
    "reject_requeue_true",
    "reject_requeue_false",
)
# Names RabbitMQ refuses for users and vhosts would be refused by ours too; NUL is ours alone
# to refuse (permissions.TRUSTED uses it).
_BAD_NAME_CHARS = "\x00"


class AdminError(CpgBrokerError):
    """A request the model refuses: the HTTP status and RabbitMQ's body."""

    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(f"{status} {error}: {reason}")
        self.status = status
        self.body = {"error": error, "reason": reason}


def bad_request(reason: str) -> AdminError:
    return AdminError(400, "bad_request", reason)


def not_found() -> AdminError:
    return AdminError(404, "Object Not Found", "Not Found")


def amqp_answer(e: AMQPError) -> Answer:
    """What RabbitMQ's management API answers when the AMQP operation it made on a user's
    behalf failed (``rabbit_mgmt_util:with_channel``): 404 for NOT_FOUND, 401 for
    ACCESS_REFUSED, 400 otherwise, with the close's reply text."""
    if e.code == R.NOT_FOUND:
        return 404, {"error": "not_found", "reason": e.reply_text}
    if e.code == R.ACCESS_REFUSED:
        return 401, {"error": "not_authorised", "reason": "Access refused."}
    return 400, {"error": "bad_request", "reason": e.reply_text}


def properties_key(key: str, args: dict[str, Any]) -> str:
    """A binding's ``properties_key`` (its id in ``/api/bindings/.../{props}``), as RabbitMQ
    makes it: the routing key form-encoded ("~" for none), and when the binding has
    arguments, "~" and a hash of them (ours is another hash than RabbitMQ's, stable for one
    binding: clients take the key from a listing)."""
    shown = urllib.parse.quote_plus(key, safe="") if key else ""
    if not args:
        return shown or "~"
    digest = hashlib.sha256(repr(sorted(json_value(args).items())).encode()).digest()
    return f"{shown}~{base64.urlsafe_b64encode(digest[:6]).decode()}"


def json_value(value: Any) -> Any:
    """A field-table value as RabbitMQ's JSON shows it (bytes as text, decimals as numbers)."""
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return float(value)  # Decimal
    except (TypeError, ValueError):
        return str(value)


# ---------------------------------------------------------------------- argument checks


def _str(args: dict[str, Any], key: str, default: str | None = None) -> str:
    v = args.get(key, default)
    if not isinstance(v, str):
        raise bad_request(f"{key} must be a string")
    return v


def _name(args: dict[str, Any], key: str) -> str:
    v = _str(args, key)
    if any(c in v for c in _BAD_NAME_CHARS) or len(v.encode()) > 255:
        raise bad_request(f"{key} is not a valid name")
    return v


def _bool(args: dict[str, Any], key: str, default: bool) -> bool:
    v = args.get(key, default)
    if isinstance(v, str) and v in ("true", "false"):
        return v == "true"  # RabbitMQ's API takes both
    if not isinstance(v, bool):
        raise bad_request(f"{key} must be true or false")
    return v


def _int(args: dict[str, Any], key: str, default: int) -> int:
    v = args.get(key, default)
    if isinstance(v, str) and v.isdigit() and v.isascii():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
        raise bad_request(f"{key} must be a non-negative integer")
    return v


def _table(args: dict[str, Any], key: str) -> dict[str, Any]:
    v = args.get(key) or {}
    if not isinstance(v, dict):
        raise bad_request(f"{key} must be a JSON object")
    return v


def _tags(v: Any) -> tuple[str, ...]:
    """RabbitMQ takes tags as a list or as one comma-separated string."""
    if isinstance(v, str):
        return tuple(t.strip() for t in v.split(",") if t.strip())
    if isinstance(v, list) and all(isinstance(t, str) for t in v):
        return tuple(t.strip() for t in v if t.strip())
    raise bad_request("tags must be a list of strings or a comma-separated string")


class Admin:
    """Applies :class:`AdminCommand` events. Owns nothing but the op table: the state it
    changes is the users', the policies' and the topology's."""

    def __init__(
        self,
        users: Users,
        permissions: Permissions,
        policies: Policies,
        topology: Topology,
        conns: Connections,
        delivery: Delivery,
        consumers: Consumers,
        out: Output,
        federation: Federation,
    ) -> None:
        self._users = users
        self._permissions = permissions
        self._policies = policies
        self._topology = topology
        self._conns = conns
        self._delivery = delivery
        self._consumers = consumers
        self._out = out
        self._federation = federation
        # The replica's own member id (0 standalone): an answer to another member's operator
        # is a confirm that waits for this member's progress report (``Output.confirmed``).
        # Not replicated.
        self.local_member = 0
        # Whether the command being applied is this replica's operator's: only then is an
        # answer that is output alone (the messages of a get) built at all.
        self._answering = False
        self._ops: dict[str, Callable[[dict[str, Any], str], Answer]] = {
            "put_user": self.put_user,
            "delete_user": self.delete_user,
            "delete_users": self.delete_users,
            "put_vhost": self.put_vhost,
            "delete_vhost": self.delete_vhost,
            "put_permissions": self.put_permissions,
            "delete_permissions": self.delete_permissions,
            "put_policy": self.put_policy,
            "delete_policy": self.delete_policy,
            "put_queue": self.put_queue,
            "delete_queue": self.delete_queue,
            "purge_queue": self.purge_queue,
            "get": self.get,
            "put_exchange": self.put_exchange,
            "delete_exchange": self.delete_exchange,
            "bind": self.bind,
            "unbind": self.unbind,
            "publish": self.publish,
            "close_connection": self.close_connection,
            "import_definitions": self.import_definitions,
            "put_parameter": self.put_parameter,
            "delete_parameter": self.delete_parameter,
            "federation_status": self.federation_status,
        }

    def apply(self, e: AdminCommand) -> None:
        self._answering = e.member == self.local_member
        try:
            args = json.loads(e.args)
            if not isinstance(args, dict):
                raise bad_request("the request is not a JSON object")
            op = self._ops.get(e.op)
            if op is None:
                raise bad_request(f"unknown operation {e.op!r}")
            status, body = op(args, e.user)
        except AdminError as err:
            status, body = err.status, err.body
        except AMQPError as err:
            status, body = amqp_answer(err)
        except (ValueError, RecursionError) as err:
            # JSON that does not parse (or nests too deep): the caller sent it.
            status, body = 400, {"error": "bad_request", "reason": str(err)[:200]}
        self._out.effect(AdminReply(e.member, e.ticket, status, body))
        self._out.admin_answered(e.member != self.local_member)

    # ------------------------------------------------------------------ users

    def put_user(self, args: dict[str, Any], who: str) -> Answer:
        name = _name(args, "name")
        if not name:
            raise bad_request("user name must not be empty")
        if "tags" not in args:
            raise bad_request("tags_not_present")
        algorithm = _str(args, "hashing_algorithm", auth.DEFAULT_ALGORITHM)
        password_hash = _str(args, "password_hash", "")
        if password_hash and not auth.valid_hash(password_hash, algorithm):
            raise AdminError(400, "bad_request", f"not_base64: {password_hash}"[:200])
        limits = _table(args, "limits")
        old = self._users.by_name.get(name)
        user = User(
            name,
            "",
            vhosts=(),
            tags=_tags(args.get("tags", "")),
            password_hash=password_hash,
            hashing_algorithm=algorithm if password_hash else auth.DEFAULT_ALGORITHM,
            # An update keeps what the user may do where (RabbitMQ's put_user does), and where
            # it may log in from (RabbitMQ's loopback_users is configuration, not the user).
            permissions=() if old is None else old.grants(),
            loopback_only=False if old is None else old.loopback_only,
            max_connections=_limit(limits, "max-connections"),
            max_channels=_limit(limits, "max-channels"),
        )
        return (201 if self._users.put(user) else 204), None

    def delete_user(self, args: dict[str, Any], who: str) -> Answer:
        if not self._users.delete(_str(args, "name")):
            raise not_found()
        return 204, None

    def delete_users(self, args: dict[str, Any], who: str) -> Answer:
        """``POST /api/users/bulk-delete``: as RabbitMQ, the users named are deleted up to one
        that does not exist, which the answer names."""
        names = args.get("users")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad_request("[{key_missing,users}]")
        for name in names:
            if not self._users.delete(name):
                raise bad_request(f"no_such_user: {name}"[:200])
        return 204, None

    # ------------------------------------------------------------------ vhosts

    def put_vhost(self, args: dict[str, Any], who: str) -> Answer:
        name = _name(args, "name")
        if not name:
            raise bad_request("vhost name must not be empty")
        if name in self._topology.vhosts:
            return 204, None
        self._topology.add_vhost(name)
        if who != TRUSTED and who in self._users.by_name:
            # RabbitMQ gives whoever creates a vhost full permissions on it.
            self._users.set_permission(who, Permission(name))
        return 201, None

    def delete_vhost(self, args: dict[str, Any], who: str) -> Answer:
        name = _str(args, "name")
        topology = self._topology
        vh = topology.vhosts.get(name)
        if vh is None:
            raise not_found()
        # Its clients go first (RabbitMQ: 320 "vhost ... is deleted"); then what it holds.
        for conn in list(self._conns.connections.values()):
            if conn.vhost == name:
                self._conns.close(conn.id, R.CONNECTION_FORCED, f"vhost '{name}' is deleted")
        for q in list(vh.queues.values()):
            topology.delete_queue(q)
        del topology.vhosts[name]
        self._users.forget_vhost(name)
        self._policies.forget_vhost(name)
        self._federation.forget_vhost(name)
        return 204, None

    # ------------------------------------------------------------------ permissions

    def _user_and_vhost(self, args: dict[str, Any]) -> tuple[str, str]:
        user, vhost = _str(args, "user"), _str(args, "vhost")
        if vhost not in self._topology.vhosts or user not in self._users.by_name:
            raise bad_request("vhost_or_user_not_found")
        return user, vhost

    def put_permissions(self, args: dict[str, Any], who: str) -> Answer:
        missing = [k for k in ("configure", "write", "read") if k not in args]
        if missing:
            raise bad_request("[" + ",".join(f"{{key_missing,{k}}}" for k in missing) + "]")
        user, vhost = self._user_and_vhost(args)
        perm = Permission(vhost, _str(args, "configure"), _str(args, "write"), _str(args, "read"))
        for field in ("configure", "write", "read"):
            problem = validate_pattern(getattr(perm, field))
            if problem:
                raise bad_request(f"{field}: {problem}")
        new = not self._users.by_name[user].may_open(vhost)
        self._users.set_permission(user, perm)
        return (201 if new else 204), None

    def delete_permissions(self, args: dict[str, Any], who: str) -> Answer:
        user, vhost = self._user_and_vhost(args)
        if not self._users.clear_permission(user, vhost):
            raise not_found()
        return 204, None

    # ------------------------------------------------------------------ policies

    def put_policy(self, args: dict[str, Any], who: str) -> Answer:
        vhost = _str(args, "vhost")
        if vhost not in self._topology.vhosts:
            raise AdminError(404, "not_found", "vhost_not_found")
        missing = [k for k in ("pattern", "definition") if k not in args]
        if missing:
            raise bad_request("[" + ",".join(f"{{key_missing,{k}}}" for k in missing) + "]")
        definition = args.get("definition")
        if not isinstance(definition, dict):
            raise bad_request("Validation failed\n\ndefinition must be a JSON object\n")
        priority = args.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise bad_request(
                f"Validation failed\n\npriority should be a number, actually was "
                f"{escaped_term(priority)}\n"
            )
        p = Policy(
            vhost,
            _name(args, "name"),
            _str(args, "pattern"),
            _str(args, "apply-to", "all"),
            definition,
            priority,
        )
        problem = validate(p)
        if problem is not None:
            raise bad_request(f"Validation failed\n\n{problem}\n")
        new = self._policies.put(p)
        self._reapply(vhost)
        return (201 if new else 204), None

    def delete_policy(self, args: dict[str, Any], who: str) -> Answer:
        vhost = _str(args, "vhost")
        if not self._policies.delete(vhost, _str(args, "name")):
            raise not_found()
        self._reapply(vhost)
        return 204, None

    def _reapply(self, vhost: str) -> None:
        """The policies of ``vhost`` changed: every queue and exchange of it gets what now
        applies, in declaration order (as every replica does)."""
        vh = self._topology.vhosts.get(vhost)
        if vh is None:
            return
        policies = self._policies
        for q in vh.queues.values():
            before = (q.expires, q.max_length, q.max_length_bytes)
            policies.apply_to_queue(q)
            if q.expires != before[0]:
                self._topology.set_expiry(q)
            if (q.max_length, q.max_length_bytes) != before[1:]:
                self._delivery.trim(q)
        for ex in vh.exchanges.values():
            policies.apply_to_exchange(ex)

    # ------------------------------------------------------------------ queues, exchanges

    def _session(self, who: str, vhost: str) -> tuple[E.Connection, E.Channel]:
        """A management connection (module docstring) of ``who`` in ``vhost``."""
        if vhost not in self._topology.vhosts:
            raise AdminError(404, "not_found", "vhost_not_found")
        conn = E.Connection(
            id=-1, member=-1, peer="management", loopback=True, reader=FrameReader(4096)
        )
        conn.user = who
        conn.vhost = vhost
        conn.state = E.OPEN
        conn.emit = False
        return conn, E.Channel(1, conn)

    def put_queue(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = _str(args, "vhost"), _str(args, "name")
        conn, ch = self._session(who, vhost)
        new = name not in self._topology.vhosts[vhost].queues
        self._topology.q_declare(
            conn,
            ch,
            SimpleNamespace(
                queue=name,
                passive=False,
                durable=_bool(args, "durable", False),
                exclusive=False,
                auto_delete=_bool(args, "auto_delete", False),
                nowait=True,
                arguments=_table(args, "arguments"),
            ),
        )
        return (201 if new else 204), None

    def delete_queue(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = _str(args, "vhost"), _str(args, "name")
        conn, ch = self._session(who, vhost)
        if name not in self._topology.vhosts[vhost].queues:
            raise not_found()
        self._topology.q_delete(
            conn,
            ch,
            SimpleNamespace(
                queue=name,
                if_unused=_bool(args, "if_unused", False),
                if_empty=_bool(args, "if_empty", False),
                nowait=True,
            ),
        )
        return 204, None

    def purge_queue(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = _str(args, "vhost"), _str(args, "name")
        conn, ch = self._session(who, vhost)
        if name not in self._topology.vhosts[vhost].queues:
            raise not_found()
        self._topology.q_purge(conn, ch, SimpleNamespace(queue=name, nowait=True))
        return 204, None

    def put_exchange(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = _str(args, "vhost"), _str(args, "name")
        conn, ch = self._session(who, vhost)
        new = name not in self._topology.vhosts[vhost].exchanges
        self._topology.ex_declare(
            conn,
            ch,
            SimpleNamespace(
                exchange=name,
                exchange_type=_str(args, "type", "direct"),
                passive=False,
                durable=_bool(args, "durable", False),
                auto_delete=_bool(args, "auto_delete", False),
                internal=_bool(args, "internal", False),
                nowait=True,
                arguments=_table(args, "arguments"),
            ),
        )
        return (201 if new else 204), None

    def delete_exchange(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = _str(args, "vhost"), _str(args, "name")
        conn, ch = self._session(who, vhost)
        if name not in self._topology.vhosts[vhost].exchanges:
            raise not_found()
        self._topology.ex_delete(
            conn,
            ch,
            SimpleNamespace(exchange=name, if_unused=_bool(args, "if_unused", False), nowait=True),
        )
        return 204, None

    # ------------------------------------------------------------------ bindings

    def _binding_ends(self, args: dict[str, Any], who: str) -> tuple[E.Connection, E.Channel, str]:
        vhost = _str(args, "vhost")
        conn, ch = self._session(who, vhost)
        vh = self._topology.vhosts[vhost]
        kind = _str(args, "destination_type")
        if kind not in ("q", "e"):
            raise bad_request("destination_type must be q or e")
        source, dest = _str(args, "source"), _str(args, "destination")
        # RabbitMQ answers 404 for a binding whose ends do not exist, before anything else.
        if source not in vh.exchanges:
            raise AdminError(404, "not_found", f"no exchange '{source}' in vhost '{vhost}'")
        if dest not in (vh.queues if kind == "q" else vh.exchanges):
            what = "queue" if kind == "q" else "exchange"
            raise AdminError(404, "not_found", f"no {what} '{dest}' in vhost '{vhost}'")
        return conn, ch, kind

    def bind(self, args: dict[str, Any], who: str) -> Answer:
        conn, ch, kind = self._binding_ends(args, who)
        key = _str(args, "routing_key", "")
        arguments = _table(args, "arguments")
        if kind == "q":
            self._topology.q_bind(
                conn,
                ch,
                SimpleNamespace(
                    queue=args["destination"],
                    exchange=args["source"],
                    routing_key=key,
                    arguments=arguments,
                    nowait=True,
                ),
            )
        else:
            self._topology.ex_bind(
                conn,
                ch,
                SimpleNamespace(
                    destination=args["destination"],
                    source=args["source"],
                    routing_key=key,
                    arguments=arguments,
                    nowait=True,
                ),
            )
        # The new binding's id, for the Location header RabbitMQ answers with.
        return 201, {"properties_key": properties_key(key, arguments)}

    def unbind(self, args: dict[str, Any], who: str) -> Answer:
        conn, ch, kind = self._binding_ends(args, who)
        vh = self._topology.vhosts[conn.vhost]
        props = _str(args, "properties_key")
        src = vh.exchanges[args["source"]]
        dest: Any = (vh.queues if kind == "q" else vh.exchanges)[args["destination"]]
        found = next(
            (b for b in src.bindings if b.dest is dest and properties_key(b.key, b.args) == props),
            None,
        )
        if found is None:
            raise not_found()
        m = SimpleNamespace(
            routing_key=found.key, arguments=found.args, nowait=True, source=src.name
        )
        if kind == "q":
            m.queue, m.exchange = dest.name, src.name
            self._topology.q_unbind(conn, ch, m)
        else:
            m.destination = dest.name
            self._topology.ex_unbind(conn, ch, m)
        return 204, None

    # ------------------------------------------------------------------ messages

    def publish(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = _str(args, "vhost"), _str(args, "name")
        conn, _ = self._session(who, vhost)
        vh = self._topology.vhosts[vhost]
        ex = vh.exchanges.get(name)
        if ex is None:
            raise bad_request(f"404 NOT_FOUND - no exchange '{name}' in vhost '{vhost}'")
        self._permissions.check(conn, WRITE, "exchange", name)
        if ex.internal:
            raise AMQPError(
                R.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{name}' in vhost '{vhost}'",
            )
        missing = [k for k in ("routing_key", "payload", "payload_encoding") if k not in args]
        if missing:
            raise bad_request("[" + ",".join(f"{{key_missing,{k}}}" for k in missing) + "]")
        payload = _str(args, "payload")
        encoding = _str(args, "payload_encoding")
        if encoding == "string":
            body = payload.encode()
        elif encoding == "base64":
            try:
                body = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise bad_request(f"not_base64: {payload}"[:200]) from None
        else:
            raise bad_request(f"unsupported_encoding: {encoding}"[:200])
        header = _content_header(_table(args, "properties"), len(body))
        routed = self._delivery.publish_admin(vh, ex, _str(args, "routing_key", ""), header, body)
        return 200, {"routed": routed}

    def get(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = _str(args, "vhost"), _str(args, "name")
        conn, ch = self._session(who, vhost)
        ackmode = _str(args, "ackmode", "")
        if not ackmode and "requeue" in args:
            # RabbitMQ before 3.7 took requeue: true/false; clients still send it.
            ackmode = "ack_requeue_true" if _bool(args, "requeue", True) else "ack_requeue_false"
        if ackmode not in GET_ACKMODES:
            raise bad_request(f"ackmode must be one of {', '.join(GET_ACKMODES)}")
        encoding = _str(args, "encoding", "auto")
        if encoding not in ("auto", "base64"):
            raise bad_request("Unsupported encoding. Please use auto or base64.")
        truncate = args.get("truncate")
        limit = None if truncate in (None, "") else _int(args, "truncate", 0)
        self._permissions.check(conn, READ, "queue", name)
        q = self._topology.queue(conn, ch, name)
        out: list[dict[str, Any]] = []
        for e, left in self._consumers.admin_get(q, _int(args, "count", 1), ackmode):
            if not self._answering:
                continue  # the messages are output: only the asking member shows them
            body = e.msg.body if limit is None else e.msg.body[:limit]
            if encoding == "auto":
                try:
                    payload, kind = body.decode(), "string"
                except UnicodeDecodeError:
                    payload, kind = base64.b64encode(body).decode(), "base64"
            else:
                payload, kind = base64.b64encode(body).decode(), "base64"
            out.append(
                {
                    "payload_bytes": len(e.msg.body),
                    "redelivered": e.redelivered,
                    "exchange": e.msg.exchange,
                    "routing_key": e.msg.routing_key,
                    "message_count": left,
                    # RabbitMQ shows no properties as [] (an empty Erlang proplist).
                    "properties": _properties_json(e.msg.header) or [],
                    "payload": payload,
                    "payload_encoding": kind,
                }
            )
        return 200, out

    # ------------------------------------------------------------------ connections

    def close_connection(self, args: dict[str, Any], who: str) -> Answer:
        conn_id = _int(args, "conn", 0)
        conn = self._conns.connections.get(conn_id)
        if conn is None:
            raise not_found()
        reason = _str(args, "reason", "") or CLOSED_VIA_MANAGEMENT
        self._conns.close(conn.id, R.CONNECTION_FORCED, reason)
        return 204, None

    # ------------------------------------------------------------------ federation

    def put_parameter(self, args: dict[str, Any], who: str) -> Answer:
        """A runtime parameter: only ``federation-upstream`` is ours (RabbitMQ's shape:
        ``{"value": {...}}``)."""
        component, vhost, name = _str(args, "component"), _str(args, "vhost"), _name(args, "name")
        if component != UPSTREAM:
            raise bad_request(f"unknown component {component!r}: only {UPSTREAM} is supported")
        if vhost not in self._topology.vhosts:
            raise AdminError(404, "not_found", "vhost_not_found")
        upstream = upstream_from_value(vhost, name, args.get("value"))
        if isinstance(upstream, str):
            raise bad_request(f"Validation failed\n\n{upstream}\n")
        return (201 if self._federation.put(upstream) else 204), None

    def delete_parameter(self, args: dict[str, Any], who: str) -> Answer:
        if _str(args, "component") != UPSTREAM:
            raise not_found()
        if not self._federation.delete(_str(args, "vhost"), _str(args, "name")):
            raise not_found()
        return 204, None

    def federation_status(self, args: dict[str, Any], who: str) -> Answer:
        """A link's runner reports a change of its state (runtime/federation.py): only a
        member does (the secret holder's identity), never an HTTP caller."""
        if who != TRUSTED:
            raise AdminError(401, "not_authorised", "Access refused.")
        key = (_str(args, "vhost"), _str(args, "exchange"), _str(args, "upstream"))
        state = args.get("state")
        if not isinstance(state, dict):
            raise bad_request("state must be a JSON object")
        self._federation.report(key, state)
        return 204, None

    def forward(self, e: Forward) -> None:
        """Messages a federation link brought in: published into the local exchange, each
        as the management API's publish is (routed, enqueued, dispatched; no confirm of its
        own: the answer is the link's confirm). A header that does not parse is dropped, not
        trusted: the answer counts what was routed."""
        vh = self._topology.vhosts.get(e.vhost)
        ex = None if vh is None else vh.exchanges.get(e.exchange)
        status: int = 404
        routed = 0
        if vh is not None and ex is not None:
            status = 200
            publish = self._delivery.publish_admin
            for rk, header, body in e.messages:
                try:
                    parse_content_header(header)
                except ValueError:
                    continue
                if publish(vh, ex, rk, header, body):
                    routed += 1
        self._out.effect(AdminReply(e.member, e.ticket, status, {"routed": routed}))
        self._out.admin_answered(e.member != self.local_member)

    # ------------------------------------------------------------------ definitions

    def import_definitions(self, args: dict[str, Any], who: str) -> Answer:
        """RabbitMQ's definitions (``POST /api/definitions``), in its order: users, vhosts,
        permissions, policies, queues, exchanges, bindings. Each item goes through the op a
        request for it alone would; the first that fails ends the import with its answer,
        what came before it staying (as in RabbitMQ)."""
        defs = _table(args, "definitions")
        only = args.get("vhost")
        if only is not None and not isinstance(only, str):
            raise bad_request("vhost must be a string")

        def items(key: str) -> list[dict[str, Any]]:
            v = defs.get(key) or []
            if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
                raise bad_request(f"{key} must be a list of JSON objects")
            if only is None:
                return v
            return [dict(x, vhost=only) for x in v if key not in ("users", "vhosts")]

        steps: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = [
            ("users", lambda u: {**u, "tags": u.get("tags", "")}),
            ("vhosts", lambda v: {"name": v.get("name")}),
            ("permissions", lambda p: p),
            ("parameters", lambda p: p),
            ("policies", lambda p: p),
            ("queues", lambda q: q),
            ("exchanges", lambda x: x),
            ("bindings", _binding_item),
        ]
        ops = {
            "users": self.put_user,
            "vhosts": self.put_vhost,
            "permissions": self.put_permissions,
            "parameters": self.put_parameter,
            "policies": self.put_policy,
            "queues": self.put_queue,
            "exchanges": self.put_exchange,
            "bindings": self.bind,
        }
        vhosts = self._topology.vhosts
        for key, shape in steps:
            for item in items(key):
                if key == "exchanges" and _predeclared(item):
                    continue  # RabbitMQ's export leaves them out; a hand-written one may not
                if key == "parameters" and item.get("component") != UPSTREAM:
                    continue  # vhost limits and other parameters: not ours (operations.md)
                vh = vhosts.get(item.get("vhost", ""))
                if vh is not None and (
                    (key == "queues" and item.get("name") in vh.queues)
                    or (key == "exchanges" and item.get("name") in vh.exchanges)
                ):
                    continue  # RabbitMQ keeps what exists, as it is
                if key == "bindings" and (
                    vh is None
                    or item.get("source") not in vh.exchanges
                    or item.get("destination")
                    not in (vh.queues if item.get("destination_type") == "queue" else vh.exchanges)
                ):
                    continue  # RabbitMQ skips a binding whose ends are not there
                try:
                    ops[key](shape(item), who)
                except AdminError as e:
                    raise bad_request(f"{key} {_label(item)}: {e.body['reason']}") from None
                except AMQPError as e:
                    raise bad_request(f"{key} {_label(item)}: {e.reply_text}") from None
        return 204, None


def _limit(limits: dict[str, Any], key: str) -> int | None:
    v = limits.get(key)
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and v < 0):
        return None  # RabbitMQ's -1: no limit
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"limit {key} must be an integer")
    return v


def validate_pattern(pattern: str) -> str:
    try:
        compile_pattern(pattern)
    except ValueError as e:
        return f"{pattern!r} is not a valid regular expression: {e}"
    return ""


def _predeclared(item: dict[str, Any]) -> bool:
    name = item.get("name")
    return (
        name == ""
        or any(name == n for n, _ in PREDECLARED)
        or name
        in (
            FAILOVER_EXCHANGE,
            PEER_EXCHANGE,
        )
    )


def _label(item: dict[str, Any]) -> str:
    name = item.get("name", item.get("destination", item.get("user", "")))
    return f"'{name}'" + (f" in vhost '{item['vhost']}'" if "vhost" in item else "")


def _binding_item(b: dict[str, Any]) -> dict[str, Any]:
    """A binding as definitions write it (``destination_type`` queue / exchange), as the
    bind op takes it."""
    kind = b.get("destination_type")
    return {
        **b,
        "destination_type": "q" if kind == "queue" else "e" if kind == "exchange" else kind,
    }


# The properties the management API takes, with the pamqp names they are set by.
_PROPERTY_NAMES = {
    "content_type": "content_type",
    "content_encoding": "content_encoding",
    "headers": "headers",
    "delivery_mode": "delivery_mode",
    "priority": "priority",
    "correlation_id": "correlation_id",
    "reply_to": "reply_to",
    "expiration": "expiration",
    "message_id": "message_id",
    "timestamp": "timestamp",
    "type": "message_type",
    "user_id": "user_id",
    "app_id": "app_id",
    "cluster_id": "cluster_id",
}


def _content_header(props: dict[str, Any], size: int) -> bytes:
    """The content header of a message published through the API, encoded by pamqp (once,
    on every replica alike: its encoding is a pure function of the properties)."""
    kw: dict[str, Any] = {}
    for key, value in props.items():
        name = _PROPERTY_NAMES.get(key)
        if name is not None:  # RabbitMQ ignores a property it does not know
            kw[name] = value
    exp = kw.get("expiration")
    if exp is not None and (not isinstance(exp, str) or not exp.isdigit() or not exp.isascii()):
        raise bad_request(f"invalid expiration {exp!r}")
    try:
        raw = bytes(pheader.ContentHeader(0, size, commands.Basic.Properties(**kw)).marshal())
        # Through our own check too: what a client could not publish, the API cannot.
        parse_content_header(raw)
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise bad_request(f"invalid message properties: {e}") from None
    return raw


def _properties_json(header: bytes) -> dict[str, Any]:
    """A message's properties as RabbitMQ's get answers them (only those set)."""
    try:
        h = pheader.ContentHeader()
        h.unmarshal(header)
    except (ValueError, TypeError, IndexError):
        return {}
    out: dict[str, Any] = {}
    for key, name in _PROPERTY_NAMES.items():
        v = getattr(h.properties, name, None)
        if v is None or (key == "cluster_id" and v == ""):  # pamqp's default for an unset one
            continue
        if key == "timestamp" and hasattr(v, "timestamp"):
            v = int(v.timestamp())
        out[key] = json_value(v)
    return out

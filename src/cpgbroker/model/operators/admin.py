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
its errors map to RabbitMQ's HTTP answers (``adminargs.amqp_answer``). Those ops live in
``adminops.py`` (:class:`ResourceOps`), the argument checks and answers in ``adminargs.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cpgbroker.errors import AMQPError, ReplyCode
from cpgbroker.model.access import auth
from cpgbroker.model.access.permissions import TRUSTED, Permissions
from cpgbroker.model.access.users import Users
from cpgbroker.model.clients.connection import ConnectionProtocol
from cpgbroker.model.config import Permission, Policy, User
from cpgbroker.model.events import AdminCommand, AdminReply, Forward
from cpgbroker.model.federation import (
    UPSTREAM,
    Federation,
    push_queue_name,
    upstream_from_value,
)
from cpgbroker.model.messages.consumers import Consumers
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.operators.adminargs import (
    AdminError,
    Answer,
    amqp_answer,
    bad_request,
    limit_arg,
    name_arg,
    not_found,
    table_arg,
    tags_arg,
    text_arg,
    validate_pattern,
)
from cpgbroker.model.operators.adminops import ResourceOps
from cpgbroker.model.output import Output
from cpgbroker.model.routing.policies import Policies, escaped_term, validate
from cpgbroker.model.routing.topology import FAILOVER_EXCHANGE, PEER_EXCHANGE, PREDECLARED, Topology
from cpgbroker.model.versions import (
    EXACT_FIELD_TABLES,
    NEWEST,
    OLDEST,
    ModelVersion,
    supports,
)
from cpgbroker.wire.fastpath import parse_content_header

R = ReplyCode

# The operator's ``cluster upgrade-finish``: the runtime decides, before the model applies it,
# whether every member can follow (runtime/member/member.py).
RAISE_MODEL_VERSION = "raise_model_version"


class Admin:
    """Applies :class:`AdminCommand` events. Owns nothing but the op table: the state it
    changes is the users', the policies' and the topology's."""

    def __init__(
        self,
        users: Users,
        permissions: Permissions,
        policies: Policies,
        topology: Topology,
        conns: ConnectionProtocol,
        delivery: Delivery,
        consumers: Consumers,
        out: Output,
        federation: Federation,
        version: ModelVersion,
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
        self._version = version
        # The replica's own member id (0 standalone): an answer to another member's operator
        # is a confirm that waits for this member's progress report (``Output.confirmed``).
        # Not replicated.
        self.local_member = 0
        # Queues, exchanges, bindings, messages, connections: their own component.
        self.resources = res = ResourceOps(
            permissions, topology, conns, delivery, consumers, version
        )
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
            "put_queue": res.put_queue,
            "delete_queue": res.delete_queue,
            "purge_queue": res.purge_queue,
            "get": res.get,
            "put_exchange": res.put_exchange,
            "delete_exchange": res.delete_exchange,
            "bind": res.bind,
            "unbind": res.unbind,
            "publish": res.publish,
            "close_connection": res.close_connection,
            "import_definitions": self.import_definitions,
            "put_parameter": self.put_parameter,
            "delete_parameter": self.delete_parameter,
            "federation_status": self.federation_status,
            "federation_pushed": self.federation_pushed,
            RAISE_MODEL_VERSION: self.raise_model_version,
        }

    def apply(self, e: AdminCommand) -> None:
        self.resources.answering = e.member == self.local_member
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

    # ------------------------------------------------------------------ model version

    def raise_model_version(self, args: dict[str, Any], who: str) -> Answer:
        """The cluster moves up to model ``version`` at this event (model/versions.py): the
        operator's ``cpgbroker cluster upgrade-finish``. A member of a cluster has decided
        before this event whether every member applies that version, and says why not in
        ``refused`` (cluster/membership.py ``refuse_version``); alike on every member, so
        every replica answers the same and switches, or not, at this same event."""
        version = args.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise bad_request("version must be an integer")
        refused = args.get("refused")
        if isinstance(refused, str):
            return 409, {"error": "conflict", "reason": refused}
        if not supports(version):
            raise bad_request(
                f"this software applies model versions {OLDEST} to {NEWEST}, not {version}"
            )
        before = self._version.current
        if version < before:
            return 409, {
                "error": "conflict",
                "reason": f"the cluster runs model version {before}: model versions only move up",
            }
        self._version.adopt(version)
        return 200, {"model_version": version, "was": before}

    # ------------------------------------------------------------------ users

    def put_user(self, args: dict[str, Any], who: str) -> Answer:
        name = name_arg(args, "name")
        if not name:
            raise bad_request("user name must not be empty")
        if "tags" not in args:
            raise bad_request("tags_not_present")
        algorithm = text_arg(args, "hashing_algorithm", auth.DEFAULT_ALGORITHM)
        password_hash = text_arg(args, "password_hash", "")
        if password_hash and not auth.valid_hash(password_hash, algorithm):
            raise AdminError(400, "bad_request", f"not_base64: {password_hash}"[:200])
        limits = table_arg(args, "limits")
        old = self._users.by_name.get(name)
        user = User(
            name,
            "",
            vhosts=(),
            tags=tags_arg(args.get("tags", "")),
            password_hash=password_hash,
            hashing_algorithm=algorithm if password_hash else auth.DEFAULT_ALGORITHM,
            # An update keeps what the user may do where (RabbitMQ's put_user does), and where
            # it may log in from (RabbitMQ's loopback_users is configuration, not the user).
            permissions=() if old is None else old.grants(),
            loopback_only=False if old is None else old.loopback_only,
            max_connections=limit_arg(limits, "max-connections"),
            max_channels=limit_arg(limits, "max-channels"),
        )
        return (201 if self._users.put(user) else 204), None

    def delete_user(self, args: dict[str, Any], who: str) -> Answer:
        if not self._users.delete(text_arg(args, "name")):
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
        name = name_arg(args, "name")
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
        name = text_arg(args, "name")
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
        user, vhost = text_arg(args, "user"), text_arg(args, "vhost")
        if vhost not in self._topology.vhosts or user not in self._users.by_name:
            raise bad_request("vhost_or_user_not_found")
        return user, vhost

    def put_permissions(self, args: dict[str, Any], who: str) -> Answer:
        missing = [k for k in ("configure", "write", "read") if k not in args]
        if missing:
            raise bad_request("[" + ",".join(f"{{key_missing,{k}}}" for k in missing) + "]")
        user, vhost = self._user_and_vhost(args)
        perm = Permission(
            vhost, text_arg(args, "configure"), text_arg(args, "write"), text_arg(args, "read")
        )
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
        vhost = text_arg(args, "vhost")
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
            name_arg(args, "name"),
            text_arg(args, "pattern"),
            text_arg(args, "apply-to", "all"),
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
        vhost = text_arg(args, "vhost")
        if not self._policies.delete(vhost, text_arg(args, "name")):
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

    # ------------------------------------------------------------------ federation

    def put_parameter(self, args: dict[str, Any], who: str) -> Answer:
        """A runtime parameter: only ``federation-upstream`` is ours (RabbitMQ's shape:
        ``{"value": {...}}``)."""
        component, vhost, name = (
            text_arg(args, "component"),
            text_arg(args, "vhost"),
            name_arg(args, "name"),
        )
        if component != UPSTREAM:
            raise bad_request(f"unknown component {component!r}: only {UPSTREAM} is supported")
        if vhost not in self._topology.vhosts:
            raise AdminError(404, "not_found", "vhost_not_found")
        upstream = upstream_from_value(vhost, name, args.get("value"))
        if isinstance(upstream, str):
            raise bad_request(f"Validation failed\n\n{upstream}\n")
        return (201 if self._federation.put(upstream) else 204), None

    def delete_parameter(self, args: dict[str, Any], who: str) -> Answer:
        if text_arg(args, "component") != UPSTREAM:
            raise not_found()
        if not self._federation.delete(text_arg(args, "vhost"), text_arg(args, "name")):
            raise not_found()
        return 204, None

    def federation_status(self, args: dict[str, Any], who: str) -> Answer:
        """A link's runner reports a change of its state (runtime/federation/links.py)."""
        _member_only(who)
        key = (text_arg(args, "vhost"), text_arg(args, "exchange"), text_arg(args, "upstream"))
        state = args.get("state")
        if not isinstance(state, dict):
            raise bad_request("state must be a JSON object")
        self._federation.report(key, state)
        return 204, None

    def federation_pushed(self, args: dict[str, Any], who: str) -> Answer:
        """A pushing link's upstream confirmed the messages at the head of its push queue up
        to message ``upto``: they leave it (runtime/federation/links.py)."""
        _member_only(who)
        vhost, exchange = text_arg(args, "vhost"), text_arg(args, "exchange")
        upto = args.get("upto")
        if isinstance(upto, bool) or not isinstance(upto, int):
            raise bad_request("upto must be an integer")
        vh = self._topology.vhosts.get(vhost)
        q = (
            None
            if vh is None
            else vh.queues.get(push_queue_name(exchange, text_arg(args, "upstream")))
        )
        if q is None:
            raise not_found()
        return 200, {"removed": self._consumers.settle_head(q, upto)}

    def forward(self, e: Forward) -> None:
        """Messages a federation link brought in: published into the local exchange, each
        as the management API's publish is (routed, enqueued, dispatched; no confirm of its
        own: the answer is the link's confirm). A header that does not parse is dropped, not
        trusted: the answer counts what was routed."""
        vh = self._topology.vhosts.get(e.vhost)
        ex = None if vh is None else vh.exchanges.get(e.exchange)
        status: int = 404
        routed = duplicates = 0
        if vh is not None and ex is not None:
            status = 200
            publish = self._delivery.publish_admin
            exact = self._version.at_least(EXACT_FIELD_TABLES)
            seen = self._federation.seen((e.vhost, e.exchange, e.upstream))
            for rk, header, body, digest, redelivered in e.messages:
                if not seen.fresh(digest, redelivered):
                    duplicates += 1  # handed over already by a runner that died (or was cut)
                    continue
                try:
                    # From model version 8 every value the grammar allows (wire/fieldtable.py).
                    parse_content_header(header, roundtrip=not exact)
                except ValueError:
                    continue
                if publish(vh, ex, rk, header, body, local=False):
                    routed += 1
        answer = {"routed": routed, "duplicates": duplicates}
        self._out.effect(AdminReply(e.member, e.ticket, status, answer))
        self._out.admin_answered(e.member != self.local_member)

    # ------------------------------------------------------------------ definitions

    def import_definitions(self, args: dict[str, Any], who: str) -> Answer:
        """RabbitMQ's definitions (``POST /api/definitions``), in its order: users, vhosts,
        permissions, policies, queues, exchanges, bindings. Each item goes through the op a
        request for it alone would; the first that fails ends the import with its answer,
        what came before it staying (as in RabbitMQ)."""
        defs = table_arg(args, "definitions")
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
            "queues": self.resources.put_queue,
            "exchanges": self.resources.put_exchange,
            "bindings": self.resources.bind,
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


def _member_only(who: str) -> None:
    """Federation runners' own commands: only a member sends them (the secret holder's
    identity), never an HTTP caller."""
    if who != TRUSTED:
        raise AdminError(401, "not_authorised", "Access refused.")

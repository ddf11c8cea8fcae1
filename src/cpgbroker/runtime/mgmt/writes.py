"""RabbitMQ's management HTTP API, the write side: ``PUT``, ``POST`` and ``DELETE`` under
``/api`` turned into the operators' changes the model applies in the event order
(model/operators/admin.py), and their answers into RabbitMQ's HTTP answers.

Theory of operation
-------------------
A write is never applied here: :func:`command_for` checks who may ask (RabbitMQ's tag rules:
users, vhosts, permissions and definitions are an administrator's, policies a policymaker's,
the rest any management user's, whose vhost permissions the model then applies), reads the
path and the JSON body, hashes a password with a salt drawn here (passwords never enter the
event stream), and names the op and its arguments. The member multicasts them as an
``AdminCommand``; every member applies it at the same point of the order; the asking member's
answer comes back as ``AdminReply`` (runtime/admin/admindesk.py), which :func:`response_for` shapes:
RabbitMQ answers a successful write with an empty body (201 Created or 204 No Content), a bind
with a ``Location`` header, a publish and a get with JSON.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from typing import Any

import attrs

from cpgbroker.model import RAISE_MODEL_VERSION, TRUSTED, auth
from cpgbroker.model import entities as E
from cpgbroker.runtime.mgmt.reads import SECRET_HOLDER, Answer, flag_version
from cpgbroker.runtime.mgmt.views import ADMIN_TAGS, ClusterView, Identity, connection_name

POLICY_TAGS = ("administrator", "policymaker")
# Why ``PUT /api/cluster-name`` is refused.
CLUSTER_NAME_FIXED = (
    "the cluster name comes from the configuration ([cluster] name in cpgbroker.toml, the same "
    "on every member; a standalone broker's is its node name) and cannot be changed through "
    "the API"
)
# Definitions larger than this travel as several commands (each one CPG event): a batch of
# client events is at most 512 KiB, and one command should fit one.
IMPORT_CHUNK_BYTES = 256 * 1024


@attrs.frozen
class Command:
    """An op for the model (model/operators/admin.py) and its arguments, in order."""

    op: str
    args: dict[str, Any]
    # Who the model acts as: the user's name, or TRUSTED for the secret holder.
    user: str


def _bad(reason: str) -> Answer:
    return Answer(400, {"error": "bad_request", "reason": reason})


def _not_authorised(reason: str) -> Answer:
    return Answer(401, {"error": "not_authorised", "reason": reason})


def _not_found() -> Answer:
    return Answer(404, {"error": "Object Not Found", "reason": "Not Found"})


def _body(raw: bytes, not_json: str = "not_json") -> dict[str, Any] | Answer:
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return _bad(not_json)
    return value if isinstance(value, dict) else _bad(not_json)


def _flag(query: dict[str, list[str]], key: str) -> bool:
    return query.get(key, ["false"])[-1] == "true"


def hashed_user(body: dict[str, Any]) -> dict[str, Any] | Answer:
    """A user's body with a plain ``password`` replaced by its salted hash (RabbitMQ's
    format; the salt drawn here, so that the password itself is never multicast)."""
    if "password" in body and "password_hash" in body:
        return _bad("both_password_and_password_hash_are_provided")
    if "password" not in body:
        return body
    password = body["password"]
    if not isinstance(password, str):
        return _bad("password must be a string")
    out = {k: v for k, v in body.items() if k != "password"}
    out["password_hash"] = (
        auth.hash_password(password, os.urandom(auth.SALT_BYTES)) if password else ""
    )
    out["hashing_algorithm"] = auth.DEFAULT_ALGORITHM
    return out


def _who(identity: Identity) -> str:
    return TRUSTED if identity.name == SECRET_HOLDER else identity.name


def command_for(
    method: str,
    parts: list[str],
    raw: bytes,
    query: str,
    headers: dict[str, str],
    identity: Identity,
    view: ClusterView,
) -> Command | list[Command] | Answer:
    """The change a write request asks for, or the answer it gets at once (refused, not
    found, malformed). ``parts``: the path under /api, decoded segment by segment."""
    if not parts:
        return _not_found()
    head, rest = parts[0], parts[1:]
    who = _who(identity)
    q = urllib.parse.parse_qs(query)
    admin = identity.any_of(ADMIN_TAGS)
    not_admin = _not_authorised("Not administrator user")
    body = _body(raw, "failed_to_parse_json" if head == "definitions" else "not_json")
    if isinstance(body, Answer):
        return body

    if head == "users":
        if not admin:
            return not_admin
        if method == "POST" and rest == ["bulk-delete"]:
            return Command("delete_users", {"users": body.get("users")}, who)
        if len(rest) != 1:
            return _not_found()
        if method == "PUT":
            user = hashed_user(body)
            if isinstance(user, Answer):
                return user
            return Command("put_user", {**user, "name": rest[0]}, who)
        if method == "DELETE":
            return Command("delete_user", {"name": rest[0]}, who)
    elif head == "vhosts" and len(rest) == 1:
        if not admin:
            return not_admin
        if method == "PUT":
            return Command("put_vhost", {"name": rest[0]}, who)
        if method == "DELETE":
            return Command("delete_vhost", {"name": rest[0]}, who)
    elif head == "feature-flags" and len(rest) == 2 and rest[1] == "enable" and method == "PUT":
        # RabbitMQ's way to turn on a feature once every node runs the new release: ours are
        # the model versions (model/versions.py), enabled in order.
        if not admin:
            return not_admin
        version = flag_version(rest[0])
        if version is None:
            return _not_found()
        return Command(RAISE_MODEL_VERSION, {"version": version}, who)
    elif head == "permissions" and len(rest) == 2:
        if not admin:
            return not_admin
        target = {"vhost": rest[0], "user": rest[1]}
        if method == "PUT":
            return Command("put_permissions", {**body, **target}, who)
        if method == "DELETE":
            return Command("delete_permissions", target, who)
    elif head == "policies" and len(rest) == 2:
        if not identity.any_of(POLICY_TAGS):
            return _not_authorised("Not policymaker user")
        target = {"vhost": rest[0], "name": rest[1]}
        if method == "PUT":
            return Command("put_policy", {**body, **target}, who)
        if method == "DELETE":
            return Command("delete_policy", target, who)
    elif head == "parameters" and len(rest) == 3:
        if not identity.any_of(POLICY_TAGS):
            return _not_authorised("Not policymaker user")
        target = {"component": rest[0], "vhost": rest[1], "name": rest[2]}
        if method == "PUT":
            return Command("put_parameter", {**body, **target}, who)
        if method == "DELETE":
            return Command("delete_parameter", target, who)
    elif head == "queues" and len(rest) in (2, 3):
        target = {"vhost": rest[0], "name": rest[1]}
        if len(rest) == 2 and method == "PUT":
            return Command("put_queue", {**body, **target}, who)
        if len(rest) == 2 and method == "DELETE":
            return Command(
                "delete_queue",
                {**target, "if_unused": _flag(q, "if-unused"), "if_empty": _flag(q, "if-empty")},
                who,
            )
        if rest[2:] == ["contents"] and method == "DELETE":
            return Command("purge_queue", target, who)
        if rest[2:] == ["get"] and method == "POST":
            return Command("get", {**body, **target}, who)
    elif head == "exchanges" and len(rest) in (2, 3):
        name = "" if rest[1] == "amq.default" else rest[1]
        target = {"vhost": rest[0], "name": name}
        if len(rest) == 2 and method == "PUT":
            return Command("put_exchange", {**body, **target}, who)
        if len(rest) == 2 and method == "DELETE":
            return Command("delete_exchange", {**target, "if_unused": _flag(q, "if-unused")}, who)
        if rest[2:] == ["publish"] and method == "POST":
            return Command("publish", {**body, **target}, who)
    elif head == "bindings" and len(rest) in (5, 6) and rest[1] == "e" and rest[3] in "qe":
        source = "" if rest[2] == "amq.default" else rest[2]
        target = {
            "vhost": rest[0],
            "source": source,
            "destination_type": rest[3],
            "destination": rest[4],
        }
        if len(rest) == 5 and method == "POST":
            return Command("bind", {**body, **target}, who)
        if len(rest) == 6 and method == "DELETE":
            return Command("unbind", {**target, "properties_key": rest[5]}, who)
    elif head == "connections" and len(rest) == 1 and method == "DELETE":
        return _close_connection(rest[0], headers, identity, view, who)
    elif head == "definitions" and method == "POST" and len(rest) <= 1:
        if not admin:
            return not_admin
        return import_commands(body, rest[0] if rest else None, who)
    elif head == "cluster-name" and not rest:
        # RabbitMQ renames its cluster at runtime. Ours is the configuration's, which every
        # member must share (compared when one joins): a name set here would be forgotten at
        # the next start, and a member started afterwards would answer the file's.
        if not admin:
            return not_admin
        return Answer(405, {"error": "Method Not Allowed", "reason": CLUSTER_NAME_FIXED})
    else:
        return _not_found()
    return Answer(405, {"error": "Method Not Allowed", "reason": f"{method} {'/'.join(parts)}"})


def _close_connection(
    name: str, headers: dict[str, str], identity: Identity, view: ClusterView, who: str
) -> Command | Answer:
    """RabbitMQ: an administrator may close any connection, a user their own; the reason is
    the ``X-Reason`` header's."""
    b = view.broker
    found: E.Connection | None = None
    if b is not None:
        found = next((c for c in b.connections.values() if connection_name(c) == name), None)
    if found is None:
        return _not_found()
    if not identity.any_of(ADMIN_TAGS) and found.user != identity.name:
        return _not_authorised("Not administrator user")
    reason = urllib.parse.unquote(headers.get("x-reason", ""))
    return Command("close_connection", {"conn": found.id, "reason": reason}, who)


def import_commands(
    definitions: dict[str, Any], vhost: str | None, who: str
) -> list[Command] | Answer:
    """``POST /api/definitions[/{vhost}]``: the import as one command, or as several in
    order when it is large (module constants); passwords hashed first."""
    users = definitions.get("users") or []
    if not isinstance(users, list):
        return _bad("users must be a list")
    hashed = []
    for u in users:
        if not isinstance(u, dict):
            return _bad("users must be a list of JSON objects")
        if "tags" not in u:
            return _bad("tags_not_present")
        h = hashed_user(u)
        if isinstance(h, Answer):
            return h
        hashed.append(h)
    defs = {**definitions, "users": hashed}
    base: dict[str, Any] = {} if vhost is None else {"vhost": vhost}
    if len(json.dumps(defs)) <= IMPORT_CHUNK_BYTES:
        return [Command("import_definitions", {**base, "definitions": defs}, who)]
    out: list[Command] = []
    chunk: dict[str, list[Any]] = {}
    size = 0
    keys = ("users", "vhosts", "permissions", "parameters", "policies", "queues", "exchanges")
    for key in (*keys, "bindings"):
        items = defs.get(key) or []
        if not isinstance(items, list):
            return _bad(f"{key} must be a list")
        for item in items:
            n = len(json.dumps(item))
            if size + n > IMPORT_CHUNK_BYTES and size:
                out.append(Command("import_definitions", {**base, "definitions": chunk}, who))
                chunk, size = {}, 0
            chunk.setdefault(key, []).append(item)
            size += n
    if chunk or not out:
        out.append(Command("import_definitions", {**base, "definitions": chunk}, who))
    return out


def not_imported(definitions: dict[str, Any]) -> dict[str, int]:
    """What of RabbitMQ's definitions an import leaves out (docs/operations.md): how many
    topic permissions, runtime parameters other than federation upstreams, global
    parameters; for the member to say so in its log (RabbitMQ answers the import 204)."""
    counts = {
        "topic_permissions": len(definitions.get("topic_permissions") or []),
        "parameters": sum(
            1
            for p in definitions.get("parameters") or []
            if not isinstance(p, dict) or p.get("component") != "federation-upstream"
        ),
        "global_parameters": len(definitions.get("global_parameters") or []),
    }
    return {k: n for k, n in counts.items() if n}


@attrs.frozen
class Shaped:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


def response_for(command: Command, status: int, body: Any) -> Shaped:
    """The HTTP answer to a write, from the model's :class:`AdminReply`: RabbitMQ answers a
    successful write with an empty body; a bind with where the binding is (``Location``:
    the destination and the binding's properties key, escaped once more, relative)."""
    headers: tuple[tuple[str, str], ...] = ()
    if command.op == RAISE_MODEL_VERSION and status == 200:
        return Shaped(204, b"", headers)  # as RabbitMQ's feature flag enable
    if command.op == "bind" and status == 201 and isinstance(body, dict):
        where = "/".join(
            urllib.parse.quote(str(x), safe="")
            for x in (command.args["destination"], body["properties_key"])
        )
        headers = (("Location", where),)
        body = None
    if body is None:
        return Shaped(status, b"", headers)
    return Shaped(status, json.dumps(body).encode(), headers)

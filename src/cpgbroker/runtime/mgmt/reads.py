"""RabbitMQ's management HTTP API, the read side: ``GET /api/...`` answered from this member's
replica of the model, with RabbitMQ's paths, JSON shapes, status codes and login rules.

Theory of operation
-------------------
Every member holds the whole broker (every connection, channel, queue and message of the
cluster), so any member answers for the whole cluster, as any RabbitMQ node does. Three parts,
each a pure function of what it is given:

* :func:`authenticate` decides who a request is from (HTTP Basic with a broker user, or the
  member's admin secret as a Bearer token) and how far it may see, with RabbitMQ's tag rules
  (``rabbit_web_dispatch_access_control``): any of ``administrator``, ``monitoring``,
  ``policymaker``, ``management`` may log in; monitoring (and administrator) see every vhost,
  connection and node; users, permissions and ``/metrics`` need what RabbitMQ asks for them.
* the ``*_json`` functions (runtime/mgmt/views.py) turn model entities into RabbitMQ 3.10's
  JSON objects, leaving out the fields we cannot know (rates, Erlang process details,
  wall-clock times) rather than inventing them;
* :class:`ManagementApi` routes a method and path to them and shapes the answer (200 with
  JSON, 404 ``Object Not Found``, 401 ``not_authorised``).

It reads the model only between events (the trio task that runs it is the one applying them),
and never changes it: nothing here is replicated.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from cpgbroker.model import NEWEST, OLDEST, UPSTREAM, VERSION_CHANGES, User, VHost, auth
from cpgbroker.model import entities as E
from cpgbroker.runtime.mgmt.views import (
    ADMIN_TAGS,
    MGMT_TAGS,
    MONITOR_TAGS,
    ClusterView,
    Identity,
    bindings_json,
    channel_json,
    connection_json,
    definitions_json,
    exchange_json,
    federation_links_json,
    node_json,
    overview_json,
    parameter_json,
    permissions_json,
    policy_json,
    queue_json,
    user_json,
    vhost_json,
    visible_connections,
    visible_vhosts,
)

# RabbitMQ's realm (rabbit_mgmt.hrl AUTH_REALM): clients and browsers show it.
AUTH_REALM = 'Basic realm="RabbitMQ Management"'
NOT_FOUND = {"error": "Object Not Found", "reason": "Not Found"}
# What a Bearer caller is: the holder of the member's admin secret (operators, the CLI).
SECRET_HOLDER = "(admin secret)"


@attrs.frozen
class Refusal:
    """A request that may not proceed: the HTTP status, RabbitMQ's body, the header a 401
    for missing or wrong credentials carries, and what the member logs (never a password)."""

    status: int
    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...]
    user: str
    why: str


def _not_authorised(user: str, reason: str) -> Refusal:
    # Authenticated but not allowed: RabbitMQ's not_authorised (British spelling), no realm.
    return Refusal(401, {"error": "not_authorised", "reason": reason}, (), user, reason)


def _not_authenticated(user: str, why: str) -> Refusal:
    # RabbitMQ's answer to missing or wrong credentials: not_authorized / "Not_Authorized"
    # (American spelling there), with the realm so that browsers and tools ask for a login.
    return Refusal(
        401,
        {"error": "not_authorized", "reason": "Not_Authorized"},
        (("WWW-Authenticate", AUTH_REALM),),
        user,
        why,
    )


def authenticate(
    authorization: str,
    users: Iterable[User],
    secret: str,
    loopback: bool,
    need: tuple[str, ...] = MGMT_TAGS,
) -> Identity | Refusal:
    """Who sent ``authorization`` (the header's value), and whether they carry one of the
    tags ``need`` (RabbitMQ's rule for the resource)."""
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer" and credentials:
        if secret and hmac.compare_digest(credentials.encode(errors="replace"), secret.encode()):
            return Identity(SECRET_HOLDER, ("administrator",))
        return _not_authenticated("-", "wrong admin secret")
    if scheme.lower() != "basic" or not credentials:
        return _not_authenticated("-", "no credentials")
    try:
        name, sep, password = base64.b64decode(credentials, validate=True).decode().partition(":")
    except (binascii.Error, ValueError):
        return _not_authenticated("-", "malformed Basic credentials")
    user = next((u for u in users if u.name == name), None)
    if not sep or user is None or not auth.password_ok(user, password):
        return _not_authenticated(name, "wrong user name or password")
    if user.loopback_only and not loopback:
        return _not_authorised(name, "User can only log in via localhost")
    if not any(t in user.tags for t in MGMT_TAGS):
        return _not_authorised(name, "Not management user")
    if not any(t in user.tags for t in need):
        reason = "Not administrator user" if need == ADMIN_TAGS else "Not monitor user"
        return _not_authorised(name, reason)
    return Identity(name, user.tags, user)


# ---------------------------------------------------------------------------------------------
# Lists: RabbitMQ's order, its name filter and its pagination (rabbit_mgmt_util reply_list /
# reply_list_or_paginate)

# The lists RabbitMQ sorts and pages.
LISTED = ("queues", "exchanges", "connections", "channels", "vhosts", "bindings", "users", "nodes")
# RabbitMQ's page size when none is asked for, and the largest it allows.
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 500


def _query_value(query: dict[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    return values[-1] if values else None


def list_answer(items: list[dict[str, Any]], query: dict[str, list[str]]) -> Answer:
    """Sorted as RabbitMQ sorts (``sort`` or by vhost and name), filtered by ``name`` (a
    case-insensitive substring, or with ``use_regex=true`` a regular expression), and, when
    ``page`` is given, one page in RabbitMQ's envelope."""
    key = _query_value(query, "sort")
    reverse = _query_value(query, "sort_reverse") == "true"
    columns = [key] if key else ["vhost", "name"]
    items = sorted(items, key=lambda x: [str(x.get(c, "")) for c in columns], reverse=reverse)
    total = len(items)
    name = _query_value(query, "name")
    if name:
        if _query_value(query, "use_regex") == "true":
            try:
                pattern = re.compile(name)
            except re.error:
                return Answer(400, {"error": "bad_request", "reason": f"invalid regex {name!r}"})
            items = [x for x in items if pattern.search(str(x.get("name", "")))]
        else:
            items = [x for x in items if name.lower() in str(x.get("name", "")).lower()]
    page_text = _query_value(query, "page")
    if page_text is None:
        return Answer(200, items)
    size_text = _query_value(query, "page_size") or str(DEFAULT_PAGE_SIZE)
    if not page_text.isdigit() or not size_text.isdigit():
        return Answer(400, {"error": "bad_request", "reason": "Pagination parameters are invalid"})
    page, size = int(page_text), int(size_text)
    if page < 1 or not 1 <= size <= MAX_PAGE_SIZE:
        return Answer(400, {"error": "bad_request", "reason": "Pagination parameters are invalid"})
    pages = max(1, -(-len(items) // size))
    if page > pages:
        return Answer(400, {"error": "bad_request", "reason": "Page out of range"})
    chosen = items[(page - 1) * size : page * size]
    return Answer(
        200,
        {
            "filtered_count": len(items),
            "item_count": len(chosen),
            "items": chosen,
            "page": page,
            "page_count": pages,
            "page_size": size,
            "total_count": total,
        },
    )


# ---------------------------------------------------------------------------------------------
# Routing


@attrs.frozen
class Answer:
    status: int
    body: Any


def _not_found() -> Answer:
    return Answer(404, NOT_FOUND)


# A model version as a feature flag's name (``PUT /api/feature-flags/model_version_8/enable``).
FLAG_PREFIX = "model_version_"


def flag_version(name: str) -> int | None:
    """The model version a feature flag names, if this software applies it."""
    if not name.startswith(FLAG_PREFIX) or not name[len(FLAG_PREFIX) :].isdigit():
        return None
    version = int(name[len(FLAG_PREFIX) :])
    return version if OLDEST < version <= NEWEST else None


def needed_tags(parts: list[str]) -> tuple[str, ...]:
    """The tags a path needs beyond a management tag (the ``is_authorized_*`` RabbitMQ's
    handler for the resource uses): users and permissions are an administrator's, nodes a
    monitor's; the rest any management user's, filtered to what that user may see."""
    admin_only = (["users"], ["permissions"], ["definitions"], ["feature-flags"])
    if parts[:1] in admin_only or parts[2:3] == ["permissions"]:
        return ADMIN_TAGS
    if parts[:1] == ["nodes"]:
        return MONITOR_TAGS
    if parts[:1] in (["policies"], ["parameters"]):
        return ("administrator", "policymaker")
    return MGMT_TAGS


def split_path(path: str) -> list[str] | None:
    """``/api/queues/%2F/q%201`` -> ["queues", "/", "q 1"]: split first, then decode, so an
    escaped "/" stays in its segment. None if not under /api."""
    if path != "/api" and not path.startswith("/api/"):
        return None
    return [urllib.parse.unquote(p) for p in path[len("/api/") :].split("/") if p != ""]


class ManagementApi:
    """GET /api/... from a :class:`ClusterView` (stateless: a class for its route table)."""

    def get(
        self, parts: list[str], view: ClusterView, identity: Identity, query: str = ""
    ) -> Answer:
        if not parts:
            return _not_found()
        head, rest = parts[0], parts[1:]
        handler = self._routes.get(head)
        if handler is None:
            return _not_found()
        answer = handler(self, rest, view, identity)
        if answer.status != 200 or not isinstance(answer.body, list) or head not in LISTED:
            return answer
        return list_answer(answer.body, urllib.parse.parse_qs(query))

    # Each route: (the path after its first segment, view, identity) -> Answer.

    def _overview(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        if rest:
            return _not_found()
        return Answer(200, overview_json(view, identity))

    def _feature_flags(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        """RabbitMQ's ``GET /api/feature-flags``: ours are the model versions past the oldest,
        one flag each, ``enabled`` once the cluster runs at it, ``disabled`` while every member
        applies it (``PUT .../enable`` or ``cpgbroker cluster upgrade-finish`` turns it on),
        ``unavailable`` while some member's release does not."""
        if rest:
            return _not_found()
        status = view.status
        current = status.get("model_version")
        upgrade = status.get("upgrade") or {}
        newest = upgrade.get("newest_all_apply", NEWEST)
        if not isinstance(current, int):
            return Answer(503, {"error": "unavailable", "reason": f"this member is {view.state}"})
        return Answer(
            200,
            [
                {
                    "name": f"{FLAG_PREFIX}{v}",
                    "desc": VERSION_CHANGES[v],
                    "doc_url": "",
                    "stability": "stable",
                    "provided_by": "cpgbroker",
                    "state": "enabled"
                    if current >= v
                    else "disabled"
                    if newest >= v
                    else "unavailable",
                }
                for v in range(OLDEST + 1, NEWEST + 1)
            ],
        )

    def _whoami(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        return Answer(200, {"name": identity.name, "tags": list(identity.tags)})

    def _nodes(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        nodes = [node_json(m, view) for m in view.members]
        if not rest:
            return Answer(200, nodes)
        found = [n for n in nodes if n["name"] == rest[0]]
        return Answer(200, found[0]) if len(rest) == 1 and found else _not_found()

    def _vhost_items(
        self,
        rest: list[str],
        view: ClusterView,
        identity: Identity,
        items: Callable[[VHost], list[dict[str, Any]]],
    ) -> Answer:
        """A per-vhost collection: all of them, one vhost's (``/{vhost}``) or one item
        (``/{vhost}/{name}``)."""
        b = view.broker
        if b is None:
            return Answer(200, []) if not rest else _not_found()
        vhs = visible_vhosts(b, identity)
        if not rest:
            return Answer(200, [x for vh in vhs for x in items(vh)])
        vh = next((v for v in vhs if v.name == rest[0]), None)
        if vh is None or len(rest) > 2:
            return _not_found()
        listed = items(vh)
        if len(rest) == 1:
            return Answer(200, listed)
        name = "" if rest[1] == "amq.default" else rest[1]
        found = [x for x in listed if x["name"] == name]
        return Answer(200, found[0]) if found else _not_found()

    def _exchanges(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is not None and len(rest) == 4 and rest[2] == "bindings":
            # /api/exchanges/{vhost}/{name}/bindings/source|destination
            name = "" if rest[1] == "amq.default" else rest[1]
            vh = next((v for v in visible_vhosts(b, identity) if v.name == rest[0]), None)
            if vh is None or name not in vh.exchanges or rest[3] not in ("source", "destination"):
                return _not_found()
            side = rest[3]
            return Answer(
                200,
                [
                    x
                    for x in bindings_json(vh)
                    if (x["source"] if side == "source" else x["destination"]) == name
                    and (side == "source" or x["destination_type"] == "exchange")
                ],
            )
        return self._vhost_items(
            rest, view, identity, lambda vh: [exchange_json(x) for x in vh.exchanges.values()]
        )

    def _queues(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is not None and len(rest) == 3 and rest[2] == "bindings":
            vh = next((v for v in visible_vhosts(b, identity) if v.name == rest[0]), None)
            if vh is None or rest[1] not in vh.queues:
                return _not_found()
            return Answer(
                200,
                [
                    x
                    for x in bindings_json(vh)
                    if x["destination"] == rest[1] and x["destination_type"] == "queue"
                ],
            )
        if b is not None and len(rest) == 2:
            vh = next((v for v in visible_vhosts(b, identity) if v.name == rest[0]), None)
            q = None if vh is None else vh.queues.get(rest[1])
            if q is None:
                return _not_found()
            return Answer(200, queue_json(q, view.node, True, b.policies))
        return self._vhost_items(
            rest, view, identity, lambda vh: [queue_json(q, view.node) for q in vh.queues.values()]
        )

    def _bindings(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is not None and len(rest) in (5, 6) and rest[1] == "e" and rest[3] in ("q", "e"):
            # /api/bindings/{vhost}/e/{source}/q|e/{destination}[/{properties_key}]
            vh = next((v for v in visible_vhosts(b, identity) if v.name == rest[0]), None)
            if vh is None:
                return _not_found()
            kind = "queue" if rest[3] == "q" else "exchange"
            source = "" if rest[2] == "amq.default" else rest[2]
            found = [
                x
                for x in bindings_json(vh)
                if x["source"] == source
                and x["destination"] == rest[4]
                and x["destination_type"] == kind
            ]
            if len(rest) == 5:
                return Answer(200, found)
            one = [x for x in found if x["properties_key"] == rest[5]]
            return Answer(200, one[0]) if one else _not_found()
        if b is None or len(rest) > 1:
            return Answer(200, []) if b is None and not rest else _not_found()
        vhs = visible_vhosts(b, identity)
        if rest:
            vhs = [v for v in vhs if v.name == rest[0]]
            if not vhs:
                return _not_found()
        return Answer(200, [x for vh in vhs for x in bindings_json(vh)])

    def _vhosts(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is None:
            return Answer(200, []) if not rest else _not_found()
        vhs = [vhost_json(vh, view) for vh in visible_vhosts(b, identity)]
        if not rest:
            return Answer(200, vhs)
        found = [v for v in vhs if v["name"] == rest[0]]
        if not found:
            return _not_found()
        if len(rest) == 1:
            return Answer(200, found[0])
        if rest[1:] == ["permissions"]:
            return Answer(200, permissions_json(b.users.by_name.values(), [rest[0]]))
        return _not_found()

    def _connections(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        conns = [] if b is None else visible_connections(b, identity)
        shaped = [connection_json(c, view.member_name(c.member)) for c in conns]
        if not rest:
            return Answer(200, shaped)
        found = [c for c in shaped if c["name"] == rest[0]]
        if len(rest) == 1 and found:
            return Answer(200, found[0])
        if len(rest) == 2 and found and rest[1] == "channels":
            chans = self._channel_list(conns, view)
            return Answer(200, [c for c in chans if c["connection_details"]["name"] == rest[0]])
        return _not_found()

    def _channel_list(self, conns: list[E.Connection], view: ClusterView) -> list[dict[str, Any]]:
        return [
            channel_json(c, ch, view.member_name(c.member))
            for c in conns
            for ch in c.channels.values()
        ]

    def _channels(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        chans = [] if b is None else self._channel_list(visible_connections(b, identity), view)
        if not rest:
            return Answer(200, chans)
        found = [c for c in chans if c["name"] == rest[0]]
        return Answer(200, found[0]) if len(rest) == 1 and found else _not_found()

    def _users(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        users = () if b is None else list(b.users.by_name.values())
        if not rest:
            return Answer(200, [user_json(u) for u in users])
        user = next((u for u in users if u.name == rest[0]), None)
        if user is None or len(rest) > 2:
            return _not_found()
        if len(rest) == 1:
            return Answer(200, user_json(user))
        if rest[1] == "permissions" and b is not None:
            return Answer(200, permissions_json([user], b.vhosts))
        return _not_found()

    def _permissions(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is None:
            return Answer(200, []) if not rest else _not_found()
        perms = permissions_json(b.users.by_name.values(), b.vhosts)
        if not rest:
            return Answer(200, perms)
        if len(rest) == 2:
            found = [p for p in perms if p["vhost"] == rest[0] and p["user"] == rest[1]]
            if found:
                return Answer(200, found[0])
        return _not_found()

    def _policies(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is None:
            return Answer(200, []) if not rest else _not_found()
        shown = [
            policy_json(p)
            for p in b.policies.all()
            if p.vhost in (v.name for v in visible_vhosts(b, identity))
        ]
        if not rest:
            return Answer(200, shown)
        if rest[0] not in b.vhosts or len(rest) > 2:
            return _not_found()
        shown = [p for p in shown if p["vhost"] == rest[0]]
        if len(rest) == 1:
            return Answer(200, shown)
        found = [p for p in shown if p["name"] == rest[1]]
        return Answer(200, found[0]) if found else _not_found()

    def _parameters(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is None or not rest or rest[0] != UPSTREAM or len(rest) > 3:
            return Answer(200, []) if b is None and not rest else _not_found()
        shown = [parameter_json(u) for u in b.federation.all()]
        if len(rest) >= 2:
            if rest[1] not in b.vhosts:
                return _not_found()
            shown = [p for p in shown if p["vhost"] == rest[1]]
        if len(rest) == 3:
            found = [p for p in shown if p["name"] == rest[2]]
            return Answer(200, found[0]) if found else _not_found()
        return Answer(200, shown)

    def _federation_links(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is None:
            return Answer(200, [])
        links = federation_links_json(b, view)
        if rest:
            links = [x for x in links if x["vhost"] == rest[0]]
        return Answer(200, links)

    def _aliveness(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        # RabbitMQ declares aliveness-test in the vhost and publishes and gets a message; a
        # read-only API cannot (a declare is a replicated event), so: the vhost exists and
        # this member serves clients.
        b = view.broker
        if len(rest) != 1 or b is None or rest[0] not in b.vhosts:
            return _not_found()
        if not view.serving:
            return Answer(503, {"status": "failed", "reason": f"this member is {view.state}"})
        return Answer(200, {"status": "ok"})

    def _definitions(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is None or rest:
            return _not_found()
        return Answer(200, definitions_json(b))

    def _cluster_name(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        if rest:
            return _not_found()
        # The configuration's: PUT is refused (runtime/mgmt/writes.py).
        return Answer(200, {"name": view.cluster})

    def _healthchecks_node(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        # RabbitMQ 3.10's older health check (``/api/healthchecks/node[/{node}]``): 200 either
        # way, with the reason in the body when the node is not well.
        if not rest or rest[0] != "node" or len(rest) > 2:
            return _not_found()
        if len(rest) == 2 and rest[1] not in (m.name for m in view.members):
            return _not_found()
        if len(rest) == 2 and rest[1] != view.node:
            member = next(m for m in view.members if m.name == rest[1])
            ok = member.state == "ready"
            reason = f"member {member.name} is {member.state}"
        else:
            ok, reason = view.serving, f"this member is {view.state}"
        return Answer(200, {"status": "ok"} if ok else {"status": "failed", "reason": reason})

    def _health(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        if len(rest) < 2 or rest[0] != "checks":
            return _not_found()
        check = rest[1]
        if check in ("alarms", "local-alarms"):
            return health_alarms(view, local=check == "local-alarms")
        if check == "node-is-quorum-critical":
            return quorum_critical(view)
        if check in ("virtual-hosts", "node-is-mirror-sync-critical"):
            # Every vhost runs on every member that serves; there are no mirrors to sync.
            return Answer(200, {"status": "ok"}) if view.serving else _failed(view)
        return _not_found()

    _routes: dict[str, Callable[[ManagementApi, list[str], ClusterView, Identity], Answer]] = {
        "overview": _overview,
        "feature-flags": _feature_flags,
        "whoami": _whoami,
        "nodes": _nodes,
        "exchanges": _exchanges,
        "queues": _queues,
        "bindings": _bindings,
        "vhosts": _vhosts,
        "connections": _connections,
        "channels": _channels,
        "users": _users,
        "permissions": _permissions,
        "policies": _policies,
        "parameters": _parameters,
        "federation-links": _federation_links,
        "aliveness-test": _aliveness,
        "cluster-name": _cluster_name,
        "definitions": _definitions,
        "healthchecks": _healthchecks_node,
        "health": _health,
    }


def _failed(view: ClusterView) -> Answer:
    return Answer(503, {"status": "failed", "reason": f"this member is {view.state}"})


def health_alarms(view: ClusterView, local: bool) -> Answer:
    """RabbitMQ's ``check_alarms`` (and ``check_local_alarms``): 200 ``{"status": "ok"}``, or
    503 with the alarms. The memory mark is one for the whole cluster (it counts replicated
    queue contents), so every member shows it; a disk alarm is the member's whose disk is low."""
    b = view.broker
    if b is None:
        return _failed(view)
    me = next((m.id for m in view.members if m.name == view.node), None)
    alarms = []
    if b.mark.memory_blocked:
        alarms.append({"node": view.node, "resource": "memory"})
    for member in b.mark.disk_alarms:
        if not local or member == me:
            alarms.append({"node": view.member_name(member), "resource": "disk"})
    if not alarms:
        return Answer(200, {"status": "ok"})
    where = "on the node" if local else "in the cluster"
    return Answer(
        503,
        {"status": "failed", "reason": f"There are alarms in effect {where}", "alarms": alarms},
    )


def quorum_critical(view: ClusterView) -> Answer:
    """RabbitMQ's ``check_if_node_is_quorum_critical``: would stopping this member leave the
    cluster without a majority? Every queue lives on every member, so it is the cluster's
    quorum, not a queue's, that is at stake."""
    quorum = view.status.get("quorum") or {}
    needed = quorum.get("quorum")
    ready = sum(1 for m in view.members if m.state == "ready")
    if view.state == "standalone" or not isinstance(needed, int) or needed <= 0:
        return Answer(200, {"status": "ok"})
    if view.state == "ready" and ready - 1 < needed:
        return Answer(
            503,
            {
                "status": "failed",
                "reason": "The cluster would lose its quorum if this member is shut down "
                f"({ready} members ready, {needed} needed)",
                "queues": [],
            },
        )
    return Answer(200, {"status": "ok"})

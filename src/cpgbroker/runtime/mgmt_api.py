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
* the ``*_json`` functions turn model entities into RabbitMQ 3.10's JSON objects, leaving out
  the fields we cannot know (rates, Erlang process details, wall-clock times) rather than
  inventing them;
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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from cpgbroker.model import auth
from cpgbroker.model import entities as E
from cpgbroker.model.adminargs import json_value, properties_key
from cpgbroker.model.broker import Broker
from cpgbroker.model.config import Policy, User
from cpgbroker.model.exchange import Exchange
from cpgbroker.model.federation import UPSTREAM, Upstream
from cpgbroker.model.policies import Policies
from cpgbroker.model.topology import VHost
from cpgbroker.model.users import hashed

# RabbitMQ's realm (rabbit_mgmt.hrl AUTH_REALM): clients and browsers show it.
AUTH_REALM = 'Basic realm="RabbitMQ Management"'
# RabbitMQ's tag sets (rabbit_web_dispatch_access_control: is_mgmt_user, is_monitor, is_admin).
MGMT_TAGS = ("administrator", "monitoring", "policymaker", "management")
MONITOR_TAGS = ("administrator", "monitoring")
ADMIN_TAGS = ("administrator",)
# The API's version of RabbitMQ whose shapes we follow, for tools that check it.
MANAGEMENT_VERSION = "3.10.8"
NOT_FOUND = {"error": "Object Not Found", "reason": "Not Found"}
# What a Bearer caller is: the holder of the member's admin secret (operators, the CLI).
SECRET_HOLDER = "(admin secret)"


@attrs.frozen
class Identity:
    """Who a request is from: a broker user's name and tags, or the secret's holder (who may
    do everything an administrator may)."""

    name: str
    tags: tuple[str, ...]
    user: User | None = None

    def any_of(self, tags: Iterable[str]) -> bool:
        return any(t in self.tags for t in tags)


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
# The cluster as one member sees it


@attrs.frozen
class MemberView:
    id: int
    name: str
    url: str
    state: str


@attrs.frozen
class ClusterView:
    """What the API reads: this member's replica (None while it has none to show), its node
    name, and the members it knows of."""

    broker: Broker | None
    node: str
    members: tuple[MemberView, ...]
    # This member's state name (``ready``, ``standalone``, ``updating``, ...).
    state: str
    status: dict[str, Any]

    @property
    def serving(self) -> bool:
        return self.broker is not None and self.state in ("ready", "standalone")

    def member_name(self, member: int) -> str:
        for m in self.members:
            if m.id == member:
                return m.name
        return self.node


def node_name(url: str, fallback: str) -> str:
    """A member's node name, as RabbitMQ's ``rabbit@host``: its client address names it
    (member ids change at every restart; the address does not)."""
    netloc = urllib.parse.urlsplit(url).netloc if url else ""
    return f"cpgbroker@{netloc.rpartition('@')[2] or fallback}"


def cluster_view(status: dict[str, Any], broker: Broker | None, host: str) -> ClusterView:
    """The view from a member's status (``cpgbroker status``'s JSON, without the digest)."""
    state = str(status.get("state"))
    me = node_name(str(status.get("url") or ""), host)
    members = tuple(
        MemberView(
            int(m["member"]),
            node_name(str(m.get("url") or ""), host),
            str(m.get("url")),
            str(m["status"]),
        )
        for m in status.get("members") or ()
    )
    if not members:
        members = (
            MemberView(int(status.get("member") or 0), me, str(status.get("url") or ""), state),
        )
    return ClusterView(broker, me, members, state, status)


# ---------------------------------------------------------------------------------------------
# JSON shapes (RabbitMQ 3.10)


# RabbitMQ's JSON of field-table values: the model's (its admin answers shape them alike).
jsonable = json_value


def _peer(peer: str) -> tuple[str, int | None]:
    host, _, port = peer.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else None


def connection_name(c: E.Connection) -> str:
    # RabbitMQ's "peer -> us"; we do not keep the address the client reached.
    return c.peer or f"connection {c.id}"


def connection_json(c: E.Connection, node: str) -> dict[str, Any]:
    host, port = _peer(c.peer)
    return {
        "name": connection_name(c),
        "node": node,
        "type": "network",
        "protocol": "AMQP 0-9-1",
        "state": "running"
        if c.state == E.OPEN
        else ("closing" if c.state >= E.CLOSING else "starting"),
        "user": c.user,
        "vhost": c.vhost,
        "peer_host": host,
        "peer_port": port,
        "ssl": c.tls,
        "channels": len(c.channels),
        "channel_max": c.channel_max,
        "frame_max": c.frame_max,
        "timeout": c.heartbeat,
        "client_properties": jsonable(c.client_properties),
        "auth_mechanism": "EXTERNAL" if c.cert_user and c.user == c.cert_user else "PLAIN",
    }


def channel_json(c: E.Connection, ch: E.Channel, node: str) -> dict[str, Any]:
    host, port = _peer(c.peer)
    name = connection_name(c)
    return {
        "name": f"{name} ({ch.id})",
        "number": ch.id,
        "node": node,
        "user": c.user,
        "vhost": c.vhost,
        "connection_details": {"name": name, "peer_host": host, "peer_port": port},
        "state": "running" if ch.flow_active else "flow",
        "prefetch_count": ch.prefetch_count,
        "global_prefetch_count": ch.global_prefetch,
        "confirm": ch.confirm,
        "transactional": ch.tx,
        "consumer_count": len(ch.consumers),
        "messages_unacknowledged": len(ch.unacked),
        "messages_unconfirmed": max(0, ch.publish_seq - ch.confirm_sent) if ch.confirm else 0,
    }


def exchange_json(x: Exchange) -> dict[str, Any]:
    return {
        "name": x.name,
        "vhost": x.vhost,
        "type": x.type,
        "durable": x.durable,
        "auto_delete": x.auto_delete,
        "internal": x.internal,
        "arguments": jsonable(x.arguments),
        "user_who_performed_action": "",
    }


def queue_json(
    q: E.Queue, node: str, detail: bool = False, policies: Policies | None = None
) -> dict[str, Any]:
    ready = len(q.messages)
    out: dict[str, Any] = {
        "name": q.name,
        "vhost": q.vhost,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner is not None,
        "arguments": jsonable(q.arguments),
        "node": node,
        "state": "running",
        "type": "quorum" if q.quorum else "classic",
        "messages": ready + q.unacked,
        "messages_ready": ready,
        "messages_unacknowledged": q.unacked,
        "message_bytes": q.ready_bytes,
        "consumers": len(q.consumers),
        "single_active_consumer_tag": (
            q.consumers[0].tag if q.single_active and q.consumers else None
        ),
        "policy": q.policy,
        # Counted by this replica since it has had the queue (RabbitMQ's message_stats; the
        # rates RabbitMQ adds need samples over time: /metrics, or the dashboard, has them).
        "message_stats": {"publish": q.published_total, "deliver_get": q.delivered_total},
    }
    if policies is not None and q.policy is not None:
        p = policies.by_vhost[q.vhost][q.policy]
        out["effective_policy_definition"] = p.definition
    if detail:
        out["consumer_details"] = [
            {
                "consumer_tag": c.tag,
                "exclusive": c.exclusive,
                "ack_required": not c.no_ack,
                "prefetch_count": c.prefetch,
                "arguments": jsonable(c.args),
                "queue": {"name": q.name, "vhost": q.vhost},
                "channel_details": {
                    "name": f"{connection_name(c.channel.conn)} ({c.channel.id})",
                    "number": c.channel.id,
                    "connection_name": connection_name(c.channel.conn),
                    "user": c.channel.conn.user,
                },
            }
            for c in q.consumers
        ]
    return out


def bindings_json(vh: VHost) -> Iterator[dict[str, Any]]:
    """A vhost's bindings in RabbitMQ's order: the default exchange's implicit binding of every
    queue first, then every exchange's bindings."""
    for q in vh.queues.values():
        yield {
            "source": "",
            "vhost": vh.name,
            "destination": q.name,
            "destination_type": "queue",
            "routing_key": q.name,
            "arguments": {},
            "properties_key": properties_key(q.name, {}),
        }
    for x in vh.exchanges.values():
        if not x.name:
            continue
        for b in x.bindings:
            dest = b.dest
            yield {
                "source": x.name,
                "vhost": vh.name,
                "destination": dest.name,
                "destination_type": "queue" if isinstance(dest, E.Queue) else "exchange",
                "routing_key": b.key,
                "arguments": jsonable(b.args),
                "properties_key": properties_key(b.key, b.args),
            }


def vhost_json(vh: VHost, view: ClusterView) -> dict[str, Any]:
    ready = sum(len(q.messages) for q in vh.queues.values())
    unacked = sum(q.unacked for q in vh.queues.values())
    return {
        "name": vh.name,
        "description": "",
        "tags": [],
        "metadata": {"description": "", "tags": []},
        "default_queue_type": "classic",
        "tracing": False,
        "messages": ready + unacked,
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
        "cluster_state": {
            m.name: "running" if m.state == "ready" else "stopped" for m in view.members
        }
        if view.state != "standalone"
        else {view.node: "running"},
    }


def shown_hash(user: User) -> tuple[str, str]:
    """(password_hash, hashing_algorithm) as RabbitMQ shows a user. The model holds every
    user with a hash (a configured plain password is hashed from the user's name,
    model/users.py); the configuration's users, shown before a member has a replica, alike."""
    u = hashed(user)
    return u.password_hash, u.hashing_algorithm


def user_json(user: User) -> dict[str, Any]:
    password_hash, algorithm = shown_hash(user)
    limits: dict[str, int] = {}
    if user.max_connections is not None:
        limits["max-connections"] = user.max_connections
    if user.max_channels is not None:
        limits["max-channels"] = user.max_channels
    return {
        "name": user.name,
        "password_hash": password_hash,
        "hashing_algorithm": algorithm,
        "tags": list(user.tags),
        "limits": limits,
    }


def permissions_json(users: Iterable[User], vhosts: Iterable[str]) -> list[dict[str, Any]]:
    known = set(vhosts)
    return [
        {
            "user": u.name,
            "vhost": p.vhost,
            "configure": p.configure,
            "write": p.write,
            "read": p.read,
        }
        for u in users
        for p in u.grants()
        if p.vhost in known
    ]


def parameter_json(u: Upstream) -> dict[str, Any]:
    """A federation upstream as RabbitMQ shows the runtime parameter."""
    return {"value": u.value(), "vhost": u.vhost, "component": UPSTREAM, "name": u.name}


def federation_links_json(b: Broker, view: ClusterView) -> list[dict[str, Any]]:
    """RabbitMQ's federation-management shape: one per link, with what its runner last
    reported (every member shows the same: the reports are replicated)."""
    out = []
    for link in b.federation.links(b.vhosts, b.policies.definition_of):
        state = b.federation.status.get(link.key, {})
        member = state.get("member")
        item = {
            "node": view.member_name(member) if isinstance(member, int) else "",
            "vhost": link.vhost,
            "exchange": link.exchange,
            "upstream_exchange": link.upstream_exchange,
            "type": "exchange",
            "upstream": link.upstream.name,
            "id": f"{link.vhost}/{link.exchange}/{link.upstream.name}",
            "status": state.get("status", "starting"),
            "uri": state.get("uri", ""),
            "local_connection": "",
        }
        for key in ("error", "forwarded", "upstream_queue_messages"):
            if key in state:
                item[key] = state[key]
        out.append(item)
    return out


def policy_json(p: Policy) -> dict[str, Any]:
    return {
        "vhost": p.vhost,
        "name": p.name,
        "pattern": p.pattern,
        "apply-to": p.apply_to,
        "definition": p.definition,
        "priority": p.priority,
    }


def node_json(m: MemberView, view: ClusterView) -> dict[str, Any]:
    b = view.broker
    out: dict[str, Any] = {
        "name": m.name,
        "type": "disc",
        "running": m.state in ("ready", "standalone"),
        "being_drained": False,
        # Ours: the CPG member id (new at every start) and its state (docs/operations.md).
        "cpgbroker_member": m.id,
        "cpgbroker_state": m.state,
        "cpgbroker_url": m.url,
    }
    if b is not None:
        out["mem_alarm"] = b.mark.memory_blocked
        out["disk_free_alarm"] = m.id in b.mark.disk_alarms
    return out


def overview_json(view: ClusterView, identity: Identity) -> dict[str, Any]:
    version = "" if view.broker is None else view.broker.config.version
    out: dict[str, Any] = {
        "management_version": MANAGEMENT_VERSION,
        "rabbitmq_version": version,
        "product_name": "cpgbroker",
        "product_version": version,
        "cluster_name": view.node,
        "node": view.node,
        "listeners": [],
        # The management listener (what a client of the API reads its node name from).
        "contexts": [{"node": view.node, "description": "RabbitMQ Management", "path": "/"}],
    }
    if identity.any_of(MONITOR_TAGS):
        # Ours (the dashboard reads it): the replication as the answering member sees it,
        # from its status; for those who may see the nodes (RabbitMQ's monitor tags).
        status = view.status
        out["cpgbroker_cluster"] = {
            key: status.get(key)
            for key in (
                "member",
                "state",
                "event_seq",
                "clock_master",
                # Each member's progress ("applied") and digest agreement at the last
                # checkpoint ("checkpoint_agreed"), as the answering member knows them.
                "members",
                "lag",
                "checkpoint",
                "error_checks",
                "update",
                "updating",
                "quorum",
            )
        }
    b = view.broker
    if b is None:
        return out
    if b.config.cluster_name:
        out["cluster_name"] = b.config.cluster_name
    vhs = _visible_vhosts(b, identity)
    queues = [q for vh in vhs for q in vh.queues.values()]
    ready = sum(len(q.messages) for q in queues)
    unacked = sum(q.unacked for q in queues)
    conns = _visible_connections(b, identity)
    out["object_totals"] = {
        "connections": len(conns),
        "channels": sum(len(c.channels) for c in conns),
        "consumers": sum(len(q.consumers) for q in queues),
        "exchanges": sum(len(vh.exchanges) for vh in vhs),
        "queues": len(queues),
    }
    out["queue_totals"] = {
        "messages": ready + unacked,
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
    }
    return out


def definitions_json(b: Broker) -> dict[str, Any]:
    """``GET /api/definitions``: RabbitMQ's export format (what ``rabbitmqctl
    export_definitions`` writes) of users, vhosts, permissions and the durable-or-not
    topology clients declared; not exclusive queues (they die with their connection), the
    default exchange, ``amq.*`` or the default exchange's implicit bindings, as RabbitMQ."""
    vhosts = list(b.vhosts.values())
    return {
        "rabbit_version": b.config.version,
        "rabbitmq_version": b.config.version,
        "product_name": "cpgbroker",
        "product_version": b.config.version,
        "users": [user_json(u) for u in b.users.by_name.values()],
        # RabbitMQ 3.10.8 exports a vhost as its name alone.
        "vhosts": [{"name": vh.name} for vh in vhosts],
        "permissions": permissions_json(b.users.by_name.values(), b.vhosts),
        "topic_permissions": [],
        "parameters": [parameter_json(u) for u in b.federation.all()],
        "global_parameters": [],
        "policies": [policy_json(p) for p in b.policies.all()],
        "queues": [
            {
                "name": q.name,
                "vhost": q.vhost,
                "durable": q.durable,
                "auto_delete": q.auto_delete,
                "arguments": jsonable(q.arguments),
            }
            for vh in vhosts
            for q in vh.queues.values()
            if q.exclusive_owner is None
        ],
        "exchanges": [
            {k: v for k, v in exchange_json(x).items() if k != "user_who_performed_action"}
            for vh in vhosts
            for x in vh.exchanges.values()
            if x.name and not x.name.startswith("amq.")
        ],
        "bindings": [
            {k: v for k, v in bd.items() if k != "properties_key"}
            for vh in vhosts
            for bd in bindings_json(vh)
            if bd["source"]
        ],
    }


# ---------------------------------------------------------------------------------------------
# Who sees what (RabbitMQ: monitoring sees everything; other management users their vhosts and
# their own connections)


def _visible_vhosts(b: Broker, identity: Identity) -> list[VHost]:
    if identity.any_of(MONITOR_TAGS) or identity.user is None:
        return list(b.vhosts.values())
    user = identity.user
    return [vh for vh in b.vhosts.values() if user.may_open(vh.name)]


def _visible_connections(b: Broker, identity: Identity) -> list[E.Connection]:
    conns = [c for c in b.connections.values() if c.state != E.CLOSED]
    if identity.any_of(MONITOR_TAGS):
        return conns
    return [c for c in conns if c.user == identity.name]


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


def needed_tags(parts: list[str]) -> tuple[str, ...]:
    """The tags a path needs beyond a management tag (the ``is_authorized_*`` RabbitMQ's
    handler for the resource uses): users and permissions are an administrator's, nodes a
    monitor's; the rest any management user's, filtered to what that user may see."""
    if parts[:1] in (["users"], ["permissions"], ["definitions"]) or parts[2:3] == ["permissions"]:
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
        vhs = _visible_vhosts(b, identity)
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
            vh = next((v for v in _visible_vhosts(b, identity) if v.name == rest[0]), None)
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
            vh = next((v for v in _visible_vhosts(b, identity) if v.name == rest[0]), None)
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
            vh = next((v for v in _visible_vhosts(b, identity) if v.name == rest[0]), None)
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
            vh = next((v for v in _visible_vhosts(b, identity) if v.name == rest[0]), None)
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
        vhs = _visible_vhosts(b, identity)
        if rest:
            vhs = [v for v in vhs if v.name == rest[0]]
            if not vhs:
                return _not_found()
        return Answer(200, [x for vh in vhs for x in bindings_json(vh)])

    def _vhosts(self, rest: list[str], view: ClusterView, identity: Identity) -> Answer:
        b = view.broker
        if b is None:
            return Answer(200, []) if not rest else _not_found()
        vhs = [vhost_json(vh, view) for vh in _visible_vhosts(b, identity)]
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
        conns = [] if b is None else _visible_connections(b, identity)
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
        chans = [] if b is None else self._channel_list(_visible_connections(b, identity), view)
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
            if p.vhost in (v.name for v in _visible_vhosts(b, identity))
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
        return Answer(200, {"name": overview_json(view, identity)["cluster_name"]})

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

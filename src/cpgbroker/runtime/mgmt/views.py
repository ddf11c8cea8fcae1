"""RabbitMQ 3.10's JSON shapes for the management API (runtime/mgmt/reads.py reads them out,
runtime/mgmt/writes.py and runtime/mgmt/metrics.py share them): who asks (:class:`Identity`),
the cluster as this member sees it (:class:`ClusterView`), and one ``*_json`` function per kind of
object, each a pure function of the model's entities that leaves out the fields we cannot know
(rates, Erlang process details, wall-clock times) rather than inventing them.

Owns nothing: it reads the model between events and never changes it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from cpgbroker.model import (
    UPSTREAM,
    Broker,
    Exchange,
    Policies,
    Policy,
    Upstream,
    User,
    VHost,
    json_value,
    properties_key,
)
from cpgbroker.model import entities as E
from cpgbroker.model import hashed_user as hashed

# RabbitMQ's tag sets (rabbit_web_dispatch_access_control: is_mgmt_user, is_monitor, is_admin).
MGMT_TAGS = ("administrator", "monitoring", "policymaker", "management")
MONITOR_TAGS = ("administrator", "monitoring")
ADMIN_TAGS = ("administrator",)
# The API's version of RabbitMQ whose shapes we follow, for tools that check it.
MANAGEMENT_VERSION = "3.10.8"


@attrs.frozen
class Identity:
    """Who a request is from: a broker user's name and tags, or the secret's holder (who may
    do everything an administrator may)."""

    name: str
    tags: tuple[str, ...]
    user: User | None = None

    def any_of(self, tags: Iterable[str]) -> bool:
        return any(t in self.tags for t in tags)


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
    # The cluster's name (RabbitMQ's cluster_name: ``[cluster] name``, by default the CPG
    # group), the same on every member, with or without a replica; "": this member's node name.
    cluster_name: str = ""

    @property
    def cluster(self) -> str:
        """What ``/api/cluster-name``, ``/api/overview`` and ``/metrics`` call the cluster."""
        return self.cluster_name or self.node

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


def cluster_view(
    status: dict[str, Any], broker: Broker | None, host: str, cluster_name: str = ""
) -> ClusterView:
    """The view from a member's status (``cpgbroker status``'s JSON, without the digest) and
    its configuration's cluster name."""
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
    return ClusterView(broker, me, members, state, status, cluster_name)


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
    model/access/users.py); the configuration's users, shown before a member has a replica,
    alike."""
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
        for key in (
            "error",
            "forwarded",
            "upstream_queue_messages",
            "pushed",
            "dropped_loops",
            "duplicates_dropped",
            "too_large",
        ):
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
        "cluster_name": view.cluster,
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
                # The release this member runs, the model version the cluster runs, and
                # where an upgrade stands (each member's release is in "members").
                "software",
                "model_version",
                "upgrade",
            )
        }
    b = view.broker
    if b is None:
        return out
    vhs = visible_vhosts(b, identity)
    queues = [q for vh in vhs for q in vh.queues.values()]
    ready = sum(len(q.messages) for q in queues)
    unacked = sum(q.unacked for q in queues)
    conns = visible_connections(b, identity)
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


def visible_vhosts(b: Broker, identity: Identity) -> list[VHost]:
    if identity.any_of(MONITOR_TAGS) or identity.user is None:
        return list(b.vhosts.values())
    user = identity.user
    return [vh for vh in b.vhosts.values() if user.may_open(vh.name)]


def visible_connections(b: Broker, identity: Identity) -> list[E.Connection]:
    conns = [c for c in b.connections.values() if c.state != E.CLOSED]
    if identity.any_of(MONITOR_TAGS):
        return conns
    return [c for c in conns if c.user == identity.name]

"""Federation between clusters: upstreams, which local exchanges they feed, and what the
members running the links report. Replicated state, as RabbitMQ's federation plugin keeps its
upstreams as runtime parameters and picks exchanges by policy.

Theory of operation
-------------------
An *upstream* (``PUT /api/parameters/federation-upstream/{vhost}/{name}``, or
``[[federation.upstreams]]`` in the configuration of a new cluster) names another cluster (a
list of AMQP URLs, tried in turn) and how to link to it. A policy on exchanges with
``federation-upstream`` (one upstream's name) or ``federation-upstream-set`` (``"all"``) makes
each exchange it matches *federated*: for every (exchange, upstream) pair there is a *link*.
The links are a pure function of this state and the topology (:meth:`Federation.links`), so
every member computes the same list in the same order; which member runs a link is decided
from the same replicated membership (runtime/federation/links.py).

A link's runner reports its state changes (connecting, running, error) through an ordered
admin command, so every member shows every link's status alike; messages a link brings in
arrive as :class:`~cpgbroker.model.events.Forward` events (model/operators/admin.py applies them).
The digests of each link's latest forwarded messages (:class:`Seen`) let every replica drop alike
the upstream's redelivery of a message a runner handed over and died before acknowledging.
Owns: the upstreams, by vhost and name, the links' reported states and their recent digests.
"""

from __future__ import annotations

from typing import Any

import attrs

UPSTREAM = "federation-upstream"
UPSTREAM_SET = "federation-upstream-set"
ACK_MODES = ("on-confirm", "on-publish", "no-ack")
# The header a federated message carries (RabbitMQ's): where it has been, newest last.
RECEIVED_FROM = "x-received-from"
# Where a cluster says its federation server id: server-properties to its clients, and
# client-properties of the links it opens to others.
SERVER_ID_PROPERTY = "cpgbroker_server_id"


@attrs.frozen
class Upstream:
    vhost: str
    name: str
    uris: tuple[str, ...]
    # The upstream exchange's name ("": the same as the federated exchange's).
    exchange: str = ""
    # How many clusters a message may cross (RabbitMQ's max-hops): 1 forwards only what was
    # published at the upstream itself.
    max_hops: int = 1
    # on-confirm: acknowledged upstream once every member here has it (nothing lost, and a
    # redelivery of what was handed over is recognised: Seen); on-publish: acknowledged once sent
    # on; no-ack: the upstream forgets it at once and keeps nothing for a link that is down
    # (fastest; a link failure loses what was on the way and what is published meanwhile:
    # the seed design's lossy link).
    ack_mode: str = "on-confirm"
    prefetch_count: int = 1000
    reconnect_delay_s: int = 5
    # The upstream queue's x-expires and x-message-ttl (ms; None: none): how long a link may
    # be down before the upstream stops buffering for it.
    expires: int | None = None
    message_ttl: int | None = None
    # Also send what is published here to the upstream (ours, not RabbitMQ's: its federation
    # only pulls): local publishes to a federated exchange wait in its push queue
    # (:func:`push_queue_name`) until the upstream confirmed them.
    push: bool = False

    def value(self) -> dict[str, Any]:
        """As RabbitMQ shows a federation-upstream parameter's value."""
        out: dict[str, Any] = {
            "uri": list(self.uris) if len(self.uris) != 1 else self.uris[0],
            "max-hops": self.max_hops,
            "ack-mode": self.ack_mode,
            "prefetch-count": self.prefetch_count,
            "reconnect-delay": self.reconnect_delay_s,
        }
        if self.exchange:
            out["exchange"] = self.exchange
        if self.expires is not None:
            out["expires"] = self.expires
        if self.message_ttl is not None:
            out["message-ttl"] = self.message_ttl
        if self.push:
            out["push"] = True
        return out


def upstream_from_value(vhost: str, name: str, value: Any) -> Upstream | str:
    """An upstream from RabbitMQ's parameter value, or what is wrong with it."""
    if not isinstance(value, dict):
        return "value must be a JSON object"
    uri = value.get("uri")
    uris = [uri] if isinstance(uri, str) else uri
    if not isinstance(uris, list) or not uris or not all(isinstance(u, str) for u in uris):
        return "uri must be a URI or a non-empty list of URIs"
    for u in uris:
        if not u.startswith(("amqp://", "amqps://")):
            return f"{u!r} is not an amqp:// or amqps:// URI"

    def count(key: str, default: int | None, minimum: int) -> int | None:
        v = value.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{key} must be an integer of at least {minimum}")
        return v

    try:
        max_hops = count("max-hops", 1, 1)
        prefetch = count("prefetch-count", 1000, 1)
        delay = count("reconnect-delay", 5, 0)
        expires = count("expires", None, 1)
        ttl = count("message-ttl", None, 0)
    except ValueError as e:
        return str(e)
    ack_mode = value.get("ack-mode", "on-confirm")
    if ack_mode not in ACK_MODES:
        return f"ack-mode must be one of {', '.join(ACK_MODES)}"
    exchange = value.get("exchange", "")
    if not isinstance(exchange, str):
        return "exchange must be a string"
    push = value.get("push", False)
    if not isinstance(push, bool):
        return "push must be true or false"
    assert max_hops is not None and prefetch is not None and delay is not None
    return Upstream(
        vhost,
        name,
        tuple(uris),
        exchange,
        max_hops,
        str(ack_mode),
        prefetch,
        delay,
        expires,
        ttl,
        push,
    )


@attrs.frozen
class Link:
    """One federated exchange fed by one upstream."""

    vhost: str
    exchange: str
    upstream: Upstream

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.vhost, self.exchange, self.upstream.name)

    @property
    def upstream_exchange(self) -> str:
        return self.upstream.exchange or self.exchange

    @property
    def push_queue(self) -> str:
        return push_queue_name(self.exchange, self.upstream.name)


def push_queue_name(exchange: str, upstream: str) -> str:
    """The local queue where a pushing link's messages wait for the upstream's confirm: an
    ordinary durable queue (replicated, stored, shown), declared by the link's runner."""
    return f"federation-push: {exchange} -> {upstream}"


# How many of a link's latest messages are remembered, to recognise the upstream's
# redeliveries of messages a runner handed over but did not acknowledge before it died (at
# most its prefetch count were in flight; the default prefetch is 1,000).
SEEN_WINDOW = 2000


class Seen:
    """The digests of a link's latest forwarded messages, oldest first (a dict as an
    ordered set: iteration and eviction follow insertion order on every replica)."""

    __slots__ = ("digests", "window")

    def __init__(self, window: int = SEEN_WINDOW) -> None:
        self.digests: dict[bytes, None] = {}
        self.window = window

    def fresh(self, digest: bytes, redelivered: bool) -> bool:
        """Whether to forward a message: not if the upstream redelivers one already forwarded
        (a first delivery is always new: two equal messages published upstream are two).
        Remembers it either way."""
        if redelivered and digest in self.digests:
            return False
        if digest:
            self.digests.pop(digest, None)
            self.digests[digest] = None
            if len(self.digests) > self.window:
                del self.digests[next(iter(self.digests))]
        return True


class Federation:
    __slots__ = ("recent", "status", "upstreams")

    def __init__(self, seed: tuple[Upstream, ...] = ()) -> None:
        # vhost -> name -> upstream, in the order they were first set.
        self.upstreams: dict[str, dict[str, Upstream]] = {}
        # (vhost, exchange, upstream) -> what the link's runner last reported.
        self.status: dict[tuple[str, str, str], dict[str, Any]] = {}
        # (vhost, exchange, upstream) -> the link's latest forwarded messages (replicated:
        # whichever member runs the link next must recognise the same redeliveries).
        self.recent: dict[tuple[str, str, str], Seen] = {}
        for u in seed:
            self.put(u)

    def put(self, u: Upstream) -> bool:
        ups = self.upstreams.setdefault(u.vhost, {})
        new = u.name not in ups
        ups[u.name] = u
        return new

    def delete(self, vhost: str, name: str) -> bool:
        ups = self.upstreams.get(vhost)
        if ups is None or ups.pop(name, None) is None:
            return False
        if not ups:
            del self.upstreams[vhost]
        for table in (self.status, self.recent):
            for key in [k for k in table if k[0] == vhost and k[2] == name]:
                del table[key]
        return True

    def forget_vhost(self, vhost: str) -> None:
        self.upstreams.pop(vhost, None)
        for table in (self.status, self.recent):
            for key in [k for k in table if k[0] == vhost]:
                del table[key]

    def all(self) -> list[Upstream]:
        return [u for ups in self.upstreams.values() for u in ups.values()]

    def restore(self, upstreams: list[Upstream], status: list[Any], recent: list[Any]) -> None:
        self.upstreams.clear()
        for u in upstreams:
            self.put(u)
        self.status = {(s[0], s[1], s[2]): s[3] for s in status}
        self.recent = {}
        for vhost, exchange, upstream, digests in recent:
            seen = self.seen((vhost, exchange, upstream))
            seen.digests = dict.fromkeys(digests)

    def links(self, vhosts: dict[str, Any], definition_of: Any) -> list[Link]:
        """Every link, in vhost, exchange and upstream order. ``definition_of(ex)``: the
        definition of the policy that applies to exchange ``ex`` (or {})."""
        out: list[Link] = []
        for vname, ups in self.upstreams.items():
            vh = vhosts.get(vname)
            if vh is None:
                continue
            for ex in vh.exchanges.values():
                if ex.policy is None:
                    continue
                for u in self._upstreams_for(ups, definition_of(ex)):
                    out.append(Link(vname, ex.name, u))
        return out

    @staticmethod
    def _upstreams_for(ups: dict[str, Upstream], definition: dict[str, Any]) -> list[Upstream]:
        one = definition.get(UPSTREAM)
        if isinstance(one, str):
            return [ups[one]] if one in ups else []
        if definition.get(UPSTREAM_SET) == "all":
            return list(ups.values())
        return []

    def push_queues(self, vh: Any, ex: Any, definition: dict[str, Any]) -> list[Any]:
        """The push queues of ``ex``'s pushing links that exist (routing adds them to a
        local publish's destinations: model/messages/delivery.py). ``definition``: the definition of
        the policy that applies to ``ex``."""
        ups = self.upstreams.get(vh.name)
        if not ups:
            return []
        out = []
        for u in self._upstreams_for(ups, definition):
            if u.push:
                q = vh.queues.get(push_queue_name(ex.name, u.name))
                if q is not None:
                    out.append(q)
        return out

    def report(self, key: tuple[str, str, str], state: dict[str, Any]) -> None:
        self.status[key] = state

    def member_left(self, member: int) -> None:
        """``member`` left the cluster: the links it ran are being taken over (no longer
        running) until their next runner reports."""
        for key, state in self.status.items():
            if state.get("member") == member and state.get("status") != "starting":
                self.status[key] = {**state, "status": "starting"}

    def seen(self, key: tuple[str, str, str]) -> Seen:
        s = self.recent.get(key)
        if s is None:
            s = self.recent[key] = Seen()
        return s

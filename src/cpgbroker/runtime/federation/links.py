"""Federation links: this member's share of the cluster's links to upstream clusters.

Theory of operation
-------------------
Which links exist is replicated state (model/federation.py): every member computes the same
list from the same upstreams, policies and exchanges. Each link is run by exactly one member,
chosen from the same replicated membership: the ready members sorted by id, the one at the
index the link's CRC-32 picks (:func:`owner`). Every member decides alike, so there is no
election: when the membership changes (a member dies, one joins), every member recomputes,
the new owner starts the link and the old one, if still there, stops it. A link follows the
seed design's exchange federation agent (and RabbitMQ's federation plugin):

1. it connects to the upstream cluster as an ordinary AMQP client
   (runtime/federation/client.py), trying its URLs in turn, and refuses to run when the
   upstream calls itself by this cluster's server id (the upstream refuses it too,
   model/clients/connection.py);
2. it declares the upstream exchange (same type) and a queue there, ``federation: <exchange>
   -> <server id>``, and binds the queue with the local exchange's bindings, *normalised*: one
   binding per distinct routing key (and arguments), however many local queues share it;
   it keeps them in step as local bindings come and go;
3. it consumes that queue and hands what arrives to the cluster as ``Forward`` events (in
   batches), each message's header extended with ``x-received-from`` (where it has been:
   a message that was here already, or has crossed ``max-hops`` clusters, is not forwarded:
   no loops between mutually federated clusters). From model version 8 (read from the broker
   the link serves) the header is the upstream's bytes with only ``x-received-from`` changed
   (:func:`with_hop_exact`, both ways); at version 7 pamqp decoded and wrote it again;
4. it acknowledges upstream as the upstream's ``ack-mode`` says: ``on-confirm`` once the
   cluster's answer says every member has the messages (and, with stores, wrote them): a
   link that dies loses nothing, the upstream redelivers what was not acknowledged, and the
   cluster drops a redelivery of what it has (each message carries its digest and the
   upstream's redelivered flag: model/federation.py); ``on-publish`` once handed over; ``no-ack``
   the upstream forgets at once, and its queue lives only while the link is connected, so
   what is published upstream while the link is down is lost (the seed's lossy link).

5. with ``push`` on the upstream it also sends local publishes upstream: they wait in the
   link's push queue here (model routing adds it to every local publish to the exchange), the
   runner publishes the queue's head to the upstream exchange with confirms and, once
   confirmed, removes it by an ordered command; a message that comes back down the link
   carries this cluster's name in ``x-received-from`` and is dropped as a loop.

Whatever ends a link (a cut, the upstream member gone, a refusal, a bug of ours) is reported
as its error and the link is tried again after its reconnect delay: a link never takes its
member down.

Its state (starting, running, error and why; messages forwarded; the upstream queue's depth)
is reported through an ordered admin command when it changes, so every member shows every
link alike (``/api/federation-links``, ``cpgbroker status``). A running link also announces
itself on the upstream's ``amq.peer`` fanout exchange (who, which link, its state), where the
upstream's operators can watch their peers, as the seed design's status exchange.

Owns: the links this member runs (one task each).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import ssl
import zlib
from collections.abc import Callable
from typing import Any

import trio
from pamqp import commands
from pamqp import header as pheader

from cpgbroker.errors import CpgBrokerError
from cpgbroker.model import (
    EXACT_FIELD_TABLES,
    PEER_EXCHANGE,
    RECEIVED_FROM,
    SERVER_ID_PROPERTY,
    TRUSTED,
    Broker,
    Link,
)
from cpgbroker.model.events import Forward
from cpgbroker.runtime.admin.admindesk import AdminDesk, Pending
from cpgbroker.runtime.config.tls import TlsConfig
from cpgbroker.runtime.federation.client import (
    AmqpClient,
    AmqpClientError,
    ChannelClosed,
    ConnectionClosed,
    Delivery,
)
from cpgbroker.wire.fastpath import FLAG_HEADERS, property_span, with_headers
from cpgbroker.wire.fieldtable import ARRAY, BOOL, TABLE, Field, Table, decode_table

log = logging.getLogger("cpgbroker.federation")

# How often a member looks again at which links it should run, and a running link at the
# local exchange's bindings (a change shows in the exchange's bind counter and size).
RECHECK = 0.5
# A Forward event carries at most this much (a CPG message may be 16 MiB, but large ones
# stall the ring for everyone), and the link waits at most this long to fill one.
BATCH_BYTES = 256 * 1024
BATCH_WAIT = 0.002
# A message larger than this is not forwarded: rejected upstream (dead-lettered there, if
# the upstream queue says where) and counted.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# How long the cluster may take to settle a batch before the link counts the upstream
# connection as stuck and starts over (the upstream then redelivers it).
SETTLE_TIMEOUT = 60.0
# How often a running link refreshes its reported counters, and announces itself upstream.
REPORT_EVERY = 5.0
ANNOUNCE_EVERY = 30.0
# A pushing link that found its push queue empty looks again when the member has applied more
# events (FederationLinks.applied), or after this long at the latest; and how many batches it
# may have sent and not yet seen confirmed and removed.
PUSH_RECHECK = 1.0
PUSH_BATCHES_IN_FLIGHT = 4
# How many forwarded batches may wait for the cluster's answer while the next ones go out.
FORWARD_BATCHES_IN_FLIGHT = 4


def client_context(tls: TlsConfig | None) -> ssl.SSLContext | None:
    """The TLS context links use towards amqps:// upstreams: the ``[tls]`` CA file as the
    trusted CAs and the member's own certificate as its client certificate (None without
    ``[tls]``: the system's CAs, no client certificate)."""
    if tls is None:
        return None
    context = ssl.create_default_context(cafile=tls.cacertfile or None)
    context.load_cert_chain(tls.certfile, tls.keyfile or None)
    return context


def message_digest(d: Delivery) -> bytes:
    """What names a message as the upstream sent it, for the cluster to recognise the
    upstream's redelivery of one a previous runner handed over already (model/federation.py):
    its routing key, the identifying properties a publisher sets, and its body."""
    h = hashlib.blake2b(digest_size=16)
    p = d.properties
    for part in (
        d.exchange,
        d.routing_key,
        "" if p is None else str(p.message_id or ""),
        "" if p is None else str(p.timestamp or ""),
        "" if p is None else str(p.correlation_id or ""),
    ):
        h.update(part.encode())
        h.update(b"\0")
    h.update(d.body)
    return h.digest()


def owner(link: Link, ready: list[int]) -> int | None:
    """The member that runs ``link``: every member computes the same from the same ready
    members (CRC-32: the same on every member, unlike ``hash``)."""
    if not ready:
        return None
    members = sorted(ready)
    key = f"{link.vhost}\0{link.exchange}\0{link.upstream.name}".encode()
    return members[zlib.crc32(key) % len(members)]


def queue_name(link: Link, server_id: str) -> str:
    """The upstream queue of ``link``: one per (exchange, downstream cluster, upstream), in
    the characters any AMQP client library accepts in a name (pamqp's are fewer than
    RabbitMQ's: no '>', no parentheses), so that the name means the same everywhere."""
    name = f"federation: {link.upstream_exchange} to {server_id} from {link.upstream.name}"
    return re.sub(r"[^a-zA-Z0-9\-_.:@#,/+ ]", "_", name)


def redacted(uri: str) -> str:
    """A URI without its password, for status and logs."""
    scheme, sep, rest = uri.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at:
        return uri
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}@{host}"


def travelled(props: commands.Basic.Properties) -> tuple[dict[str, Any], list[Any]]:
    """A message's headers (a copy) and where it has been (``x-received-from``, oldest first)."""
    headers = dict(props.headers or {})
    seen = headers.get(RECEIVED_FROM)
    return headers, list(seen) if isinstance(seen, list) else []


def been_at(seen: list[Any], cluster: str, max_hops: int) -> bool:
    """Whether a message that has been where ``seen`` says must not go to ``cluster``: it was
    there already, or it has crossed as many clusters as it may (a loop, or too far)."""
    names = [x.get("cluster-name") for x in seen if isinstance(x, dict)]
    return cluster in names or len(seen) >= max_hops


# From model version 8 (``EXACT_FIELD_TABLES``) a link carries a message's content header
# byte for byte, both ways: only ``x-received-from`` changes, through wire/fieldtable.py (at
# version 7 pamqp decoded every header and wrote them all again: floats cut to 32 bits, a long
# string that is not UTF-8 refused when pushing).


def travelled_exact(header: bytes) -> tuple[Table, list[Field]]:
    """A content header's headers table, kept byte for byte, and where the message has been
    (``x-received-from``'s entries, oldest first; none unless it is an array)."""
    flags = header[12] << 8 | header[13]
    if not flags & FLAG_HEADERS:
        return Table(), []
    start, end = property_span(header, FLAG_HEADERS)
    table = decode_table(header, start, end)[0]
    found = table.get(RECEIVED_FROM)
    seen = found.value if found is not None and found.kind == ARRAY else []
    assert isinstance(seen, list)
    return table, seen


def been_at_exact(seen: list[Field], cluster: str, max_hops: int) -> bool:
    """:func:`been_at` on ``x-received-from``'s entries as they are on the wire."""
    name = cluster.encode()
    for f in seen:
        if f.kind == TABLE:
            entry = f.value
            assert isinstance(entry, Table)
            there = entry.get("cluster-name")
            if there is not None and there.long_string() == name:
                return True
    return len(seen) >= max_hops


def with_hop_exact(header: bytes, table: Table, seen: list[Field], hop: dict[str, Any]) -> bytes:
    """``header`` with ``hop`` at the end of ``x-received-from`` (``table`` and ``seen``:
    what :func:`travelled_exact` read from it); every other byte as it was. The entry is
    written as pamqp wrote it at version 7: names in order, text ``S``, booleans ``t``."""
    entry = Table(
        (k, Field.of(BOOL, v) if isinstance(v, bool) else Field.longstr(str(v)))
        for k, v in sorted(hop.items())
    )
    table.set(RECEIVED_FROM, Field.array([*seen, Field.table(entry)]))
    return with_headers(header, table.encode())


def wanted_bindings(b: Broker, link: Link) -> dict[tuple[str, str], dict[str, Any]]:
    """The local exchange's bindings, normalised: one per distinct routing key and
    arguments (``repr`` of the arguments makes the key: equal tables give equal reprs)."""
    vh = b.vhosts.get(link.vhost)
    ex = None if vh is None else vh.exchanges.get(link.exchange)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    if ex is None:
        return out
    for bd in ex.bindings:
        key = "" if ex.type == "fanout" else bd.key
        args = dict(bd.args) if ex.type == "headers" else {}
        out.setdefault((key, repr(sorted(args.items()))), args)
    return out


class LinkState:
    """What a running link knows of itself (reported, and shown in this member's status)."""

    def __init__(self) -> None:
        self.status = "starting"
        self.uri = ""
        self.error = ""
        self.forwarded = 0
        self.dropped_loops = 0
        self.too_large = 0
        self.duplicates = 0
        self.upstream_queue_messages: int | None = None
        # A pushing link: local publishes sent upstream (and confirmed there).
        self.pushed = 0

    def as_dict(self, member: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": self.status,
            "member": member,
            "uri": self.uri,
            "forwarded": self.forwarded,
        }
        if self.error:
            out["error"] = self.error
        if self.upstream_queue_messages is not None:
            out["upstream_queue_messages"] = self.upstream_queue_messages
        if self.dropped_loops:
            out["dropped_loops"] = self.dropped_loops
        if self.too_large:
            out["too_large"] = self.too_large
        if self.duplicates:
            out["duplicates_dropped"] = self.duplicates
        if self.pushed:
            out["pushed"] = self.pushed
        return out


class FederationLinks:
    def __init__(
        self,
        member: int,
        server_id: str,
        name: str,
        desk: AdminDesk,
        replica: Callable[[], Broker],
        ready: Callable[[], list[int]],
        serving: Callable[[], bool],
        ssl_context: ssl.SSLContext | None = None,
        cluster_name: str = "",
    ) -> None:
        self.member = member
        # [federation] server_id ("" for none: then no duplicate check), and this cluster's
        # name in the queues and announcements its links make upstream (the server id, else
        # its CPG group).
        self.server_id = server_id
        self.name = name
        # What x-received-from calls this cluster: the server id, else its cluster name, which
        # it also tells clients in connection.start (so a downstream pulling from it writes the
        # same, and a message that went round is known by either). Not ``name``, so that a
        # renamed cluster keeps its queues upstream.
        self.hop_name = server_id or cluster_name or name
        self._desk = desk
        self._replica = replica
        self._ready = ready
        self._serving = serving
        # For amqps:// upstreams: the [tls] CA and this member's certificate (an upstream may
        # log the link in by it: EXTERNAL); None: the system's CAs.
        self._ssl_context = ssl_context
        # Links this member runs: key -> (cancel scope, state).
        self.running: dict[tuple[str, str, str], tuple[trio.CancelScope, LinkState]] = {}
        # Set when the member has applied more events, for pushing links waiting on an empty
        # push queue (None while none waits).
        self._applied: trio.Event | None = None

    def applied(self) -> None:
        """The member applied a batch of events: a push queue may have grown. Called once per
        delivered batch, so it costs a test when no link waits."""
        ev = self._applied
        if ev is not None:
            self._applied = None
            ev.set()

    async def _wait_applied(self) -> None:
        if self._applied is None:
            self._applied = trio.Event()
        with trio.move_on_after(PUSH_RECHECK):
            await self._applied.wait()

    def status(self) -> list[dict[str, Any]]:
        return [
            {"vhost": k[0], "exchange": k[1], "upstream": k[2], **st.as_dict(self.member)}
            for k, (_, st) in self.running.items()
        ]

    async def run(self) -> None:
        """Start and stop this member's links as the replicated state says, for ever."""
        async with trio.open_nursery() as nursery:
            while True:
                self._reconcile(nursery)
                await trio.sleep(RECHECK)

    def _reconcile(self, nursery: trio.Nursery) -> None:
        mine: dict[tuple[str, str, str], Link] = {}
        if self._serving():
            b = self._replica()
            ready = self._ready()
            for link in b.federation.links(b.vhosts, b.policies.definition_of):
                if owner(link, ready) == self.member:
                    mine[link.key] = link
        for key in [k for k in self.running if k not in mine]:
            scope, _ = self.running.pop(key)
            log.info("federation link stops here link=%s", "/".join(key))
            scope.cancel()
        for key, link in mine.items():
            if key not in self.running:
                scope = trio.CancelScope()
                state = LinkState()
                self.running[key] = (scope, state)
                log.info("federation link runs here link=%s", "/".join(key))
                nursery.start_soon(self._run_link, link, scope, state)

    async def _report(self, link: Link, state: LinkState) -> None:
        try:
            await self._desk.request(
                TRUSTED,
                "federation_status",
                {
                    "vhost": link.vhost,
                    "exchange": link.exchange,
                    "upstream": link.upstream.name,
                    "state": state.as_dict(self.member),
                },
                SETTLE_TIMEOUT,
            )
        except trio.TooSlowError:
            log.warning("federation link status not applied in time link=%s", link.key)

    async def _run_link(self, link: Link, scope: trio.CancelScope, state: LinkState) -> None:
        with scope:
            uris = link.upstream.uris
            attempt = 0
            while True:
                uri = uris[attempt % len(uris)]
                attempt += 1
                state.uri = redacted(uri)
                try:
                    await self._serve_link(link, uri, state)
                except Exception as e:
                    # Whatever ends a link (the upstream gone, a cut, a refusal, a bug of
                    # ours), the member serves on: the link is retried after the delay. The
                    # link's tasks run in a nursery, so its errors come grouped.
                    cause = _first_leaf(e)
                    state.status = "error"
                    state.error = f"{type(cause).__name__}: {cause}"[:300]
                    refused = isinstance(cause, LinkRefused) or (
                        isinstance(cause, ConnectionClosed)
                        and "duplicate server id" in cause.reply_text
                    )
                    expected = isinstance(cause, _LINK_ERRORS)
                    log.log(
                        logging.ERROR if refused or not expected else logging.WARNING,
                        "federation link error link=%s uri=%s error=%s",
                        "/".join(link.key),
                        state.uri,
                        state.error,
                        exc_info=None if expected else cause,
                    )
                    await self._report(link, state)
                await trio.sleep(link.upstream.reconnect_delay_s if attempt % len(uris) == 0 else 0)

    async def _serve_link(self, link: Link, uri: str, state: LinkState) -> None:
        b = self._replica()
        vh = b.vhosts.get(link.vhost)
        ex = None if vh is None else vh.exchanges.get(link.exchange)
        if ex is None:
            raise LinkRefused(f"no local exchange '{link.exchange}'")
        ex_type = ex.type
        if link.upstream.max_hops > 1 and not self.server_id:
            # Past one hop, loops are caught by name: this cluster must have one.
            raise LinkRefused("max-hops above 1 needs [federation] server_id on this cluster")
        if link.upstream.push and vh is not None and link.push_queue not in vh.queues:
            # Before connecting: local publishes wait there while the upstream is away.
            status, answer = await self._desk.request(
                TRUSTED,
                "put_queue",
                {"vhost": link.vhost, "name": link.push_queue, "durable": True},
                SETTLE_TIMEOUT,
            )
            if status >= 300:
                raise LinkRefused(f"cannot declare the push queue: {status} {answer}")
        our_id = self.name
        client = await AmqpClient.connect(
            uri,
            ssl_context=self._ssl_context,
            connection_name=f"Federation link (upstream: {link.upstream.name}, "
            f"exchange: {link.exchange})",
            client_properties={SERVER_ID_PROPERTY: self.server_id} if self.server_id else None,
        )
        async with client:
            theirs = str(client.server_properties.get(SERVER_ID_PROPERTY, ""))
            if self.server_id and theirs == self.server_id:
                raise LinkRefused(
                    f"duplicate server id '{theirs}': the upstream calls itself what this "
                    "cluster is called; fix [federation] server_id on one of them"
                )
            # Without a server id, its cluster name (a cpgbroker's: its [cluster] name).
            upstream_name = theirs or str(client.server_properties.get("cluster_name", ""))
            ch = await client.channel()
            up = link.upstream
            await ch.exchange_declare(link.upstream_exchange, ex_type, durable=True)
            args: dict[str, Any] = {}
            if up.expires is not None:
                args["x-expires"] = up.expires
            if up.message_ttl is not None:
                args["x-message-ttl"] = up.message_ttl
            qname = queue_name(link, our_id)
            # no-ack is the seed design's lossy link: its upstream queue lives only while the
            # link is connected (auto-delete), so what is published upstream while the link is
            # down is not kept for it. The others buffer it (durable) until the link is back.
            lossy = up.ack_mode == "no-ack"
            _, depth, _ = await ch.queue_declare(
                qname, durable=not lossy, auto_delete=lossy, arguments=args or None
            )
            state.upstream_queue_messages = depth
            bound: dict[tuple[str, str], dict[str, Any]] = {}
            await self._sync_bindings(ch, link, qname, bound)
            no_ack = up.ack_mode == "no-ack"
            if not no_ack:
                await ch.basic_qos(up.prefetch_count)
            deliveries = await ch.consume(qname, no_ack=no_ack)
            state.status, state.error = "running", ""
            log.info("federation link running link=%s uri=%s", "/".join(link.key), state.uri)
            await self._report(link, state)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_bindings, ch, link, qname, bound)
                nursery.start_soon(self._keep_reporting, ch, link, qname, state)
                nursery.start_soon(self._announce, client, link, state)
                if up.push:
                    nursery.start_soon(self._push, client, link, upstream_name, state)
                await self._forward(link, ch, deliveries, upstream_name, uri, state, no_ack)
                nursery.cancel_scope.cancel()

    async def _sync_bindings(
        self, ch: Any, link: Link, qname: str, bound: dict[tuple[str, str], dict[str, Any]]
    ) -> None:
        want = wanted_bindings(self._replica(), link)
        for key, args in want.items():
            if key not in bound:
                await ch.queue_bind(qname, link.upstream_exchange, key[0], args or None)
                bound[key] = args
        for key in [k for k in bound if k not in want]:
            await ch.queue_unbind(qname, link.upstream_exchange, key[0], bound.pop(key) or None)

    async def _keep_bindings(
        self, ch: Any, link: Link, qname: str, bound: dict[tuple[str, str], dict[str, Any]]
    ) -> None:
        seen: tuple[int, int] | None = None
        while True:
            await trio.sleep(RECHECK)
            b = self._replica()
            vh = b.vhosts.get(link.vhost)
            ex = None if vh is None else vh.exchanges.get(link.exchange)
            mark = (-1, -1) if ex is None else (ex.bind_seq, len(ex.bindings))
            if mark != seen:
                seen = mark
                await self._sync_bindings(ch, link, qname, bound)

    async def _keep_reporting(self, ch: Any, link: Link, qname: str, state: LinkState) -> None:
        reported = (state.forwarded, state.pushed)
        while True:
            await trio.sleep(REPORT_EVERY)
            _, depth, _ = await ch.queue_declare(qname, passive=True)
            now = (state.forwarded, state.pushed)
            changed = depth != state.upstream_queue_messages or now != reported
            state.upstream_queue_messages = depth
            if changed:
                reported = now
                await self._report(link, state)

    async def _announce(self, client: AmqpClient, link: Link, state: LinkState) -> None:
        """The seed design's status exchange: tell the upstream who is linked to it, on its
        ``amq.peer`` fanout (a cpgbroker upstream with a server id has one; elsewhere there is
        none, and nothing is announced)."""
        ch = await client.channel()
        try:
            await ch.exchange_declare(PEER_EXCHANGE, "fanout", passive=True)
        except ChannelClosed:
            return
        while True:
            body = json.dumps(
                {
                    "server_id": self.server_id,
                    "name": self.name,
                    "member": self.member,
                    "link": {"vhost": link.vhost, "exchange": link.exchange},
                    "upstream": link.upstream.name,
                    "status": state.status,
                    "forwarded": state.forwarded,
                }
            ).encode()
            props = commands.Basic.Properties(
                content_type="application/json",
                headers={SERVER_ID_PROPERTY: self.server_id or self.name},
                app_id="cpgbroker-federation",
            )
            await ch.publish(PEER_EXCHANGE, "", body, props)
            await trio.sleep(ANNOUNCE_EVERY)

    async def _forward(
        self,
        link: Link,
        ch: Any,
        deliveries: Any,
        upstream_name: str,
        uri: str,
        state: LinkState,
        no_ack: bool,
    ) -> None:
        our_id = self.hop_name
        hop = {
            "uri": redacted(uri),
            "exchange": link.upstream_exchange,
            "cluster-name": upstream_name,
        }
        max_hops = link.upstream.max_hops
        on_confirm = link.upstream.ack_mode == "on-confirm"
        # Batches handed to the cluster whose answers (and, on-confirm, acks) are pending:
        # the next batch goes out while the cluster settles this one (_settle_forwarded).
        settle, settling = trio.open_memory_channel[tuple[Pending | None, int, int]](
            FORWARD_BATCHES_IN_FLIGHT
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._settle_forwarded, ch, settling, state)
                await self._forward_batches(
                    link, ch, deliveries, hop, our_id, max_hops, on_confirm, no_ack, state, settle
                )
        finally:
            # A link that ends drops the answers nobody will take (the upstream redelivers
            # what was not acknowledged).
            while True:
                try:
                    pending, _, _ = settling.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                if pending is not None:
                    self._desk.forget(pending)

    async def _forward_batches(
        self,
        link: Link,
        ch: Any,
        deliveries: Any,
        hop: dict[str, Any],
        our_id: str,
        max_hops: int,
        on_confirm: bool,
        no_ack: bool,
        state: LinkState,
        settle: trio.MemorySendChannel[tuple[Pending | None, int, int]],
    ) -> None:
        while True:
            batch: list[Delivery] = [await deliveries.receive()]
            size = len(batch[0].body)
            with trio.move_on_after(BATCH_WAIT):
                while size < BATCH_BYTES:
                    d = await deliveries.receive()
                    batch.append(d)
                    size += len(d.body)
            messages: list[tuple[str, bytes, bytes, bytes, bool]] = []
            # The last delivery of the batch that is still ours to acknowledge (one rejected
            # as too large is settled already: acknowledging it again is a channel error).
            last_tag = 0
            exact = self._replica().version.at_least(EXACT_FIELD_TABLES)
            for d in batch:
                digest = message_digest(d)
                raw: tuple[Table, list[Field]] | None = None
                if exact:
                    try:
                        raw = travelled_exact(d.header)
                    except (ValueError, IndexError):
                        # A header the cluster does not take either (it drops one that does
                        # not parse, and answers it as not routed): handed over as it came.
                        raw = None
                if exact:
                    looped = raw is not None and been_at_exact(raw[1], our_id, max_hops)
                else:
                    props = d.properties or commands.Basic.Properties()
                    headers, seen = travelled(props)
                    looped = been_at(seen, our_id, max_hops)
                if looped:
                    # Been here, or crossed as many clusters as it may: not forwarded.
                    state.dropped_loops += 1
                    last_tag = d.delivery_tag
                    continue
                if len(d.body) > MAX_MESSAGE_BYTES:
                    state.too_large += 1
                    if not no_ack:
                        await ch.nack(d.delivery_tag, requeue=False)
                    continue
                here = {**hop, "redelivered": d.redelivered}
                if exact:
                    header = d.header if raw is None else with_hop_exact(d.header, *raw, here)
                else:
                    headers[RECEIVED_FROM] = [*seen, here]
                    props.headers = headers
                    header = bytes(pheader.ContentHeader(0, len(d.body), props).marshal())
                messages.append((d.routing_key, header, d.body, digest, d.redelivered))
                last_tag = d.delivery_tag
            acked = no_ack or not last_tag
            if not on_confirm and not acked:
                # on-publish: handed over is enough.
                await ch.ack(last_tag, multiple=True)
                acked = True
            pending = None
            if messages:
                pending = await self._desk.send(
                    functools.partial(
                        Forward,
                        self.member,
                        vhost=link.vhost,
                        exchange=link.exchange,
                        upstream=link.upstream.name,
                        messages=tuple(messages),
                    )
                )
            if pending is not None or not acked:
                # In order behind the batches before it: an acknowledgement covers every
                # delivery up to its tag.
                await settle.send((pending, len(messages), 0 if acked else last_tag))

    async def _settle_forwarded(
        self,
        ch: Any,
        batches: trio.MemoryReceiveChannel[tuple[Pending | None, int, int]],
        state: LinkState,
    ) -> None:
        """Each forwarded batch in order: its answer once the cluster settled it (every member
        has the messages, and every store), then its acknowledgement upstream, if it has one
        (``on-confirm``)."""
        async for pending, count, tag in batches:
            if pending is not None:
                status, answer = await self._desk.answer(pending, SETTLE_TIMEOUT)
                if status != 200:
                    raise LinkRefused(f"the local exchange is gone ({status})")
                state.duplicates += answer["duplicates"]
                state.forwarded += count - answer["duplicates"]
            if tag:
                await ch.ack(tag, multiple=True)

    def _push_batch(self, link: Link, after: int) -> list[tuple[int, str, bytes, bytes]]:
        """The next messages of the link's push queue after message id ``after`` (those are
        sent and wait for their removal), as this member's replica has them: (message id,
        routing key, content header, body), at most a batch's bytes and the prefetch count."""
        vh = self._replica().vhosts.get(link.vhost)
        q = None if vh is None else vh.queues.get(link.push_queue)
        out: list[tuple[int, str, bytes, bytes]] = []
        if q is None:
            return out
        size = 0
        limit = link.upstream.prefetch_count
        for e in q.messages:
            m = e.msg
            if m.id <= after:
                continue
            out.append((m.id, m.routing_key, m.header, m.body))
            size += len(m.body)
            if size >= BATCH_BYTES or len(out) >= limit:
                break
        return out

    async def _push(
        self, client: AmqpClient, link: Link, upstream_name: str, state: LinkState
    ) -> None:
        """Send local publishes upstream: the push queue's messages, in order, published to the
        upstream exchange with confirms, then removed here by an ordered command once the
        upstream confirmed them. Two stages, so that neither round trip waits for the other:
        this one publishes batch after batch (at most PUSH_BATCHES_IN_FLIGHT unsettled),
        :meth:`_settle_pushed` waits for each batch's confirms and removes it. A runner that
        dies in between leaves them in the queue, and the next one sends them again (at least
        once: the upstream may get a message twice, never none). A message that was at the
        upstream already, or crossed ``max-hops`` clusters, is removed without being sent
        (mutually pushing clusters do not loop)."""
        ch = await client.channel()
        await ch.confirm_select()
        hop: dict[str, Any] = {
            "exchange": link.exchange,
            "cluster-name": self.hop_name,
            "redelivered": False,
        }
        max_hops = link.upstream.max_hops
        send, receive = trio.open_memory_channel[tuple[int, list[Any]]](PUSH_BATCHES_IN_FLIGHT)
        sent_upto = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._settle_pushed, link, receive, state)
            while True:
                batch = self._push_batch(link, sent_upto)
                if not batch:
                    # Nothing new to send: until the member has applied more (no polling).
                    await self._wait_applied()
                    continue
                confirms = []
                exact = self._replica().version.at_least(EXACT_FIELD_TABLES)
                for _, rk, header, body in batch:
                    if exact:
                        # The header as the local publisher sent it (accepted at publish).
                        table, hops = travelled_exact(header)
                        if been_at_exact(hops, upstream_name, max_hops):
                            state.dropped_loops += 1
                            continue
                        confirms.append(
                            await ch.publish(
                                link.upstream_exchange,
                                rk,
                                body,
                                header=with_hop_exact(header, table, hops, hop),
                            )
                        )
                        continue
                    ch_header = pheader.ContentHeader()
                    ch_header.unmarshal(header)
                    props = ch_header.properties
                    headers, seen = travelled(props)
                    if been_at(seen, upstream_name, max_hops):
                        state.dropped_loops += 1
                        continue
                    headers[RECEIVED_FROM] = [*seen, hop]
                    props.headers = headers
                    confirms.append(await ch.publish(link.upstream_exchange, rk, body, props))
                sent_upto = batch[-1][0]
                await send.send((sent_upto, confirms))

    async def _settle_pushed(
        self,
        link: Link,
        batches: trio.MemoryReceiveChannel[tuple[int, list[Any]]],
        state: LinkState,
    ) -> None:
        """Each pushed batch in order: once the upstream confirmed all of it, removed from the
        push queue on every member (up to its last message id)."""
        async for upto, confirms in batches:
            for c in confirms:
                if c is not None and not await c.wait():
                    raise LinkRefused("the upstream refused a pushed message (nack)")
            # Counted once the upstream confirmed them, before the removal: a runner cut off
            # while the removal is applied (its connection lost, so this task cancelled) must
            # still have counted them, as nothing sends them again. A batch that a later runner
            # sends again is counted again (at least once, as delivery).
            state.pushed += len(confirms)
            status, _ = await self._desk.request(
                TRUSTED,
                "federation_pushed",
                {
                    "vhost": link.vhost,
                    "exchange": link.exchange,
                    "upstream": link.upstream.name,
                    "upto": upto,
                },
                SETTLE_TIMEOUT,
            )
            if status != 200:
                raise LinkRefused(f"the push queue is gone ({status})")


class LinkRefused(CpgBrokerError):
    """A link that cannot run as configured (a duplicate server id, no local exchange):
    reported as the link's error, and tried again after the reconnect delay."""


# What ends a link in the ordinary course of things (logged without a traceback).
_LINK_ERRORS = (AmqpClientError, OSError, trio.TooSlowError, LinkRefused)


def _first_leaf(e: BaseException) -> BaseException:
    """The first error inside (nested) exception groups: what a link's nursery raised."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e

"""Delivery: publishing, routing, enqueueing, dispatching to consumers, TTL and dead letters.

Theory of operation
-------------------
:class:`Delivery` owns the message counter (``msg_seq``: message ids grow with publishing,
which keeps a queue's ready messages in id order) and the way a message travels:

1. ``basic_publish`` (the fast path: struct-decoded, no pamqp) opens a
   :class:`~.entities.PendingPublish` on the channel; ``content_header`` and
   ``content_body`` fill it; the last body frame publishes it. The client's content-header
   bytes are kept and forwarded byte for byte.
2. ``route`` finds the queues (exchange-to-exchange bindings, alternate exchanges);
   ``enqueue`` applies x-max-length / x-overflow and TTL; ``dispatch`` offers each ready
   message to the queue's consumers (round robin, consumer priorities, single active
   consumer), against the do-output credit of their connections only.
3. A message that leaves a queue without being consumed (expired, dropped at max length,
   rejected, over its delivery limit) is *settled dropped*: released from the memory mark
   and, if the queue has a dead-letter exchange, copied there (``deadletter.py``).

From model version 8 (``versions.EXACT_FIELD_TABLES``) the header of a dead-lettered or
redelivered copy is changed on its bytes (``wire/fieldtable.py``), every header value it does
not touch kept as published, and so publish accepts every headers value the grammar allows; at
version 7 pamqp writes those headers again, and publish refuses what it could not write.

Transactions hold publishes on the channel (``Channel.tx_ops``); confirms are counted by
:class:`~.confirms.Confirms`, which this component tells about every routed publish.
Consumers, acks and requeues live in ``consumers.py``; queues, exchanges and the
``ttl_queues`` index in ``topology.py`` (delivery adds a queue to the index when a message
that can expire joins it, and expires queue heads on ticks).

Per-message cost is what every replica pays for every client, so the hot methods keep their
collaborators as bound methods and encode deliveries straight into ``Connection.outbuf``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from pamqp import commands

from cpgbroker.errors import ChannelError, ConnectionError_, ReplyCode
from cpgbroker.model import entities as E
from cpgbroker.model.access.permissions import Permissions
from cpgbroker.model.changes import Recording
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.entities import (
    Channel,
    Connection,
    Consumer,
    Entry,
    Message,
    PendingPublish,
    Queue,
    TxPublish,
    put_back,
)
from cpgbroker.model.events import WantOutput
from cpgbroker.model.messages.confirms import Confirms
from cpgbroker.model.messages.validate import dead_letter_problem
from cpgbroker.model.output import Clock, Output, basic_return
from cpgbroker.model.resources.memory import MemoryMark
from cpgbroker.model.resources.queueflow import QueueFlow
from cpgbroker.model.routing.deadletter import (
    dead_letter_header,
    dead_letter_header_exact,
    is_cycle,
    is_cycle_exact,
)
from cpgbroker.model.routing.exchange import Exchange
from cpgbroker.model.routing.topology import FAILOVER_EXCHANGE, VHost, reply_queue_of
from cpgbroker.model.routing.ttlindex import TtlQueues
from cpgbroker.model.versions import EXACT_FIELD_TABLES, ModelVersion
from cpgbroker.wire.fastpath import (
    DIRECT_REPLY,
    HeaderInfo,
    decode_publish,
    encode_content,
    encode_deliver,
    parse_content_header,
    with_delivery_count,
)

R = ReplyCode


def fast_decode(decoder: Any, payload: bytes, name: str, method_id: int) -> Any:
    """Run a hand-written decoder. The decoders answer arguments that do not decode with
    RabbitMQ's 501 themselves (wire/fastpath.py); a ValueError or IndexError still escaping
    one is refused with 502 rather than reaching the error-check round."""
    try:
        return decoder(payload)
    except (ValueError, IndexError) as e:
        raise ConnectionError_(
            R.SYNTAX_ERROR, f"malformed {name} arguments: {e}", class_id=60, method_id=method_id
        ) from None


def _untimed(ch: Channel, q: Queue) -> None:
    """``Delivery.on_unacked`` until the broker wires consumer timeouts in."""


def _over(q: Queue, size: int) -> bool:
    return (q.max_length is not None and len(q.messages) + 1 > q.max_length) or (
        q.max_length_bytes is not None and q.ready_bytes + size > q.max_length_bytes
    )


class Delivery:
    __slots__ = (
        "_changes",
        "_clock",
        "_confirm_publish",
        "_connections",
        "_dirty",
        "_emit",
        "_flow",
        "_flow_high",
        "_flow_low",
        "_mark",
        "_max_message_size",
        "_out",
        "_permissions",
        "_published",
        "_release",
        "_ttl_queues",
        "_version",
        "_vhosts",
        "msg_seq",
        "on_unacked",
        "push_to",
    )

    def __init__(
        self,
        config: BrokerConfig,
        clock: Clock,
        out: Output,
        mark: MemoryMark,
        confirms: Confirms,
        vhosts: dict[str, VHost],
        ttl_queues: TtlQueues,
        connections: dict[int, Connection],
        flow: QueueFlow,
        permissions: Permissions,
        version: ModelVersion,
        changes: Recording,
    ) -> None:
        self.msg_seq = 0
        # The cluster's model version (read at every use: it moves up at an event).
        self._version = version
        self._flow = flow
        self._flow_high = flow.high or 2**62
        self._flow_low = flow.low
        self._max_message_size = config.max_message_size
        self._clock = clock
        self._out = out
        self._mark = mark
        # Read only: topology owns vhosts and the index of queues whose head may expire.
        self._vhosts = vhosts
        self._ttl_queues = ttl_queues
        self._connections = connections
        # Bound once: these run per message.
        self._dirty = out.dirty
        self._emit = out.emit
        self._release = mark.release
        self._confirm_publish = confirms.published
        self._permissions = permissions
        # The push queues of a federated exchange (model/federation.py; set by the broker):
        # local publishes to it also go there, to be sent upstream.
        self.push_to: Callable[[VHost, Exchange], list[Queue]] | None = None
        # The write check's results (permissions.py): a hit is the whole per-message cost.
        self._published = permissions.published
        # Where a hot-standby primary's change log is (model/changes.py): told what joins a
        # queue, goes to a consumer and comes back (``enqueue``, ``record_delivery``,
        # ``requeue``).
        self._changes = changes
        # A delivery to ack from another queue than its channel's last one (or its first):
        # consumer timeouts look at it (model/messages/consumertimeout.py; set by the broker).
        self.on_unacked: Callable[[Channel, Queue], None] = _untimed

    def set_msg_seq(self, msg_seq: int) -> None:
        """The message counter is ``msg_seq`` (a snapshot's, or the primary's from each change
        batch: model/standby/replica.py): the next message published gets the id after it."""
        self.msg_seq = msg_seq

    # ------------------------------------------------------------------ publishing

    def basic_publish(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        exchange, rk, mandatory, immediate = fast_decode(
            decode_publish, payload, "basic.publish", 40
        )
        if immediate:
            raise ConnectionError_(R.NOT_IMPLEMENTED, "immediate=true", class_id=60, method_id=40)
        ch.pending = PendingPublish(exchange, rk, mandatory)

    def content_header(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        pend = ch.pending
        if pend is None or pend.header is not None:
            raise ConnectionError_(
                R.UNEXPECTED_FRAME, f"unexpected content header frame on channel {ch.id}"
            )
        # As RabbitMQ: a header too short for class, weight and size is a malformed frame
        # (501); one for another class or with a weight is not the frame expected (505); then
        # every property is checked here, at the door, so that nothing done later with the
        # stored message (headers-exchange routing, dead-lettering, redelivery) can fail.
        if len(payload) < 14:
            raise ConnectionError_(
                R.FRAME_ERROR, f"content header of {len(payload)} bytes is too short"
            )
        if payload[0] != 0 or payload[1] != 60 or payload[2] or payload[3]:
            raise ConnectionError_(
                R.UNEXPECTED_FRAME,
                f"expected content header for class 60 with weight 0, got class "
                f"{payload[0] << 8 | payload[1]} weight {payload[2] << 8 | payload[3]}",
            )
        exact = self._version.at_least(EXACT_FIELD_TABLES)
        try:
            info = parse_content_header(payload, roundtrip=not exact)
        except (ValueError, IndexError) as e:
            raise ConnectionError_(R.FRAME_ERROR, f"malformed content header: {e}") from None
        if info.headers_span is not None and not exact:
            # Version 7 only: version 8 dead-letters any x-death as RabbitMQ does.
            problem = dead_letter_problem(payload, info.headers_span)
            if problem is not None:
                ch.pending = None
                raise ChannelError(R.PRECONDITION_FAILED, problem, class_id=60, method_id=40)
        if info.body_size > self._max_message_size:
            ch.pending = None
            raise ChannelError(
                R.PRECONDITION_FAILED,
                f"message size {info.body_size} is larger than configured max size "
                f"{self._max_message_size}",
                class_id=60,
                method_id=40,
            )
        pend.header = payload
        pend.remaining = info.body_size
        pend.info = info
        if info.body_size == 0:
            ch.pending = None
            self._publish(conn, ch, pend, payload, info, b"")

    def content_body(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        pend = ch.pending
        if pend is None:
            raise ConnectionError_(
                R.UNEXPECTED_FRAME, f"unexpected content body frame on channel {ch.id}"
            )
        header = pend.header
        info = pend.info
        if header is None or info is None:
            raise ConnectionError_(
                R.UNEXPECTED_FRAME, f"unexpected content body frame on channel {ch.id}"
            )
        remaining = pend.remaining - len(payload)
        if remaining < 0:
            raise ConnectionError_(
                R.FRAME_ERROR, "content body frames exceed the size in the content header"
            )
        parts = pend.parts
        if remaining:
            if parts is None:
                pend.parts = [payload]
            else:
                parts.append(payload)
            pend.remaining = remaining
            return
        ch.pending = None
        if parts is not None:
            parts.append(payload)
            payload = b"".join(parts)
        self._publish(conn, ch, pend, header, info, payload)

    def _publish(
        self,
        conn: Connection,
        ch: Channel,
        pend: PendingPublish,
        header: bytes,
        info: HeaderInfo,
        body: bytes,
    ) -> None:
        exchange = pend.exchange
        if not self._published.get((conn.user, conn.vhost, exchange)):
            self._permissions.check_publish(conn, exchange)
        vh = self._vhosts[conn.vhost]
        ex = vh.exchanges.get(exchange)
        if ex is None:
            raise ChannelError(
                R.NOT_FOUND,
                f"no exchange '{exchange}' in vhost '{vh.name}'",
                class_id=60,
                method_id=40,
            )
        if ex.internal:
            raise ChannelError(
                R.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{exchange}' in vhost '{vh.name}'",
                class_id=60,
                method_id=40,
            )
        if info.user_id is not None and info.user_id != conn.user:
            raise ChannelError(
                R.PRECONDITION_FAILED,
                f"user_id property set to '{info.user_id}' but authenticated user was "
                f"'{conn.user}'",
                class_id=60,
                method_id=40,
            )
        at = info.direct_reply_at
        if at >= 0:
            # Direct reply-to (model/routing/topology.py): the answer's address is this channel's
            # own reply queue, spliced into the client's header bytes in place of the pseudo-queue
            # (the headers table, whose span the message keeps, comes before reply-to).
            rq = reply_queue_of(ch)
            if rq is None:
                raise ChannelError(
                    R.PRECONDITION_FAILED,
                    "fast reply consumer does not exist",
                    class_id=60,
                    method_id=40,
                )
            name = rq.name.encode()
            end = at + 1 + len(DIRECT_REPLY)
            header = header[:at] + bytes((len(name),)) + name + header[end:]
        expiration_ms: int | None = None
        if info.expiration is not None:
            exp = info.expiration
            if not exp.isdigit() or not exp.isascii():
                raise ChannelError(
                    R.PRECONDITION_FAILED, f"invalid expiration '{exp}'", class_id=60, method_id=40
                )
            expiration_ms = int(exp)
        self.msg_seq += 1
        msg = Message(
            self.msg_seq,
            exchange,
            pend.routing_key,
            header,
            body,
            info.delivery_mode,
            expiration_ms,
            info.headers_span,
        )
        conn.published = True
        if ch.tx:
            ch.tx_ops.append(TxPublish(msg, pend.mandatory))
            return
        self.route_and_enqueue(conn, ch, vh, ex, msg, pend.mandatory)
        mark = self._mark
        if mark.queued_bytes > mark.high and not mark.memory_blocked:
            mark.set_blocked(True)

    def route_and_enqueue(
        self, conn: Connection, ch: Channel, vh: VHost, ex: Exchange, msg: Message, mandatory: bool
    ) -> None:
        queues = self.route(vh, ex, msg.routing_key, msg)
        refused = False
        if not queues:
            if mandatory:
                self._send_return(conn, ch, msg, R.NO_ROUTE, "NO_ROUTE")
        else:
            durable = False
            flow_high = self._flow_high
            for q in queues:
                if self.enqueue(q, Entry(msg, False, None)):
                    self.dispatch(q)
                    durable = durable or q.durable
                    if len(q.messages) > flow_high and q.consumers:
                        self._flow.published(conn, q)
                else:
                    refused = True
            if durable and msg.delivery_mode == 2 and (ch.confirm or ch.tx):
                # Its confirm (or the commit-ok of its transaction) waits for the stores.
                self._out.persisted(conn)
        if ch.confirm:
            self._confirm_publish(conn, ch, refused)

    def _send_return(
        self, conn: Connection, ch: Channel, msg: Message, code: int, text: str
    ) -> None:
        conn.last_tx_ms = self._clock.now_ms
        if conn.emit:
            # Encoded here, not by pamqp, which refuses exchange names RabbitMQ accepts.
            self._emit(
                conn,
                basic_return(ch.id, code, text, msg.exchange, msg.routing_key)
                + encode_content(ch.id, msg.header, msg.body, conn.frame_max),
            )

    def publish_members(self, q: Queue, urls: tuple[str, ...]) -> None:
        """The member list as a message on ``q`` (amq.failover): body one URL per line, and the
        list in header ``members`` for clients that read headers."""
        from pamqp import header as pheader

        props = commands.Basic.Properties(
            content_type="text/plain", headers={"members": list(urls)}
        )
        body = "\n".join(urls).encode()
        hdr = bytes(pheader.ContentHeader(0, len(body), props).marshal())
        info = parse_content_header(hdr)
        self.msg_seq += 1
        msg = Message(self.msg_seq, FAILOVER_EXCHANGE, "", hdr, body, 1, None, info.headers_span)
        if self.enqueue(q, Entry(msg, False, None)):
            self.dispatch(q)

    def publish_admin(
        self,
        vh: VHost,
        ex: Exchange,
        routing_key: str,
        header: bytes,
        body: bytes,
        *,
        local: bool = True,
    ) -> bool:
        """A message published through the management API (``POST /api/exchanges/{vhost}/
        {name}/publish``; the caller checked the user's write permission and the exchange):
        routed and enqueued as a client's would be; whether it reached a queue. It has no
        confirm, transaction, return or publisher to hold back. Not ``local``: brought in by
        a federation link, so never pushed back upstream."""
        info = parse_content_header(
            header, roundtrip=not self._version.at_least(EXACT_FIELD_TABLES)
        )
        self.msg_seq += 1
        msg = Message(
            self.msg_seq,
            ex.name,
            routing_key,
            header,
            body,
            info.delivery_mode,
            None if info.expiration is None else int(info.expiration),
            info.headers_span,
        )
        queues = self.route(vh, ex, routing_key, msg, push=local)
        for q in queues:
            if self.enqueue(q, Entry(msg, False, None)):
                self.dispatch(q)
        self._mark.check()
        return bool(queues)

    def trim(self, q: Queue) -> None:
        """``q``'s length limits just became smaller (a policy): drop (or dead-letter) heads
        until it fits, as RabbitMQ applies a new max-length at once."""
        if q.max_length is None and q.max_length_bytes is None:
            return
        dropped = False
        while q.messages and (
            (q.max_length is not None and len(q.messages) > q.max_length)
            or (q.max_length_bytes is not None and q.ready_bytes > q.max_length_bytes)
        ):
            dropped = True
            self.settle_dropped(q, q.messages.popleft(), "maxlen")
        if dropped:
            self._ttl_queues.note(q)

    # ------------------------------------------------------------------ routing and queues

    def route(
        self,
        vh: VHost,
        ex: Exchange,
        rk: str,
        msg: Message,
        seen: list[Exchange] | None = None,
        *,
        push: bool = True,
    ) -> list[Queue]:
        if ex.name == "":
            q = vh.queues.get(rk)
            return [q] if q is not None else []
        # Breadth first through exchange-to-exchange bindings; results de-duplicated in order
        # (dicts by identity: O(1) per destination, so a fanout to many queues stays linear).
        found: dict[int, Queue] = {}
        visited: dict[int, None] = {id(ex): None}
        pending = [ex]
        push_to = self.push_to if push else None
        # Model version 8: headers exchanges read headers with our codec, as RabbitMQ matches.
        exact = self._version.at_least(EXACT_FIELD_TABLES)
        i = 0
        while i < len(pending):
            cur = pending[i]
            i += 1
            for dest in cur.match(rk, msg, exact):
                if isinstance(dest, Queue):
                    if id(dest) not in found:
                        found[id(dest)] = dest
                elif id(dest) not in visited:
                    visited[id(dest)] = None
                    pending.append(dest)
            if push_to is not None and cur.policy is not None:
                # A federated exchange that pushes upstream: as if bound to its push queues.
                for q in push_to(vh, cur):
                    if id(q) not in found:
                        found[id(q)] = q
        if not found:
            ae_name = ex.alternate
            if ae_name is not None:
                ae = vh.exchanges.get(ae_name)
                # Alternate exchanges may form a cycle (a -> b -> a): every exchange of the
                # chain is tried once, as RabbitMQ does.
                seen = [ex] if seen is None else seen
                if ae is not None and ae not in seen:
                    seen.append(ae)
                    return self.route(vh, ae, rk, msg, seen, push=push)
        return list(found.values())

    def enqueue(self, q: Queue, e: Entry) -> bool:
        """Append to ``q``; False if the queue refused it (x-overflow reject-publish)."""
        msg = e.msg
        size = len(msg.body)
        if (q.max_length is not None or q.max_length_bytes is not None) and _over(q, size):
            if q.overflow != "drop-head":
                if q.overflow == "reject-publish-dlx":
                    self.dead_letter(q, e, "maxlen")
                return False
            dropped = False
            while q.messages and _over(q, size):
                dropped = True
                self.settle_dropped(q, q.messages.popleft(), "maxlen")
            if dropped:
                self._ttl_queues.note(q)
            if _over(q, size):
                # Does not fit even in an empty queue: it is the head that is dropped.
                if q.dlx is not None:
                    self.dead_letter(q, e, "maxlen")
                return True
        ttl = q.ttl
        exp = msg.expiration_ms
        if ttl is not None or exp is not None:
            if ttl is None:
                lim = exp
            elif exp is None:
                lim = ttl
            else:
                lim = min(ttl, exp)
            e.expires_at = self._clock.now_ms + (lim or 0)
            ttl_queues = self._ttl_queues
            ttl_queues.join(q)
            q.messages.append(e)
            if q.messages[0] is e:
                ttl_queues.note(q)
        else:
            q.messages.append(e)
        q.ready_bytes += size
        q.published_total += 1
        self._mark.queued_bytes += size
        log = self._changes.log
        if log is not None:
            log.enqueued(q, e)
        return True

    def record_delivery(self, conn: Connection, q: Queue, e: Entry, acked: bool) -> None:
        """``e`` was just taken from ``q`` for ``conn`` (a consumer's delivery or a basic.get;
        ``acked``: one the client must acknowledge), before a no-ack delivery releases it:
        tell the change log, and whether the client may see it only once its batch is stable
        (runtime/replication/shipping.py, "Deliveries")."""
        log = self._changes.log
        if log is not None:
            if conn.emit and log.delivery_waits(q, e):
                conn.delivery_waits = True
            if acked:
                log.delivered(q, e)

    def requeue(self, q: Queue, e: Entry) -> None:
        """``e``, delivered from ``q``, goes back to its place there, flagged redelivered
        (nack or reject with requeue, recover, a closed channel, the management API's get)."""
        e.redelivered = True
        put_back(q.messages, e)
        log = self._changes.log
        if log is not None:
            log.requeued(q, e)

    def track_ttl(self, q: Queue, e: Entry) -> None:
        """``e`` is back among ``q``'s ready messages: ticks must look at ``q`` if it expires."""
        if e.expires_at is not None:
            self._ttl_queues.join(q)
            self._ttl_queues.note(q)

    def expire_head(self, q: Queue) -> None:
        msgs = q.messages
        now = self._clock.now_ms
        expired = False
        while msgs:
            e = msgs[0]
            if e.expires_at is None or e.expires_at > now:
                break
            msgs.popleft()
            expired = True
            self.settle_dropped(q, e, "expired")
        if expired:
            self._ttl_queues.note(q)

    def expire_ttl(self) -> None:
        """On a tick: expired heads leave their queues; a queue with none left that can expire
        leaves the index.

        Same effect as visiting every queue of ``ttl_queues`` in its order (the index as it was
        when the tick began), each once, at less cost: a visit is a no-op unless the queue is
        *due* (its head expired, or it is empty), so only due queues are visited, in index
        order. A queue that becomes due during the tick (dead letters reach it) is visited in
        this tick if the walk has not passed its place yet, else on the next one, as the full
        walk would."""
        index = self._ttl_queues
        heap = index.heap
        if len(heap) > 64 + 4 * len(index):
            index.rebuild()  # stale entries outnumber live ones: O(n) now and then
        now = self._clock.now_ms
        if not heap or heap[0][0] > now:
            return
        limit = index.next_order  # queues that join during the tick wait for the next one
        ready: list[tuple[int, int, Queue]] = []
        later: list[Queue] = []
        cursor = -1
        heappop = heapq.heappop
        while True:
            while heap and heap[0][0] <= now:
                t, order, push, q = heappop(heap)
                if q.ttl_due != t or q.ttl_order != order:
                    continue  # stale: superseded, or the queue left the index
                q.ttl_due = None
                if cursor < order < limit:
                    heapq.heappush(ready, (order, push, q))
                else:
                    later.append(q)  # visited already in this tick, or joined during it
            if not ready:
                break
            order, _, q = heappop(ready)
            if order == cursor:
                continue  # noted twice before its visit: that visit saw the later state
            cursor = order
            self.expire_head(q)
            if not q.messages:
                index.leave(q)
            else:
                index.note(q)
        for q in later:
            index.note(q)

    # ------------------------------------------------------------------ dead letters

    @staticmethod
    def over_delivery_limit(q: Queue, e: Entry) -> bool:
        """A message comes back to a quorum queue: count it; True if that is past its
        x-delivery-limit (the caller dead-letters it instead, as RabbitMQ's quorum queues do
        with poison messages)."""
        if not q.quorum:
            return False
        e.delivery_count += 1
        return q.delivery_limit is not None and e.delivery_count > q.delivery_limit

    def dead_letter_over_limit(self, over: list[tuple[Queue, Entry]]) -> None:
        """``over`` was collected newest first (returns walk back from the last tag): dead-letter
        in delivery order, as the messages were published."""
        for q, e in reversed(over):
            self.settle_dropped(q, e, "delivery_limit")

    def settle_dropped(self, q: Queue, e: Entry, reason: str) -> None:
        """A message leaves ``q`` without being consumed: dead-letter it if configured."""
        self._release(q, e)
        if q.dlx is not None:
            self.dead_letter(q, e, reason)

    def dead_letter(self, q: Queue, e: Entry, reason: str) -> None:
        vh = self._vhosts[q.vhost]
        ex = vh.exchanges.get(q.dlx or "")
        if ex is None or q.dlx is None:
            return
        msg = e.msg
        rk = q.dlrk if q.dlrk is not None else msg.routing_key
        exact = self._version.at_least(EXACT_FIELD_TABLES)
        if exact:
            header = dead_letter_header_exact(msg, q, reason, self._clock.now_ms)
        else:
            header = dead_letter_header(msg, q, reason, self._clock.now_ms)
        self.msg_seq += 1
        info = parse_content_header(header, roundtrip=not exact)
        new = Message(
            self.msg_seq, ex.name, rk, header, msg.body, info.delivery_mode, None, info.headers_span
        )
        cycle = is_cycle_exact if exact else is_cycle
        for target in self.route(vh, ex, rk, new):
            # RabbitMQ drops a message that would go round a dead-letter cycle (back into a
            # queue it died in) unless a rejection is on the way.
            if reason != "rejected" and cycle(header, target.name):
                continue
            if self.enqueue(target, Entry(new, False, None)):
                self.dispatch(target)

    def delivered_header(self, e: Entry) -> bytes:
        """The content header ``e`` goes out with: its message's, with ``x-delivery-count``
        once it came back to a quorum queue (basic.get; ``_deliver`` inlines it)."""
        if not e.delivery_count:
            return e.msg.header
        return with_delivery_count(
            e.msg.header, e.delivery_count, exact=self._version.at_least(EXACT_FIELD_TABLES)
        )

    # ------------------------------------------------------------------ dispatch

    def on_do_output(self, conn_id: int, limit: int) -> None:
        """The owner of ``conn_id`` grants ``limit`` deliveries (its socket drained)."""
        conn = self._connections.get(conn_id)
        if conn is None:
            return
        conn.credit = limit
        conn.want_output = False
        conn.granted = True
        if conn.state != E.OPEN:
            return
        # Queues are visited in channel and consumer order: deterministic.
        seen: dict[int, Queue] = {}
        for ch in conn.channels.values():
            for c in ch.consumers.values():
                seen.setdefault(id(c.queue), c.queue)
        for q in seen.values():
            self.dispatch(q)
            if conn.credit <= 0:
                break

    def dispatch_channel(self, ch: Channel) -> None:
        seen: dict[int, Queue] = {}
        for c in ch.consumers.values():
            seen.setdefault(id(c.queue), c.queue)
        for q in seen.values():
            self.dispatch(q)

    def dispatch(self, q: Queue) -> None:
        msgs = q.messages
        consumers = q.consumers
        if not msgs or not consumers:
            return
        now = self._clock.now_ms
        # A single-active-consumer queue offers messages to its eldest consumer only.
        n = 1 if q.single_active else len(consumers)
        # Consumer priorities (x-priority): the highest that can take a message gets it, in
        # turn among equals; a lower one only while all higher ones cannot (prefetch full,
        # flow off, their connection not draining), as in RabbitMQ.
        ranked = n > 1 and q.ranked_consumers > 0
        popped = False
        while msgs:
            e = msgs[0]
            if e.expires_at is not None and e.expires_at < now:
                msgs.popleft()
                popped = True
                self.settle_dropped(q, e, "expired")
                continue
            chosen: Consumer | None = None
            start = q.rr
            order: Iterable[int] = range(n)
            # The priority of a consumer whose connection waits for its first do-output grant: a
            # lower one must not take the message meanwhile (every fresh connection waits for
            # one, and whose comes first is no measure of who can take more). Out of credit
            # later, a connection has not drained what it was given: it cannot take more, and
            # lower ones may (RabbitMQ's credit flow); so a stuck client holds nobody up.
            waiting: int | None = None
            if ranked:
                order = sorted(order, key=lambda i: (-consumers[(start + i) % n].priority, i))
            for i in order:
                c = consumers[(start + i) % n]
                if waiting is not None and c.priority < waiting:
                    break
                ch = c.channel
                if not ch.flow_active or ch.closing:
                    continue
                if not c.no_ack:
                    if c.prefetch and c.unacked >= c.prefetch:
                        continue
                    if ch.global_prefetch and len(ch.unacked) >= ch.global_prefetch:
                        continue
                conn = ch.conn
                if conn.credit <= 0:
                    if not conn.want_output:
                        conn.want_output = True
                        self._out.effect(WantOutput(conn.id))
                    if ranked and waiting is None and not conn.granted:
                        waiting = c.priority
                    continue
                chosen = c
                q.rr = (start + i + 1) % n
                break
            if chosen is None:
                break
            msgs.popleft()
            popped = True
            self._deliver(chosen, q, e)
        if popped and q.ttl_order >= 0:
            self._ttl_queues.note(q)
        if q.flow_paused and len(msgs) <= self._flow_low:
            self._flow.check(q)

    def _deliver(self, c: Consumer, q: Queue, e: Entry) -> None:
        ch = c.channel
        conn = ch.conn
        ch.next_tag += 1
        tag = ch.next_tag
        conn.credit -= 1
        q.delivered_total += 1
        now = self._clock.now_ms
        if self._changes.log is not None:
            self.record_delivery(conn, q, e, not c.no_ack)
        if c.no_ack:
            self._release(q, e)
        else:
            ch.unacked[tag] = (q, e, c, now)
            c.unacked += 1
            q.unacked += 1
            if ch.ack_q is not q:
                # The channel's first delivery to ack, or one from another queue than its
                # last: its consumer timeout may start or get shorter (consumertimeout.py).
                self.on_unacked(ch, q)
        conn.last_tx_ms = now
        if conn.emit:
            msg = e.msg
            header = (
                with_delivery_count(
                    msg.header,
                    e.delivery_count,
                    exact=self._version.at_least(EXACT_FIELD_TABLES),
                )
                if e.delivery_count
                else msg.header
            )
            data = encode_deliver(
                ch.id, c.tag_b, tag, e.redelivered, msg.ex_b, msg.rk_b
            ) + encode_content(ch.id, header, msg.body, conn.frame_max)
            # Output.emit inlined (one call less per delivery).
            if not conn.outbuf:
                self._dirty.append(conn)
            conn.outbuf.append(data)

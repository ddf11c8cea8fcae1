"""The broker's mutable entities. Hot ones are plain ``__slots__`` classes: they are created per
message or touched per frame, where attrs' generated ``__init__`` and validators would cost more
than they give. Cold ones use ``attrs.define(eq=False)`` without validators (house style).

Ordering rule: every collection here is a list, a deque or an insertion-ordered dict, never a
set, so that iteration order is the same on every replica whatever ``PYTHONHASHSEED`` is.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

import attrs

from cpgbroker.wire.fastpath import HeaderInfo, header_priority
from cpgbroker.wire.fieldtable import Table, decode_table
from cpgbroker.wire.framer import FrameReader

T = TypeVar("T")


class Message:
    """One published message. Shared by every queue it was routed to; never modified."""

    __slots__ = (
        "body",
        "delivery_mode",
        "ex_b",
        "exchange",
        "expiration_ms",
        "header",
        "headers_span",
        "id",
        "rk_b",
        "routing_key",
    )

    def __init__(
        self,
        msg_id: int,
        exchange: str,
        routing_key: str,
        header: bytes,
        body: bytes,
        delivery_mode: int,
        expiration_ms: int | None,
        headers_span: tuple[int, int] | None,
    ) -> None:
        self.id = msg_id
        self.exchange = exchange
        self.routing_key = routing_key
        # Encoded once here instead of once per delivery.
        self.ex_b = exchange.encode()
        self.rk_b = routing_key.encode()
        # The client's content-header payload, forwarded byte for byte.
        self.header = header
        self.body = body
        self.delivery_mode = delivery_mode
        self.expiration_ms = expiration_ms
        self.headers_span = headers_span

    @classmethod
    def encoded(
        cls,
        msg_id: int,
        ex_b: bytes,
        rk_b: bytes,
        header: bytes,
        body: bytes,
        delivery_mode: int,
        expiration_ms: int | None,
        headers_span: tuple[int, int] | None,
    ) -> Message:
        """The same message from its exchange and routing key as bytes (a hot-standby
        backup's change batch carries them so: no encoding again, model/standby/replica.py)."""
        m = cls.__new__(cls)
        m.id = msg_id
        m.exchange = ex_b.decode()
        m.routing_key = rk_b.decode()
        m.ex_b = ex_b
        m.rk_b = rk_b
        m.header = header
        m.body = body
        m.delivery_mode = delivery_mode
        m.expiration_ms = expiration_ms
        m.headers_span = headers_span
        return m

    def headers(self) -> dict[str, Any]:
        """The message's header table, decoded on demand (headers exchange, dead-lettering)."""
        if self.headers_span is None:
            return {}
        from pamqp import decode

        start, end = self.headers_span
        return dict(decode.field_table(self.header[start:end])[1])

    def header_table(self) -> Table:
        """The message's header table read with our codec (``wire/fieldtable.py``: every value
        as sent; the headers exchange at model version 8)."""
        if self.headers_span is None:
            return Table()
        start, end = self.headers_span
        return decode_table(self.header, start, end)[0]


class Entry:
    """A message's place in one queue: ready in ``Queue.messages`` or unacked on a channel."""

    __slots__ = ("delivery_count", "expires_at", "msg", "redelivered")

    def __init__(
        self, msg: Message, redelivered: bool, expires_at: int | None, delivery_count: int = 0
    ) -> None:
        self.msg = msg
        self.redelivered = redelivered
        self.expires_at = expires_at
        # Quorum queues only: how often it came back (requeued, or its channel closed); from 1
        # on, deliveries carry it as x-delivery-count.
        self.delivery_count = delivery_count


# RabbitMQ's limit for x-max-priority: the priority property is one octet.
MAX_PRIORITY = 255


class PriorityMessages:
    """The ready messages of a queue declared with ``x-max-priority``: one FIFO per priority,
    the highest first. It offers the part of ``deque``'s interface the broker uses, so the
    rest of the model treats both alike: ``[0]`` is the head (the next message to deliver),
    ``popleft`` takes it, ``append`` queues a message behind those of its priority, iteration
    is delivery order; :func:`put_back` puts a message back among those of its priority.

    As in RabbitMQ, a message without a priority has priority 0 and one above the maximum
    counts as the maximum; expiry and ``x-max-length`` act on the head, as in any queue."""

    __slots__ = ("bands", "count", "top")

    def __init__(self, max_priority: int) -> None:
        self.bands: list[collections.deque[Entry]] = [
            collections.deque() for _ in range(max_priority + 1)
        ]
        self.count = 0
        # No band above this one holds a message: the head is found without scanning every
        # band twice per delivery (``[0]``, then ``popleft``).
        self.top = 0

    def _band(self, e: Entry) -> collections.deque[Entry]:
        p = min(header_priority(e.msg.header), len(self.bands) - 1)
        if p > self.top:
            self.top = p
        return self.bands[p]

    def _head_band(self) -> collections.deque[Entry]:
        bands = self.bands
        i = self.top
        while i > 0 and not bands[i]:
            i -= 1
        self.top = i
        if not bands[i]:
            raise IndexError("no ready messages")
        return bands[i]

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self) -> Iterator[Entry]:
        for band in reversed(self.bands):
            yield from band

    def __getitem__(self, i: int) -> Entry:
        if i != 0:
            raise IndexError("only the head of a priority queue is addressed")
        return self._head_band()[0]

    def popleft(self) -> Entry:
        e = self._head_band().popleft()
        self.count -= 1
        return e

    def append(self, e: Entry) -> None:
        self._band(e).append(e)
        self.count += 1

    def requeue(self, e: Entry) -> None:
        _insert_by_age(self._band(e), e)
        self.count += 1

    def appendleft(self, e: Entry) -> None:
        """In front of those of its priority (a replica's update arrives from the back)."""
        self._band(e).appendleft(e)
        self.count += 1

    def remove(self, e: Entry) -> None:
        """Take ``e`` out from wherever it is (a hot-standby backup's replica, told that the
        primary settled it: model/standby/replica.py)."""
        self._band(e).remove(e)
        self.count -= 1

    def extend(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            self.append(e)

    def clear(self) -> None:
        for band in self.bands:
            band.clear()
        self.count = 0
        self.top = 0


def _insert_by_age(msgs: collections.deque[Entry], e: Entry) -> None:
    # In front of every ready message published after it: message ids grow with publishing,
    # so a queue's ready messages are in id order (but for transactions, whose messages get
    # their ids at publish and join queues at commit: the search still finds one place, the
    # same on every replica). Mostly the requeued message is older than all of them (the
    # head); otherwise a binary search, not a walk, so that rejecting many messages one by
    # one does not cost the square of their number.
    mid = e.msg.id
    if not msgs or msgs[0].msg.id > mid:
        msgs.appendleft(e)
    else:
        msgs.insert(bisect.bisect_right(msgs, mid, key=_msg_id), e)


def _msg_id(e: Entry) -> int:
    return e.msg.id


def put_back(msgs: collections.deque[Entry] | PriorityMessages, e: Entry) -> None:
    """Put a message taken from ``msgs`` back at its original place where it can be, as
    RabbitMQ does: rejecting A, B, C one by one gives A, B, C again, not C, B, A."""
    if isinstance(msgs, PriorityMessages):
        msgs.requeue(e)
    else:
        _insert_by_age(msgs, e)


def ready_messages(arguments: dict[str, Any]) -> collections.deque[Entry] | PriorityMessages:
    """The container for a queue's ready messages, by its (validated) declare arguments."""
    top = arguments.get("x-max-priority")
    if top is None:
        return collections.deque()
    return PriorityMessages(int(top))  # validated at declare: 0 to MAX_PRIORITY


class Consumer:
    __slots__ = (
        "args",
        "channel",
        "exclusive",
        "no_ack",
        "prefetch",
        "priority",
        "qseq",
        "queue",
        "tag",
        "tag_b",
        "unacked",
    )

    def __init__(
        self,
        tag: str,
        queue: Queue,
        channel: Channel,
        no_ack: bool,
        exclusive: bool,
        prefetch: int,
        args: dict[str, Any],
    ) -> None:
        self.tag = tag
        self.tag_b = tag.encode()
        self.queue = queue
        self.channel = channel
        self.no_ack = no_ack
        self.exclusive = exclusive
        # basic.qos(global=false) as RabbitMQ reads it: a limit per consumer, fixed at consume.
        self.prefetch = prefetch
        self.unacked = 0
        self.args = args
        # x-priority (validated at consume): higher goes first; derived from ``args`` so that
        # snapshots need not carry it.
        self.priority = int(args.get("x-priority", 0))
        # Derived, not replicated: a number increasing along ``queue.consumers`` (a consumer
        # is found there by bisection, not a scan; ``consumers.py`` numbers a restored list
        # the first time the number fails to find one).
        self.qseq = 0


def detach_unacked(c: Consumer) -> None:
    """A consumer goes away (cancel, channel close, queue delete): its unacked deliveries
    stay on the channel but no longer count against it, so a later consumer reusing the
    tag is not charged (and snapshots, which name consumers by tag, stay exact)."""
    if c.unacked:
        ch = c.channel
        for tag, (dq, e, dc, at) in ch.unacked.items():
            if dc is c:
                ch.unacked[tag] = (dq, e, None, at)
        c.unacked = 0


# One unacked delivery on a channel: (queue, entry, consumer or None for basic.get, the cluster
# time it was delivered at, in ms). A plain tuple on purpose: one is made per delivery, and a
# tuple costs a quarter of a slotted instance there (the per-message path is what every
# replica pays for every client). The time is what consumer timeouts measure
# (model/messages/consumertimeout.py): replicated state from model version 8 on (snapshots carry it
# then); at version 7 nothing reads it, and the switch to 8 sets it anew.
Unacked = tuple["Queue", Entry, "Consumer | None", int]

# ``Channel.ack_floor`` of a channel that has no delivery a timeout applies to.
NO_TIMEOUT = 1 << 62


class PendingPublish:
    """A basic.publish whose content is still arriving on its channel. One is made per
    publish, so a plain slotted class whose constructor takes only what basic.publish
    carries (cheaper than attrs' generated one with every field, on the per-message path)."""

    __slots__ = ("exchange", "header", "info", "mandatory", "parts", "remaining", "routing_key")

    def __init__(self, exchange: str, routing_key: str, mandatory: bool) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.mandatory = mandatory
        # The client's content-header payload (None until the header frame came) and what the
        # broker read from it.
        self.header: bytes | None = None
        self.info: HeaderInfo | None = None
        # Body bytes still to come, and the body frames so far when the body spans several
        # (None until a second frame is due: most bodies come in one frame, and need no list).
        self.remaining = 0
        self.parts: list[bytes] | None = None


@attrs.define(slots=True, eq=False)
class TxPublish:
    """A publish held by a transaction until tx.commit routes it."""

    msg: Message
    mandatory: bool


@attrs.define(slots=True, eq=False)
class TxAck:
    """A basic.ack held by a transaction."""

    tag: int
    multiple: bool


@attrs.define(slots=True, eq=False)
class TxNack:
    """A basic.nack, or a basic.reject (``multiple`` false), held by a transaction. Both
    settle as a nack at commit, as they always did (and snapshots name both "nack")."""

    tag: int
    multiple: bool
    requeue: bool


TxOp = TxPublish | TxAck | TxNack


@attrs.frozen
class QueueBinding:
    """One binding of a queue, as the queue remembers it (the exchange holds the routing
    side): what deleting the queue must undo. Made per queue.bind, off the hot path."""

    exchange: str
    routing_key: str
    arguments: dict[str, Any]


class IdList(Generic[T]):
    """An insertion-ordered collection of objects with O(1) removal by identity: what a list
    of bindings is, without the scan to remove one (a queue bound to a large exchange, and the
    exchange's own bindings, are unbound one by one). It iterates, sizes and tests like the list
    it replaced; it is deliberately not a ``list`` subclass, whose C-level fast paths would read
    the (empty) list storage instead of these items."""

    __slots__ = ("_items",)

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._items: dict[int, T] = {id(x): x for x in items}

    def append(self, x: T) -> None:
        self._items[id(x)] = x

    def discard(self, x: T) -> None:
        self._items.pop(id(x), None)

    def clear(self) -> None:
        self._items.clear()

    def __iter__(self) -> Iterator[T]:
        # A copy: callers delete while they walk (a queue's delete unbinds as it goes).
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, x: object) -> bool:
        return self._items.get(id(x)) is x

    def __repr__(self) -> str:
        return f"IdList({list(self._items.values())!r})"


@attrs.define(eq=False)
class Queue:
    name: str
    vhost: str
    durable: bool
    exclusive_owner: int | None
    auto_delete: bool
    arguments: dict[str, Any]
    # Limits and policies read from arguments at declare time.
    ttl: int | None = None
    expires: int | None = None
    max_length: int | None = None
    max_length_bytes: int | None = None
    overflow: str = "drop-head"
    dlx: str | None = None
    dlrk: str | None = None
    # x-single-active-consumer: only the eldest consumer (consumers[0]) gets messages; when it
    # goes, the next in registration order takes over.
    single_active: bool = False
    # x-queue-type quorum: deliveries carry x-delivery-count; x-delivery-limit applies.
    quorum: bool = False
    delivery_limit: int | None = None
    # A deque, or one per priority when declared with x-max-priority (PriorityMessages).
    messages: collections.deque[Entry] | PriorityMessages = attrs.Factory(collections.deque)
    consumers: list[Consumer] = attrs.Factory(list)
    # How many of them have a non-zero x-priority: dispatch ranks consumers only then, without
    # looking at every consumer per message (derived: snapshots rebuild it).
    ranked_consumers: int = 0
    # Next consumer to try: round-robin start so competing consumers share fairly.
    rr: int = 0
    unacked: int = 0
    # Bytes of bodies held (ready and unacked), for x-max-length-bytes and the memory mark.
    ready_bytes: int = 0
    had_consumers: bool = False
    last_used_ms: int = 0
    deleted: bool = False
    # Every binding of the queue, for cleanup on delete.
    bindings: IdList[QueueBinding] = attrs.Factory(IdList)
    # Publishers this queue holds back until it drains (model/resources/queueflow.py): id ->
    # connection.
    flow_paused: dict[int, Connection] = attrs.Factory(dict)
    # Derived (``ttlindex.TtlQueues``, rebuilt on restore): the queue's join number in
    # ``ttl_queues`` (-1 when not in it) and the due time of its live due-heap entry.
    ttl_order: int = -1
    ttl_due: int | None = None
    # Derived (model/routing/policies.py, re-applied on restore): the policy that applies, by name.
    policy: str | None = None
    # Statistics for the management API and metrics (RabbitMQ's message_stats publish and
    # deliver_get): messages this queue took and handed out since this replica has had it.
    # Not replicated: a newcomer starts them at 0 (a counter reset, to Prometheus).
    published_total: int = 0
    delivered_total: int = 0


@attrs.define(eq=False)
class Channel:
    id: int
    conn: Connection
    closing: bool = False
    flow_active: bool = True
    prefetch_count: int = 0
    global_prefetch: int = 0
    next_tag: int = 0
    # delivery tag -> (queue, entry, consumer or None for basic.get); tags only grow, so the
    # dict's insertion order is tag order, which multiple-acks and requeue rely on.
    unacked: dict[int, Unacked] = attrs.Factory(dict)
    consumers: dict[str, Consumer] = attrs.Factory(dict)
    confirm: bool = False
    publish_seq: int = 0
    # Highest publish seq settled but not yet confirmed to the client, and highest confirmed.
    confirm_pending: int = 0
    confirm_sent: int = 0
    tx: bool = False
    tx_ops: list[TxOp] = attrs.Factory(list)
    # The last queue declared on this channel: what an empty queue name refers to.
    last_queue: str = ""
    # A publish whose content is still arriving.
    pending: PendingPublish | None = None
    # Derived (model/messages/consumertimeout.py, rebuilt on restore): the due time of the channel's
    # live entry in the consumer-timeout heap (None: none), the smallest timeout of the queues
    # it delivered from since it had nothing unacked (a lower bound), and the queue of its
    # last delivery that must be acked (a delivery from another one looks at its timeout).
    ack_due: int | None = None
    ack_floor: int = NO_TIMEOUT
    ack_q: Queue | None = None


# Connection states, in handshake order.
AWAIT_HEADER = 0
AWAIT_START_OK = 1
AWAIT_TUNE_OK = 2
AWAIT_OPEN = 3
OPEN = 4
# We sent connection.close and wait for close-ok; only close/close-ok are read.
CLOSING = 5
CLOSED = 6


@attrs.define(eq=False)
class Connection:
    id: int
    member: int
    peer: str
    loopback: bool
    reader: FrameReader
    # Over TLS, and the user named by its verified client certificate ("" for none): what the
    # EXTERNAL mechanism logs in as (model/clients/connection.py).
    tls: bool = False
    cert_user: str = ""
    state: int = AWAIT_HEADER
    header_buf: bytes = b""
    user: str = ""
    vhost: str = ""
    channel_max: int = 0
    frame_max: int = 0
    heartbeat: int = 0
    capabilities: dict[str, bool] = attrs.Factory(dict)
    client_properties: dict[str, Any] = attrs.Factory(dict)
    channels: dict[int, Channel] = attrs.Factory(dict)
    # do-output credit: deliveries the owner allows before it must grant more.
    credit: int = 0
    want_output: bool = False
    # Whether the owner ever granted output: until then a lack of credit says nothing about
    # whether the client can take more (consumer priorities wait for the first grant only).
    granted: bool = False
    last_rx_ms: int = 0
    last_tx_ms: int = 0
    close_deadline: int | None = None
    # Names of the queues it declared exclusive (a dict as an ordered set: O(1) removal).
    exclusive_queues: dict[str, None] = attrs.Factory(dict)
    counter: int = 0
    published: bool = False
    blocked_sent: bool = False
    # Whether this replica produces output bytes for the connection. A member's own clients get
    # output; shadows skip the encoding work. Not replicated state: excluded from digests.
    emit: bool = True
    outbuf: list[bytes] = attrs.Factory(list)
    confirm_dirty: list[Channel] = attrs.Factory(list)
    # ``outbuf`` holds a confirm or tx.commit-ok (the flushed Send says so). Transient like it.
    confirm_out: bool = False
    # ``outbuf`` holds a delivery that waits for its batch (``Send.delivery_waits``). Transient.
    delivery_waits: bool = False
    # How many queues hold this connection's publishing back (model/resources/queueflow.py; derived:
    # rebuilt on restore from ``Queue.flow_paused``).
    flow_pauses: int = 0

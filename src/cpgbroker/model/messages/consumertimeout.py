"""Consumer timeouts: a channel whose oldest unacknowledged delivery waited too long is closed
(model version 8).

Theory of operation
-------------------
RabbitMQ (from 3.8.15; ``rabbit_channel:evaluate_consumer_timeout`` in 3.10.8) looks, once per
channel tick (``channel_tick_interval``, 60 s), at the channel's *oldest* delivery still to be
acknowledged (a consumer's or a basic.get's, in delivery order) and closes the channel with
406 PRECONDITION_FAILED when it was delivered more than the timeout ago (``Time < Now -
Timeout``); closing the channel requeues what it held, redelivered. The timeout is the
``consumer_timeout`` setting (30 minutes since 3.8.17, 15 in 3.8.15), or from RabbitMQ 3.12
the queue's own: the ``x-consumer-timeout`` argument of the queue the oldest delivery came
from (its ``consumer-timeout`` policy too, which we do not have). RabbitMQ does not check
that argument at declare: an integer of any type is the timeout in ms (0 or less: the next
check closes the channel), any other value means no timeout for that queue's deliveries, and
without it the setting applies (None here: no timeout).

Here the same rule is decided on cluster time (``Clock``, written by ticks) at every tick, so
every replica closes the same channel at the same event. A delivery's time is the cluster
time of the event that made it (the last tick's), the fourth element of its ``Channel.unacked``
tuple; tags only grow, so the first entry of that dict is the oldest. A channel closes at the
first tick past its oldest delivery's time plus the timeout: within one tick of the timeout,
early or late as message TTL, rather than up to RabbitMQ's minute late.

Only the channels that may be due are visited. :class:`ConsumerTimeouts` keeps a heap of
``(due, push number, channel)`` entries, validated lazily when popped (``Channel.ack_due``
names a channel's live entry), and keeps this rule: *a live entry is never later than the
moment its channel must close*. The entry says ``time of the oldest delivery + ack_floor + 1``,
where ``ack_floor`` is the smallest timeout of the queues the channel delivered from since it
last had nothing unacked. The oldest delivery only ever moves to later ones and every later
delivery's timeout is at least the floor, so acks never make an entry late: a delivery only
needs a look when it is the channel's first, or comes from another queue than the last one
(``Channel.ack_q``: one comparison per delivery on the hot path, in ``Delivery._deliver``). A
popped entry whose channel is not due is pushed again at its real time, or at the next tick
when the floor cannot say more (a channel mixing queues of different timeouts whose oldest
delivery has the longer one). The channels due at a tick are closed in the order of their
real due time, then connection id, then channel number: a function of replicated state alone,
whatever the heap went through, so a replica restored from a snapshot (which rebuilds the heap)
closes what the others close, in the same order.

In a transaction, RabbitMQ takes an acknowledged delivery off the channel's list at once;
ours stay in ``Channel.unacked`` until tx.commit, so the oldest delivery is looked for among
those no pending ack or nack of the transaction covers.

Version 7 (release 0.1.0) has no consumer timeouts: nothing is scheduled and ticks close
nothing. Deliveries made before the cluster moves to version 8 count from the event that moves
it (:meth:`ConsumerTimeouts.restart`): a replica restored from a version-7 snapshot does not
know their times.

A hot-standby backup's broker has no connections. A backup promoted to primary gets its
predecessor's deliveries back in its queues, redelivered (``shipping.promote``), and times the
deliveries it makes itself.

Owns: the heap (derived, never replicated; rebuilt on restore).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from cpgbroker.errors import AMQPError, ChannelError, ReplyCode
from cpgbroker.model.entities import NO_TIMEOUT, OPEN, Channel, Connection, Queue, TxPublish
from cpgbroker.model.output import Clock
from cpgbroker.model.versions import CONSUMER_TIMEOUTS, ModelVersion

# The queue argument (RabbitMQ 3.12 and later) that sets the timeout of a queue's deliveries.
QUEUE_ARGUMENT = "x-consumer-timeout"
# RabbitMQ's default (consumer_timeout, rabbit.app in 3.10.8): 30 minutes.
DEFAULT_MS = 1_800_000


def timeout_text(channel: int, timeout_ms: int) -> str:
    """RabbitMQ 3.10.8's reply text (``rabbit_channel:evaluate_consumer_timeout``), after
    ``PRECONDITION_FAILED - ``."""
    return (
        f"delivery acknowledgement on channel {channel} timed out. Timeout value used: "
        f"{timeout_ms} ms. This timeout value can be configured, see consumers doc guide to "
        "learn more"
    )


class ConsumerTimeouts:
    """Closes channels whose oldest delivery to acknowledge waited longer than its queue's
    consumer timeout (module docstring)."""

    __slots__ = (
        "_clock",
        "_compact_at",
        "_connections",
        "_pushes",
        "_version",
        "close_channel",
        "default_ms",
        "heap",
    )

    def __init__(
        self,
        default_ms: int | None,
        clock: Clock,
        connections: dict[int, Connection],
        version: ModelVersion,
    ) -> None:
        # The configuration's consumer_timeout (None: none but the queues' own).
        self.default_ms = default_ms
        self._clock = clock
        self._connections = connections
        self._version = version
        # (due, push number, channel): derived, validated when popped (module docstring).
        self.heap: list[tuple[int, int, Channel]] = []
        self._pushes = 0
        self._compact_at = 64
        # Channels.channel_error (set by the broker: the channel protocol comes later).
        self.close_channel: Callable[[Connection, int, AMQPError], None] | None = None

    def timeout_of(self, q: Queue) -> int | None:
        """The timeout (ms) of a delivery from ``q``, None for none (module docstring)."""
        args = q.arguments
        if QUEUE_ARGUMENT in args:
            v = args[QUEUE_ARGUMENT]
            return v if isinstance(v, int) and not isinstance(v, bool) else None
        return self.default_ms

    # ------------------------------------------------------------------ deliveries

    def delivered(self, ch: Channel, q: Queue) -> None:
        """A delivery to acknowledge from ``q`` went into ``ch.unacked``, and ``q`` is not the
        queue of the channel's previous one (``Channel.ack_q``): its timeout may lower the
        channel's floor, or start its clock."""
        ch.ack_q = q
        if self._version.current < CONSUMER_TIMEOUTS:
            return
        t = self.timeout_of(q)
        if t is not None and t < ch.ack_floor:
            ch.ack_floor = t
            self._schedule(ch)

    def _schedule(self, ch: Channel) -> None:
        """Give ``ch`` an entry no later than its floor says (it has something unacked)."""
        at = next(iter(ch.unacked.values()))[3]
        due = at + max(ch.ack_floor, -1) + 1
        live = ch.ack_due
        if live is None or due < live:
            self._push(ch, due)

    def _push(self, ch: Channel, due: int) -> None:
        ch.ack_due = due
        self._pushes += 1
        heapq.heappush(self.heap, (due, self._pushes, ch))
        if len(self.heap) > self._compact_at:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries (channels that closed, entries superseded)."""
        live: dict[int, tuple[int, int, Channel]] = {}
        for item in self.heap:
            ch = item[2]
            if ch.ack_due == item[0] and id(ch) not in live:
                live[id(ch)] = item
        self.heap = list(live.values())
        heapq.heapify(self.heap)
        self._compact_at = 2 * len(self.heap) + 64

    @staticmethod
    def _forget(ch: Channel) -> None:
        ch.ack_due = None
        ch.ack_floor = NO_TIMEOUT
        ch.ack_q = None

    # ------------------------------------------------------------------ ticks

    def on_tick(self) -> None:
        """Close the channels whose oldest delivery to acknowledge waited longer than its
        queue's timeout, in the order of when they were due (module docstring)."""
        heap = self.heap
        now = self._clock.now_ms
        if not heap or heap[0][0] > now or self._version.current < CONSUMER_TIMEOUTS:
            return
        found: list[tuple[int, int, int, Channel, int]] = []
        again: list[tuple[Channel, int]] = []
        heappop = heapq.heappop
        while heap and heap[0][0] <= now:
            due, _, ch = heappop(heap)
            if ch.ack_due != due:
                continue  # stale: superseded, or handled already
            ch.ack_due = None
            if not ch.unacked or not self._live(ch):
                self._forget(ch)
                continue
            oldest = _oldest(ch)
            timeout = None if oldest is None else self.timeout_of(oldest[0])
            if oldest is not None and timeout is not None:
                real = oldest[3] + max(timeout, -1) + 1
                if real <= now:
                    found.append((real, ch.conn.id, ch.id, ch, timeout))
                    continue
            else:
                real = NO_TIMEOUT
            floor = next(iter(ch.unacked.values()))[3] + max(ch.ack_floor, -1) + 1
            # Not due: again at its real time if the floor allows it, else at the next tick.
            again.append((ch, min(real, floor) if floor > now else now + 1))
        for ch, due in again:  # (after the loop: a push may compact the heap)
            self._push(ch, due)
        if len(found) > 1:
            found.sort(key=_close_order)
        close = self.close_channel
        assert close is not None
        for _, _, _, ch, timeout in found:
            if self._live(ch):
                self._forget(ch)
                close(
                    ch.conn,
                    ch.id,
                    ChannelError(ReplyCode.PRECONDITION_FAILED, timeout_text(ch.id, timeout)),
                )

    def _live(self, ch: Channel) -> bool:
        conn = ch.conn
        return (
            not ch.closing
            and conn.state == OPEN
            and conn.channels.get(ch.id) is ch
            and self._connections.get(conn.id) is conn
        )

    # ------------------------------------------------------------------ restore, versions

    def rebuild(self) -> None:
        """Recompute the derived state from the channels' deliveries (a restored broker)."""
        self.heap = []
        self._pushes = 0
        self._compact_at = 64
        timed = self._version.current >= CONSUMER_TIMEOUTS
        for conn in self._connections.values():
            for ch in conn.channels.values():
                self._forget(ch)
                if timed and ch.unacked and not ch.closing:
                    self._track(ch)

    def restart(self) -> None:
        """The cluster moved to model version 8 at this event: every delivery still to be
        acknowledged counts from now (module docstring)."""
        now = self._clock.now_ms
        for conn in self._connections.values():
            for ch in conn.channels.values():
                unacked = ch.unacked
                for tag, (q, e, c, _at) in unacked.items():
                    unacked[tag] = (q, e, c, now)
        self.rebuild()

    def _track(self, ch: Channel) -> None:
        floor = NO_TIMEOUT
        seen: dict[int, None] = {}
        for q, _e, _c, _at in ch.unacked.values():
            if id(q) not in seen:
                seen[id(q)] = None
                t = self.timeout_of(q)
                if t is not None and t < floor:
                    floor = t
        ch.ack_floor = floor
        if floor != NO_TIMEOUT:
            self._schedule(ch)


def _close_order(item: tuple[int, int, int, Channel, int]) -> tuple[int, int, int]:
    return item[0], item[1], item[2]


def _oldest(ch: Channel) -> Any:
    """``ch``'s oldest delivery still to be acknowledged, as RabbitMQ counts them: not one a
    pending ack or nack of its transaction covers (None when they cover all)."""
    unacked = ch.unacked
    if not ch.tx_ops:
        return next(iter(unacked.values()))
    upto = 0
    single: dict[int, None] = {}
    for op in ch.tx_ops:
        if isinstance(op, TxPublish):
            continue
        if op.multiple:
            upto = max(upto, op.tag or ch.next_tag)
        else:
            single[op.tag] = None
    for tag, item in unacked.items():
        if tag > upto and tag not in single:
            return item
    return None

"""Consumers and acknowledgements: basic.qos / consume / cancel / get / ack / nack / reject /
recover, and giving back what a channel holds.

Theory of operation
-------------------
:class:`Consumers` owns the life of a consumer (registered on its channel and its queue,
ranked by x-priority, taken away by cancel, channel close or queue delete) and the
settlement of unacked deliveries (``Channel.unacked``: tag -> (queue, entry, consumer)).
Settling is the one place a delivery ends: an ack releases the message (memory mark), a
nack or reject without requeue drops it (dead-lettering it if the queue says so), and a
requeue puts it back at its original place in the queue (``Delivery.requeue``), counted
against a quorum queue's delivery limit. After a settlement the queues it touched are
dispatched again (delivery owns dispatch), so freed prefetch is used in the same event.

In a transaction, acks and nacks are checked at once but held as records on the channel
until tx.commit settles them (``transactions.py``).

A queue's consumers are a list in registration order (``Queue.consumers``: the round-robin
order, ``Queue.rr`` an index into it, and what snapshots carry). Removing one must not cost
a scan of them all (one client can put 100,000 consumers on a queue and cancel them one by
one): each carries a number increasing along the list (``Consumer.qseq``, derived), so it is
found by bisection (:func:`consumer_position`) and taken out of the list in place.
"""

from __future__ import annotations

from bisect import bisect_left
from operator import attrgetter
from typing import Any

from pamqp import commands

from cpgbroker.errors import ChannelError, ConnectionError_, ReplyCode
from cpgbroker.model.access.permissions import READ, Permissions
from cpgbroker.model.entities import (
    Channel,
    Connection,
    Consumer,
    Entry,
    Queue,
    TxAck,
    TxNack,
    Unacked,
    detach_unacked,
)
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.output import Clock, Output
from cpgbroker.model.resources.memory import MemoryMark
from cpgbroker.model.routing.queueargs import amqp_type
from cpgbroker.model.routing.topology import DIRECT_REPLY, Topology, generated_name, reply_queue_of
from cpgbroker.wire import fastpath as fp

R = ReplyCode

_QSEQ = attrgetter("qseq")


def consumer_position(consumers: list[Consumer], c: Consumer) -> int:
    """Where ``c`` is in ``consumers`` (a queue's), or -1 if it is not there: a bisection on
    the numbers that increase along the list (``Consumer.qseq``)."""
    i = bisect_left(consumers, c.qseq, key=_QSEQ)
    if i < len(consumers) and consumers[i] is c:
        return i
    # The numbers failed: a list restored from a snapshot (restored consumers are all 0), or
    # ``c`` is not on it. Number the list once; from then on the numbers find any consumer.
    for j, x in enumerate(consumers):
        x.qseq = j
    i = c.qseq
    return i if 0 <= i < len(consumers) and consumers[i] is c else -1


def _unlink(q: Queue, c: Consumer) -> bool:
    """Take ``c`` off ``q``'s consumers if it is there; ``rr`` keeps naming the consumer it
    named, or the next one (cyclically) if that was ``c``."""
    consumers = q.consumers
    idx = consumer_position(consumers, c)
    if idx < 0:
        return False
    del consumers[idx]  # a memmove of the pointers after it: no Python-level work per consumer
    if c.priority:
        q.ranked_consumers -= 1
    if idx < q.rr:
        q.rr -= 1
    if q.rr >= len(consumers):
        q.rr = 0
    return True


class Consumers:
    __slots__ = (
        "_clock",
        "_delivery",
        "_dispatch",
        "_out",
        "_permissions",
        "_release",
        "_topology",
    )

    def __init__(
        self,
        clock: Clock,
        out: Output,
        mark: MemoryMark,
        topology: Topology,
        delivery: Delivery,
        permissions: Permissions,
    ) -> None:
        self._clock = clock
        self._out = out
        self._topology = topology
        self._delivery = delivery
        self._permissions = permissions
        # Bound once: these run per ack.
        self._release = mark.release
        self._dispatch = delivery.dispatch

    # ------------------------------------------------------------------ consumers

    def b_qos(self, conn: Connection, ch: Channel, m: Any) -> None:
        if m.prefetch_size:
            raise ConnectionError_(R.NOT_IMPLEMENTED, f"prefetch_size!=0 ({m.prefetch_size})")
        if m.global_:
            ch.global_prefetch = m.prefetch_count
        else:
            ch.prefetch_count = m.prefetch_count
        self._out.send_method(conn, ch.id, commands.Basic.QosOk())
        self._delivery.dispatch_channel(ch)

    def b_consume(self, conn: Connection, ch: Channel, m: Any) -> None:
        if m.queue == DIRECT_REPLY:
            self._reply_consume(conn, ch, m)
            return
        name = self._topology.queue_name(conn, ch, m.queue)
        self._permissions.check(conn, READ, "queue", name)
        q = self._topology.queue(conn, ch, name)
        tag = m.consumer_tag or generated_name(conn, "amq.ctag-")
        if tag in ch.consumers:
            raise ConnectionError_(R.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'")
        # RabbitMQ refuses an exclusive consumer on a single-active-consumer queue outright.
        # An exclusive consumer is always alone on its queue (these rules), so the first one
        # says whether there is one.
        consumers = q.consumers
        if (consumers or q.single_active) and (
            m.exclusive or (consumers and consumers[0].exclusive)
        ):
            raise ChannelError(
                R.ACCESS_REFUSED,
                f"queue '{q.name}' in vhost '{q.vhost}' in exclusive use",
            )
        args = dict(m.arguments or {})
        prio = args.get("x-priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise ChannelError(
                R.PRECONDITION_FAILED,
                f"invalid arg 'x-priority' for queue '{q.name}' in vhost '{q.vhost}': "
                f'"expected integer, got {amqp_type(prio)}"',
            )
        self._add(conn, ch, Consumer(tag, q, ch, m.no_ack, m.exclusive, ch.prefetch_count, args), m)

    def _reply_consume(self, conn: Connection, ch: Channel, m: Any) -> None:
        """RabbitMQ's direct reply-to (model/routing/topology.py, ``DIRECT_REPLY``): one no-ack
        consumer per channel, of a queue made for it, with RabbitMQ's refusals."""
        tag = m.consumer_tag or generated_name(conn, "amq.ctag-")
        if tag in ch.consumers:
            raise ConnectionError_(R.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'")
        if not m.no_ack:
            raise ChannelError(R.PRECONDITION_FAILED, "reply consumer cannot acknowledge")
        if reply_queue_of(ch) is not None:
            raise ChannelError(R.PRECONDITION_FAILED, "reply consumer already set")
        q = self._topology.reply_queue(conn)
        self._add(conn, ch, Consumer(tag, q, ch, True, False, ch.prefetch_count, {}), m)

    def _add(self, conn: Connection, ch: Channel, c: Consumer, m: Any) -> None:
        """Register ``c`` on its channel and queue, answer, and deliver what is ready."""
        tag, q, consumers = c.tag, c.queue, c.queue.consumers
        ch.consumers[tag] = c
        if consumers:
            c.qseq = consumers[-1].qseq + 1
        consumers.append(c)
        if c.priority:
            q.ranked_consumers += 1
        q.had_consumers = True
        q.last_used_ms = self._clock.now_ms
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Basic.ConsumeOk(consumer_tag=tag))
        self._dispatch(q)

    def b_cancel(self, conn: Connection, ch: Channel, m: Any) -> None:
        c = ch.consumers.pop(m.consumer_tag, None)
        if not m.nowait:
            self._out.send_method(conn, ch.id, commands.Basic.CancelOk(consumer_tag=m.consumer_tag))
        if c is not None and self.remove_consumer(c):
            self._dispatch(c.queue)  # a next single active consumer, or a lower priority

    def remove_consumer(self, c: Consumer) -> bool:
        """True if the queue still has consumers and ready messages: the caller dispatches it
        (the next single active consumer takes over; a lower-priority consumer may no longer
        have to wait for this one)."""
        q = c.queue
        handover = False
        detach_unacked(c)
        if _unlink(q, c):
            handover = bool(q.consumers) and bool(q.messages)
        q.last_used_ms = self._clock.now_ms
        if q.auto_delete and q.had_consumers and not q.consumers and not q.deleted:
            self._topology.delete_queue(q)
        return handover

    def remove_consumers(self, cs: list[Consumer]) -> list[Queue]:
        """Remove the consumers of one channel (it closes) at once; returns the queues to
        dispatch, as :meth:`remove_consumer` called for each in turn would have said (True
        gives the queue). Cost: the channel's unacked deliveries once, and per queue the
        smaller of its consumer list once and a bisection per consumer of ``cs`` on it, not a
        scan per consumer (a channel with many consumers on one queue made closing it
        quadratic; one consumer on a queue with many must not cost them all)."""
        if not cs:
            return []
        ch = cs[0].channel
        if any(c.unacked for c in cs):
            gone = {id(c): c for c in cs}
            unacked = ch.unacked
            for tag, (dq, e, dc, at) in unacked.items():
                if dc is not None and id(dc) in gone:
                    unacked[tag] = (dq, e, None, at)
            for c in cs:
                c.unacked = 0
        # The consumers of ``cs`` on each queue.
        mine: dict[int, list[Consumer]] = {}
        for c in cs:
            mine.setdefault(id(c.queue), []).append(c)
        now = self._clock.now_ms
        handover: list[Queue] = []
        # Per queue: its consumers before, the ids of those of ``cs`` that were on it, and
        # how many of them were removed so far in ``cs`` order (what one-by-one removal saw).
        state: dict[int, tuple[int, dict[int, None]]] = {}
        removed: dict[int, int] = {}
        for c in cs:
            q = c.queue
            qk = id(q)
            st = state.get(qk)
            if st is None:
                st = state[qk] = (len(q.consumers), self._drop_from_queue(q, mine[qk]))
                removed[qk] = 0
            before, present = st
            if id(c) in present:
                removed[qk] += 1
                left = before - removed[qk]
                if left and q.messages:
                    handover.append(q)
            else:
                left = before - removed[qk]
            q.last_used_ms = now
            if q.auto_delete and q.had_consumers and not left and not q.deleted:
                self._topology.delete_queue(q)
        return handover

    @staticmethod
    def _drop_from_queue(q: Queue, mine: list[Consumer]) -> dict[int, None]:
        """Take ``mine`` off ``q``'s consumers (returns the ids of those that were on it);
        ``rr`` keeps naming the consumer it named, or the next one left after it
        (cyclically): what removing them one by one gives."""
        if len(mine) * 8 < len(q.consumers):
            # A few among many: one by one, each found by bisection.
            return {id(c): None for c in mine if _unlink(q, c)}
        gone = {id(c): c for c in mine}
        rr = q.rr
        kept: list[Consumer] = []
        present: dict[int, None] = {}
        new_rr = -1
        ranked = 0
        for idx, c in enumerate(q.consumers):
            if id(c) in gone:
                present[id(c)] = None
                if c.priority:
                    ranked += 1
                continue
            if new_rr < 0 and idx >= rr:
                new_rr = len(kept)
            kept.append(c)
        if present:
            q.consumers = kept
            q.ranked_consumers -= ranked
            q.rr = new_rr if new_rr >= 0 else 0
        return present

    def b_get(self, conn: Connection, ch: Channel, m: Any) -> None:
        name = self._topology.queue_name(conn, ch, m.queue)
        self._permissions.check(conn, READ, "queue", name)
        q = self._topology.queue(conn, ch, name)
        now = self._clock.now_ms
        q.last_used_ms = now
        self._delivery.expire_head(q)
        if not q.messages:
            self._out.send_method(conn, ch.id, commands.Basic.GetEmpty())
            return
        e = q.messages.popleft()
        q.delivered_total += 1
        if q.ttl_order >= 0:
            self._topology.ttl_queues.note(q)
        ch.next_tag += 1
        tag = ch.next_tag
        # (Before a no_ack get releases it: runtime/replication/shipping.py, "Deliveries".)
        self._delivery.record_delivery(conn, q, e, not m.no_ack)
        if m.no_ack:
            self._release(q, e)
        else:
            ch.unacked[tag] = (q, e, None, now)
            q.unacked += 1
            if ch.ack_q is not q:
                self._delivery.on_unacked(ch, q)
        conn.last_tx_ms = now
        if conn.emit:
            msg = e.msg
            self._out.emit(
                conn,
                fp.encode_get_ok(ch.id, tag, e.redelivered, msg.ex_b, msg.rk_b, len(q.messages))
                + fp.encode_content(
                    ch.id, self._delivery.delivered_header(e), msg.body, conn.frame_max
                ),
            )

    def admin_get(self, q: Queue, count: int, ackmode: str) -> list[tuple[Entry, int]]:
        """The management API's get (``POST /api/queues/{vhost}/{name}/get``): up to
        ``count`` ready messages from ``q``'s head, each with how many were left behind it,
        then settled as RabbitMQ's ``ackmode`` says: requeued as a rejected delivery is
        (redelivered, at its place: ``*_requeue_true``), acked, or rejected without requeue
        (dead-lettered: ``reject_requeue_false``)."""
        delivery = self._delivery
        q.last_used_ms = self._clock.now_ms
        delivery.expire_head(q)
        taken: list[tuple[Entry, int]] = []
        msgs = q.messages
        while msgs and len(taken) < count:
            e = msgs.popleft()
            taken.append((e, len(msgs)))
        if not taken:
            return taken
        q.delivered_total += len(taken)
        if q.ttl_order >= 0:
            self._topology.ttl_queues.note(q)
        if ackmode.endswith("requeue_true"):
            over: list[tuple[Queue, Entry]] = []
            for e, _ in reversed(taken):
                if delivery.over_delivery_limit(q, e):
                    over.append((q, e))
                    continue
                delivery.requeue(q, e)
                delivery.track_ttl(q, e)
            delivery.dead_letter_over_limit(over)
        elif ackmode == "reject_requeue_false":
            for e, _ in taken:
                delivery.settle_dropped(q, e, "rejected")
        else:
            for e, _ in taken:
                self._release(q, e)
        self._dispatch(q)
        return taken

    def settle_head(self, q: Queue, upto: int) -> int:
        """The messages at ``q``'s head up to message id ``upto`` leave it for good, as if
        acknowledged (a pushing federation link's upstream confirmed them); how many."""
        msgs = q.messages
        n = 0
        while msgs and msgs[0].msg.id <= upto:
            self._release(q, msgs.popleft())
            n += 1
        if n:
            q.delivered_total += n
            if q.ttl_order >= 0:
                self._topology.ttl_queues.note(q)
        return n

    # ------------------------------------------------------------------ acknowledgements

    def basic_ack(self, ch: Channel, payload: bytes) -> None:
        """basic.ack, the fast path (struct-decoded)."""
        tag, multiple = fp.decode_ack(payload)
        if ch.tx:
            self._check_tags(ch, tag, multiple, 80)
            ch.tx_ops.append(TxAck(tag, multiple))
            return
        self.settle(ch, tag, multiple, None, 80)

    def b_nack(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        tag, multiple, requeue = fp.decode_nack(payload)
        if ch.tx:
            self._check_tags(ch, tag, multiple, 120)
            ch.tx_ops.append(TxNack(tag, multiple, requeue))
            return
        self.settle(ch, tag, multiple, requeue, 120)

    def b_reject(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        tag, requeue = fp.decode_reject(payload)
        if ch.tx:
            self._check_tags(ch, tag, False, 90)
            ch.tx_ops.append(TxNack(tag, False, requeue))
            return
        self.settle(ch, tag, False, requeue, 90)

    def b_ack_method(self, conn: Connection, ch: Channel, payload: bytes) -> None:
        # basic.ack arriving while a fast path did not apply (e.g. channel in tx).
        self.basic_ack(ch, payload)

    def _check_tags(self, ch: Channel, tag: int, multiple: bool, method_id: int) -> None:
        if multiple and tag == 0:
            return
        if tag not in ch.unacked:
            raise ChannelError(
                R.PRECONDITION_FAILED,
                f"unknown delivery tag {tag}",
                class_id=60,
                method_id=method_id,
            )

    def settle(
        self, ch: Channel, tag: int, multiple: bool, requeue: bool | None, method_id: int
    ) -> None:
        """ack (``requeue`` None), or nack/reject with or without requeue."""
        unacked = ch.unacked
        settled: list[Unacked]
        if multiple:
            if tag == 0:
                tag = ch.next_tag
            elif tag not in unacked:
                raise ChannelError(
                    R.PRECONDITION_FAILED,
                    f"unknown delivery tag {tag}",
                    class_id=60,
                    method_id=method_id,
                )
            settled = []
            while unacked:
                t = next(iter(unacked))
                if t > tag:
                    break
                settled.append(unacked.pop(t))
        else:
            item = unacked.pop(tag, None)
            if item is None:
                raise ChannelError(
                    R.PRECONDITION_FAILED,
                    f"unknown delivery tag {tag}",
                    class_id=60,
                    method_id=method_id,
                )
            settled = [item]
        touched: list[Queue] = []
        release = self._release
        if requeue:
            delivery = self._delivery
            over: list[tuple[Queue, Entry]] = []
            for q, e, c, _at in reversed(settled):
                if c is not None:
                    c.unacked -= 1
                q.unacked -= 1
                if q.deleted:
                    release(q, e)
                    continue
                if q not in touched:
                    touched.append(q)
                if delivery.over_delivery_limit(q, e):
                    over.append((q, e))
                    continue
                delivery.requeue(q, e)
                delivery.track_ttl(q, e)
            delivery.dead_letter_over_limit(over)
            touched.reverse()
        else:
            for q, e, c, _at in settled:
                if c is not None:
                    c.unacked -= 1
                q.unacked -= 1
                if requeue is None or q.deleted:
                    release(q, e)
                else:
                    self._delivery.settle_dropped(q, e, "rejected")
                if q not in touched:
                    touched.append(q)
        dispatch = self._dispatch
        for q in touched:
            dispatch(q)
        if ch.global_prefetch:
            self._delivery.dispatch_channel(ch)

    def b_recover(self, conn: Connection, ch: Channel, m: Any) -> None:
        if not m.requeue:
            raise ConnectionError_(R.NOT_IMPLEMENTED, "requeue=false")
        self.requeue_all(ch)
        if isinstance(m, commands.Basic.Recover):
            self._out.send_method(conn, ch.id, commands.Basic.RecoverOk())

    def requeue_all(self, ch: Channel) -> None:
        """Every unacked delivery of ``ch`` goes back to its queue (recover, channel close)."""
        if not ch.unacked:
            return
        delivery = self._delivery
        touched: list[Queue] = []
        # Taken off the channel first: a dead-lettered one may be delivered again on it below.
        items = list(ch.unacked.values())
        ch.unacked.clear()
        over: list[tuple[Queue, Entry]] = []
        # Back to their original places; in reverse tag order each lands at the head.
        for q, e, c, _at in reversed(items):
            if c is not None:
                c.unacked -= 1
            q.unacked -= 1
            if q.deleted:
                self._release(q, e)
                continue
            if q not in touched:
                touched.append(q)
            if delivery.over_delivery_limit(q, e):
                over.append((q, e))
                continue
            delivery.requeue(q, e)
        delivery.dead_letter_over_limit(over)
        for q in reversed(touched):
            if q.messages:
                delivery.track_ttl(q, q.messages[0])
            self._dispatch(q)

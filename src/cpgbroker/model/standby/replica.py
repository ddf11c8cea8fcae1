"""A hot-standby backup's broker kept by the primary's change batches (``Broker.apply`` of
:class:`~.events.Changes`).

Theory of operation
-------------------
The primary's broker records what it changed (``model/changes.py``); its runtime turns the
records into change batches (``model/shipping.py``) and multicasts them. Every member applies
them, in the cluster's order, to its stream broker, which has no connections in this mode: so
every member holds the same broker and the same snapshot digest, and everything that reads a
broker (a state update, the store, the management API) reads it as it reads any other.

* **Definitions** (vhosts, exchanges, bindings, users, policies, federation) come whole when
  they changed and are installed in place at the end of the batch, the queues keeping their
  messages. Queues declared and deleted in the batch are records of their own, at their
  place, so that the records between them find the right queue.
* **Messages** are enqueued at the back and removed when settled; a message out with a
  consumer of the primary is *kept in place* with what a client would see of it were it
  delivered again after the primary died: ``redelivered``, and a quorum queue's delivery count
  one higher. That is what closing the consumer's channel does to it
  (``Consumers.requeue_all``), done ahead; a requeue on the primary then sets the values the
  primary computed. ``shipping.promote`` does the rest when this member becomes primary.
* **The front of a queue**: a message delivered from the head of a plain queue moves to the
  queue's *front*, an insertion-ordered dict by id in front of ``Queue.messages``, so that
  settling it costs a dict pop, not a walk of the deque past every message still out with
  the primary's consumers (4 consumers with a prefetch of 1,000 keep up to 4,000 there, and
  they settle out of order). The queue's messages in order are the front's, then
  ``Queue.messages``: exactly what keeping it in place gives, so every reader of a replica
  (:func:`in_order`: snapshots, digests, state updates, promotion) sees what it saw before.
  A broker restored from a snapshot has its fronts back in ``Queue.messages``; the first
  message delivered from behind them moves them, and itself, into the front again.
  ``Queue.unacked`` counts the front, so a backup's management API shows what is out with the
  primary's consumers as unacked; snapshots count it back as ready (:func:`held`).

A backup does per message what appending to a deque and removing from it do, plus decoding
the record: no frame parsing, routing, consumer or channel bookkeeping
(``bench/shipping_bench.py``).

The batch's layout is ``model/standby/changebatch.py``'s, which reads it and hands this component
each record in turn. A batch that does not decode or does not apply is an
``InvariantError``: the member stops rather than run diverged.

Owns: an index of the broker's messages by id (derived: rebuilt from a queue when missing),
and the fronts of its queues. Changes, through their methods, the components a batch
writes: the topology (queues declared, deleted; the definitions), the memory mark (queued
bytes), delivery (the message counter), the clock, the output (shadow confirms), users,
policies, federation and the model version; queues' messages are the entities' own.
"""

from __future__ import annotations

import collections
import itertools
import struct
from collections.abc import Iterable
from typing import Any

from cpgbroker.errors import InvariantError
from cpgbroker.model.access.users import Users
from cpgbroker.model.canonical import decode, queue_from_meta, restore_user, vhost_from_part
from cpgbroker.model.config import Policy
from cpgbroker.model.entities import Entry, Message, PriorityMessages, Queue
from cpgbroker.model.federation import Federation, Upstream
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.output import Clock, Output
from cpgbroker.model.resources.memory import MemoryMark
from cpgbroker.model.routing.policies import Policies
from cpgbroker.model.routing.topology import Topology
from cpgbroker.model.standby import changebatch
from cpgbroker.model.versions import OLDEST, ModelVersion


class Replication:
    """Applies change batches to the broker it belongs to: a hot-standby backup's, which
    has no connections (``Broker.apply`` of :class:`~.events.Changes`). It is the
    :class:`~.changebatch.Records` that ``changebatch.decode`` hands a batch's records to."""

    __slots__ = (
        "_clock",
        "_delivery",
        "_federation",
        "_front",
        "_index",
        "_mark",
        "_out",
        "_policies",
        "_queued",
        "_refs",
        "_release",
        "_topology",
        "_users",
        "_version",
        "catching_up",
        "released",
    )

    def __init__(
        self,
        topology: Topology,
        delivery: Delivery,
        mark: MemoryMark,
        clock: Clock,
        out: Output,
        users: Users,
        policies: Policies,
        federation: Federation,
        version: ModelVersion,
    ) -> None:
        self._topology = topology
        self._delivery = delivery
        self._mark = mark
        # Bound once: these run per message.
        self._queued = mark.add
        self._release = mark.release
        self._clock = clock
        self._out = out
        self._users = users
        self._policies = policies
        self._federation = federation
        self._version = version
        # (vhost, queue) -> message id -> entry; derived: built from the queue when missing.
        self._index: dict[tuple[str, str], dict[int, Entry]] = {}
        # (vhost, queue) -> the queue's front (module docstring): message id -> entry, in
        # queue order. Counted in ``Queue.unacked``.
        self._front: dict[tuple[str, str], dict[int, Entry]] = {}
        # While a batch is applied: its refs -> the queue, its index of messages by id and its
        # front (model/standby/changebatch.py); empty between batches.
        self._refs: dict[int, tuple[Queue, dict[int, Entry], dict[int, Entry]]] = {}
        # Replaying the stream after a state update that left out messages consumed while
        # it was sent (snapshot.parts, ``gone``): a record for a message that is not here
        # is for one of those, and done already. Otherwise such a record is a divergence.
        self.catching_up = False
        # While a state update from this member is sent: the messages released since, as
        # (vhost, queue, id), for the updater to leave out (runtime/update/transfer.py); else None.
        self.released: list[tuple[str, str, int]] | None = None

    # The runtime says what it is doing with this replica through these (it never writes the
    # attributes above itself).

    def catch_up(self, catching_up: bool) -> None:
        """Whether the events now replayed follow a state update that left messages out (or a
        store's recovery, whose base may come from one): see ``catching_up``."""
        self.catching_up = catching_up

    def track_released(self, tracking: bool) -> None:
        """Start (an empty list) or stop (None) collecting ``released`` for a state update
        this member sends from the back of its queues."""
        self.released = [] if tracking else None

    def _entries(self, q: Queue) -> dict[int, Entry]:
        key = (q.vhost, q.name)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = {e.msg.id: e for e in self.in_order(q)}
        return index

    def _front_of(self, q: Queue) -> dict[int, Entry]:
        key = (q.vhost, q.name)
        front = self._front.get(key)
        if front is None:
            front = self._front[key] = {}
        return front

    def in_order(self, q: Queue) -> Iterable[Entry]:
        """``q``'s messages in queue order: its front's, then ``q.messages``."""
        front = self._front.get((q.vhost, q.name))
        if not front:
            return q.messages
        return itertools.chain(front.values(), q.messages)

    def from_back(self, q: Queue) -> Iterable[Entry]:
        """``q``'s messages from the back (a state update from the back, snapshot.parts)."""
        msgs = q.messages
        # reversed() walks a deque without copying it; a priority queue's bands are walked
        # once (a priority queue has no front).
        if isinstance(msgs, PriorityMessages):
            return reversed(list(msgs))
        front = self._front.get((q.vhost, q.name))
        if not front:
            return reversed(msgs)
        return itertools.chain(reversed(msgs), reversed(front.values()))

    def held(self, q: Queue) -> int:
        """How many of ``q``'s messages are in its front (counted in ``q.unacked``)."""
        front = self._front.get((q.vhost, q.name))
        return len(front) if front else 0

    @staticmethod
    def _to_front(q: Queue, front: dict[int, Entry], e: Entry) -> None:
        """Move ``q``'s messages up to ``e`` into its front (a plain queue's): the queue's
        order stays, and settling them is a dict pop from here on."""
        msgs = q.messages
        assert isinstance(msgs, collections.deque)  # (only a plain queue has a front)
        moved = msgs.index(e) + 1
        for _ in range(moved):
            x = msgs.popleft()
            front[x.msg.id] = x
        q.unacked += moved

    def fold_all(self) -> None:
        """Every queue's front back into its messages (a restart from the stores drops what
        is transient from whole queues: ``Recovered``)."""
        for vh in self._topology.vhosts.values():
            for q in vh.queues.values():
                self.fold(q)
        self._front.clear()

    def fold(self, q: Queue) -> None:
        """Put ``q``'s front back into ``q.messages`` (before it is deleted or promoted)."""
        front = self._front.pop((q.vhost, q.name), None)
        if front:
            msgs = q.messages
            assert not isinstance(msgs, PriorityMessages)  # (only a plain queue has a front)
            msgs.extendleft(reversed(front.values()))
            q.unacked -= len(front)

    def apply(self, batch: bytes) -> None:
        """Apply one change batch (in the cluster's order)."""
        try:
            self._apply(batch)
        except (KeyError, IndexError, ValueError, UnicodeDecodeError, struct.error) as e:
            raise InvariantError(f"change batch does not apply: {e!r}") from e
        finally:
            self._refs = {}

    def _apply(self, batch: bytes) -> None:
        head = changebatch.decode(batch, self)
        self._delivery.set_msg_seq(head.msg_seq)
        self._clock.set(head.now_ms)
        if head.definitions is not None:
            self._install(decode(head.definitions))
        if head.confirms:
            # A client of the primary waits for a confirm in this batch: reported as soon as
            # this member applied it (stored it: F_DURABLE), as for another member's client in
            # active-active.
            self._out.shadow_confirmed(head.durable)
        if head.applied:
            # Counted as a confirm that waits for no store: this member reports what it applied
            # at once (runtime/replication/shipping.py, "Deliveries").
            self._out.shadow_confirmed(False)

    # ------------------------------------------------------------------ a batch's records

    def msg_released(self, ref: int, msg_id: int) -> None:
        q, index, front = self._refs[ref]
        e = index.pop(msg_id, None)
        if e is None:
            if self.catching_up:
                return
            raise KeyError(msg_id)
        if front.pop(msg_id, None) is not None:
            q.unacked -= 1
        else:
            msgs = q.messages
            if msgs[0] is e:
                msgs.popleft()
            else:
                msgs.remove(e)
        self._release(q, e)
        if self.released is not None:
            self.released.append((q.vhost, q.name, msg_id))

    def msg_enqueued(self, ref: int, msg: Message, expires_at: int | None) -> None:
        q, index, _ = self._refs[ref]
        mid = msg.id
        if mid in index:
            raise InvariantError(f"message {mid} joins queue {q.name!r} twice")
        e = index[mid] = Entry(msg, False, expires_at)
        q.messages.append(e)
        size = len(msg.body)
        q.ready_bytes += size
        self._queued(size)

    def msg_delivered(self, ref: int, msg_id: int) -> None:
        q, index, front = self._refs[ref]
        e = index.get(msg_id)
        if e is None:
            if self.catching_up:
                return
            raise KeyError(msg_id)
        # What closing the consumer's channel would do (module docstring).
        e.redelivered = True
        if q.quorum:
            e.delivery_count += 1
        if msg_id not in front:
            msgs = q.messages
            if type(msgs) is collections.deque:
                if msgs[0] is e:
                    # Into the front: it all but always is the head.
                    msgs.popleft()
                    front[msg_id] = e
                    q.unacked += 1
                else:
                    # A replica restored from a snapshot, whose fronts came back as the head
                    # of their queues: the messages before this one went out before it, so
                    # they join the front with it, in order.
                    self._to_front(q, front, e)

    def msg_requeued(self, ref: int, msg_id: int, redelivered: bool, delivery_count: int) -> None:
        e = self._refs[ref][1].get(msg_id)
        if e is None:
            if self.catching_up:
                return
            raise KeyError(msg_id)
        e.redelivered = redelivered
        e.delivery_count = delivery_count

    def queue_named(self, ref: int, vhost: str, name: str) -> None:
        q = self._topology.vhosts[vhost].queues[name]
        self._refs[ref] = (q, self._entries(q), self._front_of(q))

    def queue_created(self, ref: int, q: Queue) -> None:
        self._topology.add_queue(q)
        self._refs[ref] = (q, self._index.setdefault((q.vhost, q.name), {}), self._front_of(q))

    def queue_deleted(self, ref: int) -> None:
        q, _, _ = self._refs.pop(ref)
        self._index.pop((q.vhost, q.name), None)
        self.fold(q)
        self._topology.delete_queue(q)

    # ------------------------------------------------------------------ definitions

    def _install(self, defs: list[Any]) -> None:
        """The primary's definitions replace this broker's, in place; queues keep their
        messages (a queue's metadata may have changed: a policy)."""
        topology = self._topology
        head = defs[0]
        queues = [queue_from_meta(p[2]) for p in defs[1:] if p[0] == "queue"]
        index: dict[tuple[str, str], dict[int, Entry]] = {}
        fronts: dict[tuple[str, str], dict[int, Entry]] = {}
        queued = 0
        for q in queues:
            old_vh = topology.vhosts.get(q.vhost)
            old = old_vh.queues.get(q.name) if old_vh is not None else None
            if old is None:
                continue
            q.messages = old.messages
            q.ready_bytes = old.ready_bytes
            q.unacked = old.unacked
            queued += q.ready_bytes
            key = (q.vhost, q.name)
            if key in self._index:
                index[key] = self._index[key]
            if key in self._front:
                fronts[key] = self._front[key]
        vhosts = [vhost_from_part(p[1], queues) for p in defs[1:] if p[0] == "vhost"]
        topology.restore(vhosts, tuple(head["member_urls"]), [], [])
        # Users travel only once an operator changed them (snapshot._head): else the seed's.
        users = (
            [restore_user(d) for d in head["users"]]
            if "users" in head
            else list(self._users.seeded)
        )
        if list(self._users.by_name.values()) != users:
            self._users.restore(users)
        self._policies.restore([Policy(*p) for p in head.get("policies", [])])
        self._policies.mark_applied(topology.vhosts.values())
        fed = head.get("federation", {"upstreams": [], "status": [], "recent": []})
        self._federation.restore(
            [Upstream(u[0], u[1], tuple(u[2]), *u[3:]) for u in fed["upstreams"]],
            fed["status"],
            fed["recent"],
        )
        self._mark.recount(queued)
        # The primary's model version (snapshot._head: absent at the oldest): a backup's
        # replica, and a backup promoted, run what the primary ran.
        self._version.adopt(head.get("model_version", OLDEST))
        self._index = index
        self._front = fronts

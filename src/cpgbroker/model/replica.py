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

The batch encoding is fixed-layout and versioned by its first byte (``shipping.encode_batch``
writes it): a batch crosses the network to members that may run another build, so no pickle
or marshal. A batch that does not decode or does not apply is an ``InvariantError``: the
member stops rather than run diverged.

Owns: an index of the broker's messages by id (derived: rebuilt from a queue when missing),
and the fronts of its queues.
"""

from __future__ import annotations

import collections
import itertools
import struct
from collections.abc import Iterable
from typing import Any

from cpgbroker.errors import InvariantError
from cpgbroker.model.changes import CREATED, DELETED, DELIVERED, ENQUEUED, RELEASED, REQUEUED
from cpgbroker.model.config import Policy
from cpgbroker.model.entities import Entry, Message, PriorityMessages, Queue
from cpgbroker.model.federation import Upstream
from cpgbroker.model.plain import decode, queue_from_meta, restore_user, vhost_from_part
from cpgbroker.model.versions import OLDEST

BATCH_FORMAT = 1

# Names a queue for the records after it (a queue the batch did not declare).
NAME_KIND = 0
HEAD_S = struct.Struct(">BQQB")  # format, msg_seq, now_ms, flags
F_DEFINITIONS = 1  # the definitions follow the head
F_CONFIRMS = 2  # a client waits for a confirm of this batch: report it at once
F_DURABLE = 4  # ... a confirm that waits for every store: report it once it is stored
# ... and output waits for it to be applied only (a delivery, a transient message's confirm):
# report it applied at once too, not only once stored. Release 0.1.0 ignores the bit (and so
# reports such a batch once stored: later, never wrong).
F_APPLIED = 8
LEN_S = struct.Struct(">I")
NAMED_S = struct.Struct(">BIHH")  # kind, ref, vhost length, name length
CREATED_S = struct.Struct(">BII")  # kind, ref, metadata length (then snapshot.encode of it)
REF_S = struct.Struct(">BI")  # kind, ref (deleted)
REF_ID_S = struct.Struct(">BIQ")  # kind, ref, message id (delivered, released)
REQUEUED_S = struct.Struct(">BIQBI")  # + redelivered, delivery count
# kind, ref, message id, expires_at (-1: none), whether the message follows: when it is new
# in this batch, its delivery mode, expiration (-1: none), where its header table is in the
# header (start and end, 0 and 0: none; not parsed again on every backup), the lengths of
# exchange, routing key, header and body, then those bytes.
ENQUEUED_S = struct.Struct(">BIQqB")
MESSAGE_S = struct.Struct(">BqIIBBII")


class Replication:
    """Applies change batches to the broker it belongs to: a hot-standby backup's, which
    has no connections (``Broker.apply`` of :class:`~.events.Changes`)."""

    __slots__ = ("_front", "_index", "_owner", "catching_up", "released")

    def __init__(self, owner: Any) -> None:
        # The broker (typed Any: it imports this module, which must not import it back).
        self._owner = owner
        # (vhost, queue) -> message id -> entry; derived: built from the queue when missing.
        self._index: dict[tuple[str, str], dict[int, Entry]] = {}
        # (vhost, queue) -> the queue's front (module docstring): message id -> entry, in
        # queue order. Counted in ``Queue.unacked``.
        self._front: dict[tuple[str, str], dict[int, Entry]] = {}
        # Replaying the stream after a state update that left out messages consumed while
        # it was sent (snapshot.parts, ``gone``): a record for a message that is not here
        # is for one of those, and done already. Otherwise such a record is a divergence.
        self.catching_up = False
        # While a state update from this member is sent: the messages released since, as
        # (vhost, queue, id), for the updater to leave out (runtime/update/transfer.py); else None.
        self.released: list[tuple[str, str, int]] | None = None

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
        for vh in self._owner.vhosts.values():
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

    def _apply(self, batch: bytes) -> None:
        fmt, msg_seq, now_ms, flags = HEAD_S.unpack_from(batch)
        if fmt != BATCH_FORMAT:
            raise InvariantError(f"change batch format {fmt} is not {BATCH_FORMAT}")
        p = HEAD_S.size
        defs: bytes | None = None
        if flags & F_DEFINITIONS:
            (n,) = LEN_S.unpack_from(batch, p)
            p += LEN_S.size
            defs = batch[p : p + n]
            p += n
        b = self._owner
        vhosts = b.vhosts
        mark = b.mark
        release = mark.release
        # ref -> the queue, its index of messages by id and its front.
        refs: dict[int, tuple[Queue, dict[int, Entry], dict[int, Entry]]] = {}
        new: dict[int, Message] = {}
        ref_id = REF_ID_S.unpack_from
        end = len(batch)
        while p < end:
            kind = batch[p]
            if kind == RELEASED:
                _, ref, mid = ref_id(batch, p)
                p += 13
                q, index, front = refs[ref]
                e = index.pop(mid, None)
                if e is None:
                    if self.catching_up:
                        continue
                    raise KeyError(mid)
                if front.pop(mid, None) is not None:
                    q.unacked -= 1
                else:
                    msgs = q.messages
                    if msgs[0] is e:
                        msgs.popleft()
                    else:
                        msgs.remove(e)
                release(q, e)
                if self.released is not None:
                    self.released.append((q.vhost, q.name, mid))
            elif kind == ENQUEUED:
                _, ref, mid, exp, has_msg = ENQUEUED_S.unpack_from(batch, p)
                p += ENQUEUED_S.size
                if has_msg:
                    mode, expiration, h0, h1, nx, nr, nh, nb = MESSAGE_S.unpack_from(batch, p)
                    p += MESSAGE_S.size
                    ex_b = batch[p : p + nx]
                    p += nx
                    rk_b = batch[p : p + nr]
                    p += nr
                    header = batch[p : p + nh]
                    p += nh
                    body = batch[p : p + nb]
                    p += nb
                    if p > end:
                        raise InvariantError("change batch: a message overruns the batch")
                    msg = new[mid] = Message.encoded(
                        mid,
                        ex_b,
                        rk_b,
                        header,
                        body,
                        mode,
                        None if expiration < 0 else expiration,
                        (h0, h1) if h1 else None,
                    )
                else:
                    msg = new[mid]
                q, index, _ = refs[ref]
                if mid in index:
                    raise InvariantError(f"message {mid} joins queue {q.name!r} twice")
                e = index[mid] = Entry(msg, False, None if exp < 0 else exp)
                q.messages.append(e)
                size = len(msg.body)
                q.ready_bytes += size
                mark.queued_bytes += size
            elif kind == DELIVERED:
                _, ref, mid = ref_id(batch, p)
                p += 13
                q, index, front = refs[ref]
                e = index.get(mid)
                if e is None:
                    if self.catching_up:
                        continue
                    raise KeyError(mid)
                # What closing the consumer's channel would do (module docstring).
                e.redelivered = True
                if q.quorum:
                    e.delivery_count += 1
                if mid not in front:
                    msgs = q.messages
                    if type(msgs) is collections.deque:
                        if msgs[0] is e:
                            # Into the front: it all but always is the head.
                            msgs.popleft()
                            front[mid] = e
                            q.unacked += 1
                        else:
                            # A replica restored from a snapshot, whose fronts came back as
                            # the head of their queues: the messages before this one went
                            # out before it, so they join the front with it, in order.
                            self._to_front(q, front, e)
            elif kind == REQUEUED:
                _, ref, mid, redelivered, count = REQUEUED_S.unpack_from(batch, p)
                p += REQUEUED_S.size
                e = refs[ref][1].get(mid)
                if e is None:
                    if self.catching_up:
                        continue
                    raise KeyError(mid)
                e.redelivered = bool(redelivered)
                e.delivery_count = count
            elif kind == NAME_KIND:
                _, ref, nv, nn = NAMED_S.unpack_from(batch, p)
                p += NAMED_S.size
                vhost = batch[p : p + nv].decode()
                p += nv
                name = batch[p : p + nn].decode()
                p += nn
                q = vhosts[vhost].queues[name]
                refs[ref] = (q, self._entries(q), self._front_of(q))
            elif kind == CREATED:
                _, ref, n = CREATED_S.unpack_from(batch, p)
                p += CREATED_S.size
                q = queue_from_meta(decode(batch[p : p + n]))
                p += n
                vh = vhosts.get(q.vhost) or b.topology.add_vhost(q.vhost)
                if q.name in vh.queues:
                    raise InvariantError(f"queue {q.name!r} declared but already there")
                vh.queues[q.name] = q
                refs[ref] = (q, self._index.setdefault((q.vhost, q.name), {}), self._front_of(q))
            elif kind == DELETED:
                _, ref = REF_S.unpack_from(batch, p)
                p += REF_S.size
                q, _, _ = refs.pop(ref)
                self._index.pop((q.vhost, q.name), None)
                self.fold(q)
                b.topology.delete_queue(q)
            else:
                raise InvariantError(f"unknown change record kind {kind} at byte {p}")
        if p != end:
            raise InvariantError(f"change batch overruns its {end} bytes")
        b.delivery.msg_seq = msg_seq
        b.clock.now_ms = now_ms
        if defs is not None:
            self._install(decode(defs))
        if flags & F_CONFIRMS:
            # A client of the primary waits for a confirm in this batch: reported as soon as
            # this member applied it (stored it: F_DURABLE), as for another member's client in
            # active-active.
            b.out.shadow_confirms += 1
            if flags & F_DURABLE:
                b.out.shadow_durable_confirms += 1
        if flags & F_APPLIED:
            # Counted as a confirm that waits for no store: this member reports what it applied
            # at once (runtime/replication/shipping.py, "Deliveries").
            b.out.shadow_confirms += 1

    def _install(self, defs: list[Any]) -> None:
        """The primary's definitions replace this broker's, in place; queues keep their
        messages (a queue's metadata may have changed: a policy)."""
        b = self._owner
        head = defs[0]
        queues = [queue_from_meta(p[2]) for p in defs[1:] if p[0] == "queue"]
        index: dict[tuple[str, str], dict[int, Entry]] = {}
        fronts: dict[tuple[str, str], dict[int, Entry]] = {}
        queued = 0
        for q in queues:
            old_vh = b.vhosts.get(q.vhost)
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
        b.topology.restore(vhosts, tuple(head["member_urls"]), [], [])
        # Users travel only once an operator changed them (snapshot._head): else the seed's.
        users = (
            [restore_user(d) for d in head["users"]] if "users" in head else list(b.users.seeded)
        )
        if list(b.users.by_name.values()) != users:
            b.users.restore(users)
        b.policies.restore([Policy(*p) for p in head.get("policies", [])])
        b.policies.mark_applied(b.vhosts.values())
        fed = head.get("federation", {"upstreams": [], "status": [], "recent": []})
        b.federation.restore(
            [Upstream(u[0], u[1], tuple(u[2]), *u[3:]) for u in fed["upstreams"]],
            fed["status"],
            fed["recent"],
        )
        b.mark.queued_bytes = queued
        # The primary's model version (snapshot._head: absent at the oldest): a backup's
        # replica, and a backup promoted, run what the primary ran.
        b.version.current = head.get("model_version", OLDEST)
        self._index = index
        self._front = fronts

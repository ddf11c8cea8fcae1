"""A restored broker must be indistinguishable from the original: the Qpid cluster's bug
history is mostly "this field was not transferred". These tests walk every attribute of every
entity of both brokers side by side, so a field added to an entity without snapshot support
fails here (unless it is listed in ``NOT_REPLICATED`` as deliberately local or derived)."""

from __future__ import annotations

import collections
import inspect
from typing import Any

import attrs
import pytest

from cpgbroker.errors import InvariantError
from cpgbroker.model.access.permissions import Permissions
from cpgbroker.model.access.users import Users
from cpgbroker.model.broker import Broker, VHost
from cpgbroker.model.clients.channel import Channels
from cpgbroker.model.clients.connection import ConnectionProtocol
from cpgbroker.model.config import Policy
from cpgbroker.model.entities import (
    Channel,
    Connection,
    Consumer,
    Entry,
    IdList,
    Message,
    PendingPublish,
    PriorityMessages,
    Queue,
    TxAck,
    TxNack,
    TxPublish,
)
from cpgbroker.model.federation import Federation, Seen, Upstream
from cpgbroker.model.messages.confirms import Confirms
from cpgbroker.model.messages.consumers import Consumers
from cpgbroker.model.messages.consumertimeout import ConsumerTimeouts
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.messages.transactions import Transactions
from cpgbroker.model.operators.admin import Admin
from cpgbroker.model.operators.adminops import ResourceOps
from cpgbroker.model.output import Clock, Output
from cpgbroker.model.resources.memory import MemoryMark
from cpgbroker.model.resources.queueflow import QueueFlow
from cpgbroker.model.routing.exchange import Binding, Exchange
from cpgbroker.model.routing.policies import Policies
from cpgbroker.model.routing.topology import Topology
from cpgbroker.model.standby.replica import Replication
from cpgbroker.model.state import snapshot as S
from cpgbroker.wire.fastpath import HeaderInfo
from cpgbroker.wire.framer import FrameReader
from modelclient import Harness
from workload import generate

ENTITIES = (
    Channel,
    Connection,
    Consumer,
    Entry,
    Message,
    Queue,
    Exchange,
    Binding,
    VHost,
    PendingPublish,
    TxPublish,
    TxAck,
    TxNack,
    HeaderInfo,
    Policy,
    Upstream,
    Seen,
)
# The broker and its components: every attribute of each is compared too (references between
# components and their bound methods included), so a component that grows state the snapshot
# does not carry fails here.
COMPONENTS = (
    Broker,
    Clock,
    Output,
    MemoryMark,
    Topology,
    Confirms,
    Delivery,
    Consumers,
    Transactions,
    Channels,
    ConnectionProtocol,
    QueueFlow,
    Permissions,
    Users,
    Policies,
    Admin,
    ResourceOps,
    Federation,
    Replication,
    ConsumerTimeouts,
)
# Component attributes that are transient between events or replica-local statistics
# (configuration is compared: equal by construction).
LOCAL = {"Output": {"_effects", "dirty", "shadow_confirms"}}


def _fields(obj: Any) -> list[str]:
    if attrs.has(type(obj)):
        return [a.name for a in attrs.fields(type(obj))]
    if hasattr(obj, "__dict__"):
        return list(vars(obj))
    return list(type(obj).__slots__)


def same(a: Any, b: Any, path: str, seen: dict[tuple[int, int], None]) -> None:
    """Structural equality; entities are compared field by field (once per pair, so the
    object graph's cycles terminate)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, ENTITIES + COMPONENTS):
        key = (id(a), id(b))
        if key in seen:
            return
        seen[key] = None
        name = type(a).__name__
        skip = S.NOT_REPLICATED.get(name, set()) | LOCAL.get(name, set())
        for f in _fields(a):
            if f not in skip:
                same(getattr(a, f), getattr(b, f), f"{path}.{f}", seen)
    elif inspect.ismethod(a):
        # A collaborator's bound method: the same function of the corresponding component.
        assert a.__func__ is b.__func__, f"{path}: {a.__qualname__} vs {b.__qualname__}"
        same(a.__self__, b.__self__, f"{path}.__self__", seen)
    elif isinstance(a, PriorityMessages):
        assert a.count == b.count, f"{path}: count {a.count} vs {b.count}"
        same(a.bands, b.bands, f"{path}.bands", seen)
    elif isinstance(a, FrameReader):
        assert a.pending == b.pending and a.frame_max == b.frame_max, path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]", seen)
    elif isinstance(a, IdList):
        assert isinstance(b, IdList), f"{path}: {type(b).__name__}"
        same(list(a), list(b), path, seen)
    elif isinstance(a, list | tuple | collections.deque):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]", seen)
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def assert_indistinguishable(a: Broker, b: Broker) -> None:
    same(a, b, "broker", {})
    # Reached through the components above; named here too so that a refactoring that
    # unwired one from the broker cannot skip it silently.
    for f in ("now_ms", "event_seq", "msg_seq", "queued_bytes", "blocked", "member_urls"):
        assert getattr(a, f) == getattr(b, f), f"broker.{f}"


def _replay(seed: int, steps: int) -> Broker:
    b = Broker()
    for ev in generate(seed, steps=steps):
        b.apply(ev)
    return b


@pytest.mark.parametrize("seed", range(12))
def test_restored_broker_equals_original_in_every_field(seed: int) -> None:
    b = _replay(seed, 200)
    # Small chunks, so queues span several entry parts and messages shared by queues and
    # unacked deliveries cross part boundaries.
    restored = S.restore(S.decode(S.encode(p)) for p in S.parts(b, chunk=2))
    assert_indistinguishable(b, restored)
    assert S.digest(restored) == S.digest(b)


def test_walk_covers_rich_state() -> None:
    """The workloads above must actually reach the state kinds the comparison is about."""
    kinds: dict[str, int] = collections.Counter()
    for seed in range(12):
        b = _replay(seed, 200)
        for q in (q for vh in b.vhosts.values() for q in vh.queues.values()):
            kinds["ready"] += len(q.messages)
            kinds["redelivered"] += sum(e.redelivered for e in q.messages)
            kinds["consumers"] += len(q.consumers)
            if isinstance(q.messages, PriorityMessages):
                # Messages of more than one priority waiting in a priority queue.
                kinds["prioritised"] += sum(len(b) > 0 for b in q.messages.bands) > 1
        for c in b.connections.values():
            for ch in c.channels.values():
                kinds["unacked"] += len(ch.unacked)
                kinds["tx_ops"] += len(ch.tx_ops)
                kinds["confirm"] += ch.confirm
    assert all(
        kinds[k] > 0
        for k in ("ready", "redelivered", "consumers", "unacked", "confirm", "prioritised")
    ), kinds


def test_digest_equals_hash_of_streamed_parts() -> None:
    import hashlib

    b = _replay(3, 150)
    h = hashlib.sha256()
    for p in S.parts(b, chunk=1):
        h.update(S.encode(p))
    # The chunk size is part of the encoding: members must agree on it, and they do (a
    # constant of the model version). The default-chunk digest is what checkpoints use.
    assert S.digest(b) == hashlib.sha256(b"".join(S.encode(p) for p in S.parts(b))).hexdigest()


def test_partial_or_corrupt_snapshot_is_refused() -> None:
    b = _replay(5, 120)
    ps = S.snapshot(b)
    with pytest.raises(InvariantError, match="before its tail"):
        S.restore(ps[:-1])
    with pytest.raises(InvariantError, match="format"):
        S.restore(ps[1:])
    bad = [ps[0], ["nonsense", 1]]
    with pytest.raises(InvariantError, match="unknown snapshot part"):
        S.restore(bad)


def test_empty_broker_round_trips() -> None:
    h = Harness()
    h.tick(5)
    restored = S.restore(S.snapshot(h.broker))
    assert_indistinguishable(h.broker, restored)

"""A fault loop against a running dev cluster of brokers: clients under load while members are
killed, frozen and cut off, then what the clients saw (lost, duplicated, waited).

Theory of operation
-------------------
:class:`FaultLoop` takes a running :class:`~cpgbroker.dev.cluster.DevCluster` and the
:class:`~cpgbroker.dev.brokers.BrokerSet` on it, and runs in one trio process:

* **Producers** (``producers``, one connection each) publish persistent messages of
  ``body_size`` bytes to one durable queue with publisher confirms, at most ``confirm_window``
  unconfirmed at a time. A producer never publishes a message again: every body carries (run
  id, producer, sequence number) with a fresh number per publish, so a message any consumer
  gets twice was delivered twice by the brokers, not sent twice by us. The body is in the
  layout the audit's clients use (``cpgbroker.audit.history.encode_body``), so whatever reads
  the queue with those tools knows our messages too. Which numbers were confirmed (acked) is
  recorded per producer; a publish whose confirm never came (its connection went first) is
  neither confirmed nor lost.
* **Consumers** (``consumers``, one connection each, prefetch ``prefetch``) record each
  delivery's (producer, number) and redelivered flag, then ack it. A *duplicate* is a message
  received before; an *unflagged duplicate* is one whose repeated arrival has
  ``redelivered=False``, which AMQP's at-least-once promise never allows (a message the broker
  hands out again must carry the flag).
* Every client gets every member's URL (rotated, so that in active-active mode they spread
  over the members) and, on any failure, connects again after ``reconnect_pause_s`` and goes on.
* **The schedule**: once messages flow both ways, one fault every ``interval`` seconds (the
  first after ``first_fault_s``), the kinds of ``faults`` in turn, until ``seconds`` (a fault is
  started only if it will have been undone by then; ``max_faults`` caps the count):

  - ``kill_primary_broker``: SIGKILL the primary's broker, start it again
    ``broker_restart_after_s`` later;
  - ``stop_primary_corosync``: SIGSTOP the primary's corosync, SIGCONT after ``stop_for_s``;
  - ``partition_primary``: cut the primary's node off the network, heal after
    ``partition_for_s``;
  - ``kill_backup_corosync``: SIGKILL a backup's corosync (the backups in turn), start it
    again ``corosync_restart_after_s`` later, and its broker too if it died with it.

  A broker found dead before or after a fault (it left with its corosync, say) is started
  again, and the fault's record says so.
* **The end**: publishing stops at ``seconds`` (producers get ``confirm_grace_s`` to collect
  the confirms in flight), then every fault is undone (:meth:`DevCluster.repair`, dead brokers
  started), every member must become ready, and the consumers drain the queue until every
  confirmed message arrived and nothing came for ``settle_s``, or nothing came for ``quiet_s``.
  Then the members' digests are compared (:meth:`BrokerSet.converged`).

*The primary*: in hot-standby mode the member the ready members name (their status's
``primary_url``, the majority's view: a frozen old primary may still name itself); in
active-active mode, where no member is primary, the member most of our clients are on.

*Gaps*: the longest time between two consecutive deliveries to any consumer, and between two
consecutive confirms to any producer, from the moment messages flowed until publishing ended
(a gap still open then counts up to that moment).

*Histories for the audit* (``history_dir``): every producer and consumer also records what it
did and saw (:class:`~cpgbroker.audit.history.HistoryRecorder`, one
``<run id>-<client>.history.jsonl`` each): its connections (with the member's URL), every
publish (persistent, durable queue) and its confirm (``ack``, ``nack``, or ``unknown`` when the
connection or the run ended first), every delivery of our messages with its redelivered flag,
and every ack. The faults are in the dev cluster's fault log (``faults.jsonl``): the cluster
records its own; the loop records the brokers it kills (``kill-broker``, with the member's URL)
and starts (``start-broker``). With the members' event logs, that is what ``cpgbroker audit``
needs to check the run on its own (``docs/audit.md``).

Whatever happens (an error, a cancellation), a corosync this loop stopped is resumed and a
node it cut off is healed before :meth:`FaultLoop.run` returns or raises: a frozen member left
behind would break whatever runs next on the cluster.
"""

from __future__ import annotations

import bisect
import calendar
import contextlib
import functools
import re
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio
from pamqp import commands

from cpgbroker.audit.history import LOAD_HEADER, HistoryRecorder, encode_body, producer_name
from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster, DevClusterError
from cpgbroker.dev.netns import proc_state
from cpgbroker.runtime.federation.client import AmqpClient, AmqpClientError, Confirmation

KILL_PRIMARY_BROKER = "kill_primary_broker"
STOP_PRIMARY_COROSYNC = "stop_primary_corosync"
PARTITION_PRIMARY = "partition_primary"
KILL_BACKUP_COROSYNC = "kill_backup_corosync"
FAULT_KINDS: tuple[str, ...] = (
    KILL_PRIMARY_BROKER,
    STOP_PRIMARY_COROSYNC,
    PARTITION_PRIMARY,
    KILL_BACKUP_COROSYNC,
)

# What a client's connection, channel or consumer can end with while members come and go.
CLIENT_FAILURES = (
    AmqpClientError,
    OSError,
    trio.TooSlowError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)

# Log lines of the members that tell where roles changed and who stopped serving whom.
LOG_MARKS = (
    "promoted to hot-standby primary",
    "no longer the hot-standby primary",
    "closing this member's clients",
    "stopping client service",
    "serving clients",
    "leaving the cluster",
    "waiting for quorum",
    "resuming the state",
    "hot-standby lease in doubt",
    "hot-standby lease lapsed",
    "hot-standby lease renewed",
    "ring lease lapsed",
    "ring lease renewed",
)
_LOG_TS = re.compile(r"^ts=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{3})Z ")

_T = TypeVar("_T")


class FaultLoopError(Exception):
    """The loop could not run (no messages flowed, an unknown fault kind)."""


@attrs.frozen(kw_only=True)
class FaultLoopOptions:
    """What to run; every duration in seconds (module docstring)."""

    seconds: float = 100.0
    interval: float = 8.0
    faults: tuple[str, ...] = FAULT_KINDS
    # None: as many as fit in ``seconds``.
    max_faults: int | None = None
    # None: one interval after messages flow, so the first fault hits a steady load.
    first_fault_s: float | None = None
    producers: int = 3
    consumers: int = 3
    body_size: int = 512
    confirm_window: int = 64
    prefetch: int = 100
    # Confirmed messages the queue holds before the consumers start: a standing queue, so
    # that a primary the loop cuts off still has messages to hand its consumers (with none,
    # its producers stall on their confirms and its consumers on an empty queue).
    backlog: int = 0
    # Deliveries per second each consumer takes at most while publishing goes on (None: as
    # fast as it can). Below the producers' rate the queue grows: a primary cut off then
    # still has messages to hand its consumers, as a cluster behind on its consumers has.
    # The drain is never capped.
    consume_rate: float | None = None
    reconnect_pause_s: float = 0.2
    connect_timeout_s: float = 5.0
    # Short enough that a client of a member that hangs notices within the run.
    heartbeat_s: int = 10
    broker_restart_after_s: float = 3.0
    stop_for_s: float = 4.0
    partition_for_s: float = 5.0
    corosync_restart_after_s: float = 2.0
    # Until messages must flow both ways before the schedule starts (the backlog's filling
    # included).
    start_timeout_s: float = 120.0
    confirm_grace_s: float = 10.0
    repair_timeout_s: float = 60.0
    ready_timeout_s: float = 180.0
    settle_s: float = 2.0
    quiet_s: float = 10.0
    drain_timeout_s: float = 300.0
    converge_timeout_s: float = 60.0
    # None: a queue of this run's own (``faultloop-<run id>``).
    queue: str | None = None
    delete_queue: bool = True
    # Where every client records its history for ``cpgbroker audit`` (module docstring);
    # None: no histories.
    history_dir: str | None = None

    def __attrs_post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULT_KINDS]
        if unknown:
            raise FaultLoopError(f"unknown fault kinds {unknown}: use {list(FAULT_KINDS)}")
        if self.interval <= 0 or self.seconds <= 0:
            raise FaultLoopError("seconds and interval must be positive")
        if self.body_size < LOAD_HEADER.size:
            raise FaultLoopError(
                f"body_size must leave room for the message's id ({LOAD_HEADER.size} bytes)"
            )

    def duration(self, kind: str) -> float:
        """How long a fault of ``kind`` lasts before it is undone."""
        return {
            KILL_PRIMARY_BROKER: self.broker_restart_after_s,
            STOP_PRIMARY_COROSYNC: self.stop_for_s,
            PARTITION_PRIMARY: self.partition_for_s,
            KILL_BACKUP_COROSYNC: self.corosync_restart_after_s,
        }[kind]


class _Gap:
    """The longest interval between consecutive events within a window."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.longest = 0.0
        self.at: float | None = None
        self.open = False

    def begin(self, now: float) -> None:
        self.last, self.open = now, True

    def note(self, now: float) -> None:
        if not self.open or self.last is None:
            return
        if now - self.last > self.longest:
            self.longest, self.at = now - self.last, self.last
        self.last = now

    def end(self, now: float) -> None:
        self.note(now)
        self.open = False


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _key(producer: int, seq: int) -> int:
    # One int rather than a tuple: hundreds of thousands of them are kept.
    return (producer << 40) | seq


class FaultLoop:
    """One run of the fault loop on a running cluster (module docstring)::

        result = await FaultLoop(dc, bs, FaultLoopOptions(seconds=60)).run()

    or, outside trio, :func:`run_fault_loop`. The brokers must be running and ready.

    What it does to the brokers and how it finds the primary are methods of their own
    (:meth:`survey`, :meth:`kill_broker`, :meth:`start_broker`, :meth:`freeze`, :meth:`thaw`,
    :meth:`kill_backup`, :meth:`restart_backup`, :meth:`restart_dead_brokers`,
    :meth:`unfreeze`, :meth:`repair`, :meth:`final_state`), so that a subclass runs the same
    clients, load and schedule against other brokers on the same dev cluster's nodes
    (:class:`cpgbroker.dev.rabbitnodes.RabbitFaultLoop`).
    """

    # What the result names the brokers under test.
    broker = "cpgbroker"
    # ``queue.declare`` arguments of the loop's queue (None: a plain durable queue).
    queue_arguments: dict[str, Any] | None = None

    def __init__(
        self,
        dc: DevCluster,
        bs: BrokerSet,
        options: FaultLoopOptions | None = None,
        *,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.bs = bs
        self._setup(dc, {n.nodeid: bs.ports[n.nodeid][0] for n in dc.nodes}, options, log)

    def _setup(
        self,
        dc: DevCluster,
        ports: dict[int, int],
        options: FaultLoopOptions | None,
        log: Callable[[str], None] | None,
    ) -> None:
        """What every loop keeps, whatever the brokers (``ports``: node -> the AMQP port its
        clients reach it on, at 127.0.0.1)."""
        self.dc = dc
        self.opt = options or FaultLoopOptions()
        self._log = log or (lambda _msg: None)
        # The body's run id is a 32-bit number (encode_body's layout); named in hex.
        self.run_num = secrets.randbits(32)
        self.run_id = f"{self.run_num:08x}"
        self.queue = self.opt.queue or f"faultloop-{self.run_id}"
        self.nodes = [n.nodeid for n in dc.nodes]
        self._node_by_port = {ports[n]: n for n in self.nodes}
        self._props = commands.Basic.Properties(delivery_mode=2)
        self.publishing = True
        self.t0: float | None = None
        self.wall0: float | None = None
        self.publish_end: float | None = None
        # Producers.
        self.published = 0
        self.nacked = 0
        self.confirmed: list[set[int]] = [set() for _ in range(self.opt.producers)]
        self.confirmed_count = 0
        self._backlog_filled = trio.Event()
        self._next_seq = [0] * self.opt.producers
        # Consumers: first member each message came from, by key.
        self._first_from: dict[int, int] = {}
        self.deliveries = 0
        self.duplicates = 0
        self.unflagged = 0
        self.redelivered = 0
        self.foreign = 0
        self.last_delivery: float | None = None
        self.unflagged_members: Counter[str] = Counter()
        # Node -> when a consumer connected to it last received something: a member that gave
        # its clients up must have delivered nothing after.
        self.last_delivery_from: dict[int, float] = {}
        self.reconnects = {"producers": 0, "consumers": 0}
        # Which member each client is on now (for active-active's "primary").
        self._placement: dict[str, int] = {}
        self.delivery_gap = _Gap()
        self.confirm_gap = _Gap()
        # The schedule as it went; fault start times (relative to t0) for attributing
        # duplicates to the fault before them.
        self.faults: list[dict[str, Any]] = []
        self._fault_starts: list[float] = []
        self._dups_after: Counter[int] = Counter()
        self._unflagged_after: Counter[int] = Counter()
        self._backup_turn = 0
        self._mode: str | None = None
        # Client name (p0, c1, ...) -> its history, while :meth:`run` runs with history_dir.
        self._histories: dict[str, HistoryRecorder] = {}
        # As the histories name each producer's messages (and the audit reports them).
        self._producer_names = [producer_name(self.run_num, p) for p in range(self.opt.producers)]

    # ------------------------------------------------------------------ helpers

    def _now(self) -> float:
        return trio.current_time()

    def _rel(self, t: float | None = None) -> float:
        t = self._now() if t is None else t
        return round(t - (self.t0 if self.t0 is not None else t), 3)

    def _urls(self, i: int) -> list[str]:
        # Rotated: in active-active mode clients spread over the members; in hot standby a
        # client lands on the primary whichever it tries first.
        k = i % len(self.nodes)
        order = self.nodes[k:] + self.nodes[:k]
        return [self.url(n) for n in order]

    def url(self, node: int) -> str:
        """The URL our clients reach ``node``'s broker on."""
        return self.bs.url(node)

    def _node_of(self, client: AmqpClient) -> int:
        return self._node_by_port.get(client.url.port, 0)

    def _member(self, client: AmqpClient) -> str:
        # The URL the fault log names a killed broker by: the audit ties its clients to it.
        node = self._node_of(client)
        return self.url(node) if node in self.nodes else str(client.url)

    async def _thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        # The dev tools block (signals and waits, `ip`, HTTP to the status endpoints): in a
        # thread, so that the clients' deliveries and confirms go on being timed meanwhile.
        return await trio.to_thread.run_sync(fn, *args)

    # ------------------------------------------------------------------ producers

    def _body(self, producer: int, seq: int) -> bytes:
        return encode_body(self.run_num, producer, seq, self.opt.body_size)

    def _settle(self, producer: int, pending: deque[tuple[int, Confirmation]]) -> None:
        """Record the confirms that came, in publish order (the broker confirms in order)."""
        rec = self._histories.get(f"p{producer}")
        name = self._producer_names[producer]
        while pending and pending[0][1].done:
            seq, c = pending.popleft()
            if c.acked is True:
                self.confirmed[producer].add(seq)
                self.confirmed_count += 1
                self.confirm_gap.note(self._now())
                if self.confirmed_count >= self.opt.backlog:
                    self._backlog_filled.set()
                if rec is not None:
                    rec.confirmed(name, seq, "ack")
            elif c.acked is False:
                self.nacked += 1
                if rec is not None:
                    rec.confirmed(name, seq, "nack")
            elif rec is not None:
                # Failed with its channel or connection: taken or not, nobody can say.
                rec.confirmed(name, seq, "unknown")

    def _unanswered(
        self,
        producer: int,
        pending: deque[tuple[int, Confirmation]],
        sending: list[int],
        reason: str,
    ) -> None:
        """A producer's connection ended (``reason``): the confirms that came are recorded, every
        publish still unanswered is ``unknown`` in its history, then the disconnect. Recorded at
        once, not after the reconnect pause: the audit takes a connection to have ended at its
        last record."""
        self._settle(producer, pending)
        rec = self._histories.get(f"p{producer}")
        if rec is None:
            return
        name = self._producer_names[producer]
        for seq in [*(s for s, _ in pending), *sending]:
            rec.confirmed(name, seq, "unknown")
        pending.clear()
        sending.clear()
        rec.disconnected(reason)

    async def _producer(self, producer: int) -> None:
        name = f"p{producer}"
        rec = self._histories.get(name)
        pname = self._producer_names[producer]
        while self.publishing:
            pending: deque[tuple[int, Confirmation]] = deque()
            # The publish being handed to the client: recorded as published already, so it
            # needs an outcome even if the handing over fails.
            sending: list[int] = []
            connected = False
            try:
                conn = await AmqpClient.connect(
                    self._urls(producer),
                    timeout=self.opt.connect_timeout_s,
                    heartbeat=self.opt.heartbeat_s,
                    connection_name=f"faultloop-{name}",
                )
                async with conn:
                    self._placement[name] = self._node_of(conn)
                    if rec is not None:
                        rec.connected(self._member(conn))
                        connected = True
                    ch = await conn.channel()
                    await ch.queue_declare(self.queue, durable=True, arguments=self.queue_arguments)
                    await ch.confirm_select()
                    while self.publishing:
                        seq = self._next_seq[producer]
                        # A fresh number for every publish, sent or not: never republished.
                        self._next_seq[producer] = seq + 1
                        if rec is not None:
                            # Before the publish: its time is where the audit's latency starts.
                            rec.published(pname, seq, self.queue, persistent=True, durable=True)
                            sending.append(seq)
                        c = await ch.publish("", self.queue, self._body(producer, seq), self._props)
                        sending.clear()
                        assert c is not None
                        self.published += 1
                        pending.append((seq, c))
                        self._settle(producer, pending)
                        while len(pending) >= self.opt.confirm_window:
                            await pending[0][1].wait()
                            self._settle(producer, pending)
                    # Publishing ended: collect the confirms in flight (the caller's deadline
                    # cancels a wait that never ends).
                    while pending:
                        await pending[0][1].wait()
                        self._settle(producer, pending)
                if connected:
                    self._unanswered(producer, pending, sending, "closed")
            except CLIENT_FAILURES as e:
                if connected:
                    self._unanswered(producer, pending, sending, f"lost: {type(e).__name__}")
                else:
                    self._settle(producer, pending)
                self._placement.pop(name, None)
                if not self.publishing:
                    return
                self.reconnects["producers"] += 1
                await trio.sleep(self.opt.reconnect_pause_s)
            except BaseException:
                # Cancelled when the confirm grace ran out (or the run failed): we end the
                # connection, and what is still unanswered stays unknown.
                if connected:
                    self._unanswered(producer, pending, sending, "closed")
                raise

    # ------------------------------------------------------------------ consumers

    def _record(self, body: bytes, redelivered: bool, node: int) -> tuple[int, int] | None:
        """Count one delivery; its (producer, number), or None if the message is not ours."""
        now = self._now()
        if len(body) < LOAD_HEADER.size:
            self.foreign += 1
            return None
        run, producer, seq, _sent_ns = LOAD_HEADER.unpack_from(body)
        if run != self.run_num or producer >= self.opt.producers:
            self.foreign += 1
            return None
        key = _key(producer, seq)
        self.deliveries += 1
        self.last_delivery = now
        self.last_delivery_from[node] = now
        self.delivery_gap.note(now)
        if redelivered:
            self.redelivered += 1
        first = self._first_from.get(key)
        if first is None:
            self._first_from[key] = node
            return producer, seq
        self.duplicates += 1
        bucket = self._bucket(now)
        self._dups_after[bucket] += 1
        if not redelivered:
            self.unflagged += 1
            self._unflagged_after[bucket] += 1
            self.unflagged_members[f"{first}->{node}"] += 1
        return producer, seq

    def _bucket(self, now: float) -> int:
        """Index of the last fault started before ``now``; -1 before the first; -2 once
        publishing ended (the heal and the drain)."""
        if self.publish_end is not None and now >= self.publish_end:
            return -2
        return bisect.bisect_right(self._fault_starts, self._rel(now)) - 1

    async def _consumer(self, consumer: int) -> None:
        name = f"c{consumer}"
        rec = self._histories.get(name)
        if self.opt.backlog > 0:
            await self._backlog_filled.wait()
        while True:
            connected = False
            try:
                conn = await AmqpClient.connect(
                    self._urls(consumer),
                    timeout=self.opt.connect_timeout_s,
                    heartbeat=self.opt.heartbeat_s,
                    connection_name=f"faultloop-{name}",
                )
                async with conn:
                    node = self._node_of(conn)
                    self._placement[name] = node
                    if rec is not None:
                        rec.connected(self._member(conn))
                        connected = True
                    ch = await conn.channel()
                    await ch.queue_declare(self.queue, durable=True, arguments=self.queue_arguments)
                    await ch.basic_qos(self.opt.prefetch)
                    consumer_ = await ch.consume(self.queue)
                    due = self._now()
                    async for d in consumer_:
                        mid = self._record(d.body, d.redelivered, node)
                        if rec is not None and mid is not None:
                            pname = self._producer_names[mid[0]]
                            rec.delivered(name, self.queue, pname, mid[1], d.redelivered)
                        await ch.ack(d.delivery_tag)
                        # Only once the ack is handed to the connection: an ack that raised
                        # was never sent, and the message is the broker's to hand out again.
                        if rec is not None and mid is not None:
                            rec.acked(name, self.queue, self._producer_names[mid[0]], mid[1])
                        if self.opt.consume_rate and self.publishing:
                            due = max(due, self._now() - 1.0) + 1.0 / self.opt.consume_rate
                            await trio.sleep_until(due)
                if rec is not None and connected:
                    # The broker ended our consumer; we closed the connection and start over.
                    rec.disconnected("consumer cancelled by the broker")
            except CLIENT_FAILURES as e:
                if rec is not None and connected:
                    rec.disconnected(f"lost: {type(e).__name__}")
                self._placement.pop(name, None)
                self.reconnects["consumers"] += 1
                await trio.sleep(self.opt.reconnect_pause_s)
            except BaseException:
                # Cancelled at the end of the drain: we close the connection.
                if rec is not None and connected:
                    rec.disconnected("closed")
                raise

    # ------------------------------------------------------------------ the cluster

    def statuses(self) -> dict[int, dict[str, Any] | None]:
        """Every member's status (None: not answering)."""
        return {n: self.bs.status(n) for n in self.nodes}

    def _node_of_url(self, url: str | None) -> int | None:
        if not url:
            return None
        m = re.search(r":(\d+)/?$", url)
        return self._node_by_port.get(int(m.group(1))) if m else None

    def find_primary(self) -> int | None:
        """The primary (module docstring), or None if no member is ready to say."""
        return self.survey()[0]

    def survey(self) -> tuple[int | None, dict[str, Any] | None]:
        """The primary (or None) and our queue as the primary's status shows it."""
        stats = self.statuses()
        ready = {n: s for n, s in stats.items() if s is not None and s.get("state") == "ready"}
        if self._mode is None:
            for s in ready.values():
                self._mode = str(s.get("mode", "active-active"))
                break
        primary: int | None
        if self._mode == "hot-standby":
            named = Counter(
                p for s in ready.values() if (p := self._node_of_url(s.get("primary_url")))
            )
            primary = named.most_common(1)[0][0] if named else None
        else:
            on = Counter(n for n in self._placement.values() if n in ready)
            primary = on.most_common(1)[0][0] if on else min(ready) if ready else None
        if primary is None or primary not in ready:
            return primary, None
        queue = ready[primary].get("queues", {}).get(f"/:{self.queue}")
        return primary, queue if isinstance(queue, dict) else None

    def restart_dead_brokers(self) -> list[dict[str, Any]]:
        """Start each broker whose process ended, where its node's corosync runs."""
        done = []
        for n in self.nodes:
            proc = self.bs.procs.get(n)
            if proc is not None and proc.poll() is None:
                continue
            pid = self.dc.node(n).pid
            if pid is None or proc_state(pid) in (None, "Z"):
                continue  # it would only fail: started again with its corosync
            self.start_broker(n)
            done.append({"node": n, "exit": None if proc is None else proc.returncode})
        return done

    def kill_broker(self, node: int) -> None:
        """SIGKILL ``node``'s broker, in the fault log first (the cluster records only what it
        does to corosync and the network): the audit's failure window, and its URL ties the
        clients connected there to the fault."""
        self.dc.record_fault("kill-broker", node, url=self.bs.url(node))
        self.bs.kill(node)

    def start_broker(self, node: int) -> None:
        """Start ``node``'s broker, in the fault log first (the member is back)."""
        self.dc.record_fault("start-broker", node, url=self.bs.url(node))
        self.bs.start(node)

    def unfreeze(self) -> None:
        """Resume every stopped corosync, heal every cut link (never raises)."""
        for node in self.dc.nodes:
            with contextlib.suppress(Exception):
                if node.partitioned:
                    self.dc.heal(node.nodeid)
            with contextlib.suppress(Exception):
                if node.pid is not None and (node.stopped or proc_state(node.pid) == "T"):
                    self.dc.resume(node.nodeid)

    def freeze(self, node: int) -> None:
        """``stop_primary_corosync``: SIGSTOP ``node``'s corosync."""
        self.dc.stop(node)

    def thaw(self, node: int) -> None:
        """Undo :meth:`freeze` (SIGCONT)."""
        self.dc.resume(node)

    def kill_backup(self, node: int) -> None:
        """``kill_backup_corosync``: SIGKILL ``node``'s corosync."""
        self.dc.kill(node)

    def restart_backup(self, node: int) -> dict[str, Any]:
        """Undo :meth:`kill_backup`; what the fault's record gets."""
        self.dc.start(node)
        # Its broker, if it died with its corosync, can only start once the new corosync
        # answers.
        self._wait_corosync_quorate(node, 10.0)
        proc = self.bs.procs.get(node)
        return {"broker_died_with_it": proc is None or proc.poll() is not None}

    def _wait_corosync_quorate(self, nodeid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(DevClusterError):
                if self.dc.node_status(nodeid).quorate:
                    return True
            time.sleep(0.1)
        return False

    # ------------------------------------------------------------------ the schedule

    async def _fault(self, kind: str) -> None:
        rec: dict[str, Any] = {
            "t_s": self._rel(),
            # As the members' logs write their times, to find the fault among their lines.
            "wall": _utc(time.time()),
            "kind": kind,
        }
        self.faults.append(rec)
        self._fault_starts.append(rec["t_s"])
        restarted = await self._thread(self.restart_dead_brokers)
        if restarted:
            rec["brokers_restarted_before"] = restarted
        primary, queue = await self._thread(self.survey)
        rec["primary"] = primary
        # How much the primary had to hand out when it was hit.
        rec["queue"] = queue
        if primary is None:
            rec["skipped"] = "no ready member names a primary"
            return
        duration = self.opt.duration(kind)
        # When it hit: finding the primary takes a while (a CLI tool's round trip for RabbitMQ).
        rec["hit_t_s"] = self._rel()
        try:
            if kind == KILL_PRIMARY_BROKER:
                rec["node"] = primary
                await self._thread(self.kill_broker, primary)
                await trio.sleep(duration)
                await self._thread(self.start_broker, primary)
            elif kind == STOP_PRIMARY_COROSYNC:
                rec["node"] = primary
                await self._thread(self.freeze, primary)
                try:
                    await trio.sleep(duration)
                finally:
                    with trio.CancelScope(shield=True):
                        await self._thread(self.thaw, primary)
            elif kind == PARTITION_PRIMARY:
                rec["node"] = primary
                await self._thread(self.dc.partition, primary)
                try:
                    await trio.sleep(duration)
                finally:
                    with trio.CancelScope(shield=True):
                        await self._thread(self.dc.heal, primary)
            elif kind == KILL_BACKUP_COROSYNC:
                backups = [n for n in self.nodes if n != primary]
                backup = backups[self._backup_turn % len(backups)]
                self._backup_turn += 1
                rec["node"] = backup
                await self._thread(self.kill_backup, backup)
                await trio.sleep(duration)
                rec.update(await self._thread(self.restart_backup, backup))
        except DevClusterError as e:
            rec["error"] = str(e)
        rec["undone_t_s"] = self._rel()
        restarted = await self._thread(self.restart_dead_brokers)
        if restarted:
            rec["brokers_restarted_after"] = restarted
        self._log(f"fault {len(self.faults)}: {rec}")

    async def _schedule(self) -> None:
        assert self.t0 is not None
        opt = self.opt
        first = opt.interval if opt.first_fault_s is None else opt.first_fault_s
        k = 0
        while opt.faults and (opt.max_faults is None or k < opt.max_faults):
            kind = opt.faults[k % len(opt.faults)]
            at = self.t0 + first + k * opt.interval
            if at + opt.duration(kind) > self.t0 + opt.seconds:
                break
            await trio.sleep_until(at)
            await self._fault(kind)
            k += 1
        await trio.sleep_until(self.t0 + opt.seconds)

    async def _wait_flowing(self) -> None:
        with trio.move_on_after(self.opt.start_timeout_s) as scope:
            while self.last_delivery is None or not any(self.confirmed):
                await trio.sleep(0.05)
        if scope.cancelled_caught:
            raise FaultLoopError(
                f"no messages flowed within {self.opt.start_timeout_s} s "
                f"(published {self.published}, deliveries {self.deliveries})"
            )

    # ------------------------------------------------------------------ the end

    def repair(self) -> dict[str, Any]:
        """Undo every fault, start the dead brokers, wait until every member is ready: what
        the result's ``repair`` shows (``all_ready`` among it)."""
        out: dict[str, Any] = {}
        self.unfreeze()
        try:
            self.dc.repair(timeout=self.opt.repair_timeout_s)
        except DevClusterError as e:
            out["repair_error"] = str(e)
        out["brokers_restarted"] = self.restart_dead_brokers()
        try:
            self.wait_ready()
            out["all_ready"] = True
        except DevClusterError as e:
            # A broker that exited while catching up gets one more start; after that it
            # counts as not ready.
            again = self.restart_dead_brokers()
            out["brokers_restarted"] += again
            out["all_ready"] = False
            out["ready_error"] = str(e)[-2000:]
            if again:
                try:
                    self.wait_ready()
                    out["all_ready"] = True
                    del out["ready_error"]
                except DevClusterError as e2:
                    out["ready_error"] = str(e2)[-2000:]
        return out

    def wait_ready(self) -> None:
        """Until every broker serves (DevClusterError after ``ready_timeout_s``)."""
        self.bs.wait_ready(self.nodes, timeout=self.opt.ready_timeout_s)

    def _all_confirmed_received(self) -> bool:
        return all(
            _key(p, s) in self._first_from for p, seqs in enumerate(self.confirmed) for s in seqs
        )

    async def _drain(self) -> float:
        start = self._now()
        deadline = start + self.opt.drain_timeout_s
        while self._now() < deadline:
            await trio.sleep(0.5)
            quiet = self._now() - max(self.last_delivery or start, start)
            if quiet >= self.opt.quiet_s:
                break
            if quiet >= self.opt.settle_s and self._all_confirmed_received():
                break
        return self._now() - start

    async def _delete_queue(self) -> None:
        with trio.move_on_after(15), contextlib.suppress(*CLIENT_FAILURES):
            conn = await AmqpClient.connect(self._urls(0), timeout=self.opt.connect_timeout_s)
            async with conn:
                ch = await conn.channel()
                await ch.queue_delete(self.queue)

    def log_marks(self) -> list[dict[str, Any]]:
        """The members' log lines of :data:`LOG_MARKS` since the run started, each with its
        time relative to the first fault schedule's zero (``t_s``)."""
        out: list[dict[str, Any]] = []
        if self.wall0 is None:
            return out
        for n in self.nodes:
            path: Path = self.bs.log_path(n)
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                m = _LOG_TS.match(line)
                if m is None or not any(mark in line for mark in LOG_MARKS):
                    continue
                day = time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")
                wall = calendar.timegm(day) + int(m.group(2)) / 1000
                if wall < self.wall0 - 1:
                    continue
                msg = line.split(" msg=", 1)[-1]
                out.append({"node": n, "t_s": round(wall - self.wall0, 3), "msg": msg[:300]})
        out.sort(key=lambda r: float(r["t_s"]))
        return out[:500]

    # ------------------------------------------------------------------ the run

    async def run(self) -> dict[str, Any]:
        """Run the clients and the schedule, heal, drain; the result (module docstring)."""
        healed: dict[str, Any] = {}
        drain_s = 0.0
        self._open_histories()
        try:
            async with trio.open_nursery() as consumers:
                for i in range(self.opt.consumers):
                    consumers.start_soon(self._consumer, i)
                async with trio.open_nursery() as producers:
                    for i in range(self.opt.producers):
                        producers.start_soon(self._producer, i)
                    await self._wait_flowing()
                    self.t0, self.wall0 = self._now(), time.time()
                    self.delivery_gap.begin(self.t0)
                    self.confirm_gap.begin(self.t0)
                    self._log(f"run {self.run_id}: messages flow; faults start")
                    await self._schedule()
                    self.publishing = False
                    self.publish_end = self._now()
                    self.delivery_gap.end(self.publish_end)
                    self.confirm_gap.end(self.publish_end)
                    producers.cancel_scope.deadline = self._now() + self.opt.confirm_grace_s
                self._log("publishing ended; repairing the cluster")
                healed = await self._thread(self.repair)
                self._log(f"repaired: {healed}; draining")
                drain_s = await self._drain()
                consumers.cancel_scope.cancel()
        finally:
            # Synchronous, so it runs even under cancellation.
            self.unfreeze()
            for rec in self._histories.values():
                rec.close()
        digest, converge_error, members = await self._thread(self.final_state)
        if self.opt.delete_queue:
            await self._delete_queue()
        return self._result(healed, drain_s, digest, converge_error, members)

    def final_state(self) -> tuple[str | None, str | None, dict[str, Any]]:
        """After the drain: the members' common digest (None if they disagree), why not, and
        what the result's ``members`` shows of each."""
        digest: str | None = None
        converge_error: str | None = None
        try:
            digest = self.bs.converged(self.nodes, timeout=self.opt.converge_timeout_s)
        except DevClusterError as e:
            converge_error = str(e)[-2000:]
        members: dict[str, Any] = {}
        for n, s in self.statuses().items():
            if s is None:
                members[str(n)] = None
                continue
            q = s.get("queues", {}).get(f"/:{self.queue}", {})
            members[str(n)] = {
                "state": s.get("state"),
                "role": s.get("role"),
                "primary": self._node_of_url(s.get("primary_url")),
                "queue_ready": q.get("ready"),
            }
        return digest, converge_error, members

    def _open_histories(self) -> None:
        if self.opt.history_dir is None:
            return
        where = Path(self.opt.history_dir)
        where.mkdir(parents=True, exist_ok=True)
        names = [f"p{i}" for i in range(self.opt.producers)]
        names += [f"c{i}" for i in range(self.opt.consumers)]
        for name in names:
            # The run id in the client's name: the histories of several runs may be audited
            # together (and share a directory), and a client's name must be unique.
            client = f"{self.run_id}-{name}"
            self._histories[name] = HistoryRecorder(where / f"{client}.history.jsonl", client)

    def _result(
        self,
        healed: dict[str, Any],
        drain_s: float,
        digest: str | None,
        converge_error: str | None,
        members: dict[str, Any],
    ) -> dict[str, Any]:
        confirmed = sum(len(s) for s in self.confirmed)
        lost = [
            (p, s)
            for p, seqs in enumerate(self.confirmed)
            for s in sorted(seqs)
            if _key(p, s) not in self._first_from
        ]
        confirmed_keys = {_key(p, s) for p, seqs in enumerate(self.confirmed) for s in seqs}
        for i, rec in enumerate(self.faults):
            rec["duplicates_until_next"] = self._dups_after.get(i, 0)
            rec["unflagged_until_next"] = self._unflagged_after.get(i, 0)
        return {
            "broker": self.broker,
            "run_id": self.run_id,
            "queue": self.queue,
            "history_dir": self.opt.history_dir,
            "mode": self._mode,
            "seconds": self.opt.seconds,
            "published": self.published,
            "confirmed": confirmed,
            "nacked": self.nacked,
            "lost": len(lost),
            "lost_sample": lost[:20],
            "received": len(self._first_from),
            "received_unconfirmed": sum(1 for k in self._first_from if k not in confirmed_keys),
            "deliveries": self.deliveries,
            "duplicates": self.duplicates,
            "unflagged_duplicates": self.unflagged,
            "redelivered": self.redelivered,
            "unflagged_by_members": dict(self.unflagged_members),
            "last_delivery_by_node": {
                n: round(self._rel(t), 3) for n, t in sorted(self.last_delivery_from.items())
            },
            "duplicates_before_first_fault": self._dups_after.get(-1, 0),
            "duplicates_after_publishing": self._dups_after.get(-2, 0),
            "unflagged_after_publishing": self._unflagged_after.get(-2, 0),
            "foreign_messages": self.foreign,
            "longest_consumer_gap_s": round(self.delivery_gap.longest, 3),
            "longest_consumer_gap_at_s": self._rel_or_none(self.delivery_gap.at),
            "longest_confirm_gap_s": round(self.confirm_gap.longest, 3),
            "longest_confirm_gap_at_s": self._rel_or_none(self.confirm_gap.at),
            "reconnects": dict(self.reconnects),
            "faults": self.faults,
            "all_ready": bool(healed.get("all_ready", False)),
            "repair": {k: v for k, v in healed.items() if k != "all_ready"},
            "drain_s": round(drain_s, 1),
            "digests_equal": digest is not None,
            "digest": digest,
            "converge_error": converge_error,
            "members": members,
            "log_marks": self.log_marks(),
        }

    def _rel_or_none(self, t: float | None) -> float | None:
        return None if t is None else self._rel(t)


# A hot-standby cluster shipping changes (``BrokerSet(cluster_options=...)``), and a queue that
# stands deep (``extra_config``: no publisher held back by queue flow): what a cut-off primary
# still hands out of it, a new primary would hand out again.
STANDBY_CHANGES = 'mode = "hot-standby"\nreplication = "changes"'
DEEP_QUEUE = "\n[limits]\nqueue_flow_messages = 0\n"


def frozen_primary(**more: Any) -> FaultLoopOptions:
    """One freeze of the primary's corosync (4 s) in a 16 s run, consumers held at 1,500
    deliveries per second each while publishing so that the queue stands deep: the tests'
    short loop (``more``: other options)."""
    return FaultLoopOptions(
        seconds=16,
        interval=5,
        faults=(STOP_PRIMARY_COROSYNC,),
        max_faults=1,
        consume_rate=1500,
        **more,
    )


async def fault_loop(
    dc: DevCluster,
    bs: BrokerSet,
    options: FaultLoopOptions | None = None,
    *,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """:meth:`FaultLoop.run` for callers in trio (pytest-trio tests)."""
    return await FaultLoop(dc, bs, options, log=log).run()


def run_fault_loop(
    dc: DevCluster,
    bs: BrokerSet,
    options: FaultLoopOptions | None = None,
    *,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One fault loop from synchronous code (a test, a benchmark): its result."""
    return trio.run(functools.partial(fault_loop, dc, bs, options, log=log))


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The runs as a markdown table (one row per result of :func:`run_fault_loop`). A row
    with an ``audit`` (``{"status": ..., "failed": [...]}``, as ``bench/standby_faults.py
    --audit`` adds) gets the audit's verdict in a last column. The broker column names the
    brokers and their mode (a row's ``label`` instead, if it has one)."""
    audited = any("audit" in r for r in rows)
    head = (
        "| run | broker | confirmed | lost | duplicates | duplicates without the redelivered "
        "flag | longest consumer gap | longest confirm gap |"
        + (" audit |" if audited else "")
        + "\n| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" --- |" if audited else "")
    )
    lines = [head]
    for i, r in enumerate(rows, 1):
        broker = r.get("label") or f"{r.get('broker', 'cpgbroker')} {r.get('mode') or ''}".strip()
        line = (
            f"| {r.get('run', i)} | {broker} | {r['confirmed']:,} | {r['lost']:,} "
            f"| {r['duplicates']:,} "
            f"| {r['unflagged_duplicates']:,} | {r['longest_consumer_gap_s']:.2f} s "
            f"| {r['longest_confirm_gap_s']:.2f} s |"
        )
        if audited:
            audit = r.get("audit") or {}
            failed = audit.get("failed") or []
            status = str(audit.get("status", "-"))
            line += f" {status}{': ' + ', '.join(failed) if failed else ''} |"
        lines.append(line)
    return "\n".join(lines)

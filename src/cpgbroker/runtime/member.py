"""A cluster member: the broker model driven by the CPG total order.

Every event a local client causes (connect, bytes, disconnect, do-output grant) is multicast
instead of applied; the member acts on it only when CPG delivers it back, in the same order
every other member delivers it. Events of other members' clients are applied to *shadow*
connections whose output is dropped. Membership (joins, leaves, readiness), cluster time and
digest checkpoints come from the same stream (``cpgbroker.cluster``), so every member takes
every decision at the same point of the order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from typing import IO, Any

import attrs
import trio

from cpgbroker import MODEL_VERSION, __version__
from cpgbroker.cluster import codec
from cpgbroker.cluster.checkpoint import Checkpoints, Verdict
from cpgbroker.cluster.codec import STATUS_NAMES, Checkpoint, Hello, Progress
from cpgbroker.cluster.membership import (
    READY,
    ApplyToModel,
    BecomeReady,
    Fatal,
    Membership,
    NeedUpdate,
    SendHello,
)
from cpgbroker.config import ServerConfig
from cpgbroker.cpg import (
    MAX_IOVEC,
    ConfChg,
    Deliver,
    PartitionMerge,
    RingChangeSameMembers,
    tune_malloc,
)
from cpgbroker.errors import ClusterError, CpgError
from cpgbroker.model import snapshot
from cpgbroker.model.events import ClientConnected, ClientData, Event, Tick
from cpgbroker.runtime import admin
from cpgbroker.runtime.cpg_trio import TrioCpg, open_cpg
from cpgbroker.runtime.server import Node, forced_close_frame, open_listeners, wait_for_signal

log = logging.getLogger("cpgbroker.member")

# Largest CPG message we build from queued events (below the 1 MiB atomic size, so libcpg
# never fragments; large enough to amortise the per-message cost over many frames).
MAX_BATCH_BYTES = 512 * 1024
# Digest the model after every this many applied events (same points on every member).
CHECKPOINT_EVERY = 10_000
# Cluster flow control: each member reports how far it has applied every PROGRESS_EVERY
# events (or fewer when ``max_lag`` is small), and a member stops multicasting new client
# traffic while the slowest member is more than ``[cluster] max_lag`` events behind it.
# Without this, corosync buffers for a slow member without limit (and never gives the memory
# back).
PROGRESS_EVERY = 1_000

_TYPE_NAMES = {
    "ClientData": "data",
    "ClientConnected": "connect",
    "ClientDisconnected": "disconnect",
    "DoOutput": "do-output",
    "CloseClient": "close-client",
    "Tick": "tick",
    "MemberLeft": "member-left",
    "ClusterMembers": "members",
}


def member_id(nodeid: int, pid: int) -> int:
    """Unique among live members: corosync identifies a group member by (nodeid, pid)."""
    return (nodeid << 22) | (pid & 0x3FFFFF)


def config_digest(config: ServerConfig) -> bytes:
    """What must be equal on all members for their models to stay equal."""
    b = config.broker
    assert config.cluster is not None
    relevant = attrs.asdict(b, filter=lambda a, _v: a.name not in ("member_urls",))
    relevant["group"] = config.cluster.group
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).digest()


class ClusterNode(Node):
    def __init__(self, config: ServerConfig, cpg: TrioCpg, member: int) -> None:
        super().__init__(config, member)
        assert config.cluster is not None
        self.cpg = cpg
        self.cluster_cfg = config.cluster
        self.membership = Membership(
            member,
            config.cluster.size,
            MODEL_VERSION,
            config_digest(config),
            config.cluster.url,
        )
        self.checkpoints = Checkpoints()
        self.checkpoint_every = CHECKPOINT_EVERY
        self.ready = trio.Event()
        self.failed = trio.Event()
        self.failure: str | None = None
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._send_wake = trio.Event()
        self._event_log: IO[str] | None = None
        if config.cluster.event_log:
            self._event_log = open(config.cluster.event_log, "a", buffering=1 << 16)  # noqa: SIM115
        self.delivered_events = 0
        # Latest applied sequence each other member reported (cluster flow control).
        self.peer_progress: dict[int, int] = {}
        self._progress_changed = trio.Event()
        self.lag_waits = 0
        # Members that came back from the other side of a partition: ignored until they leave.
        self.shunned: set[int] = set()
        self.max_lag = config.cluster.max_lag
        self.progress_every = max(1, min(PROGRESS_EVERY, self.max_lag // 4))

    # ------------------------------------------------------------------ sequencer

    async def submit(self, ev: Event) -> None:
        """Multicast instead of apply: the event takes effect when CPG delivers it."""
        if type(ev) is ClientData:
            lc = self.local.get(ev.conn)
            if lc is not None:
                lc.inflight += 1
            data = codec.encode_data(ev.conn, ev.data)
        else:
            data = codec.encode(ev)
        self._queue(data)

    def _queue(self, data: bytes) -> None:
        self._out.append(data)
        self._out_bytes += len(data)
        self._send_wake.set()

    async def sender(self) -> None:
        while True:
            if not self._out:
                self._send_wake = trio.Event()
                await self._send_wake.wait()
                continue
            # Take queued events up to the batch size, in order.
            out = self._out
            take = 0
            size = 2
            for data in out:
                if take and size + len(data) > MAX_BATCH_BYTES:
                    break
                size += len(data)
                take += 1
            await self._wait_for_slow_members()
            batch = out[:take]
            del out[:take]
            self._out_bytes -= size - 2
            if take < MAX_IOVEC:  # the binding gathers up to MAX_IOVEC buffers; header + batch
                await self.cpg.send(codec.HEADER, *batch)  # gathered by the kernel, no copy
            else:
                await self.cpg.send(codec.HEADER + b"".join(batch))

    def lag(self) -> int:
        """How many events the slowest ready member is behind this one."""
        seq = self.broker.event_seq
        behind = [
            seq - self.peer_progress.get(m, seq)
            for m in self.membership.ready_members
            if m != self.member
        ]
        return max(behind, default=0)

    async def _wait_for_slow_members(self) -> None:
        if self.lag() <= self.max_lag:
            return
        self.lag_waits += 1
        log.warning("holding back client traffic: a member is %d events behind", self.lag())
        while self.lag() > self.max_lag:
            self._progress_changed = trio.Event()
            with trio.move_on_after(1):
                await self._progress_changed.wait()

    # ------------------------------------------------------------------ delivery

    async def deliver_loop(self) -> None:
        cpg = self.cpg
        while True:
            for ev in await cpg.receive_batch():
                t = type(ev)
                if t is Deliver:
                    sender = member_id(ev.nodeid, ev.pid)  # type: ignore[union-attr]
                    if sender in self.shunned:
                        continue  # diverged in a partition; it is leaving
                    for e in codec.decode_batch(ev.data, sender):  # type: ignore[union-attr]
                        self._on_event(e, sender)
                elif t is ConfChg:
                    self._on_confchg(ev)  # type: ignore[arg-type]
                elif t is PartitionMerge:
                    self._on_partition_merge(ev)  # type: ignore[arg-type]
                elif t is RingChangeSameMembers:
                    log.info("ring re-formed with the same members ring=%s", ev.ring_id)  # type: ignore[union-attr]

    def _on_event(self, e: Any, sender: int) -> None:
        t = type(e)
        if t is Hello:
            self._act(self.membership.on_hello(e))
            self._log_event("hello", sender, None, 0, status=STATUS_NAMES.get(e.status, "?"))
            return
        if t is Progress:
            self.peer_progress[e.member] = e.seq
            self._progress_changed.set()
            return
        if t is Checkpoint:
            if self.membership.state == READY:
                verdict = self.checkpoints.record(
                    e.seq, e.member, e.digest, self.membership.ready_members
                )
                if verdict is not None:
                    self._on_verdict(verdict)
            return
        if self.membership.state != READY:
            return  # not serving yet: the members that serve started from the state we lack
        if t is Tick and sender != self.membership.clock_master:
            return  # a late tick from a former clock master: every member drops it alike
        self.apply(e)
        if t is ClientConnected and e.member != self.member:
            self.broker.set_emit(e.conn, False)
        elif t is ClientData and sender == self.member:
            lc = self.local.get(e.conn)
            if lc is not None:
                lc.inflight -= 1
                lc.credit_back.set()
        self._after_apply(e, sender)

    def _after_apply(self, e: Any, sender: int) -> None:
        self.delivered_events += 1
        if self._event_log is not None:
            self._log_event(
                _TYPE_NAMES.get(type(e).__name__, type(e).__name__),
                sender,
                getattr(e, "conn", None),
                len(e.data) if type(e) is ClientData else 0,
            )
        seq = self.broker.event_seq
        if seq % self.progress_every == 0:
            self._queue(codec.encode(Progress(self.member, seq)))
        if seq % self.checkpoint_every == 0:
            digest = hashlib.sha256(snapshot.encode(snapshot.snapshot(self.broker))).digest()
            self._queue(codec.encode(Checkpoint(self.member, seq, digest)))
            if self._event_log is not None:
                self._write_log({"type": "checkpoint", "seq": seq, "digest": digest.hex()})

    def _on_partition_merge(self, ev: PartitionMerge) -> None:
        """Two sides of a partition merged: neither saw what the other applied meanwhile.
        The side with more members keeps serving (on a tie, the side holding the lowest member
        id); the other side's members leave, and until they are gone nothing they send is
        applied. Both sides reach the same verdict: each knows both sides' members."""
        others = [member_id(m.nodeid, m.pid) for m in (*ev.rejoined, *ev.merged)]
        mine = [m for m in self.membership.members if m not in others]
        if (len(mine), -min(mine, default=1 << 62)) > (len(others), -min(others, default=1 << 62)):
            log.error(
                "partition healed: members %s come back from another partition with diverged "
                "state; ignoring them until they leave",
                others,
            )
            self.shunned.update(others)
            for m in others:
                self.membership.members.pop(m, None)
            return
        raise ClusterError(
            "this member was partitioned from the cluster and merged back on the smaller side: "
            "it missed events the others applied, so its state cannot be trusted; leaving "
            f"(other side: {others})"
        )

    def _on_confchg(self, ev: ConfChg) -> None:
        members = [
            m for m in (member_id(x.nodeid, x.pid) for x in ev.members) if m not in self.shunned
        ]
        joined = [
            m for m in (member_id(x.nodeid, x.pid) for x in ev.joined) if m not in self.shunned
        ]
        left = [member_id(m.nodeid, m.pid) for m in ev.left]
        self.shunned.difference_update(left)
        for m in ev.left:
            log.warning(
                "member left member=%s node=%s pid=%s reason=%s",
                member_id(m.nodeid, m.pid),
                m.nodeid,
                m.pid,
                m.reason.name,
            )
        for m in ev.joined:
            log.info("member joined node=%s pid=%s", m.nodeid, m.pid)
        self._act(self.membership.on_confchg(members, joined, left))
        if left and self.membership.state == READY:
            for verdict in self.checkpoints.members_changed(self.membership.ready_members):
                self._on_verdict(verdict)

    def _act(self, actions: list[Any]) -> None:
        for a in actions:
            t = type(a)
            if t is SendHello:
                self._queue(
                    codec.encode(
                        Hello(
                            self.member,
                            a.status,
                            MODEL_VERSION,
                            self.membership.config_digest,
                            self.cluster_cfg.url,
                            f"cpgbroker {__version__}",
                            self.now_ms(),
                        )
                    )
                )
            elif t is BecomeReady:
                # Every member becomes ready at this same event: that is where each of them
                # stands until it reports more (a member that never reports is then seen to lag).
                for m in self.membership.ready_members:
                    self.peer_progress[m] = self.broker.event_seq
                log.info(
                    "cluster ready members=%d clock_master=%s",
                    len(self.membership.members),
                    self.membership.clock_master,
                )
                self.ready.set()
            elif t is ApplyToModel:
                self.apply(a.event)
                self._after_apply(a.event, 0)
            elif t is NeedUpdate:
                raise ClusterError(
                    f"{a.reason}; state transfer to a new member is not available in this "
                    "version: restart the whole cluster, or run this member only with a "
                    "cluster that is starting"
                )
            elif t is Fatal:
                raise ClusterError(a.reason)

    def _on_verdict(self, v: Verdict) -> None:
        if self._event_log is not None:
            self._write_log(
                {
                    "type": "verdict",
                    "seq": v.seq,
                    "agreed": v.agreed,
                    "losers": list(v.losers),
                    "digests": {str(m): d.hex() for m, d in v.digests},
                }
            )
        if v.agreed:
            log.debug("checkpoint agreed seq=%s digest=%s", v.seq, v.winner.hex()[:16])
            return
        log.error(
            "REPLICAS DIVERGED seq=%s digests=%s losers=%s",
            v.seq,
            {m: d.hex()[:16] for m, d in v.digests},
            list(v.losers),
        )
        if self.member in v.losers:
            raise ClusterError(
                f"this member's state differs from the majority at event {v.seq}: leaving"
            )

    # ------------------------------------------------------------------ time and logs

    async def cluster_ticker(self) -> None:
        interval = self.config.tick_ms / 1000
        while True:
            await trio.sleep(interval)
            if self.membership.state == READY and self.membership.clock_master == self.member:
                await self.submit(Tick(self.now_ms()))

    def _log_event(self, kind: str, sender: int, conn: int | None, size: int, **extra: Any) -> None:
        if self._event_log is None:
            return
        rec: dict[str, Any] = {
            "seq": self.broker.event_seq,
            "t_ns": time.time_ns(),
            "member": self.member,
            "sender": sender,
            "type": kind,
        }
        if conn is not None:
            rec["conn"] = conn
        if size:
            rec["size"] = size
        rec.update(extra)
        self._write_log(rec)

    def _write_log(self, rec: dict[str, Any]) -> None:
        if self._event_log is not None:
            rec.setdefault("member", self.member)
            rec.setdefault("t_ns", time.time_ns())
            self._event_log.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def status(self, with_digest: bool = False) -> dict[str, Any]:
        b = self.broker
        local = sum(1 for c in b.connections if c in self.local)
        last = self.checkpoints.last
        out = super().status(with_digest)
        out.update(
            {
                "member": self.member,
                "url": self.cluster_cfg.url,
                "state": self.membership.state,
                "clock_master": self.membership.clock_master,
                "members": [
                    {
                        "member": m,
                        "url": i.url,
                        "status": STATUS_NAMES.get(i.status, "unknown")
                        if i.status is not None
                        else "unknown",
                    }
                    for m, i in self.membership.members.items()
                ],
                "connections": {"local": local, "shadow": len(b.connections) - local},
                "checkpoint": None
                if last is None
                else {"seq": last.seq, "digest": last.winner.hex(), "agreed": last.agreed},
                "cpg": {"in_flight": self.cpg.in_flight, "sent": self.cpg.stats.sent},
                "lag": {"events_behind": self.lag(), "held_back": self.lag_waits},
            }
        )
        return out

    def close(self) -> None:
        if self._event_log is not None:
            self._event_log.close()
            self._event_log = None


async def serve_member(
    config: ServerConfig,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    cluster = config.cluster
    assert cluster is not None
    log.info(
        "joining cluster group=%s size=%d netns=%s", cluster.group, cluster.size, cluster.netns
    )
    # Keep freed memory in the process: otherwise glibc returns it after every batch of large
    # CPG messages and page-faults it back for the next (measured in docs/performance.md).
    tune_malloc()
    async with open_cpg(cluster.group, netns=cluster.netns or None) as cpg:
        me = member_id(cpg.local_nodeid, os.getpid())
        node = ClusterNode(config, cpg, me)
        log.info("joined member=%s node=%s pid=%s", me, cpg.local_nodeid, os.getpid())
        try:
            async with trio.open_nursery() as nursery:

                async def guarded(fn: Any) -> None:
                    # A member that cannot stay consistent stops serving at once; the failure
                    # is reported after the nursery, not as a bare exception group.
                    try:
                        await fn()
                    except (ClusterError, CpgError) as e:
                        node.failure = str(e)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(guarded, node.sender)
                nursery.start_soon(guarded, node.deliver_loop)
                nursery.start_soon(node.cluster_ticker)
                with trio.move_on_after(cluster.ready_timeout) as wait:
                    await node.ready.wait()
                if wait.cancelled_caught:
                    node.failure = (
                        f"the cluster did not become ready within {cluster.ready_timeout:.0f} s "
                        f"(expected {cluster.size} members, have "
                        f"{len(node.membership.members)})"
                    )
                    nursery.cancel_scope.cancel()
                    await trio.lowlevel.checkpoint()
                listeners, bound = await open_listeners(config)
                if config.admin_listen:
                    await nursery.start(admin.serve_admin, config.admin_listen, node.status)
                accept_scope = trio.CancelScope()

                async def accept() -> None:
                    with accept_scope:
                        await trio.serve_listeners(node.handle, listeners, handler_nursery=nursery)

                nursery.start_soon(accept)
                task_status.started(bound)
                signum = await wait_for_signal()
                log.info("stopping member=%s signal=%s", me, signum)
                # Stop accepting before closing the listeners the accept loop waits on.
                accept_scope.cancel()
                for lst in listeners:
                    await lst.aclose()
                await node.shutdown_clients(config.shutdown_grace)
                nursery.cancel_scope.cancel()
            if node.failure is not None:
                log.error("leaving the cluster: %s", node.failure)
                # Our clients must fail over: tell them why, then drop them. The other members
                # see us leave through CPG and close our clients' shadows at that point.
                frame = forced_close_frame("member left the cluster: " + node.failure[:150])
                for lc in list(node.local.values()):
                    with (
                        trio.move_on_after(1),
                        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
                    ):
                        await lc.stream.send_all(frame)
                    await lc.stream.aclose()
                raise ClusterError(node.failure)
        finally:
            node.close()

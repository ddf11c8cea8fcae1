"""One broker process as a cluster member: the process start-up and its incarnations.

A :class:`MemberProcess` outlives the CPG memberships it goes through (quorum loss ends an
incarnation, regaining it starts a new one that takes a state update); it owns the AMQP and
state-update listeners, the status endpoint, the votequorum reader and the watchdog. Each
incarnation is one :class:`~cpgbroker.runtime.member.member.ClusterNode`, assembled by
``runtime/process/assembly.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import urllib.parse
from typing import Any

import trio

from cpgbroker.cluster.membership import member_id
from cpgbroker.corosync import cmap
from cpgbroker.corosync.cpg import tune_malloc
from cpgbroker.errors import ClusterError, CpgError
from cpgbroker.model import NEWEST, RAISE_MODEL_VERSION, Broker
from cpgbroker.runtime.admin import endpoint
from cpgbroker.runtime.amqp.localbroker import LocalBroker
from cpgbroker.runtime.amqp.server import (
    CLOSE_LINGER,
    RECV_SIZE,
    ClientStream,
    forced_close_frame,
    open_listeners,
    wait_for_signal,
)
from cpgbroker.runtime.config.settings import ServerConfig, parse_listen
from cpgbroker.runtime.member import watchdog
from cpgbroker.runtime.member.member import (
    NOT_QUORATE_TEXT,
    RESYNC_TEXT,
    SUSPEND_GRACE,
    ClusterNode,
    Inherited,
)
from cpgbroker.runtime.member.status import MemberStatus
from cpgbroker.runtime.member.storelink import StoreLink
from cpgbroker.runtime.process import sdnotify
from cpgbroker.runtime.process.assembly import assemble
from cpgbroker.runtime.ring.cpg_trio import open_cpg
from cpgbroker.runtime.ring.quorum_trio import TrioQuorum, open_quorum
from cpgbroker.runtime.update.giving import close_released

log = logging.getLogger("cpgbroker.member")

# A hot-standby backup holds a client it would turn away while the ring stands still, looking
# again this often, at most this long (after that, or once the ring moves, it answers as
# usual): the others promote one of theirs within about token + consensus of the ring
# stopping, far less than a client's handshake timeout.
HOLD_POLL = 0.02
HOLD_LIMIT = 5.0


async def reap_updaters(updates: dict[int, dict[str, Any]]) -> None:
    """Collect finished updater children (no threads: poll)."""
    while True:
        await trio.sleep(0.5)
        for pid in list(updates):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                info = updates.pop(pid)
                close_released(info)
                code = os.waitstatus_to_exitcode(status)
                (log.info if code == 0 else log.warning)(
                    "state update to member=%s finished exit=%s after %.1f s",
                    info["newcomer"],
                    code,
                    time.monotonic() - info["started"],
                )


async def open_update_listeners(update_listen: str, url: str) -> list[trio.SocketListener]:
    if update_listen:
        host, port = parse_listen(update_listen)
    else:
        host, port = urllib.parse.urlsplit(url).hostname or "127.0.0.1", 0
    return await trio.open_tcp_listeners(port, host=host)


def listener_address(lst: trio.SocketListener) -> str:
    host, port = lst.socket.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MemberProcess:
    """One broker process as a cluster member, across incarnations.

    An incarnation is one CPG membership (one :class:`ClusterNode` and its model). Losing
    quorum ends it: its clients are told to go, its state is dropped, and once the partition
    is quorate again a new incarnation joins the group as a newcomer and takes a state update.
    The AMQP listeners, the status endpoint and the votequorum handle outlive incarnations;
    while no incarnation serves, new AMQP connections are refused with connection.close 320.
    """

    def __init__(
        self,
        config: ServerConfig,
        quorum: TrioQuorum,
        notifier: sdnotify.Notifier | None = None,
    ) -> None:
        assert config.cluster is not None
        # systemd's readiness, status and watchdog (a no-op outside systemd).
        self.notifier = notifier or sdnotify.Notifier(None)
        self.config = config
        self.cluster = config.cluster
        self.quorum = quorum
        # The current incarnation, and what the process reads of it (runtime/member/status.py).
        self.node: ClusterNode | None = None
        self.member: MemberStatus | None = None
        self.conn_counter = 0
        self.incarnations = 0
        self.phase = "waiting-for-quorum"
        self.last_suspension: str | None = None
        self.refused = 0
        self.stop = trio.Event()
        # (model, history epoch) kept from an incarnation that served until quorum was lost,
        # or recovered from the store at start-up (``restarted``).
        self.kept: tuple[Broker, int] | None = None
        self.restarted = False
        # The durable store (``[store]``), shared by every incarnation.
        self.storage: StoreLink | None = (
            None if config.store is None else StoreLink(config.store, self.cluster.group)
        )
        self.watchdog: Any = None
        # The event being applied, shared by every incarnation with the watchdog's feeder.
        self.applying = watchdog.ApplyMark()
        # Updater children of every incarnation (see runtime/update/giving.py), reaped here.
        self.updates: dict[int, dict[str, Any]] = {}
        # Member-local clients (``[cluster] local_listen``): outlive incarnations, like the
        # listeners, since nothing of theirs is the cluster's.
        self.local: LocalBroker | None = (
            LocalBroker(config, self._access)
            if self.cluster.local_listen or self.cluster.local_listen_tls
            else None
        )

    def status(self, with_digest: bool = False) -> dict[str, Any]:
        member = self.member
        if member is not None and member.suspended is None:
            out = member.report(with_digest)
            if out["state"] == "ready" and self.phase != "ready":
                # The membership is ready a moment before this process serves clients (it
                # opens its listeners then): "ready" is what a client may connect to.
                out["state"] = self.phase
        else:
            out = {
                "member": None if member is None else member.member,
                "url": self.cluster.url,
                "state": self.phase,
                "digest": None,
                "event_seq": None,
                "members": [],
                # A suspended member's clients linger until they read connection.close.
                "connections": {
                    "local": 0 if member is None else member.local_clients,
                    "shadow": 0,
                },
                "queues": {},
                "quorum": self.quorum.status(),
            }
        out["incarnations"] = self.incarnations
        if self.storage is not None:
            out["store"] = self.storage.status()
        out["refused_connections"] = self.refused
        if self.local is not None:
            out["local"] = self.local.status()
        out["watchdog"] = (
            None
            if self.watchdog is None
            else {
                "pid": self.watchdog.pid,
                "timeout": self.cluster.watchdog_timeout,
                "max_apply_seconds": self.cluster.max_apply_seconds,
            }
        )
        if self.last_suspension is not None:
            out["last_suspension"] = self.last_suspension
        return out

    def _access(self) -> Broker | None:
        """Where the member-local broker takes users and vhosts from: the replica, else (before
        the member first serves, or while it waits to rejoin) the state it kept or recovered."""
        return self.replica() or (None if self.kept is None else self.kept[0])

    def replica(self) -> Broker | None:
        """The model the management API and /metrics read: the current incarnation's while it
        serves (before, a newcomer's model is still empty or half transferred; once suspended,
        it is no longer the cluster's state)."""
        return None if self.member is None else self.member.replica()

    async def admin_command(
        self, user: str, op: str, args: dict[str, Any], timeout: float
    ) -> tuple[int, Any]:
        """An operator's change (runtime/mgmt/writes.py), through the serving incarnation."""
        node, member = self.node, self.member
        if node is None or member is None or not member.serving or member.halted is not None:
            return 503, {
                "error": "unavailable",
                "reason": f"this member does not serve ({self.phase})",
            }
        if (why := member.admin_refusal()) is not None:
            # Shipping changes, only the primary's broker applies operators' changes.
            return 503, {"error": "unavailable", "reason": why}
        return await node.admin_request(user, op, args, timeout)

    async def control(self, path: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``POST /stop`` {"member": ID} (none: the whole cluster), ``POST /upgrade-finish``
        {"version": N} (none: the newest this member applies) and ``POST /faults``
        {"kind", "at_seq", "seconds"} from the status endpoint."""
        node, member = self.node, self.member
        if node is None or member is None or not member.serving or member.halted is not None:
            return 409, {"error": f"this member does not serve ({self.phase}): ask another"}
        try:
            if path == "/stop":
                target = endpoint.json_int(args, "member", 0)
                seq = await node.request_stop(target)
                return 202, {"stopping": target if target else "cluster", "at_seq": seq}
            if path == "/upgrade-finish":
                version = endpoint.json_int(args, "version", NEWEST)
                return await self.admin_command(
                    "operator", RAISE_MODEL_VERSION, {"version": version}, endpoint.REQUEST_TIMEOUT
                )
            if path == "/faults":
                if not self.cluster.fault_injection:
                    return 403, {"error": "fault injection is off ([cluster] fault_injection)"}
                return 200, node.inject_fault(
                    str(args.get("kind")),
                    endpoint.json_int(args, "at_seq", member.event_seq + 1),
                    float(args.get("seconds", 0.0)),
                )
        except (ClusterError, ValueError, TypeError) as e:
            return 400, {"error": str(e)}
        except trio.TooSlowError:
            return 409, {"error": "the request was not delivered back in time"}
        return 404, {"error": f"no control request {path}"}

    async def feed_watchdog(self) -> None:
        """Signs of life for the watchdog process and, under systemd, for systemd's watchdog
        (``WatchdogSec``), from the event loop that processes the stream: if that loop blocks
        or the process stops, the feeding stops and either kills the member. While the loop
        is inside one long event, a thread feeds for it as long as it makes progress
        (``runtime/member/watchdog.py``, "Slow events are not hangs")."""
        periods = [self.cluster.watchdog_timeout / 5, self.notifier.watchdog_period or 0.0]
        period = min(p for p in periods if p > 0)

        def feed() -> None:
            if self.watchdog is not None:
                watchdog.feed(self.watchdog)
            self.notifier.watchdog()

        feeder = watchdog.BusyFeeder(feed, self.applying, period, self.cluster.max_apply_seconds)
        feeder.start()  # from this thread: it watches the event loop thread's CPU time
        try:
            while True:
                feed()
                await trio.sleep(period)
        finally:
            feeder.stop()

    def progress(self) -> str:
        """One line for ``systemctl status`` (cheap: no model work)."""
        member = self.member
        return sdnotify.member_line(
            self.phase,
            None if member is None else member.state_name(),
            [] if member is None else member.members(),
            self.cluster.size,
            None if member is None else member.member,
        )

    async def handle_client(self, stream: ClientStream, held: bool = False) -> None:
        node, member = self.node, self.member
        if self.stop.is_set():
            await refuse(stream, "broker shutdown")
            return
        if node is None or member is None or not member.serving:
            self.refused += 1
            await refuse(stream, NOT_QUORATE_TEXT if not self.quorum.quorate else RESYNC_TEXT)
            return
        if member.halted is not None:
            # A stop request stopped this member: its clients are being let go (it may still
            # wait a few seconds for their last confirms), and a new one is told so at once
            # rather than served by a member that applies nothing more.
            self.refused += 1
            await refuse(stream, member.stop_text())
            return
        refusal = member.client_refusal(self.config.broker)
        if refusal is not None and not held and member.ring_stands_still():
            # A hot-standby backup while the ring stands still: the primary may be gone and
            # this member promoted in a moment. Hold the client (it waits for connection.start)
            # until the ring moves again, rather than send it round members that cannot serve
            # it either (runtime/replication/standby.py, "Holding clients").
            with trio.move_on_after(HOLD_LIMIT):
                while (
                    member is self.member
                    and member.ring_stands_still()
                    and member.client_refusal(self.config.broker) is not None
                ):
                    await trio.sleep(HOLD_POLL)
            await self.handle_client(stream, held=True)
            return
        if refusal is not None:
            # A hot-standby backup: the client is told where the primary is.
            self.refused += 1
            await refuse(stream, *refusal)
            return
        await node.serve_client(stream)

    async def run(
        self, task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await self._run(task_status)
        finally:
            self._close_store()

    def _close_store(self) -> None:
        """Stopped on purpose: everything applied is fsynced and the store marked clean.
        Failed: closed as is (the next start recovers to the last whole record)."""
        storage, self.storage = self.storage, None
        if storage is None:
            return
        member = self.member
        clean = self.stop.is_set() and (member is None or member.failure is None)
        last = 0 if member is None else member.event_seq
        try:
            storage.close(clean, last)
        except OSError as e:
            log.error("closing the store failed: %s", e)

    async def _run(self, task_status: trio.TaskStatus[list[tuple[str, int]]]) -> None:
        config, cluster = self.config, self.cluster
        listeners: list[trio.abc.Listener[ClientStream]] = []
        async with trio.open_nursery() as outer:
            if config.admin_listen:
                # Before readiness: ``status`` shows a joining member's quorum and progress.
                await outer.start(
                    functools.partial(
                        endpoint.serve_admin,
                        ssl_context=endpoint.admin_ssl_context(config),
                        replica=self.replica,
                        users=config.broker.users,
                        cluster_name=config.broker.cluster_name,
                        command=self.admin_command,
                    ),
                    config.admin_listen,
                    self.status,
                    self.control,
                    endpoint.load_secret(config),
                )
            if cluster.watchdog_timeout > 0:
                self.watchdog = watchdog.spawn(cluster.watchdog_timeout)
                log.info("watchdog pid=%s timeout=%gs", self.watchdog.pid, cluster.watchdog_timeout)
            if self.watchdog is not None or self.notifier.watchdog_period is not None:
                outer.start_soon(self.feed_watchdog)
            outer.start_soon(sdnotify.report_status, self.notifier, self.progress)
            outer.start_soon(reap_updaters, self.updates)

            async def on_signal() -> None:
                signum = await wait_for_signal()
                log.info("stopping member signal=%s", signum)
                self.notifier.stopping()
                self.stop.set()
                local = self.local
                if self.member is None or not self.member.serving:
                    if local is not None:
                        await local.shutdown(config.shutdown_grace)
                    outer.cancel_scope.cancel()  # nothing else to shut down gracefully
                elif local is not None:
                    # Beside the replicated clients' grace, not after it.
                    outer.start_soon(local.shutdown, config.shutdown_grace)

            outer.start_soon(on_signal)
            await self._check_quorum_policy()
            await self._check_ring_security()
            if self.storage is not None:
                self.phase = "recovering"
                rec = await self.storage.recover(config.broker)
                outer.start_soon(self.storage.watch_snapshots)
                outer.start_soon(self.storage.watch_disk)
                if rec is not None:
                    # Offered in the hellos like a state kept after quorum loss: the freshest
                    # among the members that start together is resumed, the others update.
                    self.kept = (rec.broker, rec.epoch)
                    self.restarted = True
            if self.local is not None:
                # Before joining: member-local clients need nothing of the cluster.
                await outer.start(self.local.serve)
            first = True
            while True:
                if not self.quorum.quorate:
                    self.phase = "waiting-for-quorum"
                    log.warning("this node's partition is not quorate: waiting for quorum")
                    if first:
                        # Start-up waits for quorum as well as for the configured size.
                        with trio.move_on_after(cluster.ready_timeout):
                            await self.quorum.wait_quorate()
                        if not self.quorum.quorate:
                            raise ClusterError(
                                f"this node was not quorate within {cluster.ready_timeout:.0f} s"
                            )
                    else:
                        await self.quorum.wait_quorate()
                    log.info("quorate: joining the cluster group")
                self.phase = "joining"
                serving_started = await self._incarnation(outer, listeners, first)
                if serving_started and first:
                    first = False
                    task_status.started(self.bound)
                if self.stop.is_set():
                    break
            if self.local is not None:
                await self.local.shutdown(config.shutdown_grace)
            outer.cancel_scope.cancel()
        for lst in listeners:
            await lst.aclose()

    def close_watchdog(self) -> None:
        """A member that exits on purpose tells its watchdog so (EOF) rather than starve it."""
        w, self.watchdog = self.watchdog, None
        if w is not None:
            with contextlib.suppress(OSError):
                w.stdin.close()
            with contextlib.suppress(Exception):
                w.wait(2)

    async def _check_ring_security(self) -> None:
        """Refuse a corosync ring other machines can read or join: every client's bytes,
        PLAIN passwords included, are multicast over it. A loopback-only ring (one machine)
        or ``[cluster] allow_plaintext_ring`` (the operator says the network is private) is
        accepted."""
        ring = await trio.to_thread.run_sync(cmap.ring_security, self.cluster.netns or None)
        if ring.encrypted:
            log.info("corosync ring encrypted cipher=%s hash=%s", ring.cipher, ring.hash)
            return
        if ring.loopback_only:
            log.info("corosync ring not encrypted, but on loopback only")
            return
        if self.cluster.allow_plaintext_ring:
            log.warning(
                "corosync ring NOT encrypted (crypto_cipher %s, crypto_hash %s) on %s: client "
                "bytes and passwords cross the network in clear ([cluster] allow_plaintext_ring)",
                ring.cipher,
                ring.hash,
                ", ".join(ring.addresses),
            )
            return
        raise ClusterError(
            f"the corosync ring is not encrypted (crypto_cipher {ring.cipher}, crypto_hash "
            f"{ring.hash}) and not loopback-only ({', '.join(ring.addresses) or 'no nodelist'}): "
            "every client's bytes, passwords included, would cross the network in clear. Set "
            "crypto_cipher, crypto_hash and keyfile in corosync.conf (`cpgbroker cluster init` "
            "writes such a configuration), or [cluster] allow_plaintext_ring = true if the "
            "network is private"
        )

    async def _check_quorum_policy(self) -> None:
        """Refuse votequorum settings under which two sides of a split both stay quorate."""
        info = await self.quorum.call(self.quorum.quorum.getinfo)
        if info.two_node:
            raise ClusterError(
                "corosync's votequorum runs in two_node mode: after a split both nodes stay "
                "quorate (votequorum expects fencing), so both would serve and diverge; run three "
                "nodes (or two with a quorum device) and set two_node: 0"
            )
        if info.expected_votes > self.cluster.size:
            log.warning(
                "[cluster] size is %d but corosync expects %d votes: after a split in which "
                "every member lost quorum, the first %d members back decide whose kept state "
                "is resumed; set size to the number of nodes",
                self.cluster.size,
                info.expected_votes,
                self.cluster.size,
            )

    async def _incarnation(
        self, outer: trio.Nursery, listeners: list[trio.abc.Listener[ClientStream]], first: bool
    ) -> bool:
        """Join, get ready (from scratch or by update), serve until signalled (returns) or
        suspended (returns, the caller waits for quorum and starts another). Returns whether
        the member served in this incarnation."""
        config, cluster = self.config, self.cluster
        self.incarnations += 1
        served = False
        async with open_cpg(cluster.group, netns=cluster.netns or None) as cpg:
            me = member_id(cpg.local_nodeid, os.getpid())
            node = assemble(
                config,
                cpg,
                me,
                quorum=self.quorum,
                inherited=Inherited(
                    conn_counter=self.conn_counter,
                    kept=self.kept,
                    incarnation=self.incarnations,
                    updates=self.updates,
                    applying=self.applying,
                    store=None if self.storage is None else self.storage.store,
                    restarted=self.restarted and self.kept is not None,
                    forced=cluster.force_boot and first,
                ),
            )
            self.node = node
            self.member = member = MemberStatus(node)
            if self.storage is not None:
                self.storage.node = node
            unregister = self.quorum.on_loss(node.on_quorum_loss)
            log.info(
                "joined member=%s node=%s pid=%s incarnation=%d",
                me,
                cpg.local_nodeid,
                os.getpid(),
                self.incarnations,
            )
            try:
                async with trio.open_nursery() as nursery:
                    node.scope = nursery.cancel_scope
                    if not self.quorum.quorate:  # lost between the wait and the join
                        node.suspend("this node lost quorum while joining")

                    async def guarded(fn: Any) -> None:
                        # A member that cannot stay consistent stops serving at once; the
                        # failure is reported after the nursery, not as an exception group.
                        try:
                            await fn()
                        except (ClusterError, CpgError) as e:
                            node.fail(str(e))
                            nursery.cancel_scope.cancel()

                    update_listeners = await open_update_listeners(
                        cluster.update_listen, cluster.url
                    )
                    handler = node.update_handler(listener_address(update_listeners[0]))
                    nursery.start_soon(trio.serve_listeners, handler, update_listeners)
                    for task in node.guarded_tasks():
                        nursery.start_soon(guarded, task)
                    # The cluster ticker, this member's share of the federation links, the
                    # hot-standby watch, the replication mode's own.
                    for task in node.tasks():
                        nursery.start_soon(task)
                    activity = -1
                    while not member.ready:
                        with trio.move_on_after(cluster.ready_timeout):
                            await member.wait_ready()
                        if member.ready or nursery.cancel_scope.cancel_called:
                            break
                        if member.update_activity() != activity:
                            activity = member.update_activity()  # an update progresses: wait on
                            continue
                        if member.holding_kept:
                            # Leaving would throw away what may be the cluster's only copy of
                            # its confirmed messages (every member lost quorum): wait for the
                            # other members to come back instead.
                            log.warning(
                                "holding the state kept since quorum was lost: waiting for %d "
                                "members to rejoin (have %d)",
                                cluster.size,
                                len(member.members()),
                            )
                            continue
                        node.fail(
                            f"the cluster did not become ready within "
                            f"{cluster.ready_timeout:.0f} s (expected {cluster.size} members, "
                            f"have {len(member.members())}, state {member.state_name()})"
                        )
                        nursery.cancel_scope.cancel()
                        await trio.lowlevel.checkpoint()
                    if member.ready and not nursery.cancel_scope.cancel_called:
                        if not listeners:
                            opened, self.bound = await open_listeners(config)
                            listeners.extend(opened)
                            outer.start_soon(self._accept, listeners, outer)
                        served = True
                        self.kept = None  # serving again: the kept state was resumed or replaced
                        self.restarted = False
                        self.phase = "ready"
                        log.info("serving clients (incarnation %d)", self.incarnations)
                        self.notifier.ready(self.progress())  # READY=1 the first time only
                        await _first_of(self.stop, node.stop_requested)
                        self.notifier.stopping()
                        if member.halted is not None:
                            # A stop request: this member stops where the stream said, and
                            # leaves the group at once (the others count it in stability
                            # and flow control until then); its clients go after.
                            await node.finish_stop()
                            self.phase = "stopped"
                            self.stop.set()
                        else:
                            log.info("stopping member=%s", me)
                            await node.shutdown_clients(config.shutdown_grace)
                        nursery.cancel_scope.cancel()
            finally:
                unregister()
                self.conn_counter = member.conn_counter
                node.close()
            if member.failure is not None:
                log.error("leaving the cluster: %s", member.failure)
                await node.drop_clients("member left the cluster: " + member.failure[:150])
                raise ClusterError(member.failure)
            if member.halted is not None:
                # Clients read their connection.close and go.
                await node.let_clients_go(config.shutdown_grace)
            if member.suspended is not None:
                self.phase = "suspended"
                self.last_suspension = member.suspended
                # Offered when rejoining, used only if nobody kept serving meanwhile.
                self.kept = node.state_to_keep()
                # Leaving the group (closing the handle, below) is what lets the quorate side
                # forget this incarnation; its clients get a moment to read connection.close.
                await node.let_clients_go(SUSPEND_GRACE)
        return served

    async def _accept(
        self, listeners: list[trio.abc.Listener[ClientStream]], outer: trio.Nursery
    ) -> None:
        await trio.serve_listeners(self.handle_client, listeners, handler_nursery=outer)

    bound: list[tuple[str, int]] = []


async def _first_of(*events: trio.Event) -> None:
    async with trio.open_nursery() as nursery:

        async def wait(ev: trio.Event) -> None:
            await ev.wait()
            nursery.cancel_scope.cancel()

        for ev in events:
            nursery.start_soon(wait, ev)


async def refuse(stream: ClientStream, text: str, start: bytes = b"") -> None:
    """Turn away a client while this member does not serve: read its protocol header, answer
    connection.close 320 with the reason (clients report it; failover clients move on; after
    ``start``, a connection.start, when given: what a hot-standby backup shows), then
    linger as a closed connection does (``runtime/amqp/server.py``, CLOSE_LINGER): end of stream,
    and read and discard what the client still sends (its close-ok, frames it wrote after its
    header) until it closes, at most CLOSE_LINGER seconds, so that closing with unread input
    does not reset the connection and destroy the close before the client reads it."""
    with contextlib.suppress(
        trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError
    ):
        with trio.move_on_after(2):
            await stream.receive_some(8)
            await stream.send_all(start + forced_close_frame(text))
        with trio.move_on_after(CLOSE_LINGER):
            # A no-op on amqps (TlsStream: TLS has no half close).
            await stream.send_eof()
            while await stream.receive_some(RECV_SIZE):
                pass
    await stream.aclose()


async def serve_member(
    config: ServerConfig,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    notifier: sdnotify.Notifier | None = None,
) -> None:
    cluster = config.cluster
    assert cluster is not None
    log.info(
        "joining cluster group=%s size=%d netns=%s", cluster.group, cluster.size, cluster.netns
    )
    # Keep freed memory in the process: otherwise glibc returns it after every batch of large
    # CPG messages and page-faults it back for the next (measured in docs/performance.md).
    tune_malloc()
    async with open_quorum(netns=cluster.netns or None) as quorum:
        process = MemberProcess(config, quorum, notifier)
        try:
            await process.run(task_status=task_status)
        finally:
            process.close_watchdog()

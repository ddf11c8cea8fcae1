"""Member-local connections: AMQP clients whose traffic never crosses the cluster.

A cluster replicates *connections*, not queues: every member replays each client's bytes
into the same model. A queue cannot stay on one member while the connection that uses it is
replicated, because the connection's channels (delivery tags, prefetch, confirm numbers) would
then differ between members, and its bytes would cross CPG anyway. Locality is therefore a
property of a connection, chosen where the client connects: ``[cluster] local_listen``.

A :class:`LocalBroker` serves those listeners with a standalone broker in the member's process
(a :class:`~cpgbroker.runtime.amqp.server.AmqpServer` with its own model, applied at once, as a
broker without ``[cluster]`` does). Its queues live on this member only, are never stored, and
die with it: its clients' connections drop with the process and they reconnect and declare again, as
RPC clients do with their reply queues. Users, permissions and vhosts are the cluster's: the
replica's are taken before each new client and every :data:`FOLLOW_EVERY` seconds
(``Broker.mirror_access``, between events on this thread), so a user the management API adds,
changes or deletes logs in here, or not, like anywhere else, and a permission taken away stops
working on open connections too; a vhost deleted in the cluster is deleted here through the
local model's own admin command, which closes its connections as the cluster does. Before the
member first serves, the users are those of its store (if it recovered one), else of its
configuration. Policies and federation apply to replicated queues only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import trio

from cpgbroker.model import TRUSTED, Broker
from cpgbroker.model.events import Tick
from cpgbroker.runtime.amqp.server import AmqpServer, ClientStream, open_listeners
from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.runtime.config.tls import TlsListener

log = logging.getLogger("cpgbroker.local")

# Seconds between two looks at the replica's users and vhosts (also taken at every login).
FOLLOW_EVERY = 1.0


class LocalBroker:
    """The member-local broker: its listeners, its node and its model."""

    def __init__(self, config: ServerConfig, replica: Callable[[], Broker | None]) -> None:
        cluster = config.cluster
        assert cluster is not None and (cluster.local_listen or cluster.local_listen_tls)
        self.config = attrs.evolve(
            config,
            listen=cluster.local_listen,
            listen_tls=cluster.local_listen_tls,
            cluster=None,
            store=None,
            # Policies and federation links are the cluster's business: they act on replicated
            # queues and exchanges, which this broker does not hold.
            broker=attrs.evolve(
                config.broker, policies=(), upstreams=(), server_id="", replicated=False
            ),
        )
        self.node = AmqpServer(self.config)
        assert self.node.standalone is not None
        self.broker = self.node.standalone.broker
        self._replica = replica
        self.bound: list[tuple[str, int]] = []
        self.bound_tls: list[tuple[str, int]] = []
        self._accepting = trio.CancelScope()
        # Set once every client was told to go (or the grace ran out): shutdown is idempotent.
        self._shut: trio.Event | None = None

    async def serve(
        self, task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept member-local clients until :meth:`shutdown` (or cancelled)."""
        listeners, self.bound = await open_listeners(self.config)
        self.bound_tls = [
            _address(lst.transport_listener) for lst in listeners if isinstance(lst, TlsListener)
        ]
        log.info(
            "listening member-local (not replicated): %s",
            ", ".join(
                [
                    *(f"{h}:{p}" for h, p in self.bound),
                    *(f"amqps {h}:{p}" for h, p in self.bound_tls),
                ]
            ),
        )
        node = self.node
        await node.submit(Tick(node.now_ms()))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.ticker)
            nursery.start_soon(self._follow)
            task_status.started(self.bound)
            with self._accepting:
                await trio.serve_listeners(self.handle, listeners, handler_nursery=nursery)
            for lst in listeners:
                await lst.aclose()
            # The ticker and the clients' tasks go on until the member's nursery ends.
            await trio.sleep_forever()

    async def handle(self, stream: ClientStream) -> None:
        await self.follow()
        await self.node.handle(stream)

    async def follow(self) -> None:
        """Take the replica's users and vhosts (none to take: what was taken last stays)."""
        replica = self._replica()
        if replica is None:
            return
        self.broker.mirror_access(replica)
        for name in [v for v in self.broker.vhosts if v not in replica.vhosts]:
            assert self.node.desk is not None
            status, _ = await self.node.desk.request(TRUSTED, "delete_vhost", {"name": name}, 10)
            log.info(
                "vhost deleted in the cluster: deleted here too vhost=%r status=%s", name, status
            )

    async def _follow(self) -> None:
        while True:
            await trio.sleep(FOLLOW_EVERY)
            await self.follow()

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, tell every client (320 CONNECTION_FORCED), give them ``grace``
        seconds to take it. A second call waits for the first."""
        if self._shut is not None:
            with trio.move_on_after(grace):
                await self._shut.wait()
            return
        self._shut = trio.Event()
        self._accepting.cancel()
        if self.node.local:
            log.info("closing member-local connections=%d", len(self.node.local))
        await self.node.shutdown_clients(grace)
        self._shut.set()

    def status(self) -> dict[str, Any]:
        queues = [q for vh in self.broker.vhosts.values() for q in vh.queues.values()]
        return {
            "listen": [f"{h}:{p}" for h, p in self.bound],
            "listen_tls": [f"{h}:{p}" for h, p in self.bound_tls],
            "connections": len(self.node.local),
            "queues": len(queues),
            "messages": sum(len(q.messages) + q.unacked for q in queues),
        }


def _address(lst: trio.SocketListener) -> tuple[str, int]:
    addr = lst.socket.getsockname()
    return str(addr[0]), int(addr[1])

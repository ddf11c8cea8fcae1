"""Member-local connections: AMQP clients whose traffic never crosses the cluster.

A cluster replicates *connections*, not queues: every member replays each client's bytes
into the same model. A queue cannot stay on one member while the connection that uses it is
replicated, because the connection's channels (delivery tags, prefetch, confirm numbers) would
then differ between members, and its bytes would cross CPG anyway. Locality is therefore a
property of a connection, chosen where the client connects: ``[cluster] local_listen``.

A :class:`LocalBroker` serves those listeners with a standalone broker in the member's process
(a :class:`~cpgbroker.runtime.server.Node` with its own model, applied at once, as a broker
without ``[cluster]`` does). Its queues live on this member only, are never stored, and die with
it: its clients' connections drop with the process and they reconnect and declare again, as
RPC clients do with their reply queues. Users, permissions and vhosts are the cluster's: the
replica's are taken before each new client (``Broker.mirror_access``), so a user the
management API adds or deletes logs in here, or not, like anywhere else. Policies and
federation apply to replicated queues only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import trio

from cpgbroker.model.broker import Broker
from cpgbroker.model.events import Tick
from cpgbroker.runtime.server import ClientStream, Node, open_listeners
from cpgbroker.runtime.settings import ServerConfig
from cpgbroker.runtime.tls import TlsListener

log = logging.getLogger("cpgbroker.local")


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
        self.node = Node(self.config)
        assert self.node.standalone is not None
        self.broker = self.node.standalone.broker
        self._replica = replica
        self.bound: list[tuple[str, int]] = []
        self.bound_tls: list[tuple[str, int]] = []
        self._accepting = trio.CancelScope()

    async def serve(
        self, task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept member-local clients until :meth:`shutdown` (or cancelled)."""
        listeners, self.bound = await open_listeners(self.config)
        self.bound_tls = [
            _address(lst.transport_listener) for lst in listeners if isinstance(lst, TlsListener)
        ]
        log.info(
            "member-local listeners (not replicated): %s",
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
            task_status.started(self.bound)
            with self._accepting:
                await trio.serve_listeners(self.handle, listeners, handler_nursery=nursery)
            for lst in listeners:
                await lst.aclose()
            # The ticker and the clients' tasks go on until the member's nursery ends.
            await trio.sleep_forever()

    async def handle(self, stream: ClientStream) -> None:
        replica = self._replica()
        if replica is not None:
            # Between incarnations (no replica) the users last taken stay in force.
            self.broker.mirror_access(replica)
        await self.node.handle(stream)

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, tell every client (320 CONNECTION_FORCED), give them ``grace``
        seconds to take it."""
        self._accepting.cancel()
        if self.node.local:
            log.info("closing member-local connections=%d", len(self.node.local))
        await self.node.shutdown_clients(grace)

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

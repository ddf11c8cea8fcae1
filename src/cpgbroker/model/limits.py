"""Resource limits: what one client may make the whole cluster hold.

Theory of operation
-------------------
Every member replays every client, so a client that creates a million exchanges makes every
member hold (and snapshot, and transfer to newcomers) a million exchanges, and one that opens
ten thousand connections makes every member's heartbeat tick walk them. The limits below are
RabbitMQ's where RabbitMQ has one (per-vhost ``max-connections`` and ``max-queues``, per-user
``max-connections`` and ``max-channels``, with its reply codes and texts) and cpgbroker's own
for exchanges and bindings per vhost (RabbitMQ has none; the texts follow its queue limit's).

They are model decisions: each check reads replicated state only (the vhost's exchanges,
queues and binding count, the connections dict), so every replica refuses at the same event.
The handlers call the ``check_*`` functions before they create anything; each costs O(1) but
the connection and channel checks, which count the connections of a vhost or user: O(open
connections), bounded by ``vhost_max_connections`` and paid once per connection.open /
channel.open (a user channel limit only when one is configured).
"""

from __future__ import annotations

import attrs

from cpgbroker.errors import ChannelError, ConnectionError_, ReplyCode
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.entities import Connection

R = ReplyCode


@attrs.define
class Limits:
    """The broker's limits (compared by value: the configuration, equal on every replica)."""

    config: BrokerConfig = attrs.Factory(BrokerConfig)
    # The broker's connections (read only; not compared: replicas hold their own).
    connections: dict[int, Connection] = attrs.field(factory=dict, eq=False, repr=False)

    def configure(self, config: BrokerConfig) -> None:
        self.config = config


def check_new_queue(limits: Limits, vhost: str, queues: int, name: str) -> None:
    """queue.declare of a queue that does not exist yet in a vhost holding ``queues``."""
    limit = limits.config.vhost_max_queues
    if limit is not None and queues >= limit:
        raise ChannelError(
            R.PRECONDITION_FAILED,
            f"cannot declare queue '{name}': queue limit in vhost '{vhost}' ({limit}) is reached",
        )


def check_new_exchange(limits: Limits, vhost: str, exchanges: int, name: str) -> None:
    """exchange.declare of a new exchange in a vhost holding ``exchanges`` declared by
    clients (the default exchange and the amq.* ones do not count)."""
    limit = limits.config.vhost_max_exchanges
    if limit is not None and exchanges >= limit:
        raise ChannelError(
            R.PRECONDITION_FAILED,
            f"cannot declare exchange '{name}': exchange limit in vhost '{vhost}' ({limit}) "
            "is reached",
        )


def check_new_binding(limits: Limits, vhost: str, bindings: int, source: str) -> None:
    """queue.bind / exchange.bind adding a binding to a vhost holding ``bindings``."""
    limit = limits.config.vhost_max_bindings
    if limit is not None and bindings >= limit:
        raise ChannelError(
            R.PRECONDITION_FAILED,
            f"cannot bind to exchange '{source}': binding limit in vhost '{vhost}' ({limit}) "
            "is reached",
        )


def check_connection_open(limits: Limits, conn: Connection, vhost: str) -> None:
    """connection.open of ``conn`` into ``vhost`` (access already checked): the vhost's and
    the user's connection limits, as RabbitMQ's reader checks them (530 NOT_ALLOWED)."""
    config = limits.config
    connections = limits.connections
    vlimit = config.vhost_max_connections
    user = next((u for u in config.users if u.name == conn.user), None)
    ulimit = user.max_connections if user is not None else None
    if vlimit is None and ulimit is None:
        return
    in_vhost = for_user = 0
    for c in connections.values():
        if c is conn or not c.vhost:
            continue  # not open (the vhost is set by connection.open)
        if c.vhost == vhost:
            in_vhost += 1
        if c.user == conn.user:
            for_user += 1
    if vlimit is not None and in_vhost >= vlimit:
        raise ConnectionError_(
            R.NOT_ALLOWED,
            f"access to vhost '{vhost}' refused for user '{conn.user}': connection limit "
            f"({vlimit}) is reached",
        )
    if ulimit is not None and for_user >= ulimit:
        raise ConnectionError_(
            R.NOT_ALLOWED,
            f"connection refused for user '{conn.user}': user connection limit ({ulimit}) "
            "is reached",
        )


def check_channel_open(limits: Limits, conn: Connection, class_id: int, method_id: int) -> None:
    """channel.open on ``conn``: the user's channel limit across all of the user's
    connections (RabbitMQ's ``max-channels``; 530 NOT_ALLOWED closes the connection)."""
    user = next((u for u in limits.config.users if u.name == conn.user), None)
    limit = user.max_channels if user is not None else None
    if limit is None:
        return
    opened = sum(len(c.channels) for c in limits.connections.values() if c.user == conn.user)
    if opened >= limit:
        raise ConnectionError_(
            R.NOT_ALLOWED,
            f"number of channels opened for user '{conn.user}' has reached the maximum "
            f"allowed user limit of ({limit})",
            class_id=class_id,
            method_id=method_id,
        )

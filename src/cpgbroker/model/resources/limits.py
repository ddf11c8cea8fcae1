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
queues and binding count, the connection and channel counts below), so every replica refuses
at the same event. The handlers call the ``check_*`` functions before they create anything;
each costs O(1).

The connection and channel checks read counters kept here (derived state, not in snapshots:
``ConnectionProtocol.restore`` recounts each restored connection). What they count is exactly what a
scan of the broker's connections would:

* ``vhost_connections[v]`` / ``user_connections[u]``: connections in the connections dict that
  are past connection.open (``conn.vhost`` set) into ``v`` / of user ``u``, closing ones
  included (they stay until dropped). Counted by ``connection_opened`` when connection.open is
  accepted, uncounted by ``connection_gone`` when the connection leaves the dict (client close,
  deliver-close, a member leaving, a timeout: ``ConnectionProtocol.drop``).
* ``user_channels[u]``: the channels (closing ones included) held in ``conn.channels`` by the
  connections of user ``u``. Changed by ``channels_opened`` / ``channels_closed`` wherever
  ``conn.channels`` grows or shrinks (channel.open, channel.close / close-ok, a connection's
  release).

A count that drops to 0 is removed, so two replicas with the same connections hold equal dicts.
"""

from __future__ import annotations

import attrs

from cpgbroker.errors import ChannelError, ConnectionError_, InvariantError, ReplyCode
from cpgbroker.model.config import BrokerConfig, User
from cpgbroker.model.entities import Connection

R = ReplyCode


@attrs.define
class Limits:
    """The broker's limits (compared by value: the configuration, equal on every replica)."""

    config: BrokerConfig = attrs.Factory(BrokerConfig)
    # Derived counts (see the module docstring), compared: a restored replica must hold the
    # same. Only non-zero counts are present.
    vhost_connections: dict[str, int] = attrs.Factory(dict)
    user_connections: dict[str, int] = attrs.Factory(dict)
    user_channels: dict[str, int] = attrs.Factory(dict)
    # The users by name (model/access/users.py's ``Users.by_name``: the broker's replicated users,
    # given by ``configure``; compared there, not here).
    users: dict[str, User] = attrs.field(init=False, factory=dict, eq=False, repr=False)

    def configure(self, config: BrokerConfig, users: dict[str, User]) -> None:
        self.config = config
        self.users = users

    # -- counters (O(1) each)

    def connection_opened(self, conn: Connection) -> None:
        """connection.open of ``conn`` accepted (``conn.vhost`` just set)."""
        _add(self.vhost_connections, conn.vhost, 1)
        _add(self.user_connections, conn.user, 1)

    def connection_gone(self, conn: Connection) -> None:
        """``conn`` leaves the broker's connections: uncount it (if it was opened) and the
        channels it still holds."""
        if conn.vhost:
            _add(self.vhost_connections, conn.vhost, -1)
            _add(self.user_connections, conn.user, -1)
        self.channels_closed(conn, len(conn.channels))

    def restore_connection(self, conn: Connection) -> None:
        """A connection restored from a snapshot joins the broker's connections."""
        if conn.vhost:
            self.connection_opened(conn)
        self.channels_opened(conn, len(conn.channels))

    def channels_opened(self, conn: Connection, n: int = 1) -> None:
        if n:
            _add(self.user_channels, conn.user, n)

    def channels_closed(self, conn: Connection, n: int = 1) -> None:
        if n:
            _add(self.user_channels, conn.user, -n)


def _add(counts: dict[str, int], key: str, n: int) -> None:
    v = counts.get(key, 0) + n
    if v > 0:
        counts[key] = v
    elif v == 0:
        del counts[key]
    else:
        raise InvariantError(f"limit count for {key!r} would go negative ({v})")


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
    # ``conn`` itself is not counted yet: it is counted once connection.open is accepted.
    vlimit = limits.config.vhost_max_connections
    user = limits.users.get(conn.user)
    ulimit = user.max_connections if user is not None else None
    if vlimit is not None and limits.vhost_connections.get(vhost, 0) >= vlimit:
        raise ConnectionError_(
            R.NOT_ALLOWED,
            f"access to vhost '{vhost}' refused for user '{conn.user}': connection limit "
            f"({vlimit}) is reached",
        )
    if ulimit is not None and limits.user_connections.get(conn.user, 0) >= ulimit:
        raise ConnectionError_(
            R.NOT_ALLOWED,
            f"connection refused for user '{conn.user}': user connection limit ({ulimit}) "
            "is reached",
        )


def check_channel_open(limits: Limits, conn: Connection, class_id: int, method_id: int) -> None:
    """channel.open on ``conn``: the user's channel limit across all of the user's
    connections (RabbitMQ's ``max-channels``; 530 NOT_ALLOWED closes the connection)."""
    user = limits.users.get(conn.user)
    limit = user.max_channels if user is not None else None
    if limit is not None and limits.user_channels.get(conn.user, 0) >= limit:
        raise ConnectionError_(
            R.NOT_ALLOWED,
            f"number of channels opened for user '{conn.user}' has reached the maximum "
            f"allowed user limit of ({limit})",
            class_id=class_id,
            method_id=method_id,
        )

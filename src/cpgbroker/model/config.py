"""Broker configuration that the model sees. Every member of a cluster must use the same values:
they change replicated behaviour (the cluster checks this when a member joins)."""

from __future__ import annotations

from typing import Any

import attrs

from cpgbroker.model.federation import Upstream

# RabbitMQ's permission pattern for "every resource" (what ``vhosts = [...]`` grants).
ALL = ".*"


@attrs.frozen
class Permission:
    """A user's rights on one vhost, as RabbitMQ's ``set_permissions``: three regular
    expressions over queue and exchange names (model/permissions.py applies them). ""
    grants nothing."""

    vhost: str
    configure: str = ALL
    write: str = ALL
    read: str = ALL


@attrs.frozen
class User:
    name: str
    password: str
    # Shorthand for full permissions (".*" three times) on each of these vhosts; an entry of
    # ``permissions`` for the same vhost takes its place.
    vhosts: tuple[str, ...] = ("/",)
    # RabbitMQ's rule for the default user: guest may only log in from loopback.
    loopback_only: bool = False
    tags: tuple[str, ...] = ()
    # RabbitMQ's user limits (rabbitmqctl set_user_limits): connections of this user across
    # the cluster, and channels across all of them. None: no limit (RabbitMQ's -1).
    max_connections: int | None = None
    max_channels: int | None = None
    # Instead of ``password``: a salted hash in RabbitMQ's format (model/auth.py).
    password_hash: str = ""
    hashing_algorithm: str = "rabbit_password_hashing_sha256"
    permissions: tuple[Permission, ...] = ()

    def grants(self) -> tuple[Permission, ...]:
        """The user's permissions, one per vhost it may open: ``permissions`` first, then
        full permissions on each vhost of ``vhosts`` that they do not name."""
        named = {p.vhost for p in self.permissions}
        return self.permissions + tuple(Permission(v) for v in self.vhosts if v not in named)

    def may_open(self, vhost: str) -> bool:
        """RabbitMQ's rule: any permissions on a vhost, even three "", let a user open it."""
        return vhost in self.vhosts or any(p.vhost == vhost for p in self.permissions)


@attrs.frozen
class Policy:
    """A policy (model/policies.py applies them): RabbitMQ's set_policy fields."""

    vhost: str
    name: str
    pattern: str
    apply_to: str
    definition: dict[str, Any]
    priority: int = 0


@attrs.frozen
class BrokerConfig:
    users: tuple[User, ...] = (
        User("guest", "guest", ("/",), loopback_only=True, tags=("administrator",)),
    )
    vhosts: tuple[str, ...] = ("/",)
    # 2047 as RabbitMQ: enough for any real client, bounds per-connection state.
    channel_max: int = 2047
    # 128 KiB as RabbitMQ: large enough for efficient bodies, small enough to bound buffers.
    frame_max: int = 131072
    # Seconds proposed in connection.tune; 60 as RabbitMQ, which client suites expect.
    heartbeat: int = 60
    # Largest message body accepted (RabbitMQ's default max_message_size is 128 MiB).
    max_message_size: int = 128 * 1024 * 1024
    # Memory mark: above this many bytes of queued bodies publishers are blocked
    # (connection.blocked), and resume below low_watermark_ratio of it.
    high_watermark_bytes: int = 512 * 1024 * 1024
    low_watermark_ratio: float = 0.8
    # Limits per vhost (each vhost gets the same; None: none). Every member holds, snapshots
    # and transfers to newcomers everything every client creates, and a cluster is only as
    # fast as its slowest member, so the defaults are sized for a 2-core member (measured with
    # bench/model_cost_bench.py: declare, delete, bind and unbind cost a few to some tens of
    # µs each whatever exists, so these bound memory and state-transfer time, not per-command
    # time). RabbitMQ's max-queues and max-connections (406 / 530 with its texts), and
    # cpgbroker's own caps on exchanges and bindings, which RabbitMQ leaves unlimited:
    # - connections: a few KiB of model state each, and a tick looks at the ones whose
    #   heartbeat or timeout is due;
    vhost_max_connections: int | None = 10_000
    # - queues, exchanges: ~1-2 KiB of model state each plus their snapshot part; 50,000 of
    #   each transfer to a newcomer in a few seconds;
    vhost_max_queues: int | None = 50_000
    vhost_max_exchanges: int | None = 50_000
    # - bindings: a few hundred bytes each (binding, queue record, indexes).
    vhost_max_bindings: int | None = 200_000
    # Queue flow (model/queueflow.py): a publish that leaves a queue with consumers holding
    # more than this many ready messages pauses the publisher until the queue is down to half;
    # 0: off (publishers then slow down only at the memory mark).
    queue_flow_messages: int = 1000
    # This cluster's name across a federation ([federation] server_id): announced to peers,
    # and a link from or to a cluster of the same id is refused on both sides. "": no
    # federation identity.
    server_id: str = ""
    # Federation upstreams and policies the configuration seeds (model/federation.py,
    # model/policies.py).
    upstreams: tuple[Upstream, ...] = ()
    policies: tuple[Policy, ...] = ()
    product: str = "cpgbroker"
    version: str = "0.1.0"
    # RabbitMQ's cluster_name, told to clients in connection.start: ``[cluster] name``, by
    # default the CPG group, the same on every member (runtime/config/settings.py; a standalone
    # broker's is its node name). "" (a model made without settings): "standalone". Release
    # 0.1.0 left it "": runtime/member/member.py ``config_digest`` hashes the default as it did.
    cluster_name: str = ""
    # Member URLs announced in server-properties (cluster mode); empty standalone.
    member_urls: tuple[str, ...] = ()
    # Whether this model is a cluster's replica (a member's model; not standalone, not a
    # member-local broker): a queue's x-replicate argument must say the same.
    replicated: bool = False
    # RabbitMQ's consumer_timeout (ms; its default since 3.8.17): a channel whose oldest
    # unacknowledged delivery waited longer is closed (model/consumertimeout.py, model version
    # 8); None: no timeout but a queue's own x-consumer-timeout. Added after release 0.1.0:
    # hashed into the members' configuration digest only when it is not its default.
    consumer_timeout: int | None = attrs.field(default=1_800_000, metadata={"since": "0.2.0"})

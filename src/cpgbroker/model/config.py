"""Broker configuration that the model sees. Every member of a cluster must use the same values:
they change replicated behaviour (the cluster checks this when a member joins)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from cpgbroker.errors import ConfigError
from cpgbroker.model.federation import Upstream

# Field metadata of a setting that every member of a cluster must share: members compare these
# when one joins (runtime/config/digest.py ``config_digest``), a member with another value is
# refused.
CLUSTER_WIDE: dict[str, object] = {"cluster_wide": True}


def cluster_wide(since: str) -> dict[str, object]:
    """Metadata of a cluster-wide setting added in release ``since``: compared only when not its
    default, so that members of an older release, which have no such setting, compare equal."""
    return {"cluster_wide": True, "since": since}


# A ``[limits]`` key of cpgbroker.toml (runtime/config/sections.py reads the section), cluster-wide.
# Verbatim: taken as the file gives it (the members' digest hashes it so since release 0.1.0).
LIMIT: dict[str, object] = {**CLUSTER_WIDE, "section": "limits", "verbatim": True}


def _no_limit(value: int | None) -> int | None:
    """RabbitMQ's -1 for "no limit" (TOML has no null) is None."""
    return None if value == -1 and not isinstance(value, bool) else value


def _limit(config: Any, field: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(
            f"{type(config).KEY.format(field.name)} must be an integer, -1 for no limit"
        )


# A count limit: a number, or None (-1 in the file) for none.
COUNT_LIMIT: dict[str, Any] = {"converter": _no_limit, "validator": _limit}


def _timeout_off(value: int | bool | None) -> int | None:
    """``consumer_timeout``: 0 or false is none."""
    return None if value is False or (type(value) is int and value == 0) else value


def _timeout(_config: Any, _field: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(
            "[limits] consumer_timeout must be a number of milliseconds, or 0 or false for none"
        )


# RabbitMQ's permission pattern for "every resource" (what ``vhosts = [...]`` grants).
ALL = ".*"


@attrs.frozen
class Permission:
    """A user's rights on one vhost, as RabbitMQ's ``set_permissions``: three regular
    expressions over queue and exchange names (model/access/permissions.py applies them). ""
    grants nothing."""

    vhost: str
    configure: str = ALL
    write: str = ALL
    read: str = ALL


@attrs.frozen
class User:
    KEY: ClassVar[str] = "[users] {}"

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
    max_connections: int | None = attrs.field(default=None, **COUNT_LIMIT)
    max_channels: int | None = attrs.field(default=None, **COUNT_LIMIT)
    # Instead of ``password``: a salted hash in RabbitMQ's format (model/access/auth.py).
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
    """A policy (model/routing/policies.py applies them): RabbitMQ's set_policy fields."""

    vhost: str
    name: str
    pattern: str
    apply_to: str
    definition: dict[str, Any]
    priority: int = 0


@attrs.frozen
class BrokerConfig:
    """The model's settings: every field but ``member_urls`` is cluster-wide. Those of
    ``[limits]`` are read from it (runtime/config/sections.py); users, policies and federation
    from their own declared entries (runtime/config/definitions.py)."""

    KEY: ClassVar[str] = "[limits] {}"

    users: tuple[User, ...] = attrs.field(
        default=(User("guest", "guest", ("/",), loopback_only=True, tags=("administrator",)),),
        metadata={**CLUSTER_WIDE, "section": "users"},
    )
    vhosts: tuple[str, ...] = attrs.field(
        default=("/",), metadata={**CLUSTER_WIDE, "section": "vhosts"}
    )
    # 2047 as RabbitMQ: enough for any real client, bounds per-connection state.
    channel_max: int = attrs.field(default=2047, metadata=LIMIT)
    # 128 KiB as RabbitMQ: large enough for efficient bodies, small enough to bound buffers.
    frame_max: int = attrs.field(default=131072, metadata=LIMIT)
    # Seconds proposed in connection.tune; 60 as RabbitMQ, which client suites expect.
    heartbeat: int = attrs.field(default=60, metadata=LIMIT)
    # Largest message body accepted (RabbitMQ's default max_message_size is 128 MiB).
    max_message_size: int = attrs.field(default=128 * 1024 * 1024, metadata=LIMIT)
    # Memory mark: above this many bytes of queued bodies publishers are blocked
    # (connection.blocked), and resume below low_watermark_ratio of it.
    high_watermark_bytes: int = attrs.field(default=512 * 1024 * 1024, metadata=LIMIT)
    low_watermark_ratio: float = attrs.field(default=0.8, metadata=LIMIT)
    # Limits per vhost (each vhost gets the same; None: none). Every member holds, snapshots
    # and transfers to newcomers everything every client creates, and a cluster is only as
    # fast as its slowest member, so the defaults are sized for a 2-core member (measured with
    # bench/model_cost_bench.py: declare, delete, bind and unbind cost a few to some tens of
    # µs each whatever exists, so these bound memory and state-transfer time, not per-command
    # time). RabbitMQ's max-queues and max-connections (406 / 530 with its texts), and
    # cpgbroker's own caps on exchanges and bindings, which RabbitMQ leaves unlimited:
    # - connections: a few KiB of model state each, and a tick looks at the ones whose
    #   heartbeat or timeout is due;
    vhost_max_connections: int | None = attrs.field(default=10_000, metadata=LIMIT, **COUNT_LIMIT)
    # - queues, exchanges: ~1-2 KiB of model state each plus their snapshot part; 50,000 of
    #   each transfer to a newcomer in a few seconds;
    vhost_max_queues: int | None = attrs.field(default=50_000, metadata=LIMIT, **COUNT_LIMIT)
    vhost_max_exchanges: int | None = attrs.field(default=50_000, metadata=LIMIT, **COUNT_LIMIT)
    # - bindings: a few hundred bytes each (binding, queue record, indexes).
    vhost_max_bindings: int | None = attrs.field(default=200_000, metadata=LIMIT, **COUNT_LIMIT)
    # Queue flow (model/resources/queueflow.py): a publish that leaves a queue with consumers
    # holding more than this many ready messages pauses the publisher until the queue is down to
    # half; 0: off (publishers then slow down only at the memory mark).
    queue_flow_messages: int = attrs.field(default=1000, metadata=LIMIT)
    # This cluster's name across a federation ([federation] server_id): announced to peers,
    # and a link from or to a cluster of the same id is refused on both sides. "": no
    # federation identity.
    server_id: str = attrs.field(default="", metadata={**CLUSTER_WIDE, "section": "federation"})
    # Federation upstreams and policies the configuration seeds (model/federation.py,
    # model/routing/policies.py).
    upstreams: tuple[Upstream, ...] = attrs.field(
        default=(), metadata={**CLUSTER_WIDE, "section": "federation"}
    )
    policies: tuple[Policy, ...] = attrs.field(
        default=(), metadata={**CLUSTER_WIDE, "section": "policies"}
    )
    product: str = attrs.field(default="cpgbroker", metadata={**CLUSTER_WIDE, "key": None})
    version: str = attrs.field(default="0.1.0", metadata={**CLUSTER_WIDE, "key": None})
    # RabbitMQ's cluster_name, told to clients in connection.start: ``[cluster] name``, by
    # default the CPG group, the same on every member (runtime/config/settings.py; a standalone
    # broker's is its node name). "" (a model made without settings): "standalone". Release
    # 0.1.0 left it "": runtime/config/digest.py ``config_digest`` hashes the default as it did.
    cluster_name: str = attrs.field(
        default="", metadata={**CLUSTER_WIDE, "section": "cluster", "key": "name"}
    )
    # Member URLs announced in server-properties (cluster mode); empty standalone. Each
    # member's own (not cluster-wide).
    member_urls: tuple[str, ...] = attrs.field(default=(), metadata={"key": None})
    # Whether this model is a cluster's replica (a member's model; not standalone, not a
    # member-local broker): a queue's x-replicate argument must say the same.
    replicated: bool = attrs.field(default=False, metadata={**CLUSTER_WIDE, "key": None})
    # RabbitMQ's consumer_timeout (ms; its default since 3.8.17): a channel whose oldest
    # unacknowledged delivery waited longer is closed (model/messages/consumertimeout.py, model
    # version 8); None: no timeout but a queue's own x-consumer-timeout. Added after release 0.1.0:
    # hashed into the members' configuration digest only when it is not its default.
    consumer_timeout: int | None = attrs.field(
        default=1_800_000,
        metadata={**cluster_wide(since="0.2.0"), "section": "limits"},
        converter=_timeout_off,
        validator=_timeout,
    )

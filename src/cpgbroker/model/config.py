"""Broker configuration that the model sees. Every member of a cluster must use the same values:
they change replicated behaviour (the cluster checks this when a member joins)."""

from __future__ import annotations

import attrs


@attrs.frozen
class User:
    name: str
    password: str
    vhosts: tuple[str, ...] = ("/",)
    # RabbitMQ's rule for the default user: guest may only log in from loopback.
    loopback_only: bool = False
    tags: tuple[str, ...] = ()


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
    product: str = "cpgbroker"
    version: str = "0.1.0"
    cluster_name: str = ""
    # Member URLs announced in server-properties (cluster mode); empty standalone.
    member_urls: tuple[str, ...] = ()

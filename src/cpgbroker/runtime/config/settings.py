"""Loading ``cpgbroker.toml``: the broker model's settings plus this process's own (listeners,
logging, cluster membership). See ``configs/cpgbroker.toml`` for every key, commented."""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path
from typing import Any, ClassVar

import attrs

from cpgbroker import __version__
from cpgbroker.errors import ConfigError
from cpgbroker.model import CLUSTER_WIDE, REPLICATE, BrokerConfig, cluster_wide
from cpgbroker.runtime.config import definitions
from cpgbroker.runtime.config.sections import (
    address,
    addresses,
    check,
    one_of,
    one_or_many,
    structure,
    structure_sections,
)
from cpgbroker.runtime.config.sections import parse_listen as parse_listen
from cpgbroker.runtime.config.tls import TlsConfig, parse_tls
from cpgbroker.store.store import StoreSettings

# A field that is a section of its own (read into its class), not a key.
_SECTION: dict[str, object] = {"key": None}
_off_or_positive = check(lambda t: t >= 0, "must be 0 (off) or positive")


@attrs.frozen
class ClusterConfig:
    """``[cluster]``: each field is a key (runtime/config/sections.py reads it); those marked
    ``cluster_wide`` must be the same on every member (runtime/config/digest.py)."""

    KEY: ClassVar[str] = "cluster.{}"

    # CPG group name: members of one cluster share it; at most 127 bytes (CPG_MAX_NAME_LENGTH).
    group: str = attrs.field(
        metadata=CLUSTER_WIDE,
        validator=check(
            lambda g: len(g.encode()) <= 127, "is longer than 127 bytes (the CPG name limit)"
        ),
    )
    # Members expected before serving clients.
    size: int = attrs.field(default=1, validator=check(lambda n: n >= 1, "must be at least 1"))
    # The AMQP URL clients use to reach this member (announced to clients for failover).
    url: str = ""
    event_log: str = ""
    # Network namespace whose corosync to join (a dev cluster on one machine); "" for none.
    netns: str = ""
    # Seconds to wait for ``size`` members before giving up.
    ready_timeout: float = 120.0
    # Cluster flow control: stop multicasting new client traffic while another member is more
    # than this many events behind (bounds what corosync buffers for a slow member).
    max_lag: int = 20_000
    # HOST:PORT where this member receives a state update when it joins a serving cluster
    # (the updater connects here). "" = the host of ``url`` (else 127.0.0.1), any free port.
    update_listen: str = attrs.field(default="", validator=address)
    # Cap on the bandwidth one state transfer uses (MiB/s; 0 = unlimited), so that feeding a
    # newcomer never starves client traffic on a shared network.
    update_rate_limit: float = 0.0
    # Digest the model and vote on it after every this many applied events. Every member must
    # use the same value (it is part of the configuration members compare when they join).
    # Each checkpoint digests the whole state: lower values suit small states (a dev cluster,
    # where short runs then get replica checks too), not millions of queued messages.
    checkpoint_every: int = attrs.field(
        default=10_000,
        metadata=CLUSTER_WIDE,
        validator=check(lambda n: n >= 1, "must be at least 1"),
    )
    # Seconds a member may go without processing events before its watchdog process kills
    # it (a hung member must not hold the others back); 0 disables the watchdog.
    watchdog_timeout: float = attrs.field(default=30.0, validator=_off_or_positive)
    # Seconds one event of the stream may take to apply while the watchdog keeps the member
    # alive (runtime/member/watchdog.py): while the member is inside one event and its event loop
    # thread keeps using CPU, a thread feeds the watchdog for it, because every member is
    # then as slow in that same event and killing them all would leave no member. A member
    # stopped, swapping or deadlocked in an event uses no CPU and is still killed after
    # ``watchdog_timeout``; one that loops for longer than this is killed that much later.
    # 0: the watchdog is fed by the event loop only.
    max_apply_seconds: float = attrs.field(default=300.0, validator=_off_or_positive)
    # Accept ``POST /faults`` on the status endpoint (make this member fail at a chosen event,
    # or find its disk full): for tests of the cluster's error handling, never in production.
    fault_injection: bool = False
    # ``cpgbroker start --force-boot`` (never from the file): after a whole-cluster stop,
    # serve from this member's store without waiting for ``size`` members.
    force_boot: bool = attrs.field(default=False, metadata={"key": None})
    # Serve on a corosync ring without crypto_cipher/crypto_hash although it is not
    # loopback-only: only where the network is private to the cluster (client bytes and
    # PLAIN passwords cross the ring).
    allow_plaintext_ring: bool = False
    # "active-active" (every member serves clients) or "hot-standby" (only the eldest ready
    # member does; the others turn clients away naming it: runtime/replication/standby.py). Every
    # member must use the same (it is part of what members compare when they join).
    mode: str = attrs.field(
        default="active-active",
        metadata=CLUSTER_WIDE,
        validator=one_of(("active-active", "hot-standby")),
    )
    # Hot standby only: what reaches the backups. "bytes": the primary's clients' bytes,
    # applied by every member as in active-active. "changes": the primary applies its
    # clients' bytes alone and ships what its broker changed (model/changes.py); a backup
    # spends a fraction of the CPU per message (runtime/replication/shipping.py).
    replication: str = attrs.field(
        default="bytes",
        metadata=cluster_wide(since="0.2.0"),
        validator=one_of(("bytes", "changes")),
    )
    # With replication = "changes": which messages ship. "all" (but exclusive and reply-to
    # queues'), "durable" (persistent messages on durable queues: what a restart keeps;
    # the rest is lost when the primary dies), "definitions" (no message).
    replicate: str = attrs.field(
        default="all", metadata=cluster_wide(since="0.2.0"), validator=one_of(REPLICATE)
    )
    # Member-local AMQP listeners (HOST:PORT; none by default): what clients do there never
    # crosses the cluster. Their queues live on this member only and die with it
    # (runtime/amqp/localbroker.py); users, permissions and vhosts are the cluster's.
    local_listen: tuple[str, ...] = attrs.field(
        default=(), converter=one_or_many, validator=addresses
    )
    # ... and member-local amqps listeners, served with ``[tls]`` like ``listen_tls``.
    local_listen_tls: tuple[str, ...] = attrs.field(
        default=(), converter=one_or_many, validator=addresses
    )

    def __attrs_post_init__(self) -> None:
        if self.replication == "changes" and self.mode != "hot-standby":
            raise ConfigError(
                'cluster.replication = "changes" needs mode = "hot-standby": in active-active '
                "every member serves clients, so every member applies their bytes"
            )
        if self.replicate != "all" and self.replication != "changes":
            raise ConfigError(
                "cluster.replicate chooses what a hot-standby primary ships: it needs "
                'replication = "changes"'
            )


@attrs.frozen
class ServerConfig:
    """The whole file: the keys of ``[server]`` and ``[log]`` are its own fields (read by
    runtime/config/sections.py); each other section, a field of its own class."""

    KEY: ClassVar[str] = "server.{}"

    listen: tuple[str, ...] = attrs.field(
        default=("127.0.0.1:5672",), converter=one_or_many, validator=addresses
    )
    # amqps listeners (RabbitMQ's listeners.ssl.*), served with ``tls``; none by default.
    listen_tls: tuple[str, ...] = attrs.field(
        default=(), converter=one_or_many, validator=addresses
    )
    log_level: str = attrs.field(default="info", metadata={"section": "log", "key": "level"})
    log_format: str = attrs.field(default="logfmt", metadata={"section": "log", "key": "format"})
    # Seconds a SIGTERM/SIGINT shutdown waits for clients to take their connection.close.
    shutdown_grace: float = 5.0
    # Cluster time resolution: TTL, x-expires and heartbeats act on ticks this far apart.
    tick_ms: int = 100
    # HOST:PORT of the HTTP status endpoint (GET /status -> JSON); "" disables it.
    admin_listen: str = attrs.field(default="", metadata={"key": "admin"}, validator=address)
    # Every admin request (the status read too) must carry ``Authorization: Bearer <secret>``:
    # the secret in this file (generated 0600 at first start, runtime/admin/secret.py; "" = the
    # default, ~/.cpgbroker/admin.secret of the broker's user) ...
    admin_secret_file: str = ""
    # ... or, when set, this fixed token instead (e.g. shared with a monitoring system).
    admin_token: str = ""
    # Serve the admin endpoint over TLS with the [tls] certificate (https).
    admin_tls: bool = False
    # [limits], [[users]], vhosts, [[policies]], [federation] and [cluster] name.
    broker: BrokerConfig = attrs.field(factory=BrokerConfig, metadata=_SECTION)
    cluster: ClusterConfig | None = attrs.field(default=None, metadata=_SECTION)
    # The durable store (``[store]``: a cluster member's, or a standalone broker's);
    # None: memory only.
    store: StoreSettings | None = attrs.field(default=None, metadata=_SECTION)
    # ``[tls]``: the certificate and client-certificate rules of ``listen_tls``; None: no TLS.
    tls: TlsConfig | None = attrs.field(default=None, metadata=_SECTION)


def with_force_boot(cfg: ServerConfig) -> ServerConfig:
    """``--force-boot``: only for a cluster member with a store."""
    if cfg.cluster is None or cfg.store is None:
        raise ConfigError("--force-boot is for a cluster member with a store ([cluster], [store])")
    return attrs.evolve(cfg, cluster=attrs.evolve(cfg.cluster, force_boot=True))


def load(path: str | None, listen: str | None = None) -> ServerConfig:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    return from_dict(data, listen)


# The sections of cpgbroker.toml.
SECTIONS = (
    "server",
    "log",
    "limits",
    "users",
    "vhosts",
    "policies",
    "federation",
    "cluster",
    "store",
    "tls",
)


def from_dict(data: dict[str, Any], listen: str | None = None) -> ServerConfig:
    """The settings of a parsed cpgbroker.toml; ``listen``: ``cpgbroker start --listen``, which
    takes the place of the file's."""
    unknown = sorted(k for k in data if k not in SECTIONS)
    if unknown:
        raise ConfigError(f"unknown config section(s): {', '.join(unknown)}")
    server = data.get("server", {})
    if listen is not None and isinstance(server, dict):
        server = {**server, "listen": [listen]}
    own = structure_sections(ServerConfig, {**data, "server": server}, ("server", "log"))
    tls = parse_tls(data.get("tls"))
    if own.listen_tls and tls is None:
        raise ConfigError("[server] listen_tls needs a [tls] section (certfile, keyfile, ...)")
    broker = _broker(data)
    cluster = _cluster(data, own.listen, tls)
    store = None
    if "store" in data:
        store = structure(StoreSettings, data["store"], "store")
        # Without ``dir`` there is no store: the member keeps its state in memory only.
        store = store if store.directory else None
    if store is not None and cluster is None and "recover_with" in data["store"]:
        # A standalone broker keeps its state in its store too (runtime/process/standalone.py),
        # but how many members a restart waits for means nothing without members.
        raise ConfigError(
            "[store] recover_with says how many members a cluster restart waits for: "
            "it needs [cluster] (a standalone broker recovers its own store)"
        )
    if own.admin_tls and tls is None:
        raise ConfigError("[server] admin_tls needs a [tls] section (certfile, keyfile)")
    return attrs.evolve(own, tls=tls, broker=broker, cluster=cluster, store=store)


def _broker(data: dict[str, Any]) -> BrokerConfig:
    """The model's settings: ``[limits]``, and what a new cluster starts with."""
    vhosts = tuple(data.get("vhosts", ["/"]))
    users = definitions.users(data.get("users"), vhosts)
    server_id, upstreams = definitions.federation(data.get("federation", {}), vhosts)
    return attrs.evolve(
        structure(BrokerConfig, data.get("limits", {}), "limits"),
        # What clients are told in server-properties: this member's release.
        version=__version__,
        users=users,
        vhosts=vhosts,
        policies=definitions.policies(data.get("policies", []), vhosts),
        server_id=server_id,
        upstreams=upstreams,
        replicated="cluster" in data,
        cluster_name=_cluster_name(data.get("cluster")),
    )


def _cluster(
    data: dict[str, Any], listen: tuple[str, ...], tls: TlsConfig | None
) -> ClusterConfig | None:
    if "cluster" not in data:
        return None
    # ``name`` is the broker's (``cluster_name``): every other key is a ClusterConfig field.
    raw = {k: v for k, v in data["cluster"].items() if k != "name"}
    if "url" not in raw and listen:
        raw["url"] = f"amqp://{listen[0]}/"
    cluster = structure(ClusterConfig, raw, "cluster")
    if cluster.local_listen_tls and tls is None:
        raise ConfigError("cluster.local_listen_tls needs a [tls] section (certfile, keyfile)")
    return cluster


def standalone_name() -> str:
    """A standalone broker's cluster name: its node name as the management API gives it
    (runtime/mgmt/views.py ``node_name`` without a member URL), as RabbitMQ names a cluster of
    one node after that node (``rabbit@host``). Distinct per machine, so that dashboards
    grouping by cluster do not merge separate brokers."""
    return f"cpgbroker@{socket.gethostname()}"


def _cluster_name(c: Any) -> str:
    """``[cluster] name``: what the management API, ``/metrics`` and connection.start call the
    cluster (RabbitMQ's ``cluster_name``); the standalone name without ``[cluster]``."""
    if c is None:
        return standalone_name()
    group = _req(c, "group", "cluster")
    # The CPG group by default: every member of one cluster already shares it (they could not
    # form one otherwise), it is stable across restarts, and it is what the cluster's
    # federation links call it upstream without a server id; so an existing cluster is named
    # alike by every member without a new key in any file.
    name = c.get("name", group)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError("cluster.name must be a non-empty string")
    return name


def _req(d: dict[str, Any], key: str, section: str) -> Any:
    if key not in d:
        raise ConfigError(f"[{section}] entry is missing {key!r}")
    return d[key]

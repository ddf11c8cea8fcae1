"""Loading ``cpgbroker.toml``: the broker model's settings plus this process's own (listeners,
logging, cluster membership). See ``configs/cpgbroker.toml`` for every key, commented."""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path
from typing import Any

import attrs

from cpgbroker import __version__
from cpgbroker.errors import ConfigError
from cpgbroker.model import auth, permissions
from cpgbroker.model.changes import REPLICATE
from cpgbroker.model.config import BrokerConfig, Permission, Policy, User
from cpgbroker.model.federation import Upstream, upstream_from_value
from cpgbroker.model.policies import validate as validate_policy
from cpgbroker.runtime.config.tls import TlsConfig, parse_tls
from cpgbroker.store.store import FSYNC_POLICIES, RECOVER_WITH, StoreSettings


@attrs.frozen
class ClusterConfig:
    # CPG group name: members of one cluster share it; at most 127 bytes (CPG_MAX_NAME_LENGTH).
    group: str
    # Members expected before serving clients.
    size: int
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
    update_listen: str = ""
    # Cap on the bandwidth one state transfer uses (MiB/s; 0 = unlimited), so that feeding a
    # newcomer never starves client traffic on a shared network.
    update_rate_limit: float = 0.0
    # Digest the model and vote on it after every this many applied events. Every member must
    # use the same value (it is part of the configuration members compare when they join).
    # Each checkpoint digests the whole state: lower values suit small states (a dev cluster,
    # where short runs then get replica checks too), not millions of queued messages.
    checkpoint_every: int = 10_000
    # Seconds a member may go without processing events before its watchdog process kills
    # it (a hung member must not hold the others back); 0 disables the watchdog.
    watchdog_timeout: float = 30.0
    # Seconds one event of the stream may take to apply while the watchdog keeps the member
    # alive (runtime/member/watchdog.py): while the member is inside one event and its event loop
    # thread keeps using CPU, a thread feeds the watchdog for it, because every member is
    # then as slow in that same event and killing them all would leave no member. A member
    # stopped, swapping or deadlocked in an event uses no CPU and is still killed after
    # ``watchdog_timeout``; one that loops for longer than this is killed that much later.
    # 0: the watchdog is fed by the event loop only.
    max_apply_seconds: float = 300.0
    # Accept ``POST /faults`` on the status endpoint (make this member fail at a chosen event,
    # or find its disk full): for tests of the cluster's error handling, never in production.
    fault_injection: bool = False
    # ``cpgbroker start --force-boot`` (never from the file): after a whole-cluster stop,
    # serve from this member's store without waiting for ``size`` members.
    force_boot: bool = False
    # Serve on a corosync ring without crypto_cipher/crypto_hash although it is not
    # loopback-only: only where the network is private to the cluster (client bytes and
    # PLAIN passwords cross the ring).
    allow_plaintext_ring: bool = False
    # "active-active" (every member serves clients) or "hot-standby" (only the eldest ready
    # member does; the others turn clients away naming it: runtime/replication/standby.py). Every
    # member must use the same (it is part of what members compare when they join).
    mode: str = "active-active"
    # Hot standby only: what reaches the backups. "bytes": the primary's clients' bytes,
    # applied by every member as in active-active. "changes": the primary applies its
    # clients' bytes alone and ships what its broker changed (model/changes.py); a backup
    # spends a fraction of the CPU per message (runtime/replication/shipping.py).
    replication: str = "bytes"
    # With replication = "changes": which messages ship. "all" (but exclusive and reply-to
    # queues'), "durable" (persistent messages on durable queues: what a restart keeps;
    # the rest is lost when the primary dies), "definitions" (no message).
    replicate: str = "all"
    # Member-local AMQP listeners (HOST:PORT; none by default): what clients do there never
    # crosses the cluster. Their queues live on this member only and die with it
    # (runtime/amqp/localbroker.py); users, permissions and vhosts are the cluster's.
    local_listen: tuple[str, ...] = ()
    # ... and member-local amqps listeners, served with ``[tls]`` like ``listen_tls``.
    local_listen_tls: tuple[str, ...] = ()


@attrs.frozen
class ServerConfig:
    listen: tuple[str, ...] = ("127.0.0.1:5672",)
    # amqps listeners (RabbitMQ's listeners.ssl.*), served with ``tls``; none by default.
    listen_tls: tuple[str, ...] = ()
    log_level: str = "info"
    log_format: str = "logfmt"
    # Seconds a SIGTERM/SIGINT shutdown waits for clients to take their connection.close.
    shutdown_grace: float = 5.0
    # Cluster time resolution: TTL, x-expires and heartbeats act on ticks this far apart.
    tick_ms: int = 100
    # HOST:PORT of the HTTP status endpoint (GET /status -> JSON); "" disables it.
    admin_listen: str = ""
    # Every admin request (the status read too) must carry ``Authorization: Bearer <secret>``:
    # the secret in this file (generated 0600 at first start, runtime/admin/secret.py; "" = the
    # default, ~/.cpgbroker/admin.secret of the broker's user) ...
    admin_secret_file: str = ""
    # ... or, when set, this fixed token instead (e.g. shared with a monitoring system).
    admin_token: str = ""
    # Serve the admin endpoint over TLS with the [tls] certificate (https).
    admin_tls: bool = False
    broker: BrokerConfig = attrs.Factory(BrokerConfig)
    cluster: ClusterConfig | None = None
    # The member's durable store (``[store]``; cluster members only); None: memory only.
    store: StoreSettings | None = None
    # ``[tls]``: the certificate and client-certificate rules of ``listen_tls``; None: no TLS.
    tls: TlsConfig | None = None


def with_force_boot(cfg: ServerConfig) -> ServerConfig:
    """``--force-boot``: only for a cluster member with a store."""
    if cfg.cluster is None or cfg.store is None:
        raise ConfigError("--force-boot is for a cluster member with a store ([cluster], [store])")
    return attrs.evolve(cfg, cluster=attrs.evolve(cfg.cluster, force_boot=True))


def _addresses(raw: Any, key: str) -> tuple[str, ...]:
    """A HOST:PORT or an array of them, each checked."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
        raise ConfigError(f'{key} must be an array of "HOST:PORT" strings')
    for addr in raw:
        parse_listen(addr)
    return tuple(raw)


def parse_listen(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    addr = addr.strip()
    if addr.startswith("["):
        host, sep, port = addr[1:].partition("]:")
    else:
        host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"listen address {addr!r} is not HOST:PORT")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ConfigError(f"listen port {p} out of range")
    return host, p


def _policies(raw: Any, vhosts: tuple[str, ...]) -> tuple[Policy, ...]:
    """``[[policies]]``: policies a new cluster starts with (RabbitMQ's set_policy keys)."""
    if not isinstance(raw, list):
        raise ConfigError("policies must be an array of tables ([[policies]])")
    out = []
    for p in raw:
        unknown = sorted(
            set(p) - {"vhost", "name", "pattern", "apply_to", "definition", "priority"}
        )
        if unknown:
            raise ConfigError(f"unknown [[policies]] key(s): {', '.join(unknown)}")
        policy = Policy(
            str(p.get("vhost", "/")),
            _req(p, "name", "policies"),
            _req(p, "pattern", "policies"),
            str(p.get("apply_to", "all")),
            dict(p.get("definition", {})),
            int(p.get("priority", 0)),
        )
        if policy.vhost not in vhosts:
            raise ConfigError(f"policy {policy.name!r}: vhost {policy.vhost!r} is not declared")
        problem = validate_policy(policy)
        if problem is not None:
            raise ConfigError(f"policy {policy.name!r}: {problem}")
        out.append(policy)
    return tuple(out)


# [[federation.upstreams]] keys, and the key of RabbitMQ's federation-upstream value each is.
_UPSTREAM_KEYS = {
    "uri": "uri",
    "exchange": "exchange",
    "max_hops": "max-hops",
    "ack_mode": "ack-mode",
    "prefetch_count": "prefetch-count",
    "reconnect_delay": "reconnect-delay",
    "expires": "expires",
    "message_ttl": "message-ttl",
    "push": "push",
}


def _federation(raw: Any, vhosts: tuple[str, ...]) -> tuple[str, tuple[Upstream, ...]]:
    """``[federation]``: this cluster's server id and the upstreams a new cluster starts with."""
    if not isinstance(raw, dict):
        raise ConfigError("[federation] must be a table")
    unknown = sorted(set(raw) - {"server_id", "upstreams"})
    if unknown:
        raise ConfigError(f"unknown [federation] key(s): {', '.join(unknown)}")
    server_id = str(raw.get("server_id", ""))
    upstreams = []
    for u in raw.get("upstreams", []):
        extra = sorted(set(u) - {"name", "vhost", *_UPSTREAM_KEYS})
        if extra:
            raise ConfigError(f"unknown [[federation.upstreams]] key(s): {', '.join(extra)}")
        name, vhost = _req(u, "name", "federation.upstreams"), str(u.get("vhost", "/"))
        if vhost not in vhosts:
            raise ConfigError(f"upstream {name!r}: vhost {vhost!r} is not declared")
        value = {_UPSTREAM_KEYS[k]: v for k, v in u.items() if k in _UPSTREAM_KEYS}
        upstream = upstream_from_value(vhost, name, value)
        if isinstance(upstream, str):
            raise ConfigError(f"upstream {name!r}: {upstream}")
        upstreams.append(upstream)
    return server_id, tuple(upstreams)


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


def from_dict(data: dict[str, Any], listen: str | None = None) -> ServerConfig:
    known = {
        "server",
        "limits",
        "users",
        "vhosts",
        "cluster",
        "log",
        "store",
        "tls",
        "policies",
        "federation",
    }
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        raise ConfigError(f"unknown config section(s): {', '.join(unknown)}")
    server = dict(data.get("server", {}))
    limits = dict(data.get("limits", {}))
    log = dict(data.get("log", {}))
    configured = server.pop("listen", ["127.0.0.1:5672"])
    # ``cpgbroker start --listen`` takes the place of the file's.
    listeners = _addresses([listen] if listen is not None else configured, "server.listen")
    listeners_tls = _addresses(server.pop("listen_tls", []), "server.listen_tls")
    tls = parse_tls(data.get("tls"))
    if listeners_tls and tls is None:
        raise ConfigError("[server] listen_tls needs a [tls] section (certfile, keyfile, ...)")
    if "cluster" in data and "url" not in data["cluster"] and listeners:
        data["cluster"] = {**data["cluster"], "url": f"amqp://{listeners[0]}/"}
    vhosts = tuple(data.get("vhosts", ["/"]))
    users_raw = data.get("users")
    if users_raw is None:
        users: tuple[User, ...] = BrokerConfig().users
    else:
        users = tuple(
            User(
                name=_req(u, "name", "users"),
                password=_password(u),
                password_hash=str(u.get("password_hash", "")),
                hashing_algorithm=str(u.get("hashing_algorithm", auth.DEFAULT_ALGORITHM)),
                # With [[users.permissions]], no vhost is granted unless named.
                vhosts=tuple(u.get("vhosts", [] if "permissions" in u else ["/"])),
                permissions=_permissions(u),
                loopback_only=bool(u.get("loopback_only", False)),
                tags=tuple(u.get("tags", [])),
                max_connections=_count_limit(u, "max_connections", "users"),
                max_channels=_count_limit(u, "max_channels", "users"),
            )
            for u in users_raw
        )
    for u in users:
        for vh in u.vhosts:
            if vh not in vhosts:
                raise ConfigError(f"user {u.name!r} refers to vhost {vh!r} which is not declared")
        for perm in u.permissions:
            if perm.vhost not in vhosts:
                raise ConfigError(
                    f"user {u.name!r} has permissions on vhost {perm.vhost!r} which is not declared"
                )
            if perm.vhost in u.vhosts:
                raise ConfigError(
                    f"user {u.name!r}: vhost {perm.vhost!r} is both in vhosts (full "
                    "permissions) and in [[users.permissions]]"
                )
        permissions.check_user(u)
    server_id, upstreams = _federation(data.get("federation", {}), vhosts)
    try:
        broker = BrokerConfig(
            # What clients are told in server-properties: this member's release.
            version=__version__,
            users=users,
            vhosts=vhosts,
            policies=_policies(data.get("policies", []), vhosts),
            server_id=server_id,
            upstreams=upstreams,
            replicated="cluster" in data,
            cluster_name=_cluster_name(data.get("cluster")),
            **_limit_values(limits),
        )
    except TypeError as e:
        raise ConfigError(f"bad [limits]: {e}") from None
    for k in _LIMIT_KEYS:
        limits.pop(k, None)
    if limits:
        raise ConfigError(f"unknown [limits] key(s): {', '.join(sorted(limits))}")
    cluster = None
    if "cluster" in data:
        c = dict(data["cluster"])
        group = _req(c, "group", "cluster")
        if len(group.encode()) > 127:
            raise ConfigError("cluster.group is longer than 127 bytes (the CPG name limit)")
        cluster = ClusterConfig(
            group=group,
            size=int(c.get("size", 1)),
            url=str(c.get("url", "")),
            event_log=str(c.get("event_log", "")),
            netns=str(c.get("netns", "")),
            ready_timeout=float(c.get("ready_timeout", 120.0)),
            max_lag=int(c.get("max_lag", 20_000)),
            update_listen=str(c.get("update_listen", "")),
            update_rate_limit=float(c.get("update_rate_limit", 0.0)),
            checkpoint_every=int(c.get("checkpoint_every", 10_000)),
            watchdog_timeout=float(c.get("watchdog_timeout", 30.0)),
            max_apply_seconds=float(c.get("max_apply_seconds", 300.0)),
            fault_injection=bool(c.get("fault_injection", False)),
            allow_plaintext_ring=bool(c.get("allow_plaintext_ring", False)),
            mode=str(c.get("mode", "active-active")),
            replication=str(c.get("replication", "bytes")),
            replicate=str(c.get("replicate", "all")),
            local_listen=_addresses(c.get("local_listen", []), "cluster.local_listen"),
            local_listen_tls=_addresses(c.get("local_listen_tls", []), "cluster.local_listen_tls"),
        )
        if cluster.update_listen:
            parse_listen(cluster.update_listen)
        known_keys = (
            "group",
            "name",
            "size",
            "url",
            "event_log",
            "netns",
            "ready_timeout",
            "max_lag",
            "update_listen",
            "update_rate_limit",
            "checkpoint_every",
            "watchdog_timeout",
            "max_apply_seconds",
            "fault_injection",
            "allow_plaintext_ring",
            "mode",
            "replication",
            "replicate",
            "local_listen",
            "local_listen_tls",
        )
        unknown_c = sorted(k for k in c if k not in known_keys)
        if unknown_c:
            raise ConfigError(f"unknown [cluster] key(s): {', '.join(unknown_c)}")
        if cluster.size < 1:
            raise ConfigError("cluster.size must be at least 1")
        if cluster.mode not in ("active-active", "hot-standby"):
            raise ConfigError(
                f'cluster.mode must be "active-active" or "hot-standby", not {cluster.mode!r}'
            )
        if cluster.replication not in ("bytes", "changes"):
            raise ConfigError(
                f'cluster.replication must be "bytes" or "changes", not {cluster.replication!r}'
            )
        if cluster.replicate not in REPLICATE:
            raise ConfigError(
                f"cluster.replicate must be one of {', '.join(REPLICATE)}, not "
                f"{cluster.replicate!r}"
            )
        if cluster.replication == "changes" and cluster.mode != "hot-standby":
            raise ConfigError(
                'cluster.replication = "changes" needs mode = "hot-standby": in active-active '
                "every member serves clients, so every member applies their bytes"
            )
        if cluster.replicate != "all" and cluster.replication != "changes":
            raise ConfigError(
                "cluster.replicate chooses what a hot-standby primary ships: it needs "
                'replication = "changes"'
            )
        if cluster.checkpoint_every < 1:
            raise ConfigError("cluster.checkpoint_every must be at least 1")
        if cluster.watchdog_timeout < 0:
            raise ConfigError("cluster.watchdog_timeout must be 0 (off) or positive")
        if cluster.max_apply_seconds < 0:
            raise ConfigError("cluster.max_apply_seconds must be 0 (off) or positive")
        if not isinstance(c.get("fault_injection", False), bool):
            raise ConfigError("cluster.fault_injection must be true or false")
        if not isinstance(c.get("allow_plaintext_ring", False), bool):
            raise ConfigError("cluster.allow_plaintext_ring must be true or false")
        if cluster.local_listen_tls and tls is None:
            raise ConfigError("cluster.local_listen_tls needs a [tls] section (certfile, keyfile)")
    store = _store(dict(data["store"])) if "store" in data else None
    if store is not None and cluster is None:
        raise ConfigError("[store] needs [cluster]: the store records a cluster member's stream")
    admin_listen = str(server.get("admin", ""))
    if admin_listen:
        parse_listen(admin_listen)
    admin_token = str(server.get("admin_token", ""))
    admin_secret_file = str(server.get("admin_secret_file", ""))
    admin_tls = server.get("admin_tls", False)
    if not isinstance(admin_tls, bool):
        raise ConfigError("server.admin_tls must be true or false")
    if admin_tls and tls is None:
        raise ConfigError("[server] admin_tls needs a [tls] section (certfile, keyfile)")
    extra = sorted(
        k
        for k in server
        if k
        not in (
            "shutdown_grace",
            "tick_ms",
            "admin",
            "admin_token",
            "admin_secret_file",
            "admin_tls",
        )
    )
    if extra:
        raise ConfigError(f"unknown [server] key(s): {', '.join(extra)}")
    return ServerConfig(
        listen=listeners,
        listen_tls=listeners_tls,
        tls=tls,
        log_level=str(log.get("level", "info")),
        log_format=str(log.get("format", "logfmt")),
        shutdown_grace=float(server.get("shutdown_grace", 5.0)),
        tick_ms=int(server.get("tick_ms", 100)),
        admin_listen=admin_listen,
        admin_token=admin_token,
        admin_secret_file=admin_secret_file,
        admin_tls=admin_tls,
        broker=broker,
        cluster=cluster,
        store=store,
    )


_STORE_KEYS = (
    "dir",
    "fsync",
    "fsync_interval_ms",
    "segment_mib",
    "snapshot_mib",
    "free_disk_limit_mib",
    "recover_with",
)


def standalone_name() -> str:
    """A standalone broker's cluster name: its node name as the management API gives it
    (runtime/mgmt/mgmt_json.py ``node_name`` without a member URL), as RabbitMQ names a cluster of
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


def _store(d: dict[str, Any]) -> StoreSettings | None:
    unknown = sorted(k for k in d if k not in _STORE_KEYS)
    if unknown:
        raise ConfigError(f"unknown [store] key(s): {', '.join(unknown)}")
    directory = str(d.get("dir", ""))
    if not directory:
        return None
    fsync = str(d.get("fsync", "always"))
    if fsync not in FSYNC_POLICIES:
        raise ConfigError(f"[store] fsync must be one of {', '.join(FSYNC_POLICIES)}")
    interval = d.get("fsync_interval_ms", 20)
    segment = d.get("segment_mib", 64)
    snap = d.get("snapshot_mib", 256)
    recover_with = str(d.get("recover_with", "all"))
    if recover_with not in RECOVER_WITH:
        raise ConfigError(f"[store] recover_with must be one of {', '.join(RECOVER_WITH)}")
    free = d.get("free_disk_limit_mib", 50)
    if isinstance(free, bool) or not isinstance(free, int) or free < 0:
        raise ConfigError("[store] free_disk_limit_mib must be 0 (off) or a positive integer")
    for key, v in (
        ("fsync_interval_ms", interval),
        ("segment_mib", segment),
        ("snapshot_mib", snap),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"[store] {key} must be a positive integer")
    return StoreSettings(
        directory=directory,
        fsync=fsync,
        fsync_interval_ms=interval,
        segment_bytes=segment * 2**20,
        snapshot_bytes=snap * 2**20,
        free_disk_limit=free * 2**20,
        recover_with=recover_with,
    )


_LIMIT_KEYS = (
    "channel_max",
    "frame_max",
    "heartbeat",
    "max_message_size",
    "high_watermark_bytes",
    "low_watermark_ratio",
    "vhost_max_connections",
    "vhost_max_queues",
    "vhost_max_exchanges",
    "vhost_max_bindings",
    "queue_flow_messages",
    "consumer_timeout",
)
# Limits where -1 means none (RabbitMQ's convention; TOML has no null).
_COUNT_LIMITS = (
    "vhost_max_connections",
    "vhost_max_queues",
    "vhost_max_exchanges",
    "vhost_max_bindings",
    "max_connections",
    "max_channels",
)


def _limit_values(limits: dict[str, Any]) -> dict[str, Any]:
    out = {
        k: _count_limit(limits, k, "limits") if k in _COUNT_LIMITS else limits[k]
        for k in list(limits)
        if k in _LIMIT_KEYS
    }
    if "consumer_timeout" in out:
        out["consumer_timeout"] = _consumer_timeout(out["consumer_timeout"])
    return out


def _consumer_timeout(v: Any) -> int | None:
    """``[limits] consumer_timeout``: milliseconds, as RabbitMQ's; 0 or false: none."""
    if v is False:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(
            "[limits] consumer_timeout must be a number of milliseconds, or 0 or false for none"
        )
    return v or None


def _count_limit(d: dict[str, Any], key: str, section: str) -> int | None:
    v = d.get(key, -1)
    if isinstance(v, bool) or not isinstance(v, int) or v < -1:
        raise ConfigError(f"[{section}] {key} must be an integer, -1 for no limit")
    return None if v == -1 else v


def _password(u: dict[str, Any]) -> str:
    """A user has ``password`` or ``password_hash`` (RabbitMQ's format), not both."""
    name = u.get("name", "?")
    if ("password" in u) == ("password_hash" in u):
        raise ConfigError(f"[[users]] {name!r} needs either password or password_hash")
    if "password_hash" in u:
        algo = str(u.get("hashing_algorithm", auth.DEFAULT_ALGORITHM))
        # "" as RabbitMQ's `clear_password`: no password login at all (EXTERNAL only).
        if u["password_hash"] != "" and not auth.valid_hash(str(u["password_hash"]), algo):
            raise ConfigError(
                f"[[users]] {name!r}: password_hash is not a {algo} hash in RabbitMQ's format "
                "(make one with `cpgbroker hash-password`)"
            )
        return ""
    return str(u["password"])


def _permissions(u: dict[str, Any]) -> tuple[Permission, ...]:
    """[[users.permissions]]: vhost, configure, write, read, all required (as rabbitmqctl
    set_permissions); the patterns are checked once the users are built."""
    name = u.get("name", "?")
    raw = u.get("permissions", [])
    if not isinstance(raw, list) or not all(isinstance(p, dict) for p in raw):
        raise ConfigError(f"[[users]] {name!r}: permissions must be [[users.permissions]] tables")
    out: list[Permission] = []
    for p in raw:
        keys = ("vhost", *permissions.FIELDS)
        missing = [k for k in keys if k not in p]
        unknown = sorted(k for k in p if k not in keys)
        if missing or unknown:
            raise ConfigError(
                f"[[users.permissions]] of user {name!r} "
                + (f"is missing {', '.join(missing)}" if missing else "")
                + (" and " if missing and unknown else "")
                + (f"has unknown key(s) {', '.join(unknown)}" if unknown else "")
            )
        bad = [k for k in keys if not isinstance(p[k], str)]
        if bad:
            raise ConfigError(f"user {name!r}, vhost {p['vhost']!r}: {bad[0]} must be a string")
        if any(q.vhost == p["vhost"] for q in out):
            raise ConfigError(f"user {name!r} has two permissions entries for vhost {p['vhost']!r}")
        out.append(Permission(p["vhost"], p["configure"], p["write"], p["read"]))
    return tuple(out)


def _req(d: dict[str, Any], key: str, section: str) -> Any:
    if key not in d:
        raise ConfigError(f"[{section}] entry is missing {key!r}")
    return d[key]

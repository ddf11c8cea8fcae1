"""What a new cluster starts with: ``[[users]]`` (with ``[[users.permissions]]``),
``[[policies]]`` and ``[federation]`` of ``cpgbroker.toml``, each entry read into its attrs
class here (runtime/config/sections.py), then made the model's record (``User``,
``Permission``, ``Policy``, ``Upstream``) and checked against the declared vhosts.

These classes are the file's side: a key is a field, written once, with its default and its
validation. The model's records keep their own shape (hashed into the members' digest,
runtime/config/digest.py); a default that is the record's is taken from it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from cpgbroker.errors import ConfigError
from cpgbroker.model import (
    BrokerConfig,
    Permission,
    Policy,
    Upstream,
    User,
    auth,
    check_user,
    upstream_from_value,
    validate_policy,
)
from cpgbroker.runtime.config.sections import structure, structure_array

# Taken as the file gives it: the model's record, or the entry's own reading, checks it.
_VERBATIM: dict[str, object] = {"verbatim": True}


def _user_default(name: str) -> Any:
    return attrs.fields_dict(User)[name].default


@attrs.frozen
class PermissionEntry:
    """``[[users.permissions]]``: every key required, as rabbitmqctl set_permissions; the
    patterns (strings, valid regular expressions) are checked with the user (``check_user``)."""

    KEY: ClassVar[str] = "[users.permissions] {}"

    vhost: str = attrs.field(metadata=_VERBATIM)
    configure: str = attrs.field(metadata=_VERBATIM)
    write: str = attrs.field(metadata=_VERBATIM)
    read: str = attrs.field(metadata=_VERBATIM)


@attrs.frozen
class UserEntry:
    """``[[users]]``: a user, with ``password`` or ``password_hash`` (RabbitMQ's format)."""

    KEY: ClassVar[str] = "[users] {}"

    name: str
    password: str | None = None
    # "" as RabbitMQ's `clear_password`: no password login at all (EXTERNAL only).
    password_hash: str | None = None
    hashing_algorithm: str = _user_default("hashing_algorithm")
    # Full permissions on each; without the key: "/", or none with [[users.permissions]].
    vhosts: tuple[str, ...] | None = None
    # The [[users.permissions]] tables (read with the user's name, into PermissionEntry).
    permissions: Any = attrs.field(default=None, metadata=_VERBATIM)
    loopback_only: bool = _user_default("loopback_only")
    tags: tuple[str, ...] = _user_default("tags")
    # Checked by the model's User (-1: no limit).
    max_connections: Any = attrs.field(default=None, metadata=_VERBATIM)
    max_channels: Any = attrs.field(default=None, metadata=_VERBATIM)

    def __attrs_post_init__(self) -> None:
        if (self.password is None) == (self.password_hash is None):
            raise ConfigError(f"[[users]] {self.name!r} needs either password or password_hash")
        if self.password_hash and not auth.valid_hash(self.password_hash, self.hashing_algorithm):
            raise ConfigError(
                f"[[users]] {self.name!r}: password_hash is not a {self.hashing_algorithm} hash "
                "in RabbitMQ's format (make one with `cpgbroker hash-password`)"
            )

    def user(self) -> User:
        permissions = self._permissions()
        default_vhosts = ("/",) if self.permissions is None else ()
        return User(
            name=self.name,
            password=self.password or "",
            password_hash=self.password_hash or "",
            hashing_algorithm=self.hashing_algorithm,
            vhosts=default_vhosts if self.vhosts is None else self.vhosts,
            permissions=permissions,
            loopback_only=self.loopback_only,
            tags=self.tags,
            max_connections=self.max_connections,
            max_channels=self.max_channels,
        )

    def _permissions(self) -> tuple[Permission, ...]:
        raw = [] if self.permissions is None else self.permissions
        if not isinstance(raw, list) or not all(isinstance(p, dict) for p in raw):
            raise ConfigError(
                f"[[users]] {self.name!r}: permissions must be [[users.permissions]] tables"
            )
        keys = attrs.fields_dict(PermissionEntry)
        out: list[Permission] = []
        for table in raw:
            missing = [k for k in keys if k not in table]
            unknown = sorted(k for k in table if k not in keys)
            if missing or unknown:
                raise ConfigError(
                    f"[[users.permissions]] of user {self.name!r} "
                    + (f"is missing {', '.join(missing)}" if missing else "")
                    + (" and " if missing and unknown else "")
                    + (f"has unknown key(s) {', '.join(unknown)}" if unknown else "")
                )
            p = structure(PermissionEntry, table, "users.permissions")
            if any(q.vhost == p.vhost for q in out):
                raise ConfigError(
                    f"user {self.name!r} has two permissions entries for vhost {p.vhost!r}"
                )
            out.append(Permission(p.vhost, p.configure, p.write, p.read))
        return tuple(out)


def users(raw: Any, vhosts: tuple[str, ...]) -> tuple[User, ...]:
    """``[[users]]``, each checked against the declared vhosts; the default user without."""
    if raw is None:
        made: tuple[User, ...] = BrokerConfig().users
    else:
        made = tuple(entry.user() for entry in structure_array(UserEntry, raw, "users"))
    for u in made:
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
        check_user(u)
    return made


@attrs.frozen
class PolicyEntry:
    """``[[policies]]``: a policy a new cluster starts with (RabbitMQ's set_policy keys)."""

    KEY: ClassVar[str] = "[policies] {}"

    name: str
    pattern: str
    vhost: str = "/"
    apply_to: str = "all"
    definition: dict[str, Any] = attrs.field(factory=dict)
    priority: int = 0

    def policy(self, vhosts: tuple[str, ...]) -> Policy:
        if self.vhost not in vhosts:
            raise ConfigError(f"policy {self.name!r}: vhost {self.vhost!r} is not declared")
        made = Policy(
            self.vhost, self.name, self.pattern, self.apply_to, self.definition, self.priority
        )
        problem = validate_policy(made)
        if problem is not None:
            raise ConfigError(f"policy {self.name!r}: {problem}")
        return made


def policies(raw: Any, vhosts: tuple[str, ...]) -> tuple[Policy, ...]:
    """``[[policies]]``, each checked against the declared vhosts."""
    return tuple(p.policy(vhosts) for p in structure_array(PolicyEntry, raw, "policies"))


def _value(name: str) -> dict[str, object]:
    """A key that is ``name`` in RabbitMQ's federation-upstream value: taken as the file gives
    it (None: not given) and checked, with its default, by the model's ``upstream_from_value``."""
    return {"verbatim": True, "value": name}


@attrs.frozen
class UpstreamEntry:
    """``[[federation.upstreams]]``: an upstream a new cluster starts with."""

    KEY: ClassVar[str] = "[federation.upstreams] {}"

    name: str
    vhost: str = "/"
    uri: Any = attrs.field(default=None, metadata=_value("uri"))
    exchange: Any = attrs.field(default=None, metadata=_value("exchange"))
    max_hops: Any = attrs.field(default=None, metadata=_value("max-hops"))
    ack_mode: Any = attrs.field(default=None, metadata=_value("ack-mode"))
    prefetch_count: Any = attrs.field(default=None, metadata=_value("prefetch-count"))
    reconnect_delay: Any = attrs.field(default=None, metadata=_value("reconnect-delay"))
    expires: Any = attrs.field(default=None, metadata=_value("expires"))
    message_ttl: Any = attrs.field(default=None, metadata=_value("message-ttl"))
    push: Any = attrs.field(default=None, metadata=_value("push"))

    def upstream(self, vhosts: tuple[str, ...]) -> Upstream:
        if self.vhost not in vhosts:
            raise ConfigError(f"upstream {self.name!r}: vhost {self.vhost!r} is not declared")
        value = {
            f.metadata["value"]: getattr(self, f.name)
            for f in attrs.fields(UpstreamEntry)
            if "value" in f.metadata and getattr(self, f.name) is not None
        }
        made = upstream_from_value(self.vhost, self.name, value)
        if isinstance(made, str):
            raise ConfigError(f"upstream {self.name!r}: {made}")
        return made


@attrs.frozen
class FederationSection:
    """``[federation]``: this cluster's server id and the upstreams a new cluster starts with."""

    KEY: ClassVar[str] = "federation.{}"

    server_id: str = ""
    # The [[federation.upstreams]] tables (read into UpstreamEntry).
    upstreams: Any = attrs.field(factory=list, metadata=_VERBATIM)

    def upstreams_in(self, vhosts: tuple[str, ...]) -> tuple[Upstream, ...]:
        entries = structure_array(UpstreamEntry, self.upstreams, "federation.upstreams")
        return tuple(u.upstream(vhosts) for u in entries)


def federation(raw: Any, vhosts: tuple[str, ...]) -> tuple[str, tuple[Upstream, ...]]:
    """``[federation]``: the server id and the upstreams, checked against the declared vhosts."""
    section = structure(FederationSection, raw, "federation")
    return section.server_id, section.upstreams_in(vhosts)

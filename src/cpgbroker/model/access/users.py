"""The broker's users and their permissions: replicated state, changed by ordered admin events.

The configuration only seeds them (a new cluster starts with the TOML's ``[[users]]``); from
then on ``cpgbroker ctl add_user`` / ``set_permissions`` and the management API change them
through :class:`~cpgbroker.model.events.AdminCommand` events (model/operators/admin.py), so every
member changes them at the same point of the order, snapshots carry them to newcomers and
stores, and the digest compares them.

Owns ``by_name`` (name -> :class:`User`, in the order users were added: the order listings
and snapshots show). The dict object itself is shared, never replaced: the connections
component (logins, vhost access) and the limits (user limits) read it. Permissions are
compiled from it (``Permissions.load``) whenever a user changes: changes are rare, logins
and publishes are not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import attrs

from cpgbroker.model.access import auth
from cpgbroker.model.access.permissions import Permissions
from cpgbroker.model.config import Permission, User


def seed_salt(name: str) -> bytes:
    """The salt of a configured plain password's hash: drawn from the user's name, so that
    every member (and every restart) makes the same hash of it."""
    return hashlib.sha256(b"cpgbroker password salt\0" + name.encode()).digest()[: auth.SALT_BYTES]


def hashed(u: User) -> User:
    """``u`` with a configured plain password replaced by its salted hash: model state (and
    so snapshots, stores and state updates) never holds a password."""
    if not u.password or u.password_hash:
        return u
    return attrs.evolve(
        u,
        password="",
        password_hash=auth.hash_password(u.password, seed_salt(u.name)),
        hashing_algorithm=auth.DEFAULT_ALGORITHM,
    )


class Users:
    __slots__ = ("_permissions", "by_name", "seeded")

    def __init__(self, seed: Iterable[User], permissions: Permissions) -> None:
        self.by_name: dict[str, User] = {}
        for u in seed:
            # The first of a name, as a scan of the configuration would find it.
            if u.name not in self.by_name:
                self.by_name[u.name] = hashed(u)
        # What the configuration seeded (equal on every member: the configuration is): a
        # snapshot carries the users only once they are something else.
        self.seeded = tuple(self.by_name.values())
        self._permissions = permissions
        permissions.load(self.by_name.values())

    def put(self, user: User) -> bool:
        """Add ``user`` or replace the user of its name (keeping its place); whether it is
        new."""
        new = user.name not in self.by_name
        self.by_name[user.name] = user
        self._permissions.load(self.by_name.values())
        return new

    def delete(self, name: str) -> bool:
        if self.by_name.pop(name, None) is None:
            return False
        self._permissions.load(self.by_name.values())
        return True

    def set_permission(self, name: str, perm: Permission) -> bool:
        """Give user ``name`` ``perm`` on its vhost (in place of what it had there); whether
        the user exists."""
        u = self.by_name.get(name)
        if u is None:
            return False
        kept = tuple(p for p in u.grants() if p.vhost != perm.vhost)
        self.put(attrs.evolve(u, vhosts=(), permissions=(*kept, perm)))
        return True

    def clear_permission(self, name: str, vhost: str) -> bool:
        """Take user ``name``'s permissions on ``vhost`` away; whether it had any."""
        u = self.by_name.get(name)
        if u is None or not u.may_open(vhost):
            return False
        kept = tuple(p for p in u.grants() if p.vhost != vhost)
        self.put(attrs.evolve(u, vhosts=(), permissions=kept))
        return True

    def forget_vhost(self, vhost: str) -> None:
        """A vhost was deleted: nobody keeps permissions on it (RabbitMQ deletes them with
        it, so a vhost made again under the name starts with none)."""
        for name in list(self.by_name):
            u = self.by_name[name]
            if u.may_open(vhost):
                kept = tuple(p for p in u.grants() if p.vhost != vhost)
                self.by_name[name] = attrs.evolve(u, vhosts=(), permissions=kept)
        self._permissions.load(self.by_name.values())

    def restore(self, users: Iterable[User]) -> None:
        """Install the users of a snapshot in place of the seeded ones."""
        self.by_name.clear()
        for u in users:
            self.by_name[u.name] = u
        self._permissions.load(self.by_name.values())

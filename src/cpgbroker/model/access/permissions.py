"""Permissions: which queues and exchanges of a vhost a user may configure, write and read.

Theory of operation
-------------------
RabbitMQ's internal authorisation backend, fed from the configuration (``User.grants()``):
a user holds, per vhost, three regular expressions over resource names (queues and exchanges
alike). Which operation needs which permission is RabbitMQ's (``rabbit_channel``):

* configure: queue.declare, queue.delete, exchange.declare, exchange.delete (on the resource);
* write: basic.publish (on the exchange), queue.bind / unbind (on the queue), exchange.bind /
  unbind (on the destination), and the dead-letter exchange of a queue or the alternate
  exchange of an exchange being created;
* read: basic.get, basic.consume, queue.purge (on the queue), bindings (on the source
  exchange), and a queue or exchange being created with a dead-letter / alternate exchange
  (on itself);
* passive declares: any one of the three (RabbitMQ 4.2.6 and later; the refusal names
  configure, as a regular declare's does).

What the broker does on its own is not checked, as in RabbitMQ: dead-lettering, routing to an
alternate exchange, publishing the member list on ``amq.failover``. The default exchange is
checked under its name ``amq.default``; a server-named queue under its generated name. A
refusal is 403 ACCESS_REFUSED with RabbitMQ's text (a channel exception); the handlers call
the checks before they look anything up, so a refused client learns nothing of what exists.
Opening a vhost is the connection's business (``User.may_open``: 530 NOT_ALLOWED).

Matching is RabbitMQ's ``re:run(Name, Pattern, [{capture, none}])``: a search, not anchored
(``^`` and ``$`` in the pattern anchor it), on the name's UTF-8 bytes with a bytes pattern,
as Erlang's ``re`` matches a binary without the ``unicode`` option (so ``.`` is one byte and
``\\w`` ASCII in both). "" is taken as ``^$`` as RabbitMQ does, which no checked name matches.
Differences from PCRE that matter: PCRE-only syntax (``\\Q...\\E``, ``(?<name>``,
``\\p{..}``, recursion, ``(*VERB)``) is refused at load rather than accepted, and ``\\Z`` is
PCRE's ``\\z``. RabbitMQ caps a pattern at 1024 bytes (so do we) and a match at 50,000 steps;
Python has no step limit, but patterns come from the operator's configuration and names are
at most 255 bytes.

Cost: patterns are compiled once, when the broker is built; ".*" is never run at all. Every
member replays every publish, so the per-message check is one dict lookup of a result kept
per (user, vhost, exchange) (``published``, which the delivery path reads directly); other
results are kept per (user, vhost, permission, name). Both are derived (a function of the
configuration and the name): not snapshot state, not digested, and emptied when they grow past
``CACHE_MAX`` entries, since clients choose the names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs

from cpgbroker.errors import ChannelError, ConfigError, ReplyCode
from cpgbroker.model.config import ALL, Permission, User
from cpgbroker.model.entities import Connection

CONFIGURE = "configure"
WRITE = "write"
READ = "read"
FIELDS = (CONFIGURE, WRITE, READ)

# RabbitMQ's rabbit_re:max_pattern_length.
MAX_PATTERN_BYTES = 1024
# Results kept before the caches start again (a few MiB at most).
CACHE_MAX = 10_000
# Who an operator holding a member's admin secret acts as (model/operators/admin.py): every
# permission. No user can have this name: NUL is not allowed in a user name
# (model/operators/admin.py refuses it, and a login's name never carries one past SASL PLAIN, which
# splits on NUL).
TRUSTED = "\x00admin-secret"

# A compiled pattern, or True for ".*" (everything: nothing to run).
_Matcher = re.Pattern[bytes] | bool


def compile_pattern(pattern: str) -> _Matcher:
    """``pattern`` as matched against names; ValueError if RabbitMQ would refuse it or
    Python's ``re`` cannot compile it."""
    if pattern == ALL:
        return True
    raw = pattern.encode()
    if len(raw) > MAX_PATTERN_BYTES:
        raise ValueError(f"longer than {MAX_PATTERN_BYTES} bytes")
    try:
        # RabbitMQ runs "" as "^$" (an empty pattern would match every name).
        return re.compile(raw or b"^$")
    except re.error as e:
        raise ValueError(str(e)) from None


def check_user(user: User) -> None:
    """ConfigError naming the user, vhost and field of the first pattern that is invalid."""
    for p in user.permissions:
        for field in FIELDS:
            pattern = getattr(p, field)
            if not isinstance(pattern, str):
                raise ConfigError(
                    f"user {user.name!r}, vhost {p.vhost!r}: {field} must be a string"
                )
            try:
                compile_pattern(pattern)
            except ValueError as e:
                raise ConfigError(
                    f"user {user.name!r}, vhost {p.vhost!r}: {field} pattern {pattern!r} is "
                    f"not a valid regular expression: {e}"
                ) from None


@attrs.frozen
class _Grant:
    """One user's compiled permissions on one vhost (equal when compiled from equal
    patterns: ``re.Pattern`` compares its source)."""

    configure: _Matcher
    write: _Matcher
    read: _Matcher

    @classmethod
    def compile(cls, p: Permission) -> _Grant:
        return cls(compile_pattern(p.configure), compile_pattern(p.write), compile_pattern(p.read))


def _matches(m: _Matcher, name: str) -> bool:
    if m is True or m is False:
        return m
    return m.search(name.encode()) is not None


class Permissions:
    """Owns the compiled permissions of every user and the cached results. Reads a
    connection's ``user`` and ``vhost``; never changes anything but its caches. The users are
    model/access/users.py's, which calls :meth:`load` whenever one changes."""

    __slots__ = ("_grants", "_known", "published")

    def __init__(self, users: Iterable[User] = ()) -> None:
        self._grants: dict[tuple[str, str], _Grant] = {}
        # Derived (module docstring): (user, vhost, permission, name) -> allowed.
        self._known: dict[tuple[str, str, str, str], bool] = {}
        # Derived, the publish path's: (user, vhost, exchange as published) -> may write.
        self.published: dict[tuple[str, str, str], bool] = {}
        self.load(users)

    def load(self, users: Iterable[User]) -> None:
        """Compile the permissions of ``users`` in place of what was loaded before (and forget
        every cached result: they were answers for the old permissions)."""
        grants: dict[tuple[str, str], _Grant] = {}
        for u in users:
            check_user(u)
            for p in u.grants():
                grants[(u.name, p.vhost)] = _Grant.compile(p)
        self._grants = grants
        self._known.clear()
        self.published.clear()

    def allowed(self, user: str, vhost: str, perm: str, name: str) -> bool:
        key = (user, vhost, perm, name)
        ok = self._known.get(key)
        if ok is None:
            grant = self._grants.get((user, vhost))
            ok = user == TRUSTED or (grant is not None and _matches(getattr(grant, perm), name))
            if len(self._known) >= CACHE_MAX:
                self._known.clear()
            self._known[key] = ok
        return ok

    def check(self, conn: Connection, perm: str, kind: str, name: str) -> None:
        """403 unless ``conn``'s user has ``perm`` on the ``kind`` ("queue" or "exchange")
        named ``name`` ("" is the default exchange) in its vhost."""
        if kind == "exchange" and name == "":
            name = "amq.default"
        if not self.allowed(conn.user, conn.vhost, perm, name):
            raise refused(conn, perm, kind, name)

    def check_any(self, conn: Connection, kind: str, name: str) -> None:
        """A passive declare: any permission will do; the refusal names configure."""
        user, vhost = conn.user, conn.vhost
        if not (self.allowed(user, vhost, READ, name) or self.allowed(user, vhost, WRITE, name)):
            self.check(conn, CONFIGURE, kind, name)

    def check_publish(self, conn: Connection, exchange: str) -> None:
        """The write check of basic.publish, remembered in ``published`` (whose hit is all the
        delivery path looks at)."""
        key = (conn.user, conn.vhost, exchange)
        ok = self.published.get(key)
        if ok is None:
            ok = self.allowed(conn.user, conn.vhost, WRITE, exchange or "amq.default")
            if len(self.published) >= CACHE_MAX:
                self.published.clear()
            self.published[key] = ok
        if not ok:
            raise refused(conn, WRITE, "exchange", exchange or "amq.default", method=(60, 40))


def refused(
    conn: Connection, perm: str, kind: str, name: str, method: tuple[int, int] = (0, 0)
) -> ChannelError:
    """RabbitMQ's text (rabbit_access_control, rabbit_misc:rs). ``method``: basic.publish's
    ids, which a refusal found on its content frames must name itself."""
    return ChannelError(
        ReplyCode.ACCESS_REFUSED,
        f"{perm} access to {kind} '{name}' in vhost '{conn.vhost}' refused for user '{conn.user}'",
        class_id=method[0],
        method_id=method[1],
    )

"""Per-vhost permissions (``model/access/permissions.py``): RabbitMQ's configure / write / read
checks, its 403 ACCESS_REFUSED texts, the ``vhosts`` shorthand, and validation at load."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands as C

from cpgbroker.errors import ConfigError
from cpgbroker.model.access import permissions as P
from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig, Permission, User
from cpgbroker.model.state import snapshot as S
from cpgbroker.runtime.config.digest import config_digest
from cpgbroker.runtime.config.settings import from_dict
from modelclient import Client, Harness

APP = Permission("/", configure=r"^app\.", write=r"^app\.|^amq\.default$", read=r"^app\.")
USERS = (
    User("guest", "guest", ("/", "b")),
    User("app", "app", (), permissions=(APP,)),
    # May open "b" but touch nothing there: "" grants nothing.
    User("none", "none", (), permissions=(Permission("b", "", "", ""),)),
    User("ro", "ro", (), permissions=(Permission("/", "", "", r"^ro\."),)),
)
CONFIG = BrokerConfig(users=USERS, vhosts=("/", "b"))


def _broker() -> Harness:
    return Harness(Broker(CONFIG))


def _open(h: Harness, conn: int, user: str, vhost: str = "/") -> Client:
    c = h.connect(conn)
    ok = c.handshake(user=user, password=user, vhost=vhost)
    assert isinstance(ok, C.Connection.OpenOk), ok
    c.channel(1)
    return c


def _refused(c: Client, ch: int = 1) -> tuple[int, str, int, int]:
    ms = c.methods()
    closes = [m for m in ms if isinstance(m, C.Channel.Close)]
    assert closes, ms
    m = closes[-1]
    c.send(ch, C.Channel.CloseOk())
    return m.reply_code, m.reply_text, m.class_id, m.method_id


def _text(perm: str, kind: str, name: str, user: str = "app", vhost: str = "/") -> str:
    return (
        f"ACCESS_REFUSED - {perm} access to {kind} '{name}' in vhost '{vhost}' refused for "
        f"user '{user}'"
    )


def _setup(h: Harness) -> Client:
    """Topology the restricted users act on, declared by guest."""
    g = _open(h, 100, "guest")
    for q in ("app.q", "other.q", "ro.q"):
        g.rpc(1, C.Queue.Declare(queue=q))
    for x in ("app.x", "other.x"):
        g.rpc(1, C.Exchange.Declare(exchange=x, exchange_type="fanout"))
    return g


# ------------------------------------------------------------------ configure


def test_queue_declare_needs_configure_on_the_name() -> None:
    h = _broker()
    c = _open(h, 1, "app")
    assert isinstance(c.rpc(1, C.Queue.Declare(queue="app.q2")), C.Queue.DeclareOk)
    c.send(1, C.Queue.Declare(queue="other.q"))
    assert _refused(c) == (403, _text("configure", "queue", "other.q"), 50, 10)
    assert "other.q" not in h.broker.topology.vhosts["/"].queues
    assert not c.is_closed  # a channel exception: the connection stays


def test_server_named_queues_are_checked_by_their_generated_name() -> None:
    h = _broker()
    c = _open(h, 1, "app")
    c.send(1, C.Queue.Declare(queue="", exclusive=True))
    code, text, _, _ = _refused(c)
    assert code == 403
    assert text.startswith("ACCESS_REFUSED - configure access to queue 'amq.gen-")
    assert text.endswith("' in vhost '/' refused for user 'app'")
    gen = Harness(
        Broker(
            BrokerConfig(
                users=(User("g", "g", (), permissions=(Permission("/", r"^amq\.gen-", "", ""),)),)
            )
        )
    )
    d = _open(gen, 1, "g")
    ok = d.rpc(1, C.Queue.Declare(queue="", exclusive=True))
    assert isinstance(ok, C.Queue.DeclareOk) and ok.queue.startswith("amq.gen-")


def test_passive_declares_need_any_permission_and_name_configure_when_refused() -> None:
    h = _broker()
    _setup(h)
    c = _open(h, 1, "ro")  # read on ^ro\. only
    assert isinstance(c.rpc(1, C.Queue.Declare(queue="ro.q", passive=True)), C.Queue.DeclareOk)
    c.send(1, C.Queue.Declare(queue="app.q", passive=True))
    assert _refused(c) == (403, _text("configure", "queue", "app.q", "ro"), 50, 10)
    c.channel(2)
    # Refused before it is looked up: a user without rights learns nothing of what exists.
    c.send(2, C.Queue.Declare(queue="missing.q", passive=True))
    assert _refused(c, 2) == (403, _text("configure", "queue", "missing.q", "ro"), 50, 10)
    c.channel(3)
    c.send(3, C.Exchange.Declare(exchange="app.x", passive=True))
    assert _refused(c, 3) == (403, _text("configure", "exchange", "app.x", "ro"), 40, 10)
    a = _open(h, 2, "app")
    a.send(1, C.Queue.Declare(queue="app.missing", passive=True))
    assert _refused(a)[:2] == (404, "NOT_FOUND - no queue 'app.missing' in vhost '/'")


def test_queue_delete_needs_configure() -> None:
    h = _broker()
    _setup(h)
    c = _open(h, 1, "app")
    c.send(1, C.Queue.Delete(queue="other.q"))
    assert _refused(c) == (403, _text("configure", "queue", "other.q"), 50, 40)
    assert "other.q" in h.broker.topology.vhosts["/"].queues
    c.channel(2)
    assert isinstance(c.rpc(2, C.Queue.Delete(queue="app.q")), C.Queue.DeleteOk)


def test_exchange_declare_and_delete_need_configure() -> None:
    h = _broker()
    _setup(h)
    c = _open(h, 1, "app")
    assert isinstance(
        c.rpc(1, C.Exchange.Declare(exchange="app.new", exchange_type="topic")),
        C.Exchange.DeclareOk,
    )
    c.send(1, C.Exchange.Declare(exchange="other.new", exchange_type="topic"))
    assert _refused(c) == (403, _text("configure", "exchange", "other.new"), 40, 10)
    c.channel(2)
    c.send(2, C.Exchange.Delete(exchange="other.x"))
    assert _refused(c, 2) == (403, _text("configure", "exchange", "other.x"), 40, 20)
    assert "other.x" in h.broker.topology.vhosts["/"].exchanges
    c.channel(3)
    assert isinstance(c.rpc(3, C.Exchange.Delete(exchange="app.new")), C.Exchange.DeleteOk)
    # The checks of names come first where RabbitMQ makes them first.
    c.send(3, C.Exchange.Declare(exchange="", exchange_type="direct"))
    assert _refused(c, 3)[1] == "ACCESS_REFUSED - operation not permitted on the default exchange"


# ------------------------------------------------------------------ write and read


def test_publish_needs_write_on_the_exchange_default_exchange_as_amq_default() -> None:
    h = _broker()
    g = _setup(h)
    c = _open(h, 1, "ro")  # no write at all
    c.publish(1, "", "ro.q", b"x")
    assert _refused(c) == (403, _text("write", "exchange", "amq.default", "ro"), 60, 40)
    c.channel(2)
    c.publish(2, "app.x", "", b"x")
    assert _refused(c, 2) == (403, _text("write", "exchange", "app.x", "ro"), 60, 40)
    # Refused before the exchange is looked up.
    c.channel(3)
    c.publish(3, "no.such.x", "", b"x")
    assert _refused(c, 3)[1] == _text("write", "exchange", "no.such.x", "ro")
    assert not h.broker.topology.vhosts["/"].queues["ro.q"].messages
    a = _open(h, 2, "app")
    a.publish(1, "", "app.q", b"ok")  # amq.default matches the app user's write pattern
    assert len(h.broker.topology.vhosts["/"].queues["app.q"].messages) == 1
    assert g.conn in h.broker.connections and not c.is_closed


def test_the_publish_check_is_one_cached_lookup_per_user_vhost_and_exchange(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = _broker()
    _setup(h)
    a = _open(h, 1, "app")
    perms = h.broker.permissions
    calls: list[tuple[str, ...]] = []
    real = P.Permissions.allowed

    def counting(self: P.Permissions, *args: str) -> bool:
        calls.append(args)
        return real(self, *args)

    monkeypatch.setattr(P.Permissions, "allowed", counting)
    for i in range(50):
        a.publish(1, "app.x", "", b"%d" % i)
    assert calls == [("app", "/", "write", "app.x")]
    assert perms.published == {("app", "/", "app.x"): True}


def test_queue_bind_and_unbind_need_write_on_the_queue_and_read_on_the_exchange() -> None:
    h = _broker()
    _setup(h)
    c = _open(h, 1, "app")
    assert isinstance(c.rpc(1, C.Queue.Bind(queue="app.q", exchange="app.x")), C.Queue.BindOk)
    c.send(1, C.Queue.Bind(queue="other.q", exchange="app.x"))
    assert _refused(c) == (403, _text("write", "queue", "other.q"), 50, 20)
    c.channel(2)
    c.send(2, C.Queue.Bind(queue="app.q", exchange="other.x"))
    assert _refused(c, 2) == (403, _text("read", "exchange", "other.x"), 50, 20)
    c.channel(3)
    c.send(3, C.Queue.Unbind(queue="other.q", exchange="app.x"))
    assert _refused(c, 3) == (403, _text("write", "queue", "other.q"), 50, 50)
    c.channel(4)
    c.send(4, C.Queue.Unbind(queue="app.q", exchange="other.x"))
    assert _refused(c, 4) == (403, _text("read", "exchange", "other.x"), 50, 50)
    c.channel(5)
    assert isinstance(c.rpc(5, C.Queue.Unbind(queue="app.q", exchange="app.x")), C.Queue.UnbindOk)


def test_exchange_bind_and_unbind_need_write_on_destination_and_read_on_source() -> None:
    h = _broker()
    _setup(h)
    c = _open(h, 1, "app")
    c.rpc(1, C.Exchange.Declare(exchange="app.y", exchange_type="fanout"))
    ok = c.rpc(1, C.Exchange.Bind(destination="app.y", source="app.x"))
    assert isinstance(ok, C.Exchange.BindOk)
    c.send(1, C.Exchange.Bind(destination="other.x", source="app.x"))
    assert _refused(c) == (403, _text("write", "exchange", "other.x"), 40, 30)
    c.channel(2)
    c.send(2, C.Exchange.Bind(destination="app.y", source="other.x"))
    assert _refused(c, 2) == (403, _text("read", "exchange", "other.x"), 40, 30)
    c.channel(3)
    c.send(3, C.Exchange.Unbind(destination="app.y", source="other.x"))
    assert _refused(c, 3) == (403, _text("read", "exchange", "other.x"), 40, 40)
    c.channel(4)
    ok = c.rpc(4, C.Exchange.Unbind(destination="app.y", source="app.x"))
    assert isinstance(ok, C.Exchange.UnbindOk)


def test_get_consume_and_purge_need_read_on_the_queue() -> None:
    h = _broker()
    _setup(h)
    c = _open(h, 1, "app")
    for n, method, ids in (
        (1, C.Basic.Get(queue="other.q"), (60, 70)),
        (2, C.Basic.Consume(queue="other.q"), (60, 20)),
        (3, C.Queue.Purge(queue="other.q"), (50, 30)),
    ):
        if n > 1:
            c.channel(n)
        c.send(n, method)
        assert _refused(c, n) == (403, _text("read", "queue", "other.q"), *ids)
    c.channel(4)
    assert isinstance(c.rpc(4, C.Basic.Get(queue="app.q")), C.Basic.GetEmpty)
    assert isinstance(c.rpc(4, C.Basic.Consume(queue="app.q")), C.Basic.ConsumeOk)
    assert isinstance(c.rpc(4, C.Queue.Purge(queue="app.q")), C.Queue.PurgeOk)


def test_dead_letter_exchange_is_checked_when_the_queue_is_created_not_when_it_is_used() -> None:
    h = _broker()
    g = _setup(h)
    c = _open(h, 1, "app")
    c.send(1, C.Queue.Declare(queue="app.dl", arguments={"x-dead-letter-exchange": "other.x"}))
    assert _refused(c) == (403, _text("write", "exchange", "other.x"), 50, 10)
    c.channel(2)
    # guest names the dead-letter exchange; app only reads app.dl.
    g.rpc(1, C.Queue.Declare(queue="app.dl", arguments={"x-dead-letter-exchange": "other.x"}))
    g.rpc(1, C.Queue.Bind(queue="other.q", exchange="other.x"))
    # Redeclaring an existing queue checks configure only (RabbitMQ).
    ok = c.rpc(2, C.Queue.Declare(queue="app.dl", arguments={"x-dead-letter-exchange": "other.x"}))
    assert isinstance(ok, C.Queue.DeclareOk)
    c.publish(2, "", "app.dl", b"m")
    got = c.rpc(2, C.Basic.Get(queue="app.dl"))
    assert isinstance(got, C.Basic.GetOk)
    c.send(2, C.Basic.Reject(delivery_tag=got.delivery_tag, requeue=False))
    assert len(h.broker.topology.vhosts["/"].queues["other.q"].messages) == 1


def test_alternate_exchange_is_checked_when_the_exchange_is_created() -> None:
    h = _broker()
    _setup(h)
    c = _open(h, 1, "app")
    c.send(
        1,
        C.Exchange.Declare(
            exchange="app.ae", exchange_type="direct", arguments={"alternate-exchange": "other.x"}
        ),
    )
    assert _refused(c) == (403, _text("write", "exchange", "other.x"), 40, 10)
    c.channel(2)
    ok = c.rpc(
        2,
        C.Exchange.Declare(
            exchange="app.ae", exchange_type="direct", arguments={"alternate-exchange": "app.x"}
        ),
    )
    assert isinstance(ok, C.Exchange.DeclareOk)


# ------------------------------------------------------------------ vhosts, "", isolation


def test_opening_a_vhost_needs_permissions_on_it_even_empty_ones() -> None:
    h = _broker()
    c = h.connect(1)
    close = c.handshake(user="app", password="app", vhost="b")
    assert isinstance(close, C.Connection.Close)
    assert (close.reply_code, close.reply_text) == (
        530,
        "NOT_ALLOWED - access to vhost 'b' refused for user 'app'",
    )
    n = _open(h, 2, "none", vhost="b")
    # "" grants nothing: not even a server-named queue.
    n.send(1, C.Queue.Declare(queue="", exclusive=True))
    assert _refused(n)[0] == 403
    n.channel(2)
    n.publish(2, "", "x", b"x")
    assert _refused(n, 2)[1] == _text("write", "exchange", "amq.default", "none", "b")


def test_the_vhosts_shorthand_is_full_permissions_and_permissions_replace_it() -> None:
    u = User("u", "p", ("/", "b"), permissions=(Permission("b", "", "", ""),))
    assert u.grants() == (Permission("b", "", "", ""), Permission("/", ".*", ".*", ".*"))
    assert u.may_open("/") and u.may_open("b") and not u.may_open("c")
    h = _broker()
    g = _open(h, 1, "guest")
    for i, q in enumerate(("a", "ünïcode", "x" * 255)):
        g.send_unchecked(1, C.Queue.Declare, queue=q)
        assert isinstance(g.methods()[-1], C.Queue.DeclareOk), i


def test_patterns_search_the_name_bytes_unanchored() -> None:
    perms = P.Permissions(
        (
            User("u", "p", (), permissions=(Permission("/", "q", r"^..$", r"\w+$"),)),
            User("e", "p", (), permissions=(Permission("/", "", "", ""),)),
        )
    )
    assert perms.allowed("u", "/", "configure", "my-q-1")  # a search, not a full match
    assert not perms.allowed("u", "/", "configure", "Q")
    # Erlang's re matches a binary byte by byte: "é" is two bytes.
    assert perms.allowed("u", "/", "write", "é") and not perms.allowed("u", "/", "write", "ab!")
    assert not perms.allowed("u", "/", "read", "é")  # \w is ASCII on bytes, as in PCRE
    # "" is "^$": it matches no name a check ever sees.
    assert not perms.allowed("e", "/", "read", "amq.default")
    assert not perms.allowed("u", "b", "read", "x")  # no permissions on the vhost


def test_a_refusal_closes_only_its_channel_and_loses_nothing() -> None:
    h = _broker()
    g = _setup(h)
    c = _open(h, 1, "app")
    c.channel(2)
    c.rpc(2, C.Basic.Qos(prefetch_count=10))
    c.rpc(2, C.Basic.Consume(queue="app.q", consumer_tag="t"))
    g.publish(1, "", "app.q", b"one")
    assert [b for _, b in c.deliveries()] == [b"one"]
    c.send(1, C.Queue.Delete(queue="other.q"))
    assert _refused(c)[0] == 403
    assert 2 in h.broker.connections[1].channels and not c.is_closed
    # Only the refused channel went: its close changed nothing else.
    assert h.broker.topology.vhosts["/"].queues["app.q"].unacked == 1
    g.publish(1, "", "app.q", b"two")
    assert [b for _, b in c.deliveries()] == [b"two"]
    c.send(2, C.Basic.Ack(delivery_tag=2, multiple=True))
    assert h.broker.topology.vhosts["/"].queues["app.q"].unacked == 0


def test_snapshot_restore_keeps_behaviour_without_the_caches() -> None:
    h = _broker()
    _setup(h)
    c = _open(h, 1, "app")
    c.publish(1, "app.x", "", b"x")
    assert h.broker.permissions.published
    restored = S.restore(S.decode(S.encode(S.snapshot(h.broker))), CONFIG)
    assert S.digest(restored) == S.digest(h.broker)
    assert not restored.permissions.published


# ------------------------------------------------------------------ configuration


def _cfg(**user: Any) -> dict[str, Any]:
    return {"vhosts": ["/", "b"], "users": [{"name": "app", "password": "p", **user}]}


def test_config_permissions_and_shorthand() -> None:
    cfg = from_dict(
        _cfg(permissions=[{"vhost": "/", "configure": r"^app\.", "write": ".*", "read": ".*"}])
    )
    (u,) = cfg.broker.users
    # With permissions, no vhost is granted unless named.
    assert u.vhosts == () and u.permissions == (Permission("/", r"^app\.", ".*", ".*"),)
    assert not u.may_open("b")
    (old,) = from_dict(_cfg()).broker.users
    assert old.vhosts == ("/",) and old.grants() == (Permission("/"),)
    both = from_dict(
        _cfg(vhosts=["b"], permissions=[{"vhost": "/", **dict.fromkeys(P.FIELDS, "")}])
    )
    assert both.broker.users[0].may_open("b") and both.broker.users[0].may_open("/")


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (
            {"vhost": "/", "configure": "(", "write": "", "read": ""},
            r"user 'app', vhost '/': configure pattern '\(' is not a valid regular expression",
        ),
        (
            {"vhost": "/", "configure": "", "write": "", "read": "a" * 1025},
            r"user 'app', vhost '/': read pattern .* longer than 1024 bytes",
        ),
        (
            {"vhost": "/", "configure": "", "write": 1, "read": ""},
            r"user 'app', vhost '/': write must be a string",
        ),
        (
            {"vhost": "c", "configure": "", "write": "", "read": ""},
            r"user 'app' has permissions on vhost 'c' which is not declared",
        ),
        ({"vhost": "/", "configure": ""}, r"of user 'app' is missing write, read"),
        (
            {"vhost": "/", "configure": "", "write": "", "read": "", "admin": ""},
            r"has unknown key\(s\) admin",
        ),
    ],
)
def test_config_errors_name_the_user_vhost_and_field(entry: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        from_dict(_cfg(permissions=[entry]))


def test_config_refuses_ambiguous_entries() -> None:
    full = dict.fromkeys(P.FIELDS, ".*")
    with pytest.raises(ConfigError, match="two permissions entries for vhost '/'"):
        from_dict(_cfg(permissions=[{"vhost": "/", **full}, {"vhost": "/", **full}]))
    with pytest.raises(ConfigError, match="both in vhosts"):
        from_dict(_cfg(vhosts=["/"], permissions=[{"vhost": "/", **full}]))
    with pytest.raises(ConfigError, match=r"user 'x', vhost '/': read pattern"):
        Broker(BrokerConfig(users=(User("x", "x", (), permissions=(Permission("/", read="["),)),)))


def test_members_with_other_permissions_do_not_share_a_cluster() -> None:
    """Permissions change what the model does with the same bytes: they are part of the
    configuration digest that hellos carry."""

    def digest(read: str) -> bytes:
        perms = [{"vhost": "/", "configure": ".*", "write": ".*", "read": read}]
        return config_digest(from_dict({**_cfg(permissions=perms), "cluster": {"group": "g"}}))

    assert digest(".*") == digest(".*")
    assert digest(".*") != digest("^app")


# ------------------------------------------------------------------ determinism


def scenario() -> list[str]:
    """Allowed and refused operations of several users; the model digest and a hash of every
    effect (run in child processes under different hash seeds)."""
    h = _broker()
    _setup(h)
    a = _open(h, 1, "app")
    r = _open(h, 2, "ro")
    for i in range(30):
        a.publish(1, "app.x" if i % 3 else "", "app.q", b"%d" % i)
        a.send(1, C.Queue.Declare(queue=f"app.q{i % 4}"))
        r.send(1, C.Basic.Get(queue="ro.q"))
        if i % 5 == 0:
            a.send(1, C.Queue.Declare(queue=f"other.{i}"))
            a.send(1, C.Channel.CloseOk())
            a.channel(1)
            r.publish(1, "", "ro.q", b"no")
            r.send(1, C.Channel.CloseOk())
            r.channel(1)
    out = hashlib.sha256(repr(h.effects).encode()).hexdigest()
    return [S.digest(h.broker), out]


_CHILD = """
import sys, json
sys.path[:0] = {paths!r}
from test_permissions import scenario
print(json.dumps(scenario()))
"""


def test_the_same_permission_scenario_gives_the_same_digest_under_other_hash_seeds() -> None:
    here = Path(__file__).resolve().parent
    paths = [str(here), str(here.parent)]
    results = []
    for seed in ("0", "4242"):
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD.format(paths=paths)],
            env=dict(os.environ, PYTHONHASHSEED=seed),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1] == scenario()

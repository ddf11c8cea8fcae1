"""The EXTERNAL mechanism (a client certificate names the user) in the model, and the
connection's TLS facts through everything that carries an event or a state: the CPG codec,
the journal and snapshots (a newcomer must give the same login answer as the member that
accepted the socket)."""

from __future__ import annotations

from typing import Any

import pytest
from pamqp import commands as C

from cpgbroker.cluster import codec
from cpgbroker.model.broker import Broker
from cpgbroker.model.clients.connection import NO_CERT_USER
from cpgbroker.model.config import BrokerConfig, User
from cpgbroker.model.events import ClientConnected, LoginRefused
from cpgbroker.model.state import snapshot as S
from cpgbroker.store import records
from modelclient import Client, Harness

DN = "CN=alice,OU=clients,O=cpgbroker tests"
REFUSED = (
    "ACCESS_REFUSED - Login was refused using authentication mechanism EXTERNAL. "
    "For details see the broker logfile."
)


def _harness() -> Harness:
    users = (
        User(DN, "not-for-external", vhosts=("/",)),
        User("alice", "secret", vhosts=("/",)),
        User("local", "x", vhosts=("/",), loopback_only=True),
        User("nowhere", "x", vhosts=()),
    )
    h = Harness(Broker(BrokerConfig(users=users, vhosts=("/", "other"))))
    h.tick(1_000)
    return h


def _connect(
    h: Harness, conn: int, *, tls: bool, cert_user: str = "", loopback: bool = True
) -> tuple[Client, Any]:
    """Connect, send the header; the connection.start the broker answers with."""
    h.apply(ClientConnected(conn, 0, "192.0.2.1:9", loopback, tls, cert_user))
    c = Client(h, conn)
    c.send_raw(b"AMQP\x00\x00\x09\x01")
    return c, c.methods()[-1]


def _external(c: Client, vhost: str = "/") -> Any:
    reply = c.rpc(
        0,
        C.Connection.StartOk(
            client_properties={"capabilities": {"authentication_failure_close": True}},
            mechanism="EXTERNAL",
            response="",
        ),
    )
    if not isinstance(reply, C.Connection.Tune):
        return reply
    c.send(0, C.Connection.TuneOk(channel_max=reply.channel_max, frame_max=131072))
    return c.rpc(0, C.Connection.Open(virtual_host=vhost))


def test_external_is_offered_over_tls_only() -> None:
    h = _harness()
    _c, start = _connect(h, 1, tls=False)
    assert start.mechanisms == "PLAIN AMQPLAIN"
    _c, start = _connect(h, 2, tls=True)
    assert start.mechanisms == "PLAIN AMQPLAIN EXTERNAL"


def test_the_certificates_user_logs_in_without_a_password() -> None:
    h = _harness()
    c, _ = _connect(h, 1, tls=True, cert_user=DN)
    assert isinstance(_external(c), C.Connection.OpenOk)
    assert h.broker.connections[1].user == DN
    assert not [e for e in h.effects if isinstance(e, LoginRefused)]


@pytest.mark.parametrize(
    ("cert_user", "loopback", "why"),
    [
        ("CN=mallory,O=elsewhere", True, "no such user"),
        ("", True, NO_CERT_USER),
        ("local", False, "user may only connect via localhost"),
    ],
)
def test_a_refused_external_login_is_403_and_says_who_and_why(
    cert_user: str, loopback: bool, why: str
) -> None:
    h = _harness()
    c, _ = _connect(h, 1, tls=True, cert_user=cert_user, loopback=loopback)
    reply = _external(c)
    assert isinstance(reply, C.Connection.Close)
    assert (reply.reply_code, reply.reply_text) == (403, REFUSED)
    assert [e for e in h.effects if isinstance(e, LoginRefused)] == [
        LoginRefused(1, cert_user, "EXTERNAL", why)
    ]


def test_vhost_rules_still_apply_to_an_external_login() -> None:
    h = _harness()
    c, _ = _connect(h, 1, tls=True, cert_user="nowhere")
    reply = _external(c)
    assert isinstance(reply, C.Connection.Close) and reply.reply_code == 530


def test_external_without_tls_is_an_unsupported_mechanism() -> None:
    # Not offered on a plain connection; a name in the event (there is none) would not matter.
    h = _harness()
    c, _ = _connect(h, 1, tls=False, cert_user=DN)
    reply = _external(c)
    assert isinstance(reply, C.Connection.Close) and reply.reply_code == 403
    assert "unsupported authentication mechanism 'EXTERNAL'" in reply.reply_text
    assert [e.why for e in h.effects if isinstance(e, LoginRefused)] == ["unsupported mechanism"]


def test_plain_still_checks_the_password_over_tls() -> None:
    h = _harness()
    c, _ = _connect(h, 1, tls=True, cert_user=DN)
    c.send(
        0,
        C.Connection.StartOk(client_properties={}, mechanism="PLAIN", response=f"\0{DN}\0wrong"),
    )
    reply = c.methods()[-1]
    assert isinstance(reply, C.Connection.Close) and reply.reply_code == 403
    assert [e.why for e in h.effects if isinstance(e, LoginRefused)] == ["wrong password"]


EVENTS = [
    ClientConnected(codec.conn_id(3, 1), 3, "192.0.2.1:9", False, True, DN),
    ClientConnected(codec.conn_id(3, 2), 3, "[::1]:9", True, True, ""),
    ClientConnected(codec.conn_id(3, 3), 3, "127.0.0.1:9", True, False, ""),
    ClientConnected(codec.conn_id(3, 4), 3, "192.0.2.1:9", False, False, ""),
    ClientConnected(codec.conn_id(3, 5), 3, "192.0.2.1:9", True, True, "CN=café,O=ü"),
]


def test_the_cpg_codec_carries_tls_and_the_certificates_user() -> None:
    batch = codec.HEADER + b"".join(codec.encode(ev) for ev in EVENTS)
    assert codec.decode_batch(batch, 3) == EVENTS


def test_the_journal_carries_tls_and_the_certificates_user() -> None:
    for ev in EVENTS:
        for failed in (False, True):
            assert records.decode(records.encode(ev, failed)) == (ev, failed)


def test_a_restored_replica_keeps_tls_and_the_certificates_user() -> None:
    h = _harness()
    c, _ = _connect(h, 1, tls=True, cert_user=DN)
    _connect(h, 2, tls=True)  # handshake pending: the login is decided after the restore
    _connect(h, 3, tls=False)
    assert isinstance(_external(c), C.Connection.OpenOk)
    before = S.digest(h.broker)
    copy = S.restore(S.snapshot(h.broker))
    assert S.digest(copy) == before
    for cid, tls, user in ((1, True, DN), (2, True, ""), (3, False, "")):
        conn = copy.connections[cid]
        assert (conn.tls, conn.cert_user) == (tls, user)
    # A plain connection snapshots as before TLS existed (old snapshots, old digests).
    snapped = {d["id"]: d for d in _connection_dicts(S.snapshot(h.broker))}
    assert "tls" not in snapped[3] and "cert_user" not in snapped[3]
    assert (snapped[1]["tls"], snapped[1]["cert_user"]) == (True, DN)


def _connection_dicts(obj: Any) -> list[dict[str, Any]]:
    if isinstance(obj, dict):
        found = [obj] if "peer" in obj and "loopback" in obj else []
        return found + [d for v in obj.values() for d in _connection_dicts(v)]
    if isinstance(obj, (list, tuple)):
        return [d for v in obj for d in _connection_dicts(v)]
    return []


def test_a_user_without_a_password_logs_in_by_certificate_only() -> None:
    from cpgbroker.runtime.config.settings import from_dict

    # RabbitMQ's `clear_password`: password_hash "" (what export_definitions writes then).
    cfg = from_dict({"users": [{"name": DN, "password_hash": "", "vhosts": ["/"]}]}).broker
    (user,) = cfg.users
    assert not user.password and not user.password_hash
    h = Harness(Broker(cfg))
    h.tick(1_000)
    c, _ = _connect(h, 1, tls=True, cert_user=DN)
    assert isinstance(_external(c), C.Connection.OpenOk)
    # Neither an empty nor any other password opens it over PLAIN.
    for password in ("", "guess"):
        c, _ = _connect(h, 2 + len(password), tls=True)
        reply = c.rpc(
            0,
            C.Connection.StartOk(
                client_properties={"capabilities": {"authentication_failure_close": True}},
                mechanism="PLAIN",
                response=f"\x00{DN}\x00{password}",
            ),
        )
        assert isinstance(reply, C.Connection.Close) and reply.reply_code == 403

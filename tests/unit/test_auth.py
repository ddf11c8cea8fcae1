"""Salted password hashes in RabbitMQ's format, and refused logins told to the owner's log."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys

import pytest
from pamqp import commands as C

from cpgbroker.errors import ConfigError
from cpgbroker.model.access import auth
from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig, User
from cpgbroker.model.events import LoginRefused
from cpgbroker.runtime.config.settings import from_dict
from modelclient import Harness

# A hash as `rabbitmqctl export_definitions` writes it: base64(salt ++ sha256(salt ++ pw)).
SALT = b"\x90\x8d\xa8\x17"
HASH = base64.b64encode(SALT + hashlib.sha256(SALT + b"s3cret").digest()).decode()


def test_a_hash_in_rabbitmqs_format_checks_its_password() -> None:
    u = User("alice", "", password_hash=HASH)
    assert auth.password_ok(u, "s3cret")
    assert not auth.password_ok(u, "s3cret ") and not auth.password_ok(u, "")
    # A blank password never logs in (RabbitMQ refuses them), even one configured blank.
    assert not auth.password_ok(User("blank", ""), "")
    assert auth.hash_password("s3cret", SALT) == HASH
    u512 = User(
        "bob",
        "",
        password_hash=auth.hash_password("pw", SALT, "rabbit_password_hashing_sha512"),
        hashing_algorithm="rabbit_password_hashing_sha512",
    )
    assert auth.password_ok(u512, "pw") and not auth.password_ok(u512, "pW")


def _broker(users: tuple[User, ...]) -> Harness:
    h = Harness(Broker(BrokerConfig(users=users)))
    h.tick(1_000)
    return h


@pytest.mark.parametrize(
    ("user", "password", "loopback", "why"),
    [
        ("alice", "s3cret", True, ""),
        ("alice", "hunter2", True, "wrong password"),
        ("mallory", "s3cret", True, "no such user"),
        ("alice", "s3cret", False, "user may only connect via localhost"),
    ],
)
def test_a_refused_login_says_who_and_why_never_the_secret(
    user: str, password: str, loopback: bool, why: str
) -> None:
    h = _broker((User("alice", "", password_hash=HASH, loopback_only=True),))
    c = h.connect(1, loopback=loopback)
    reply = c.handshake(user=user, password=password)
    refused = [e for e in h.effects if isinstance(e, LoginRefused)]
    if not why:
        assert isinstance(reply, C.Connection.OpenOk) and refused == []
        return
    assert refused == [LoginRefused(1, user, "PLAIN", why)]
    assert password not in repr(refused)
    assert isinstance(reply, C.Connection.Close) and reply.reply_code == 403


def test_the_configuration_takes_a_hash_or_a_password_not_both() -> None:
    cfg = from_dict({"users": [{"name": "alice", "password_hash": HASH}]})
    assert cfg.broker.users[0].password_hash == HASH
    with pytest.raises(ConfigError, match="either password or password_hash"):
        from_dict({"users": [{"name": "alice", "password_hash": HASH, "password": "x"}]})
    with pytest.raises(ConfigError, match="not a rabbit_password_hashing_sha256 hash"):
        from_dict({"users": [{"name": "alice", "password_hash": "bm90IGEgaGFzaA=="}]})


def test_hash_password_prints_a_hash_that_checks() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cpgbroker", "hash-password"],
        input="horse battery\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert auth.password_ok(User("u", "", password_hash=out), "horse battery")
    assert "horse" not in out

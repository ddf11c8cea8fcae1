"""Hashed credentials with a real client: a user configured with a RabbitMQ password hash logs
in with pika; a refused login is logged with user, peer and mechanism, never the password."""

from __future__ import annotations

import base64
import hashlib
import time

import pika
import pika.exceptions
import pytest
from clientutil import BrokerFactory

SALT = b"\x01\x02\x03\x04"
HASH = base64.b64encode(SALT + hashlib.sha256(SALT + b"s3cret").digest()).decode()
CONFIG = f"""
[[users]]
name = "alice"
password_hash = "{HASH}"
vhosts = ["/"]
"""


def _params(port: int, password: str) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(
        "127.0.0.1",
        port,
        credentials=pika.PlainCredentials("alice", password),
        socket_timeout=5,
        connection_attempts=1,
    )


def test_a_hashed_password_logs_in_and_a_wrong_one_is_logged_without_the_secret(
    broker_factory: BrokerFactory,
) -> None:
    b = broker_factory(CONFIG)
    conn = pika.BlockingConnection(_params(b.port, "s3cret"))
    conn.channel().queue_declare("", exclusive=True)
    conn.close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(_params(b.port, "hunter2"))
    deadline = time.monotonic() + 5
    while "login refused" not in b.log():
        assert time.monotonic() < deadline, b.log()
        time.sleep(0.05)
    line = next(ln for ln in b.log().splitlines() if "login refused" in ln)
    assert "user='alice'" in line and "mechanism=PLAIN" in line and "peer=127.0.0.1" in line
    assert "wrong password" in line
    assert "hunter2" not in b.log() and "s3cret" not in b.log()

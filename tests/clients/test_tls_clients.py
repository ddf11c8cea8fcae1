"""amqps with real clients (pika, aio-pika) against a broker process: the server certificate
is checked by the client, client certificates by the broker (verify_peer,
fail_if_no_peer_cert), and the EXTERNAL mechanism logs a client in as the user its
certificate names. Certificates are made per test session by trustme (tests/tlscerts.py)."""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import time
from typing import Any

import aio_pika
import pika
import pika.credentials
import pika.exceptions
import pytest
from clientutil import BrokerFactory, BrokerProcess, drain_get, pika_params

import tlscerts

_AMQPS = re.compile(r"msg=listening amqps host=(\S+) port=(\d+)")
DN = tlscerts.client_dn("alice")
# How pika fails a connection whose TLS handshake fails: its own error, or the ssl module's
# (certificate verification on its side), or a reset (the server refused ours).
REFUSED = (pika.exceptions.AMQPConnectionError, ssl.SSLError, pika.exceptions.StreamLostError)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tlscerts.Certs:
    return tlscerts.make(tmp_path_factory.mktemp("certs"))


def start(factory: BrokerFactory, tls: str, users: str = "") -> tuple[BrokerProcess, int]:
    """A broker with an amqps listener on a free port; the broker and that port."""
    b = factory('[server]\nlisten_tls = ["127.0.0.1:0"]\n' + tls + users)
    return b, amqps_port(b)


def amqps_port(b: BrokerProcess) -> int:
    deadline = time.monotonic() + 5
    while not (m := _AMQPS.search(b.log())):
        assert b.alive() and time.monotonic() < deadline, b.log()
        time.sleep(0.05)
    return int(m.group(2))


def params(port: int, ctx: ssl.SSLContext, **kw: Any) -> pika.ConnectionParameters:
    return pika_params(
        ("127.0.0.1", port), ssl_options=pika.SSLOptions(ctx, server_hostname="127.0.0.1"), **kw
    )


def wait_log(b: BrokerProcess, needle: str) -> str:
    """The first line of ``b``'s log that holds ``needle`` (waits for it)."""
    deadline = time.monotonic() + 5
    while True:
        lines = [ln for ln in b.log().splitlines() if needle in ln]
        if lines:
            return lines[0]
        assert time.monotonic() < deadline, f"no {needle!r} in:\n{b.log()}"
        time.sleep(0.05)


def test_pika_publishes_and_consumes_over_amqps(
    broker_factory: BrokerFactory, certs: tlscerts.Certs
) -> None:
    _b, port = start(broker_factory, tlscerts.tls_table(certs))
    conn = pika.BlockingConnection(params(port, certs.client_context()))
    ch = conn.channel()
    ch.confirm_delivery()
    q = ch.queue_declare("", exclusive=True).method.queue
    bodies = [bytes([i]) * 1024 for i in range(50)]
    for body in bodies:
        ch.basic_publish("", q, body)  # confirmed: returns once the broker has it
    got = []
    for method, _props, body in ch.consume(q, inactivity_timeout=5):
        assert method is not None, "deliveries stopped"
        got.append(body)
        ch.basic_ack(method.delivery_tag)
        if len(got) == len(bodies):
            break
    ch.cancel()
    assert got == bodies
    conn.close()


def test_aio_pika_over_amqps(broker_factory: BrokerFactory, certs: tlscerts.Certs) -> None:
    _b, port = start(broker_factory, tlscerts.tls_table(certs))

    async def main() -> list[bytes]:
        conn = await aio_pika.connect(
            f"amqps://guest:guest@127.0.0.1:{port}/",
            ssl_context=certs.client_context(),
            timeout=5,
        )
        async with conn:
            ch = await conn.channel()
            q = await ch.declare_queue("", exclusive=True)
            for i in range(20):
                await ch.default_exchange.publish(aio_pika.Message(b"m%d" % i), q.name)
            got = []
            async with q.iterator() as it:
                async for msg in it:
                    async with msg.process():
                        got.append(msg.body)
                    if len(got) == 20:
                        break
            return got

    got = asyncio.run(asyncio.wait_for(main(), 20))
    assert got == [b"m%d" % i for i in range(20)]


@pytest.mark.parametrize("case", ["wrong CA", "expired server certificate"])
def test_the_client_refuses_a_server_it_cannot_trust(
    broker_factory: BrokerFactory, certs: tlscerts.Certs, case: str
) -> None:
    if case == "wrong CA":
        _b, port = start(broker_factory, tlscerts.tls_table(certs))
        ctx = certs.client_context(ca=certs.other_ca)
    else:
        _b, port = start(broker_factory, tlscerts.tls_table(certs, certs.expired_server))
        ctx = certs.client_context()
    with pytest.raises(REFUSED) as err:
        pika.BlockingConnection(params(port, ctx))
    text = repr(err.value)
    assert "CERTIFICATE_VERIFY_FAILED" in text, text
    if case == "expired server certificate":
        assert "expired" in text, text


def test_verify_peer_refuses_clients_without_a_good_certificate(
    broker_factory: BrokerFactory, certs: tlscerts.Certs
) -> None:
    tls = tlscerts.tls_table(certs, verify="verify_peer", fail_if_no_peer_cert=True)
    b, port = start(broker_factory, tls)
    for client in (None, certs.client("alice", expired=True), certs.client("x", untrusted=True)):
        with pytest.raises(REFUSED):
            c = pika.BlockingConnection(params(port, certs.client_context(client=client)))
            # TLS 1.3: the client may finish its handshake before the server refuses the
            # certificate; then the first exchange fails.
            c.channel()
    # The broker logged each failed handshake with the peer and goes on serving.
    line = wait_log(b, "tls handshake failed")
    assert "peer=127.0.0.1:" in line
    log = b.log()
    assert "certificate" in log.lower() and "expired" in log
    good = pika.BlockingConnection(params(port, certs.client_context(client=certs.client("a"))))
    good.channel().queue_declare("", exclusive=True)
    good.close()


def test_external_logs_in_the_user_the_certificate_names(
    broker_factory: BrokerFactory, certs: tlscerts.Certs
) -> None:
    tls = tlscerts.tls_table(certs, verify="verify_peer", fail_if_no_peer_cert=True)
    users = f'\n[[users]]\nname = "{DN}"\npassword = "unused"\nvhosts = ["/"]\n'
    b, port = start(broker_factory, tls, users)
    ctx = certs.client_context(client=certs.client("alice"))
    conn = pika.BlockingConnection(
        params(port, ctx, credentials=pika.credentials.ExternalCredentials())
    )
    ch = conn.channel()
    ch.confirm_delivery()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, b"hello")
    assert drain_get(ch, q) == [b"hello"]
    conn.close()
    # A certificate whose name is no user: 403, and the log says who, how and why.
    ctx = certs.client_context(client=certs.client("mallory"))
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as err:
        pika.BlockingConnection(
            params(port, ctx, credentials=pika.credentials.ExternalCredentials())
        )
    assert "403" in repr(err.value) and "mechanism EXTERNAL" in repr(err.value)
    line = wait_log(b, "login refused")
    assert "mechanism=EXTERNAL" in line and "no such user" in line
    assert f"user='{tlscerts.client_dn('mallory')}'" in line


def test_common_name_login_and_plain_still_works_over_tls(
    broker_factory: BrokerFactory, certs: tlscerts.Certs
) -> None:
    tls = tlscerts.tls_table(certs, verify="verify_peer", cert_login_from="common_name")
    users = '\n[[users]]\nname = "alice"\npassword = "pw"\nvhosts = ["/"]\n'
    b, port = start(broker_factory, tls, users)
    ctx = certs.client_context(client=certs.client("alice"))
    ext = pika.credentials.ExternalCredentials()
    pika.BlockingConnection(params(port, ctx, credentials=ext)).close()
    # No certificate (allowed: fail_if_no_peer_cert is false): PLAIN works, EXTERNAL is refused.
    plain = pika.credentials.PlainCredentials("alice", "pw")
    pika.BlockingConnection(params(port, certs.client_context(), credentials=plain)).close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(params(port, certs.client_context(), credentials=ext))
    assert "no verified TLS (x.509) certificate" in wait_log(b, "login refused")


def test_a_silent_client_is_cut_at_the_handshake_timeout(
    broker_factory: BrokerFactory, certs: tlscerts.Certs
) -> None:
    b, port = start(broker_factory, tlscerts.tls_table(certs, handshake_timeout=0.3))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        t0 = time.monotonic()
        assert s.recv(1) == b""  # the broker closed it
        assert time.monotonic() - t0 < 3
    assert "handshake timed out" in wait_log(b, "tls handshake failed")
    # ... and it never reached the model (no connection was accepted).
    assert "connection accepted" not in b.log()

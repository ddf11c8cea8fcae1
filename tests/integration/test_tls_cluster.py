"""amqps on a real 3-member cluster: every member refuses a client whose certificate it cannot
verify; a pika client with a failover list logs in with its certificate (EXTERNAL), publishes
with confirms, loses its member to kill -9 and gets every confirmed message from another
member over TLS. The certificate's user travels in the stream, so the replicas agree on it."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

import pika
import pika.credentials
import pika.exceptions
import pytest

import tlscerts
from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

N = 200
REFUSED = (pika.exceptions.AMQPConnectionError, ssl.SSLError, pika.exceptions.StreamLostError)


def _params(
    bs: BrokerSet, nodes: list[int], ctx: ssl.SSLContext
) -> list[pika.ConnectionParameters]:
    return [
        pika.ConnectionParameters(
            "127.0.0.1",
            bs.tls_ports[n],
            ssl_options=pika.SSLOptions(ctx, server_hostname="127.0.0.1"),
            credentials=pika.credentials.ExternalCredentials(),
            socket_timeout=5,
            stack_timeout=10,
            blocked_connection_timeout=10,
            connection_attempts=1,
        )
        for n in nodes
    ]


def test_amqps_failover_with_client_certificates(
    broker_set: Callable[..., BrokerSet], tmp_path: Path
) -> None:
    certs = tlscerts.make(tmp_path / "certs")
    dn = tlscerts.client_dn("app")
    config = (
        tlscerts.tls_table(certs, verify="verify_peer", fail_if_no_peer_cert=True)
        + f'\n[[users]]\nname = "{dn}"\npassword = "unused"\nvhosts = ["/"]\n'
    )
    bs = broker_set(tls=True, extra_config=config)
    good = certs.client_context(client=certs.client("app"))
    bad = certs.client_context(client=certs.client("app", untrusted=True))

    # Every member turns away a certificate from a CA it does not trust, and logs why.
    for n in (1, 2, 3):
        with pytest.raises(REFUSED):
            pika.BlockingConnection(_params(bs, [n], bad)).channel()
    for n in (1, 2, 3):
        bs.wait_log(n, "tls handshake failed")

    # The failover list starts at member 1: that is where the client lands.
    conn = pika.BlockingConnection(_params(bs, [1, 2, 3], good))
    assert conn._impl.params.port == bs.tls_ports[1]
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("tls.q")
    sent = [b"m%d" % i for i in range(N)]
    for body in sent:
        ch.basic_publish("", "tls.q", body)  # returns once confirmed: stable on every member
    # The replicas agree on everything, the TLS connection and its certificate user included.
    bs.converged([1, 2, 3])

    bs.kill(1)
    with pytest.raises(pika.exceptions.AMQPError):
        ch.basic_publish("", "tls.q", b"after the kill")
        conn.process_data_events(1)

    conn = pika.BlockingConnection(_params(bs, [1, 2, 3], good))
    assert conn._impl.params.port in (bs.tls_ports[2], bs.tls_ports[3])
    ch = conn.channel()
    got = []
    while True:
        m, _p, body = ch.basic_get("tls.q", auto_ack=True)
        if m is None:
            break
        got.append(body)
    conn.close()
    # Every confirmed message, in order (one that was sent after the kill may or may not be
    # there: it was never confirmed).
    assert got[:N] == sent and got[N:] in ([], [b"after the kill"])

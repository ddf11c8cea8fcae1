"""Member-local connections on real corosync with real clients (pika): what clients do on a
member's ``local_listen`` port never crosses CPG, its queues live and die with that member, and
the replicated queues beside them are untouched (runtime/amqp/localbroker.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pika
import pika.exceptions
import pytest
from brokerclients import (
    ADMIN_GUEST,
    GUEST_AUTH,
    OPEN,
    ConfirmingPublisher,
    connect,
    drain_queue,
    load_until,
    management,
    queues,
)

from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

ROUND_TRIPS = 200
BODY = b"x" * 1024


def local(
    bs: BrokerSet, node: int, user: str = "guest", pw: str = "guest"
) -> pika.BlockingConnection:
    conn = pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1",
            bs.local_ports[node],
            credentials=pika.PlainCredentials(user, pw),
            connection_attempts=1,
            heartbeat=0,
        )
    )
    OPEN.append(conn)  # closed after the test, also when its member died
    return conn


def rpc_round_trips(server: pika.BlockingConnection, client: pika.BlockingConnection) -> None:
    """A server answering requests on a queue and a client calling it over direct reply-to, as
    an RPC library does; every answer must come back to the call it answers."""
    srv = server.channel()
    srv.queue_declare("rpc.requests", auto_delete=True)
    cli = client.channel()
    replies: list[tuple[str, bytes]] = []
    cli.basic_consume(
        "amq.rabbitmq.reply-to",
        lambda _ch, _m, props, body: replies.append((props.correlation_id, body)),
        auto_ack=True,
    )
    for i in range(ROUND_TRIPS):
        call = BODY + b"%d" % i
        cli.basic_publish(
            "",
            "rpc.requests",
            call,
            pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id=str(i)),
        )
        while True:
            m, props, body = srv.basic_get("rpc.requests", auto_ack=True)
            if m is not None:
                break
            server.process_data_events(0.001)
        srv.basic_publish(
            "",
            props.reply_to,
            b"re:" + body,
            pika.BasicProperties(correlation_id=props.correlation_id),
        )
        while len(replies) <= i:
            client.process_data_events(0.001)
        assert replies[i] == (str(i), b"re:" + call)


def test_member_local_traffic_stays_off_the_cluster_and_dies_with_its_member(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(local=True, extra_config=ADMIN_GUEST)
    # Replicated work beside it: confirmed on every member.
    pub = ConfirmingPublisher(bs, [2], "work", "work")
    pub.start()
    load_until(pub, 100)
    confirmed = pub.stop()
    sent_before = {n: bs.status(n)["cpg"]["sent_bytes"] for n in (1, 2, 3)}

    server, client = local(bs, 1), local(bs, 1)
    rpc_round_trips(server, client)

    # None of the ~400 KiB of calls and answers was multicast, by any member (what was is
    # the members' clock and progress reports).
    grew = {n: bs.status(n)["cpg"]["sent_bytes"] - sent_before[n] for n in (1, 2, 3)}
    assert all(g < ROUND_TRIPS * len(BODY) // 10 for g in grew.values()), grew
    # The local queue is member 1's alone: the replicas never heard of it, nor did the other
    # members' local brokers.
    s1 = bs.status(1)
    assert s1["local"]["queues"] >= 1 and s1["local"]["connections"] == 2, s1["local"]
    # Operators see them: `cpgbroker status` and the Prometheus endpoint.
    out = subprocess.run(
        [sys.executable, "-m", "cpgbroker", "status", *bs.cli_args(1)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"member-local (not replicated) on 127.0.0.1:{bs.local_ports[1]}: 2 connections" in out
    _, metrics = management(bs, 1, "GET", "/metrics", f"Bearer {bs.admin_target(1).secret}")
    assert "cpgbroker_local_connections 2.0" in metrics, metrics
    for n in (1, 2, 3):
        assert "/:rpc.requests" not in queues(bs, n)
    other = local(bs, 2)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        other.channel().queue_declare("rpc.requests", passive=True)
    assert e.value.reply_code == 404
    # Asked for by name: x-replicate false is taken on a local listener, and refused on a
    # replicated port with a pointer to where it is served.
    other.channel().queue_declare("own.q", arguments={"x-replicate": False}, auto_delete=True)
    other.close()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        connect(bs, 2).channel().queue_declare("own.q", arguments={"x-replicate": False})
    assert e.value.reply_code == 406 and "member-local listener" in e.value.reply_text
    for n in (1, 2, 3):
        assert "/:own.q" not in queues(bs, n)

    # Users are the cluster's: one added through the management API of member 3 logs in at
    # member 1's local port; a wrong password is refused there.
    status, _ = management(
        bs, 3, "PUT", "/api/users/app", GUEST_AUTH, {"password": "app-pw", "tags": ""}
    )
    assert status == 201
    status, _ = management(
        bs,
        3,
        "PUT",
        "/api/permissions/%2F/app",
        GUEST_AUTH,
        {"configure": ".*", "write": ".*", "read": ".*"},
    )
    assert status in (201, 204)
    app = local(bs, 1, "app", "app-pw")
    app.channel().queue_declare("app.local", auto_delete=True)
    app.close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        local(bs, 1, "app", "wrong")

    # Member 1 dies: its local clients lose their connections (and its queue with them); the
    # replicated queue is whole on the survivors and their local brokers serve on.
    bs.kill(1)
    with pytest.raises(pika.exceptions.AMQPError):
        for _ in range(50):
            client.process_data_events(0.1)
    assert sorted(drain_queue(bs, 2, "work")) == sorted(confirmed)
    again = local(bs, 3)
    ch = again.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.queue_declare("rpc.requests", passive=True)
    rpc_round_trips(again, local(bs, 3))

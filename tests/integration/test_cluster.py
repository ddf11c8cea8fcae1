"""The replicated broker on a real 3-node corosync cluster in network namespaces, driven by
real AMQP clients (pika, kombu, raw sockets) on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import pika
import pika.exceptions
import pytest
from brokerclients import OPEN as _OPEN
from brokerclients import connect, drain, queues

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster
from cpgbroker.runtime.admin import adminclient

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_publish_on_one_member_consume_on_the_others(brokers: BrokerSet) -> None:
    c1 = connect(brokers, 1)
    ch1 = c1.channel()
    ch1.confirm_delivery()
    ch1.exchange_declare("orders", "topic")
    ch1.queue_declare("eu")
    ch1.queue_bind("eu", "orders", "order.eu.*")
    for i in range(50):
        ch1.basic_publish("orders", f"order.eu.{i % 3}", b"%d" % i)
    ch1.basic_publish("orders", "order.us.1", b"unrouted")
    digest = brokers.converged([1, 2, 3])
    for n in (1, 2, 3):
        assert queues(brokers, n)["/:eu"] == {"ready": 50, "unacked": 0, "consumers": 0}
    got: dict[int, list[bytes]] = {2: [], 3: []}
    conns = {n: connect(brokers, n) for n in (2, 3)}
    for n, c in conns.items():
        ch = c.channel()
        ch.basic_qos(prefetch_count=5)
        ch.basic_consume(
            "eu", lambda ch_, m, p, b, n=n: (got[n].append(b), ch_.basic_ack(m.delivery_tag))
        )
    deadline = time.monotonic() + 15
    while len(got[2]) + len(got[3]) < 50:
        assert time.monotonic() < deadline
        for c in conns.values():
            c.process_data_events(0.02)
    # Competing consumers on different members: disjoint, complete, no duplicates.
    assert not set(got[2]) & set(got[3])
    assert sorted(got[2] + got[3], key=int) == [b"%d" % i for i in range(50)]
    assert got[2] and got[3]
    assert brokers.converged([1, 2, 3]) != digest
    for n in (1, 2, 3):
        assert queues(brokers, n)["/:eu"]["ready"] == 0


def test_rpc_with_direct_reply_to_between_clients_of_different_members(
    brokers: BrokerSet,
) -> None:
    """RabbitMQ's direct reply-to with pika: the requester on member 1 consumes
    ``amq.rabbitmq.reply-to`` and publishes requests with it as reply-to; the server on member
    3 answers to the address it sees. Every answer reaches its request; nothing is left behind
    once the requester is gone."""
    server = connect(brokers, 3)
    sch = server.channel()
    sch.queue_declare("rpc.dr")

    def serve(ch: Any, m: Any, p: pika.BasicProperties, body: bytes) -> None:
        assert p.reply_to.startswith("amq.rabbitmq.reply-to.")
        answer = pika.BasicProperties(correlation_id=p.correlation_id)
        ch.basic_publish("", p.reply_to, body.upper(), answer)
        ch.basic_ack(m.delivery_tag)

    sch.basic_consume("rpc.dr", serve)
    requester = connect(brokers, 1)
    rch = requester.channel()
    answers: dict[str, bytes] = {}
    rch.basic_consume(
        "amq.rabbitmq.reply-to",
        lambda _c, _m, p, body: answers.__setitem__(p.correlation_id, body),
        auto_ack=True,
    )
    for i in range(20):
        props = pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id=str(i))
        rch.basic_publish("", "rpc.dr", b"q%d" % i, props)
    deadline = time.monotonic() + 15
    while len(answers) < 20:
        assert time.monotonic() < deadline, f"{len(answers)} answers"
        for c in (server, requester):
            c.process_data_events(0.02)
    assert answers == {str(i): b"Q%d" % i for i in range(20)}
    brokers.converged([1, 2, 3])
    requester.close()
    brokers.converged([1, 2, 3])
    for n in (1, 2, 3):
        assert not [q for q in queues(brokers, n) if "amq.rabbitmq.reply-to" in q]


def test_a_priority_queue_hands_out_one_order_through_every_member(brokers: BrokerSet) -> None:
    c1 = connect(brokers, 1)
    ch1 = c1.channel()
    ch1.confirm_delivery()
    ch1.queue_declare("prio", arguments={"x-max-priority": 4})
    for i in range(30):
        # Priority 5 is above the maximum: it counts as 4.
        ch1.basic_publish("", "prio", b"%d" % i, pika.BasicProperties(priority=i % 6))
    brokers.converged([1, 2, 3])
    expected = [b"%d" % i for i in sorted(range(30), key=lambda i: (-min(i % 6, 4), i))]
    got: list[bytes] = []
    # Gets alternate between members 2 and 3: one queue, one order, wherever a client asks.
    chans = {n: connect(brokers, n).channel() for n in (2, 3)}
    method, _p, body = chans[3].basic_get("prio")
    chans[3].basic_reject(method.delivery_tag, requeue=True)  # back to its place: first
    # basic.reject has no reply: a round trip on the same channel makes sure it was applied
    # before member 2's next get enters the cluster order.
    chans[3].queue_declare("prio", passive=True)
    for i in range(30):
        method, _p, body = chans[2 + i % 2].basic_get("prio", auto_ack=True)
        got.append(body)
    assert got == expected
    brokers.converged([1, 2, 3])
    for n in (1, 2, 3):
        assert queues(brokers, n)["/:prio"]["ready"] == 0


def test_single_active_consumer_fails_over_to_the_next_member_in_order(
    brokers: BrokerSet,
) -> None:
    c1 = connect(brokers, 1)
    ch1 = c1.channel()
    ch1.confirm_delivery()
    ch1.queue_declare("ordered", arguments={"x-single-active-consumer": True})
    # The active consumer on member 3 holds five deliveries; the next in line is on member 2.
    c3 = connect(brokers, 3)
    ch3 = c3.channel()
    ch3.basic_qos(prefetch_count=5)
    held: list[bytes] = []
    ch3.basic_consume("ordered", lambda c, m, p, b: held.append(b))
    c2 = connect(brokers, 2)
    ch2 = c2.channel()
    got: list[tuple[bytes, bool]] = []
    ch2.basic_consume(
        "ordered",
        lambda c, m, p, b: (got.append((b, m.redelivered)), c.basic_ack(m.delivery_tag)),
    )
    sent = [b"%d" % i for i in range(20)]
    for body in sent:
        ch1.basic_publish("", "ordered", body)  # returns once confirmed
    drain(c3, lambda: len(held) == 5)
    c2.process_data_events(0.5)
    assert held == sent[:5] and got == [], "only the eldest consumer gets messages"
    brokers.kill(3)  # kill -9 the active consumer's member
    # The next consumer takes over: the five unacked first (redelivered), then the rest, in
    # publish order, and nothing twice.
    drain(c2, lambda: len(got) == 20)
    c2.process_data_events(0.3)
    assert got == [(b, i < 5) for i, b in enumerate(sent)]
    brokers.converged([1, 2])
    assert queues(brokers, 1)["/:ordered"] == {"ready": 0, "unacked": 0, "consumers": 1}


def test_consumer_priorities_hold_across_members(brokers: BrokerSet) -> None:
    c1 = connect(brokers, 1)
    ch1 = c1.channel()
    ch1.confirm_delivery()
    ch1.queue_declare("ranked")
    # The high-priority consumer (member 2) takes two at a time; the low one (member 3) gets
    # messages only while the high one is full, whichever member's grant comes first.
    c2, c3 = connect(brokers, 2), connect(brokers, 3)
    hi_ch = c2.channel()
    hi_ch.basic_qos(prefetch_count=2)
    hi: list[tuple[int, bytes]] = []
    lo: list[bytes] = []
    hi_ch.basic_consume(
        "ranked", lambda c, m, p, b: hi.append((m.delivery_tag, b)), arguments={"x-priority": 9}
    )
    c3.channel().basic_consume("ranked", lambda c, m, p, b: lo.append(b), auto_ack=True)
    for i in range(6):
        ch1.basic_publish("", "ranked", b"%d" % i)
    drain(c2, lambda: len(hi) == 2)
    drain(c3, lambda: len(lo) == 4)
    assert [b for _t, b in hi] == [b"0", b"1"] and lo == [b"2", b"3", b"4", b"5"]
    # Room again on the high one: the next message is its.
    hi_ch.basic_ack(hi[-1][0], multiple=True)
    # basic.ack has no reply: a round trip on the same channel makes sure it was applied
    # before the publish on member 1 enters the cluster order.
    hi_ch.queue_declare("ranked", passive=True)
    ch1.basic_publish("", "ranked", b"6")
    drain(c2, lambda: len(hi) == 3)
    c3.process_data_events(0.3)
    assert hi[-1][1] == b"6" and len(lo) == 4
    brokers.converged([1, 2, 3])


def test_a_poison_message_in_a_quorum_queue_is_dead_lettered_whichever_member_returns_it(
    brokers: BrokerSet,
) -> None:
    ch1 = connect(brokers, 1).channel()
    ch1.confirm_delivery()
    ch1.exchange_declare("poison.dlx", "fanout")
    ch1.queue_declare("poison.dead")
    ch1.queue_bind("poison.dead", "poison.dlx")
    args = {"x-queue-type": "quorum", "x-delivery-limit": 2, "x-dead-letter-exchange": "poison.dlx"}
    ch1.queue_declare("poison", durable=True, arguments=args)
    ch1.basic_publish("", "poison", b"bad")
    counts = []
    # Members 2 and 3 take turns failing it; each return counts on every member.
    for n in (2, 3, 2):
        ch = connect(brokers, n).channel()
        method, props, _body = ch.basic_get("poison")
        counts.append((props.headers or {}).get("x-delivery-count", 0))
        ch.basic_nack(method.delivery_tag, requeue=True)
        ch.queue_declare("poison", durable=True, arguments=args)  # the nack applied first
    assert counts == [0, 1, 2]
    ch3 = connect(brokers, 3).channel()
    assert ch3.basic_get("poison")[0] is None
    _m, props, body = ch3.basic_get("poison.dead", auto_ack=True)
    assert body == b"bad" and props.headers["x-first-death-reason"] == "delivery_limit"
    brokers.converged([1, 2, 3])


def _mixed_client(url: str, idx: int, errors: list[str]) -> None:
    try:
        p = pika.URLParameters(url)
        p.socket_timeout = 5
        conn = pika.BlockingConnection(p)
        _OPEN.append(conn)
        ch = conn.channel()
        q = f"mixed-{idx % 3}"
        ch.queue_declare(q)
        ch.exchange_declare("mixed-fan", "fanout")
        ch.queue_bind(q, "mixed-fan")
        if idx % 2:
            ch.confirm_delivery()
        else:
            ch.tx_select()
        for i in range(30):
            ch.basic_publish("mixed-fan" if i % 4 == 0 else "", q, b"m")
            if idx % 2 == 0 and i % 5 == 4:
                ch.tx_commit()
        if idx % 2 == 0:
            ch.tx_commit()
        for _ in range(10):
            m, _props, _body = ch.basic_get(q)
            if m is None:
                continue
            if m.delivery_tag % 3 == 0:
                ch.basic_nack(m.delivery_tag, requeue=True)
            elif m.delivery_tag % 3 == 1:
                ch.basic_reject(m.delivery_tag, requeue=False)
            else:
                ch.basic_ack(m.delivery_tag)
        if idx % 2 == 0:
            ch.tx_commit()
        conn.close()
    except Exception as e:  # reported to the test
        errors.append(f"client {idx}: {e!r}")


def test_ten_concurrent_mixed_clients_keep_replicas_identical(brokers: BrokerSet) -> None:
    errors: list[str] = []
    threads = [
        threading.Thread(target=_mixed_client, args=(brokers.url(1 + i % 3), i, errors))
        for i in range(10)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    brokers.converged([1, 2, 3])
    depths = [queues(brokers, n) for n in (1, 2, 3)]
    assert depths[0] == depths[1] == depths[2]
    assert sum(q["ready"] for q in depths[0].values()) > 0


def test_killed_member_unacked_messages_are_redelivered_on_survivors(brokers: BrokerSet) -> None:
    c1 = connect(brokers, 1)
    ch1 = c1.channel()
    ch1.confirm_delivery()
    ch1.queue_declare("jobs")
    c3 = connect(brokers, 3)
    ch3 = c3.channel()
    ch3.basic_qos(prefetch_count=10)
    held: list[bytes] = []
    ch3.basic_consume("jobs", lambda c, m, p, b: held.append(b))
    confirmed = []
    for i in range(30):
        ch1.basic_publish("", "jobs", b"%d" % i)  # returns once confirmed
        confirmed.append(b"%d" % i)
    drain(c3, lambda: len(held) == 10)
    brokers.kill(3)  # kill -9 the member with 10 unacked deliveries
    c2 = connect(brokers, 2)
    ch2 = c2.channel()
    got: list[tuple[bytes, bool]] = []
    ch2.basic_consume(
        "jobs", lambda c, m, p, b: (got.append((b, m.redelivered)), c.basic_ack(m.delivery_tag))
    )
    drain(c2, lambda: len(got) >= 30)
    assert sorted(b for b, _ in got) == sorted(confirmed)  # at least once: nothing lost
    redelivered = {b for b, r in got if r}
    assert redelivered == set(held)
    brokers.converged([1, 2])
    s = brokers.status(1)
    assert s is not None and len(s["members"]) == 2


def test_node_failure_closes_its_clients_everywhere_and_cluster_continues(
    brokers: BrokerSet, cluster: DevCluster
) -> None:
    c2 = connect(brokers, 2)
    ch2 = c2.channel()
    ch2.queue_declare("survive")
    ch2.basic_consume("survive", lambda *a: None)
    # consume-ok means member 2 applied the consume; member 1 may apply it a moment later.
    brokers.converged([1, 2, 3])
    assert queues(brokers, 1)["/:survive"]["consumers"] == 1
    cluster.kill(2)  # corosync of node 2 dies: a machine failure as the others see it
    deadline = time.monotonic() + 15
    while queues(brokers, 1)["/:survive"]["consumers"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # The broker on the dead node stops by itself (its corosync is gone).
    assert brokers.procs[2].wait(15) != 0
    c1 = connect(brokers, 1)
    ch1 = c1.channel()
    ch1.confirm_delivery()
    ch1.basic_publish("", "survive", b"after")
    brokers.converged([1, 3])


def test_ttl_and_expiry_act_identically_even_when_the_clock_master_dies(
    brokers: BrokerSet,
) -> None:
    master = brokers.status(1)["clock_master"]  # type: ignore[index]
    members = {brokers.status(n)["member"]: n for n in (1, 2, 3)}  # type: ignore[index]
    master_node = members[master]
    other = next(n for n in (1, 2, 3) if n != master_node)
    c = connect(brokers, other)
    ch = c.channel()
    ch.queue_declare("ttl", arguments={"x-message-ttl": 1500})
    ch.queue_declare("tmp", arguments={"x-expires": 2500})
    ch.confirm_delivery()
    for _ in range(5):
        ch.basic_publish("", "ttl", b"x")
    brokers.kill(master_node)
    survivors = [n for n in (1, 2, 3) if n != master_node]
    deadline = time.monotonic() + 20
    while True:
        qs = [queues(brokers, n) for n in survivors]
        if all(q.get("/:ttl", {}).get("ready") == 0 and "/:tmp" not in q for q in qs):
            break
        assert time.monotonic() < deadline, qs
        time.sleep(0.2)
    new_master = brokers.status(survivors[0])["clock_master"]  # type: ignore[index]
    assert new_master != master and new_master in members
    brokers.converged(survivors)


def test_malformed_frame_closes_that_client_on_every_member_and_nothing_else(
    brokers: BrokerSet,
) -> None:
    good = connect(brokers, 2)
    gch = good.channel()
    gch.queue_declare("steady")
    port = int(brokers.url(1).rsplit(":", 1)[1].strip("/"))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"AMQP\x00\x00\x09\x01")
        time.sleep(0.3)
        s.recv(4096)  # connection.start
        s.sendall(b"\x07\x00\x00\x00\x00\x00\x00\xce")  # unknown frame type
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    assert b"FRAME_ERROR" in data
    brokers.converged([1, 2, 3])
    for n in (1, 2, 3):
        s = brokers.status(n)
        assert s is not None
        assert s["connections"]["local"] + s["connections"]["shadow"] == 1
    gch.basic_publish("", "steady", b"still fine")
    _m, _p, body = gch.basic_get("steady", auto_ack=True)
    assert body == b"still fine"


def test_clients_fail_over_with_the_documented_examples(brokers: BrokerSet) -> None:
    brokers.kill(1)
    time.sleep(1)
    urls = [brokers.url(n) for n in (1, 2, 3)]  # the first one is dead
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs/examples/pika_failover.py"), *urls],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "consumed 100 distinct messages" in out.stdout
    kombu_url = ";".join(u + "/" for u in urls)  # kombu spells vhost "/" as a second slash
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs/examples/kombu_failover.py"), kombu_url],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "received [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in out.stdout


def test_member_list_reaches_clients(brokers: BrokerSet) -> None:
    c = connect(brokers, 2)
    props = c._impl.server_properties  # what connection.start carried
    assert set(props["cluster_members"].split()) == {
        f"amqp://127.0.0.1:{brokers.ports[n][0]}/" for n in (1, 2, 3)
    }
    ch = c.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "amq.failover")
    m, p, body = ch.basic_get(q, auto_ack=True)
    assert len(body.decode().split("\n")) == 3
    brokers.kill(3)
    deadline = time.monotonic() + 15
    while True:
        m, p, body = ch.basic_get(q, auto_ack=True)
        if m is not None:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert len(body.decode().split("\n")) == 2
    assert p.headers["members"] == body.decode().split("\n")


def test_status_command_shows_members_and_queues(brokers: BrokerSet) -> None:
    c = connect(brokers, 1)
    c.channel().queue_declare("visible")
    brokers.converged([1, 2, 3])  # member 2 may apply the declare a moment after member 1

    def status(*extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "cpgbroker", "status", *brokers.cli_args(2), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)

    out = status()
    assert out.returncode == 0, out.stderr
    assert "state: ready" in out.stdout
    assert "queue /:visible" in out.stdout
    assert "connections: 0 local, 1 shadow" in out.stdout
    js = json.loads(status("--json").stdout)
    assert len(js["members"]) == 3 and all(m["status"] == "ready" for m in js["members"])


def test_the_admin_plane_refuses_calls_without_the_secret_on_loopback_too(
    brokers: BrokerSet,
) -> None:
    def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cpgbroker", *args, "--url", brokers.admin(1)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": "/nonexistent", **env},
        )

    # No secret at all: the CLI finds none to send.
    out = cli("cluster", "stop")
    assert out.returncode == 1 and "no admin secret" in out.stderr, out.stderr
    # The endpoint itself, asked without one or with a wrong one (loopback, as every test).
    target = brokers.admin_target(1)
    wrong = "not-the-secret-7f3a"
    for secret, code in (("", 401), (wrong, 403)):
        http, answer = adminclient.request(attrs.evolve(target, secret=secret), "GET", "/status")
        assert http == code and "error" in answer and "state" not in answer
        http, _ = adminclient.request(attrs.evolve(target, secret=secret), "POST", "/stop", {})
        assert http == code
    out = cli("cluster", "stop", "--token", wrong)
    assert out.returncode == 1 and "refused (403)" in out.stderr, out.stderr
    out = cli("status", "--token", wrong)
    assert out.returncode == 1 and "refused (403)" in out.stderr, out.stderr
    # Nothing stopped: every member still serves, and the refusals are in the member's log.
    for n in (1, 2, 3):
        s = brokers.status(n)
        assert s is not None and s["state"] == "ready" and not s.get("stopping")
    log = brokers.wait_log(1, "admin request refused")
    assert "peer=127.0.0.1" in log
    assert wrong not in log and target.secret not in log


def test_a_stalled_member_holds_back_traffic_instead_of_unbounded_buffering(
    cluster: DevCluster,
) -> None:
    group = f"t{uuid.uuid4().hex[:10]}"
    bs = BrokerSet(cluster, group=group, name=f"broker-{group}", extra_config="max_lag = 40\n")
    # extra_config lands after [cluster] in the generated file
    try:
        bs.start_all(timeout=60)
        c = connect(bs, 1)
        ch = c.channel()
        ch.queue_declare("flood")
        stop = threading.Event()

        def publish() -> None:
            # Blocks once the member stops reading us (TCP backpressure): that is the point.
            with contextlib.suppress(Exception):
                while not stop.is_set():
                    ch.basic_publish("", "flood", b"x" * 100)

        bs.procs[3].send_signal(signal.SIGSTOP)  # member 3 stops applying events
        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        time.sleep(4)
        s1 = bs.status(1)
        assert s1 is not None
        assert s1["lag"]["held_back"] > 0, (s1["lag"], s1["event_seq"], s1["queues"])
        # The bound, plus what was in flight when it was reached (progress reports every 10).
        assert s1["lag"]["events_behind"] <= 40 + 10 + 8
        stop.set()
        bs.procs[3].send_signal(signal.SIGCONT)
        publisher.join(30)
        assert not publisher.is_alive()
        # Member 1 still holds client bytes it read before the hold-back; they drain once
        # member 3 catches up, so equal digests at one instant are not the end yet: wait
        # until both report the same final depth.
        deadline = time.monotonic() + 60
        while True:
            bs.converged([1, 2, 3], timeout=60)
            depth = queues(bs, 3)["/:flood"]["ready"]
            if depth == queues(bs, 1)["/:flood"]["ready"] > 0:
                break
            assert time.monotonic() < deadline, "member 1 and member 3 never agreed on depth"
            time.sleep(0.5)
    finally:
        with contextlib.suppress(Exception):
            bs.procs[3].send_signal(signal.SIGCONT)
        bs.stop_all()
        for n in (1, 2, 3):  # shown by pytest only when the test failed
            print(f"--- broker {n} log\n{bs.tail(n, 40)}")


def test_member_partitioned_away_and_merged_back_resyncs_and_the_majority_serves_on(
    brokers: BrokerSet, cluster: DevCluster
) -> None:
    c = connect(brokers, 1)
    ch = c.channel()
    ch.confirm_delivery()
    ch.queue_declare("split")
    cluster.stop(3)  # node 3 hangs longer than the token: the others form a partition of two
    deadline = time.monotonic() + 15
    while len((brokers.status(1) or {}).get("members", [])) != 2:
        assert time.monotonic() < deadline, "members 1 and 2 never saw node 3 go"
        time.sleep(0.2)
    for i in range(20):
        ch.basic_publish("", "split", b"%d" % i)  # applied on the majority side only
    cluster.resume(3)
    # The member that missed those events must not serve them a diverged state: it drops its
    # state (inquorate ring, or merged back on the smaller side) and takes a state update.
    deadline = time.monotonic() + 60
    while True:
        s3 = brokers.status(3) or {}
        if s3.get("state") == "ready" and s3.get("incarnations", 1) >= 2:
            break
        assert brokers.procs[3].poll() is None, brokers.tail(3, 20)
        assert time.monotonic() < deadline, brokers.tail(3, 20)
        time.sleep(0.2)
    brokers.converged([1, 2, 3], timeout=30)
    for n in (1, 2, 3):
        s = brokers.status(n)
        assert s is not None and s["state"] == "ready" and len(s["members"]) == 3
        assert s["queues"]["/:split"]["ready"] == 20
    ch.basic_publish("", "split", b"after")

"""The management HTTP API on a real 3-member cluster: any member answers for the whole cluster
from its replica."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import connect, management
from prometheus_client.parser import text_string_to_metric_families

from cpgbroker.dev.brokers import BrokerSet

pytestmark = pytest.mark.integration

# A user with the administrator tag that may log in from anywhere (guest is loopback-only).
ADMIN_USERS = """
[[users]]
name = "guest"
password = "guest"
loopback_only = true
tags = ["administrator"]

[[users]]
name = "ops"
password = "ops-pw"
tags = ["administrator"]
"""
AUTH = "Basic " + base64.b64encode(b"ops:ops-pw").decode()


def api(bs: BrokerSet, node: int, path: str, auth: str = AUTH) -> tuple[int, Any]:
    return management(bs, node, "GET", path, auth)


def test_every_member_answers_the_api_for_the_whole_cluster(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(extra_config=ADMIN_USERS)
    conn = connect(bs, 1)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare("mc.ex", "fanout")
    for name in ("mc.a", "mc.b"):
        ch.queue_declare(name, durable=True)
        ch.queue_bind(name, "mc.ex")
    for i in range(5):
        ch.basic_publish("mc.ex", "", b"m%d" % i)
    ch.basic_publish("", "mc.a", b"extra")

    def queues(node: int) -> list[tuple[str, int]]:
        status, got = api(bs, node, "/api/queues/%2F")
        assert status == 200, got
        return [(q["name"], q["messages"]) for q in got]

    want = [("mc.a", 6), ("mc.b", 5)]
    # Confirms come once every member has the messages; the replicas agree at once after.
    deadline = time.monotonic() + 15
    while any(queues(n) != want for n in (1, 2, 3)):
        assert time.monotonic() < deadline, [queues(n) for n in (1, 2, 3)]
        time.sleep(0.2)
    urls = {f"127.0.0.1:{bs.ports[n][0]}" for n in (1, 2, 3)}
    for n in (1, 2, 3):
        status, nodes = api(bs, n, "/api/nodes")
        assert status == 200
        assert {node["name"] for node in nodes} == {f"cpgbroker@{u}" for u in urls}
        assert all(node["running"] and node["cpgbroker_state"] == "ready" for node in nodes)
        status, overview = api(bs, n, "/api/overview")
        assert overview["node"] == f"cpgbroker@127.0.0.1:{bs.ports[n][0]}"
        # One cluster name on every member (by default the CPG group), where each member
        # names its own node.
        assert overview["cluster_name"] == bs.group
        assert api(bs, n, "/api/cluster-name") == (200, {"name": bs.group})
        assert overview["queue_totals"]["messages"] == 11
        # The one client is on member 1; every member lists it, with member 1 as its node.
        status, conns = api(bs, n, "/api/connections")
        assert [c["node"] for c in conns] == [f"cpgbroker@127.0.0.1:{bs.ports[1][0]}"]
        status, bindings = api(bs, n, "/api/bindings/%2F")
        assert sum(1 for b in bindings if b["source"] == "mc.ex") == 2
        assert api(bs, n, "/api/health/checks/alarms") == (200, {"status": "ok"})
        assert api(bs, n, "/api/health/checks/node-is-quorum-critical")[0] == 200
        # The admin secret as a Bearer token, for operators' tools.
        secret = bs.admin_target(n).secret
        status, text = api(bs, n, "/metrics", f"Bearer {secret}")
        assert status == 200
        samples = {
            (s.name, s.labels.get("queue", "")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("rabbitmq_queue_messages_ready", "mc.a")] == 6
        assert samples[("cpgbroker_members_ready", "")] == 3
        identity = [
            s.labels
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "rabbitmq_identity_info"
        ]
        assert identity == [{"rabbitmq_node": overview["node"], "rabbitmq_cluster": bs.group}]
        # Counters for rates, the ring's traffic, what waits for stability, apply times.
        assert samples[("cpgbroker_queue_messages_published_total", "mc.a")] == 6
        assert samples[("cpgbroker_queue_messages_delivered_total", "mc.a")] == 0
        assert samples[("cpgbroker_cpg_bytes_sent_total", "")] > 0
        assert samples[("cpgbroker_confirms_held", "")] == 0
        # One event in 64 is timed (the events a member applied, less any before it served).
        timed = samples[("cpgbroker_event_apply_seconds_count", "")]
        assert timed <= samples[("cpgbroker_event_seq", "")] // 64
        assert samples[("cpgbroker_member_lag_events", "")] >= 0
        assert api(bs, n, "/api/queues", "Basic " + base64.b64encode(b"ops:x").decode())[0] == 401
    # Clients are told the same name by every member (connection.start's cluster_name).
    for n in (1, 2, 3):
        other = connect(bs, n)
        assert other._impl.server_properties["cluster_name"] == bs.group
        other.close()
    conn.close()


def write(
    bs: BrokerSet, node: int, method: str, path: str, body: Any = None, auth: str = AUTH
) -> tuple[int, Any]:
    return management(bs, node, method, path, auth, body)


def login(bs: BrokerSet, node: int, user: str, password: str, vhost: str = "/") -> Any:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1",
            bs.ports[node][0],
            vhost,
            credentials=pika.PlainCredentials(user, password),
            connection_attempts=1,
        )
    )


def test_users_and_policies_change_on_every_member_at_once_and_reach_a_newcomer(
    broker_set: Callable[..., BrokerSet],
) -> None:
    """A user added through one member logs in on every member as soon as the answer came
    (the answer waits until every member applied the change); a policy set through another
    applies on all of them at the same event; both reach a member that joins later through a
    state update, which ends with the same digest."""
    bs = broker_set(extra_config=ADMIN_USERS, store=True)
    assert write(bs, 1, "PUT", "/api/vhosts/apps") == (201, None)
    assert write(bs, 1, "PUT", "/api/users/carol", {"password": "c-pw", "tags": ""}) == (
        201,
        None,
    )
    perms = {"configure": ".*", "write": ".*", "read": ".*"}
    assert write(bs, 1, "PUT", "/api/permissions/apps/carol", perms) == (201, None)
    for node in (1, 2, 3):  # no retry: the answer came after every member had it
        login(bs, node, "carol", "c-pw", "apps").close()
    policy = {"pattern": "^capped\\.", "definition": {"max-length": 3}, "apply-to": "queues"}
    assert write(bs, 2, "PUT", "/api/policies/apps/cap", policy) == (201, None)
    conn = login(bs, 3, "carol", "c-pw", "apps")
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("capped.q", durable=True)
    for i in range(10):
        ch.basic_publish("", "capped.q", b"m%d" % i, pika.BasicProperties(delivery_mode=2))
    for node in (1, 2, 3):
        status, q = api(bs, node, "/api/queues/apps/capped.q")
        assert status == 200 and (q["messages"], q["policy"]) == (3, "cap")
    digest = bs.converged([1, 2, 3])
    # A member that joins later gets users, permissions and policies with the state update.
    late = BrokerSet(
        bs.dc, group=bs.group, name=f"late-{bs.group}", extra_config=ADMIN_USERS, store=True
    )
    try:
        late.start(1)
        late.wait_ready([1])
        login(late, 1, "carol", "c-pw", "apps").close()
        status, q = api(late, 1, "/api/queues/apps/capped.q")
        assert (status, q["messages"], q["policy"]) == (200, 3, "cap")
        assert api(late, 1, "/api/policies/apps/cap")[1]["definition"] == {"max-length": 3}
        # Every member, the newcomer too, at one event with one digest.
        same = same_state([(bs, 1), (bs, 2), (bs, 3), (late, 1)])
        assert same != digest  # ticks moved on; the point is that all four agree
        # A change after the update reaches the newcomer too.
        assert write(bs, 2, "DELETE", "/api/users/carol") == (204, None)
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            login(late, 1, "carol", "c-pw", "apps")
    finally:
        late.stop_all()
    conn.close()


def same_state(sets: list[tuple[BrokerSet, int]], timeout: float = 30.0) -> str:
    """Members of several broker sets sampled at one moment until they stand at one event
    with one digest."""
    deadline = time.monotonic() + timeout
    while True:
        seen = [s.status(n, digest=True) for s, n in sets]
        points = [None if x is None else (x["event_seq"], x["digest"]) for x in seen]
        if None not in points and len(set(points)) == 1:
            return str(points[0][1])  # type: ignore[index]
        assert time.monotonic() < deadline, points
        time.sleep(0.05)


def test_a_management_write_through_a_member_is_refused_without_rights_and_logged(
    broker_set: Callable[..., BrokerSet],
) -> None:
    bs = broker_set(extra_config=ADMIN_USERS + MONITOR_USER, cluster_options='name = "orders-eu"')
    mon = "Basic " + base64.b64encode(b"mon:mon-pw").decode()
    status, body = write(
        bs, 2, "PUT", "/api/users/evil", {"password": "x", "tags": "administrator"}, mon
    )
    assert (status, body["reason"]) == (401, "Not administrator user")
    assert api(bs, 1, "/api/users/evil")[0] == 404
    log = bs.wait_log(2, "user='mon'")
    assert "admin request refused" in log
    assert "mon-pw" not in log
    # A name of its own from [cluster] name, given by every member, and renamed by none.
    for n in (1, 2, 3):
        assert api(bs, n, "/api/cluster-name") == (200, {"name": "orders-eu"})
    status, body = write(bs, 3, "PUT", "/api/cluster-name", {"name": "other"})
    assert status == 405 and "[cluster] name" in body["reason"], body
    assert api(bs, 1, "/api/cluster-name") == (200, {"name": "orders-eu"})


MONITOR_USER = """
[[users]]
name = "mon"
password = "mon-pw"
tags = ["monitoring"]
"""

"""The management HTTP API on a real 3-member cluster: any member answers for the whole cluster
from its replica."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from brokerclients import connect
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
    url = f"http://127.0.0.1:{bs.ports[node][1]}{path}"
    request = urllib.request.Request(url, headers={"Authorization": auth})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    is_json = body.startswith((b"{", b"["))
    return status, json.loads(body) if is_json else body.decode()


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
        assert api(bs, n, "/api/queues", "Basic " + base64.b64encode(b"ops:x").decode())[0] == 401
    conn.close()

"""RabbitMQ's management HTTP API (the read side) and Prometheus metrics on the admin endpoint:
the pure shaping and login rules, then a real standalone broker with a real client."""

from __future__ import annotations

import base64
import functools
import json
import logging
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pika
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig, Permission, User
from cpgbroker.runtime.mgmt import reads, views
from cpgbroker.runtime.mgmt.reads import Refusal
from cpgbroker.runtime.mgmt.views import ADMIN_TAGS, MGMT_TAGS, MONITOR_TAGS, Identity

USERS = (
    User("admin", "pw-admin", ("/", "other"), tags=("administrator",)),
    User("mon", "pw-mon", tags=("monitoring",)),
    User("mgr", "pw-mgr", ("other",), tags=("management",)),
    User("app", "pw-app"),
    User("guest", "guest", loopback_only=True, tags=("administrator",)),
)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ---- login rules, as rabbit_web_dispatch_access_control


def test_logins_follow_rabbitmqs_tag_rules() -> None:
    def who(auth: str, need: tuple[str, ...] = MGMT_TAGS, loopback: bool = True) -> Any:
        return reads.authenticate(auth, USERS, "s3cret", loopback, need)

    assert who(basic("admin", "pw-admin")) == Identity("admin", ("administrator",), USERS[0])
    assert isinstance(who(basic("mgr", "pw-mgr")), Identity)
    assert isinstance(who(basic("mon", "pw-mon"), MONITOR_TAGS), Identity)
    assert who("Bearer s3cret") == Identity(reads.SECRET_HOLDER, ("administrator",))
    # Missing or wrong credentials: not_authorized with the realm, as RabbitMQ answers.
    for auth in ("", basic("admin", "nope"), basic("ghost", "x"), "Bearer nope", "Basic !!"):
        r = who(auth)
        assert isinstance(r, Refusal) and r.status == 401
        assert r.body == {"error": "not_authorized", "reason": "Not_Authorized"}
        assert r.headers == (("WWW-Authenticate", 'Basic realm="RabbitMQ Management"'),)
    # Right password, but no management tag / not enough of one: not_authorised, no realm.
    refused = who(basic("app", "pw-app"))
    assert isinstance(refused, Refusal) and refused.headers == ()
    assert refused.body == {"error": "not_authorised", "reason": "Not management user"}
    refused = who(basic("mgr", "pw-mgr"), MONITOR_TAGS)
    assert isinstance(refused, Refusal) and refused.body["reason"] == "Not monitor user"
    refused = who(basic("mon", "pw-mon"), ADMIN_TAGS)
    assert isinstance(refused, Refusal) and refused.body["reason"] == "Not administrator user"
    refused = who(basic("guest", "guest"), loopback=False)
    assert isinstance(refused, Refusal)
    assert refused.body["reason"] == "User can only log in via localhost"
    # What the member logs names the user, never the password.
    assert "nope" not in repr(who(basic("admin", "nope")).why)


def test_paths_split_before_decoding_and_need_rabbitmqs_tags() -> None:
    assert reads.split_path("/api/queues/%2F/a%2Fb") == ["queues", "/", "a/b"]
    assert reads.split_path("/api/overview") == ["overview"]
    assert reads.split_path("/status") is None
    assert reads.needed_tags(["users"]) == ADMIN_TAGS
    assert reads.needed_tags(["vhosts", "/", "permissions"]) == ADMIN_TAGS
    assert reads.needed_tags(["nodes"]) == MONITOR_TAGS
    assert reads.needed_tags(["queues", "/"]) == MGMT_TAGS


# ---- JSON shapes from a model


def _broker_with_things() -> Broker:
    from pamqp import commands

    from modelclient import Harness

    h = Harness(Broker(BrokerConfig(users=USERS, vhosts=("/", "other"))))
    c = h.connect(1)
    c.handshake("admin", "pw-admin")
    c.channel(1)
    c.rpc(1, commands.Exchange.Declare(exchange="ex1", exchange_type="topic"))
    c.rpc(1, commands.Queue.Declare(queue="q1", arguments={"x-max-length": 10}))
    c.rpc(1, commands.Queue.Bind(queue="q1", exchange="ex1", routing_key="a.#"))
    c.publish(1, "", "q1", b"hello")
    c.publish(1, "", "q1", b"world")
    return h.broker


def test_queues_exchanges_bindings_in_rabbitmqs_shapes() -> None:
    b = _broker_with_things()
    view = views.cluster_view({"state": "standalone", "member": None}, b, "host1")
    admin = Identity("admin", ("administrator",), USERS[0])
    api = reads.ManagementApi()
    got = api.get(["queues", "/", "q1"], view, admin)
    assert got.status == 200
    q = got.body
    assert {k: q[k] for k in ("name", "vhost", "durable", "exclusive", "auto_delete")} == {
        "name": "q1",
        "vhost": "/",
        "durable": False,
        "exclusive": False,
        "auto_delete": False,
    }
    assert q["messages"] == q["messages_ready"] == 2 and q["messages_unacknowledged"] == 0
    assert q["arguments"] == {"x-max-length": 10} and q["state"] == "running"
    assert q["node"] == "cpgbroker@host1" and q["consumer_details"] == []
    assert [x["name"] for x in api.get(["queues"], view, admin).body] == ["q1"]
    assert api.get(["queues", "other"], view, admin).body == []
    assert api.get(["queues", "/", "nope"], view, admin) == reads.Answer(
        404, {"error": "Object Not Found", "reason": "Not Found"}
    )
    assert api.get(["queues", "nope"], view, admin).status == 404
    ex = api.get(["exchanges", "/", "ex1"], view, admin).body
    assert ex["type"] == "topic" and ex["vhost"] == "/" and ex["internal"] is False
    assert api.get(["exchanges", "/", "amq.default"], view, admin).body["name"] == ""
    names = [x["name"] for x in api.get(["exchanges", "/"], view, admin).body]
    assert {"", "amq.direct", "amq.topic", "ex1"} <= set(names)
    bindings = api.get(["bindings", "/"], view, admin).body
    assert {"source": "", "destination": "q1", "routing_key": "q1"}.items() <= bindings[0].items()
    assert {
        "source": "ex1",
        "vhost": "/",
        "destination": "q1",
        "destination_type": "queue",
        "routing_key": "a.#",
        "arguments": {},
        "properties_key": "a.%23",  # form-encoded, as RabbitMQ makes it
    } in bindings
    overview = api.get(["overview"], view, admin).body
    assert overview["queue_totals"] == {
        "messages": 2,
        "messages_ready": 2,
        "messages_unacknowledged": 0,
    }
    assert overview["object_totals"]["queues"] == 1
    assert overview["object_totals"]["connections"] == 1
    assert overview["rabbitmq_version"] == b.config.version
    conns = api.get(["connections"], view, admin).body
    assert len(conns) == 1 and conns[0]["user"] == "admin" and conns[0]["channels"] == 1
    chans = api.get(["channels"], view, admin).body
    assert chans[0]["number"] == 1 and chans[0]["connection_details"]["name"] == conns[0]["name"]
    assert api.get(["nope"], view, admin).status == 404


def test_management_users_see_their_vhosts_and_connections_only() -> None:
    b = _broker_with_things()
    view = views.cluster_view({"state": "standalone"}, b, "h")
    api = reads.ManagementApi()
    mgr = Identity("mgr", ("management",), USERS[2])
    assert api.get(["queues"], view, mgr).body == []
    assert api.get(["queues", "/", "q1"], view, mgr).status == 404
    assert [v["name"] for v in api.get(["vhosts"], view, mgr).body] == ["other"]
    assert api.get(["connections"], view, mgr).body == []
    mon = Identity("mon", ("monitoring",), USERS[1])
    assert len(api.get(["queues"], view, mon).body) == 1
    assert len(api.get(["connections"], view, mon).body) == 1


def test_users_permissions_and_the_shown_hash() -> None:
    b = Broker(
        BrokerConfig(
            users=(
                *USERS,
                User("fine", "", password_hash="", permissions=(Permission("/", "^a", "", ".*"),)),
            )
        )
    )
    view = views.cluster_view({"state": "standalone"}, b, "h")
    api = reads.ManagementApi()
    admin = Identity("admin", ("administrator",), USERS[0])
    users = api.get(["users"], view, admin).body
    admin_json = users[0]
    assert admin_json["name"] == "admin" and admin_json["tags"] == ["administrator"]
    assert admin_json["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    # The shown hash is the password's, in RabbitMQ's format, and the same every time.
    from cpgbroker.model.access import auth

    shown = User("admin", "", password_hash=admin_json["password_hash"])
    assert auth.password_ok(shown, "pw-admin") and not auth.password_ok(shown, "x")
    assert api.get(["users"], view, admin).body[0]["password_hash"] == shown.password_hash
    assert "pw-admin" not in json.dumps(users)
    perms = api.get(["permissions"], view, admin).body
    assert {"user": "fine", "vhost": "/", "configure": "^a", "write": "", "read": ".*"} in perms
    # Only vhosts that exist: "other" is not one of this broker's.
    assert not any(p["vhost"] == "other" for p in perms)
    assert api.get(["users", "fine", "permissions"], view, admin).body == [
        {"user": "fine", "vhost": "/", "configure": "^a", "write": "", "read": ".*"}
    ]
    assert api.get(["permissions", "/", "fine"], view, admin).body["configure"] == "^a"
    assert api.get(["users", "ghost"], view, admin).status == 404
    assert api.get(["whoami"], view, admin).body == {"name": "admin", "tags": ["administrator"]}


def test_health_checks_show_the_memory_mark_and_disk_alarms() -> None:
    b = Broker(BrokerConfig())
    status = {
        "state": "ready",
        "member": 2,
        "url": "amqp://10.0.0.2:5672/",
        "members": [
            {"member": 1, "url": "amqp://10.0.0.1:5672/", "status": "ready"},
            {"member": 2, "url": "amqp://10.0.0.2:5672/", "status": "ready"},
        ],
        "quorum": {"quorate": True, "quorum": 2, "expected_votes": 3},
    }
    view = views.cluster_view(status, b, "h")
    assert view.node == "cpgbroker@10.0.0.2:5672"
    api = reads.ManagementApi()
    admin = Identity("admin", ("administrator",))
    assert api.get(["health", "checks", "alarms"], view, admin).body == {"status": "ok"}
    nodes = api.get(["nodes"], view, admin).body
    assert [n["name"] for n in nodes] == ["cpgbroker@10.0.0.1:5672", "cpgbroker@10.0.0.2:5672"]
    assert all(n["running"] and n["type"] == "disc" for n in nodes)
    b.mark.disk_alarms[1] = True
    got = api.get(["health", "checks", "alarms"], view, admin)
    assert got.status == 503 and got.body["alarms"] == [
        {"node": "cpgbroker@10.0.0.1:5672", "resource": "disk"}
    ]
    # Member 1's disk is not this member's.
    assert api.get(["health", "checks", "local-alarms"], view, admin).status == 200
    b.mark.memory_blocked = True
    got = api.get(["health", "checks", "local-alarms"], view, admin)
    assert got.status == 503 and got.body["alarms"] == [
        {"node": "cpgbroker@10.0.0.2:5672", "resource": "memory"}
    ]
    # Two of three ready with a quorum of two: stopping this member stops the cluster.
    assert api.get(["health", "checks", "node-is-quorum-critical"], view, admin).status == 503
    assert api.get(["aliveness-test", "/"], view, admin).body == {"status": "ok"}
    assert api.get(["aliveness-test", "nope"], view, admin).status == 404


# ---- a real standalone broker, a real client


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str, auth: str | None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


async def test_a_standalone_broker_answers_the_api_and_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cpgbroker.runtime.config import settings
    from cpgbroker.runtime.process import main as runtime_main

    admin_port = _free_port()
    toml = tmp_path / "cpgbroker.toml"
    toml.write_text(
        'vhosts = ["/", "v2"]\n'
        f'[server]\nlisten = ["127.0.0.1:0"]\nadmin = "127.0.0.1:{admin_port}"\n'
        'admin_token = "s3cret-token"\n'
        '[[users]]\nname = "guest"\npassword = "guest"\nloopback_only = true\n'
        'tags = ["administrator"]\nvhosts = ["/", "v2"]\n'
        '[[users]]\nname = "mon"\npassword = "pw-mon"\ntags = ["monitoring"]\n'
        '[[users]]\nname = "app"\npassword = "pw-app"\n'
    )
    base = f"http://127.0.0.1:{admin_port}"
    guest = basic("guest", "guest")
    caplog.set_level(logging.INFO, logger="cpgbroker.admin")

    def client_work(amqp_port: int) -> None:
        params = pika.ConnectionParameters(
            "127.0.0.1", amqp_port, credentials=pika.PlainCredentials("guest", "guest")
        )
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        ch.exchange_declare("mgmt.ex", "direct")
        ch.queue_declare("mgmt.q", durable=True, arguments={"x-message-ttl": 60000})
        ch.queue_bind("mgmt.q", "mgmt.ex", "rk")
        ch.confirm_delivery()
        for i in range(3):
            ch.basic_publish("mgmt.ex", "rk", b"m%d" % i)
        method, _props, _body = ch.basic_get("mgmt.q")
        assert method is not None  # one unacked now

        def get(path: str, auth: str | None = guest) -> Any:
            status, _h, body = _get(base + path, auth)
            assert status == 200, (path, status, body)
            return json.loads(body)

        q = get("/api/queues/%2F/mgmt.q")
        assert q["messages"] == 3 and q["messages_ready"] == 2
        assert q["messages_unacknowledged"] == 1 and q["durable"] is True
        assert q["arguments"] == {"x-message-ttl": 60000} and q["vhost"] == "/"
        assert [x["name"] for x in get("/api/queues")] == ["mgmt.q"]
        assert get("/api/queues/v2") == []
        assert get("/api/exchanges/%2F/mgmt.ex")["type"] == "direct"
        assert any(
            b["source"] == "mgmt.ex" and b["destination"] == "mgmt.q" and b["routing_key"] == "rk"
            for b in get("/api/bindings/%2F")
        )
        assert [v["name"] for v in get("/api/vhosts")] == ["/", "v2"]
        assert get("/api/vhosts/v2")["name"] == "v2"
        conns = get("/api/connections")
        assert len(conns) == 1 and conns[0]["user"] == "guest"
        assert conns[0]["client_properties"]["product"] == "Pika Python Client Library"
        assert get("/api/channels")[0]["confirm"] is True
        overview = get("/api/overview")
        assert overview["object_totals"]["queues"] == 1
        assert overview["queue_totals"]["messages"] == 3
        assert [n["name"] for n in get("/api/nodes")] == [overview["node"]]
        # A standalone broker is a cluster of one named after its node, as RabbitMQ's, and
        # tells its clients so too.
        assert overview["node"] == f"cpgbroker@{socket.gethostname()}"
        assert get("/api/cluster-name") == {"name": overview["node"]}
        assert overview["cluster_name"] == overview["node"]
        assert conn._impl.server_properties["cluster_name"] == overview["node"]
        assert get("/api/whoami") == {"name": "guest", "tags": ["administrator"]}
        assert get("/api/health/checks/alarms") == {"status": "ok"}
        assert get("/api/aliveness-test/%2F") == {"status": "ok"}
        assert {u["name"] for u in get("/api/users")} == {"guest", "mon", "app"}
        # The admin secret works as a Bearer token; monitoring may read queues too.
        assert get("/api/queues", "Bearer s3cret-token")[0]["name"] == "mgmt.q"
        assert get("/api/queues", basic("mon", "pw-mon"))[0]["name"] == "mgmt.q"

        # Refusals, with RabbitMQ's statuses, bodies and realm.
        status, headers, body = _get(base + "/api/queues", basic("guest", "wrong"))
        assert status == 401 and json.loads(body)["error"] == "not_authorized"
        assert headers["WWW-Authenticate"] == 'Basic realm="RabbitMQ Management"'
        status, headers, body = _get(base + "/api/queues", None)
        assert status == 401 and "WWW-Authenticate" in headers
        status, _h, body = _get(base + "/api/overview", basic("app", "pw-app"))
        assert status == 401
        assert json.loads(body) == {"error": "not_authorised", "reason": "Not management user"}
        status, _h, body = _get(base + "/api/users", basic("mon", "pw-mon"))
        assert status == 401 and json.loads(body)["reason"] == "Not administrator user"
        status, _h, body = _get(base + "/api/queues/%2F/nope", guest)
        assert status == 404
        assert json.loads(body) == {"error": "Object Not Found", "reason": "Not Found"}
        # The admin plane's own paths still want the secret, not a user.
        assert _get(base + "/status", guest)[0] == 401
        assert _get(base + "/status", "Bearer s3cret-token")[0] == 200

        # Metrics, in Prometheus' text format, from the replica at scrape time.
        status, headers, body = _get(base + "/metrics", basic("mon", "pw-mon"))
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        samples = {
            (s.name, s.labels.get("queue", "")): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }
        assert samples[("rabbitmq_queue_messages_ready", "mgmt.q")] == 2
        [identity] = [
            s.labels
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
            if s.name == "rabbitmq_identity_info"
        ]
        assert identity["rabbitmq_cluster"] == identity["rabbitmq_node"] == overview["node"]
        assert samples[("rabbitmq_queue_messages_unacked", "mgmt.q")] == 1
        assert samples[("rabbitmq_queue_consumers", "mgmt.q")] == 0
        assert samples[("rabbitmq_connections", "")] == 1
        assert samples[("rabbitmq_channels", "")] == 1
        assert samples[("rabbitmq_alarms_memory_used_watermark", "")] == 0
        assert samples[("cpgbroker_event_seq", "")] > 0
        assert _get(base + "/metrics", None)[0] == 401
        assert _get(base + "/metrics", basic("app", "pw-app"))[0] == 401
        conn.close()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(runtime_main.serve, settings.load(str(toml)))
            await trio.to_thread.run_sync(client_work, bound[0][1])
            nursery.cancel_scope.cancel()
    refused = [m for m in caplog.messages if "refused" in m]
    assert any("user='guest'" in m and "peer=127.0.0.1" in m for m in refused)
    assert not any("wrong" in m.split("reason=")[0] for m in refused)
    assert not any("pw-app" in m or "s3cret-token" in m for m in caplog.messages)


async def test_keep_alive_bodies_and_malformed_requests() -> None:
    from cpgbroker.runtime.admin import endpoint
    from cpgbroker.runtime.mgmt import http11

    async def control(path: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 202, {"got": args}

    async def exchange(stream: trio.SocketStream, data: bytes) -> bytes:
        await stream.send_all(data)
        out = b""
        while b"\r\n\r\n" not in out:
            out += await stream.receive_some(65536)
        head, _, body = out.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += await stream.receive_some(65536)
        return head + b"\r\n\r\n" + body

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            _h, port = await nursery.start(
                endpoint.serve_admin, "127.0.0.1:0", lambda _d: {"state": "ready"}, control, "s3"
            )
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                # Three requests on one connection: HTTP/1.1 keeps it alive.
                for _ in range(2):
                    got = await exchange(
                        stream,
                        b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3\r\n\r\n",
                    )
                    assert got.startswith(b"HTTP/1.1 200") and b'"ready"' in got
                big = json.dumps({"pad": "x" * 100_000}).encode()
                got = await exchange(
                    stream,
                    b"POST /stop HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(big), big),
                )
                assert got.startswith(b"HTTP/1.1 202") and got.count(b"x") >= 100_000
            for bad in (
                b"NOT HTTP AT ALL\r\n\r\n",
                b"GET /status HTTP/1.1\r\nno colon here\r\n\r\n",
                b"GET /status HTTP/1.1\r\nHost: x\r\nContent-Length: 12x\r\n\r\n",
            ):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    got = await exchange(stream, bad)
                    assert got.startswith(b"HTTP/1.1 400"), (bad, got)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                declared = http11.MAX_BODY + 1
                got = await exchange(
                    stream,
                    b"POST /stop HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3\r\n"
                    b"Content-Length: %d\r\n\r\n" % declared,
                )
                assert got.startswith(b"HTTP/1.1 413")
            nursery.cancel_scope.cancel()


def test_lists_are_sorted_filtered_and_paged_as_rabbitmq_pages_them() -> None:
    items = [{"name": n, "vhost": "/"} for n in ("ghi", "abc", "def", "xab")]

    def listed(query: str) -> Any:
        import urllib.parse

        return reads.list_answer(items, urllib.parse.parse_qs(query))

    assert [x["name"] for x in listed("").body] == ["abc", "def", "ghi", "xab"]
    assert [x["name"] for x in listed("sort=name&sort_reverse=true").body] == [
        "xab",
        "ghi",
        "def",
        "abc",
    ]
    assert [x["name"] for x in listed("name=AB").body] == ["abc", "xab"]
    assert [x["name"] for x in listed("name=%5Eab&use_regex=true").body] == ["abc"]
    page = listed("page=2&page_size=3&pagination=true").body
    assert page == {
        "filtered_count": 4,
        "item_count": 1,
        "items": [{"name": "xab", "vhost": "/"}],
        "page": 2,
        "page_count": 2,
        "page_size": 3,
        "total_count": 4,
    }
    assert listed("page=3&page_size=3").status == 400
    assert listed("page=x").status == 400
    assert listed("name=(&use_regex=true").status == 400


def test_the_older_node_health_check_and_the_cluster_name() -> None:
    view = views.cluster_view({"state": "standalone"}, Broker(BrokerConfig()), "h")
    api = reads.ManagementApi()
    admin = Identity("admin", ("administrator",))
    assert api.get(["healthchecks", "node"], view, admin).body == {"status": "ok"}
    assert api.get(["healthchecks", "node", "cpgbroker@h"], view, admin).body == {"status": "ok"}
    assert api.get(["healthchecks", "node", "rabbit@x"], view, admin).status == 404
    # A view given no cluster name answers its node's (a standalone broker's settings give it
    # that: runtime/config/settings.py).
    assert api.get(["cluster-name"], view, admin).body == {"name": "cpgbroker@h"}
    overview = api.get(["overview"], view, admin).body
    assert overview["contexts"][0]["node"] == "cpgbroker@h"


def test_every_member_answers_the_configured_cluster_name_with_or_without_a_replica() -> None:
    """/api/cluster-name, /api/overview and rabbitmq_identity_info's rabbitmq_cluster give the
    configuration's name (the same on every member), each member its own node name."""
    from cpgbroker.runtime.mgmt import metrics

    api = reads.ManagementApi()
    admin = Identity("admin", ("administrator",))
    members = [
        {"member": m, "url": f"amqp://10.0.0.{m}:5672/", "status": "ready"} for m in (1, 2, 3)
    ]
    for m, broker in ((1, Broker(BrokerConfig())), (2, Broker(BrokerConfig())), (3, None)):
        status = {"state": "ready", "url": f"amqp://10.0.0.{m}:5672/", "members": members}
        view = views.cluster_view(status, broker, "h", "prod-eu")
        assert api.get(["cluster-name"], view, admin) == reads.Answer(200, {"name": "prod-eu"})
        overview = views.overview_json(view, admin)
        assert (overview["cluster_name"], overview["node"]) == (
            "prod-eu",
            f"cpgbroker@10.0.0.{m}:5672",
        )
        text = metrics.render(metrics.registry_for(lambda v=view: v)).decode()
        [info] = [
            s
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "rabbitmq_identity_info"
        ]
        assert info.labels == {
            "rabbitmq_node": f"cpgbroker@10.0.0.{m}:5672",
            "rabbitmq_cluster": "prod-eu",
        }


async def test_a_failing_route_answers_500_and_the_endpoint_lives_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from cpgbroker.runtime.admin import endpoint

    def broken() -> Broker:
        raise RuntimeError("boom")

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            _h, port = await nursery.start(
                functools.partial(endpoint.serve_admin, replica=broken),
                "127.0.0.1:0",
                lambda _d: {"state": "ready"},
                None,
                "s3",
            )
            base = f"http://127.0.0.1:{port}"
            status, _h2, body = await trio.to_thread.run_sync(
                _get, base + "/api/overview", "Bearer s3"
            )
            assert status == 500 and b"boom" in body
            status, _h2, body = await trio.to_thread.run_sync(_get, base + "/status", "Bearer s3")
            assert status == 200 and b'"ready"' in body
            nursery.cancel_scope.cancel()
    assert any("admin request failed" in r.getMessage() for r in caplog.records)


def test_definitions_export_in_rabbitmqs_format() -> None:
    b = _broker_with_things()
    view = views.cluster_view({"state": "standalone"}, b, "h")
    admin = Identity("admin", ("administrator",), USERS[0])
    defs = reads.ManagementApi().get(["definitions"], view, admin).body
    assert defs["queues"] == [
        {
            "name": "q1",
            "vhost": "/",
            "durable": False,
            "auto_delete": False,
            "arguments": {"x-max-length": 10},
        }
    ]
    assert [x["name"] for x in defs["exchanges"]] == ["ex1"]
    assert defs["bindings"] == [
        {
            "source": "ex1",
            "vhost": "/",
            "destination": "q1",
            "destination_type": "queue",
            "routing_key": "a.#",
            "arguments": {},
        }
    ]
    assert [u["name"] for u in defs["users"]] == [u.name for u in USERS]
    assert [v["name"] for v in defs["vhosts"]] == ["/", "other"]
    assert defs["policies"] == [] and defs["topic_permissions"] == []
    assert reads.needed_tags(["definitions"]) == ADMIN_TAGS

"""RabbitMQ's management HTTP API, the write side, on a real standalone broker with real
clients: users, vhosts, permissions and policies changed at runtime, queues, exchanges,
bindings and messages through HTTP, definitions exported and imported, and what is refused."""

from __future__ import annotations

import base64
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
import trio

from cpgbroker.runtime.mgmt import writes

FIXTURE = Path(__file__).parent.parent / "fixtures" / "rabbitmq-3.10.8-definitions.json"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


GUEST = basic("guest", "guest")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Api:
    def __init__(self, base: str) -> None:
        self.base = base

    def __call__(
        self,
        method: str,
        path: str,
        body: Any = None,
        auth: str | None = GUEST,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if auth:
            hdrs["Authorization"] = auth
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                status, h, raw = resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            status, h, raw = e.code, dict(e.headers), e.read()
        return status, h, json.loads(raw) if raw else None


def _connect(port: int, user: str = "guest", password: str = "guest", vhost: str = "/") -> Any:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1", port, vhost, credentials=pika.PlainCredentials(user, password)
        )
    )


async def _standalone(tmp_path: Path, work: Callable[[Api, int], None]) -> None:
    from cpgbroker.runtime.config import settings
    from cpgbroker.runtime.process import main as runtime_main

    admin_port = _free_port()
    toml = tmp_path / "cpgbroker.toml"
    toml.write_text(
        f'[server]\nlisten = ["127.0.0.1:0"]\nadmin = "127.0.0.1:{admin_port}"\n'
        'admin_token = "s3cret-token"\n'
        '[[users]]\nname = "guest"\npassword = "guest"\nloopback_only = true\n'
        'tags = ["administrator"]\n'
        '[[users]]\nname = "mon"\npassword = "pw-mon"\ntags = ["monitoring"]\n'
    )
    api = Api(f"http://127.0.0.1:{admin_port}")
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(runtime_main.serve, settings.load(str(toml)))
            await trio.to_thread.run_sync(work, api, bound[0][1])
            nursery.cancel_scope.cancel()


async def test_users_vhosts_permissions_change_at_runtime(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cpgbroker")

    def work(api: Api, port: int) -> None:
        # A user added over HTTP logs in over AMQP at once, in a vhost added over HTTP.
        assert api("PUT", "/api/users/ann", {"password": "ann-pw", "tags": "monitoring"})[:1] == (
            201,
        )
        status, _, body = api("GET", "/api/users/ann")
        assert status == 200 and body["tags"] == ["monitoring"]
        assert (
            "ann-pw" not in json.dumps(body) and len(base64.b64decode(body["password_hash"])) == 36
        )
        assert api("PUT", "/api/vhosts/team%2Fa")[0] == 201
        assert api("PUT", "/api/vhosts/team%2Fa")[0] == 204
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError):
            _connect(port, "ann", "ann-pw", "team/a")
        perms = {"configure": "^ann\\.", "write": ".*", "read": ".*"}
        status, _, body = api("PUT", "/api/permissions/team%2Fa/ann", perms)
        assert (status, body) == (201, None)
        conn = _connect(port, "ann", "ann-pw", "team/a")
        ch = conn.channel()
        ch.queue_declare("ann.q")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.queue_declare("other.q")
        assert refused.value.reply_code == 403
        conn.close()
        # Updated, the password changes; deleted, the user no longer logs in.
        assert api("PUT", "/api/users/ann", {"password": "new-pw", "tags": ""})[0] == 204
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            _connect(port, "ann", "ann-pw", "team/a")
        _connect(port, "ann", "new-pw", "team/a").close()
        assert api("DELETE", "/api/users/ann")[0] == 204
        assert api("GET", "/api/users/ann")[0] == 404
        # Deleting a vhost closes its clients (320) and takes its queues.
        conn = _connect(port, "guest", "guest", "team/a")
        assert api("DELETE", "/api/vhosts/team%2Fa")[0] == 204
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            conn.channel()
            conn.process_data_events(1)
        assert closed.value.reply_code == 320
        assert api("GET", "/api/vhosts/team%2Fa")[0] == 404
        # Bulk delete, as RabbitMQ: up to a user that does not exist.
        for name in ("b1", "b2"):
            api("PUT", f"/api/users/{name}", {"password_hash": "", "tags": ""})
        assert api("POST", "/api/users/bulk-delete", {"users": ["b1", "b2"]})[0] == 204
        # What only an administrator may do.
        mon = basic("mon", "pw-mon")
        status, _, body = api("PUT", "/api/users/x", {"password": "p", "tags": ""}, auth=mon)
        assert (status, body["reason"]) == (401, "Not administrator user")
        assert api("GET", "/api/users/x")[0] == 404
        # Malformed requests: RabbitMQ's answers, nothing changed.
        assert api("PUT", "/api/users/y", {"password": "p"})[2] == {
            "error": "bad_request",
            "reason": "tags_not_present",
        }
        both = {"password": "p", "password_hash": "", "tags": ""}
        assert api("PUT", "/api/users/y", both)[0] == 400
        status, _, body = api("PUT", "/api/permissions/nope/guest", perms)
        assert (status, body["reason"]) == (400, "vhost_or_user_not_found")

    await _standalone(tmp_path, work)
    # The password never reaches the log; the refused admin call does.
    assert not any("ann-pw" in m or "new-pw" in m for m in caplog.messages)
    assert any("refused" in m and "user='mon'" in m for m in caplog.messages)


async def test_queues_exchanges_bindings_messages_and_policies_over_http(
    tmp_path: Path,
) -> None:
    def work(api: Api, port: int) -> None:
        q = {"durable": True, "auto_delete": False, "arguments": {}, "vhost": "/"}
        assert api("PUT", "/api/queues/%2F/jobs.a", q)[:3:2] == (201, None)
        assert api("PUT", "/api/queues/%2F/jobs.a", q)[0] == 204
        status, _, body = api("PUT", "/api/queues/%2F/jobs.a", {**q, "durable": False})
        assert status == 400 and "inequivalent arg 'durable'" in body["reason"]
        x = {"type": "topic", "durable": True}
        assert api("PUT", "/api/exchanges/%2F/ev", x)[0] == 201
        status, headers, body = api(
            "POST", "/api/bindings/%2F/e/ev/q/jobs.a", {"routing_key": "a.#", "arguments": {}}
        )
        assert (status, headers["Location"], body) == (201, "jobs.a/a.%2523", None)
        bindings = api("GET", "/api/queues/%2F/jobs.a/bindings")[2]
        assert [b["properties_key"] for b in bindings] == ["jobs.a", "a.%23"]
        # A client consumes what HTTP publishes; HTTP gets what a client publishes.
        conn = _connect(port)
        ch = conn.channel()
        pub = {"routing_key": "a.b", "payload": "hello", "payload_encoding": "string"}
        props = {"properties": {"content_type": "text/plain", "headers": {"n": 1}}}
        assert api("POST", "/api/exchanges/%2F/ev/publish", {**pub, **props})[2] == {"routed": True}
        method, properties, got = ch.basic_get("jobs.a", auto_ack=True)
        assert got == b"hello" and properties.content_type == "text/plain"
        assert properties.headers == {"n": 1}
        ch.basic_publish("", "jobs.a", b"\xff\x00raw")
        get = {"count": 5, "ackmode": "ack_requeue_true", "encoding": "auto", "truncate": 50000}
        status, _, msgs = api("POST", "/api/queues/%2F/jobs.a/get", get)
        assert status == 200 and len(msgs) == 1
        assert msgs[0]["payload_encoding"] == "base64"
        assert base64.b64decode(msgs[0]["payload"]) == b"\xff\x00raw"
        assert msgs[0]["properties"] == [] and msgs[0]["message_count"] == 0
        method, _, got = ch.basic_get("jobs.a", auto_ack=True)
        assert method.redelivered and got == b"\xff\x00raw"
        # A policy set over HTTP applies to queues at once and to those declared later.
        for i in range(10):
            ch.basic_publish("", "jobs.a", b"%d" % i)
        policy = {"pattern": "^jobs\\.", "definition": {"max-length": 3}, "apply-to": "queues"}
        assert api("PUT", "/api/policies/%2F/cap", policy)[0] == 201
        assert api("GET", "/api/queues/%2F/jobs.a")[2]["messages"] == 3
        assert api("GET", "/api/queues/%2F/jobs.a")[2]["policy"] == "cap"
        ch.queue_declare("jobs.b")
        for i in range(5):
            ch.basic_publish("", "jobs.b", b"%d" % i)
        assert ch.queue_declare("jobs.b", passive=True).method.message_count == 3
        assert api("GET", "/api/policies/%2F/cap")[2] == {
            "vhost": "/",
            "name": "cap",
            "pattern": "^jobs\\.",
            "apply-to": "queues",
            "definition": {"max-length": 3},
            "priority": 0,
        }
        status, _, body = api("PUT", "/api/policies/%2F/bad", {**policy, "definition": {"x": 1}})
        assert status == 400 and "are not recognised policy settings" in body["reason"]
        assert api("DELETE", "/api/policies/%2F/cap")[0] == 204
        for i in range(5):
            ch.basic_publish("", "jobs.b", b"%d" % i)
        assert ch.queue_declare("jobs.b", passive=True).method.message_count == 8
        # Purge, unbind, delete; a connection closed over HTTP with its reason.
        assert api("DELETE", "/api/queues/%2F/jobs.b/contents")[0] == 204
        assert ch.queue_declare("jobs.b", passive=True).method.message_count == 0
        assert api("DELETE", "/api/bindings/%2F/e/ev/q/jobs.a/a.%2523")[0] == 204
        assert api("DELETE", "/api/bindings/%2F/e/ev/q/jobs.a/a.%2523")[0] == 404
        assert api("DELETE", "/api/exchanges/%2F/ev")[0] == 204
        assert api("DELETE", "/api/queues/%2F/jobs.a")[0] == 204
        assert api("DELETE", "/api/queues/%2F/jobs.a")[0] == 404
        (listed,) = api("GET", "/api/connections")[2]
        name = urllib.parse.quote(listed["name"], safe="")
        assert api("DELETE", f"/api/connections/{name}", headers={"X-Reason": "bye now"})[0] == 204
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            conn.process_data_events(2)
            ch.basic_get("jobs.b")
        assert closed.value.reply_code == 320 and "bye now" in closed.value.reply_text

    await _standalone(tmp_path, work)


async def test_rabbitmq_definitions_import_and_log_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Definitions exported from a RabbitMQ 3.10.8 node (tests/fixtures, recorded by
    record_rabbitmq_definitions.py) import whole: its users log in with their passwords, its
    topology and policies are there, and our export carries them back in RabbitMQ's format."""
    exported = json.loads(FIXTURE.read_text())

    def work(api: Api, port: int) -> None:
        status, _, body = api("POST", "/api/definitions", exported)
        assert (status, body) == (204, None), body
        ours = api("GET", "/api/definitions")[2]
        for key in ("vhosts", "queues", "exchanges", "bindings", "policies"):
            theirs = {json.dumps(x, sort_keys=True) for x in exported[key]}
            mine = {json.dumps(x, sort_keys=True) for x in ours[key]}
            # Every item of theirs is in ours as they wrote it (ours has the seeded ones too).
            assert theirs - mine == set(), key
        perms = {(p["user"], p["vhost"]) for p in ours["permissions"]}
        assert {(p["user"], p["vhost"]) for p in exported["permissions"]} <= perms
        users = {u["name"]: u for u in ours["users"]}
        for u in exported["users"]:
            assert users[u["name"]]["password_hash"] == u["password_hash"]
            assert users[u["name"]]["tags"] == u["tags"]
        # A user carried over logs in with the password it had on RabbitMQ.
        vhost = next(p["vhost"] for p in exported["permissions"] if p["user"] == "svc-orders")
        _connect(port, "svc-orders", "orders-secret", vhost).close()
        # Importing again changes nothing and is not an error (RabbitMQ keeps what exists).
        assert api("POST", "/api/definitions", exported)[0] == 204
        assert api("POST", "/api/definitions", {})[0] == 204
        status, _, body = api(
            "POST", "/api/definitions", {"users": [{"name": "z", "password": "p"}]}
        )
        assert (status, body["reason"]) == (400, "tags_not_present")

    caplog.set_level(logging.INFO, logger="cpgbroker")
    await _standalone(tmp_path, work)
    # What cpgbroker has no place for is said, not dropped in silence.
    left_out = [m for m in caplog.messages if "definitions import leaves out" in m]
    assert left_out and "1 topic_permissions, 1 parameters" in left_out[0]


def test_large_imports_travel_in_several_commands_in_order() -> None:
    queues = [{"name": f"q{i:05d}", "vhost": "/", "durable": True} for i in range(8000)]
    defs = {"users": [{"name": "u", "password": "pw", "tags": ""}], "queues": queues}
    commands = writes.import_commands(defs, None, "admin")
    assert isinstance(commands, list) and len(commands) > 1
    for c in commands:
        assert len(json.dumps(c.args)) < 2 * writes.IMPORT_CHUNK_BYTES
    got = [q["name"] for c in commands for q in c.args["definitions"].get("queues", [])]
    assert got == [q["name"] for q in queues]
    user = commands[0].args["definitions"]["users"][0]
    assert "password" not in user and user["password_hash"]


def test_renaming_the_cluster_is_refused_saying_the_name_is_the_configurations() -> None:
    """RabbitMQ's ``PUT /api/cluster-name``: ours comes from ``[cluster] name``, which every
    member must share, so no member may change it alone."""
    from cpgbroker.model.broker import Broker
    from cpgbroker.model.config import BrokerConfig
    from cpgbroker.runtime.mgmt.reads import Answer
    from cpgbroker.runtime.mgmt.views import Identity, cluster_view

    view = cluster_view({"state": "ready"}, Broker(BrokerConfig()), "h", "prod")

    def put(identity: Identity, method: str = "PUT") -> Any:
        return writes.command_for(
            method, ["cluster-name"], b'{"name": "other"}', "", {}, identity, view
        )

    refused = put(Identity("admin", ("administrator",)))
    assert refused == Answer(405, {"error": "Method Not Allowed", "reason": refused.body["reason"]})
    assert "[cluster] name in cpgbroker.toml" in refused.body["reason"]
    assert put(Identity("admin", ("administrator",)), "DELETE") == refused
    # As RabbitMQ, only an administrator may ask at all.
    assert put(Identity("ops", ("management",))) == Answer(
        401, {"error": "not_authorised", "reason": "Not administrator user"}
    )

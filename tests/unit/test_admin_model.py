"""Operators' changes as ordered model events (model/operators/admin.py): users, vhosts,
permissions, policies, queues, exchanges, bindings and messages, checked through what AMQP clients
then see, through snapshots and digests, and against malformed requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from pamqp import commands

from cpgbroker.cluster import codec
from cpgbroker.model.access import auth
from cpgbroker.model.access.permissions import TRUSTED
from cpgbroker.model.broker import Broker
from cpgbroker.model.events import AdminCommand, AdminReply
from cpgbroker.model.state import snapshot
from cpgbroker.model.versions import NEWEST, OLDEST
from cpgbroker.store import records
from cpgbroker.wire import fastpath as fp
from cpgbroker.wire.fieldtable import decode_table
from modelclient import Harness

HASH = auth.hash_password("s3cret", b"salt")


class Ops:
    """Admin commands on a harness, numbered, as one member's operator would send them."""

    def __init__(self, h: Harness, member: int = 0) -> None:
        self.h = h
        self.member = member
        self.ticket = 0

    def __call__(self, op: str, as_user: str = TRUSTED, **args: Any) -> tuple[int, Any]:
        self.ticket += 1
        before = len(self.h.effects)
        self.h.apply(AdminCommand(self.member, self.ticket, as_user, op, json.dumps(args).encode()))
        replies = [e for e in self.h.effects[before:] if isinstance(e, AdminReply)]
        assert len(replies) == 1, replies
        r = replies[0]
        assert (r.member, r.ticket) == (self.member, self.ticket)
        return r.status, r.body


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def ops(h: Harness) -> Ops:
    return Ops(h)


def login(h: Harness, conn: int, user: str, password: str, vhost: str = "/") -> Any:
    return h.connect(conn).handshake(user, password, vhost)


def test_a_user_added_logs_in_and_a_deleted_one_no_longer(h: Harness, ops: Ops) -> None:
    assert ops("put_user", name="ann", password_hash=HASH, tags="monitoring") == (201, None)
    assert (
        ops("put_permissions", vhost="/", user="ann", configure=".*", write=".*", read=".*")[0]
        == 201
    )
    assert isinstance(login(h, 1, "ann", "s3cret"), commands.Connection.OpenOk)
    assert h.broker.users.by_name["ann"].tags == ("monitoring",)
    # Updating keeps the permissions (RabbitMQ's put_user).
    assert ops("put_user", name="ann", password_hash=HASH, tags=["administrator"])[0] == 204
    assert isinstance(login(h, 2, "ann", "s3cret"), commands.Connection.OpenOk)
    assert ops("delete_user", name="ann") == (204, None)
    c = h.connect(3)
    reply = c.handshake("ann", "s3cret")
    assert isinstance(reply, commands.Connection.Close) and reply.reply_code == 403
    assert ops("delete_user", name="ann")[0] == 404


def test_permissions_limit_what_a_user_may_touch(h: Harness, ops: Ops) -> None:
    ops("put_user", name="bob", password_hash=HASH, tags="")
    c = h.connect(1)
    reply = c.handshake("bob", "s3cret")
    assert isinstance(reply, commands.Connection.Close) and reply.reply_code == 530
    ops("put_permissions", vhost="/", user="bob", configure="^bob\\.", write=".*", read=".*")
    c = h.connect(2)
    assert isinstance(c.handshake("bob", "s3cret"), commands.Connection.OpenOk)
    c.channel()
    assert isinstance(c.rpc(1, commands.Queue.Declare(queue="bob.q")), commands.Queue.DeclareOk)
    refused = c.rpc(1, commands.Queue.Declare(queue="other"))
    assert isinstance(refused, commands.Channel.Close) and refused.reply_code == 403
    # The API acts with the asking user's permissions too.
    status, body = ops("put_queue", as_user="bob", vhost="/", name="other2")
    assert (status, body) == (401, {"error": "not_authorised", "reason": "Access refused."})
    assert "other2" not in h.broker.vhosts["/"].queues
    assert ops("delete_permissions", vhost="/", user="bob")[0] == 204
    assert ops("delete_permissions", vhost="/", user="bob")[0] == 404


def test_a_vhost_added_serves_and_a_deleted_one_takes_its_clients_and_queues(
    h: Harness, ops: Ops
) -> None:
    assert ops("put_vhost", name="team/a")[0] == 201
    assert ops("put_vhost", name="team/a")[0] == 204
    c = h.connect(1)
    reply = c.handshake(vhost="team/a")
    assert isinstance(reply, commands.Connection.Close) and reply.reply_code == 530
    ops("put_permissions", vhost="team/a", user="guest", configure=".*", write=".*", read=".*")
    c = h.connect(2)
    assert isinstance(c.handshake(vhost="team/a"), commands.Connection.OpenOk)
    c.channel()
    c.rpc(1, commands.Queue.Declare(queue="work"))
    assert ops("delete_vhost", name="team/a") == (204, None)
    closes = [m for m in c.methods() if isinstance(m, commands.Connection.Close)]
    assert closes and closes[0].reply_code == 320
    assert "vhost 'team/a' is deleted" in closes[0].reply_text
    assert "team/a" not in h.broker.vhosts
    assert not h.broker.users.by_name["guest"].may_open("team/a")
    # Made again under the name, it starts empty and without permissions.
    ops("put_vhost", name="team/a")
    assert not h.broker.vhosts["team/a"].queues
    assert ops("delete_vhost", name="nope")[0] == 404


def _declare(h: Harness, conn: int, name: str, **args: Any) -> Any:
    c = h.connect(conn)
    c.handshake()
    c.channel()
    c.rpc(1, commands.Queue.Declare(queue=name, durable=True, arguments=args or None))
    return c


def _depth(h: Harness, name: str) -> int:
    return len(h.broker.vhosts["/"].queues[name].messages)


def test_a_policy_applies_at_once_to_matching_queues_and_goes_when_cleared(
    h: Harness, ops: Ops
) -> None:
    c = _declare(h, 1, "jobs.a")
    _declare(h, 2, "other")
    for i in range(10):
        c.publish(1, "", "jobs.a", b"%d" % i)
        c.publish(1, "", "other", b"%d" % i)
    status, _ = ops(
        "put_policy",
        vhost="/",
        name="cap",
        pattern="^jobs\\.",
        definition={"max-length": 3, "message-ttl": 1000},
        **{"apply-to": "queues"},
    )
    assert status == 201
    q = h.broker.vhosts["/"].queues["jobs.a"]
    # RabbitMQ drops from the head at once when a max-length policy lands.
    assert [e.msg.body for e in q.messages] == [b"7", b"8", b"9"]
    assert q.policy == "cap" and q.ttl == 1000
    assert _depth(h, "other") == 10 and h.broker.vhosts["/"].queues["other"].policy is None
    # A queue declared later gets it too; its own smaller argument holds over the policy.
    _declare(h, 3, "jobs.b", **{"x-max-length": 1})
    assert h.broker.vhosts["/"].queues["jobs.b"].max_length == 1
    _declare(h, 4, "jobs.c", **{"x-max-length": 50})
    assert h.broker.vhosts["/"].queues["jobs.c"].max_length == 3
    assert ops("delete_policy", vhost="/", name="cap") == (204, None)
    assert q.max_length is None and q.ttl is None and q.policy is None
    assert h.broker.vhosts["/"].queues["jobs.c"].max_length == 50


def test_the_highest_priority_policy_wins_and_dead_letter_argument_holds(
    h: Harness, ops: Ops
) -> None:
    ops("put_exchange", vhost="/", name="dlx.p", type="fanout")
    ops("put_exchange", vhost="/", name="dlx.a", type="fanout")
    _declare(h, 1, "q1")
    _declare(h, 2, "q2", **{"x-dead-letter-exchange": "dlx.a"})
    ops("put_policy", vhost="/", name="low", pattern=".*", definition={"max-length": 9})
    ops(
        "put_policy",
        vhost="/",
        name="high",
        pattern="^q",
        priority=5,
        definition={"dead-letter-exchange": "dlx.p", "expires": 60000},
    )
    q1, q2 = (h.broker.vhosts["/"].queues[n] for n in ("q1", "q2"))
    assert (q1.policy, q1.dlx, q1.max_length, q1.expires) == ("high", "dlx.p", None, 60000)
    assert q2.dlx == "dlx.a"  # the queue's own argument holds over the policy's
    assert ("/", "q1") in h.broker.topology.expiring


def test_delivery_limit_policy_applies_to_quorum_queues(h: Harness, ops: Ops) -> None:
    _declare(h, 1, "qq", **{"x-queue-type": "quorum"})
    _declare(h, 2, "classic")
    ops("put_policy", vhost="/", name="dl", pattern=".*", definition={"delivery-limit": 2})
    assert h.broker.vhosts["/"].queues["qq"].delivery_limit == 2
    assert h.broker.vhosts["/"].queues["classic"].delivery_limit is None


@pytest.mark.parametrize(
    ("definition", "reason"),
    [
        # RabbitMQ 3.10.8's texts, HTML escaping included.
        ({"max-length": -1}, "-1 is not a valid maximum length"),
        ({"max-length": "ten"}, '&lt;&lt;"ten"&gt;&gt; is not a valid maximum length'),
        ({"bogus": 1}, '[{&lt;&lt;"bogus"&gt;&gt;,1}] are not recognised policy settings'),
        ({"overflow": "explode"}, '&lt;&lt;"explode"&gt;&gt; is not a valid overflow value'),
        ({}, "no policy provided"),
    ],
)
def test_an_invalid_policy_is_refused_and_changes_nothing(
    h: Harness, ops: Ops, definition: dict[str, Any], reason: str
) -> None:
    digest = snapshot.digest(h.broker)
    status, body = ops("put_policy", vhost="/", name="p", pattern=".*", definition=definition)
    assert status == 400 and reason in body["reason"]
    assert snapshot.digest(h.broker) != ""  # still a whole state
    assert h.broker.policies.all() == []
    # The event counts (every replica applied it), but nothing else changed.
    h2 = Harness()
    Ops(h2)("put_policy", vhost="/", name="p", pattern=".*", definition=definition)
    assert snapshot.digest(h2.broker) == snapshot.digest(h.broker) != digest


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[1, 2]", b'{"name": 5}', b'{"name": "x", "tags": 7}', b'{"a": ' * 5000],
)
def test_malformed_requests_are_400_on_every_replica(raw: bytes) -> None:
    answers = []
    for _ in range(2):
        h = Harness()
        h.apply(AdminCommand(0, 1, TRUSTED, "put_user", raw))
        (reply,) = [e for e in h.effects if isinstance(e, AdminReply)]
        answers.append((reply.status, reply.body, snapshot.digest(h.broker)))
    assert answers[0] == answers[1]
    assert answers[0][0] == 400


def test_unknown_op_is_refused(ops: Ops) -> None:
    status, body = ops("reformat_disk")
    assert status == 400 and "unknown operation" in body["reason"]


def test_queue_exchange_binding_publish_and_get_through_the_api(h: Harness, ops: Ops) -> None:
    assert ops("put_exchange", vhost="/", name="ev", type="topic")[0] == 201
    assert ops("put_queue", vhost="/", name="sink", durable=True)[0] == 201
    status, body = ops(
        "bind",
        vhost="/",
        source="ev",
        destination="sink",
        destination_type="q",
        routing_key="a.#",
    )
    assert status == 201 and body == {"properties_key": "a.%23"}
    assert ops(
        "publish",
        vhost="/",
        name="ev",
        routing_key="a.b",
        payload="hi",
        payload_encoding="string",
        properties={},
    )[1] == {"routed": True}
    assert ops(
        "publish",
        vhost="/",
        name="ev",
        routing_key="z",
        payload="x",
        payload_encoding="string",
        properties={},
    )[1] == {"routed": False}
    ops(
        "publish",
        vhost="/",
        name="ev",
        routing_key="a.c",
        payload="/wE=",
        payload_encoding="base64",
        properties={"content_type": "application/x", "headers": {"k": "v"}, "delivery_mode": 2},
    )
    status, got = ops("get", vhost="/", name="sink", count=5, ackmode="ack_requeue_true")
    assert status == 200 and [m["payload"] for m in got] == ["hi", "/wE="]
    assert got[1]["payload_encoding"] == "base64"
    assert got[1]["properties"] == {
        "content_type": "application/x",
        "headers": {"k": "v"},
        "delivery_mode": 2,
    }
    assert [m["message_count"] for m in got] == [1, 0]
    assert _depth(h, "sink") == 2  # requeued, redelivered
    status, got = ops("get", vhost="/", name="sink", count=1, ackmode="ack_requeue_false")
    assert got[0]["redelivered"] is True and _depth(h, "sink") == 1
    assert ops("purge_queue", vhost="/", name="sink")[0] == 204 and _depth(h, "sink") == 0
    assert (
        ops(
            "unbind",
            vhost="/",
            source="ev",
            destination="sink",
            destination_type="q",
            properties_key="a.%23",
        )[0]
        == 204
    )
    assert ops(
        "publish",
        vhost="/",
        name="ev",
        routing_key="a.b",
        payload="x",
        payload_encoding="string",
        properties={},
    )[1] == {"routed": False}
    assert ops("delete_exchange", vhost="/", name="ev")[0] == 204
    assert ops("delete_queue", vhost="/", name="sink")[0] == 204
    assert ops("delete_queue", vhost="/", name="sink")[0] == 404


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_api_publish_types_header_values_as_rabbitmqs_management_plugin(version: int) -> None:
    """From model version 8 the management API's publish writes JSON numbers as RabbitMQ's
    management plugin does (``rabbit_misc:to_amqp_table``): integers as signed 64-bit ``l``,
    other numbers as doubles ``d``, so 1.1 and 1e308 arrive whole; at 7 as release 0.1.0 did
    (pamqp: 32-bit floats, the smallest integer type)."""
    h = Harness(Broker(version=version))
    ops = Ops(h)
    assert ops("put_queue", vhost="/", name="sink")[0] == 201
    headers = {
        "price": 1.1,
        "big": 1e308,
        "n": 5,
        "s": "x",
        "yes": True,
        "list": [1, 2.5, "y"],
        "table": {"z": 0.1, "a": -7},
    }
    status, body = ops(
        "publish",
        vhost="/",
        name="",
        routing_key="sink",
        payload="m",
        payload_encoding="string",
        properties={"headers": headers, "delivery_mode": 2},
    )
    if version == OLDEST:
        # pamqp cannot write 1e308 as its 32-bit float.
        assert status == 400 and "invalid message properties" in body["reason"]
        del headers["big"]
        status, body = ops(
            "publish",
            vhost="/",
            name="",
            routing_key="sink",
            payload="m",
            payload_encoding="string",
            properties={"headers": headers, "delivery_mode": 2},
        )
    assert (status, body) == (200, {"routed": True})
    (entry,) = h.broker.vhosts["/"].queues["sink"].messages
    header = entry.msg.header
    start, end = fp.property_span(header, fp.FLAG_HEADERS)
    table = decode_table(header, start, end)[0]
    types = {name: chr(f.kind) for name, f in table}
    assert [name for name, _ in table] == sorted(headers)  # in name order, as both write them
    if version == OLDEST:
        assert types == {"list": "A", "n": "b", "price": "f", "s": "S", "table": "F", "yes": "t"}
        price = table.get("price")
        assert price is not None and price.value != 1.1  # cut to 32 bits
        return
    assert types == {
        "big": "d",
        "list": "A",
        "n": "l",
        "price": "d",
        "s": "S",
        "table": "F",
        "yes": "t",
    }
    assert {name: f.value for name, f in table if chr(f.kind) in "dlSt"} == {
        "big": 1e308,
        "n": 5,
        "price": 1.1,
        "s": b"x",
        "yes": True,
    }
    inner = table.get("table")
    assert inner is not None and [(k, chr(f.kind), f.value) for k, f in inner.value] == [  # type: ignore[union-attr]
        ("a", "l", -7),
        ("z", "d", 0.1),
    ]
    items = table.get("list")
    assert items is not None and [(chr(f.kind), f.value) for f in items.value] == [  # type: ignore[union-attr]
        ("l", 1),
        ("d", 2.5),
        ("S", b"y"),
    ]
    # A value JSON has but a table cannot hold is a 400, not an exception of the member.
    status, body = ops(
        "publish",
        vhost="/",
        name="",
        routing_key="sink",
        payload="m",
        payload_encoding="string",
        properties={"headers": {"huge": 2**70}},
    )
    assert status == 400 and "invalid message properties" in body["reason"]


def test_api_declares_answer_as_rabbitmq_does(ops: Ops) -> None:
    ops("put_queue", vhost="/", name="d", durable=True)
    status, body = ops("put_queue", vhost="/", name="d", durable=False)
    assert status == 400
    assert "inequivalent arg 'durable' for queue 'd'" in body["reason"]
    assert ops("put_queue", vhost="/", name="amq.x") == (
        401,
        {"error": "not_authorised", "reason": "Access refused."},
    )
    assert ops("put_queue", vhost="nope", name="x")[0] == 404
    status, body = ops("put_exchange", vhost="/", name="e", type="nonsense")
    assert status == 400 and "unknown exchange type" in body["reason"]
    assert ops("put_queue", vhost="/", name="d", durable=True)[0] == 204


def test_closing_a_connection_through_the_api(h: Harness, ops: Ops) -> None:
    c = h.connect(7)
    c.handshake()
    assert ops("close_connection", conn=7, reason="maintenance") == (204, None)
    close = next(m for m in c.methods() if isinstance(m, commands.Connection.Close))
    assert close.reply_code == 320 and "maintenance" in close.reply_text
    assert ops("close_connection", conn=99)[0] == 404


def test_users_and_policies_are_in_snapshots_and_change_the_digest(h: Harness, ops: Ops) -> None:
    plain = snapshot.digest(h.broker)
    assert plain == snapshot.digest(Broker())
    ops("put_user", name="ann", password_hash=HASH, tags="administrator")
    ops("put_vhost", name="v2")
    ops("put_permissions", vhost="v2", user="ann", configure="", write="x", read=".*")
    ops("put_policy", vhost="/", name="p", pattern="^a", definition={"max-length": 4})
    _declare(h, 1, "a1")
    assert snapshot.digest(h.broker) != plain
    restored = snapshot.restore(snapshot.snapshot(h.broker))
    assert snapshot.digest(restored) == snapshot.digest(h.broker)
    assert list(restored.users.by_name) == ["guest", "ann"]
    assert restored.vhosts["/"].queues["a1"].policy == "p"
    assert restored.policies.all() == h.broker.policies.all()
    # The restored replica goes on alike: a login of the new user works there.
    h2 = Harness(restored)
    assert isinstance(login(h2, 5, "ann", "s3cret", "v2"), commands.Connection.OpenOk)


def test_shadow_answers_count_as_confirms_waiting_for_the_stores(h: Harness) -> None:
    out = h.broker.out
    h.broker.admin.local_member = 1
    Ops(h, member=1)("put_vhost", name="a")
    assert (out.shadow_confirms, out.shadow_durable_confirms) == (0, 0)
    Ops(h, member=2)("put_vhost", name="b")
    assert (out.shadow_confirms, out.shadow_durable_confirms) == (1, 1)


def test_admin_commands_cross_the_wire_and_the_journal_unchanged() -> None:
    ev = AdminCommand(3, 77, "ann", "put_policy", json.dumps({"é": "ü" * 70000}).encode())
    batch = codec.HEADER + codec.encode(ev)
    assert codec.decode_batch(batch, 3) == [ev]
    with pytest.raises(Exception, match="admin command for 3"):
        codec.decode_batch(batch, 4)
    assert records.decode(records.encode(ev)) == (ev, False)
    assert records.decode(records.encode(ev, failed=True)) == (ev, True)


def test_admin_changes_replay_identically_under_other_hash_seeds(tmp_path: Any) -> None:
    script = tmp_path / "replay.py"
    script.write_text(
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from modelclient import Harness\n"
        "from test_admin_model import scripted\n"
        "print(scripted(Harness()))\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    digests = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join([tests, here]))
        out = subprocess.run(
            [sys.executable, str(script), tests], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def scripted(h: Harness) -> str:
    """A run mixing every kind of admin change with client traffic: its final digest."""
    ops = Ops(h)
    ops("put_vhost", name="v")
    for i in range(5):
        ops("put_user", name=f"u{i}", password_hash=HASH, tags=["management", "x"][: i % 3])
        ops("put_permissions", vhost="v", user=f"u{i}", configure=".*", write=".*", read=".*")
    for i in range(4):
        ops(
            "put_policy",
            vhost="/",
            name=f"p{i}",
            pattern=f"q{i}",
            priority=i,
            definition={"max-length": 10 - i, "message-ttl": 1000 * i},
        )
    c = _declare(h, 1, "q1")
    _declare(h, 2, "q2", **{"x-max-length": 2})
    for i in range(20):
        c.publish(1, "", f"q{1 + i % 2}", b"m%d" % i)
    ops("delete_policy", vhost="/", name="p2")
    ops("delete_user", name="u3")
    ops("import_definitions", definitions={"queues": [{"name": "imp", "vhost": "v"}]})
    return snapshot.digest(h.broker)


def test_a_get_changes_every_replica_alike_and_only_the_asker_builds_the_answer() -> None:
    replicas = [Harness(), Harness()]
    replicas[0].broker.admin.local_member = 1  # the asking member's replica
    replicas[1].broker.admin.local_member = 2
    bodies = []
    for h in replicas:
        ops = Ops(h, member=1)
        ops("put_queue", vhost="/", name="q")
        for i in range(3):
            ops(
                "publish",
                vhost="/",
                name="",
                routing_key="q",
                payload=f"m{i}",
                payload_encoding="string",
                properties={},
            )
        bodies.append(ops("get", vhost="/", name="q", count=2, ackmode="ack_requeue_false"))
    assert [m["payload"] for m in bodies[0][1]] == ["m0", "m1"]
    assert bodies[1] == (200, [])
    assert snapshot.digest(replicas[0].broker) == snapshot.digest(replicas[1].broker)
    assert _depth(replicas[0], "q") == 1


def test_guest_stays_loopback_only_when_its_password_changes(h: Harness, ops: Ops) -> None:
    assert ops("put_user", name="guest", password_hash=HASH, tags="administrator")[0] == 204
    assert h.broker.users.by_name["guest"].loopback_only
    c = h.connect(9, loopback=False)
    reply = c.handshake("guest", "s3cret")
    assert isinstance(reply, commands.Connection.Close) and reply.reply_code == 403

"""Federation's replicated side (model/federation.py, model/operators/admin.py): upstreams as
runtime parameters, links picked by policy, links' reported states, forwarded messages, a peer with
this cluster's own server id refused; all through snapshots, the wire and the journal."""

from __future__ import annotations

import pytest
from pamqp import commands
from pamqp import header as pheader
from test_admin_model import Ops

from cpgbroker.cluster import codec
from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig
from cpgbroker.model.events import AdminReply, Forward
from cpgbroker.model.state import snapshot
from cpgbroker.store import records
from modelclient import Harness

UP = {"uri": ["amqp://u:p@10.0.0.1:5672/", "amqp://u:p@10.0.0.2:5672/"], "max-hops": 2}


def _header(size: int, **props: object) -> bytes:
    return bytes(pheader.ContentHeader(0, size, commands.Basic.Properties(**props)).marshal())


def _links(b: Broker) -> list[tuple[str, str, str]]:
    return [link.key for link in b.federation.links(b.vhosts, b.policies.definition_of)]


def test_an_upstream_and_a_policy_make_a_link_per_federated_exchange() -> None:
    h = Harness()
    ops = Ops(h)
    assert ops(
        "put_parameter", component="federation-upstream", vhost="/", name="central", value=UP
    ) == (201, None)
    ops("put_exchange", vhost="/", name="events", type="topic", durable=True)
    ops("put_exchange", vhost="/", name="local.only", type="fanout")
    assert _links(h.broker) == []
    policy = {"federation-upstream-set": "all"}
    assert (
        ops(
            "put_policy",
            vhost="/",
            name="fed",
            pattern="^events$",
            definition=policy,
            **{"apply-to": "exchanges"},
        )[0]
        == 201
    )
    assert _links(h.broker) == [("/", "events", "central")]
    # An exchange declared later under a matching name is federated too; a second upstream
    # adds a link per exchange.
    ops(
        "put_parameter",
        component="federation-upstream",
        vhost="/",
        name="edge",
        value={"uri": "amqp://10.0.9.9/"},
    )
    assert _links(h.broker) == [("/", "events", "central"), ("/", "events", "edge")]
    link = h.broker.federation.links(h.broker.vhosts, h.broker.policies.definition_of)[0]
    assert link.upstream.uris == tuple(UP["uri"]) and link.upstream.max_hops == 2
    assert (
        ops("delete_parameter", component="federation-upstream", vhost="/", name="edge")[0] == 204
    )
    assert _links(h.broker) == [("/", "events", "central")]
    assert ops("delete_policy", vhost="/", name="fed")[0] == 204
    assert _links(h.broker) == []


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"uri": "http://x/"}, "is not an amqp:// or amqps:// URI"),
        ({"uri": []}, "uri must be a URI or a non-empty list"),
        ({"uri": "amqp://x/", "ack-mode": "maybe"}, "ack-mode must be one of"),
        ({"uri": "amqp://x/", "max-hops": 0}, "max-hops must be an integer of at least 1"),
        ("amqp://x/", "value must be a JSON object"),
    ],
)
def test_a_bad_upstream_is_refused_and_changes_nothing(value: object, reason: str) -> None:
    h = Harness()
    before = snapshot.digest(h.broker)
    status, body = Ops(h)(
        "put_parameter", component="federation-upstream", vhost="/", name="x", value=value
    )
    assert status == 400 and reason in body["reason"]
    assert h.broker.federation.all() == []
    # Only the event count moved.
    h2 = Harness()
    Ops(h2)("put_parameter", component="federation-upstream", vhost="/", name="x", value=value)
    assert snapshot.digest(h2.broker) == snapshot.digest(h.broker) != before


def test_only_a_member_reports_a_links_state() -> None:
    h = Harness()
    ops = Ops(h)
    state = {"status": "running", "member": 3, "uri": "amqp://10.0.0.1:5672/"}
    assert ops("federation_status", vhost="/", exchange="e", upstream="u", state=state)[0] == 204
    assert h.broker.federation.status[("/", "e", "u")] == state
    status, _ = ops(
        "federation_status",
        as_user="guest",
        vhost="/",
        exchange="e",
        upstream="u",
        state={"status": "forged"},
    )
    assert status == 401 and h.broker.federation.status[("/", "e", "u")] == state


def test_forwarded_messages_are_routed_in_order_and_answered() -> None:
    h = Harness()
    ops = Ops(h, member=2)
    ops("put_exchange", vhost="/", name="events", type="topic")
    ops("put_queue", vhost="/", name="sink")
    ops(
        "bind",
        vhost="/",
        source="events",
        destination="sink",
        destination_type="q",
        routing_key="a.*",
    )
    good = _header(3, headers={"x-received-from": [{"cluster-name": "central"}]})
    msgs = tuple(
        (rk, header, body, body, False)
        for rk, header, body in (
            ("a.x", good, b"one"),
            ("b.x", _header(3), b"two"),
            ("a.y", b"\x00garbage", b"bad"),
            ("a.z", _header(5), b"three"),
        )
    )
    before = len(h.effects)
    h.apply(Forward(2, 99, "/", "events", "central", msgs))
    (reply,) = [e for e in h.effects[before:] if isinstance(e, AdminReply)]
    assert (reply.member, reply.ticket, reply.status) == (2, 99, 200)
    assert reply.body == {"routed": 2, "duplicates": 0}
    q = h.broker.vhosts["/"].queues["sink"]
    assert [e.msg.body for e in q.messages] == [b"one", b"three"]
    assert q.messages[0].msg.header == good  # the header as the link made it, byte for byte
    before = len(h.effects)
    h.apply(Forward(2, 100, "/", "nope", "central", msgs))
    (reply,) = [e for e in h.effects[before:] if isinstance(e, AdminReply)]
    assert reply.status == 404


def test_a_peer_with_our_server_id_is_refused_at_its_handshake() -> None:
    h = Harness(Broker(BrokerConfig(server_id="central")))
    c = h.connect(1)
    c.send_raw(b"AMQP\x00\x00\x09\x01")
    start = c.methods()[-1]
    assert start.server_properties["cpgbroker_server_id"] == "central"
    reply = c.rpc(
        0,
        commands.Connection.StartOk(
            client_properties={"cpgbroker_server_id": "central"},
            mechanism="PLAIN",
            response="\0guest\0guest",
        ),
    )
    assert isinstance(reply, commands.Connection.Close) and reply.reply_code == 530
    assert "duplicate server id 'central'" in reply.reply_text
    # Another id is let in as any client.
    c2 = h.connect(2)
    c2.send_raw(b"AMQP\x00\x00\x09\x01")
    c2.methods()
    tune = c2.rpc(
        0,
        commands.Connection.StartOk(
            client_properties={"cpgbroker_server_id": "edge"},
            mechanism="PLAIN",
            response="\0guest\0guest",
        ),
    )
    assert isinstance(tune, commands.Connection.Tune)


def test_federation_state_survives_snapshots_the_wire_and_the_journal() -> None:
    h = Harness()
    ops = Ops(h)
    ops("put_parameter", component="federation-upstream", vhost="/", name="central", value=UP)
    ops(
        "federation_status",
        vhost="/",
        exchange="e",
        upstream="central",
        state={"status": "error", "error": "connection refused"},
    )
    restored = snapshot.restore(snapshot.snapshot(h.broker))
    assert snapshot.digest(restored) == snapshot.digest(h.broker)
    assert restored.federation.all() == h.broker.federation.all()
    assert restored.federation.status == h.broker.federation.status
    # A state without federation snapshots as before it existed.
    assert "federation" not in snapshot.snapshot(Broker())[0]
    ev = Forward(
        7,
        1,
        "/",
        "événements",
        "up",
        (("k", _header(2), b"\x00\xff", b"d" * 16, True), ("", b"", b"", b"", False)),
    )
    assert codec.decode_batch(codec.HEADER + codec.encode(ev), 7) == [ev]
    with pytest.raises(Exception, match="link"):
        codec.decode_batch(codec.HEADER + codec.encode(ev), 8)
    with pytest.raises(Exception, match="truncated"):
        codec.decode_batch(codec.HEADER + codec.encode(ev)[:-3], 7)
    assert records.decode(records.encode(ev)) == (ev, False)


def test_redeliveries_of_what_a_link_handed_over_are_dropped_on_every_replica() -> None:
    """A runner dies after handing a batch over and before acknowledging it upstream: the
    upstream redelivers it to the next runner, and the cluster drops those it has. A first
    delivery of an equal message is a new message and stays; the window is replicated."""
    replicas = [Harness(), Harness()]
    for h in replicas:
        ops = Ops(h, member=2)
        ops("put_queue", vhost="/", name="sink")

    def batch(ticket: int, items: list[tuple[bytes, bool]]) -> Forward:
        return Forward(
            2,
            ticket,
            "/",
            "",
            "central",
            tuple(
                ("sink", _header(len(b)), b, b"id-" + b, redelivered) for b, redelivered in items
            ),
        )

    answers = []
    for h in replicas:
        h.apply(batch(101, [(b"1", False), (b"2", False), (b"3", False)]))
        # The next runner gets 2 and 3 again (redelivered), then 4; and a new "1" published
        # upstream again (not redelivered) is a message of its own.
        h.apply(batch(102, [(b"2", True), (b"3", True), (b"4", False), (b"1", False)]))
        answers.append(
            [e.body for e in h.effects if isinstance(e, AdminReply) and e.ticket in (101, 102)]
        )
    assert (
        answers[0]
        == answers[1]
        == [
            {"routed": 3, "duplicates": 0},
            {"routed": 2, "duplicates": 2},
        ]
    )
    q = replicas[0].broker.vhosts["/"].queues["sink"]
    assert [e.msg.body for e in q.messages] == [b"1", b"2", b"3", b"4", b"1"]
    assert snapshot.digest(replicas[0].broker) == snapshot.digest(replicas[1].broker)
    # A replica restored from a snapshot (a newcomer that runs the link next) knows them too.
    restored = Harness(snapshot.restore(snapshot.snapshot(replicas[0].broker)))
    restored.apply(batch(103, [(b"4", True), (b"5", True)]))
    assert [e.body for e in restored.effects if isinstance(e, AdminReply)] == [
        {"routed": 1, "duplicates": 1}
    ]


def test_the_window_forgets_the_oldest() -> None:
    from cpgbroker.model.federation import Seen

    seen = Seen(window=3)
    for d in (b"a", b"b", b"c", b"d"):
        assert seen.fresh(d, False)
    assert list(seen.digests) == [b"b", b"c", b"d"]
    assert seen.fresh(b"a", True)  # forgotten: forwarded again rather than lost
    assert not seen.fresh(b"c", True)


def test_a_pushing_link_queues_local_publishes_until_the_upstream_confirmed_them() -> None:
    h = Harness()
    ops = Ops(h, member=1)
    value = {"uri": "amqp://10.0.0.1/", "push": True}
    assert ops(
        "put_parameter", component="federation-upstream", vhost="/", name="central", value=value
    ) == (201, None)
    assert h.broker.federation.all()[0].push
    ops("put_exchange", vhost="/", name="events", type="topic", durable=True)
    ops("put_queue", vhost="/", name="sink")
    ops("bind", vhost="/", source="events", destination="sink", destination_type="q",
        routing_key="a.*")  # fmt: skip
    ops("put_policy", vhost="/", name="fed", pattern="^events$",
        definition={"federation-upstream": "central"}, **{"apply-to": "exchanges"})  # fmt: skip
    (link,) = h.broker.federation.links(h.broker.vhosts, h.broker.policies.definition_of)
    assert link.push_queue == "federation-push: events -> central"
    # Before the link's runner declared its push queue, nothing is kept for the upstream.
    c = h.connect(1)
    c.handshake()
    c.channel()
    c.publish(1, "events", "a.early", b"early")
    assert ops("put_queue", vhost="/", name=link.push_queue, durable=True)[0] == 201
    push = h.broker.vhosts["/"].queues[link.push_queue]
    assert len(push.messages) == 0
    # A client's publish and an operator's go to the push queue too, whatever their routing
    # key (as if bound with every key); one the link brought in from upstream does not.
    c.publish(1, "events", "a.x", b"one")
    c.publish(1, "events", "unbound", b"two")
    ops("publish", vhost="/", name="events", routing_key="b.y", payload="three",
        payload_encoding="string", properties={})  # fmt: skip
    h.apply(Forward(1, 500, "/", "events", "central", (("a.up", _header(4), b"from", b"", False),)))
    assert [e.msg.body for e in push.messages] == [b"one", b"two", b"three"]
    sink = h.broker.vhosts["/"].queues["sink"]
    assert [e.msg.body for e in sink.messages] == [b"early", b"one", b"from"]
    # The upstream confirmed the first two: they leave; only a member may say so.
    first_two = push.messages[1].msg.id
    args = {"vhost": "/", "exchange": "events", "upstream": "central", "upto": first_two}
    assert ops("federation_pushed", as_user="guest", **args)[0] == 401
    assert ops("federation_pushed", **args) == (200, {"removed": 2})
    assert [e.msg.body for e in push.messages] == [b"three"]
    assert push.ready_bytes == len(b"three")
    assert ops("federation_pushed", **{**args, "upstream": "nope"})[0] == 404
    # The push flag, and what waits, are in snapshots.
    restored = snapshot.restore(snapshot.snapshot(h.broker))
    assert snapshot.digest(restored) == snapshot.digest(h.broker)
    assert restored.federation.all()[0].push
    assert [e.msg.body for e in restored.vhosts["/"].queues[link.push_queue].messages] == [b"three"]
    # An upstream without push keeps nothing here.
    ops("put_parameter", component="federation-upstream", vhost="/", name="central",
        value={"uri": "amqp://10.0.0.1/"})  # fmt: skip
    c.publish(1, "events", "a.z", b"four")
    assert [e.msg.body for e in push.messages] == [b"three"]
    assert ops("put_parameter", component="federation-upstream", vhost="/", name="x",
               value={"uri": "amqp://h/", "push": "yes"})[0] == 400  # fmt: skip

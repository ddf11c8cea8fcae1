"""Pure cluster logic: the CPG event codec, membership decisions and checkpoint voting."""

import pytest

from cpgbroker.cluster import codec
from cpgbroker.cluster.checkpoint import Checkpoints
from cpgbroker.cluster.codec import STATUS_NEW, STATUS_READY, Checkpoint, Hello
from cpgbroker.cluster.membership import (
    READY,
    ApplyToModel,
    BecomeReady,
    Fatal,
    Membership,
    NeedUpdate,
    SendHello,
    StartAt,
)
from cpgbroker.errors import ClusterError
from cpgbroker.model.events import (
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    ClusterMembers,
    DoOutput,
    MemberLeft,
    Tick,
)

M = 7 << 22 | 1234
DIGEST = b"d" * 32


def test_batch_round_trip_keeps_order_and_content() -> None:
    conn = codec.conn_id(M, 5)
    events = [
        ClientConnected(conn, M, "[::1]:4000", True),
        ClientData(conn, b"\x01\x02" * 1000),
        DoOutput(conn, 64),
        CloseClient(conn, 320, "bye"),
        ClientDisconnected(conn, "gone é"),
        Tick(1_700_000_000_123),
        Hello(M, STATUS_READY, 1, DIGEST, "amqp://10.0.0.1:5672/", "cpgbroker 0.1.0", 1234567),
        Checkpoint(M, 10_000, DIGEST),
    ]
    blob = codec.HEADER + b"".join(codec.encode(e) for e in events)
    assert codec.decode_batch(blob, M) == events


def test_a_member_cannot_speak_for_another_members_clients() -> None:
    blob = codec.HEADER + codec.encode(ClientData(codec.conn_id(M, 1), b"x"))
    with pytest.raises(ClusterError):
        codec.decode_batch(blob, M + 1)


@pytest.mark.parametrize("cut", [3, 10, 20])
def test_truncated_batches_are_cluster_errors(cut: int) -> None:
    blob = codec.HEADER + codec.encode(ClientData(codec.conn_id(M, 1), b"hello world"))
    with pytest.raises(ClusterError):
        codec.decode_batch(blob[:cut], M)


def hello(m: int, status: int = STATUS_NEW, digest: bytes = DIGEST, version: int = 1) -> Hello:
    return Hello(m, status, version, digest, f"amqp://m{m}/", "x", 1000 * m)


def start(me: int, size: int = 3) -> Membership:
    return Membership(me, size, 1, DIGEST, f"amqp://m{me}/")


def test_members_starting_together_become_ready_at_the_same_event() -> None:
    views = {m: start(m) for m in (1, 2, 3)}
    # The ordered stream every member sees (members join one by one).
    # After every configuration change each joining member announces itself again.
    stream = [
        ("conf", [1], [1], []),
        ("hello", 1),
        ("conf", [1, 2], [2], []),
        ("hello", 2),
        ("hello", 1),
        ("conf", [1, 2, 3], [3], []),
        ("hello", 3),
        ("hello", 1),
        ("hello", 2),
    ]
    ready_at: dict[int, int] = {}
    for m, view in views.items():
        joined = False
        for i, item in enumerate(stream):
            if item[0] == "conf":
                if not joined and m not in item[2]:
                    continue
                joined = True
                acts = view.on_confchg(item[1], item[2], item[3])
            else:
                if not joined:
                    continue
                acts = view.on_hello(hello(item[1]))
            if any(isinstance(a, BecomeReady) for a in acts):
                ready_at[m] = i
    assert ready_at == {1: 8, 2: 8, 3: 8}
    # Cluster time starts at the latest hello clock, before anything else reaches the model.
    assert all(v.state == READY for v in views.values())
    assert views[2].clock_master == 1
    assert views[3].urls() == ("amqp://m1/", "amqp://m2/", "amqp://m3/")


def test_newcomer_to_a_serving_cluster_needs_an_update() -> None:
    view = start(4)
    assert view.on_confchg([1, 2, 4], [4], []) == [SendHello(STATUS_NEW)]
    assert view.on_hello(hello(4)) == []
    acts = view.on_hello(hello(1, STATUS_READY))
    assert isinstance(acts[0], NeedUpdate)


def test_incompatible_cluster_refuses_the_newcomer_with_a_reason() -> None:
    view = start(4)
    view.on_confchg([1, 4], [4], [])
    [fatal] = view.on_hello(hello(1, STATUS_READY, version=2))
    assert isinstance(fatal, Fatal) and "model version 2" in fatal.reason


def test_ready_member_answers_joins_and_reports_leaves_to_the_model() -> None:
    view = start(1, size=2)
    view.on_confchg([1], [1], [])
    view.on_hello(hello(1))
    view.on_confchg([1, 2], [2], [])
    assert view.on_hello(hello(2)) == []  # member 1 has not re-announced in this config
    assert any(isinstance(a, BecomeReady) for a in view.on_hello(hello(1)))
    assert view.on_confchg([1, 2, 3], [3], []) == [SendHello(STATUS_READY)]
    acts = view.on_confchg([1, 3], [], [2])
    assert ApplyToModel(MemberLeft(2)) in acts
    assert ApplyToModel(ClusterMembers(("amqp://m1/",))) in acts


def test_clock_master_passes_to_the_next_lowest_member() -> None:
    view = start(2, size=2)
    view.on_confchg([1, 2], [2], [])
    view.on_hello(hello(1))
    view.on_hello(hello(2))
    assert view.clock_master == 1
    view.on_confchg([2], [], [1])
    assert view.clock_master == 2


def test_checkpoints_agree_or_the_majority_wins() -> None:
    cp = Checkpoints()
    assert cp.record(100, 1, b"a", [1, 2, 3]) is None
    assert cp.record(100, 2, b"a", [1, 2, 3]) is None
    v = cp.record(100, 3, b"a", [1, 2, 3])
    assert v is not None and v.agreed and v.losers == ()
    cp.record(200, 1, b"a", [1, 2, 3])
    cp.record(200, 2, b"b", [1, 2, 3])
    v = cp.record(200, 3, b"b", [1, 2, 3])
    assert v is not None and not v.agreed and v.winner == b"b" and v.losers == (1,)


def test_checkpoint_tie_goes_to_the_lowest_member_and_leavers_do_not_block() -> None:
    cp = Checkpoints()
    cp.record(5, 2, b"x", [1, 2])
    v = cp.record(5, 1, b"y", [1, 2])
    assert v is not None and v.winner == b"y" and v.losers == (2,)
    cp.record(6, 1, b"z", [1, 2, 3])
    cp.record(6, 2, b"z", [1, 2, 3])
    [v] = cp.members_changed([1, 2])
    assert v.agreed and v.seq == 6


def test_cluster_time_starts_before_any_client_event_at_the_latest_hello_clock() -> None:
    view = start(1, size=2)
    view.on_confchg([1, 2], [1], [])
    view.on_hello(hello(2))  # clock 2000
    acts = view.on_hello(hello(1))  # clock 1000
    # (At the one model version both members apply: this view's tests run at version 1.)
    assert acts[0] == StartAt(1)
    assert acts[1] == ApplyToModel(Tick(2000))
    assert isinstance(acts[2], BecomeReady)


def test_update_request_round_trips_and_only_the_newcomer_may_ask() -> None:
    req = codec.UpdateRequest(M, M + 1, "127.0.0.1:40000", b"t" * 16)
    blob = codec.HEADER + codec.encode(req)
    assert codec.decode_batch(blob, M) == [req]
    with pytest.raises(ClusterError):
        codec.decode_batch(blob, M + 2)
    with pytest.raises(ClusterError):
        codec.decode_batch(blob[:-3], M)


def test_updated_newcomer_adopts_the_view_and_serves_from_its_ready_hello() -> None:
    """The updater's view at the update point becomes the newcomer's; from there both follow
    the stream alike, and the newcomer's ready hello changes the member list everywhere at
    the same point."""
    old = start(1, size=2)
    old.on_confchg([1], [1], [])
    old.on_hello(hello(1))
    old.on_confchg([1, 2], [2], [])
    old.on_hello(hello(2))
    old.on_hello(hello(1))
    assert old.state == READY
    assert old.on_confchg([1, 2, 4], [4], []) == [SendHello(STATUS_READY)]
    new = start(4)
    new.on_confchg([1, 2, 4], [4], [])
    assert isinstance(new.on_hello(hello(1, STATUS_READY))[0], NeedUpdate)
    old.on_hello(hello(4))
    new.on_hello(hello(4))
    new.adopt(old.export())
    assert new.state == READY and new.export() == old.export()
    assert new.ready_members == [1, 2]
    # A ready member leaving: both report it to the model at the same point.
    assert new.on_confchg([1, 4], [], [2]) == old.on_confchg([1, 4], [], [2])
    # The newcomer's ready hello: both add its URL; only the newcomer starts serving.
    acts_old = old.on_hello(hello(4, STATUS_READY))
    acts_new = new.on_hello(hello(4, STATUS_READY))
    assert acts_old == [ApplyToModel(ClusterMembers(("amqp://m1/", "amqp://m4/")))]
    assert acts_new == [*acts_old, BecomeReady()]
    assert old.export() == new.export()
    # A second ready hello (an answer to a later join) changes nothing.
    assert old.on_hello(hello(4, STATUS_READY)) == []

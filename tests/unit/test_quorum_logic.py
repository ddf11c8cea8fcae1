"""Pure quorum logic: per-ring verdicts from votequorum's notifications, which CPG ring changes
are held for a verdict, and which kept state the cluster resumes after it lost quorum as a
whole."""

from __future__ import annotations

from cpgbroker.cluster import codec
from cpgbroker.cluster.codec import STATUS_NEW, STATUS_READY, Hello
from cpgbroker.cluster.membership import (
    NEEDS_UPDATE,
    READY,
    ApplyToModel,
    BecomeReady,
    Membership,
    NeedUpdate,
    ResumeState,
    StartAt,
)
from cpgbroker.cluster.quorum import (
    HOLD,
    MAX_VERDICTS,
    SERVE,
    STOP,
    QuorumView,
    decide,
    ring_change,
)
from cpgbroker.corosync.events import ConfChg, MemberChange, Reason
from cpgbroker.model.events import ClusterMembers, Tick

DIGEST = b"d" * 32
NODEDOWN, NODEUP, JOIN, LEAVE = Reason.NODEDOWN, Reason.NODEUP, Reason.JOIN, Reason.LEAVE


def change(*reasons: Reason) -> ConfChg:
    """A configuration change with one member changing for each reason: those that went
    (LEAVE, NODEDOWN) left, the others joined."""
    ch = [MemberChange(n, 100 + n, r) for n, r in enumerate(reasons, 1)]
    left = tuple(c for c in ch if c.reason in (LEAVE, NODEDOWN))
    joined = tuple(c for c in ch if c not in left)
    return ConfChg(b"g", tuple(c.member for c in joined), left, joined)


def test_the_quorum_notification_after_a_nodelist_is_that_rings_verdict() -> None:
    v = QuorumView()
    assert v.verdict((1, 13)) is None
    v.on_nodelist((1, 13))
    assert v.verdict((1, 13)) is None  # the ring is known, its verdict not yet
    v.on_quorum(True)
    assert v.verdict((1, 13)) is True and v.quorate
    v.on_nodelist((3, 17))
    v.on_quorum(False)
    assert v.verdict((3, 17)) is False and not v.quorate
    assert v.verdict((1, 13)) is True  # history: a lagging CPG stream may still need it


def test_a_ring_superseded_before_its_verdict_never_counts_as_quorate() -> None:
    v = QuorumView()
    v.on_nodelist((1, 20))
    v.on_quorum(True)
    assert v.verdict((2, 16)) is False  # older than a ring with a verdict, never confirmed
    assert v.verdict((2, 24)) is None  # newer: wait for it


def test_quorum_lost_within_a_ring_overrides_its_verdict() -> None:
    v = QuorumView()
    v.on_nodelist((1, 8))
    v.on_quorum(True)
    v.on_quorum(False)  # expected votes raised by an operator: no new ring
    assert v.verdict((1, 8)) is False and not v.quorate


def test_verdict_history_is_bounded() -> None:
    v = QuorumView()
    for seq in range(4, 4 * (MAX_VERDICTS + 10), 4):
        v.on_nodelist((1, seq))
        v.on_quorum(True)
    assert len(v.verdicts) == MAX_VERDICTS
    assert v.verdict((1, 4)) is False  # forgotten and old: never treated as quorate


def test_only_ring_changes_are_held_and_only_a_quorate_verdict_serves() -> None:
    assert ring_change(change(NODEDOWN))
    assert ring_change(change(JOIN, NODEUP))
    assert ring_change(change(LEAVE, NODEUP))
    assert not ring_change(change(JOIN))
    assert not ring_change(change(LEAVE))
    assert not ring_change(change())
    assert decide(None) == HOLD and decide(True) == SERVE and decide(False) == STOP


def test_hello_carries_the_kept_state_on_the_wire() -> None:
    m = 3 << 22 | 99
    h = Hello(
        m, STATUS_NEW, 1, DIGEST, "amqp://x/", "cpgbroker", 5, recover_epoch=17, recover_seq=420
    )
    assert codec.decode_batch(codec.HEADER + codec.encode(h), m) == [h]


def hello(m: int, ring: int = 0, seq: int = 0, status: int = STATUS_NEW) -> Hello:
    return Hello(m, status, 1, DIGEST, f"amqp://m{m}/", "x", 1000 * m, ring, seq)


def rejoin(me: int, kept: dict[int, tuple[int, int]]) -> list[object]:
    """Members 1..3 rejoin after the whole cluster lost quorum; ``me``'s actions at the point
    where the last hello is delivered."""
    view = Membership(me, 3, 1, DIGEST, f"amqp://m{me}/")
    view.on_confchg([1, 2, 3], [1, 2, 3], [])
    actions: list[object] = []
    for m in (1, 2, 3):
        actions = list(view.on_hello(hello(m, *kept.get(m, (0, 0)))))
    return actions


def test_after_a_cluster_wide_quorum_loss_the_newest_kept_state_resumes() -> None:
    # Member 2 was in the latest quorate ring; member 3 applied more events, but in an older ring.
    kept = {1: (13, 500), 2: (17, 80), 3: (13, 900)}
    assert rejoin(2, kept) == [
        ResumeState(3000),
        BecomeReady(),
        ApplyToModel(ClusterMembers(("amqp://m2/",))),
    ]
    for me in (1, 3):
        actions = rejoin(me, kept)
        assert len(actions) == 1 and isinstance(actions[0], NeedUpdate)
        assert "member 2 resumes" in actions[0].reason
        # Member 3 holds more events than member 2, of an earlier epoch: the log says so.
        assert "is of an earlier history epoch and is replaced" in actions[0].reason


def reason(actions: list[object]) -> str:
    (need,) = actions
    assert isinstance(need, NeedUpdate)
    return need.reason


def test_kept_states_tie_on_ring_then_events_then_lowest_id() -> None:
    assert isinstance(rejoin(3, {1: (13, 5), 3: (13, 6)})[0], ResumeState)
    assert isinstance(rejoin(1, {1: (13, 6), 3: (13, 6)})[0], ResumeState)
    assert isinstance(rejoin(3, {1: (13, 6), 3: (13, 6)})[0], NeedUpdate)
    # Why the member takes an update is said truly: an equal state is not called older.
    assert reason(rejoin(3, {1: (13, 6), 3: (13, 6)})).endswith(
        "its own kept state (epoch 13, event 6) is just as fresh (of equals the lowest member "
        "id resumes) and is replaced"
    )
    assert reason(rejoin(1, {1: (13, 5), 3: (13, 6)})).endswith(
        "its own kept state (epoch 13, event 5) is older and is replaced"
    )
    assert reason(rejoin(2, {1: (13, 5), 3: (13, 6)})).endswith("it has no kept state")


def test_members_that_take_an_update_from_the_resumer_wait_for_it() -> None:
    view = Membership(1, 3, 1, DIGEST, "amqp://m1/")
    view.on_confchg([1, 2, 3], [1, 2, 3], [])
    for m in (1, 2, 3):
        view.on_hello(hello(m, 13, 10 if m == 2 else 5))
    assert view.state == NEEDS_UPDATE and view.ready_members == [2]


def test_without_kept_state_the_cluster_starts_empty_as_before() -> None:
    actions = rejoin(1, {})
    assert actions == [
        StartAt(1),
        ApplyToModel(Tick(3000)),
        BecomeReady(),
        ApplyToModel(ClusterMembers(("amqp://m1/", "amqp://m2/", "amqp://m3/"))),
    ]


def test_a_ready_member_still_wins_over_kept_state() -> None:
    # A serving member exists (it never lost quorum): the kept state is never resumed.
    view = Membership(3, 3, 1, DIGEST, "amqp://m3/")
    view.on_confchg([1, 2, 3], [3], [])
    actions = view.on_hello(hello(1, status=STATUS_READY))
    assert len(actions) == 1 and isinstance(actions[0], NeedUpdate)
    assert view.state == NEEDS_UPDATE and view.state != READY


def test_with_recover_with_majority_two_of_three_stores_decide_a_restart() -> None:
    # Members 1 and 2 are back with their stores; 3 is not (yet). The freshest of the two
    # resumes at the event where the second hello is delivered.
    for me, expect in ((1, NeedUpdate), (2, ResumeState)):
        view = Membership(me, 3, 1, DIGEST, f"amqp://m{me}/", recover_quorum=2)
        view.on_confchg([1, 2], [1, 2], [])
        assert view.on_hello(hello(1, 1, 400)) == []
        actions = view.on_hello(hello(2, 1, 410))
        assert isinstance(actions[0], expect), actions
    # Without kept state (a first start), all three are still waited for.
    view = Membership(1, 3, 1, DIGEST, "amqp://m1/", recover_quorum=2)
    view.on_confchg([1, 2], [1, 2], [])
    view.on_hello(hello(1))
    assert view.on_hello(hello(2)) == []
    # With "all" (no recover quorum) two of three wait for the third.
    view = Membership(1, 3, 1, DIGEST, "amqp://m1/")
    view.on_confchg([1, 2], [1, 2], [])
    view.on_hello(hello(1, 1, 400))
    assert view.on_hello(hello(2, 1, 410)) == []

"""The hot-standby primary's lease (runtime/member/lease.py): its length from corosync's timeouts,
renewal by our own messages coming back, the lapse before the others can promote, a membership
change that ends a lapse, and giving up when none comes."""

from __future__ import annotations

from typing import Any, cast

import pytest
import trio
import trio.testing

from cpgbroker.corosync import cmap
from cpgbroker.runtime.member import lease as lease_module
from cpgbroker.runtime.member.lease import DOUBT_POLL, PrimaryLease, lease_length, verdict_wait
from cpgbroker.runtime.replication import modes


@pytest.fixture
def virtual_time(monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    """The lease on trio's virtual clock, with corosync's timeouts for token 1000 ms."""
    monkeypatch.setattr(
        lease_module.cmap, "totem_timeouts", lambda netns: cmap.TotemTimeouts(1000, 1200)
    )
    monkeypatch.setattr(lease_module.time, "monotonic", trio.current_time)
    monkeypatch.setattr(modes.time, "monotonic", trio.current_time)

    async def in_this_thread(fn: Any, *args: Any) -> Any:
        return fn(*args)  # a worker thread's real time would race the virtual clock

    monkeypatch.setattr(trio.to_thread, "run_sync", in_this_thread)


def test_the_lease_lapses_before_the_others_can_promote() -> None:
    # corosync's defaults for a 3-node cluster configured with token 1000 ms.
    t = cmap.TotemTimeouts(token_ms=1000, consensus_ms=1200)
    detection = 2.2  # the others promote no sooner than this after the ring stopped
    length = lease_length(t)
    assert length == pytest.approx(1.76)
    # Noticed at most one poll late (in doubt by then), the lapse still comes before anyone
    # else can be promoted, with a margin for the close to reach the clients.
    assert length + DOUBT_POLL < detection - 0.3
    # A lapsed primary waits for the membership's verdict until well after the ring change a
    # backup's death brings (detection time, then the new ring's formation).
    assert length + verdict_wait(t) == pytest.approx(2 * detection)


def test_our_messages_coming_back_renew_it_and_silence_lapses_it() -> None:
    sent: list[float | None] = [None]
    lease = PrimaryLease(lambda: sent[0])
    lease.configure(cmap.TotemTimeouts(1000, 1200))
    length = lease.length
    lease.grant(100.0)  # promoted by a membership change delivered at t=100
    assert not lease.check(100.0 + length - 0.01)
    sent[0] = 101.0  # a message of ours sent at 101 came back
    assert lease.expires_at() == pytest.approx(101.0 + length)
    assert not lease.check(100.0 + length + 0.5)
    assert not lease.lapsed
    # Nothing of ours came back since: the lease lapses once, at its end.
    assert lease.check(101.0 + length)
    assert lease.lapsed and lease.lapses == 1
    assert not lease.check(200.0), "a lapse is reported once"


async def test_the_watcher_heartbeats_lapses_once_and_gives_up_without_a_verdict(
    virtual_time: None, autojump_clock: trio.testing.MockClock
) -> None:
    """The task a primary runs: heartbeats while it holds the lease, the lapse once our
    messages stop coming back, then, with no membership change to renew it, giving up once
    (the member then stops serving: the task ends). On trio's virtual clock."""
    sent: list[float | None] = [None]
    lease = PrimaryLease(lambda: sent[0])
    holding, ring_works = [True], [True]
    beats: list[float] = []
    lapses: list[float] = []
    gave_up: list[float] = []

    def heartbeat() -> None:
        beats.append(trio.current_time())
        if ring_works[0]:
            sent[0] = trio.current_time()  # came back at once

    def on_lapse() -> None:
        lapses.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lease.run,
            lambda: holding[0],
            heartbeat,
            on_lapse,
            None,
            lambda doubting: None,
            lambda: gave_up.append(trio.current_time()),
        )
        lease.grant(trio.current_time())
        await trio.sleep(30)
        assert not lapses
        assert lease.length == pytest.approx(1.76)
        # One heartbeat per eighth of the lease.
        assert len(beats) == pytest.approx(30 / (1.76 / 8), abs=2)
        ring_works[0] = False  # our messages stop coming back
        stopped = trio.current_time()
        await trio.sleep(10)
        assert len(lapses) == 1 and lease.lapsed
        last = sent[0] or 0
        assert lease.length <= lapses[0] - last <= lease.length + DOUBT_POLL + 0.01
        assert lapses[0] - stopped < 2.2, "before the others can promote"
        assert len(gave_up) == 1
        assert gave_up[0] - last == pytest.approx(2 * 2.2, abs=DOUBT_POLL + 0.01)
        beats_then = len(beats)
        await trio.sleep(5)
        assert len(beats) == beats_then and len(gave_up) == 1, "the task ends after giving up"
        nursery.cancel_scope.cancel()


def test_the_doubt_comes_before_the_lapse_and_both_before_the_others_can_promote() -> None:
    t = cmap.TotemTimeouts(token_ms=1000, consensus_ms=1200)
    detection = 2.2
    assert lease_module.doubt_length(t) == pytest.approx(detection * lease_module.DOUBT)
    # Even when our latest message that came back was sent a heartbeat before the ring
    # stopped, and the doubt is noticed a heartbeat late, output pauses before the lapse.
    heartbeat = lease_length(t) / lease_module.HEARTBEATS
    assert lease_module.doubt_length(t) + heartbeat < lease_length(t) < detection


async def test_a_stall_shorter_than_the_lease_pauses_and_a_membership_change_ends_a_lapse(
    virtual_time: None, autojump_clock: trio.testing.MockClock
) -> None:
    """A ring stalled for less than the lease: output pauses once in doubt and resumes as
    soon as our messages come back, without a lapse. A longer stall (a backup's loss, about
    2.2 s): the lapse, then the membership change that keeps us primary renews the lease
    (``grant``) and the task goes on, heartbeats and all, without giving up."""
    sent: list[float | None] = [None]
    lease = PrimaryLease(lambda: sent[0])
    ring_works = [True]
    doubts: list[tuple[float, bool]] = []
    lapses: list[float] = []
    gave_up: list[float] = []

    def heartbeat() -> None:
        if ring_works[0]:
            sent[0] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lease.run,
            lambda: True,
            heartbeat,
            lambda: lapses.append(trio.current_time()),
            None,
            lambda d: doubts.append((trio.current_time(), d)),
            lambda: gave_up.append(trio.current_time()),
        )
        lease.grant(trio.current_time())
        await trio.sleep(10)
        assert not doubts, "no doubt while the ring carries our heartbeats"
        ring_works[0] = False
        stopped = trio.current_time()
        await trio.sleep(1.5)  # a short stall
        ring_works[0] = True
        sent[0] = trio.current_time()  # ... and the ring carries our messages again
        await trio.sleep(0.2)
        assert [d for _t, d in doubts] == [True, False]
        paused_at, resumed_at = doubts[0][0], doubts[1][0]
        assert stopped + lease.doubt_length - 0.25 <= paused_at < stopped + lease.length
        assert resumed_at - (stopped + 1.5) <= DOUBT_POLL + 0.01
        assert not lapses and lease.doubts == 1
        # A backup dies: the ring stalls until the others re-form it without it.
        await trio.sleep(5)
        ring_works[0] = False
        stopped = trio.current_time()
        await trio.sleep(2.3)
        assert len(lapses) == 1 and lapses[0] - stopped < 2.2
        ring_works[0] = True
        lease.grant(trio.current_time())  # the membership change keeps us primary
        await trio.sleep(0.2)
        assert not lease.lapsed and doubts[-1][1] is False
        await trio.sleep(10)
        assert not gave_up and len(lapses) == 1, "renewed: no giving up, no second lapse"
        nursery.cancel_scope.cancel()


class _Output:
    """What the lease does to a member's client output (``AmqpServer``)."""

    def __init__(self) -> None:
        self.paused = False
        self.changes: list[bool] = []

    def pause_output(self) -> None:
        self.paused = True
        self.changes.append(True)

    def resume_output(self) -> None:
        self.paused = False
        self.changes.append(False)


async def test_a_member_replaying_bytes_holds_its_output_from_the_lapse_to_a_membership_change(
    virtual_time: None, autojump_clock: trio.testing.MockClock
) -> None:
    """Active-active: the lease lapses when our messages stop coming back; the member's output
    is held (its clients stay connected) until a membership change keeps it in the cluster;
    without one, the member gives up once, after the verdict wait."""
    sent: list[float | None] = [None]
    ring_works = [True]
    out = _Output()
    gave_up: list[float] = []

    def heartbeat() -> None:
        if ring_works[0]:
            sent[0] = trio.current_time()

    sequencer = cast(Any, type("Sequencer", (), {"submit": None})())
    rb = modes.ReplayingBytes(sequencer, lambda: 0, PrimaryLease(lambda: sent[0]), None)
    rb.attach(
        cast(Any, out),
        cast(Any, None),
        cast(Any, None),
        stored=True,
        on_cut=lambda: None,
        heartbeat=heartbeat,
        lapsed=lambda length: gave_up.append(length),
        doubt=lambda doubting, length: None,
        serving=lambda: True,
    )
    (task,) = rb.guarded_tasks()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(task)
        await trio.sleep(10)
        rb.membership_changed(lambda: False)
        assert out.changes == [], "no lapse, nothing to renew"
        ring_works[0] = False  # another member died: the ring stalls
        await trio.sleep(2.0)
        assert out.changes == [True], "held from the lapse (1.76 s) on"
        ring_works[0] = True
        rb.membership_changed(lambda: False)  # the ring re-formed without it
        assert out.changes == [True, False] and not out.paused
        await trio.sleep(10)
        assert out.changes == [True, False] and not gave_up
        ring_works[0] = False  # this member's corosync frozen: no verdict ever comes
        await trio.sleep(6)
        assert out.changes == [True, False, True] and out.paused
        assert gave_up == [pytest.approx(4.4)], "gave up once, 2 x (token + consensus)"
        nursery.cancel_scope.cancel()

"""The hot-standby primary's lease (runtime/member/lease.py): its length from corosync's timeouts,
renewal by our own messages coming back, the lapse, and the end of a lapse."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from cpgbroker.corosync import cmap
from cpgbroker.runtime.member import lease as lease_module
from cpgbroker.runtime.member.lease import FORMATION_MARGIN, PrimaryLease, lease_length


def test_the_lease_outlasts_the_time_the_others_take_to_promote() -> None:
    # corosync's defaults for a 3-node cluster configured with token 1000 ms.
    t = cmap.TotemTimeouts(token_ms=1000, consensus_ms=1200)
    length = lease_length(t)
    assert length == pytest.approx(2.2 * (1 + FORMATION_MARGIN))
    # Long enough that a ring stalled by a backup's loss (token + consensus) never costs the
    # primary its clients; short enough that a cut-off primary closes them within about one
    # failure detection more.
    assert 2.2 < length < 2 * 2.2


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


async def test_the_watcher_heartbeats_and_lapses_once(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """The task a primary runs: heartbeats while it holds the lease, the lapse once our
    messages stop coming back (the member then stops serving: the task ends). On trio's
    virtual clock."""
    monkeypatch.setattr(
        lease_module.cmap, "totem_timeouts", lambda netns: cmap.TotemTimeouts(1000, 1200)
    )
    monkeypatch.setattr(lease_module.time, "monotonic", trio.current_time)

    async def in_this_thread(fn: Any, *args: Any) -> Any:
        return fn(*args)  # a worker thread's real time would race the virtual clock

    monkeypatch.setattr(trio.to_thread, "run_sync", in_this_thread)
    sent: list[float | None] = [None]
    lease = PrimaryLease(lambda: sent[0])
    holding, ring_works = [True], [True]
    beats: list[float] = []
    lapses: list[float] = []

    def heartbeat() -> None:
        beats.append(trio.current_time())
        if ring_works[0]:
            sent[0] = trio.current_time()  # came back at once

    def on_lapse() -> None:
        lapses.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease.run, lambda: holding[0], heartbeat, on_lapse, None)
        lease.grant(trio.current_time())
        await trio.sleep(30)
        assert not lapses
        assert lease.length == pytest.approx(2.75)
        # One heartbeat per eighth of the lease.
        assert len(beats) == pytest.approx(30 / (2.75 / 8), abs=2)
        ring_works[0] = False  # our messages stop coming back
        stopped = trio.current_time()
        await trio.sleep(5)
        assert len(lapses) == 1 and lease.lapsed
        assert lease.length <= lapses[0] - (sent[0] or 0) <= lease.length + 2.75 / 8
        assert lapses[0] - stopped <= lease.length
        beats_at_lapse = len(beats)
        await trio.sleep(5)
        assert len(lapses) == 1 and len(beats) == beats_at_lapse, "the task ends at the lapse"
        nursery.cancel_scope.cancel()


def test_the_doubt_comes_before_the_others_can_promote_and_the_lapse_after() -> None:
    t = cmap.TotemTimeouts(token_ms=1000, consensus_ms=1200)
    detection = 2.2  # the others promote no sooner than this after the ring stopped
    assert lease_module.doubt_length(t) == pytest.approx(detection * lease_module.DOUBT)
    # Even when our latest message that came back was sent a heartbeat before the ring
    # stopped, and the doubt is noticed a heartbeat late, output pauses before a promotion.
    heartbeat = lease_length(t) / lease_module.HEARTBEATS
    assert lease_module.doubt_length(t) + heartbeat < detection
    assert lease_length(t) > detection


async def test_the_watcher_pauses_output_in_doubt_and_resumes_when_the_ring_carries_on(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A ring stalled for less than the lease (a backup's loss): output pauses once in doubt
    and resumes as soon as our messages come back, without a lapse. A ring that never comes
    back: the doubt, then the lapse."""
    monkeypatch.setattr(
        lease_module.cmap, "totem_timeouts", lambda netns: cmap.TotemTimeouts(1000, 1200)
    )
    monkeypatch.setattr(lease_module.time, "monotonic", trio.current_time)

    async def in_this_thread(fn: Any, *args: Any) -> Any:
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", in_this_thread)
    sent: list[float | None] = [None]
    lease = PrimaryLease(lambda: sent[0])
    ring_works = [True]
    doubts: list[tuple[float, bool]] = []
    lapses: list[float] = []

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
        )
        lease.grant(trio.current_time())
        await trio.sleep(10)
        assert not doubts, "no doubt while the ring carries our heartbeats"
        ring_works[0] = False
        stopped = trio.current_time()
        await trio.sleep(1.8)  # a backup's loss stalls the ring for about 2.2 s
        ring_works[0] = True
        sent[0] = trio.current_time()  # ... and the ring carries our messages again
        await trio.sleep(0.2)
        assert [d for _t, d in doubts] == [True, False]
        paused_at, resumed_at = doubts[0][0], doubts[1][0]
        assert stopped + lease.doubt_length - 0.35 <= paused_at < stopped + 2.2
        assert resumed_at - (stopped + 1.8) <= lease_module.DOUBT_POLL + 0.01
        assert not lapses and lease.doubts == 1
        # Now the ring stops for good: in doubt before the others could promote, lapsed after.
        await trio.sleep(5)
        ring_works[0] = False
        stopped = trio.current_time()
        await trio.sleep(5)
        assert doubts[2][1] is True and doubts[2][0] - stopped < 2.2
        assert len(lapses) == 1 and lapses[0] - stopped > 2.2
        nursery.cancel_scope.cancel()

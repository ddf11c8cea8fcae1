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

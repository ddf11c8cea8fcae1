"""``TrioCpg.send_nowait``: multicast in the caller's turn or not at all. It never waits and never
raises into the caller's task (a client reader, the deliver loop); what it cannot send is left
for ``send``, and a fatal error reaches the tasks that receive or send."""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio

from cpgbroker.corosync.errors import CpgConnectionLost, CpgTryAgain
from cpgbroker.runtime.ring.cpg_trio import TrioCpg


class StubCpg:
    """The calls of ``Cpg`` that sending uses; ``fail`` is raised by the next mcast."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.fail: Exception | None = None

    def max_atomic_msgsize(self) -> int:
        return 1 << 20

    def check_size(self, size: int) -> None:
        pass

    def mcast(self, *buffers: Any) -> None:
        if self.fail is not None:
            e, self.fail = self.fail, None
            raise e
        self.sent.append(b"".join(bytes(b) for b in buffers))


def adapter(window: int = 2) -> tuple[TrioCpg, StubCpg]:
    stub = StubCpg()
    return TrioCpg(stub, window=window), stub  # type: ignore[arg-type]


def test_sends_while_credit_lasts_then_refuses() -> None:
    cpg, stub = adapter(window=2)
    assert cpg.idle
    assert cpg.send_nowait(b"a", b"b") and cpg.send_nowait(b"c")
    assert stub.sent == [b"ab", b"c"]
    assert not cpg.idle and cpg.in_flight == 2
    assert not cpg.send_nowait(b"d"), "the credit window is full"
    assert stub.sent == [b"ab", b"c"]


def test_try_again_sends_nothing_and_takes_no_credit() -> None:
    cpg, stub = adapter()
    stub.fail = CpgTryAgain("cpg_mcast_joined")
    assert not cpg.send_nowait(b"a")
    assert cpg.idle and cpg.stats.try_again == 1 and stub.sent == []
    assert cpg.send_nowait(b"a") and stub.sent == [b"a"]


async def test_a_fatal_error_is_raised_to_the_receiver_not_the_caller() -> None:
    cpg, stub = adapter()
    stub.fail = CpgConnectionLost("cpg_mcast_joined")
    assert not cpg.send_nowait(b"a")  # no exception in this task
    assert isinstance(cpg.failure, CpgConnectionLost)
    assert not cpg.send_nowait(b"b"), "nothing goes out after a fatal error"
    with trio.fail_after(1), pytest.raises(CpgConnectionLost):
        await cpg.receive_batch()
    with pytest.raises(CpgConnectionLost):
        await cpg.send(b"c")
    assert stub.sent == []


async def test_a_call_answered_while_the_event_loop_was_busy_is_not_a_hang() -> None:
    """The deadline of a guarded call passes while the event loop is blocked in a long event
    (every member is, in the same event); the call itself answered at once: its result counts,
    the handle is not abandoned."""
    cpg, _stub = adapter()
    cpg.call_timeout = 0.2
    answered = trio.Event()
    got: list[int] = []

    def corosync_answers() -> int:
        time.sleep(0.1)  # answers while the loop is busy, well before the call's deadline
        return 42

    async def caller() -> None:
        got.append(await cpg.call(corosync_answers))
        answered.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller)
        await trio.sleep(0.05)  # the call is in its worker thread
        time.sleep(0.5)  # the loop busy past the call's deadline, as in a slow event
        with trio.fail_after(5):
            await answered.wait()
    assert got == [42]
    assert cpg.failure is None

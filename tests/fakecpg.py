"""An in-memory CPG for unit tests of ``ClusterNode``: total order for free (every send is
appended to every member's queue at once), and delivery to one member can be held back."""

from __future__ import annotations

from typing import Any

import trio

from cpgbroker.corosync.events import Deliver


class Bus:
    def __init__(self) -> None:
        self.subs: list[FakeCpg] = []

    def post(self, ev: Any) -> None:
        for s in self.subs:
            s.q.append(ev)
            s.wake.set()


class FakeCpg:
    """One member's handle on the bus; ``paused`` holds back delivery to it (it still sends),
    as on the far side of a partition."""

    def __init__(self, bus: Bus, nodeid: int) -> None:
        self.bus, self.local_nodeid = bus, nodeid
        self.q: list[Any] = []
        self.wake = trio.Event()
        self.in_flight = 0
        self.idle = True  # every send is delivered at once
        self.paused = False
        bus.subs.append(self)

    async def send(self, *bufs: bytes) -> None:
        self.send_nowait(*bufs)
        await trio.lowlevel.checkpoint()

    def send_nowait(self, *bufs: bytes) -> bool:
        if self in self.bus.subs:  # once it left the group, nothing it sends reaches anyone
            self.bus.post(Deliver(b"g", self.local_nodeid, 1000, b"".join(bufs)))
        return True

    def post(self, ev: Any) -> None:
        """Deliver ``ev`` to this member only (a configuration change as it alone sees it)."""
        self.q.append(ev)
        self.wake.set()

    async def receive_batch(self) -> list[Any]:
        while not self.q or self.paused:
            self.wake = trio.Event()
            await self.wake.wait()
        out, self.q = self.q, []
        return out

    def resume(self) -> None:
        self.paused = False
        self.wake.set()


class _QuorateView:
    def verdict(self, ring: tuple[int, int]) -> bool:
        return True


class FakeQuorum:
    """Stands in for the votequorum reader of a ``ClusterNode``: every ring is quorate."""

    view = _QuorateView()

    async def wait_change(self) -> None:
        await trio.sleep_forever()

    def status(self) -> dict[str, Any]:
        return {}

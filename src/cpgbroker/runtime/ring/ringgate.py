"""The quorum gate of the CPG stream: a ring change is held until votequorum's verdict on the
new ring (docs/architecture.md, "Quorum"; the decisions are ``cluster/quorum.py``).

CPG events and votequorum notifications arrive on different fds with no order between them;
both name rings by the same totem ring id. A ``ConfChg`` caused by a ring change (reason
NODEDOWN/NODEUP) comes *before* the ``TotemConfChg`` that names the ring, so the deliver loop
holds everything from it until the ring is named, then asks :meth:`RingGate.verdict`:
quorate, and the held items are applied (a few milliseconds later); inquorate, or no verdict
within ``VERDICT_TIMEOUT``, and none of them ever is.

Owns: the votequorum reader it is given and the last ring let through. Never applies or
holds stream items itself: the deliver loop does.
"""

from __future__ import annotations

import trio

from cpgbroker.cluster.quorum import SERVE, STOP, decide, ring_change
from cpgbroker.corosync.events import ConfChg, RingId, TotemConfChg
from cpgbroker.runtime.ring.quorum_trio import TrioQuorum

# How long a held ring change may wait for its TotemConfChg and for votequorum's verdict on the
# new ring. Both come from the same corosync synchronisation and arrive within milliseconds;
# past this something is wrong, and the member stops serving rather than guess.
VERDICT_TIMEOUT = 10.0


class RingGate:
    def __init__(self, quorum: TrioQuorum) -> None:
        self.quorum = quorum
        # The last ring whose quorum verdict let the stream through.
        self.ring: RingId | None = None

    @staticmethod
    def holds(ev: object) -> bool:
        """Whether ``ev`` starts (or names) a ring change, which waits for a verdict."""
        t = type(ev)
        return t is TotemConfChg or (t is ConfChg and ring_change(ev))  # type: ignore[arg-type]

    async def verdict(self, ring: RingId) -> str | None:
        """Wait for votequorum's verdict on ``ring``: None if quorate (the stream goes on),
        else why the member must stop serving."""
        key = (ring.nodeid, ring.seq)
        with trio.move_on_after(VERDICT_TIMEOUT):
            while True:
                d = decide(self.quorum.view.verdict(key))
                if d == SERVE:
                    self.ring = ring
                    return None
                if d == STOP:
                    return f"ring {ring.nodeid}.{ring.seq} is not quorate"
                await self.quorum.wait_change()
        return f"votequorum gave no verdict on ring {ring.nodeid}.{ring.seq}"

"""The confirm gate of a cluster member: local clients' output from a confirm on waits until
the confirm's event is stable (docs/architecture.md, "Stable confirms").

A confirm (or tx.commit-ok) reaches the client only once its event is stable: applied by every
ready member. An event can be delivered on this member's side of a partition only (the old
ring's transitional configuration), before the split is reported, and under AGREED ordering a
member crashing may take with it an event the others never received: once every member
applied it, the message the confirm vouches for survives a partition and the failure of all
members but one.

The :class:`~cpgbroker.runtime.amqp.server.AmqpServer` hands the gate a ``Send`` that carries a
confirm, and everything after it for the same connection (sends and the close, in order); the member
calls :meth:`ConfirmGate.release` with the stable sequence at the end of each delivered batch.

Owns: which connections hold output (``LocalConn.held`` itself is the gate's to change).
Never decides stability (the member's progress bookkeeping does) and never writes but through
the node it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cpgbroker.model.events import CONFIRM_DURABLE, Send
from cpgbroker.runtime.amqp.server import LocalConn


class Output(Protocol):
    """What the gate needs of the node when it releases output."""

    local: dict[int, LocalConn]

    def write(self, lc: LocalConn, data: bytes) -> None: ...

    def begin_close(self, lc: LocalConn, reason: str) -> None: ...


class ConfirmGate:
    def __init__(self, event_seq: Callable[[], int]) -> None:
        # The event being applied (what a confirm held now waits for).
        self._event_seq = event_seq
        # Local connections with output held until its event is stable.
        self.holding: dict[int, LocalConn] = {}

    def hold(self, lc: LocalConn, eff: Send) -> None:
        """Output that must wait: a confirm (or a delivery that waits for its batch: shipping
        changes) until its event is stable, anything else (for the same connection) until the
        output before it is out."""
        lc.held.append(
            (
                self._event_seq() if eff.confirm or eff.delivery_waits else 0,
                eff.data,
                "",
                eff.confirm == CONFIRM_DURABLE,
            )
        )
        self.holding[lc.id] = lc

    def hold_close(self, lc: LocalConn, reason: str) -> None:
        """The model closed a connection that has output held: the close goes after it."""
        lc.held.append((0, None, reason, False))

    def release(self, stable: int, out: Output, durable: int | None = None) -> None:
        """Write what waited for events up to ``stable`` (and, for a confirm of a persistent
        message on a durable queue, up to ``durable`` in every store; None: no store), in
        order per connection."""
        if durable is None:
            durable = stable
        local = out.local
        for cid, lc in list(self.holding.items()):
            if local.get(cid) is not lc:
                del self.holding[cid]  # the client is gone (its fd may be reused: no write)
                continue
            held = lc.held
            n = 0
            for seq, _data, _reason, on_disk in held:
                if seq > stable or (on_disk and seq > durable):
                    break
                n += 1
            if not n:
                continue
            ready = held[:n]
            del held[:n]
            for _seq, data, reason, _on_disk in ready:
                if data is not None:
                    out.write(lc, data)
                else:
                    out.begin_close(lc, reason)
            if not held:
                del self.holding[cid]
                lc.wake.set()  # a do-output grant waits for held output to be written

    def drop(self) -> None:
        """Held output never goes out (the member stops serving: its events may be missing on
        the quorate side, so its confirms are not owed)."""
        for lc in self.holding.values():
            lc.held.clear()
        self.holding.clear()

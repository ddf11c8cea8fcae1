"""Hot standby (``[cluster] mode = "hot-standby"``): one member, the primary, serves clients.

Theory of operation
-------------------
The seed designs' second cluster mode. One member, the *primary*, takes clients; the others,
the *backups*, turn every client away with connection.close 320 whose text names the primary's
URL, so a client with the cluster's URL list (pika's list of parameters, kombu's failover URLs)
ends up on the primary whichever member it tried first.

**Which member is primary** is a pure function of the replicated membership
(cluster/membership.py): the *eldest* ready member, i.e. the first member, in the order the
ordered stream revealed them, whose status is ready. Every member holds that same order (a
member that joins adopts it with its state update), so every member names the same primary
and nobody elects anybody. In a cluster started in node order it is the first node; the rule
never moves the primary while it lives: a member that joins later, a restarted former primary
included, comes after the others and is a backup. It took a state update before it became
ready, so it has caught up before it could ever serve again, and a member outside the quorate
partition is not ready and serves no one: there is never a second primary that lags. When the
primary dies or leaves, the next eldest takes over as soon as the membership change is
delivered (corosync's failure detection), and clients reconnect to it.

**What is replicated, and the guarantee**, are active-active's: the primary's clients' bytes
are multicast and every member applies them to the same deterministic model; a confirm goes out
once every member has the message (and, with stores, has stored it), so an acknowledged
message survives the loss of all members but one. A backup therefore still does the work of an
active-active member per message; what the mode changes today is where clients are: all on one
member, so consumers are never spread over members (no cross-member dispatch or output credit
to wait for), and failover is one documented move.

Should a primary find it is no longer the eldest ready member while it serves (a merge after a
partition can reorder the membership), it closes its clients with 320 naming the new primary.

**Holding clients** (shipping changes). While the primary's lease lapses it turns its clients
away (runtime/member/lease.py), and until the others promote one of theirs a backup would turn
them away too, naming the old primary: a client given every member's URL would go round them,
pausing between rounds, and reach the new primary only at its next round after the promotion.
So a backup whose ring delivered nothing for as long as the primary's doubt takes (the
primary's heartbeats stopped) holds a client it would turn away: it accepts the connection and
says nothing until the ring moves again or a few seconds pass (``Process.handle_client``),
then serves it if the membership change made it primary, or turns it away as usual.

Owns: whether this member was primary at the last look.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from pamqp import commands
from pamqp import frame as pframe

from cpgbroker.cluster.codec import STATUS_READY
from cpgbroker.cluster.membership import MemberInfo, Membership
from cpgbroker.errors import ReplyCode
from cpgbroker.model import MECHANISMS, BrokerConfig, server_properties

log = logging.getLogger("cpgbroker.standby")

# How often a serving primary checks that it still is (a role change needs a membership
# change, delivered in order; this only bounds how long its clients stay on a backup).
RECHECK = 0.2


# What a client of a primary whose lease lapsed reads (connection.close 320), and one that
# connects to it meanwhile (runtime/member/lease.py, "At the lapse").
LAPSED = (
    "hot standby: this member lost contact with the cluster and may no longer be primary; "
    "reconnect to another member"
)


def primary_of(membership: Membership) -> MemberInfo | None:
    """The eldest ready member (module docstring), or None while no member is ready."""
    for info in membership.members.values():
        if info.status == STATUS_READY:
            return info
    return None


class HotStandby:
    def __init__(
        self,
        member: int,
        membership: Callable[[], Membership],
        serving: Callable[[], bool],
    ) -> None:
        self.member = member
        self._membership = membership
        self._serving = serving
        self.was_primary = False
        # Why this member, primary, takes no clients for now (its lease lapsed), or None.
        self.held: str | None = None

    def refusal(self) -> str | None:
        """None when this member takes clients; otherwise what a turned-away client reads."""
        return self._not_primary() or self.held

    def _not_primary(self) -> str | None:
        """None when this member is primary; otherwise why it takes no clients."""
        primary = primary_of(self._membership())
        if primary is None:
            return "hot standby: no member is ready to be primary yet; try again soon"
        if primary.member == self.member:
            return None
        where = primary.url or f"member {primary.member}"
        return f"this member is a hot-standby backup; the primary is {where}: use it"

    def greeting(self, cfg: BrokerConfig, member_urls: tuple[str, ...]) -> bytes:
        """The connection.start a turned-away client reads before its connection.close: any
        member's server-properties (``cluster_members``: the member list), plus the primary's
        URL (``cpgbroker_primary``), for clients that look there rather than at the close."""
        props = server_properties(cfg, member_urls)
        primary = primary_of(self._membership())
        props["cpgbroker_primary"] = "" if primary is None else primary.url
        start = commands.Connection.Start(
            server_properties=props, mechanisms=MECHANISMS, locales="en_US"
        )
        return bytes(pframe.marshal(start, 0))

    def status(self) -> dict[str, Any]:
        primary = primary_of(self._membership())
        return {
            "mode": "hot-standby",
            "role": "primary"
            if primary is not None and primary.member == self.member
            else "backup",
            "primary": None if primary is None else primary.member,
            "primary_url": None if primary is None else primary.url,
        }

    async def watch(self, close_all: Callable[[int, str], Awaitable[None]]) -> None:
        """For ever: if this member stops being primary while it serves, close its clients
        (connection.close 320 through the model, naming the new primary)."""
        while True:
            await trio.sleep(RECHECK)
            if not self._serving():
                self.was_primary = False
                continue
            why = self._not_primary()
            if self.was_primary and why is not None:
                log.warning("no longer the hot-standby primary: closing this member's clients")
                await close_all(int(ReplyCode.CONNECTION_FORCED), why)
            self.was_primary = why is None

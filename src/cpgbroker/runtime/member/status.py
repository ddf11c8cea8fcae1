"""What the process wing reads of one incarnation of a member: one facade over the member.

The process wing answers the status endpoint, ``cpgbroker status``, systemd's status line, the
management API and its operators' requests, and turns clients away while this member does not
serve. It reads the member through :class:`MemberStatus` rather than through the member's
components: which component holds what (the membership, the clients' side, the replication
mode, hot standby, the checkpoints) is the member's business, and may change without the
process, the admin endpoint or the management API noticing.
"""

from __future__ import annotations

import time
from typing import Any

from cpgbroker.cluster.codec import STATUS_NAMES
from cpgbroker.cluster.membership import NEEDS_UPDATE
from cpgbroker.model import Broker, BrokerConfig
from cpgbroker.runtime.amqp.server import model_status
from cpgbroker.runtime.member.member import ClusterNode


class MemberStatus:
    """Read-only views of one :class:`~cpgbroker.runtime.member.member.ClusterNode`."""

    def __init__(self, node: ClusterNode) -> None:
        self._node = node

    @property
    def member(self) -> int:
        return self._node.member

    @property
    def serving(self) -> bool:
        return self._node.serving

    @property
    def halted(self) -> int | None:
        """The event a stop request stopped this member at."""
        return self._node.halted

    @property
    def suspended(self) -> str | None:
        """Why this member stopped serving for good in this incarnation."""
        return self._node.suspended

    @property
    def failure(self) -> str | None:
        """Why this member must leave the cluster."""
        return self._node.failure

    @property
    def ready(self) -> bool:
        return self._node.ready.is_set()

    async def wait_ready(self) -> None:
        """Until the member is ready (it joined a cluster that serves, and caught up)."""
        await self._node.ready.wait()

    @property
    def holding_kept(self) -> bool:
        """Whether it still offers a state kept since quorum was lost (or recovered)."""
        return self._node.kept is not None

    @property
    def event_seq(self) -> int:
        """The last event its state applied."""
        return self._node.broker.event_seq

    @property
    def local_clients(self) -> int:
        """Its clients still connected (a suspended member's linger until they read their
        connection.close)."""
        return len(self._node.io.local)

    @property
    def conn_counter(self) -> int:
        """Connection ids handed out so far (the next incarnation goes on from here)."""
        return self._node.io.conn_counter

    def state_name(self) -> str:
        """Where the member is: the membership's state, or what holds it (suspended,
        stopping, an error-check round, a state update, catching up after one)."""
        node = self._node
        if node.suspended is not None:
            return "suspended"
        if node.stops.halted is not None:
            return "stopping"
        if node.stall.stalled is not None:
            return "error-check"
        if node.membership.state == NEEDS_UPDATE:
            return "updating" if node.newcomer.progress is not None else "needs-update"
        if node.newcomer.installed and not node.ready.is_set():
            return "catching-up"
        return node.membership.state

    def members(self) -> list[int]:
        """The members it knows, in the stream's order."""
        return list(self._node.membership.members)

    def update_activity(self) -> int:
        """Changes whenever a state update this member takes makes progress."""
        return self._node.newcomer.activity()

    def replica(self) -> Broker | None:
        """The model the management API and /metrics read: this member's while it serves
        (before, a newcomer's model is still empty or half transferred; once suspended, it is
        no longer the cluster's state); a hot-standby primary shipping changes shows its
        serving broker."""
        node = self._node
        if node.suspended is not None or not node.serving:
            return None
        return node.view

    def stop_text(self) -> str:
        """What a client reads once a stop request stopped this member (connection.close
        320): a member stop names the others, a cluster stop does not."""
        return self._node.stops.close_text()

    def client_refusal(self, cfg: BrokerConfig) -> tuple[str, bytes] | None:
        """None when this member takes clients; else what a turned-away client reads: the
        reason, after a connection.start naming the primary (a hot-standby backup)."""
        standby = self._node.standby
        if standby is None or (why := standby.refusal()) is None:
            return None
        return why, standby.greeting(cfg, self._node.broker.topology.member_urls)

    def ring_stands_still(self) -> bool:
        """Whether a client this member turns away should rather wait: a hot-standby backup
        whose ring delivered nothing for as long as the primary's doubt takes (the primary may
        be gone, and this member promoted in a moment)."""
        node = self._node
        after = node.replication.hold_clients_after()
        return after is not None and time.monotonic() - node.multicast.cpg.last_delivery_at >= after

    def admin_refusal(self) -> str | None:
        """None when this member applies operators' changes; else why not (shipping changes,
        only the primary's broker does)."""
        return self._node.replication.refusal()

    def report(self, with_digest: bool) -> dict[str, Any]:
        """What ``cpgbroker status`` shows of a member that serves (or is getting ready to)."""
        node = self._node
        b = node.broker
        local_conns = node.io.local
        # Shipping changes, the primary's clients are its serving broker's, not the stream's.
        served = node.view
        local = sum(1 for c in served.connections if c in local_conns)
        last = node.checkpoints.last
        cpg = node.multicast.cpg
        out = model_status(b, len(local_conns), with_digest)
        out.update(
            {
                "member": node.member,
                "url": node.membership.url,
                "state": self.state_name(),
                "clock_master": node.membership.clock_master,
                **({"mode": "active-active"} if node.standby is None else node.standby.status()),
                **node.replication.status(),
                "members": [
                    {
                        "member": m,
                        "url": i.url,
                        "status": STATUS_NAMES.get(i.status, "unknown")
                        if i.status is not None
                        else "unknown",
                        # How far it has applied the stream, as it last reported (this member:
                        # now), and whether its digest agreed at the last checkpoint.
                        "applied": b.event_seq
                        if m == node.member
                        else node.stream.progress.peer.get(m),
                        # (None: it took no part in the last checkpoint, or there was none.)
                        "checkpoint_agreed": None
                        if last is None or m not in dict(last.digests)
                        else m not in last.losers,
                        # What it runs, as its hello said (an upgrade in progress shows here).
                        "software": i.software,
                        "model_versions": list(i.versions),
                    }
                    for m, i in node.membership.members.items()
                ],
                "upgrade": node.membership.upgrade_status(),
                "connections": {"local": local, "shadow": len(served.connections) - local},
                "checkpoint": None
                if last is None
                else {
                    "seq": last.seq,
                    "digest": last.winner.hex(),
                    "agreed": last.agreed,
                    "losers": list(last.losers),
                },
                "cpg": {
                    "in_flight": cpg.in_flight,
                    "sent": cpg.stats.sent,
                    "sent_bytes": cpg.stats.sent_bytes,
                    "delivered": cpg.stats.delivered,
                    "wakeups": cpg.stats.wakeups,
                },
                "lag": {"events_behind": node.stream.lag(), "held_back": node.multicast.lag_waits},
                "confirms": {
                    "held": sum(len(lc.held) for lc in node.confirms.holding.values()),
                    "admin_unsettled": len(node.desk.unsettled),
                },
                "apply_seconds": node.applier.times.as_dict(),
                # Every link of the cluster with what its runner last reported (replicated),
                # and this member's own links as it sees them now.
                "federation_links": [
                    {
                        "vhost": link.vhost,
                        "exchange": link.exchange,
                        "upstream": link.upstream.name,
                        **b.federation.status.get(link.key, {"status": "starting"}),
                    }
                    for link in b.federation.links(b.vhosts, b.policies.definition_of)
                ],
                "federation": node.federation.status(),
                "update": node.newcomer.status(),
                "updating": node.updater.status(),
                "quorum": None if node.quorum is None else node.quorum.status(),
            }
        )
        if node.suspended is not None:
            out["suspended"] = node.suspended
        out["error_checks"] = node.stall.status()
        if node.eventlog.faults:
            out["injected_faults"] = dict(node.eventlog.faults)
        if node.stops.halted is not None:
            out["stopping"] = {"scope": node.stops.scope, "seq": node.stops.halted}
        return out

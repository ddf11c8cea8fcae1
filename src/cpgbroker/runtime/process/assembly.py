"""Builds one incarnation of a member: the other wings' parts first, then the member.

The process wing is the only one that builds the others (docs/architecture.md, "The runtime's
wings"). :func:`assemble` builds what a member coordinates (``runtime/member/parts.py``) in the
order each part needs the ones before: the stream and whether the member serves, which the other
wings read instead of the member; the multicaster over the CPG handle; the replication mode;
the clients' side with its confirm gate and the admin desk, built on the mode; the federation
links; both sides of a state update. It then builds the member over them, and ends with the one
step construction cannot avoid: the replication mode's :meth:`attach
<cpgbroker.runtime.replication.modes.Replication.attach>`, which hands the mode the parts built
on it, and the member's reaction when the primary's lease lapses.
"""

from __future__ import annotations

import functools

from cpgbroker.cluster.membership import Membership
from cpgbroker.cluster.progress import PeerProgress
from cpgbroker.model import NEWEST, OLDEST, Broker
from cpgbroker.runtime.admin.admindesk import AdminDesk
from cpgbroker.runtime.amqp.confirms import ConfirmGate
from cpgbroker.runtime.amqp.server import AmqpServer
from cpgbroker.runtime.config.digest import config_digest
from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.runtime.federation.links import FederationLinks, client_context
from cpgbroker.runtime.member.eventlog import EventLog
from cpgbroker.runtime.member.lease import PrimaryLease
from cpgbroker.runtime.member.member import ClusterNode, Inherited
from cpgbroker.runtime.member.parts import Parts
from cpgbroker.runtime.member.stops import Stops
from cpgbroker.runtime.member.stream import Service, Stream, admin_settled, version_verdict
from cpgbroker.runtime.replication.modes import ReplayingBytes, Replication, ShippingChanges
from cpgbroker.runtime.replication.shipping import Shipping
from cpgbroker.runtime.replication.standby import HotStandby
from cpgbroker.runtime.ring.cpg_trio import TrioCpg
from cpgbroker.runtime.ring.multicast import Multicaster
from cpgbroker.runtime.ring.quorum_trio import TrioQuorum
from cpgbroker.runtime.update.giving import Updater
from cpgbroker.runtime.update.taking import Newcomer


def assemble(
    config: ServerConfig,
    cpg: TrioCpg,
    member: int,
    *,
    quorum: TrioQuorum | None = None,
    inherited: Inherited | None = None,
) -> ClusterNode:
    """One incarnation of member ``member`` on ``cpg``, with what it ``inherited`` from the
    process and the incarnations before it."""
    cluster = config.cluster
    assert cluster is not None
    inherited = Inherited() if inherited is None else inherited
    stream = _stream(config, member, inherited)
    service = Service()
    multicast = Multicaster(cpg, stream.progress, stream.lag, stream.report)
    # Hot standby: who takes clients (runtime/replication/standby.py); None: every member does.
    standby = (
        HotStandby(member, lambda: stream.membership, lambda: service.serving)
        if cluster.mode == "hot-standby"
        else None
    )
    eventlog = EventLog(cluster.event_log, member, inherited.incarnation)
    stops = Stops(member, multicast, eventlog)
    # How this member's clients' changes reach the others (runtime/replication/modes.py): the
    # member calls it wherever the modes differ, without asking which one it is.
    replication = _replication(config, cpg, member, multicast, stream, standby)
    confirms = ConfirmGate(replication.number)
    io = AmqpServer(
        config,
        member,
        sequencer=replication.sequencer,
        gate=confirms,
        conn_counter=inherited.conn_counter,
    )
    # Operators' changes: answered once as safe as a durable confirm.
    desk = AdminDesk(
        member,
        replication.submit_admin,
        replication.number,
        settled=functools.partial(admin_settled, stream, replication.stable),
    )
    io.desk = desk
    federation = _federation(config, member, desk, stream, service, stops, replication)
    newcomer = Newcomer(
        member,
        stream.membership,
        config.broker,
        multicast.send_control,
        functools.partial(stream.install, installed=replication.installed),
    )
    updater = Updater(member, inherited.incarnation, cluster.update_rate_limit, inherited.updates)
    parts = Parts(
        stream=stream,
        service=service,
        multicast=multicast,
        eventlog=eventlog,
        stops=stops,
        standby=standby,
        replication=replication,
        confirms=confirms,
        io=io,
        desk=desk,
        federation=federation,
        newcomer=newcomer,
        updater=updater,
    )
    node = ClusterNode(config, parts, quorum=quorum, inherited=inherited)
    # The one cycle: the mode was built before what is built on it, and a lapsed lease
    # suspends the member.
    replication.attach(
        io,
        confirms,
        desk,
        stored=inherited.store is not None,
        on_cut=federation.applied,
        heartbeat=lambda: multicast.send_control(stream.report()),
        lapsed=node.lease_lapsed,
        doubt=node.lease_doubt,
        serving=lambda: node.serving and node.halted is None,
    )
    return node


def _stream(config: ServerConfig, member: int, inherited: Inherited) -> Stream:
    """The stream broker (empty until the membership says where to start), the membership
    and the peers' progress."""
    cluster = config.cluster
    assert cluster is not None
    kept = inherited.kept
    # ``[store] recover_with = "majority"``: a majority of ``size`` decides a restart, and
    # confirms that wait for the stores need that many serving.
    store_quorum = (
        cluster.size // 2 + 1
        if config.store is not None and config.store.recover_with == "majority"
        else 0
    )
    membership = Membership(
        member,
        1 if inherited.forced else cluster.size,
        # A member with kept state announces its version; one without, the lowest it applies
        # (what a member of an older release expects to hear).
        OLDEST if kept is None else kept[0].version.current,
        config_digest(config),
        cluster.url,
        store_quorum,
        (OLDEST, NEWEST),
    )
    progress = PeerProgress(member, cluster.max_lag)
    return Stream(
        member, Broker(config.broker), membership, progress, inherited.store, store_quorum
    )


def _federation(
    config: ServerConfig,
    member: int,
    desk: AdminDesk,
    stream: Stream,
    service: Service,
    stops: Stops,
    replication: Replication,
) -> FederationLinks:
    """The federation links this member runs (runtime/federation/links.py): they read the
    view of the stream the replication mode gives, and run while the member serves."""
    cluster = config.cluster
    assert cluster is not None
    return FederationLinks(
        member,
        config.broker.server_id,
        # Without a server id, the CPG group names the cluster upstream (stable across
        # restarts, unlike member ids: the upstream queue must keep its name).
        config.broker.server_id or cluster.group,
        desk,
        lambda: replication.view(stream.broker),
        lambda: replication.link_members(stream.membership),
        lambda: service.serving and stops.halted is None and replication.active,
        client_context(config.tls),
        cluster_name=config.broker.cluster_name,
    )


def _replication(
    config: ServerConfig,
    cpg: TrioCpg,
    member: int,
    multicast: Multicaster,
    stream: Stream,
    standby: HotStandby | None,
) -> Replication:
    """The replication mode of the configuration (runtime/replication/modes.py)."""
    cluster = config.cluster
    assert cluster is not None
    if cluster.replication != "changes":
        # Every member holds a lease: its output waits once the ring may have moved on
        # without it (runtime/member/lease.py, "Replaying bytes").
        return ReplayingBytes(
            multicast,
            stream.event_seq,
            PrimaryLease(lambda: cpg.last_own_sent_at),
            cluster.netns or None,
        )
    # Shipping changes needs hot standby (the configuration says so).
    assert standby is not None
    shipping = Shipping(
        member,
        cluster.replicate,
        config.tick_ms,
        multicast.submit_nowait,
        lambda: multicast.queued_bytes,
    )
    return ShippingChanges(
        shipping,
        standby,
        # The primary keeps its clients while the ring carries its messages
        # (runtime/member/lease.py).
        PrimaryLease(lambda: cpg.last_own_sent_at),
        functools.partial(version_verdict, stream.membership),
        cluster.netns or None,
    )

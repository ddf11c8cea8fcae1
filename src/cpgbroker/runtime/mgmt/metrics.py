"""Prometheus metrics (``GET /metrics`` on the admin endpoint), read from the replica at scrape
time.

Every member replays every message of the cluster, so what one message costs bounds the
whole cluster's rate: nothing here counts anything per message. A scrape walks the model and
the member's status once (as ``cpgbroker status`` does) through a custom collector of
``prometheus_client``, which writes the text format.

Names follow RabbitMQ's Prometheus plugin where it has the metric (``rabbitmq_queue_*`` with
``vhost`` and ``queue`` labels as its per-object endpoint gives them, ``rabbitmq_connections``,
``rabbitmq_alarms_*``), so its dashboards find them; ``cpgbroker_*`` are ours: the event
order, the member's lag and the cluster's agreement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cpgbroker.runtime.mgmt.views import ClusterView

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class ReplicaCollector(Collector):
    """Collects from ``view()`` at each scrape."""

    def __init__(self, view: Callable[[], ClusterView]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        info = InfoMetricFamily(
            "rabbitmq_identity", "The member and the cluster", labels=["rabbitmq_node"]
        )
        # One cluster label for every member (dashboards group their nodes by it).
        info.add_metric([view.node], {"rabbitmq_cluster": view.cluster})
        yield info
        yield from _member_metrics(view)
        b = view.broker
        if b is None:
            return
        ready = GaugeMetricFamily(
            "rabbitmq_queue_messages_ready",
            "Messages ready to be delivered",
            labels=["vhost", "queue"],
        )
        unacked = GaugeMetricFamily(
            "rabbitmq_queue_messages_unacked",
            "Messages delivered and not yet acknowledged",
            labels=["vhost", "queue"],
        )
        total = GaugeMetricFamily(
            "rabbitmq_queue_messages",
            "Messages ready and unacknowledged",
            labels=["vhost", "queue"],
        )
        consumers = GaugeMetricFamily(
            "rabbitmq_queue_consumers", "Consumers on the queue", labels=["vhost", "queue"]
        )
        size = GaugeMetricFamily(
            "rabbitmq_queue_messages_bytes",
            "Body bytes of the queue's ready and unacknowledged messages",
            labels=["vhost", "queue"],
        )
        # Counters (rates are Prometheus' rate() of them): counted by this replica since it
        # has had the queue, so a member that took a state update starts them afresh.
        published = CounterMetricFamily(
            "cpgbroker_queue_messages_published",
            "Messages the queue took",
            labels=["vhost", "queue"],
        )
        delivered = CounterMetricFamily(
            "cpgbroker_queue_messages_delivered",
            "Messages the queue handed to consumers and gets",
            labels=["vhost", "queue"],
        )
        queues = 0
        for vh in b.vhosts.values():
            for q in vh.queues.values():
                labels = [vh.name, q.name]
                n = len(q.messages)
                ready.add_metric(labels, n)
                unacked.add_metric(labels, q.unacked)
                total.add_metric(labels, n + q.unacked)
                consumers.add_metric(labels, len(q.consumers))
                size.add_metric(labels, q.ready_bytes)
                published.add_metric(labels, q.published_total)
                delivered.add_metric(labels, q.delivered_total)
                queues += 1
        yield from (ready, unacked, total, consumers, size, published, delivered)
        conns = [c for c in b.connections.values()]
        yield _gauge("rabbitmq_queues", "Queues in the cluster", queues)
        yield _gauge("rabbitmq_connections", "Client connections in the cluster", len(conns))
        yield _gauge(
            "rabbitmq_channels", "Channels in the cluster", sum(len(c.channels) for c in conns)
        )
        yield _gauge(
            "rabbitmq_consumers",
            "Consumers in the cluster",
            sum(len(q.consumers) for vh in b.vhosts.values() for q in vh.queues.values()),
        )
        yield _gauge(
            "rabbitmq_alarms_memory_used_watermark",
            "1 while publishers are blocked by the memory mark (queued bodies above it)",
            1 if b.mark.memory_blocked else 0,
        )
        me = next((m.id for m in view.members if m.name == view.node), None)
        yield _gauge(
            "rabbitmq_alarms_free_disk_space_watermark",
            "1 while this member's store disk is below its free space limit",
            1 if me is not None and me in b.mark.disk_alarms else 0,
        )
        yield _gauge(
            "cpgbroker_disk_alarms",
            "Members whose store disk is low (publishers are blocked cluster-wide)",
            len(b.mark.disk_alarms),
        )
        yield _gauge("cpgbroker_queued_bytes", "Body bytes the queues hold", b.queued_bytes)
        yield _gauge(
            "cpgbroker_memory_mark_bytes",
            "The memory mark: publishers are blocked above it",
            b.config.high_watermark_bytes,
        )
        yield _gauge("cpgbroker_event_seq", "Events this member has applied", b.event_seq)


def _member_metrics(view: ClusterView) -> Iterator[Metric]:
    st = view.status
    state = GaugeMetricFamily(
        "cpgbroker_member_state", "1 for this member's state", labels=["state"]
    )
    state.add_metric([view.state], 1)
    yield state
    yield _gauge(
        "cpgbroker_members", "Members this member sees in the group", len(st.get("members") or ())
    )
    yield _gauge(
        "cpgbroker_members_ready",
        "Members that serve clients",
        sum(1 for m in view.members if m.state in ("ready", "standalone")),
    )
    software = st.get("software")
    if isinstance(software, dict):
        build = GaugeMetricFamily(
            "cpgbroker_build_info",
            "1, labelled with the release this member runs and the model versions it applies",
            labels=["release", "model_versions"],
        )
        lo, hi = [*(software.get("model_versions") or []), "?", "?"][:2]
        build.add_metric([str(software.get("release", "")), f"{lo}-{hi}"], 1)
        yield build
    if (version := _number(st.get("model_version"))) is not None:
        yield _gauge(
            "cpgbroker_model_version", "The model version the cluster's state runs at", version
        )
    upgrade = st.get("upgrade")
    if isinstance(upgrade, dict):
        yield _gauge(
            "cpgbroker_upgrade_pending",
            "1 while every member applies a newer model version than the cluster runs "
            "(cpgbroker cluster upgrade-finish moves it up)",
            1 if upgrade.get("pending") else 0,
        )
    conns = st.get("connections") or {}
    if (local := _number(conns.get("local"))) is not None:
        yield _gauge("cpgbroker_connections_local", "Clients connected to this member", local)
    lag = st.get("lag") or {}
    if (behind := _number(lag.get("events_behind"))) is not None:
        yield _gauge(
            "cpgbroker_member_lag_events", "Events this member is behind the slowest peer", behind
        )
    checkpoint = st.get("checkpoint")
    if isinstance(checkpoint, dict) and (seq := _number(checkpoint.get("seq"))) is not None:
        yield _gauge("cpgbroker_checkpoint_seq", "The last digest checkpoint's event", seq)
        yield _gauge(
            "cpgbroker_checkpoint_agreed",
            "1 if every member's digest agreed at the last checkpoint",
            1 if checkpoint.get("agreed") else 0,
        )
    checks = st.get("error_checks")
    if isinstance(checks, dict):
        yield _gauge(
            "cpgbroker_error_check_rounds",
            "Error-check rounds decided (the recent ones the member keeps)",
            len(checks.get("decided") or ()),
        )
        yield _gauge(
            "cpgbroker_error_check_held",
            "1 while an error-check round holds this member",
            0 if checks.get("held_at") is None else 1,
        )
    store = st.get("store")
    if isinstance(store, dict) and (durable := _number(store.get("durable_seq"))) is not None:
        yield _gauge("cpgbroker_store_durable_seq", "The last event fsynced to the store", durable)
    cpg = st.get("cpg")
    if isinstance(cpg, dict):
        for key, doc in (("sent", "CPG messages sent"), ("delivered", "CPG messages delivered")):
            if (n := _number(cpg.get(key))) is not None:
                yield CounterMetricFamily(f"cpgbroker_cpg_messages_{key}", doc, value=n)
        if (n := _number(cpg.get("sent_bytes"))) is not None:
            yield CounterMetricFamily(
                "cpgbroker_cpg_bytes_sent", "Bytes this member multicast", value=n
            )
    confirms = st.get("confirms")
    if isinstance(confirms, dict):
        for key, doc in (
            ("held", "Confirms (and output behind them) waiting until their event is stable"),
            ("admin_unsettled", "Management changes applied, waiting to be stable"),
        ):
            if (n := _number(confirms.get(key))) is not None:
                yield _gauge(f"cpgbroker_confirms_{key}", doc, n)
    update = st.get("update")
    if isinstance(update, dict):
        for key in ("messages", "total_messages", "bytes"):
            if (n := _number(update.get(key))) is not None:
                yield _gauge(
                    f"cpgbroker_update_{key}",
                    f"State update this member is taking: {key.replace('_', ' ')} so far",
                    n,
                )
    updating = st.get("updating")
    if isinstance(updating, list):
        yield _gauge("cpgbroker_updates_giving", "State updates this member gives", len(updating))
    times = st.get("apply_seconds")
    if isinstance(times, dict):
        hist = HistogramMetricFamily(
            "cpgbroker_event_apply_seconds",
            "Time to apply one event to the model (one event in APPLY_SAMPLE is timed)",
            buckets=[(str(b), c) for b, c in times["buckets"]],
            sum_value=times["sum"],
        )
        yield hist
    quorum = st.get("quorum")
    if isinstance(quorum, dict) and "quorate" in quorum:
        yield _gauge(
            "cpgbroker_quorate",
            "1 while the member's ring is quorate",
            1 if quorum["quorate"] else 0,
        )
    if isinstance(lb := st.get("local"), dict):
        for key, doc in (
            ("connections", "Clients of this member's member-local listeners"),
            ("queues", "Queues of this member's member-local broker (not replicated)"),
            ("messages", "Messages in them, ready and unacknowledged"),
        ):
            yield _gauge(f"cpgbroker_local_{key}", doc, _number(lb.get(key)) or 0)
    if (refused := _number(st.get("refused_connections"))) is not None:
        yield _gauge(
            "cpgbroker_refused_connections",
            "Clients turned away while this member did not serve",
            refused,
        )


def registry_for(view: Callable[[], ClusterView]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaCollector(view))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format of one scrape."""
    return generate_latest(registry)

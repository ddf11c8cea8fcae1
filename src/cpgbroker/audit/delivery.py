"""Delivery guarantees from the clients' histories: the Jepsen-style total-queue check, order,
and the redelivered flag. What each check means is in ``docs/audit.md``; in short:

* **lost**: confirmed (publisher confirm ``ack``), never delivered to anyone, or delivered
  only to consumers that acknowledge and never acknowledged (given back, never delivered
  again); unless a whole-cluster restart after its publish may have dropped it (a transient
  message, or one for a non-durable queue: ``restarts.py``);
* **unexpected**: delivered, never published;
* **duplicated**: delivered again although the earlier delivery was not given back (its
  consumer acked it, or still held it on a live connection), outside every failure window;
* **order**: a consumer received, not flagged redelivered, a message of one producer after a
  later message of that producer from the same queue, on one connection;
* **redelivered flag**: a message delivered again without ``redelivered`` (unless a
  whole-cluster restart forgot the earlier delivery: it came after the last event the resumed
  store held); or a first delivery flagged ``redelivered`` before anything could have requeued
  a message.

Everything is computed by Spark: one aggregation per message (the ``messages`` table, written
as Parquet and read back by the later steps), window functions over each consumer's deliveries
and over the deliveries of the (few) messages delivered more than once. The driver only sees
counts, examples, the client sessions and the fault log (small by nature).
"""

from __future__ import annotations

from typing import Any

import attrs
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cpgbroker.audit.common import NS_PER_MS, violations
from cpgbroker.audit.ingest import BAD
from cpgbroker.audit.restarts import Restart, iso
from cpgbroker.audit.schemas import DISRUPTIVE, RECOVERING

# The driver takes at most this many fault-log records.
MAX_FAULTS = 100_000
# A larger set of out-of-order deliveries is not broadcast to be matched with its messages.
BROADCAST_AT_MOST = 1_000_000
# A failure window's action for a whole-cluster restart (found in the event logs).
CLUSTER_RESTART = "cluster-restart"
NEVER = 1 << 62


def load(spark: SparkSession, staged: str) -> DataFrame:
    return spark.read.parquet(staged).where(F.col("_state") != BAD)


@attrs.frozen
class FailureWindow:
    """A failure window: from a fault until its member came back, plus the settling time."""

    start: int
    end: int
    action: str
    node: int


def _delivery_violation(df: DataFrame, kind: str, detail: Column) -> DataFrame:
    """Violations found on deliveries: each names its message, queue, client, member and time."""
    return violations(
        df,
        kind,
        producer="producer",
        seq="seq",
        queue="queue",
        client="client",
        member="member",
        t_ns="t_ns",
        detail=detail,
    )


def failure_windows(faults: list[dict[str, Any]], settle_ns: int) -> list[FailureWindow]:
    """``[fault, recovery + settle]`` for every disruptive fault; recovery is the node's next
    resume/heal/start for a stop or partition, the fault itself for a kill or restart (the
    member is gone at once; what follows is its clients failing over)."""
    out = []
    ordered = sorted(faults, key=lambda f: f["t_ns"])
    for i, f in enumerate(ordered):
        if f["action"] not in DISRUPTIVE:
            continue
        end = f["t_ns"]
        if f["action"] in ("stop", "partition"):
            end = next(
                (
                    g["t_ns"]
                    for g in ordered[i + 1 :]
                    if g["node"] == f["node"] and g["action"] in RECOVERING
                ),
                # Never recovered: the window stays open to the end of the run.
                1 << 62,
            )
        out.append(FailureWindow(f["t_ns"], min(end + settle_ns, 1 << 62), f["action"], f["node"]))
    return out


def restart_windows(restarts: list[Restart], settle_ns: int) -> list[FailureWindow]:
    """``[cluster down, cluster back + settle]`` for every whole-cluster restart (from when the
    last member was gone, as far as the inputs tell, else from when it came back)."""
    return [
        FailureWindow(
            r.down_from_ns if r.down_from_ns is not None else r.t_ns,
            min(r.t_ns + settle_ns, NEVER),
            CLUSTER_RESTART,
            0,
        )
        for r in restarts
    ]


def messages(history: DataFrame, tables: str) -> None:
    """One row per message: what happened to it from publish to ack (the ``messages`` table)."""
    op = F.col("op")
    pub = op == "publish"
    dlv = op == "deliver"
    rank = (
        F.when(F.col("outcome") == "ack", 3)
        .when(F.col("outcome") == "nack", 2)
        .when(F.col("outcome") == "unknown", 1)
    )
    agg = (
        history.where(op.isin("publish", "confirm", "deliver", "ack", "nack"))
        .groupBy("producer", "seq")
        .agg(
            F.sum(pub.cast("int")).alias("n_publish"),
            F.min(
                F.when(
                    pub, F.struct("t_ns", "queue", "client", "confirms", "persistent", "durable")
                )
            ).alias("pub"),
            F.max(F.when(op == "confirm", rank)).alias("rank"),
            F.min(F.when((op == "confirm") & (F.col("outcome") == "ack"), F.col("t_ns"))).alias(
                "t_confirm"
            ),
            F.sum(dlv.cast("int")).alias("n_deliver"),
            F.min(
                F.when(
                    dlv,
                    F.struct("t_ns", "client", "n", "session", "redelivered", "member", "queue"),
                )
            ).alias("first"),
            F.max(F.when(dlv, F.struct("t_ns", "client"))).alias("last"),
            F.sum((dlv & F.col("redelivered")).cast("int")).alias("n_redelivered"),
            F.sum((op == "ack").cast("int")).alias("n_ack"),
            # Rejected or nacked without requeue: settled, as an ack is.
            F.sum(((op == "nack") & ~F.coalesce(F.col("requeue"), F.lit(True))).cast("int")).alias(
                "n_dropped"
            ),
        )
    )
    outcome = (
        F.when(F.col("rank") == 3, "ack")
        .when(F.col("rank") == 2, "nack")
        .when(F.col("rank") == 1, "unknown")
        .when(F.col("n_publish") == 0, None)
        # Published on a channel without confirms: nothing was promised.
        .when(~F.coalesce(F.col("pub.confirms"), F.lit(True)), "none")
        .otherwise("unknown")
    )
    agg.select(
        "producer",
        "seq",
        F.coalesce("pub.queue", "first.queue").alias("queue"),
        "n_publish",
        F.col("pub.t_ns").alias("t_publish"),
        F.col("pub.client").alias("publisher"),
        outcome.alias("outcome"),
        # Null: the history did not say (recorders before whole-cluster restarts).
        F.col("pub.persistent").alias("persistent"),
        F.col("pub.durable").alias("durable"),
        "t_confirm",
        "n_deliver",
        F.col("first.t_ns").alias("t_deliver"),
        F.col("first.client").alias("first_consumer"),
        F.col("first.member").alias("first_member"),
        F.col("first.redelivered").alias("first_redelivered"),
        "n_redelivered",
        "n_ack",
        "n_dropped",
        F.col("last.client").alias("last_consumer"),
        ((F.col("first.t_ns") - F.col("pub.t_ns")) / NS_PER_MS).alias("latency_ms"),
        ((F.col("t_confirm") - F.col("pub.t_ns")) / NS_PER_MS).alias("confirm_ms"),
    ).write.mode("overwrite").parquet(f"{tables}/messages")


def sessions(history: DataFrame, tables: str) -> DataFrame:
    """One row per client connection: member, start, end and how it ended (``disconnect``, the
    client's next ``connect``, or the end of the client's history)."""
    op = F.col("op")
    per = history.groupBy("client", "session").agg(
        F.min("t_ns").alias("t_first"),
        F.max("t_ns").alias("t_last"),
        F.min(F.when(op == "connect", F.struct("t_ns", "member"))).alias("c"),
        F.min(F.when(op == "disconnect", F.struct("t_ns", "reason"))).alias("d"),
    )
    w = Window.partitionBy("client").orderBy("session")
    nxt = F.lead("t_first").over(w)
    out = per.select(
        "client",
        "session",
        F.col("c.member").alias("member"),
        F.coalesce("c.t_ns", "t_first").alias("t_start"),
        F.coalesce("d.t_ns", nxt, "t_last").alias("t_end"),
        # The earliest the connection may have died: after the client's last record of it
        # (the broker may requeue before the client notices, or before it reconnects).
        "t_last",
        F.when(F.col("d.t_ns").isNotNull(), "disconnect")
        .when(nxt.isNotNull(), "reconnect")
        .otherwise("history-end")
        .alias("ended_by"),
        F.col("d.reason").alias("reason"),
        nxt.alias("t_next"),
    )
    out.write.mode("overwrite").parquet(f"{tables}/sessions")
    return out.sparkSession.read.parquet(f"{tables}/sessions")


def first_disturbance(
    history: DataFrame, sess: DataFrame, windows: list[FailureWindow]
) -> int | None:
    """The first moment anything could have requeued a message: a fault, a client connection
    ending before its history did, a nack with requeue."""
    # Every session counts: one that ends the history without a disconnect record may be a
    # client that crashed holding messages (a still-connected client's ends with the run).
    t_sess = sess.agg(F.min("t_last")).collect()[0][0]
    t_nack = (
        history.where((F.col("op") == "nack") & F.col("requeue")).agg(F.min("t_ns")).collect()[0][0]
    )
    ts = [t for t in (t_sess, t_nack, *(w.start for w in windows)) if t is not None]
    return min(ts) if ts else None


def _windows_df(spark: SparkSession, windows: list[FailureWindow]) -> DataFrame:
    return spark.createDataFrame(
        [(w.start, w.end) for w in windows] or [(0, -1)], "w_start long, w_end long"
    )


def checks(
    spark: SparkSession,
    history: DataFrame,
    tables: str,
    windows: list[FailureWindow],
    settle_ns: int,
    restarts: list[Restart] | None = None,
) -> tuple[dict[str, dict[str, Any]], list[DataFrame]]:
    """The delivery checks; the messages and sessions tables must exist. ``windows``: every
    failure window, the whole-cluster restarts' included. Returns a summary per check and the
    violations (as DataFrames to be written)."""
    restarts = sorted(restarts or [], key=lambda r: r.t_ns)
    msgs = spark.read.parquet(f"{tables}/messages")
    sess = spark.read.parquet(f"{tables}/sessions")
    found: list[DataFrame] = []
    t0 = first_disturbance(history, sess, windows)

    lost, dropped = _lost(history, msgs, restarts)
    found.append(lost)
    unexpected = msgs.where((F.col("n_publish") == 0) & (F.col("n_deliver") > 0))
    found.append(
        violations(
            unexpected,
            "unexpected",
            producer="producer",
            seq="seq",
            queue="queue",
            client="first_consumer",
            t_ns="t_deliver",
            detail=F.format_string("delivered %d times, never published", F.col("n_deliver")),
        )
    )
    spurious = msgs.where(
        F.col("first_redelivered") & (F.col("t_deliver") < F.lit(t0 if t0 is not None else 1 << 62))
    )
    found.append(
        violations(
            spurious,
            "redelivered_flag",
            producer="producer",
            seq="seq",
            queue="queue",
            client="first_consumer",
            member="first_member",
            t_ns="t_deliver",
            detail=F.lit("first delivery flagged redelivered before anything could requeue it"),
        )
    )

    found.extend(_delivered_again(spark, history, msgs, sess, windows, settle_ns, restarts))
    found.extend(_out_of_order(history, msgs))
    context = {
        "first_disturbance_ns": t0,
        "failure_windows": len(windows),
        "dropped_by_restart": dropped,
    }
    return {"context": context}, found


def _lost(history: DataFrame, msgs: DataFrame, restarts: list[Restart]) -> tuple[DataFrame, int]:
    """Confirmed messages nobody consumed: never delivered, or delivered only to consumers that
    acknowledge and never acknowledged (given back when their connection ended, never delivered
    again). A whole-cluster restart after its publish may drop a transient message or one for
    a non-durable queue: those are counted (returned), not lost. A history that did not record
    ``persistent`` or ``durable`` makes the message one a restart must keep."""
    op = F.col("op")
    # Clients that acknowledge what they get (they recorded an ack, nack or reject).
    acking = (
        history.where(op.isin("ack", "nack"))
        .select(F.col("client").alias("last_consumer"))
        .distinct()
        .withColumn("acks", F.lit(True))
    )
    m = msgs.where(F.col("outcome") == "ack").join(F.broadcast(acking), "last_consumer", "left")
    unconsumed = (F.col("n_deliver") == 0) | (
        (F.col("n_ack") == 0) & (F.col("n_dropped") == 0) & F.coalesce(F.col("acks"), F.lit(False))
    )
    kept = F.coalesce(F.col("persistent"), F.lit(True)) & F.coalesce(F.col("durable"), F.lit(True))
    # The first restart after the publish, if any (restarts are few), named by its time.
    restart_after: Column = F.lit(None).cast("string")
    for r in reversed(restarts):
        restart_after = F.when(F.col("t_publish") < F.lit(r.t_ns), F.lit(iso(r.t_ns))).otherwise(
            restart_after
        )
    m = m.where(unconsumed).withColumn("restart_after", restart_after)
    may_drop = ~kept & F.col("restart_after").isNotNull()
    dropped = m.where(may_drop).count() if restarts else 0
    what = F.when(F.col("n_deliver") == 0, F.lit("confirmed, never delivered")).otherwise(
        F.format_string(
            "confirmed, delivered %d times, never acknowledged (given back, never delivered again)",
            F.col("n_deliver"),
        )
    )
    kind = F.when(
        F.col("persistent").isNull() | F.col("durable").isNull(),
        "persistence not recorded: taken as persistent for a durable queue",
    ).otherwise("persistent, durable queue")
    across = F.when(
        F.col("restart_after").isNotNull(),
        F.concat(
            F.lit("; published before the whole-cluster restart at "),
            F.col("restart_after"),
            F.lit(" ("),
            kind,
            F.lit(")"),
        ),
    ).otherwise("")
    lost = violations(
        m.where(~may_drop),
        "lost",
        producer="producer",
        seq="seq",
        queue="queue",
        client="publisher",
        t_ns="t_publish",
        detail=F.concat(what, across),
    )
    return lost, dropped


def _small(df: DataFrame, n: int) -> DataFrame:
    # A set known to be small is sent to every task rather than shuffled against a big one.
    return F.broadcast(df) if n <= BROADCAST_AT_MOST else df


def _delivered_again(
    spark: SparkSession,
    history: DataFrame,
    msgs: DataFrame,
    sess: DataFrame,
    windows: list[FailureWindow],
    settle_ns: int,
    restarts: list[Restart],
) -> list[DataFrame]:
    """Messages delivered more than once: was each later delivery allowed, and flagged?"""
    again = msgs.where((F.col("n_deliver") >= 2) & (F.col("n_publish") <= 1)).select(
        "producer", "seq"
    )
    n_again = again.count()
    if not n_again:
        return []
    again = _small(again, n_again)
    dlv = history.where(F.col("op") == "deliver").join(again, ["producer", "seq"], "left_semi")
    w = Window.partitionBy("producer", "seq").orderBy("t_ns", "client", "n")
    later = dlv.select(
        "producer",
        "seq",
        "queue",
        "client",
        "session",
        "member",
        "t_ns",
        "redelivered",
        F.row_number().over(w).alias("k"),
        F.lag("client").over(w).alias("p_client"),
        F.lag("session").over(w).alias("p_session"),
        F.lag("t_ns").over(w).alias("p_t"),
    ).where(F.col("k") >= 2)
    # A whole-cluster restart forgets a delivery made after the last event the resumed store
    # held: the message comes back as never delivered, without the flag. When that event was
    # applied is known from the logs before the restart, or bounded by their last event before
    # it (they may end early); with no log before the restart, any delivery before it counts.
    forgotten: Column = F.lit(False)
    for r in restarts:
        since = F.lit(True) if r.state_applied_ns is None else F.col("p_t") >= r.state_applied_ns
        forgotten = forgotten | (since & (F.col("p_t") < r.t_ns) & (F.col("t_ns") >= r.t_ns))
    found = [
        _delivery_violation(
            later.where(~F.col("redelivered") & ~forgotten),
            "redelivered_flag",
            detail=F.format_string("delivery %d not flagged redelivered", F.col("k")),
        )
    ]
    # Given back before this delivery? Its previous recipient's acks/requeues and session end.
    settles = (
        history.where(F.col("op").isin("ack", "nack"))
        .join(again, ["producer", "seq"], "left_semi")
        .groupBy("client", "session", "producer", "seq")
        .agg(
            F.min(F.when(F.col("op") == "ack", F.col("t_ns"))).alias("t_ack"),
            F.min(F.when((F.col("op") == "nack") & F.col("requeue"), F.col("t_ns"))).alias(
                "t_requeue"
            ),
        )
        .withColumnsRenamed({"client": "p_client", "session": "p_session"})
    )
    ends = sess.select(
        F.col("client").alias("p_client"), F.col("session").alias("p_session"), "t_last"
    )
    judged = (
        later.join(settles, ["p_client", "p_session", "producer", "seq"], "left")
        .join(F.broadcast(ends), ["p_client", "p_session"], "left")
        # Outside every failure window only.
        .join(
            F.broadcast(_windows_df(spark, windows)),
            F.col("t_ns").between(F.col("w_start"), F.col("w_end")),
            "left_anti",
        )
    )
    t = F.col("t_ns")
    requeued = F.coalesce(F.col("t_requeue") < t, F.lit(False))
    # Its connection ended first; an ack sent shortly before that may have died with it.
    ended = F.coalesce(F.col("t_last") <= t, F.lit(False)) & (
        F.col("t_ack").isNull()
        | (F.col("t_ack") >= t)
        | (F.col("t_last") - F.col("t_ack") <= settle_ns)
    )
    dup = judged.where(~(requeued | ended))
    found.append(
        _delivery_violation(
            dup,
            "duplicated",
            detail=F.format_string(
                "delivery %d; previous to %s (session %d) %s",
                F.col("k"),
                F.col("p_client"),
                F.col("p_session"),
                F.when(F.col("t_ack") < t, "acked it").otherwise("still held it"),
            ),
        )
    )
    return found


def _out_of_order(history: DataFrame, msgs: DataFrame) -> list[DataFrame]:
    """Per connection, consumer, queue and producer, deliveries not flagged redelivered must come
    in publish order (seq). Only confirmed (or confirm-less) messages count: a message whose
    publish was in doubt may enter the queue late, after its producer failed over."""
    ow = (
        Window.partitionBy("client", "session", "consumer", "queue", "producer")
        .orderBy("n")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    late = (
        history.where((F.col("op") == "deliver") & ~F.col("redelivered"))
        .select(
            "client",
            "session",
            "consumer",
            "queue",
            "producer",
            "seq",
            "member",
            "t_ns",
            F.max("seq").over(ow).alias("after"),
        )
        .where(F.col("seq") < F.col("after"))
    )
    n_late = late.count()
    if not n_late:
        return []
    promised = msgs.where(F.col("outcome").isin("ack", "none")).select("producer", "seq")
    late_promised = promised.join(_small(late, n_late), ["producer", "seq"])
    return [
        _delivery_violation(
            late_promised,
            "order",
            detail=F.format_string(
                "seq %d delivered after seq %d (consumer %s, session %d)",
                F.col("seq"),
                F.col("after"),
                F.col("consumer"),
                F.col("session"),
            ),
        )
    ]

"""Performance from the histories: throughput and latency per second (for the whole cluster,
per member and per queue) and failover gaps (from a fault to each affected client resuming).

Percentiles are Spark's ``percentile_approx`` (rank error within 0.1 %, see ``common.ACCURACY``).
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cpgbroker.audit.common import ACCURACY, NS_PER_MS, rows, second
from cpgbroker.audit.delivery import CLUSTER_RESTART, FailureWindow
from cpgbroker.audit.restarts import Restart
from cpgbroker.audit.schemas import DISRUPTIVE

QUANTILES = [0.5, 0.95, 0.99]
# The driver keeps at most this many per-second rows for the plots (about 8 hours of a run).
MAX_PLOT_SECONDS = 30_000
# Affected client connections shown in the verdict and the report (the table has them all).
MAX_FAILOVER_ROWS = 1_000


def _scope(gid: Any, member_bit: int, queue_bit: int) -> Any:
    """Name the grouping set a row belongs to from Spark's grouping_id()."""
    return (
        F.when(gid == member_bit | queue_bit, "all")
        .when(gid == queue_bit, "member")
        .when(gid == member_bit, "queue")
        .otherwise("run")
    )


def throughput(spark: SparkSession, tables: str) -> dict[str, Any]:
    """The ``throughput`` table; returns the run's totals and overall percentiles."""
    msgs = spark.read.parquet(f"{tables}/messages")
    # grouping_id(): bit 1 = member left out, bit 0 = queue left out (sec is bit 2).
    delivered = (
        msgs.where(F.col("n_deliver") > 0)
        .select(
            second("t_deliver").alias("sec"),
            F.col("first_member").alias("member"),
            "queue",
            "latency_ms",
            "n_deliver",
        )
        .groupingSets([["sec"], ["sec", "member"], ["sec", "queue"], []], "sec", "member", "queue")
        .agg(
            F.grouping_id().alias("gid"),
            F.count(F.lit(1)).alias("delivered"),
            F.sum("n_deliver").alias("deliveries"),
            F.percentile_approx("latency_ms", QUANTILES, ACCURACY).alias("latency_ms"),
            F.max("latency_ms").alias("latency_max_ms"),
        )
    )
    published = (
        msgs.where(F.col("n_publish") > 0)
        .select(
            second("t_publish").alias("sec"),
            F.lit(None).cast("string").alias("member"),
            "queue",
            "outcome",
            "confirm_ms",
        )
        .groupingSets([["sec"], ["sec", "queue"], []], "sec", "member", "queue")
        .agg(
            F.grouping_id().alias("gid"),
            F.count(F.lit(1)).alias("published"),
            F.sum((F.col("outcome") == "ack").cast("long")).alias("confirmed"),
            F.sum((F.col("outcome") == "nack").cast("long")).alias("nacked"),
            F.percentile_approx("confirm_ms", QUANTILES, ACCURACY).alias("confirm_ms"),
        )
    )
    d, p = delivered.alias("d"), published.alias("p")
    key = ["gid", "sec", "member", "queue"]
    # Null-safe: the grouping sets leave key columns null.
    on = [F.col(f"d.{k}").eqNullSafe(F.col(f"p.{k}")) for k in key]
    k = {c: F.coalesce(F.col(f"d.{c}"), F.col(f"p.{c}")) for c in key}
    table = d.join(p, on, "full_outer").select(
        _scope(k["gid"], 2, 1).alias("scope"),
        k["sec"].alias("sec"),
        F.coalesce(k["member"], k["queue"]).alias("key"),
        *(
            F.coalesce(F.col(c), F.lit(0)).alias(c)
            for c in ("published", "confirmed", "nacked", "delivered", "deliveries")
        ),
        *(
            F.col("latency_ms")[i].alias(f"latency_p{int(q * 100)}_ms")
            for i, q in enumerate(QUANTILES)
        ),
        "latency_max_ms",
        *(
            F.col("confirm_ms")[i].alias(f"confirm_p{int(q * 100)}_ms")
            for i, q in enumerate(QUANTILES)
        ),
    )
    table.write.mode("overwrite").parquet(f"{tables}/throughput")
    table = spark.read.parquet(f"{tables}/throughput")
    run = rows(table.where(F.col("scope") == "run").drop("scope", "sec", "key"))
    totals = run[0] if run else {}
    return {
        "published": totals.get("published", 0),
        "confirmed": totals.get("confirmed", 0),
        "nacked": totals.get("nacked", 0),
        "delivered": totals.get("delivered", 0),
        "deliveries": totals.get("deliveries", 0),
        "latency_ms": {
            k.removeprefix("latency_").removesuffix("_ms"): totals.get(k)
            for k in ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "latency_max_ms")
        },
        "confirm_ms": {
            k.removeprefix("confirm_").removesuffix("_ms"): totals.get(k)
            for k in ("confirm_p50_ms", "confirm_p95_ms", "confirm_p99_ms")
        },
    }


def plot_series(spark: SparkSession, tables: str) -> list[dict[str, Any]]:
    """Per-second rows of the whole cluster and per member (small: for the plots)."""
    table = spark.read.parquet(f"{tables}/throughput").where(F.col("scope").isin("all", "member"))
    # The first MAX_PLOT_SECONDS seconds of the run, every row of each (the whole cluster and
    # every member), so a long run's plots are cut at a second, never inside one.
    first = table.where(F.col("scope") == "all").agg(F.min("sec")).collect()[0][0]
    if first is None:
        return []
    return rows(
        table.where(F.col("sec") < first + MAX_PLOT_SECONDS).orderBy("sec", "scope", "key"),
        limit=None,
    )


def _host_port(url: Column) -> Column:
    """``amqp://user:pw@host:port/vhost`` -> ``host:port``: faults and clients may name one
    member by URLs that differ in credentials or vhost."""
    return F.regexp_extract(url, r"^(?:[a-z0-9+]+://)?(?:[^@/]*@)?([^/?]*)", 1)


def _gap_ms(col: str) -> Column:
    return F.round((F.col(col) - F.col("t_fault")) / NS_PER_MS, 3)


def failover(
    spark: SparkSession,
    history: DataFrame,
    tables: str,
    faults: list[dict[str, Any]],
    windows: list[FailureWindow],
    restarts: list[Restart] | None = None,
    settle_ns: int = 0,
) -> list[dict[str, Any]]:
    """For each disruptive fault, each client whose connection ended within the fault's failure
    window (and, when the fault names the member's URL, was connected to that member), not by
    the client's own choice: when it reconnected and when it next got a delivery or a confirm.
    ``windows``: the faults' (``delivery.failure_windows``).

    For each whole-cluster restart (action ``cluster-restart``, from when the cluster was down),
    each client's last connection from before the cluster went down that ended, not by the
    client's choice, between ``settle_ns`` before it and ``settle_ns`` after the cluster was
    back: when the client was back, and served again.

    A join on the executors (sessions x faults); the driver gets the affected connections,
    at most ``MAX_FAILOVER_ROWS`` of them (all are in the ``failover`` table)."""
    disruptive = [f for f in sorted(faults, key=lambda f: f["t_ns"]) if f["action"] in DISRUPTIVE]
    restarts = sorted(restarts or [], key=lambda r: r.t_ns)
    if not disruptive and not restarts:
        return []
    sess = spark.read.parquet(f"{tables}/sessions")
    parts = []
    if disruptive:
        parts.append(_fault_sessions(spark, sess, disruptive, windows))
    if restarts:
        parts.append(_restart_sessions(spark, sess, restarts, len(disruptive), settle_ns))
    affected = parts[0]
    for part in parts[1:]:
        affected = affected.unionByName(part)
    ok = (F.col("op") == "deliver") | ((F.col("op") == "confirm") & (F.col("outcome") == "ack"))
    resumed = (
        history.where(ok)
        .select(F.col("client").alias("r_client"), "t_ns")
        .join(
            affected.select("fault", "client", "t_reconnect"),
            (F.col("r_client") == F.col("client")) & (F.col("t_ns") > F.col("t_reconnect")),
        )
        .groupBy("fault", "client")
        .agg(F.min("t_ns").alias("t_resume"))
    )
    table = affected.join(resumed, ["fault", "client"], "left").select(
        "fault",
        "action",
        "node",
        "t_fault",
        "client",
        "session",
        "member",
        "t_lost",
        "t_reconnect",
        "t_resume",
        _gap_ms("t_reconnect").alias("reconnect_gap_ms"),
        _gap_ms("t_resume").alias("resume_gap_ms"),
    )
    table.write.mode("overwrite").parquet(f"{tables}/failover")
    return rows(
        spark.read.parquet(f"{tables}/failover").orderBy("fault", "client", "session"),
        limit=MAX_FAILOVER_ROWS,
    )


def _not_by_choice() -> Column:
    """A connection the client lost: it did not finish, nor close it itself."""
    return (F.col("ended_by") != "history-end") & F.coalesce(
        F.col("reason") != "closed", F.lit(True)
    )


def _fault_sessions(
    spark: SparkSession,
    sess: DataFrame,
    disruptive: list[dict[str, Any]],
    windows: list[FailureWindow],
) -> DataFrame:
    # failure_windows() yields one window per disruptive fault, in time order.
    fdf = spark.createDataFrame(
        [
            (i, f["action"], f["node"], f["t_ns"], w.end, f.get("url"))
            for i, (f, w) in enumerate(zip(disruptive, windows, strict=True))
        ],
        "fault long, action string, node long, t_fault long, w_end long, f_url string",
    )
    return sess.join(
        F.broadcast(fdf),
        (F.col("t_start") <= F.col("t_fault"))
        & (F.col("t_fault") <= F.col("t_end"))
        & (F.col("t_end") <= F.col("w_end"))
        # The client finished, or closed the connection itself: not a failover.
        & _not_by_choice()
        & (
            F.col("f_url").isNull()
            | F.col("member").isNull()
            | (_host_port(F.col("f_url")) == _host_port(F.col("member")))
        ),
    ).select(
        "fault",
        "action",
        "node",
        "t_fault",
        "client",
        "session",
        "member",
        F.col("t_end").alias("t_lost"),
        F.col("t_next").alias("t_reconnect"),
    )


def _restart_sessions(
    spark: SparkSession, sess: DataFrame, restarts: list[Restart], first: int, settle_ns: int
) -> DataFrame:
    rdf = spark.createDataFrame(
        [
            (
                first + k,
                CLUSTER_RESTART,
                r.down_from_ns if r.down_from_ns is not None else r.t_ns,
                r.t_ns,
            )
            for k, r in enumerate(restarts)
        ],
        "fault long, action string, t_fault long, t_back long",
    )
    latest = Window.partitionBy("fault", "client").orderBy(F.col("session").desc())
    return (
        sess.join(
            F.broadcast(rdf),
            (F.col("t_start") < F.col("t_fault"))
            & (F.col("t_end") >= F.col("t_fault") - settle_ns)
            & (F.col("t_end") <= F.col("t_back") + settle_ns)
            & _not_by_choice(),
        )
        .select("*", F.row_number().over(latest).alias("k"))
        .where(F.col("k") == 1)
        .select(
            "fault",
            "action",
            F.lit(None).cast("long").alias("node"),
            "t_fault",
            "client",
            "session",
            "member",
            F.col("t_end").alias("t_lost"),
            F.col("t_next").alias("t_reconnect"),
        )
    )

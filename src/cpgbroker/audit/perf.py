"""Performance from the histories: throughput and latency per second (for the whole cluster,
per member and per queue) and failover gaps (from a fault to each affected client resuming).

Percentiles are Spark's ``percentile_approx`` (rank error within 0.1 %, see ``common.ACCURACY``).
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cpgbroker.audit.common import ACCURACY, NS_PER_MS, rows, second
from cpgbroker.audit.delivery import MAX_SESSIONS
from cpgbroker.audit.schemas import DISRUPTIVE

QUANTILES = [0.5, 0.95, 0.99]
# The driver keeps at most this many per-second rows for the plots (about 8 hours of a run).
MAX_PLOT_SECONDS = 30_000


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
    table = spark.read.parquet(f"{tables}/throughput")
    return rows(
        table.where(F.col("scope").isin("all", "member")).orderBy("sec", "scope", "key"),
        limit=MAX_PLOT_SECONDS * 8,
    )


def _host_port(url: str | None) -> str | None:
    """``amqp://user:pw@host:port/vhost`` -> ``host:port``: faults and clients may name one
    member by URLs that differ in credentials or vhost."""
    if not url:
        return None
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit("@", 1)[-1]


def failover(
    spark: SparkSession,
    history: DataFrame,
    tables: str,
    faults: list[dict[str, Any]],
    settle_ns: int,
) -> list[dict[str, Any]]:
    """For each disruptive fault, each client whose connection ended within ``settle_ns`` after
    it (and, when the fault names the member's URL, was connected to that member): when it
    reconnected and when it next got a delivery or a confirm."""
    if not any(f["action"] in DISRUPTIVE for f in faults):
        return []
    sess = rows(spark.read.parquet(f"{tables}/sessions"), limit=MAX_SESSIONS)
    affected: list[dict[str, Any]] = []
    for i, f in enumerate(sorted(faults, key=lambda f: f["t_ns"])):
        if f["action"] not in DISRUPTIVE:
            continue
        t = f["t_ns"]
        where = _host_port(f.get("url"))
        for s in sess:
            if not (s["t_start"] <= t <= s["t_end"] <= t + settle_ns):
                continue
            if s["ended_by"] == "history-end" or s["reason"] == "closed":
                continue  # the client finished, or closed the connection itself
            if where and s["member"] and _host_port(s["member"]) != where:
                continue
            affected.append(
                {
                    "fault": i,
                    "action": f["action"],
                    "node": f["node"],
                    "t_fault": t,
                    "client": s["client"],
                    "session": s["session"],
                    "member": s["member"],
                    "t_lost": s["t_end"],
                    "t_reconnect": s["t_next"],
                }
            )
    if not affected:
        return []
    want = spark.createDataFrame(
        [(a["fault"], a["client"], a["t_reconnect"] or (1 << 62)) for a in affected],
        "fault long, w_client string, t_reconnect long",
    )
    ok = (F.col("op") == "deliver") | ((F.col("op") == "confirm") & (F.col("outcome") == "ack"))
    resumed = {
        (r["fault"], r["w_client"]): r["t_resume"]
        for r in history.where(ok)
        .select("client", "t_ns")
        .join(
            F.broadcast(want),
            (F.col("client") == F.col("w_client")) & (F.col("t_ns") > F.col("t_reconnect")),
        )
        .groupBy("fault", "w_client")
        .agg(F.min("t_ns").alias("t_resume"))
        .collect()
    }
    for a in affected:
        a["t_resume"] = resumed.get((a["fault"], a["client"]))
        for name, key in (("reconnect", "t_reconnect"), ("resume", "t_resume")):
            a[f"{name}_gap_ms"] = (
                None if a[key] is None else round((a[key] - a["t_fault"]) / NS_PER_MS, 3)
            )
    spark.createDataFrame(
        affected,
        "fault long, action string, node long, t_fault long, client string, session long, "
        "member string, t_lost long, t_reconnect long, t_resume long, "
        "reconnect_gap_ms double, resume_gap_ms double",
    ).write.mode("overwrite").parquet(f"{tables}/failover")
    return affected

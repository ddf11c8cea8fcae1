"""Checks on the members' event logs: replica consistency and total order, and per-member lag.

Total order, without bringing a stream to the driver: applied events are keyed by sequence
number and shuffled so that each sequence number's records from every member meet in one
window partition. There a fingerprint of the event (sender, type, connection, size: what every
replica logs alike) is compared as ``min == max`` across members, and each member's time is
compared with the first member's (its lag). The window's output is aggregated per second and
member before anything is collected, so the driver receives a few rows per second of the run,
whatever its size. The divergent records themselves go to a Parquet table.

Replica consistency: the digest checkpoints of all members are grouped by sequence number; a
checkpoint with more than one distinct digest, or a member's verdict saying the vote
disagreed, is a divergence.

Both compare within one era only (``restarts.py``): after a whole-cluster restart the
sequence numbers go on from the state a store held, so the events the members logged after
that point before the restart and the events after the restart share their numbers.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cpgbroker.audit.common import ACCURACY, NS_PER_MS, rows, second, violations
from cpgbroker.audit.ingest import BAD
from cpgbroker.audit.schemas import NOT_APPLIED

# Events shown on each side of the first divergence.
AROUND = 3


def load(spark: SparkSession, staged: str) -> DataFrame:
    return (
        spark.read.parquet(staged)
        .where(F.col("_state") != BAD)
        .withColumn("incarnation", F.coalesce("incarnation", F.lit(1)))
    )


def with_era(events: DataFrame) -> DataFrame:
    """``events`` as ``restarts.with_eras`` returns them (a run without restarts: all era 0)."""
    if "era" in events.columns:
        return events
    return events.withColumn("era", F.lit(0).cast("long"))


def applied(events: DataFrame) -> DataFrame:
    return (
        with_era(events)
        .where(~F.col("type").isin(*NOT_APPLIED))
        .select("era", "seq", "member", "incarnation", "t_ns", "sender", "type", "conn", "size")
    )


def replica_name(member: Any, incarnation: Any) -> str:
    """How reports name one replica's stream: the member id, and for a member that rejoined
    in the same process (after losing quorum) ``<member>#<incarnation>``."""
    return str(member) if not incarnation or incarnation == 1 else f"{member}#{incarnation}"


def _compared(events: DataFrame) -> DataFrame:
    """Every applied event with: does any member disagree at its seq, how far behind the first
    member this one applied it, is it a second record of this member at that seq."""
    # A 64-bit hash stands for the event: two different events collide with odds of 2^-64.
    fp = F.xxhash64("sender", "type", F.coalesce("conn", F.lit(-1)), F.coalesce("size", F.lit(0)))
    # One partitioning and ordering for all three, so Spark shuffles and sorts once. A replica
    # is one incarnation of a member: each has its own stream (see replica_name). Events of
    # different eras that share a sequence number are different events.
    ordered = Window.partitionBy("era", "seq").orderBy("member", "incarnation")
    whole = ordered.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    replica = F.struct("member", "incarnation")
    return (
        applied(events)
        .select("*", fp.alias("fp"))
        .select(
            "era",
            "seq",
            "member",
            "incarnation",
            "t_ns",
            "sender",
            "type",
            "conn",
            "size",
            (F.min("fp").over(whole) != F.max("fp").over(whole)).alias("div"),
            (F.col("t_ns") - F.min("t_ns").over(whole)).alias("lag_ns"),
            F.coalesce(F.lag(replica).over(ordered) == replica, F.lit(False)).alias("dup"),
        )
    )


def total_order(
    spark: SparkSession, events: DataFrame, tables: str
) -> tuple[dict[str, Any], list[dict[str, Any]], DataFrame | None]:
    """The total-order check; also the per-second, per-member table (events, bytes, lag).

    Returns the summary, the per-second rows (small: for plots) and the divergent events
    as violations (None when there are none)."""
    c = _compared(events)
    lag_ms = F.col("lag_ns") / NS_PER_MS
    # A replica lives in one era: grouping by it too only carries it to the rows.
    per_second = c.groupBy(second("t_ns").alias("sec"), "member", "incarnation", "era").agg(
        F.count(F.lit(1)).alias("events"),
        F.sum(F.coalesce("size", F.lit(0))).alias("bytes"),
        F.sum(F.col("dup").cast("long")).alias("dups"),
        F.sum(F.col("div").cast("long")).alias("div_rows"),
        F.min(F.when(F.col("div"), F.col("seq"))).alias("first_div"),
        F.min("seq").alias("seq_min"),
        F.max("seq").alias("seq_max"),
        F.percentile_approx(lag_ms, [0.5, 0.99], ACCURACY).alias("lag_ms"),
        F.max(lag_ms).alias("lag_max_ms"),
    )
    per_second.write.mode("overwrite").parquet(f"{tables}/member_seconds")
    secs = rows(
        spark.read.parquet(f"{tables}/member_seconds").orderBy("sec", "member", "incarnation")
    )
    members: dict[str, dict[str, Any]] = {}
    div_rows = 0
    first_div: tuple[int, int] | None = None  # (era, seq)
    for r in secs:
        m = members.setdefault(
            replica_name(r["member"], r["incarnation"]),
            {
                "era": r["era"],
                "first_seq": r["seq_min"],
                "last_seq": r["seq_max"],
                "records": 0,
                "duplicates": 0,
            },
        )
        m["first_seq"] = min(m["first_seq"], r["seq_min"])
        m["last_seq"] = max(m["last_seq"], r["seq_max"])
        m["records"] += r["events"]
        m["duplicates"] += r["dups"]
        div_rows += r["div_rows"]
        if r["first_div"] is not None:
            here = (r["era"], r["first_div"])
            first_div = here if first_div is None else min(first_div, here)
    gaps = 0
    for m in members.values():
        distinct = m["records"] - m["duplicates"]
        m["gaps"] = m["last_seq"] - m["first_seq"] + 1 - distinct
        gaps += m["gaps"]
    eras = _eras(members)
    dups = sum(m["duplicates"] for m in members.values())
    summary: dict[str, Any] = {
        "status": "pass" if not (div_rows or gaps or dups) else "fail",
        "members": members,
        # Of the last era's replicas (the only era of a run without a whole-cluster restart).
        "overlap_all_members": eras[-1]["overlap"] if eras else None,
        "eras": eras,
        "divergent_records": div_rows,
        "gaps": gaps,
        "duplicates": dups,
        "first_divergence": None,
    }
    if not members:
        summary["status"] = "skipped"
        summary["reason"] = "the event logs hold no applied event"
    bad: DataFrame | None = None
    if div_rows:
        divergent = c.where(F.col("div"))
        detail = F.format_string(
            "%ssender=%s type=%s conn=%s size=%s",
            _era_prefix(),
            F.col("sender"),
            F.col("type"),
            F.coalesce(F.col("conn").cast("string"), F.lit("-")),
            F.coalesce(F.col("size").cast("string"), F.lit("0")),
        )
        bad = violations(
            divergent, "total_order", seq="seq", member=F.col("member"), t_ns="t_ns", detail=detail
        )
        assert first_div is not None
        era, seq = first_div
        summary["first_divergence"] = {
            "seq": seq,
            "era": era,
            "events_around": around(events, seq - AROUND, seq + AROUND, era),
        }
    return summary, secs, bad


def _eras(members: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per era: its replicas, the events they logged and the range all of them share."""
    out = []
    for era in sorted({m["era"] for m in members.values()}):
        ms = {name: m for name, m in members.items() if m["era"] == era}
        lo = max(m["first_seq"] for m in ms.values())
        hi = min(m["last_seq"] for m in ms.values())
        out.append(
            {
                "era": era,
                "replicas": sorted(ms),
                "first_seq": min(m["first_seq"] for m in ms.values()),
                "last_seq": max(m["last_seq"] for m in ms.values()),
                "overlap": [lo, hi] if len(ms) >= 2 and lo <= hi else None,
            }
        )
    return out


def _era_prefix() -> Column:
    """``era k: `` for a violation after the ``k``-th restart (nothing in era 0)."""
    return F.when(F.col("era") > 0, F.format_string("era %d: ", F.col("era"))).otherwise("")


def around(events: DataFrame, lo: int, hi: int, era: int = 0) -> list[dict[str, Any]]:
    """The applied events of ``era`` with lo <= seq <= hi, of every member (a few rows)."""
    return rows(
        applied(events)
        .where(F.col("seq").between(lo, hi) & (F.col("era") == era))
        .select("seq", "member", "sender", "type", "conn", "size", "t_ns")
        .orderBy("seq", "member"),
        limit=(hi - lo + 1) * 64,
    )


def replica_consistency(
    spark: SparkSession, events: DataFrame, tables: str
) -> tuple[dict[str, Any], DataFrame | None]:
    """Every digest checkpoint agrees among the members that reached it; no verdict says
    otherwise."""
    events = with_era(events)
    cps = (
        events.where(F.col("type") == "checkpoint")
        .groupBy("era", "seq")
        .agg(
            F.count_distinct("member").alias("members"),
            F.count_distinct("digest").alias("digests"),
            F.sort_array(F.collect_set(F.struct("member", "digest"))).alias("votes"),
        )
        .select("*", (F.col("digests") == 1).alias("agreed"))
    )
    cps.write.mode("overwrite").parquet(f"{tables}/checkpoints")
    cps = spark.read.parquet(f"{tables}/checkpoints")
    s = cps.agg(
        F.count(F.lit(1)).alias("checkpoints"),
        F.sum((F.col("members") >= 2).cast("long")).alias("compared"),
        F.sum((~F.col("agreed")).cast("long")).alias("divergent"),
        F.min(F.when(~F.col("agreed"), F.struct("era", "seq"))).alias("first"),
    ).collect()[0]
    disagreed = events.where((F.col("type") == "verdict") & ~F.col("agreed"))
    v = disagreed.agg(
        F.count(F.lit(1)).alias("n"), F.min(F.struct("era", "seq")).alias("first")
    ).collect()[0]
    checkpoints = int(s["checkpoints"] or 0)
    divergent = int(s["divergent"] or 0)
    verdicts = int(v["n"] or 0)
    summary: dict[str, Any] = {
        "status": "pass" if not (divergent or verdicts) else "fail",
        "checkpoints": checkpoints,
        "compared": int(s["compared"] or 0),
        "divergent": divergent,
        "disagreeing_verdicts": verdicts,
        "first_divergence": None,
    }
    if not checkpoints and not verdicts:
        summary["status"] = "skipped"
        summary["reason"] = "the event logs hold no digest checkpoint: the run was too short"
    if not (divergent or verdicts):
        return summary, None
    firsts = [(int(x["era"]), int(x["seq"])) for x in (s["first"], v["first"]) if x is not None]
    era, first = min(firsts)
    here = (F.col("era") == era) & (F.col("seq") == first)
    votes = rows(cps.where(here).select("votes"))
    by_digest: dict[str, list[str]] = {}
    for vote in votes[0]["votes"] if votes else []:
        by_digest.setdefault(vote["digest"], []).append(str(vote["member"]))
    prev = (
        cps.where((F.col("era") == era) & (F.col("seq") < first) & F.col("agreed"))
        .agg(F.max("seq"))
        .collect()[0][0]
    )
    summary["first_divergence"] = {
        "seq": first,
        "era": era,
        "members_by_digest": by_digest,
        "verdicts": rows(
            disagreed.where(here).select("member", "losers", "digests"),
            limit=64,
        ),
        "last_agreed_checkpoint": prev,
        "events_around": around(events, first - 2 * AROUND, first, era),
    }
    bad_cps = cps.where(~F.col("agreed")).select("era", "seq", F.explode("votes").alias("v"))
    bad = violations(
        bad_cps,
        "replica_divergence",
        seq="seq",
        member=F.col("v.member"),
        detail=F.concat(_era_prefix(), F.lit("digest="), F.col("v.digest")),
    ).unionByName(
        violations(
            disagreed,
            "replica_divergence",
            seq="seq",
            member=F.col("member"),
            t_ns="t_ns",
            detail=F.concat(
                _era_prefix(), F.lit("verdict disagreed; losers="), F.to_json("losers")
            ),
        )
    )
    return summary, bad

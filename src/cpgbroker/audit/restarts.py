"""Whole-cluster restarts, from the members' event logs: when every member stopped (killed or
stopped) and the cluster came back from the freshest member's durable store.

Theory of operation
-------------------
A member process that starts again is a new member (its id holds its pid) appending to the
same event log. When no member is left running, the members that start again resume the
freshest store: that member applies ``member-left`` for every former member that had clients,
then ``recovered`` (the event that drops what a restart drops: transient messages,
non-durable queues), then a tick; the others take a state update from it. Its stream goes on
from the event its store held (``recovered_seq``), which may be *before* the last event the
members logged before they died: what no store held yet is forgotten, and the sequence
numbers after ``recovered_seq`` name other events from then on.

So a run is cut into **eras**: era 0 up to the first restart, era ``k`` after the ``k``-th.
Every replica (one incarnation of one member) lives in exactly one era: all members of an era
were gone before the next began, so a replica's era is the number of ``recovered`` events
applied no later than its last record. The total-order and checkpoint comparisons pair events
of one era only (``events.py``); the delivery checks learn from each restart which messages it
may have dropped and which redeliveries it may have left unflagged (``delivery.py``).

The driver receives one row per replica and per restart, never a stream.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import attrs
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from cpgbroker.audit.common import NS_PER_S, rows
from cpgbroker.audit.events import replica_name
from cpgbroker.audit.schemas import DISRUPTIVE, NOT_APPLIED, RECOVERED

# More restarts than this in one run are not told apart (each costs a term in an expression).
MAX_RESTARTS = 1_000
# Replicas (member process incarnations) the driver takes: one per process start or rejoin.
MAX_REPLICAS = 100_000


@attrs.frozen
class Restart:
    """One whole-cluster restart: the cluster served again from ``member``'s store."""

    era: int  # the era it begins (1 for the first restart)
    t_ns: int  # when the resumed member applied ``recovered``: the cluster serves again
    seq: int  # the ``recovered`` event
    recovered_seq: int  # the last event the resumed store held: the state the cluster resumed
    member: int  # whose store was resumed
    incarnation: int
    replicas: tuple[str, ...]  # the replicas of the era it begins
    # The previous era, as far as its logs tell (a member killed with SIGKILL loses the records
    # it had not written out yet): its last event, its last record of any kind, and when it
    # applied ``recovered_seq`` (or, if no log reached it, its last event before it).
    previous_last_seq: int | None
    previous_last_record_ns: int | None
    state_applied_ns: int | None
    # The last fault of the fault log that took a member away after that last record.
    last_fault_ns: int | None

    @property
    def down_from_ns(self) -> int | None:
        """When the last member of the previous era was gone, as far as the inputs tell."""
        known = [t for t in (self.previous_last_record_ns, self.last_fault_ns) if t is not None]
        return max(known) if known else None

    @property
    def down_s(self) -> float | None:
        down = self.down_from_ns
        return None if down is None else round((self.t_ns - down) / NS_PER_S, 3)

    @property
    def rolled_back(self) -> int:
        """Events the previous era logged after the resumed state: forgotten by the restart."""
        if self.previous_last_seq is None:
            return 0
        return max(0, self.previous_last_seq - self.recovered_seq)

    def describe(self) -> str:
        down = self.down_s
        text = f"whole-cluster restart at {iso(self.t_ns)}: " + (
            f"down for {down:.1f} s" if down is not None else "down since an unknown time"
        )
        text += f", recovered event {self.recovered_seq} from member {self.member}'s store"
        if self.previous_last_seq is None:
            text += " (the members before it left no event in their logs)"
        elif self.rolled_back:
            text += (
                f" (the members before it had logged up to event {self.previous_last_seq}: "
                f"{self.rolled_back} events after the recovered one were in no store)"
            )
        elif self.previous_last_seq < self.recovered_seq:
            text += (
                f" (the logs before it end at event {self.previous_last_seq}: what the members "
                "applied after that was not written out when they died)"
            )
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            **attrs.asdict(self),
            "replicas": list(self.replicas),
            "down_from_ns": self.down_from_ns,
            "down_s": self.down_s,
            "rolled_back": self.rolled_back,
            "summary": self.describe(),
        }


def iso(t_ns: int) -> str:
    """A wall-clock timestamp for people (UTC, milliseconds)."""
    t = datetime.datetime.fromtimestamp(t_ns / NS_PER_S, tz=datetime.UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _era_of_time(t: Column, restart_times: Sequence[int]) -> Column:
    """How many restarts had happened by ``t``."""
    era: Column = F.lit(0).cast("long")
    for t_r in restart_times:
        era = era + F.when(t >= F.lit(t_r), 1).otherwise(0)
    return era


def with_eras(
    spark: SparkSession, events: DataFrame, faults: Sequence[dict[str, Any]] = ()
) -> tuple[DataFrame, list[Restart]]:
    """``events`` with an ``era`` column, and the whole-cluster restarts that cut them."""
    found = rows(
        events.where(F.col("type").isin(*RECOVERED))
        .select("seq", "t_ns", "member", "incarnation")
        .orderBy("t_ns", "member"),
        limit=MAX_RESTARTS,
    )
    if not found:
        return events.withColumn("era", F.lit(0).cast("long")), []
    times = [int(r["t_ns"]) for r in found]
    applied = ~F.col("type").isin(*NOT_APPLIED)
    spans = rows(
        events.groupBy("member", "incarnation").agg(
            F.min(F.when(applied, F.col("seq"))).alias("first_seq"),
            F.max(F.when(applied, F.col("seq"))).alias("last_seq"),
            F.max(F.when(applied, F.col("t_ns"))).alias("last_applied_ns"),
            F.max("t_ns").alias("last_ns"),
        ),
        limit=MAX_REPLICAS,
    )

    def era_of(t: int) -> int:
        return sum(1 for t_r in times if t_r <= t)

    era: dict[tuple[int, int], int] = {}
    for s in spans:
        t_last = s["last_applied_ns"] if s["last_applied_ns"] is not None else s["last_ns"]
        era[(s["member"], s["incarnation"])] = era_of(t_last)
    eras = spark.createDataFrame(
        [(m, i, e) for (m, i), e in era.items()],
        "member long, incarnation long, era long",
    )
    out = events.join(F.broadcast(eras), ["member", "incarnation"], "left").withColumn(
        "era", F.coalesce(F.col("era"), _era_of_time(F.col("t_ns"), times))
    )

    # Per restart: where the previous era stood at the state the restart resumed.
    first_seq = {(s["member"], s["incarnation"]): s["first_seq"] for s in spans}
    resumed = {
        k + 1: int(first_seq.get((r["member"], r["incarnation"])) or r["seq"]) - 1
        for k, r in enumerate(found)
    }
    at_state = {
        int(r["era"]): r
        for r in rows(
            events.where(applied)
            .join(F.broadcast(eras), ["member", "incarnation"])
            .join(
                F.broadcast(
                    spark.createDataFrame(
                        [(k - 1, s) for k, s in resumed.items()], "era long, state long"
                    )
                ),
                "era",
            )
            .groupBy("era")
            .agg(
                F.min(F.when(F.col("seq") == F.col("state"), F.col("t_ns"))).alias("at"),
                F.max(F.when(F.col("seq") <= F.col("state"), F.col("t_ns"))).alias("before"),
            )
        )
    }
    restarts = []
    for k, r in enumerate(found, start=1):
        prev = [s for s in spans if era[(s["member"], s["incarnation"])] == k - 1]
        last_seqs = [s["last_seq"] for s in prev if s["last_seq"] is not None]
        last_ns = max((s["last_ns"] for s in prev), default=None)
        t_r = int(r["t_ns"])
        state = at_state.get(k - 1)
        applied_ns = None
        if state is not None:
            applied_ns = state["at"] if state["at"] is not None else state["before"]
        fault_ns = max(
            (
                int(f["t_ns"])
                for f in faults
                if f["action"] in DISRUPTIVE
                and f["t_ns"] < t_r
                and (last_ns is None or f["t_ns"] > last_ns)
                and (k == 1 or f["t_ns"] > times[k - 2])
            ),
            default=None,
        )
        restarts.append(
            Restart(
                era=k,
                t_ns=t_r,
                seq=int(r["seq"]),
                recovered_seq=resumed[k],
                member=int(r["member"]),
                incarnation=int(r["incarnation"]),
                replicas=tuple(replica_name(m, i) for (m, i), e in sorted(era.items()) if e == k),
                previous_last_seq=max(last_seqs) if last_seqs else None,
                previous_last_record_ns=last_ns,
                state_applied_ns=applied_ns,
                last_fault_ns=fault_ns,
            )
        )
    return out, restarts

"""The audit's three inputs as Spark schemas, with the fields each record must have.

``docs/audit.md`` documents them for people; this module is what the job enforces. A line
that is not a JSON object of its schema (wrong types included), or lacks a required field, is
malformed (see ``ingest.py`` for what happens to it).
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

# How a validity rule reaches a field: F.col for a flat frame, or a struct's field.
Field = Callable[[str], Column]

# Holds the raw line when a record does not parse (from_json's PERMISSIVE mode).
CORRUPT = "_corrupt"

# -- member event logs (written by runtime/member/member.py: see docs/operations.md "Event log")
EVENT_SCHEMA = T.StructType(
    [
        T.StructField("seq", T.LongType()),
        T.StructField("t_ns", T.LongType()),
        T.StructField("member", T.LongType()),
        # Absent in logs of builds before quorum support: read as 1.
        T.StructField("incarnation", T.LongType()),
        T.StructField("sender", T.LongType()),
        T.StructField("type", T.StringType()),
        T.StructField("conn", T.LongType()),
        T.StructField("size", T.LongType()),
        T.StructField("status", T.StringType()),
        T.StructField("digest", T.StringType()),
        T.StructField("agreed", T.BooleanType()),
        T.StructField("losers", T.ArrayType(T.LongType())),
        T.StructField("digests", T.MapType(T.StringType(), T.StringType())),
    ]
)
# Records that are not an event applied to the model: a hello is logged with the sequence
# number of the event before it, checkpoints and verdicts are about the stream, not in it, and
# a suspend (quorum lost) carries the last event the member applied before it stopped; an
# error names the event a member failed to apply or record, an error-check the decided round
# about it, and a stop the event at which a stop request stopped the member.
NOT_APPLIED = ("hello", "checkpoint", "verdict", "suspend", "error", "error-check", "stop")
# The event a member applies once when the cluster resumes a store after every member
# stopped (a whole-cluster restart); logged under its class name before it had a type name.
RECOVERED = ("recovered", "Recovered")
# Records that carry nothing more than type, seq, t_ns and member are required to.
_BARE = ("hello", "suspend", "error", "error-check", "stop")

# -- client operation histories (written by cpgbroker.audit.history.HistoryRecorder)
HISTORY_SCHEMA = T.StructType(
    [
        T.StructField("op", T.StringType()),
        T.StructField("client", T.StringType()),
        T.StructField("n", T.LongType()),
        T.StructField("t_ns", T.LongType()),
        T.StructField("session", T.LongType()),
        T.StructField("member", T.StringType()),
        T.StructField("reason", T.StringType()),
        T.StructField("producer", T.StringType()),
        T.StructField("seq", T.LongType()),
        T.StructField("queue", T.StringType()),
        T.StructField("confirms", T.BooleanType()),
        # Absent in histories of recorders before whole-cluster restarts: not known, so the
        # audit takes the message to be one a restart must keep (see delivery.py, "lost").
        T.StructField("persistent", T.BooleanType()),
        T.StructField("durable", T.BooleanType()),
        T.StructField("outcome", T.StringType()),
        T.StructField("consumer", T.StringType()),
        T.StructField("redelivered", T.BooleanType()),
        T.StructField("requeue", T.BooleanType()),
    ]
)
HISTORY_OPS = ("connect", "disconnect", "publish", "confirm", "deliver", "ack", "nack")
OUTCOMES = ("ack", "nack", "unknown")

# -- fault-injection logs (written by devcluster.DevCluster.record_fault)
FAULT_SCHEMA = T.StructType(
    [
        T.StructField("t_ns", T.LongType()),
        T.StructField("action", T.StringType()),
        T.StructField("node", T.LongType()),
        T.StructField("url", T.StringType()),
        T.StructField("member", T.LongType()),
    ]
)
# Actions that take a member away, and the ones that bring it back.
DISRUPTIVE = ("kill", "kill-broker", "stop", "partition", "restart")
RECOVERING = ("resume", "heal", "start", "start-broker")
FAULT_ACTIONS = (*DISRUPTIVE, *RECOVERING)


def _present(c: Field, *names: str) -> Column:
    cond = F.lit(True)
    for name in names:
        cond = cond & c(name).isNotNull()
    return cond


def event_valid(c: Field = F.col) -> Column:
    """Every record has type, seq, t_ns and member; applied events a sender; checkpoints a
    digest; verdicts their result (the records in ``_BARE`` nothing more)."""
    t = c("type")
    return _present(c, "type", "seq", "t_ns", "member") & (
        F.when(t == "checkpoint", _present(c, "digest"))
        .when(t == "verdict", _present(c, "agreed"))
        .when(t.isin(*_BARE), F.lit(True))
        .otherwise(_present(c, "sender"))
    )


def history_valid(c: Field = F.col) -> Column:
    op = c("op")
    msg = _present(c, "producer", "seq")
    return _present(c, "op", "client", "n", "t_ns", "session") & (
        F.when(op == "connect", _present(c, "member"))
        .when(op == "disconnect", F.lit(True))
        .when(op == "publish", msg & _present(c, "queue"))
        .when(op == "confirm", msg & c("outcome").isin(*OUTCOMES))
        .when(op == "deliver", msg & _present(c, "queue", "consumer", "redelivered"))
        .when(op.isin("ack", "nack"), msg)
        .otherwise(F.lit(False))
    )


def fault_valid(c: Field = F.col) -> Column:
    return _present(c, "t_ns", "node") & c("action").isin(*FAULT_ACTIONS)


# Every kind of input: its schema, its validity rule, and the file names it is found by in a
# directory.
KINDS: dict[str, tuple[T.StructType, Callable[[Field], Column], str]] = {
    "events": (EVENT_SCHEMA, event_valid, "*.events.jsonl"),
    "history": (HISTORY_SCHEMA, history_valid, "*.history.jsonl"),
    "faults": (FAULT_SCHEMA, fault_valid, "*faults.jsonl"),
}
# How a record starts (the first key each writer puts first): after a torn line (a writer
# died mid-line and a restarted one appended to the same file) the whole record that follows
# the partial one is recognised by this.
RECORD_START = r'\{"(?:seq|type|op|t_ns)":'
